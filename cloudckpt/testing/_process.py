"""What every test-server wrapper here shares: dying with the test process, context-manager
use, and a last-resort kill of a server nobody stopped."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable
from typing import Any


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that has Linux SIGKILL the server when the
    process that started it dies (even by SIGKILL), so a crashed test run leaves no server
    behind; None elsewhere. The kernel ties this to the thread that started the server:
    start it from a thread that outlives it (e.g. the main one)."""
    return _die_with_parent if sys.platform.startswith("linux") else None


class ServerProcess:
    """Mixin for a wrapper with ``start()`` / ``stop()`` and its ``subprocess.Popen`` in
    ``self._proc``."""

    _proc: Any = None

    def start(self) -> Any:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def stop(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        # Last resort against leftover servers if stop() was never called.
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(timeout=5)
