"""``PreemptionWatcher``: every source of notices (``signals``, ``sources``) behind one flag,
one event and callbacks.

One daemon thread polls the cloud sources every ``interval`` seconds and stops polling once
a notice arrived; it also turns a received signal into its notice (the signal handler only
wakes it) and runs the callbacks once. A source that fails is logged at DEBUG and polled
again later: a watcher never raises into training.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

from cloudckpt.errors import ConfigurationError
from cloudckpt.preemption import sources as _sources
from cloudckpt.preemption.notice import PreemptionNotice, PreemptionSource
from cloudckpt.preemption.signals import SignalTrap

log = logging.getLogger("cloudckpt.preemption")

DEFAULT_INTERVAL = 5.0


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
        urls = {"aws": aws_url, "gce": gce_url, "azure": azure_url}
        self.watch_signals, self.sources = _sources.resolve(
            sources, urls=urls, timeout=timeout, dmi_dir=_dmi_dir
        )
        self._trap = SignalTrap(
            signals if self.watch_signals else (),
            grace=signal_grace,
            escalate_on_repeat=escalate_on_repeat,
            wake=self._wake,
        )
        self.interval = float(interval)
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
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._rfd: int | None = None
        self._wfd: int | None = None

    # ---------------------------------------------------------------- settings

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        """The signals watched (empty when ``signal`` is not a source)."""
        return self._trap.signals

    @property
    def signal_grace(self) -> float | None:
        """Seconds a signal leaves before the hard kill (the signal notice's deadline)."""
        return self._trap.grace

    @signal_grace.setter
    def signal_grace(self, value: float | None) -> None:
        self._trap.grace = value

    @property
    def escalate_on_repeat(self) -> bool:
        """Whether a second identical signal gets its previous disposition back."""
        return self._trap.escalate_on_repeat

    @escalate_on_repeat.setter
    def escalate_on_repeat(self, value: bool) -> None:
        self._trap.escalate_on_repeat = value

    # ---------------------------------------------------------------- state

    @property
    def preempted(self) -> bool:
        """True once any source gave notice (cheap; check it at every step)."""
        return self._trap.seen is not None or self.event.is_set()

    @property
    def notice(self) -> PreemptionNotice | None:
        """The first notice, or None."""
        self._record_signal()
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
        self._trap.install()
        self._thread = threading.Thread(target=self._run, name="cloudckpt-preemption", daemon=True)
        self._thread.start()
        installed = ",".join(s.name for s in self._trap.installed)
        names = ([f"signal:{installed}"] if installed else []) + [repr(s) for s in self.sources]
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
        self._trap.restore()
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

    def _wake(self) -> None:
        if self._wfd is not None:
            with contextlib.suppress(OSError):  # full pipe: a wake-up is already pending
                os.write(self._wfd, b"\0")

    def _record_signal(self) -> None:
        """Record the notice of a signal the trap caught, unless a notice is recorded."""
        notice = self._trap.notice() if self._notice is None else None
        if notice is not None:
            self._record(notice)

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
            self._record_signal()
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
