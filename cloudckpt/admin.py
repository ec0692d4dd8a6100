"""Operations on a run besides saving and restoring: pins (and, below, repair).

Each edits LATEST with a same-epoch compare-and-swap (``committer.edit_latest``), so they
are safe while a writer is training: its next commit re-applies on top of the edit.
"""

from __future__ import annotations

import datetime as dt

from cloudckpt import protocol
from cloudckpt.committer import edit_latest
from cloudckpt.errors import CheckpointNotFoundError
from cloudckpt.protocol import Latest
from cloudckpt.stores import Store


def _record_of_step(latest: Latest, step: int) -> protocol.CheckpointRecord:
    """The newest retained checkpoint of ``step``, else one retention dropped that GC has
    not started deleting (pinning brings it back)."""
    for record in latest.retained():
        if record.step == step:
            return record
    for t in reversed(latest.tombstones):
        if t.record.step == step and t.state == "pending":
            return t.record
    raise CheckpointNotFoundError(f"no retained checkpoint of step {step}")


def pin(store: Store, step: int, label: str = "pinned") -> Latest | None:
    """Pin the newest retained checkpoint of ``step`` under ``label``.

    Raises: CheckpointNotFoundError, NeedsRepairError, CommitConflictError.
    """

    def change(latest: Latest, now: dt.datetime) -> Latest | None:
        record = _record_of_step(latest, step)
        if any(p.commit_id == record.commit_id and p.label == label for p in latest.pins):
            return None  # already pinned: idempotent
        return protocol.pin(latest, record.commit_id, label, now)

    return edit_latest(store, change)


def unpin(store: Store, step: int) -> Latest | None:
    """Remove every pin of ``step``. Retention then applies to it at once.

    Raises: CheckpointNotFoundError (no pin of that step), NeedsRepairError.
    """

    def change(latest: Latest, now: dt.datetime) -> Latest | None:
        ids = {p.commit_id for p in latest.pins if p.step == step}
        if not ids:
            if any(r.step == step for r in latest.retained()):
                return None  # nothing pinned: idempotent
            raise CheckpointNotFoundError(f"no pinned checkpoint of step {step}")
        for commit_id in ids:
            latest = protocol.unpin(latest, commit_id, now)
        return latest

    return edit_latest(store, change)
