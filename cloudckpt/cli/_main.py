"""The ``cloudckpt`` command group and its run commands (a thin layer over the library)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from cloudckpt._version import __version__
from cloudckpt.cli._common import (
    DAMAGED,
    DURATION,
    EXIT_CODE_TABLE,
    INTERRUPTED,
    NEEDS_REPAIR,
    RUN_URL,
    CloudCkptGroup,
    StoreArgs,
    chunking_option,
    emit_json,
    human_bytes,
    info,
    json_option,
    parse_key_values,
    progress_bar,
    setup_logging,
    stdout_console,
    store_options,
    two_stage_interrupts,
    warn,
)
from cloudckpt.cli._retention import (
    format_metrics,
    parse_metrics,
    retention_options,
    with_keep,
)
from cloudckpt.errors import CheckpointNotFoundError, ConfigurationError, CorruptionError

if TYPE_CHECKING:
    from cloudckpt.chunks import ChunkingMode
    from cloudckpt.gc import GCReport
    from cloudckpt.manager import CommitInfo, SaveHandle
    from cloudckpt.stores import RunURL, Store

_EPILOG = "Exit codes:\n\n\b\n" + "\n".join(
    f"  {code:>3}  {text}" for code, text in EXIT_CODE_TABLE
)


@click.group(
    cls=CloudCkptGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=_EPILOG,
)
@click.version_option(__version__, prog_name="cloudckpt")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """Crash-safe ML training checkpoints on object storage.

    URL is a run location: s3://bucket/prefix, gs://bucket/prefix, az://container/prefix
    (or abfs[s]://container@account.dfs.core.windows.net/prefix), file:///path or a local
    path. Credentials come from the usual places (AWS_PROFILE or --profile and the AWS_*
    variables; Google application default credentials; AZURE_STORAGE_CONNECTION_STRING or
    AZURE_STORAGE_ACCOUNT_NAME) or from --storage-option.

    --json prints one JSON document (watch: one per event, a line each); docs/cli.md lists
    every command's fields. Shell completion, in ~/.bashrc (zsh: zsh_source in ~/.zshrc):

    \b
      eval "$(_CLOUDCKPT_COMPLETE=bash_source cloudckpt)"
    """
    setup_logging(verbose)


def _closing(store: Any) -> contextlib.AbstractContextManager:
    return contextlib.closing(store)


def _load_for_reading(store: Any) -> tuple[Any, bool]:
    """LATEST, or the newest commit record that verifies when it is missing or damaged
    (the library warns about that fallback, once; no second warning here).

    Raises: CorruptionError if LATEST is unreadable and no commit record verifies.
    """
    from cloudckpt.restore import load_latest_for_reading

    latest, from_records = load_latest_for_reading(store)
    if latest is None and from_records:
        raise CorruptionError(
            f"LATEST of {store.url} is unreadable and no commit record verifies",
            hint="Run `cloudckpt repair URL` to see what can be recovered",
        )
    return latest, from_records


def _record_dict(latest: Any, record: Any) -> dict[str, Any]:
    return {
        "step": record.step,
        "commit_id": record.commit_id,
        "ckpt": record.ckpt,
        "epoch": record.epoch,
        "committed_at": record.committed_at,
        "num_files": record.num_files,
        "total_bytes": record.total_bytes,
        # Bytes under the checkpoint's own prefix, and bytes it names in older checkpoints'
        # (chunks); None for records written before chunks existed.
        "owned_bytes": record.owned_bytes,
        "shared_bytes": (
            None if record.owned_bytes is None else record.total_bytes - record.owned_bytes
        ),
        "current": latest.current is not None and latest.current.commit_id == record.commit_id,
        "pins": [p.label for p in latest.pins if p.commit_id == record.commit_id],
        "metadata": dict(record.metadata),
        # Numbers recorded with the checkpoint (keep-best ranks by them); NaN and
        # infinities as the strings "nan", "inf", "-inf".
        "metrics": dict(record.metrics),
    }


def _file_dict(f: Any, ckpt: str) -> dict[str, Any]:
    d: dict[str, Any] = {"path": f.path, "size": f.size, "digest": f.digest}
    if f.chunks is not None:
        d["chunks"] = len(f.chunks)
        d["shared_chunks"] = sum(1 for c in f.chunks if c.owner != ckpt)
        d["shared_bytes"] = sum(c.size for c in f.chunks if c.owner != ckpt)
    return d


def _find_record(latest: Any, step: int | None, url: str) -> Any:
    retained = latest.retained()
    if step is None:
        if latest.current is None:
            raise CheckpointNotFoundError(f"{url} has no committed checkpoint")
        return latest.current
    for record in retained:
        if record.step == step:
            return record
    steps = ", ".join(str(r.step) for r in retained) or "none"
    raise CheckpointNotFoundError(
        f"{url} retains no checkpoint of step {step}",
        hint=f"Retained steps: {steps} (`cloudckpt ls URL` lists them)",
    )


# ---------------------------------------------------------------------------- ls


@cli.command("ls")
@click.argument("url", type=RUN_URL)
@store_options
@json_option
def ls_cmd(url: RunURL, store_args: StoreArgs, as_json: bool) -> None:
    """List the committed checkpoints of the run at URL, newest first."""
    with _closing(store_args.open(url, writable=False)) as store:
        latest, from_records = _load_for_reading(store)
        below = _runs_below(store) if latest is None and not as_json else []
    doc = _ls_doc(store.url, latest, from_records)
    if as_json:
        emit_json(doc)
        return
    if below:
        shown = ", ".join(below[:5]) + (f" and {len(below) - 5} more" if len(below) > 5 else "")
        info(
            f"{store.url}: not a run, but it holds {len(below)} run(s) below it ({shown}); "
            f"list them with `cloudckpt runs {store.url}`"
        )
        return
    if latest is None:
        info(f"{store.url}: no checkpoints (nothing was ever committed here)")
        return
    _print_ls(doc)


def _runs_below(store: Store) -> list[str]:
    """The paths of the runs up to two directories below ``store``'s root (for ``ls``
    pointed at a prefix of runs)."""
    from cloudckpt.catalog import list_runs

    return [r.path for r in list_runs(store, depth=2) if r.path]


def _ls_doc(url: str, latest: Any, from_records: bool) -> dict[str, Any]:
    """What ``ls --json`` prints: the run's writer, settings, checkpoints and tombstones."""
    if latest is None:
        return {
            "url": url,
            "seq": None,
            "writer": None,
            "settings": None,
            "from_commit_records": False,
            "checkpoints": [],
            "tombstones": [],
        }
    return {
        "url": url,
        "seq": latest.seq,
        "writer": {
            "epoch": latest.writer.epoch,
            "id": latest.writer.id,
            "claimed_at": latest.writer.claimed_at,
        },
        "settings": _settings_doc(latest.settings),
        "from_commit_records": from_records,
        "checkpoints": [_record_dict(latest, r) for r in latest.retained()],
        "tombstones": [
            {
                "step": t.record.step,
                "commit_id": t.record.commit_id,
                "ckpt": t.record.ckpt,
                "state": t.state,
                "dropped_seq": t.dropped_seq,
            }
            for t in latest.tombstones
        ],
    }


def _settings_doc(settings: Any) -> dict[str, Any]:
    """A run's settings as ``ls --json`` shows them (every field, set or not)."""
    return {
        "keep_last": settings.keep_last,
        "keep_every": settings.keep_every,
        "gc_grace_s": settings.gc_grace_s,
        "keep_best": settings.keep_best,
        "best_metric": settings.best_metric,
        "best_mode": settings.best_mode if settings.keep_best is not None else None,
        "keep_periods": [
            {"period_s": period, "window_s": window} for period, window in settings.keep_periods
        ],
    }


def _print_ls(doc: dict[str, Any]) -> None:
    """``ls``'s table of checkpoints (of a run that has some): ``cli._table``."""
    from cloudckpt.cli._table import print_ls

    print_ls(stdout_console(), doc)


# ---------------------------------------------------------------------------- show


@cli.command("show")
@click.argument("url", type=RUN_URL)
@click.option("--step", type=int, help="Which checkpoint (default: the current one).")
@store_options
@json_option
def show_cmd(url: RunURL, step: int | None, store_args: StoreArgs, as_json: bool) -> None:
    """Show one checkpoint's record and manifest (its files, sizes and digests)."""
    from cloudckpt.restore import fetch_manifest

    with _closing(store_args.open(url, writable=False)) as store:
        latest, _ = _load_for_reading(store)
        if latest is None:
            raise CheckpointNotFoundError(f"{store.url} has no committed checkpoint")
        record = _find_record(latest, step, store.url)
        manifest = fetch_manifest(store, record)
    doc = _record_dict(latest, record)
    doc["url"] = store.url
    doc["manifest"] = {
        "writer_id": manifest.writer_id,
        "created_at": manifest.created_at,
        "algorithm": manifest.algorithm,
        "chunk_size": manifest.chunk_size,
        "total_bytes": manifest.total_bytes,
        "chunked": manifest.chunked,
        "owned_bytes": manifest.owned_bytes,
        "shared_bytes": manifest.total_bytes - manifest.owned_bytes,
        "files": [_file_dict(f, record.ckpt) for f in manifest.files],
    }
    if as_json:
        emit_json(doc)
        return
    from rich.table import Table

    console = stdout_console()
    console.print(f"step {doc['step']}{'  (current)' if doc['current'] else ''}")
    for key in ("commit_id", "ckpt", "epoch", "committed_at"):
        console.print(f"  {key:<13}{doc[key]}")
    console.print(f"  {'writer':<13}{manifest.writer_id}")
    console.print(
        f"  {'size':<13}{human_bytes(manifest.total_bytes)} in {len(manifest.files)} files"
    )
    m = doc["manifest"]
    console.print(
        f"  {'owns':<13}{human_bytes(m['owned_bytes'])}  shares "
        f"{human_bytes(m['shared_bytes'])} with older checkpoints"
        + ("" if m["chunked"] else "  (whole files, not chunked)")
    )
    if doc["pins"]:
        console.print(f"  {'pins':<13}{', '.join(doc['pins'])}")
    if doc["metrics"]:
        console.print(f"  {'metrics':<13}{format_metrics(doc['metrics'])}")
    if doc["metadata"]:
        import json

        console.print(f"  {'metadata':<13}{json.dumps(doc['metadata'], sort_keys=True)}")
    table = Table(title_justify="left")
    table.add_column("path")
    table.add_column("size", justify="right")
    table.add_column("chunks (shared)", justify="right")
    table.add_column(f"digest ({manifest.algorithm})")
    for f, d in zip(manifest.files, m["files"], strict=True):
        chunks = "" if f.chunks is None else f"{len(f.chunks)} ({d['shared_chunks']})"
        table.add_row(f.path, human_bytes(f.size), chunks, f.digest)
    console.print(table)


# ---------------------------------------------------------------------------- restore


@cli.command("restore")
@click.argument("url", type=RUN_URL)
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--step", type=int, help="Restore this step (default: the newest intact one).")
@click.option("--force", is_flag=True, help="Replace DEST's contents if it is not empty.")
@store_options
@json_option
def restore_cmd(
    url: RunURL, dest: Path, step: int | None, force: bool, store_args: StoreArgs, as_json: bool
) -> None:
    """Download and verify a checkpoint into DEST, atomically.

    Files land in a temporary directory beside DEST and are moved into place only after every
    byte matched its digest; if the newest checkpoint is damaged, the next older one is
    restored and the fallback reported. Read-only: it never claims the run.
    """
    from cloudckpt.restore import restore
    from cloudckpt.transfer import TransferEngine

    started = time.perf_counter()
    with (
        _closing(store_args.open(url, writable=False)) as store,
        TransferEngine() as engine,
        progress_bar(f"restoring {store.url}", _restore_size(store, step)) as progress,
    ):
        result = restore(store, dest, engine, step=step, overwrite=force, progress=progress)
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


def _restore_size(store: Store, step: int | None) -> int | None:
    """The size of the checkpoint a restore tries first, for its progress bar; None when
    LATEST is missing or damaged (the restore itself reports that, once)."""
    from cloudckpt.committer import read_latest
    from cloudckpt.protocol import CorruptRecordError
    from cloudckpt.restore import candidates

    try:
        head = read_latest(store)
    except CorruptRecordError:
        return None
    todo = candidates(head.latest, step) if head is not None else []
    return todo[0].total_bytes if todo else None


# ---------------------------------------------------------------------------- push


# push_cmd runs past 60 lines only by its options (one parameter each) and its --help
# text (the docstring); what it does is in its body and helpers.
@cli.command("push")
@click.argument(
    "src_dir", type=click.Path(exists=True, file_okay=False, readable=True, path_type=Path)
)
@click.argument("url", type=RUN_URL)
@click.option("--step", type=int, required=True, help="The training step of this checkpoint.")
@click.option(
    "--metadata",
    "-m",
    multiple=True,
    metavar="KEY=VALUE",
    help="User metadata to record (repeatable; KEY:=JSON for numbers and objects).",
)
@click.option(
    "--metric",
    "metrics",
    multiple=True,
    metavar="NAME=VALUE",
    help="A number to record with the checkpoint (repeatable), e.g. --metric eval_loss=0.31: "
    "what --keep-best ranks by.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Claim the run even though its writer wrote LATEST within the last hour.",
)
@click.option(
    "--keep-last", type=int, help="Retention to set (default: keep the run's current setting)."
)
@click.option("--keep-every", type=int, help="Also keep every K-th step (default: the run's).")
@retention_options
@click.option(
    "--staging-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Local staging directory (default: a temporary one; same filesystem as SRC_DIR "
    "makes the snapshot hard links instead of copies).",
)
@chunking_option
@store_options
@json_option
def push_cmd(
    src_dir: Path,
    url: RunURL,
    step: int,
    metadata: tuple[str, ...],
    metrics: tuple[str, ...],
    force: bool,
    keep_last: int | None,
    keep_every: int | None,
    retention: dict[str, Any],
    staging_dir: Path | None,
    chunking: ChunkingMode,  # (click's Choice gives one of them)
    store_args: StoreArgs,
    as_json: bool,
) -> None:
    """Upload the local directory SRC_DIR as checkpoint STEP and commit it.

    push makes this command the run's writer: it claims the run (a new writer epoch), which
    fences the writer that owned it, exactly as a resumed trainer would. If that writer wrote
    LATEST within the last hour it is probably still training, and push refuses (exit 5)
    unless --force is given.
    """
    from cloudckpt.staging import holds_files

    user_metadata = parse_key_values(metadata, "--metadata")
    user_metrics = parse_metrics(metrics)
    if not holds_files(src_dir):  # before the store is touched: nothing is claimed
        raise ConfigurationError(
            f"{src_dir} holds no files: there is nothing to push",
            hint="Check SRC_DIR (the local checkpoint directory comes first, the run URL "
            "second); an empty checkpoint would become the current one that restores pick",
        )
    files = [p for p in src_dir.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    settings = with_keep(retention, keep_last, keep_every)  # unset: the run's stay
    with _closing(store_args.open(url)) as store:
        previous = _check_push_takeover(store, step, force)
        started = time.perf_counter()
        result = _push(
            store,
            src_dir,
            step,
            total,
            staging_dir,
            save=lambda mgr: mgr.save_dir(step, src_dir, user_metadata, metrics=user_metrics),
            chunking=chunking,
            settings=settings,
        )
    doc = _push_doc(store.url, result, previous, time.perf_counter() - started)
    if as_json:
        emit_json(doc)
        return
    click.echo(
        f"committed step {result.step} ({result.commit_id}) to {store.url}: "
        f"{result.num_files} files, {human_bytes(result.total_bytes)} "
        f"in {doc['seconds']:.1f}s (writer epoch {result.epoch})"
    )
    click.echo(f"  {transfer_summary(result)}")


def _push(
    store: Store,
    src_dir: Path,
    step: int,
    total: int,
    staging_dir: Path | None,
    *,
    save: Callable[[Any], SaveHandle],
    chunking: ChunkingMode,
    settings: dict[str, Any],
) -> CommitInfo:
    """``push``'s upload: a manager on ``store`` (run ``settings``), ``save(manager)``
    started and waited for under a progress bar of ``total`` bytes, staged in
    ``staging_dir`` or a temporary directory of our own (removed after). Raises what the
    save raises."""
    from cloudckpt import CheckpointManager

    own_staging = None
    if staging_dir is None:  # ours, so an abandoned push leaves no copy behind
        own_staging = Path(tempfile.mkdtemp(prefix="cloudckpt-push-"))
    try:
        with progress_bar(f"pushing {src_dir.name}", total) as progress:
            mgr = CheckpointManager(
                store,
                staging_dir=staging_dir or own_staging,
                auto_gc=False,
                progress=progress,
                chunking=chunking,
                keep_local=0,  # a push restores nothing: keep no local copy
                **settings,
            )
            try:
                return _wait_for_push(lambda: save(mgr), own_staging)
            finally:
                mgr.close()
    finally:
        if own_staging is not None:
            shutil.rmtree(own_staging, ignore_errors=True)


def _push_doc(url: str, result: CommitInfo, previous: Any, seconds: float) -> dict[str, Any]:
    """``push --json``'s output: the commit, and the writer it fenced (None: a new run)."""
    return {
        "url": url,
        "step": result.step,
        "commit_id": result.commit_id,
        "ckpt": result.ckpt,
        "epoch": result.epoch,
        "seq": result.seq,
        "num_files": result.num_files,
        "total_bytes": result.total_bytes,
        "bytes_uploaded": result.bytes_uploaded,
        "bytes_reused": result.bytes_reused,
        "bytes_resumed": result.bytes_resumed,
        "metadata": dict(result.metadata),
        "metrics": dict(result.metrics),
        "fenced_writer": previous.to_dict() if previous is not None else None,
        "seconds": round(seconds, 3),
    }


def transfer_summary(result: CommitInfo) -> str:
    """``uploaded 1.0 GiB, reused 3.0 GiB already in the run (512.0 MiB from an interrupted
    save of this step)``: what a save sent, and what it named where it already lay."""
    uploaded, reused, resumed = (
        result.bytes_uploaded or 0,
        result.bytes_reused or 0,
        result.bytes_resumed or 0,
    )
    text = f"uploaded {human_bytes(uploaded)}, reused {human_bytes(reused)} already in the run"
    if resumed:
        text += f" ({human_bytes(resumed)} from an interrupted save of this step)"
    return text


def _check_push_takeover(store: Store, step: int, force: bool) -> Any:
    """The writer ``push`` is about to fence (None for a new run), after warning about it
    and about a step not newer than the current one.

    Raises: ``ActiveWriterError`` if that writer wrote LATEST within the last hour and
    not ``force`` (``admin.check_takeover``).
    """
    from cloudckpt.admin import check_takeover
    from cloudckpt.committer import read_latest

    previous = check_takeover(store, force=force)
    head = read_latest(store) if previous is not None else None
    if head is not None:
        current = head.latest.current
        if current is not None and step <= current.step:
            warn(
                f"step {step} is not newer than the current step {current.step}; once "
                "committed it becomes the current checkpoint that restores pick"
            )
    if previous is not None:
        warn(
            f"push claims {store.url}: writer {previous.id} (epoch {previous.epoch}) is "
            "fenced from now on; its next commit will fail"
        )
    return previous


def _wait_for_push(start: Callable[[], SaveHandle], own_staging: Path | None) -> CommitInfo:
    """Start the save (``start()`` hands it over and returns its handle) and wait for
    its commit.

    The first interrupt lets the upload finish and commit (a flush, as `watch` does on
    SIGTERM); one that arrives while the save is being handed over counts the same way.
    A second one abandons it at once: the process exits without waiting for transfer
    threads, so the attempt can never be committed afterwards (it stays in the bucket,
    unreferenced, for GC)."""
    handle: SaveHandle | None = None

    def flush(sig: signal.Signals) -> None:
        warn(
            "interrupted: waiting for the upload in progress to commit (interrupt again to "
            "abandon it; nothing half-done becomes visible)"
        )

    def abandon(sig: signal.Signals) -> None:
        if handle is not None and handle.done() and handle.exception() is None:
            return  # it committed just before this interrupt: report it
        info("cloudckpt: interrupted again: the upload is abandoned, nothing was committed")
        if own_staging is not None:
            shutil.rmtree(own_staging, ignore_errors=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)

    with two_stage_interrupts(flush, abandon):
        handle = start()
        return handle.result()


# ---------------------------------------------------------------------------- verify


@cli.command("verify")
@click.argument("url", type=RUN_URL)
@click.option("--all", "all_", is_flag=True, help="Every retained checkpoint (default: current).")
@click.option("--read-data", is_flag=True, help="Read back and hash every byte.")
@store_options
@json_option
def verify_cmd(
    url: RunURL, all_: bool, read_data: bool, store_args: StoreArgs, as_json: bool
) -> None:
    """Check LATEST, manifests and objects; with --read-data every byte.

    Exit 0 if everything checked is intact, 4 if anything is damaged, 6 if LATEST is missing
    or damaged (run `cloudckpt repair`).
    """
    from cloudckpt.committer import read_latest
    from cloudckpt.protocol import CorruptRecordError
    from cloudckpt.verify import verify_run

    with _closing(store_args.open(url, writable=False)) as store:
        total = None
        if read_data:
            with contextlib.suppress(CorruptRecordError):
                head = read_latest(store)
                if head is not None:
                    recs = head.latest.retained() if all_ else head.latest.retained()[:1]
                    total = sum(r.total_bytes for r in recs)
        with progress_bar("verifying", total) as progress:
            report = verify_run(store, all=all_, read_data=read_data, progress=progress)
    doc = report.to_dict()
    code = 0 if report.ok else NEEDS_REPAIR if report.needs_repair else DAMAGED
    doc["exit_code"] = code
    if as_json:
        emit_json(doc)
    else:
        _print_verify(report)
    if code:
        raise click.exceptions.Exit(code)


def _print_verify(report: Any) -> None:
    from rich.table import Table

    console = stdout_console()
    if report.latest_ok:
        console.print(f"LATEST  OK (seq {report.seq}, writer epoch {report.writer_epoch})")
    else:
        console.print(f"LATEST  [bold red]DAMAGED[/]: {report.latest_problem}")
        console.print(f"        checked the checkpoints {report.latest_source} describes")
        console.print("        run `cloudckpt repair URL` to rebuild LATEST")
    table = Table(title_justify="left")
    for col in ("step", "", "status", "size", "details"):
        table.add_column(col)
    for c in report.checkpoints:
        status = "[green]ok[/]" if c.ok else "[bold red]damaged[/]"
        details = (
            "; ".join(c.reasons)
            if c.reasons
            else (f"{human_bytes(c.bytes_read)} read and hashed" if report.read_data else "listed")
        )
        table.add_row(str(c.step), c.role, status, human_bytes(c.total_bytes), details)
    console.print(table)
    if report.all:
        console.print(
            f"commit records: {report.commit_records_checked} checked, "
            f"{len(report.commit_records_damaged)} damaged"
        )
        for d in report.commit_records_damaged:
            console.print(f"  [red]{d}[/]")
    for p in report.problems:
        console.print(f"[red]problem:[/] {p}")
    damaged = sum(not c.ok for c in report.checkpoints)
    depth = "every byte" if report.read_data else "manifests and object sizes"
    if report.ok:
        console.print(f"[green]all {len(report.checkpoints)} checkpoint(s) intact[/] ({depth})")
    elif damaged:
        console.print(
            f"[bold red]{damaged} of {len(report.checkpoints)} checkpoint(s) damaged[/]; "
            "`cloudckpt restore` skips damaged ones automatically"
        )


# ---------------------------------------------------------------------------- pin / unpin


def _pins_doc(store: Any, latest: Any, step: int) -> dict[str, Any]:
    return {
        "url": store.url,
        "step": step,
        "pins": [
            {"step": p.step, "label": p.label, "commit_id": p.commit_id, "pinned_at": p.pinned_at}
            for p in latest.pins
        ],
    }


@cli.command("pin")
@click.argument("url", type=RUN_URL)
@click.argument("step", type=int)
@click.option("--label", default="pinned", show_default=True, help="A name for the pin.")
@store_options
@json_option
def pin_cmd(url: RunURL, step: int, label: str, store_args: StoreArgs, as_json: bool) -> None:
    """Keep checkpoint STEP regardless of retention (safe while a trainer runs)."""
    from cloudckpt.admin import pin

    with _closing(store_args.open(url)) as store:
        latest = pin(store, step, label)
    doc = _pins_doc(store, latest, step)
    doc["label"] = label
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"pinned step {step} of {store.url} as {label!r}")


@cli.command("unpin")
@click.argument("url", type=RUN_URL)
@click.argument("step", type=int)
@store_options
@json_option
def unpin_cmd(url: RunURL, step: int, store_args: StoreArgs, as_json: bool) -> None:
    """Remove the pins of STEP; retention then decides whether it stays."""
    from cloudckpt.admin import unpin

    with _closing(store_args.open(url)) as store:
        latest = unpin(store, step)
    doc = _pins_doc(store, latest, step)
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"unpinned step {step} of {store.url}")


# ---------------------------------------------------------------------------- gc


@cli.command("gc")
@click.argument("url", type=RUN_URL)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (what would be deleted); delete and write nothing.",
)
@click.option(
    "--grace",
    type=DURATION,
    help="Minimum age (store clock) before unreferenced data goes, e.g. 30m, 2h, 1d. Never "
    "below the run's own gc_grace (default 2h).",
)
@store_options
@json_option
def gc_cmd(
    url: RunURL, dry_run: bool, grace: float | None, store_args: StoreArgs, as_json: bool
) -> None:
    """Delete checkpoint data nothing references, once older than the grace period.

    GC plans from one read of LATEST and one listing, then carries the plan out, checking
    again after each LATEST write of its own (what became referenced stays). --dry-run
    prints the plan and stops.
    """
    from cloudckpt.gc import execute_gc, plan_gc, preview_gc

    with _closing(store_args.open(url)) as store:
        plan = plan_gc(store, grace_seconds=grace)
        report = preview_gc(plan) if dry_run else execute_gc(plan)
    if as_json:
        emit_json(_gc_doc(store.url, report))
    else:
        _print_gc(store.url, report, plan.ages())


def _gc_doc(url: str, report: GCReport) -> dict[str, Any]:
    return {
        "url": url,
        "dry_run": report.dry_run,
        "grace_seconds": report.grace_seconds,
        "store_now": report.store_now.isoformat(),
        "deleted_checkpoints": [{"step": s, "ckpt": c} for s, c in report.deleted_checkpoints],
        "deleted_orphans": list(report.deleted_orphans),
        "aborted_uploads": [{"key": k, "upload_id": u} for k, u in report.aborted_uploads],
        "deleted_commit_records": list(report.deleted_commit_records),
        "kept_young": list(report.kept_young),
        "deleted_objects": report.deleted_objects,
        "freed_bytes": report.freed_bytes,
    }


def _span(seconds: float) -> str:
    """``3h05m``, ``12m30s``, ``42s``: a store-clock age, two units at most."""
    s = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if s >= size:
            return f"{s // size}{unit}{(s % size) // sub_size:02d}{sub}"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


_GC_WRITES = {
    "gc-mark": "gc-mark: the dropped checkpoints become 'deleting' before their objects go",
    "gc-forget": "gc-forget: their tombstones leave LATEST once their objects are gone",
    "gc-sweep": "gc-sweep: fences commits in flight before orphans go",
}


def _print_gc(url: str, report: GCReport, ages: dict[str, float]) -> None:
    dry = report.dry_run
    verb = "would delete" if dry else "deleted"
    click.echo(f"gc {url} (grace {report.grace_seconds}s, store clock){' [dry run]' * dry}")
    if report.latest_seq is not None:
        click.echo(
            f"  plan from LATEST seq {report.latest_seq}, store clock {report.store_now.isoformat()}"
        )
    for s, c in report.deleted_checkpoints:
        click.echo(f"  {verb} dropped checkpoint step {s}: {c} (dropped {_span(ages[c])} ago)")
    for p in report.deleted_orphans:
        click.echo(f"  {verb} orphan attempt {p} (started {_span(ages[p])} ago)")
    for k, _ in report.aborted_uploads:
        click.echo(f"  {'would abort' if dry else 'aborted'} incomplete upload {k}")
    if report.deleted_commit_records:
        click.echo(f"  {verb} {len(report.deleted_commit_records)} old commit record(s)")
    if report.kept_young:
        click.echo(f"  kept {len(report.kept_young)} unreferenced attempt(s) younger than grace")
    for op in report.latest_writes:
        click.echo(f"  {'would write' if dry else 'wrote'} LATEST: {_GC_WRITES.get(op, op)}")
    size = human_bytes(report.freed_bytes)
    if dry:
        click.echo(
            f"would delete {report.deleted_objects} object(s), {size}; "
            "nothing was deleted or written (dry run)"
        )
    else:
        click.echo(f"{report.deleted_objects} object(s), {size} freed")


# ---------------------------------------------------------------------------- repair


def _describe_write(write: dict[str, str]) -> str:
    if write["mode"] == "compare-and-swap":
        return (
            f"{write['key']} by compare-and-swap against the damaged version read "
            f"({write['version']}): stops if it changed meanwhile"
        )
    if write["key"] == "LATEST":
        return "LATEST create-only: stops if anything created it meanwhile"
    return f"{write['key']} create-only"


@cli.command("repair")
@click.argument("url", type=RUN_URL)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (what would be rebuilt and written); write nothing.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Rebuild even though LATEST verifies (drops checkpoints whose manifests are gone and "
    "fences the current writer).",
)
@store_options
@json_option
def repair_cmd(
    url: RunURL, dry_run: bool, force: bool, store_args: StoreArgs, as_json: bool
) -> None:
    """Rebuild a missing or damaged LATEST from the commit records.

    The new LATEST comes from the newest commit record whose current checkpoint verifies,
    with a writer epoch above every epoch ever seen (so writers from before stay fenced).
    It is written conditionally; nothing is ever deleted.
    """
    from cloudckpt.repair import repair

    with _closing(store_args.open(url)) as store:
        report = repair(store, force=force, dry_run=dry_run)
    if as_json:
        emit_json(report.to_dict())
        return
    if report.action == "healthy":
        click.echo(
            f"{store.url}: LATEST verifies (seq {report.seq}, writer epoch {report.epoch}); "
            "nothing to repair"
        )
        return
    if report.action == "empty":
        click.echo(f"{store.url}: nothing here (a new run); nothing to repair")
        return
    if report.latest_state == "ok":
        click.echo(f"{store.url}: LATEST verifies; rebuilding it anyway (--force)")
    else:
        click.echo(f"{store.url}: LATEST {report.latest_state}: {report.latest_problem}")
    click.echo(
        f"  found {report.commit_records} commit record(s) and {report.attempts} attempt(s); "
        f"highest epoch {report.highest_epoch_seen}, highest seq {report.highest_seq_seen}"
    )
    for p in report.passed_over:
        click.echo(f"  passed over {p['record']}: {p['reason']}")
    for d in report.dropped:
        click.echo(f"  dropped step {d['step']} ({d['commit_id']}): {d['reason']}")
    verb = "would rebuild" if dry_run else "rebuilt"
    click.echo(
        f"{verb} LATEST from {report.base}: seq {report.seq}, writer epoch {report.epoch}, "
        f"current step {report.current_step}, retained {report.retained_steps}"
    )
    for w in report.writes if dry_run else ():
        click.echo(f"  would write {_describe_write(w)}")
    if dry_run:
        click.echo("nothing was written (dry run)")
    if report.unreferenced_manifests:
        warn(
            f"{len(report.unreferenced_manifests)} attempt(s) with a complete manifest are not "
            "referenced and will be removed by GC after the grace period: "
            + ", ".join(report.unreferenced_manifests[:5])
        )
