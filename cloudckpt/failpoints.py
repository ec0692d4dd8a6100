"""Named failpoints: places in save, commit, restore and GC where a test can simulate a
crash. Disarmed (the normal case) a failpoint costs one dict lookup.

    from cloudckpt import failpoints
    with failpoints.armed("commit.after_cas"):
        ...   # the next time that point is reached, SimulatedCrash is raised

``SimulatedCrash`` derives from ``BaseException`` so no ``except Exception`` in the code
under test can swallow it: it unwinds like the process dying at that point.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["POINTS", "SimulatedCrash", "arm", "armed", "disarm", "hit"]

POINTS = (
    "save.after_marker",
    "save.after_part",
    "save.after_upload",
    "save.after_manifest",
    "commit.before_cas",
    "commit.after_cas",
    "commit.after_record",
    "restore.after_range",
    "restore.after_download",
    "gc.after_inventory",
    "gc.after_mark",
    "gc.after_sweep",
    "gc.after_delete_manifest",
    "gc.after_delete_data",
    "gc.after_delete_marker",
    "gc.after_forget",
)


class SimulatedCrash(BaseException):
    """Raised at an armed failpoint. Not an Exception: nothing may swallow it."""


_armed: dict[str, Callable[[str], None]] = {}
_lock = threading.Lock()


def hit(name: str) -> None:
    """Called by cloudckpt at failpoint ``name``; raises if a test armed it."""
    action = _armed.get(name)
    if action is not None:
        action(name)


def _crash(name: str) -> None:
    raise SimulatedCrash(name)


def arm(name: str, action: Callable[[str], None] = _crash, *, once: bool = True) -> None:
    """Arm ``name``: the next hit runs ``action`` (default: raise SimulatedCrash)."""
    if name not in POINTS:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")

    def fire(point: str) -> None:
        if once:
            disarm(point)
        action(point)

    with _lock:
        _armed[name] = fire


def disarm(name: str | None = None) -> None:
    """Disarm ``name`` (or every failpoint)."""
    with _lock:
        if name is None:
            _armed.clear()
        else:
            _armed.pop(name, None)


@contextlib.contextmanager
def armed(
    name: str, action: Callable[[str], None] = _crash, *, once: bool = True
) -> Iterator[None]:
    """Arm ``name`` (see ``arm``) for the duration of the block, and disarm it after."""
    arm(name, action, once=once)
    try:
        yield
    finally:
        disarm(name)
