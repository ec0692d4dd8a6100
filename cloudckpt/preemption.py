"""Preemption notices: signals and the spot/preemptible notices of AWS, GCE and Azure.

A ``PreemptionWatcher`` turns every way a cloud says "this machine is going away" into one
flag that a training loop can check at each step boundary::

    from cloudckpt.preemption import PreemptionWatcher

    with PreemptionWatcher() as watcher:          # SIGTERM + the cloud this host runs on
        for step in range(start, total):
            train_step()
            if watcher.preempted:
                save_checkpoint(step).result(timeout=watcher.seconds_left())
                break

Sources (``sources=`` names them; ``"auto"`` picks ``signal`` plus the cloud this host runs
on, detected from DMI data in ``/sys/class/dmi/id`` without any network request):

=========  ==========================================================================
``signal``  SIGTERM by default (``signals=``). Kubernetes, Slurm, systemd, GCE/Azure
            shutdown and ``docker stop`` all send it before killing the process.
``aws``     EC2 spot ``instance-action`` (IMDSv2: PUT ``/latest/api/token``, then GET
            ``/latest/meta-data/spot/instance-action``; 404 means no notice). The
            notice's ``time`` (about two minutes ahead) becomes the deadline.
``gce``     ``/computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``;
            ``TRUE`` means preempted. GCE gives 30 s, so the deadline is notice + 30 s.
``azure``   Scheduled Events (``/metadata/scheduledevents``, ``Metadata: true``): an
            event of type ``Preempt`` (``event_types=``) naming this VM. ``NotBefore`` is
            the deadline.
=========  ==========================================================================

Endpoints default to the real metadata services and can be changed with arguments
(``aws_url=``, ``gce_url=``, ``azure_url=``) or environment variables
(``CLOUDCKPT_AWS_METADATA_URL``, ``CLOUDCKPT_GCE_METADATA_URL``,
``CLOUDCKPT_AZURE_METADATA_URL``; also the standard ``AWS_EC2_METADATA_SERVICE_ENDPOINT``
and ``GCE_METADATA_HOST``). ``CLOUDCKPT_PREEMPTION_SOURCES=signal,aws`` overrides
``"auto"``. Setting an endpoint variable adds that source to ``"auto"``.

Polling runs in one daemon thread every ``interval`` seconds (5 by default) with short
request timeouts. A metadata request that fails, times out or answers nonsense is logged at
DEBUG and retried at the next poll: a watcher never raises into training.

Signals: handlers are installed only from the main thread (Python's rule); started
elsewhere, the watcher logs a warning and watches the cloud sources only. The first signal
sets the flag and calls a previously installed Python handler (so frameworks that also
listen, such as Lightning, still hear it), but not the default action (which would end the
process before the emergency save). A second identical signal (``escalate_on_repeat``)
restores the previous disposition and re-delivers the signal, so an impatient operator can
still stop the process the usual way. ``stop()`` restores the previous handlers. The
handler itself only records the signal and writes one byte to a pipe; the flag's event and
the callbacks are set and run on the watcher thread, never inside the signal handler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import email.utils
import http.client
import json
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any
from urllib.parse import urlsplit

from cloudckpt.errors import ConfigurationError

__all__ = [
    "AWSSpotSource",
    "AzureScheduledEventsSource",
    "GCEPreemptedSource",
    "PreemptionNotice",
    "PreemptionSource",
    "PreemptionWatcher",
    "detect_clouds",
]

log = logging.getLogger("cloudckpt.preemption")

DEFAULT_INTERVAL = 5.0
DEFAULT_TIMEOUT = 1.0
GCE_NOTICE_SECONDS = 30.0  # GCE's documented preemption notice
_MAX_BODY = 64 * 1024

AWS_DEFAULT_URL = "http://169.254.169.254"
GCE_DEFAULT_URL = "http://metadata.google.internal"
AZURE_DEFAULT_URL = "http://169.254.169.254"
AZURE_API_VERSION = "2020-07-01"
AZURE_COMPUTE_API_VERSION = "2021-02-01"
_AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"


@dataclasses.dataclass(frozen=True)
class PreemptionNotice:
    """One notice that this machine is going away.

    ``source``: ``"signal"``, ``"aws"``, ``"gce"``, ``"azure"``, ``"manual"`` or a custom
    source's name. ``reason``: a human-readable line for logs. ``received_at`` and
    ``deadline`` are ``time.time()`` values; ``deadline`` is when the machine may vanish, if
    the source says (None otherwise). ``detail``: the raw notice (parsed JSON, signal number).
    """

    source: str
    reason: str
    received_at: float
    deadline: float | None = None
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until ``deadline`` (never negative), or None when it is unknown."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - (time.time() if now is None else now))


# ------------------------------------------------------------------------------ HTTP


def _base_url(url: str, what: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(
            f"{what} endpoint {url!r} is not an http(s)://host[:port] URL",
            hint="Pass e.g. http://169.254.169.254 or http://127.0.0.1:8080",
        )
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def _request(
    method: str, url: str, headers: Mapping[str, str], timeout: float
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request with ``http.client`` (never through an HTTP proxy: metadata
    services are link-local). Returns (status, lower-cased headers, body)."""
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=timeout)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(method, target, headers=dict(headers))
        resp = conn.getresponse()
        body = resp.read(_MAX_BODY)
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


# ------------------------------------------------------------------------------ sources


class PreemptionSource:
    """A polled source of preemption notices. Subclass and implement ``poll()``.

    ``poll()`` returns a notice, or None when there is none; it may raise anything (the
    watcher logs it at DEBUG and polls again later).
    """

    name = "custom"

    def poll(self) -> PreemptionNotice | None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


class AWSSpotSource(PreemptionSource):
    """EC2 spot interruption notices through IMDSv2.

    A session token (``PUT /latest/api/token``) is fetched once and reused until shortly
    before it expires, or sooner if the service answers 401. If no token can be had (IMDS
    hop limit in a container, a service that only speaks IMDSv1), the GET is sent without
    one; IMDSv1-only hosts then still work.
    """

    name = "aws"
    TOKEN_PATH = "/latest/api/token"
    NOTICE_PATH = "/latest/meta-data/spot/instance-action"

    def __init__(
        self, url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT, token_ttl: int = 21600
    ) -> None:
        raw = (
            url
            or _env("CLOUDCKPT_AWS_METADATA_URL", "AWS_EC2_METADATA_SERVICE_ENDPOINT")
            or AWS_DEFAULT_URL
        )
        self.url = _base_url(raw, "AWS metadata")
        self.timeout = timeout
        self.token_ttl = int(token_ttl)
        self._token: str | None = None
        self._token_expires = 0.0

    def _get_token(self) -> str | None:
        if self._token and time.monotonic() < self._token_expires:
            return self._token
        self._token = None
        try:
            status, _, body = _request(
                "PUT",
                self.url + self.TOKEN_PATH,
                {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)},
                self.timeout,
            )
        except OSError as exc:
            log.debug("aws: no IMDSv2 token from %s: %s", self.url, exc)
            return None
        if status != 200 or not body:
            log.debug("aws: IMDSv2 token request answered %d", status)
            return None
        self._token = body.decode("ascii", "replace").strip()
        # Refresh a minute early (or halfway, for very short TTLs).
        self._token_expires = time.monotonic() + max(
            1.0, min(self.token_ttl - 60, self.token_ttl / 2)
        )
        return self._token

    def poll(self) -> PreemptionNotice | None:
        for _ in range(2):  # a second round after a 401 (expired or revoked token)
            token = self._get_token()
            headers = {"X-aws-ec2-metadata-token": token} if token else {}
            status, _, body = _request("GET", self.url + self.NOTICE_PATH, headers, self.timeout)
            if status == 401 and token:
                self._token = None
                continue
            break
        if status == 404:
            return None
        if status != 200:
            log.debug("aws: instance-action answered %d", status)
            return None
        doc = json.loads(body)
        action = str(doc.get("action", "terminate"))
        deadline = _parse_iso(doc.get("time"))
        when = f" at {doc['time']}" if doc.get("time") else ""
        return PreemptionNotice(
            source=self.name,
            reason=f"AWS spot interruption: {action}{when}",
            received_at=time.time(),
            deadline=deadline,
            detail=doc,
        )

    def __repr__(self) -> str:
        return f"<AWSSpotSource {self.url}>"


class GCEPreemptedSource(PreemptionSource):
    """GCE preemptible/spot VMs: ``instance/preempted`` turns ``TRUE``.

    The answer must carry ``Metadata-Flavor: Google`` (as the real service's does), so a
    captive portal or another service answering on that address is never mistaken for it.
    """

    name = "gce"
    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        notice_seconds: float = GCE_NOTICE_SECONDS,
    ) -> None:
        raw = url or _env("CLOUDCKPT_GCE_METADATA_URL")
        if raw is None and _env("GCE_METADATA_HOST"):
            raw = "http://" + os.environ["GCE_METADATA_HOST"].strip()
        self.url = _base_url(raw or GCE_DEFAULT_URL, "GCE metadata")
        self.timeout = timeout
        self.notice_seconds = notice_seconds

    def poll(self) -> PreemptionNotice | None:
        status, headers, body = _request(
            "GET", self.url + self.PATH, {"Metadata-Flavor": "Google"}, self.timeout
        )
        if status != 200:
            log.debug("gce: preempted answered %d", status)
            return None
        if headers.get("metadata-flavor", "").lower() != "google":
            log.debug("gce: answer without Metadata-Flavor: Google; not a GCE metadata server")
            return None
        if body.strip().upper() != b"TRUE":
            return None
        now = time.time()
        return PreemptionNotice(
            source=self.name,
            reason="GCE preemption (instance/preempted is TRUE)",
            received_at=now,
            deadline=now + self.notice_seconds,
            detail={"preempted": True},
        )

    def __repr__(self) -> str:
        return f"<GCEPreemptedSource {self.url}>"


class AzureScheduledEventsSource(PreemptionSource):
    """Azure Scheduled Events: an event of type ``Preempt`` (spot eviction) for this VM.

    Events are delivered to every VM of an availability set or scale-set placement group,
    so an event counts only if its ``Resources`` name this VM (its compute name, read once
    from ``/metadata/instance/compute/name``). If the name cannot be read, every matching
    event counts (logged once). Add ``"Terminate"`` to ``event_types`` to treat scale-in
    terminate notifications as preemption too.
    """

    name = "azure"
    EVENTS_PATH = "/metadata/scheduledevents"
    NAME_PATH = "/metadata/instance/compute/name"

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout: float = 3.0,
        event_types: Iterable[str] = ("Preempt",),
        api_version: str = AZURE_API_VERSION,
        vm_name: str | None = None,
    ) -> None:
        raw = url or _env("CLOUDCKPT_AZURE_METADATA_URL") or AZURE_DEFAULT_URL
        self.url = _base_url(raw, "Azure metadata")
        self.timeout = timeout
        self.event_types = frozenset(event_types)
        self.api_version = api_version
        self._vm_name = vm_name
        self._name_tried = vm_name is not None
        self._warned_no_name = False

    def _name(self) -> str | None:
        if self._name_tried:
            return self._vm_name
        status, _, body = _request(
            "GET",
            f"{self.url}{self.NAME_PATH}?api-version={AZURE_COMPUTE_API_VERSION}&format=text",
            {"Metadata": "true"},
            self.timeout,
        )
        if status == 200 and body.strip():
            self._vm_name = body.decode("utf-8", "replace").strip()
        self._name_tried = True
        return self._vm_name

    def poll(self) -> PreemptionNotice | None:
        status, _, body = _request(
            "GET",
            f"{self.url}{self.EVENTS_PATH}?api-version={self.api_version}",
            {"Metadata": "true"},
            self.timeout,
        )
        if status != 200:
            log.debug("azure: scheduledevents answered %d", status)
            return None
        doc = json.loads(body)
        events = [e for e in doc.get("Events") or [] if e.get("EventType") in self.event_types]
        if not events:
            return None
        try:
            name = self._name()
        except OSError as exc:
            log.debug("azure: cannot read the VM name: %s", exc)
            self._name_tried = True
            name = None
        for event in events:
            resources = [str(r).lower() for r in event.get("Resources") or []]
            if name is not None and resources and name.lower() not in resources:
                continue
            if name is None and not self._warned_no_name:
                log.warning(
                    "azure: VM name unknown; acting on %s events for any VM", event["EventType"]
                )
                self._warned_no_name = True
            now = time.time()
            deadline = _parse_http_date(event.get("NotBefore")) or now
            return PreemptionNotice(
                source=self.name,
                reason=(
                    f"Azure scheduled event {event.get('EventType')} "
                    f"(not before {event.get('NotBefore') or 'now'})"
                ),
                received_at=now,
                deadline=deadline,
                detail=event,
            )
        return None

    def __repr__(self) -> str:
        return f"<AzureScheduledEventsSource {self.url}>"


def _parse_iso(value: Any) -> float | None:
    if not value or not isinstance(value, str):
        return None
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def _parse_http_date(value: Any) -> float | None:
    if not value or not isinstance(value, str):
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------ detection


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def detect_clouds(dmi_dir: str | os.PathLike[str] = "/sys/class/dmi/id") -> list[str]:
    """The clouds this host appears to run on (``"aws"``, ``"gce"``, ``"azure"``), from
    DMI data only: no network request is made."""
    root = Path(dmi_dir)
    vendor = _read(root / "sys_vendor")
    board = _read(root / "board_vendor")
    product = _read(root / "product_name")
    bios = _read(root / "bios_vendor")
    uuid = _read(root / "product_uuid").lower()
    asset = _read(root / "chassis_asset_tag")
    found = []
    if "Amazon EC2" in (vendor, board) or bios.startswith("Amazon") or uuid.startswith("ec2"):
        found.append("aws")
    if product.startswith("Google Compute Engine") or vendor == "Google":
        found.append("gce")
    if asset == _AZURE_ASSET_TAG:
        found.append("azure")
    return found


_SOURCE_CLASSES: dict[str, Callable[..., PreemptionSource]] = {
    "aws": AWSSpotSource,
    "gce": GCEPreemptedSource,
    "azure": AzureScheduledEventsSource,
}
_ENDPOINT_ENV = {
    "aws": "CLOUDCKPT_AWS_METADATA_URL",
    "gce": "CLOUDCKPT_GCE_METADATA_URL",
    "azure": "CLOUDCKPT_AZURE_METADATA_URL",
}


def _auto_sources(dmi_dir: str | os.PathLike[str]) -> list[str]:
    override = os.environ.get("CLOUDCKPT_PREEMPTION_SOURCES", "").strip()
    if override:
        return [s.strip() for s in override.split(",") if s.strip()]
    names = ["signal"]
    clouds = detect_clouds(dmi_dir)
    for cloud, var in _ENDPOINT_ENV.items():
        if os.environ.get(var) and cloud not in clouds:
            clouds.append(cloud)
    aws_off = os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() in ("1", "true", "yes")
    if aws_off and "aws" in clouds and not os.environ.get(_ENDPOINT_ENV["aws"]):
        log.info("AWS_EC2_METADATA_DISABLED is set: not polling AWS spot notices")
        clouds.remove("aws")
    return names + clouds


# ------------------------------------------------------------------------------ watcher


NoticeCallback = Callable[[PreemptionNotice], Any]


class PreemptionWatcher:
    """Watch for preemption; expose a flag, an event and callbacks.

    Args:
        sources: ``"auto"`` (signals plus the detected cloud), or a list of ``"signal"``,
            ``"aws"``, ``"gce"``, ``"azure"`` and ``PreemptionSource`` objects.
        signals: the signals that mean "preempted" (SIGTERM by default).
        interval: seconds between polls of the cloud sources.
        timeout: per-request timeout for the cloud sources (their defaults when None).
        aws_url, gce_url, azure_url: metadata endpoints (see the module docstring).
        signal_grace: seconds a signal leaves before the hard kill, if you know it (e.g.
            Kubernetes ``terminationGracePeriodSeconds``); sets the notice's deadline.
        on_preempt: a callback or list of callbacks, called once with the notice on the
            watcher thread (exceptions are logged, not raised).
        escalate_on_repeat: a second identical signal restores the previous disposition
            and re-delivers the signal (so a second SIGTERM or Ctrl-C still stops you).

    Use as a context manager, or call ``start()`` and ``stop()``.
    """

    def __init__(
        self,
        sources: str | Sequence[str | PreemptionSource] = "auto",
        *,
        signals: Iterable[int] = (signal.SIGTERM,),
        interval: float = DEFAULT_INTERVAL,
        timeout: float | None = None,
        aws_url: str | None = None,
        gce_url: str | None = None,
        azure_url: str | None = None,
        signal_grace: float | None = None,
        on_preempt: NoticeCallback | Sequence[NoticeCallback] | None = None,
        escalate_on_repeat: bool = True,
        _dmi_dir: str | os.PathLike[str] = "/sys/class/dmi/id",
    ) -> None:
        if interval <= 0:
            raise ConfigurationError("interval must be positive")
        if isinstance(sources, str):
            if sources != "auto":
                sources = [s.strip() for s in sources.split(",") if s.strip()]
            else:
                sources = _auto_sources(_dmi_dir)
        urls = {"aws": aws_url, "gce": gce_url, "azure": azure_url}
        self.watch_signals = False
        self.sources: list[PreemptionSource] = []
        for src in sources:
            if isinstance(src, PreemptionSource):
                self.sources.append(src)
            elif src == "signal":
                self.watch_signals = True
            elif src in _SOURCE_CLASSES:
                kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
                self.sources.append(_SOURCE_CLASSES[src](urls[src], **kwargs))
            else:
                raise ConfigurationError(
                    f"unknown preemption source {src!r}",
                    hint="Use 'signal', 'aws', 'gce', 'azure' or a PreemptionSource object",
                )
        self.signals = tuple(signal.Signals(s) for s in signals) if self.watch_signals else ()
        self.interval = float(interval)
        self.signal_grace = signal_grace
        self.escalate_on_repeat = escalate_on_repeat
        if on_preempt is None:
            self._callbacks: list[NoticeCallback] = []
        elif callable(on_preempt):
            self._callbacks = [on_preempt]
        else:
            self._callbacks = list(on_preempt)

        self.event = threading.Event()
        self._lock = threading.Lock()
        self._notice: PreemptionNotice | None = None
        self._dispatched = False
        self._signal_seen: tuple[int, float] | None = None  # written by the signal handler
        self._signal_counts: dict[int, int] = {}
        self._previous: dict[int, Any] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._rfd: int | None = None
        self._wfd: int | None = None

    # ---------------------------------------------------------------- state

    @property
    def preempted(self) -> bool:
        """True once any source gave notice (cheap; check it at every step)."""
        return self._signal_seen is not None or self.event.is_set()

    @property
    def notice(self) -> PreemptionNotice | None:
        """The first notice, or None."""
        if self._notice is None and self._signal_seen is not None:
            self._record(self._signal_notice(*self._signal_seen))
        return self._notice

    @property
    def reason(self) -> str | None:
        notice = self.notice
        return None if notice is None else notice.reason

    @property
    def deadline(self) -> float | None:
        """``time.time()`` by which the machine may vanish, when the source says."""
        notice = self.notice
        return None if notice is None else notice.deadline

    def seconds_left(self, default: float | None = None) -> float | None:
        """Seconds until the deadline; ``default`` when there is no notice or no deadline."""
        notice = self.notice
        left = None if notice is None else notice.seconds_left()
        return default if left is None else left

    def wait(self, timeout: float | None = None) -> bool:
        """Block until preempted (True) or ``timeout`` passes (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.preempted:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self.event.wait(0.1 if remaining is None else min(0.1, remaining))
        return True

    def add_callback(self, callback: NoticeCallback) -> None:
        """Call ``callback(notice)`` on preemption (at once, if it already happened)."""
        with self._lock:
            self._callbacks.append(callback)
            already = self._dispatched
        if already and self._notice is not None:
            self._run_callback(callback, self._notice)

    def trigger(
        self, reason: str = "triggered by the program", *, deadline: float | None = None
    ) -> None:
        """Flag preemption from code (a scheduler hook, a test). ``deadline``: time.time()."""
        self._record(PreemptionNotice("manual", reason, time.time(), deadline))
        self._wake()
        if self._thread is None or not self._thread.is_alive():
            self._dispatch()

    # ---------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> PreemptionWatcher:
        """Install the signal handlers (main thread only) and start polling."""
        if self._thread is not None:
            return self
        self._stopping = False
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        if self.signals:
            if threading.current_thread() is threading.main_thread():
                for sig in self.signals:
                    self._previous[sig] = signal.getsignal(sig)
                    signal.signal(sig, self._on_signal)
            else:
                log.warning(
                    "PreemptionWatcher started outside the main thread: signal handlers can "
                    "only be installed from the main thread, so %s will not be watched",
                    ", ".join(s.name for s in self.signals),
                )
        self._thread = threading.Thread(target=self._run, name="cloudckpt-preemption", daemon=True)
        self._thread.start()
        names = (
            ["signal:" + ",".join(s.name for s in self._previous)] if self._previous else []
        ) + [repr(s) for s in self.sources]
        log.info("watching for preemption: %s", ", ".join(names) or "nothing")
        return self

    def stop(self) -> None:
        """Stop polling and restore the previous signal handlers. Idempotent."""
        thread = self._thread
        if thread is None:
            return
        self._stopping = True
        self._wake()
        if thread is not threading.current_thread():
            thread.join(timeout=max(5.0, self.interval))
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
                else:
                    log.debug("%s handler was replaced after us; leaving it", sig.name)
            self._previous.clear()
        for fd in (self._rfd, self._wfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._rfd = self._wfd = None
        self._thread = None

    def __enter__(self) -> PreemptionWatcher:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "preempted" if self.preempted else ("running" if self.running else "stopped")
        return f"<PreemptionWatcher {state} sources={self.sources!r} signals={self.signals!r}>"

    # ---------------------------------------------------------------- internals

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes: no locks, no logging, no callbacks.
        count = self._signal_counts.get(signum, 0) + 1
        self._signal_counts[signum] = count
        previous = self._previous.get(signum)
        if count > 1 and self.escalate_on_repeat:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            if callable(previous):
                previous(signum, frame)
            else:
                os.kill(os.getpid(), signum)  # the default action (or nothing, if ignored)
            return
        if self._signal_seen is None:
            self._signal_seen = (signum, time.time())
        self._wake()
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def _wake(self) -> None:
        if self._wfd is not None:
            with contextlib.suppress(OSError):  # full pipe: a wake-up is already pending
                os.write(self._wfd, b"\0")

    def _signal_notice(self, signum: int, when: float) -> PreemptionNotice:
        name = signal.Signals(signum).name
        deadline = None if self.signal_grace is None else when + self.signal_grace
        return PreemptionNotice("signal", f"received {name}", when, deadline, {"signal": signum})

    def _record(self, notice: PreemptionNotice) -> None:
        with self._lock:
            if self._notice is not None:
                return
            self._notice = notice
        self.event.set()
        left = notice.seconds_left()
        log.warning(
            "preemption notice (%s): %s%s",
            notice.source,
            notice.reason,
            "" if left is None else f"; about {left:.0f}s left",
        )

    def _dispatch(self) -> None:
        with self._lock:
            if self._dispatched or self._notice is None:
                return
            self._dispatched = True
            callbacks = list(self._callbacks)
        for callback in callbacks:
            self._run_callback(callback, self._notice)

    @staticmethod
    def _run_callback(callback: NoticeCallback, notice: PreemptionNotice) -> None:
        try:
            callback(notice)
        except Exception:
            log.exception("preemption callback %r failed", callback)

    def _poll_sources(self) -> None:
        for source in self.sources:
            if self._stopping:
                return
            try:
                notice = source.poll()
            except Exception as exc:  # never into training: a metadata blip is not fatal
                log.debug("%r: poll failed: %s: %s", source, type(exc).__name__, exc)
                continue
            if notice is not None:
                self._record(notice)
                return

    def _run(self) -> None:
        next_poll = time.monotonic()
        while not self._stopping:
            if self._signal_seen is not None and self._notice is None:
                self._record(self._signal_notice(*self._signal_seen))
            if self._notice is None and self.sources and time.monotonic() >= next_poll:
                self._poll_sources()
                next_poll = time.monotonic() + self.interval
            if self._notice is not None:
                self._dispatch()
                wait = None  # nothing left to poll; sleep until stop() or a trigger
            else:
                wait = max(0.0, next_poll - time.monotonic()) if self.sources else None
            rfd = self._rfd
            if rfd is None:
                return
            try:
                ready, _, _ = select.select([rfd], [], [], wait)
                if ready:
                    while os.read(rfd, 512):
                        pass
            except (BlockingIOError, InterruptedError):
                pass
            except (OSError, ValueError):  # the pipe was closed by stop()
                return
