"""Automatic garbage collection after commits, at most every ``interval`` seconds.

Each collection runs on a thread of its own, never on the save worker: a slow or hung one
(a store that stops answering its listings) would otherwise hold up every later save's
upload and commit, and, on many ranks, the coordinator's next collectives while the other
ranks time out. A collection still running when the next is due is not stacked beside it:
that one is skipped, and the skip is logged (once per running collection). Running beside
this process's saves is safe: GC runs beside writers anyway (any host, ``cloudckpt gc``),
and its rules (grace on the store's clock, chunks named by a fresh LATEST, writers that
refuse old attempts) do not depend on which thread runs it (docs/design.md §8). A failure
is logged, never raised; a ``BaseException`` there (a simulated crash) is the process's
death, as on the save worker: it goes to ``on_crash`` (the save queue stops for good).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cloudckpt.errors import CloudCkptError
from cloudckpt.gc import collect_garbage
from cloudckpt.stores import Store

log = logging.getLogger("cloudckpt")

#: The longest ``close()`` waits for a collection still running (less when the manager's
#: ``close(timeout=...)`` has less left): a hung one must not hang the manager's close.
#: GC is safe to cut at any point.
CLOSE_WAIT_S = 60.0


class AutoGC:
    """Collects garbage in ``store`` when due, on a thread of its own (module docstring)."""

    def __init__(
        self,
        store: Store,
        enabled: bool,
        interval: float,
        on_crash: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.store = store
        self.enabled = enabled
        self.interval = interval
        self._on_crash = on_crash
        self._last = time.monotonic()
        self._thread: threading.Thread | None = None
        self._started = 0.0  # when the running collection started
        self._skip_logged = False  # the running collection's skip was logged
        self._lock = threading.Lock()  # the save worker and the DCP writer may both ask

    def if_due(self) -> None:
        """Start a collection if enabled and ``interval`` has passed since the last one
        started, unless the last one still runs (skipped, logged). Never raises, never
        waits for a collection."""
        with self._lock:
            now = time.monotonic()
            if not self.enabled or now - self._last < self.interval:
                return
            if self._thread is not None and self._thread.is_alive():
                if not self._skip_logged:
                    self._skip_logged = True
                    log.warning(
                        "automatic garbage collection skipped: the last one has been running "
                        "for %.0fs (a slow or unresponsive store?); saves go on without it",
                        now - self._started,
                    )
                return
            self._last = self._started = now
            self._skip_logged = False
            thread = threading.Thread(target=self._collect, name="cloudckpt-gc", daemon=True)
            thread.start()
            self._thread = thread  # once started: is_alive() is False before

    def _collect(self) -> None:
        try:
            collect_garbage(self.store)
        except CloudCkptError as exc:
            log.warning("background garbage collection failed: %s", exc)
        except Exception as exc:
            # Not an error cloudckpt expects (an adapter's untranslated exception, a bug):
            # still GC's failure, never the saves'; logged, as nothing else would tell.
            log.error("background garbage collection failed: %r", exc, exc_info=True)
        except BaseException as exc:  # a simulated crash: the process is as dead
            if self._on_crash is None:
                raise
            self._on_crash(exc)

    def close(self, timeout: float | None = None) -> None:
        """Wait for a collection still running, at most ``timeout`` (what is left of the
        manager's ``close(timeout=...)``) and never more than ``CLOSE_WAIT_S``; one still
        running then is left to end with the process (logged): every step of GC is safe to
        interrupt, and the next collection finishes its work."""
        thread = self._thread
        if thread is None:
            return
        # Capped even under a long timeout: that one is for the saves; GC need not finish.
        wait = CLOSE_WAIT_S if timeout is None else min(max(0.0, timeout), CLOSE_WAIT_S)
        thread.join(wait)
        if thread.is_alive():
            log.warning(
                "automatic garbage collection still running at close, after %.0fs; not "
                "waited for (it is safe to interrupt; the next collection finishes its work)",
                time.monotonic() - self._started,
            )
