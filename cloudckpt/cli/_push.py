"""``push``: a local checkpoint directory uploaded and committed as one step, the run
claimed for it (a thin layer over ``CheckpointManager``; docs/cli.md)."""

from __future__ import annotations

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

from cloudckpt.cli._common import (
    INTERRUPTED,
    RUN_URL,
    StoreArgs,
    chunking_option,
    emit_json,
    human_bytes,
    info,
    json_option,
    parse_key_values,
    progress_bar,
    store_options,
    two_stage_interrupts,
    warn,
)
from cloudckpt.cli._main import cli
from cloudckpt.cli._retention import parse_metrics, retention_options
from cloudckpt.errors import ConfigurationError

if TYPE_CHECKING:
    from cloudckpt.attempts import CommitInfo
    from cloudckpt.chunks import ChunkingMode
    from cloudckpt.retention import RetentionOptions
    from cloudckpt.savequeue import SaveHandle
    from cloudckpt.stores import RunURL, Store


# push_cmd runs past 60 lines only by its options (one parameter each) and its --help
# text (the docstring); what it does is in its body and helpers.
@cli.command("push")
@click.argument(
    "src_dir", type=click.Path(exists=True, file_okay=False, readable=True, path_type=Path)
)
@click.argument("url", type=RUN_URL)
@click.option(
    "--step",
    type=int,
    help="The training step of this checkpoint. Default: read from SRC_DIR's name "
    "(checkpoint-500, global_step500, step_500; it says what it read).",
)
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
    step: int | None,
    metadata: tuple[str, ...],
    metrics: tuple[str, ...],
    force: bool,
    retention: RetentionOptions,
    staging_dir: Path | None,
    chunking: ChunkingMode,  # (click's Choice gives one of them)
    store_args: StoreArgs,
    as_json: bool,
) -> None:
    """Upload the local directory SRC_DIR as checkpoint STEP and commit it.

    Without --step, the step is read from SRC_DIR's name (checkpoint-500, global_step500,
    step_500, epoch=3-step=500); a name with no step or with two is refused (exit 2).

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
    step_from = None
    if step is None:  # before the store is touched, like the check above
        from cloudckpt.cli._step_name import step_from_name

        step_from = src_dir.resolve().name
        step = step_from_name(step_from)
        info(f"push: step {step}, read from the directory name {step_from!r} (--step sets it)")
    files = [p for p in src_dir.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    with store_args.open(url) as store:
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
            retention=retention,
        )
    doc = _push_doc(store.url, result, previous, time.perf_counter() - started, step_from)
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
    retention: RetentionOptions,
) -> CommitInfo:
    """``push``'s upload: a manager on ``store`` (setting ``retention``), ``save(manager)``
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
                **retention.given(),  # unset: the run's stay
            )
            try:
                return _wait_for_push(lambda: save(mgr), own_staging)
            finally:
                mgr.close()
    finally:
        if own_staging is not None:
            shutil.rmtree(own_staging, ignore_errors=True)


def _push_doc(
    url: str, result: CommitInfo, previous: Any, seconds: float, step_from: str | None
) -> dict[str, Any]:
    """``push --json``'s output: the commit, the directory name its step was read from
    (None: --step), and the writer it fenced (None: a new run)."""
    return {
        "url": url,
        "step": result.step,
        "step_from": step_from,
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
    if previous is not None and previous.may_be_live:
        # An earlier push (or trainer) of this host whose process is gone cannot commit
        # again: fencing it is no news, so only a writer that may still run is named.
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
