"""Operations on a run besides saving and restoring: pins, and who writes the run.

Pins edit LATEST with a same-epoch compare-and-swap (``committer.edit_latest``), so they
are safe while a writer is training: its next commit re-applies on top of the edit.
``check_takeover`` guards commands that claim the run (``push``). Repair and verification
live in ``cloudckpt.repair`` and ``cloudckpt.verify``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Container

from cloudckpt import protocol
from cloudckpt.committer import edit_latest, read_latest
from cloudckpt.errors import (
    ActiveWriterError,
    NeedsRepairError,
    step_not_retained,
)
from cloudckpt.protocol import CorruptRecordError, Latest
from cloudckpt.stores import Store


def _record_of_step(url: str, latest: Latest, step: int) -> protocol.CheckpointRecord:
    """The newest retained checkpoint of ``step``, else one retention dropped that GC has
    not started deleting (pinning brings it back)."""
    for record in latest.retained():
        if record.step == step:
            return record
    for t in reversed(latest.tombstones):
        if t.record.step == step and t.state == "pending":
            return t.record
    raise step_not_retained(url, step, (r.step for r in latest.retained()))


def pin(store: Store, step: int, label: str = "pinned") -> Latest | None:
    """Pin the newest retained checkpoint of ``step`` under ``label``.

    Raises: CheckpointNotFoundError, NeedsRepairError, CommitConflictError.
    """

    def change(latest: Latest, now: dt.datetime) -> Latest | None:
        record = _record_of_step(store.url, latest, step)
        if any(p.commit_id == record.commit_id and p.label == label for p in latest.pins):
            return None  # already pinned: idempotent
        return protocol.pin(latest, record.commit_id, label, now)

    return edit_latest(store, change)


def unpin(store: Store, step: int) -> Latest | None:
    """Remove every pin of ``step``. Retention then applies to it at once.

    Raises: CheckpointNotFoundError (the run holds no checkpoint of that step), NeedsRepairError.
    """

    def change(latest: Latest, now: dt.datetime) -> Latest | None:
        ids = {p.commit_id for p in latest.pins if p.step == step}
        if not ids:
            dropped = any(t.record.step == step for t in latest.tombstones)
            if dropped or any(r.step == step for r in latest.retained()):
                # Nothing pinned: idempotent. (After a lost answer our own unpin may
                # already have moved the checkpoint to the tombstones.)
                return None
            raise step_not_retained(store.url, step, (r.step for r in latest.retained()))
        # One transition for all of them: every write of LATEST is exactly seq + 1.
        return protocol.unpin(latest, ids, now)

    return edit_latest(store, change)


# --- who writes the run ------------------------------------------------------------------

#: A writer that wrote LATEST less than this long ago (store clock) counts as active.
ACTIVE_WINDOW_S = 3600


@dataclasses.dataclass(frozen=True)
class WriterStatus:
    """The run's current writer, and how long ago LATEST was last written (store clock).

    ``exited``: the writer ran on this host and its process is gone (so it is certainly
    not training; e.g. an earlier ``cloudckpt push``).
    """

    epoch: int
    id: str
    claimed_at: str
    idle_seconds: float
    exited: bool = False

    @property
    def active(self) -> bool:
        return self.idle_seconds < ACTIVE_WINDOW_S and not self.exited

    @property
    def may_be_live(self) -> bool:
        """Whether the writer's process may still be running (and so may try to commit
        again): anything but a writer known to have exited, whatever its age."""
        return not self.exited

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "active": self.active}


def writer_status(store: Store) -> WriterStatus | None:
    """The writer named in LATEST, or None for a run without LATEST.

    Raises: NeedsRepairError (LATEST unreadable), StoreError.
    """
    try:
        head = read_latest(store)
    except CorruptRecordError as exc:
        raise NeedsRepairError(f"LATEST of {store.url} is unreadable: {exc}") from None
    if head is None:
        return None
    written = store.head(protocol.LATEST_KEY).last_modified
    idle = (store.now() - written).total_seconds() if written is not None else 0.0
    w = head.latest.writer
    return WriterStatus(w.epoch, w.id, w.claimed_at, max(0.0, idle), _exited_here(w.id))


def _exited_here(writer_id: str) -> bool:
    """Whether ``writer_id`` (``host:pid:random``, see ``protocol.new_writer_id``) names a
    process of this host that no longer exists. Unsure (another host, pid reused, or an id
    of another shape) counts as not exited."""
    if writer_id.startswith("repair:"):
        return True  # written by `repair`, which is not a process that keeps writing
    parts = writer_id.split(":")
    if len(parts) != 3 or not parts[1].isdigit():
        return False
    this_host = protocol.new_writer_id().split(":")[0]
    if parts[0] != this_host:
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, owned by someone else
    return False


def check_takeover(
    store: Store, *, force: bool = False, finished: Container[str] = ()
) -> WriterStatus | None:
    """Before a command claims the run (``push``, ``cp``): refuse to fence an active
    writer unless ``force``. ``finished``: ids of writers this process ran to the end (a
    copy that returned), which are not active whatever their age. Returns the writer that
    claiming will fence (None for a new run).

    Raises: ActiveWriterError, NeedsRepairError, StoreError.
    """
    status = writer_status(store)
    if status is not None and status.id in finished:
        status = dataclasses.replace(status, exited=True)
    if status is not None and status.active and not force:
        raise ActiveWriterError(
            f"{store.url} belongs to writer {status.id} (epoch {status.epoch}), which wrote "
            f"LATEST {status.idle_seconds:.0f}s ago. Writing to the run claims it and fences "
            "that writer: its next commit would fail"
        )
    return status
