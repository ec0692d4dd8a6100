"""What every source of notices shares: ``PreemptionNotice`` and the ``PreemptionSource``
interface (``poll()``) that the watcher polls."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any


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
