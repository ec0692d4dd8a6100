"""Automatic garbage collection after commits, at most every ``interval`` seconds.

Inline (one host: on the save worker, after a save) or on a thread of its own (many
ranks: a long collection on the worker would hold the coordinator back from the next
save's collectives while the other ranks time out). A failure is logged, never raised.
"""

from __future__ import annotations

import logging
import threading
import time

from cloudckpt.errors import CloudCkptError
from cloudckpt.gc import collect_garbage
from cloudckpt.stores import Store

log = logging.getLogger("cloudckpt")


class AutoGC:
    """Collects garbage in ``store`` when due (module docstring)."""

    def __init__(self, store: Store, enabled: bool, interval: float, threaded: bool) -> None:
        self.store = store
        self.enabled = enabled
        self.interval = interval
        self.threaded = threaded
        self._last = time.monotonic()
        self._thread: threading.Thread | None = None

    def if_due(self) -> None:
        """Collect now if enabled and ``interval`` has passed since the last collection
        (a threaded one: unless the last one still runs). Never raises."""
        if not self.enabled or time.monotonic() - self._last < self.interval:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._last = time.monotonic()
        if not self.threaded:
            self._collect()
            return
        self._thread = threading.Thread(target=self._collect, name="cloudckpt-gc", daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        try:
            collect_garbage(self.store)
        except CloudCkptError as exc:
            log.warning("background garbage collection failed: %s", exc)
        except Exception as exc:
            # Not an error cloudckpt expects (an adapter's untranslated exception, a bug):
            # still GC's failure, never the saves'. Raised here it would end the save
            # worker it runs on, and every later save would wait forever for it.
            log.error("background garbage collection failed: %r", exc, exc_info=True)

    def close(self) -> None:
        """Wait for a collection still running on its own thread."""
        if self._thread is not None:
            self._thread.join()
