"""``cloudckpt watch``: the sidecar (see ``cloudckpt.watch`` for the rules)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from cloudckpt.cli._common import (
    DURATION,
    ERROR,
    RUN_URL,
    StoreArgs,
    arm_exit_watchdog,
    chunking_option,
    human_bytes,
    info,
    json_lines_option,
    json_mode,
    store_options,
    two_stage_interrupts,
    warn,
)
from cloudckpt.cli._main import cli
from cloudckpt.cli._retention import retention_options
from cloudckpt.errors import ConfigurationError

if TYPE_CHECKING:
    from cloudckpt.retention import RetentionOptions
    from cloudckpt.stores import RunURL, Store
    from cloudckpt.watch import Watcher

#: Seconds past the final upload budget after which the exit watchdog ends a watcher that
#: is stuck (in a hung filesystem call, say); the budget itself is enforced by the watcher.
WATCHDOG_MARGIN = 5.0


def _describe(event: dict[str, Any]) -> str | None:
    """One line of text for an event, or None (not worth a line; or the library's own
    warning already says it)."""
    kind = event["event"]
    if kind == "queued":
        return (
            f"uploading {event['source']} as step {event['step']} "
            f"({event['files']} files, {human_bytes(event['bytes'])}; complete: {event['rule']})"
        )
    if kind == "committed":
        return (
            f"committed {event['source']} as step {event['step']} "
            f"({human_bytes(event['bytes'])}) in {event['commit_seconds']:.1f}s"
        )
    if kind == "skipped":
        if "already committed" in event["reason"]:
            return None
        return f"not uploading {event['source']}: {event['reason']}"
    if kind == "ignored":
        more = event["count"] - len(event["files"])
        names = ", ".join(event["files"]) + (f" and {more} more" if more > 0 else "")
        return f"not uploading the files in {event['source']} ({names}): {event['reason']}"
    if kind == "waiting":
        return f"{event['directory']} does not exist yet: waiting for the trainer to create it"
    if kind == "appeared":
        return f"{event['directory']} exists now: watching it"
    if kind == "fenced":
        return f"stopping: {event['message']}"
    if kind == "flushing" and (event["pending"] or event["budget_seconds"] is not None):
        budget = event["budget_seconds"]
        within = "" if budget is None else f" (within {budget:.0f}s)"
        return f"final upload: taking every complete checkpoint{within}"
    # started/stopped are printed by the command; incomplete/not_uploaded are the library's
    # warnings, failed its error (in the CLI's style: ``setup_logging``), not said twice.
    return None


# watch_cmd runs past 60 lines only by its options (one parameter each) and its --help
# text (the docstring); what it does is in its body and helpers.
@cli.command("watch")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.argument("url", type=RUN_URL)
@click.option(
    "--settle",
    type=DURATION,
    default="2s",
    show_default=True,
    help="How long files must stay unchanged after a checkpoint looks complete, for layouts "
    "whose last write is not final (several HF ranks, accelerate). Others are taken at once.",
)
@click.option(
    "--quiet-period",
    type=DURATION,
    default="30s",
    show_default=True,
    help="With --accept-quiet-dirs: how long a directory must stay unchanged. Also when an "
    "incomplete checkpoint is reported as abandoned.",
)
@click.option("--poll", type=DURATION, default="1s", show_default=True, help="How often to look.")
@click.option(
    "--final-upload-timeout",
    type=DURATION,
    default="20s",
    show_default=True,
    help="On SIGTERM/Ctrl-C: how long to keep uploading what is complete before exiting. "
    "What does not fit stays on local disk, is listed, and the exit code is 1.",
)
@click.option(
    "--marker",
    multiple=True,
    default=(".complete",),
    show_default=True,
    help="File name that marks any directory as a complete checkpoint (repeatable).",
)
@click.option(
    "--accept-quiet-dirs",
    is_flag=True,
    help="Also upload any directory whose name ends with a step number once it is quiet "
    "for --quiet-period. Risky: a writer killed half-way leaves a quiet, partial directory.",
)
@click.option("--once", is_flag=True, help="Upload what is complete now, then exit.")
@click.option(
    "--staging-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Local staging directory (on DIRECTORY's filesystem for hard-link snapshots). "
    "Default: a temporary one.",
)
@retention_options
@chunking_option
@store_options
@json_lines_option
def watch_cmd(
    directory: Path,
    url: RunURL,
    settle: float,
    quiet_period: float,
    poll: float,
    final_upload_timeout: float,
    marker: tuple[str, ...],
    accept_quiet_dirs: bool,
    once: bool,
    staging_dir: Path | None,
    retention: RetentionOptions,
    chunking: str,
    store_args: StoreArgs,
    as_json: bool,
) -> None:
    """Upload and commit each complete checkpoint a trainer writes into DIRECTORY.

    A checkpoint is taken as soon as its framework's last write shows it complete: Hugging
    Face checkpoint-N/ once trainer_state.json (the Trainer's last file) is written;
    Lightning *.ckpt files (step=S in the name) once the torch.save zip is complete;
    accelerate checkpoints/checkpoint_N/ (step N: accelerate's save counter) once
    random_states_0.pkl is written and the files settle, or checkpoint_N+1 begins;
    directories holding a marker file. DIRECTORY may not exist yet: the watcher waits for
    it. Only moves forward: a checkpoint not newer than the committed step is never
    uploaded, so restarting the watcher re-uploads nothing.

    SIGTERM or Ctrl-C: keep uploading every complete checkpoint for up to
    --final-upload-timeout, then exit: 0 if everything complete was committed, 1 if not
    (each one left is listed with where its files are). A second signal exits at once
    (nothing half-committed). The watcher claims the run on its first upload, fencing any
    other writer of the run.
    """
    if once and not directory.is_dir():
        raise ConfigurationError(
            f"{directory} does not exist", hint="--once uploads what is there now; without "
            "--once the watcher waits for the directory to appear"
        )  # fmt: skip
    # One store, opened with every storage flag: the watcher reads the run from it and
    # saves through it.
    store = store_args.open(url)
    own_staging = None
    if staging_dir is None:  # ours, so that an abandoned upload can be cleaned up
        own_staging = Path(tempfile.mkdtemp(prefix="cloudckpt-watch-"))
    watcher = _new_watcher(
        directory,
        store,
        own_staging,
        settle=settle,
        quiet_period=quiet_period,
        markers=marker,
        accept_quiet_dirs=accept_quiet_dirs,
        final_upload_timeout=final_upload_timeout,
        staging_dir=staging_dir or own_staging,
        chunking=chunking,
        **retention.given(),  # unset: the run's stay
    )
    _run_until_stopped(watcher, store, own_staging, directory, poll, once)
    _conclude(watcher, store, own_staging)


def _new_watcher(
    directory: Path, store: Store, own_staging: Path | None, **options: Any
) -> Watcher:
    """A ``Watcher`` of ``directory`` saving through ``store`` (``options``: its keyword
    arguments and the manager's), printing its events.

    Raises: what ``Watcher`` raises (ConfigurationError, NeedsRepairError, NotARunError,
    StoreError), after removing ``own_staging`` and closing ``store``.
    """
    from cloudckpt.watch import Watcher

    try:
        return Watcher(directory, store, on_event=_print_event, **options)
    except BaseException:
        _remove(own_staging)
        store.close()
        raise


def _run_until_stopped(
    watcher: Watcher,
    store: Store,
    own_staging: Path | None,
    directory: Path,
    poll: float,
    once: bool,
) -> None:
    """Run ``watcher`` until it stops, under two-stage signal handling: the first SIGTERM or
    Ctrl-C starts the final upload (the exit watchdog armed past its budget), a second one
    ends the process at once, naming what was not committed.

    Raises: what ``watcher.run`` raises, after removing ``own_staging`` and closing
    ``store`` if no upload is still running.
    """
    budget = watcher.final_upload_timeout

    def finish_then_exit(sig: signal.Signals) -> None:
        info(
            f"{sig.name}: uploading what is complete (up to {budget:g}s), then "
            "exiting (again to abort)"
        )
        watcher.stop()
        arm_exit_watchdog(budget + WATCHDOG_MARGIN)

    def exit_now(sig: signal.Signals) -> None:
        left = watcher.outstanding()
        info(f"{sig.name} again: exiting now; uncommitted uploads are abandoned")
        _report_left(left, _print_event)
        _exit(128 + sig.value, own_staging, left)

    with two_stage_interrupts(finish_then_exit, exit_now):
        _announce(watcher, directory, poll, watcher.settle, budget)
        try:
            watcher.run(poll, once=once)
        except BaseException:  # an unexpected error: still leave no staging behind
            if not watcher.in_flight:
                _remove(own_staging)
                store.close()
            raise


def _print_event(event: dict[str, Any]) -> None:
    """An event on stdout as a JSON line (--json), or as a line of text on stderr."""
    if json_mode():
        click.echo(json.dumps(event, sort_keys=True))
        sys.stdout.flush()
    else:
        text = _describe(event)
        if text:
            info(text)


def _announce(
    watcher: Any, directory: Path, poll: float, settle: float, final_upload_timeout: float
) -> None:
    """Say what is watched, where to, and the committed step the watcher starts from."""
    if not json_mode():
        committed = watcher.committed_step
        info(
            f"watching {directory} -> {watcher.manager.url} (poll {poll:g}s, settle "
            f"{settle:g}s, final upload budget {final_upload_timeout:g}s); committed "
            f"step: {'none' if committed is None else committed}"
        )
    else:
        _print_event(
            {
                "event": "started",
                "directory": str(directory),
                "url": watcher.manager.url,
                "committed_step": watcher.committed_step,
            }
        )


def _conclude(watcher: Any, store: Store, own_staging: Path | None) -> None:
    """Report how the watcher ended and release what it used.

    Raises: the watcher's ``FencedError`` (another writer claimed the run); exit 1 if a
    checkpoint could not be uploaded or was left on local disk. Ends the process at once
    if uploads are still running past the budget (``_exit``).
    """
    if watcher.fenced is not None:
        _remove(own_staging)
        if not watcher.in_flight:
            store.close()
        raise watcher.fenced
    given_up = watcher.given_up  # failed and not committed since (a retry may have)
    left = watcher.not_uploaded
    _print_event(
        {
            "event": "stopped",
            "committed": len(watcher.committed),
            "failed": len(given_up),
            "not_uploaded": len(left),
            "committed_step": watcher.committed_step,
        }
    )
    if not json_mode():
        info(f"stopped: {len(watcher.committed)} checkpoint(s) committed this session")
    if given_up:
        warn(f"{len(given_up)} checkpoint(s) could not be uploaded: see the errors above")
    if left:
        warn(
            f"{len(left)} checkpoint(s) not uploaded before exiting, still on local disk: "
            + "; ".join(f"{item['source']} in {item['path']}" for item in left)
        )
    if watcher.in_flight:
        # Uploads still running past the budget: end the process now, so none of them can
        # commit after this report said it did not.
        _exit(ERROR, own_staging, left)
    _remove(own_staging)
    store.close()
    if given_up or left:
        raise click.exceptions.Exit(ERROR)


def _report_left(left: list[dict[str, Any]], on_event: Any) -> None:
    for item in left:
        if json_mode():
            on_event(item)
        else:
            warn(f"not committed: {item['source']} (step {item['step']}); its files are in "
                 f"{item['path']}")  # fmt: skip


def _exit(code: int, own_staging: Path | None, left: list[dict[str, Any]]) -> None:
    """End the process at once (upload threads cannot be stopped otherwise). Our staging
    directory goes too, unless a copy listed as left behind lives only there."""
    if own_staging is not None and not any(
        Path(item["path"]).is_relative_to(own_staging) for item in left
    ):
        _remove(own_staging)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _remove(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
