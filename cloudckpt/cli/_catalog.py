"""The catalog commands: ``runs``, ``cp``, ``get``, ``export``, ``digest``, ``diff`` (a thin
layer over ``cloudckpt.catalog``; docs/cli.md)."""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from cloudckpt.canonical import parse_iso
from cloudckpt.cli._common import (
    NEWER_FORMAT,
    RUN_URL,
    StoreArgs,
    emit_json,
    human_bytes,
    info,
    json_option,
    progress_bar,
    report_error,
    stdout_console,
    store_options,
    warn,
)
from cloudckpt.cli._main import cli
from cloudckpt.cli._table import age
from cloudckpt.errors import ConfigurationError, UnknownFormatError
from cloudckpt.stores import RunURL, parse_url


def _ago(iso_time: str) -> str:
    """How long ago ``iso_time`` was (``5m ago``), or the time itself if it is unreadable."""
    try:
        seconds = time.time() - parse_iso(iso_time).timestamp()
    except ValueError:
        return iso_time
    return iso_time if seconds < 0 else f"{age(seconds)} ago"


def _skipped(skipped: Any) -> list[dict[str, Any]]:
    """The checkpoints a read skipped, as JSON. A damaged one was warned about as it was
    skipped (the library's one warning, in the CLI's style: ``setup_logging``); one
    dropped meanwhile by retention, which the library does not warn about, is said here."""
    for s in skipped:
        if s.dropped:
            warn(f"skipped step {s.step} ({s.commit_id}): {s.reason}")
    return [
        {"step": s.step, "commit_id": s.commit_id, "reason": s.reason, "dropped": s.dropped}
        for s in skipped
    ]


# ---------------------------------------------------------------------------- destination flags


def dest_store_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The storage flags of a second store (``cp``'s and ``export``'s DEST); the command
    receives them as ``dest_args`` (None when none was given)."""

    @click.option(
        "--dest-endpoint-url",
        metavar="URL",
        help="Endpoint of DEST's store (as --endpoint-url is SRC's).",
    )
    @click.option("--dest-profile", metavar="NAME", help="AWS profile for DEST (s3:// only).")
    @click.option("--dest-region", metavar="REGION", help="AWS region for DEST (s3:// only).")
    @click.option(
        "--dest-option",
        "dest_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="A storage option for DEST (repeatable), as -o is for SRC.",
    )
    @functools.wraps(f)
    def wrapper(
        *args: Any,
        dest_endpoint_url: str | None,
        dest_profile: str | None,
        dest_region: str | None,
        dest_option: tuple[str, ...],
        **kwargs: Any,
    ) -> Any:
        given = dest_endpoint_url or dest_profile or dest_region or dest_option
        kwargs["dest_args"] = (
            StoreArgs(dest_endpoint_url, dest_profile, dest_region, dest_option, False)
            if given
            else None
        )
        return f(*args, **kwargs)

    return wrapper


def _dest_options(
    src: RunURL, dst: RunURL, src_args: StoreArgs, dest_args: StoreArgs | None
) -> dict[str, Any]:
    """DEST's storage options: its own flags (``--dest-*``) if any was given, else SRC's
    flags when both URLs have the same scheme (two buckets of one store), else none (the
    environment's)."""
    if dest_args is not None:
        return dest_args.storage_options(dst)
    if src.scheme == dst.scheme:
        return src_args.storage_options(dst)
    return {}


# ---------------------------------------------------------------------------- runs


@cli.command("runs")
@click.argument("url", type=RUN_URL)
@click.option(
    "--depth",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="How many directories below URL to look for runs.",
)
@store_options
@json_option
def runs_cmd(url: RunURL, depth: int, store_args: StoreArgs, as_json: bool) -> None:
    """List the runs at and below URL: current step, size, what each stores, age, status.

    "stored" is every byte of the run's objects (what the store bills); "awaiting gc" the
    part no retained checkpoint references (dropped checkpoints, orphan and interrupted
    attempts; in how many attempt prefixes), which `cloudckpt gc` deletes once older than
    the grace period. One listing per directory (a delimiter listing on S3, GCS and
    Azure), then for each run one read of its LATEST and one listing of its objects;
    read-only. A run whose LATEST is missing or damaged is listed as needs-repair; one a
    newer cloudckpt wrote as newer-format, and the command then exits 10 after listing.
    """
    from cloudckpt.catalog import list_runs

    with store_args.open(url, writable=False) as store:
        runs = list_runs(store, depth=depth)
        where = store.url
    doc: dict[str, Any] = {"url": where, "depth": depth, "runs": [r.to_dict() for r in runs]}
    newer = _newer_runs_error(runs)
    if as_json and newer is not None:
        # One document, the listing and why the exit code is 10, as every command says it.
        report_error(newer, NEWER_FORMAT, doc)
        raise click.exceptions.Exit(NEWER_FORMAT)
    if as_json:
        emit_json(doc)
    elif not runs:
        info(f"{where}: no runs at or below it (within {depth} directories)")
    else:
        _print_runs(where, runs)
    if newer is not None:
        raise newer


def _newer_runs_error(runs: list[Any]) -> UnknownFormatError | None:
    """Every run is listed; if a newer cloudckpt wrote some, the command then exits 10 as
    every command does on a format it does not know (a script must not take the listing
    for complete)."""
    from cloudckpt.catalog.runs import NEWER_FORMAT as NEWER_STATUS

    newer = [r for r in runs if r.status == NEWER_STATUS]
    if not newer:
        return None
    names = ", ".join(r.path or "." for r in newer)
    return UnknownFormatError(
        f"{len(newer)} of the {len(runs)} runs listed ({names}) were written by a newer "
        f"cloudckpt; this one shows only what they store ({newer[0].problem})",
        what="runs",
    )


def _print_runs(where: str, runs: list[Any]) -> None:
    from rich.text import Text

    from cloudckpt.cli._table import new_table

    console = stdout_console()
    console.print(Text(f"{where}  ·  {len(runs)} run(s)", style="bold"))
    table = new_table()
    for name, justify in (
        ("run", "left"),
        ("step", "right"),
        ("size", "right"),
        ("kept", "right"),
        ("stored", "right"),
        ("awaiting gc", "right"),
        ("updated", "left"),
        ("status", "left"),
    ):
        table.add_column(name, justify=justify)
    for r in runs:
        table.add_row(
            r.path or ".",
            "" if r.step is None else str(r.step),
            "" if r.total_bytes is None else human_bytes(r.total_bytes),
            str(r.retained),
            "" if r.stored_bytes is None else human_bytes(r.stored_bytes),
            _awaiting_gc(r),
            "" if r.updated_at is None else _ago(r.updated_at),
            r.status if r.problem is None else f"{r.status}: {r.problem}",
        )
    console.print(table)


def _awaiting_gc(run: Any) -> str:
    """``1.5 GiB (3)``: the bytes no retained checkpoint references, in how many attempts;
    ``?`` when unknown."""
    if run.unreferenced_bytes is None:
        return "" if run.status == "needs-repair" else "?"
    if not run.unreferenced_attempts:
        return "0 B"
    return f"{human_bytes(run.unreferenced_bytes)} ({run.unreferenced_attempts})"


# ---------------------------------------------------------------------------- cp


@cli.command("cp")
@click.argument("src", type=RUN_URL)
@click.argument("dest", type=RUN_URL)
@click.option("--step", type=int, help="Copy this step (default: the newest intact one).")
@click.option("--to-step", type=int, help="Commit it at DEST as this step (default: the same).")
@click.option(
    "--force",
    is_flag=True,
    help="Claim DEST even though its writer wrote LATEST within the last hour.",
)
@click.option(
    "--keep-settings",
    is_flag=True,
    help="Give DEST the retention settings of SRC (keep-last, keep-every, keep-best, "
    "periods; not its gc grace). Default: DEST keeps its own (a new run: the defaults).",
)
@store_options
@dest_store_options
@json_option
def cp_cmd(
    src: RunURL,
    dest: RunURL,
    step: int | None,
    to_step: int | None,
    force: bool,
    keep_settings: bool,
    store_args: StoreArgs,
    dest_args: StoreArgs | None,
    as_json: bool,
) -> None:
    """Copy a committed checkpoint of the run SRC into the run DEST, verified.

    DEST may be on another store (s3:// -> gs://, a bucket -> a local directory). The copy
    is committed through DEST's own LATEST, where it becomes the current checkpoint, with
    its metadata and metrics; chunks DEST already holds are not sent again, and a
    checkpoint DEST already holds as that step, with the same content, is not copied again
    (it says so). Like push, cp claims DEST and fences its writer:
    if that writer wrote LATEST within the last hour it is probably still training, and cp
    refuses (exit 5) unless --force. Storage flags apply to SRC; --dest-* ones to DEST
    (without them DEST takes SRC's flags when both URLs have the same scheme).
    """
    from cloudckpt.catalog import copy_checkpoint

    dest_options = _dest_options(src, dest, store_args, dest_args)
    with (
        store_args.open(src, writable=False) as source,
        progress_bar(f"copying {source.url}", None) as progress,
    ):
        result = copy_checkpoint(
            source,
            dest,
            step=step,
            dest_step=to_step,
            force=force,
            keep_settings=keep_settings,
            dest_options=dest_options,
            progress=progress,
        )
    doc = dataclasses.asdict(result)
    doc["fenced_writer"] = result.fenced_writer.to_dict() if result.fenced_writer else None
    doc["skipped"] = _skipped(result.skipped)
    if result.fenced_writer is not None and result.fenced_writer.may_be_live:
        w = result.fenced_writer
        warn(f"cp claimed {result.dest}: writer {w.id} (epoch {w.epoch}) is fenced from now on")
    if as_json:
        emit_json(doc)
        return
    if result.noop:
        click.echo(
            f"{result.dest} already holds step {result.step} of {result.source} as step "
            f"{result.dest_step} ({result.dest_commit_id}), with the same files, metadata "
            "and metrics: nothing copied"
        )
        return
    click.echo(
        f"copied step {result.step} of {result.source} to {result.dest} as step "
        f"{result.dest_step} ({result.dest_commit_id}): {result.num_files} files, "
        f"{human_bytes(result.total_bytes)}, verified, in {result.seconds:.1f}s"
    )
    resumed = (
        f" ({human_bytes(result.bytes_resumed)} from an interrupted copy)"
        if result.bytes_resumed
        else ""
    )
    click.echo(
        f"  read {human_bytes(result.bytes_read)}, uploaded {human_bytes(result.bytes_uploaded)}, "
        f"reused {human_bytes(result.bytes_reused)} already at the destination{resumed}"
    )
    if result.settings_copied:
        click.echo(f"  {result.dest} now keeps checkpoints by the retention settings of SRC")


# ---------------------------------------------------------------------------- get


@cli.command("get")
@click.argument("url", type=RUN_URL)
@click.argument("args", nargs=-1, required=True, metavar="PATH... [DEST]")
@click.option("--step", type=int, help="From this step (default: the newest intact one).")
@click.option("--force", is_flag=True, help="Replace files at DEST that exist.")
@store_options
@json_option
def get_cmd(
    url: RunURL,
    args: tuple[str, ...],
    step: int | None,
    force: bool,
    store_args: StoreArgs,
    as_json: bool,
) -> None:
    """Download files of a checkpoint (PATH as `show` lists it, or a glob), verified.

    One PATH: DEST is a file or a directory (an existing one, or any DEST ending in /,
    created if missing; default: the current directory); `-` writes the file to stdout
    (only once all of it verified). Several PATHs, or a glob ('*.json'; * matches / too;
    'tokenizer/' is a directory): the last argument is DEST, a directory (created if
    missing), and each file keeps its path in the checkpoint below it. Every file is
    checked against its recorded digest before it appears (written beside, then renamed),
    with its recorded mode. A damaged copy is skipped for the next older checkpoint, with
    a warning.
    """
    paths, dest = (args, None) if len(args) == 1 else (args[:-1], args[-1])
    if len(paths) == 1 and not _is_glob(paths[0]):
        _get_one(store_args, url, paths[0], dest, step, force, as_json)
        return
    if dest == "-":
        raise click.UsageError("several files (or a glob) cannot go to stdout ('-')")
    from cloudckpt.catalog import get_files

    with store_args.open(url, writable=False) as store:
        result = get_files(store, paths, dest, step=step, overwrite=force)
        where = store.url
    doc = {
        "url": where,
        "dest": str(result.dest),
        "step": result.step,
        "commit_id": result.commit_id,
        "num_files": result.num_files,
        "total_bytes": result.total_bytes,
        "files": [_got_file(f) for f in result.files],
        "skipped": _skipped(result.skipped),
        "from_commit_records": result.from_commit_records,
    }
    if as_json:
        emit_json(doc)
        return
    click.echo(
        f"{result.num_files} files of step {result.step}: {human_bytes(result.total_bytes)} "
        f"to {result.dest}, verified"
    )
    for f in result.files:
        click.echo(f"  {f.path}  {human_bytes(f.size)}")


def _is_glob(path: str) -> bool:
    """Whether a PATH of `get` is a pattern (a glob, or a directory ending in /)."""
    return any(c in path for c in "*?[") or path.endswith("/")


def _got_file(f: Any) -> dict[str, Any]:
    return {
        "path": f.path,
        "dest": None if f.dest is None else str(f.dest),
        "size": f.size,
        "digest": f.digest,
        "mode": f.mode,
    }


def _get_one(
    store_args: StoreArgs,
    url: RunURL,
    path: str,
    dest: str | None,
    step: int | None,
    force: bool,
    as_json: bool,
) -> None:
    """`get` of one exact PATH: to a file, into a directory, or to stdout."""
    from cloudckpt.catalog import get_file

    to_stdout = dest == "-"
    if to_stdout and as_json:
        raise click.UsageError("--json prints a report on stdout; it cannot go with DEST '-'")
    out = sys.stdout.buffer.write if to_stdout else None
    with store_args.open(url, writable=False) as store:
        result = get_file(
            store, path, None if to_stdout else dest, step=step, overwrite=force, write=out
        )
        where = store.url
    doc = {
        "url": where,
        **_got_file(result),
        "step": result.step,
        "commit_id": result.commit_id,
        "num_files": 1,
        "total_bytes": result.size,
        "files": [_got_file(result)],
        "skipped": _skipped(result.skipped),
        "from_commit_records": result.from_commit_records,
    }
    if as_json:
        emit_json(doc)
    elif not to_stdout:
        click.echo(
            f"{result.path} of step {result.step}: {human_bytes(result.size)} to "
            f"{result.dest}, verified"
        )
    else:
        sys.stdout.flush()


# ---------------------------------------------------------------------------- export


@cli.command("export")
@click.argument("url", type=RUN_URL)
@click.argument("dest")
@click.option("--step", type=int, help="Export this step (default: the newest intact one).")
@click.option(
    "--force",
    is_flag=True,
    help="Local DEST: replace its contents. Store DEST: write over the keys it holds. "
    "Never inside or over a cloudckpt run.",
)
@store_options
@dest_store_options
@json_option
def export_cmd(
    url: RunURL,
    dest: str,
    step: int | None,
    force: bool,
    store_args: StoreArgs,
    dest_args: StoreArgs | None,
    as_json: bool,
) -> None:
    """Write a checkpoint as plain files to DEST: a local directory or a bucket prefix.

    DEST holds the checkpoint's files under their own paths and nothing else, for tools
    that know nothing of cloudckpt (from_pretrained, aws s3 cp --recursive). Local: a
    verified, atomic restore (with fallback), modes kept. A store: each file verified, then
    uploaded whole (it appears complete or not at all); files appear one by one. A store
    prefix that holds objects is refused unless --force; a DEST that is a cloudckpt run,
    lies inside one or holds one always is (use `cp`).
    """
    from cloudckpt.catalog import export_checkpoint

    target = parse_url(dest)
    local = target.scheme == "file"
    dest_options = {} if local else _dest_options(url, target, store_args, dest_args)
    started = time.perf_counter()
    with (
        store_args.open(url, writable=False) as store,
        progress_bar(f"exporting {store.url}", None) as progress,
    ):
        result = export_checkpoint(
            store,
            Path(target.prefix) if local else target,
            step=step,
            overwrite=force,
            dest_options=dest_options,
            progress=progress,
        )
        where = store.url
    doc = {
        "url": where,
        "dest": result.dest,
        "step": result.step,
        "commit_id": result.commit_id,
        "num_files": result.num_files,
        "total_bytes": result.total_bytes,
        "skipped": _skipped(result.skipped),
        "from_commit_records": result.from_commit_records,
        "seconds": round(time.perf_counter() - started, 3),
    }
    if as_json:
        emit_json(doc)
        return
    click.echo(
        f"exported step {result.step} of {where} to {result.dest}: {result.num_files} files, "
        f"{human_bytes(result.total_bytes)}, verified"
    )


# ---------------------------------------------------------------------------- digest


@cli.command("digest")
@click.argument(
    "files",
    nargs=-1,
    required=True,
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
)
@click.option(
    "--algorithm",
    type=click.Choice(["blake3-tree", "sha256-tree"]),
    default=None,
    help="The manifest's digest (`show` names it); default: what new checkpoints use, blake3-tree.",
)
@json_option
def digest_cmd(files: tuple[Path, ...], algorithm: str | None, as_json: bool) -> None:
    """Print each FILE's digest: the value a manifest records (`show`).

    Output as sha256sum's: the digest, two spaces, the path. docs/cli.md shows how to
    compute the same value with a few lines of Python (or sha256sum, for sha256-tree).
    """
    from cloudckpt.catalog import file_digest
    from cloudckpt.digest import CHUNK_SIZE, check

    algorithm = check(algorithm)
    rows = []
    for path in files:
        try:
            rows.append(
                {
                    "path": str(path),
                    "size": path.stat().st_size,
                    "digest": file_digest(path, algorithm),
                }
            )
        except OSError as exc:
            raise ConfigurationError(f"cannot read {path}: {exc.strerror}") from None
    if as_json:
        emit_json({"algorithm": algorithm, "chunk_size": CHUNK_SIZE, "files": rows})
        return
    for row in rows:
        click.echo(f"{row['digest']}  {row['path']}")


# ---------------------------------------------------------------------------- diff


def _step_or_commit(value: str) -> int | str:
    """A diff argument: a step (digits), or a commit id (as `ls --json` shows it)."""
    text = value.strip()
    return int(text) if text.lstrip("-").isdigit() else text


@cli.command("diff")
@click.argument("url", type=RUN_URL)
@click.argument("step_a", metavar="STEP_A")
@click.argument("step_b", metavar="STEP_B")
@click.option("--all", "all_", is_flag=True, help="List unchanged files too.")
@store_options
@json_option
def diff_cmd(
    url: RunURL, step_a: str, step_b: str, all_: bool, store_args: StoreArgs, as_json: bool
) -> None:
    """Compare two retained checkpoints of a run: files added, removed, modified, and the
    chunks (and bytes) only one of them holds. Reads the two manifests only.

    STEP_A and STEP_B are steps, or commit ids (`ls --json`'s `commit_id`): where a run
    retains a step more than once, a step names the newest of them.
    """
    from cloudckpt.catalog import diff_checkpoints

    with store_args.open(url, writable=False) as store:
        diff = diff_checkpoints(store, _step_or_commit(step_a), _step_or_commit(step_b))
    doc = _diff_doc(diff)
    if as_json:
        emit_json(doc)
        return
    _print_diff(diff, all_)


def _side(record: Any) -> dict[str, Any]:
    return {
        "step": record.step,
        "commit_id": record.commit_id,
        "num_files": record.num_files,
        "total_bytes": record.total_bytes,
    }


def _diff_doc(diff: Any) -> dict[str, Any]:
    return {
        "url": diff.url,
        "a": _side(diff.a),
        "b": _side(diff.b),
        "summary": {
            change: diff.count(change)
            for change in ("added", "removed", "modified", "mode", "unchanged")
        }
        | {
            "chunks_only_in_a": diff.chunks_only_in_a,
            "chunks_only_in_b": diff.chunks_only_in_b,
            "bytes_only_in_a": diff.bytes_only_in_a,
            "bytes_only_in_b": diff.bytes_only_in_b,
            "shared_chunks": diff.shared_chunks,
            "shared_bytes": diff.shared_bytes,
        },
        "files": [dataclasses.asdict(f) for f in diff.files],
    }


_MARK = {"added": "+", "removed": "-", "modified": "M", "mode": "m", "unchanged": " "}


def _print_diff(diff: Any, all_: bool) -> None:
    a, b = diff.a, diff.b
    click.echo(
        f"{diff.url}: step {a.step} ({human_bytes(a.total_bytes)}, {a.num_files} files) -> "
        f"step {b.step} ({human_bytes(b.total_bytes)}, {b.num_files} files)"
    )
    for f in diff.files:
        if f.change == "unchanged" and not all_:
            continue
        if f.change == "added":
            sizes = human_bytes(f.size_b)
        elif f.change == "removed":
            sizes = human_bytes(f.size_a)
        else:
            sizes = f"{human_bytes(f.size_a)} -> {human_bytes(f.size_b)}"
        if f.change == "mode":
            sizes = f"mode {f.mode_a:o} -> {f.mode_b:o}"
        new = (
            ""
            if f.new_bytes is None or f.change == "unchanged"
            else f"  (new: {human_bytes(f.new_bytes)})"
        )
        click.echo(f"  {_MARK[f.change]} {f.path}  {sizes}{new}")
    counts = ", ".join(
        f"{diff.count(c)} {c}" for c in ("added", "removed", "modified", "mode", "unchanged")
    )
    click.echo(f"files: {counts}")
    click.echo(
        f"chunks: {diff.chunks_only_in_b} new in step {b.step} ({human_bytes(diff.bytes_only_in_b)}), "
        f"{diff.chunks_only_in_a} only in step {a.step} ({human_bytes(diff.bytes_only_in_a)}), "
        f"{diff.shared_chunks} shared ({human_bytes(diff.shared_bytes)})"
    )
