"""``restore``: a checkpoint into a local directory, verified and atomic (a thin layer over
``cloudckpt.restore``; docs/cli.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from cloudckpt.cli._common import (
    RUN_URL,
    StoreArgs,
    emit_json,
    human_bytes,
    json_option,
    progress_bar,
    store_options,
)
from cloudckpt.cli._main import cli

if TYPE_CHECKING:
    from cloudckpt.stores import RunURL, Store


@cli.command("restore")
@click.argument("url", type=RUN_URL)
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--step", type=int, help="Restore this step (default: the newest intact one).")
@click.option("--force", is_flag=True, help="Replace DEST's contents if it is not empty.")
@click.option(
    "--include",
    multiple=True,
    metavar="PATTERN",
    help="Restore only the files matching PATTERN (repeatable): a path, a glob "
    "('*.safetensors'; * matches / too) or a directory ending in /.",
)
@click.option(
    "--exclude",
    multiple=True,
    metavar="PATTERN",
    help="Leave out the files matching PATTERN (repeatable; after --include).",
)
@store_options
@json_option
def restore_cmd(
    url: RunURL,
    dest: Path,
    step: int | None,
    force: bool,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    store_args: StoreArgs,
    as_json: bool,
) -> None:
    """Download and verify a checkpoint into DEST, atomically.

    Files land in a temporary directory beside DEST and are moved into place only after every
    byte matched its digest; if the newest checkpoint is damaged, the next older one is
    restored and the fallback reported. Read-only: it never claims the run. With --include
    or --exclude only the selected files are read (each verified the same way); the
    others are named as left out.
    """
    from cloudckpt.restore import restore
    from cloudckpt.transfer import TransferEngine

    started = time.perf_counter()
    partial = bool(include or exclude)
    with (
        store_args.open(url, writable=False) as store,
        TransferEngine() as engine,
        progress_bar(
            f"restoring {store.url}", None if partial else _restore_size(store, step)
        ) as progress,
    ):
        result = restore(
            store,
            dest,
            engine,
            step=step,
            overwrite=force,
            progress=progress,
            include=include,
            exclude=exclude,
        )
    elapsed = time.perf_counter() - started
    doc = {
        "url": store.url,
        "step": result.step,
        "path": str(result.path),
        "commit_id": result.commit_id,
        "ckpt": result.ckpt,
        "epoch": result.epoch,
        "num_files": result.num_files,
        "total_bytes": result.total_bytes,
        "metadata": dict(result.metadata),
        "skipped": [
            {"step": s.step, "commit_id": s.commit_id, "reason": s.reason, "dropped": s.dropped}
            for s in result.skipped
        ],
        "from_commit_records": result.from_commit_records,
        "excluded": list(result.excluded),
        "seconds": round(elapsed, 3),
    }
    # Each skip was warned about on stderr as it happened (one warning per fallback).
    if as_json:
        emit_json(doc)
        return
    click.echo(
        f"restored step {result.step} ({result.commit_id}) to {result.path}: "
        f"{result.num_files} files, {human_bytes(result.total_bytes)} in {elapsed:.1f}s, verified"
        + (f" (after skipping {len(result.skipped)} damaged)" if result.skipped else "")
    )
    if result.excluded:
        names = list(result.excluded)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        click.echo(f"  left out by --include/--exclude, not read: {len(names)} file(s): {shown}")


def _restore_size(store: Store, step: int | None) -> int | None:
    """The size of the checkpoint a restore tries first, for its progress bar; None when
    LATEST is missing or damaged (the restore itself reports that, once)."""
    from cloudckpt.committer import read_latest
    from cloudckpt.protocol import CorruptRecordError
    from cloudckpt.reader import candidates

    try:
        head = read_latest(store)
    except CorruptRecordError:
        return None
    todo = candidates(head.latest, step) if head is not None else []
    return todo[0].total_bytes if todo else None
