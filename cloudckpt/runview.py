"""A run's read API as the managers offer it: its checkpoints, and restoring one.

Read-only and safe beside a running writer: every call reads LATEST afresh
(``cloudckpt.reader``); a restore goes through ``cloudckpt.restore`` with the manager's
transfer engine, progress callback and local tier.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cloudckpt.localcopy import LocalCopies
from cloudckpt.protocol import CheckpointRecord, Latest
from cloudckpt.reader import load_latest_for_reading
from cloudckpt.restore import RestoreResult, restore
from cloudckpt.stores import Store
from cloudckpt.transfer import ProgressCallback, TransferEngine


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A retained checkpoint, as ``list()`` reports it."""

    step: int
    commit_id: str
    ckpt: str
    epoch: int
    committed_at: str
    num_files: int
    total_bytes: int
    metadata: Mapping[str, Any]
    current: bool
    pins: tuple[str, ...] = ()
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, latest: Latest, record: CheckpointRecord) -> CheckpointInfo:
        return cls(
            step=record.step,
            commit_id=record.commit_id,
            ckpt=record.ckpt,
            epoch=record.epoch,
            committed_at=record.committed_at,
            num_files=record.num_files,
            total_bytes=record.total_bytes,
            metadata=dict(record.metadata),
            current=latest.current is not None and latest.current.commit_id == record.commit_id,
            pins=tuple(p.label for p in latest.pins if p.commit_id == record.commit_id),
            metrics=dict(record.metrics),
        )

    @classmethod
    def current_of(cls, latest: Latest | None) -> CheckpointInfo | None:
        """The current checkpoint of ``latest``, or None (no LATEST, or nothing current)."""
        if latest is None or latest.current is None:
            return None
        return cls.of(latest, latest.current)


class RunView:
    """The checkpoints of the run in ``store`` (module docstring). ``engine`` is asked
    for at each restore (a manager's engine may be replaced)."""

    def __init__(
        self,
        store: Store,
        engine: Callable[[], TransferEngine],
        progress: ProgressCallback | None,
        local: LocalCopies | None,
    ) -> None:
        self.store = store
        self._engine = engine
        self.progress = progress
        self.local = local

    def latest(self) -> CheckpointInfo | None:
        """The current committed checkpoint (a fresh read of the store), or None."""
        latest, _ = load_latest_for_reading(self.store)
        return CheckpointInfo.current_of(latest)

    def list(self) -> list[CheckpointInfo]:
        """Every retained checkpoint, newest first."""
        latest, _ = load_latest_for_reading(self.store)
        return [] if latest is None else [CheckpointInfo.of(latest, r) for r in latest.retained()]

    def restore(
        self,
        into: str | os.PathLike[str],
        step: int | None,
        overwrite: bool,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        *,
        link_local: bool = False,
    ) -> RestoreResult:
        """``cloudckpt.restore.restore`` of this run (raises as it does)."""
        return restore(
            self.store,
            into,
            self._engine(),
            step=step,
            overwrite=overwrite,
            progress=self.progress,
            local=self.local,
            include=include,
            exclude=exclude,
            link_local=link_local,
        )
