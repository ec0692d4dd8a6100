"""What the checker and the store plumbing need of the world and of an actor, as
``Protocol`` s.

The world (``world.Simulation``) builds the checker, the recorder and the actors, so
those must not name the world's class back, not even in annotations: they name these
roles instead, and nothing here imports a module above it. What an actor and its programs
need of the world (``actor.World``) names the ``Checker``, so it lives above the checker,
next to ``Actor``.
"""

from __future__ import annotations

import datetime as dt
from contextlib import AbstractContextManager
from typing import Protocol

from cloudckpt.stores.base import MultipartUpload, PutMode
from cloudckpt.stores.memory import MemoryStore
from cloudckpt.testing.simulation.profile import Profile
from cloudckpt.testing.simulation.result import SimResult


class Process(Protocol):
    """An actor as the checker sees it: who wrote, in which incarnation and operation,
    and why (``task``: "gc" while it collects garbage)."""

    @property
    def name(self) -> str: ...

    @property
    def incarnation(self) -> int: ...

    @property
    def op(self) -> int: ...

    @property
    def writer_id(self) -> str | None: ...

    @property
    def task(self) -> str: ...


class CheckedWorld(Protocol):
    """What the checker needs of the world: the raw store to compare against, the result
    to count in, the seed's profile (the expected content), the store's time, and where to
    report a violation."""

    @property
    def memory(self) -> MemoryStore: ...

    @property
    def result(self) -> SimResult: ...

    @property
    def profile(self) -> Profile: ...

    def elapsed(self) -> float: ...

    def violation(self, message: str) -> None: ...


class WriteChecks(Protocol):
    """The checks the recorder runs on every write as it is applied (``Checker``'s)."""

    def touched(self, prefix: str, now: dt.datetime) -> None: ...

    def latest_written(self, body: bytes, mode: PutMode | None, actor: Process | None) -> None: ...

    def before_delete(self, key: str, actor: Process | None) -> None: ...

    def upload_created(self, upload: MultipartUpload, actor: Process | None) -> None: ...

    def before_abort(self, upload: MultipartUpload, actor: Process | None) -> None: ...


class RecordedWorld(Protocol):
    """What the recorder needs of the world: the checks, the actor holding the baton (who
    wrote), and the store's clock stepping back for a write into an attempt."""

    @property
    def checker(self) -> WriteChecks: ...

    @property
    def current(self) -> Process | None: ...

    def clock_stepped_back(self, key: str) -> AbstractContextManager[None]: ...
