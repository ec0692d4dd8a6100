"""What every command shares: exit codes, error reporting, storage options, output.

Exit codes are decided here and only here (``EXIT_CODES``), from the library's error tree.
Errors are printed as one ``cloudckpt: error: ...`` line plus the error's hint, never with a
traceback (``-v`` adds it) and never with credentials (the library redacts URLs and scrubs
secrets; the CLI never echoes option values).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

from cloudckpt.admin import ActiveWriterError
from cloudckpt.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    CloudCkptError,
    CommitConflictError,
    CommitStateUnknownError,
    ConfigurationError,
    CorruptionError,
    CredentialsError,
    DestinationNotEmptyError,
    FencedError,
    NeedsRepairError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreConflictError,
    TransientStoreError,
    UnknownFormatError,
    UnsafePathError,
)
from cloudckpt.retention import parse_duration

if TYPE_CHECKING:
    from cloudckpt.stores import RunURL, Store

# --- exit codes ------------------------------------------------------------------------

OK = 0
ERROR = 1  # anything not listed below
USAGE = 2  # bad arguments, bad URL, bad option, not a run (click's usage errors are 2 too)
NOT_FOUND = 3  # no such checkpoint / step / bucket; an empty run where one was needed
DAMAGED = 4  # verification failed: corrupt or missing data, hostile manifest
CONFLICT = 5  # fenced, or another writer is active / won the race
NEEDS_REPAIR = 6  # checkpoints exist but LATEST is missing or unreadable
DEST_NOT_EMPTY = 7  # restore destination holds files (use --force)
ACCESS = 8  # no credentials, or not allowed
UNAVAILABLE = 9  # the store is unreachable or the outcome is unknown: retry later
NEWER_FORMAT = 10  # a newer cloudckpt wrote something this version does not know: upgrade
INTERRUPTED = 130  # SIGINT / SIGTERM

#: Most specific first: the first class an error is an instance of decides its code.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (UnknownFormatError, NEWER_FORMAT),
    (DestinationNotEmptyError, DEST_NOT_EMPTY),
    (NeedsRepairError, NEEDS_REPAIR),
    (CheckpointNotFoundError, NOT_FOUND),
    (BucketNotFoundError, NOT_FOUND),
    (ObjectNotFoundError, NOT_FOUND),
    (CorruptionError, DAMAGED),
    (UnsafePathError, DAMAGED),
    (FencedError, CONFLICT),
    (ActiveWriterError, CONFLICT),
    (CommitConflictError, CONFLICT),
    (PreconditionFailedError, CONFLICT),
    (StoreConflictError, CONFLICT),
    (CredentialsError, ACCESS),
    (PermissionDeniedError, ACCESS),
    (CommitStateUnknownError, UNAVAILABLE),
    (OutcomeUnknownError, UNAVAILABLE),
    (TransientStoreError, UNAVAILABLE),
    (ConfigurationError, USAGE),
    (CloudCkptError, ERROR),
)

EXIT_CODE_TABLE = (
    (OK, "success (verify: everything checked is intact)"),
    (ERROR, "any other error"),
    (
        USAGE,
        "bad usage: unknown option, bad or mistyped URL, a run location holding other "
        "data, an empty push source, bad storage option or duration",
    ),
    (NOT_FOUND, "not found: no such step, no checkpoint, no such bucket"),
    (DAMAGED, "damaged: verification failed, or nothing intact to restore"),
    (CONFLICT, "conflict: fenced by a newer writer, or an active writer would be fenced"),
    (NEEDS_REPAIR, "needs repair: checkpoints exist but LATEST is missing or unreadable"),
    (DEST_NOT_EMPTY, "restore destination is not empty (use --force), or cannot be one"),
    (ACCESS, "credentials missing or rejected, or permission denied"),
    (UNAVAILABLE, "store unreachable, or a write's outcome unknown: retry later"),
    (
        NEWER_FORMAT,
        "a newer cloudckpt wrote this run (a format or setting this one does not know): upgrade",
    ),
    (INTERRUPTED, "interrupted (SIGINT/SIGTERM); nothing half-done is left visible"),
)


def exit_code_for(exc: BaseException) -> int:
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return ERROR


class Interrupted(BaseException):
    """SIGTERM, turned into an exception so cleanup (``finally``) runs as for Ctrl-C."""


#: Seconds an interrupted command may spend cleaning up before the process exits anyway.
CLEANUP_GRACE = 20.0
_CLEANUP_OVERRAN = "cloudckpt: cleanup after the interrupt did not finish"


def arm_exit_watchdog(seconds: float | None = None) -> None:
    """After an interrupt, end the process within ``seconds`` (default ``CLEANUP_GRACE``)
    whatever the cleanup is stuck on (a user's Ctrl-C must always work). `watch` arms it
    with its final upload budget plus a margin. Nothing half-done becomes
    visible by exiting early: restores place files atomically and the next restore
    removes a leftover temporary directory; uploads are never committed. If it fires, it
    prints every thread's stack first, so the stuck place can be found and fixed."""
    import faulthandler
    import os
    import threading

    grace = CLEANUP_GRACE if seconds is None else seconds

    def overran() -> None:
        sys.stderr.write(f"{_CLEANUP_OVERRAN} within {grace:.0f} s; exiting now\n")
        sys.stderr.flush()
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(INTERRUPTED)

    timer = threading.Timer(grace, overran)
    timer.daemon = True
    timer.start()


def _on_sigterm(signum: int, frame: Any) -> None:
    arm_exit_watchdog()
    raise Interrupted()


def _on_sigint(signum: int, frame: Any) -> None:
    arm_exit_watchdog()
    raise KeyboardInterrupt


@contextlib.contextmanager
def two_stage_interrupts(
    on_first: Callable[[signal.Signals], None], on_second: Callable[[signal.Signals], None]
) -> Iterator[None]:
    """SIGTERM and Ctrl-C as a flush, then an abort, for commands that wait on uploads.

    The handlers only call back (with the signal); they never raise into the
    waiting code, so no signal can land half-way through handing a save over or printing
    the first notice and escape the command's own handling (a raised interrupt there left
    `push` waiting for an upload it had been told to abandon). ``on_second`` normally
    ends the process with ``os._exit``; abandoning uploads is safe because nothing
    uncommitted is ever visible, and GC reclaims the rest.
    """
    count = 0

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal count
        count += 1
        (on_first if count == 1 else on_second)(signal.Signals(signum))

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# --- output ----------------------------------------------------------------------------

_JSON_KEY = "cloudckpt.json"
_VERBOSE_KEY = "cloudckpt.verbose"
_LOGGING_KEY = "cloudckpt.logging"


def _root_meta() -> dict[str, Any]:
    ctx = click.get_current_context(silent=True)
    return ctx.find_root().meta if ctx is not None else {}


def json_mode() -> bool:
    return bool(_root_meta().get(_JSON_KEY))


def _set_json(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.find_root().meta[_JSON_KEY] = True
    return value


json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    callback=_set_json,
    expose_value=True,
    is_eager=True,
    help="Print one machine-readable JSON document on stdout (logs go to stderr).",
)


#: ``watch --json``: the same switch, for a stream of events rather than one document.
json_lines_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    callback=_set_json,
    expose_value=True,
    is_eager=True,
    help="Print every event on stdout as one JSON object per line (logs go to stderr).",
)


chunking_option = click.option(
    "--chunking",
    type=click.Choice(["tensor", "fixed", "off"]),  # cloudckpt.chunks.MODES
    default="tensor",
    show_default=True,
    help="How files are stored: content-addressed chunks cut at tensor boundaries (only "
    "chunks the run does not hold yet are uploaded), chunks at 8 MiB boundaries only, or "
    "whole files.",
)


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def info(message: str) -> None:
    """A human-facing line on stderr (stdout stays clean for results and JSON)."""
    click.echo(message, err=True)


def warn(message: str) -> None:
    click.echo(click.style("warning: ", fg="yellow") + message, err=True)


def stdout_console() -> Any:
    """Tables on stdout, as wide as the terminal; when stdout is not a terminal, as wide as
    ``COLUMNS`` says, else 200 columns (every column, one line per row, for grep)."""
    import os

    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console = Console(highlight=False, width=200)
    return console


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


@contextlib.contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar on stderr when it is a terminal (and not --json); yields the
    byte-count callback to hand to the library, or None when no bar is shown."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    if json_mode() or not console.is_terminal:
        yield None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        _rate_column(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def _rate_column() -> Any:
    """The progress bar's rate in the sizes' units: ``612.3 MiB/s`` beside ``12.0/38.2
    MiB`` (rich's own speed column says ``MB/s``, in units of 10^6 bytes)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            if speed is None:
                return Text("?", style="progress.data.speed")
            return Text(human_bytes(speed) + "/s", style="progress.data.speed")

    return RateColumn()


# --- durations and key=value options -----------------------------------------------------

# One parser for durations everywhere (the retention options parse the same strings).


class Duration(click.ParamType):
    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = Duration()


def parse_key_values(items: tuple[str, ...], what: str) -> dict[str, Any]:
    """``KEY=VALUE`` (a string; ``true``/``false`` become booleans) or ``KEY:=JSON``.
    Values are never echoed in errors: they may be secrets."""
    out: dict[str, Any] = {}
    for item in items:
        eq = item.find("=")
        if eq <= 0:
            raise click.BadParameter(
                f"{item.split('=')[0]!r} is not KEY=VALUE or KEY:=JSON", param_hint=what
            )
        if item[eq - 1] == ":":
            key, raw = item[: eq - 1], item[eq + 1 :]
            try:
                value: Any = json.loads(raw)
            except ValueError:
                raise click.BadParameter(
                    f"the value of {key!r} is not valid JSON (KEY:=JSON)", param_hint=what
                ) from None
        else:
            key, value = item[:eq], item[eq + 1 :]
            value = {"true": True, "false": False}.get(value.lower(), value)
        key = key.strip()
        if not key:
            raise click.BadParameter("empty key", param_hint=what)
        out[key] = value
    return out


# --- run URLs and storage options ----------------------------------------------------


class RunURLType(click.ParamType):
    """A run URL argument, parsed once, as the command line is read, into the ``RunURL``
    the command passes on (to ``StoreArgs.open``). A bad URL raises the library's
    ``ConfigurationError`` (exit 2, with its hint), as opening it would."""

    name = "url"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        from cloudckpt.stores import parse_url

        return parse_url(value)


RUN_URL = RunURLType()


@dataclasses.dataclass(frozen=True)
class StoreArgs:
    endpoint_url: str | None
    profile: str | None
    region: str | None
    options: tuple[str, ...]
    unsafe_single_writer: bool

    def storage_options(self, url: RunURL) -> dict[str, Any]:
        """The storage options for ``url`` from the flags (the environment is read by the
        store layer itself: AWS_*, STORAGE_EMULATOR_HOST, application default credentials)."""
        scheme = url.scheme
        opts = parse_key_values(self.options, "--storage-option")
        s3 = scheme in ("s3", "s3a")
        if (self.profile or self.region) and not s3:
            flag = "--profile" if self.profile else "--region"
            raise click.UsageError(f"{flag} applies to s3:// URLs only")
        if self.endpoint_url and scheme not in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"):
            raise click.UsageError("--endpoint-url applies to s3://, gs:// and az:// URLs only")
        if self.endpoint_url:
            opts["endpoint_url"] = self.endpoint_url
        if self.profile:
            opts["profile"] = self.profile
        if self.region:
            opts["region_name"] = self.region
        return opts

    def open(self, url: RunURL, *, writable: bool = True) -> Store:
        """The store at ``url``, opened with the flags (``url`` is not parsed again)."""
        from cloudckpt.stores import open_store

        return open_store(
            url,
            self.storage_options(url),
            writable=writable,
            unsafe_single_writer=self.unsafe_single_writer,
        )


def store_options(f: Callable) -> Callable:
    """Add the storage flags to a command; it receives them as ``store_args``."""

    @click.option(
        "--endpoint-url",
        metavar="URL",
        help="S3/GCS/Azure endpoint (S3-compatible stores, emulators; for az:// the blob "
        "account URL). Env: AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST, "
        "AZURE_STORAGE_CONNECTION_STRING.",
    )
    @click.option("--profile", metavar="NAME", help="AWS profile (s3:// only). Env: AWS_PROFILE.")
    @click.option("--region", metavar="REGION", help="AWS region (s3:// only). Env: AWS_REGION.")
    @click.option(
        "--storage-option",
        "-o",
        "storage_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="A storage option as fsspec takes it (repeatable); KEY:=JSON for non-strings, "
        "e.g. -o anon=true, -o token=anon, -o 'client_kwargs:={\"verify\": false}'.",
    )
    @click.option(
        "--unsafe-single-writer",
        is_flag=True,
        help="Allow writing to a backend without conditional writes. Safe only if exactly "
        "one process ever writes the run.",
    )
    @functools.wraps(f)
    def wrapper(
        *args: Any,
        endpoint_url: str | None,
        profile: str | None,
        region: str | None,
        storage_option: tuple[str, ...],
        unsafe_single_writer: bool,
        **kwargs: Any,
    ) -> Any:
        kwargs["store_args"] = StoreArgs(
            endpoint_url, profile, region, storage_option, unsafe_single_writer
        )
        return f(*args, **kwargs)

    return wrapper


# --- the group that turns errors into exit codes -------------------------------------------


def report_error(exc: BaseException, code: int, doc: dict[str, Any] | None = None) -> None:
    """Say that the command fails with ``exc`` (exit ``code``): with ``--json``, one document
    on stdout, ``doc`` (what the command has to show besides, e.g. ``runs``' listing) or an
    empty one, with an ``error`` object; always the message and hint on stderr."""
    if isinstance(exc, CloudCkptError):  # the hint in the CLI's words where they differ
        message, hint = exc.message, exc.cli_hint or exc.hint
    else:
        message, hint = f"{type(exc).__name__}: {exc}", ""
    if json_mode():
        error = {"type": type(exc).__name__, "message": message, "hint": hint or None}
        emit_json({**(doc or {}), "error": {**error, "exit_code": code}})
    click.echo(click.style("cloudckpt: error: ", fg="red", bold=True) + message, err=True)
    if hint:
        click.echo(f"hint: {hint}", err=True)


class CloudCkptGroup(click.Group):
    """Runs a subcommand and maps what it raises to the documented exit codes."""

    def invoke(self, ctx: click.Context) -> Any:
        previous = {}
        with contextlib.suppress(ValueError):  # not in the main thread: leave signals alone
            previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _on_sigterm)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                previous[signal.SIGINT] = signal.signal(signal.SIGINT, _on_sigint)
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (KeyboardInterrupt, Interrupted):
            click.echo("cloudckpt: interrupted", err=True)
            ctx.exit(INTERRUPTED)
        except CloudCkptError as exc:
            code = exit_code_for(exc)
            report_error(exc, code)
            if _root_meta().get(_VERBOSE_KEY, 0) > 1:
                traceback.print_exc(file=sys.stderr)
            ctx.exit(code)
        except Exception as exc:
            report_error(exc, ERROR)
            click.echo(
                "this is a bug in cloudckpt or an unexpected environment problem; "
                "re-run with -vv for the traceback",
                err=True,
            )
            if _root_meta().get(_VERBOSE_KEY, 0) > 1:
                traceback.print_exc(file=sys.stderr)
            ctx.exit(ERROR)
        finally:
            teardown_logging(ctx.find_root().meta)
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def setup_logging(verbose: int) -> None:
    """Library logs to stderr: warnings by default, -v info, -vv debug (undone on exit)."""
    meta = _root_meta()
    meta[_VERBOSE_KEY] = verbose
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logger = logging.getLogger("cloudckpt")
    handler = _CliLogHandler()
    meta[_LOGGING_KEY] = (handler, logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


class _CliLogHandler(logging.Handler):
    """The library's logs in the CLI's own style, so that each event is one line of one
    kind: a warning as ``warning: ...`` (what ``warn`` prints), an error as ``error: ...``,
    -v's info and debug as ``cloudckpt: info: ...``. The CLI does not repeat what the
    library logs (a skipped damaged checkpoint, a failed ``watch`` upload)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = logging.Formatter("%(message)s").format(record)
            if record.levelno >= logging.ERROR:
                click.echo(click.style("error: ", fg="red") + message, err=True)
            elif record.levelno >= logging.WARNING:
                warn(message)
            else:
                click.echo(f"cloudckpt: {record.levelname.lower()}: {message}", err=True)
        except Exception:  # a log line must never end the command
            self.handleError(record)


def teardown_logging(meta: dict[str, Any]) -> None:
    saved = meta.pop(_LOGGING_KEY, None)
    if saved is not None:
        handler, level, propagate = saved
        logger = logging.getLogger("cloudckpt")
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
