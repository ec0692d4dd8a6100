"""``cloudckpt watch``: the sidecar (see ``cloudckpt.watch`` for the rules)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click

from cloudckpt.cli._common import (
    DURATION,
    ERROR,
    StoreArgs,
    chunking_option,
    human_bytes,
    info,
    json_mode,
    json_option,
    store_options,
    two_stage_interrupts,
    warn,
)
from cloudckpt.cli._main import cli


def _describe(event: dict[str, Any]) -> str | None:
    kind = event["event"]
    if kind == "queued":
        return (
            f"uploading {event['source']} as step {event['step']} "
            f"({event['files']} files, {human_bytes(event['bytes'])})"
        )
    if kind == "committed":
        return (
            f"committed {event['source']} as step {event['step']} "
            f"({human_bytes(event['bytes'])}) in {event['commit_seconds']:.1f}s"
        )
    if kind == "skipped":
        return (
            None
            if "already committed" in event["reason"]
            else (f"not uploading {event['source']}: {event['reason']}")
        )
    if kind == "failed":
        retry = "; will retry" if event["will_retry"] else "; giving up on it"
        return f"upload of {event['source']} failed: {event['error']}{retry}"
    if kind == "fenced":
        return f"stopping: {event['message']}"
    if kind == "flushing" and event["pending"]:
        return f"waiting for {event['pending']} upload(s) to commit"
    return None


@cli.command("watch")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("url")
@click.option(
    "--settle",
    type=DURATION,
    default="30s",
    show_default=True,
    help="How long a checkpoint's files must stay unchanged before it is uploaded.",
)
@click.option("--poll", type=DURATION, default="5s", show_default=True, help="How often to look.")
@click.option(
    "--marker",
    multiple=True,
    default=(".complete",),
    show_default=True,
    help="File name that marks any directory as a finished checkpoint (repeatable).",
)
@click.option(
    "--accept-quiet-dirs",
    is_flag=True,
    help="Also upload any directory whose name ends with a step number once it is quiet "
    "for --settle. Risky: a writer killed half-way leaves a quiet, partial directory.",
)
@click.option("--once", is_flag=True, help="Upload what is finished now, then exit.")
@click.option(
    "--staging-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Local staging directory (on DIRECTORY's filesystem for hard-link snapshots). "
    "Default: a temporary one.",
)
@click.option("--keep-last", type=int, help="Retention (default: the run's current setting).")
@click.option("--keep-every", type=int, help="Also keep every K-th step (default: the run's).")
@chunking_option
@store_options
@json_option
def watch_cmd(
    directory: Path,
    url: str,
    settle: float,
    poll: float,
    marker: tuple[str, ...],
    accept_quiet_dirs: bool,
    once: bool,
    staging_dir: Path | None,
    keep_last: int | None,
    keep_every: int | None,
    chunking: str,
    store_args: StoreArgs,
    as_json: bool,
) -> None:
    """Upload and commit each finished checkpoint a trainer writes into DIRECTORY.

    Recognises Hugging Face checkpoint-N directories (finished once trainer_state.json, which
    Trainer writes last, is there), Lightning *.ckpt files (step=S in the name; a torch.save
    zip must be complete), and directories holding a marker file. Only moves forward: a
    checkpoint not newer than the committed step is never uploaded, so restarting the
    watcher re-uploads nothing. SIGTERM or Ctrl-C: stop looking, finish and commit the
    uploads in progress, exit 0. A second signal exits at once (nothing half-committed).

    The watcher claims the run on its first upload, fencing any other writer of the run.
    With --json, every event is printed on stdout as one JSON line.
    """
    from cloudckpt.watch import Watcher

    def on_event(event: dict[str, Any]) -> None:
        if json_mode():
            click.echo(json.dumps(event, sort_keys=True))
            sys.stdout.flush()
        else:
            text = _describe(event)
            if text:
                info(text)

    options: dict[str, Any] = {"staging_dir": staging_dir, "chunking": chunking}
    if keep_last is not None:
        options["keep_last"] = keep_last
    if keep_every is not None:
        options["keep_every"] = keep_every
    watcher = Watcher(
        directory,
        url,
        settle=settle,
        markers=marker,
        accept_quiet_dirs=accept_quiet_dirs,
        storage_options=store_args.storage_options(url),
        on_event=on_event,
        **options,
    )

    def finish_then_exit(sig: signal.Signals) -> None:
        info(f"{sig.name}: finishing the uploads in progress, then exiting (again to abort)")
        watcher.stop()

    def exit_now(sig: signal.Signals) -> None:
        info(f"{sig.name} again: exiting now; uncommitted uploads are abandoned")
        os._exit(128 + sig.value)

    with two_stage_interrupts(finish_then_exit, exit_now):
        if not json_mode():
            committed = watcher.committed_step
            info(
                f"watching {directory} -> {watcher.manager.url} (settle {settle:g}s, poll "
                f"{poll:g}s); committed step: {'none' if committed is None else committed}"
            )
        else:
            on_event(
                {
                    "event": "started",
                    "directory": str(directory),
                    "url": watcher.manager.url,
                    "committed_step": watcher.committed_step,
                }
            )
        watcher.run(poll, once=once)
    if watcher.fenced is not None:
        raise watcher.fenced
    given_up = watcher.given_up  # failed and not committed since (a retry may have)
    on_event(
        {
            "event": "stopped",
            "committed": len(watcher.committed),
            "failed": len(given_up),
            "committed_step": watcher.committed_step,
        }
    )
    if not json_mode():
        info(f"stopped: {len(watcher.committed)} checkpoint(s) committed this session")
    if given_up:
        warn(f"{len(given_up)} checkpoint(s) could not be uploaded: see the errors above")
        raise click.exceptions.Exit(ERROR)
