"""The ``signal`` source: SIGTERM (or other signals) as a preemption notice.

Kubernetes, Slurm, systemd, GCE/Azure shutdown and ``docker stop`` all send SIGTERM before
killing the process. The handler runs in the main thread between bytecodes, so it takes no
lock, logs nothing and runs no callback: it records the first signal and wakes the watcher
(one byte to a pipe). It calls a previously installed Python handler (so frameworks that
also listen still hear it) but not the default action (which would end the process before
the emergency save); a second identical signal (``escalate_on_repeat``) restores the
previous disposition and re-delivers the signal.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from cloudckpt.preemption.notice import PreemptionNotice

log = logging.getLogger("cloudckpt.preemption")


class SignalTrap:
    """Signal handlers that turn the first of ``signals`` into a notice.

    ``wake`` is called from the handler (it must be async-signal-safe: the watcher writes
    one byte to a pipe). ``grace``: seconds a signal leaves before the hard kill, if known;
    it sets the notice's deadline.
    """

    def __init__(
        self,
        signals: Iterable[int],
        *,
        grace: float | None,
        escalate_on_repeat: bool,
        wake: Callable[[], None],
    ) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.grace = grace
        self.escalate_on_repeat = escalate_on_repeat
        self._wake = wake
        self.seen: tuple[int, float] | None = None  # written by the handler
        self._counts: dict[int, int] = {}
        self.previous: dict[int, Any] = {}  # signal -> the handler we replaced

    def install(self) -> None:
        """Install the handlers; only from the main thread (Python's rule), else warn."""
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "PreemptionWatcher started outside the main thread: signal handlers can "
                "only be installed from the main thread, so %s will not be watched",
                ", ".join(s.name for s in self.signals),
            )
            return
        for sig in self.signals:
            self.previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self.handle)

    @property
    def installed(self) -> tuple[signal.Signals, ...]:
        """The signals whose handlers are ours now."""
        return tuple(signal.Signals(s) for s in self.previous)

    def restore(self) -> None:
        """Put the previous handlers back (main thread only), unless ours was replaced."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self.previous.items():
            if signal.getsignal(sig) == self.handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            else:
                log.debug("%s handler was replaced after us; leaving it", signal.Signals(sig).name)
        self.previous.clear()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler."""
        # Runs in the main thread between bytecodes: no locks, no logging, no callbacks.
        count = self._counts.get(signum, 0) + 1
        self._counts[signum] = count
        previous = self.previous.get(signum)
        if count > 1 and self.escalate_on_repeat:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            if callable(previous):
                previous(signum, frame)
            else:
                os.kill(os.getpid(), signum)  # the default action (or nothing, if ignored)
            return
        if self.seen is None:
            self.seen = (signum, time.time())
        self._wake()
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def notice(self) -> PreemptionNotice | None:
        """The notice of the first signal received, or None."""
        if self.seen is None:
            return None
        signum, when = self.seen
        name = signal.Signals(signum).name
        deadline = None if self.grace is None else when + self.grace
        return PreemptionNotice("signal", f"received {name}", when, deadline, {"signal": signum})
