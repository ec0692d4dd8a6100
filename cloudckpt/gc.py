"""Garbage collection (DESIGN §8): delete only what LATEST no longer references, and only
once it is older than the grace period on the store's clock.

What goes, in this order, each step safe to interrupt and re-run:

1. Tombstones (checkpoints retention dropped) older than grace: first marked ``deleting`` in
   LATEST, then per checkpoint the manifest, then its files, then its ATTEMPT.json, then the
   tombstone leaves LATEST. Age counts from when ``commits/<dropped_seq>.json`` landed.
2. Orphan attempts (never committed: crashed, fenced, or failed saves) older than grace:
   unreachable from a fresh read of LATEST; manifest first, ATTEMPT.json last.
3. Incomplete multipart uploads older than grace. An upload's age is the later of its own
   start and its attempt's ATTEMPT.json, because some stores misreport upload start times
   (moto says 2010).
4. Commit records beyond the newest ``keep_commit_records`` and older than grace.

Why ages and grace at all: a writer uploads for a while before it commits, and a reader
downloads for a while after it read LATEST. Writers refuse to commit an attempt older than
``grace - margin`` (``StaleAttemptError``), so anything older than grace can no longer become
referenced; readers get ``grace`` to finish before a dropped checkpoint's bytes go. The
effective grace is never shorter than the run's ``gc_grace_s`` in LATEST.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections import defaultdict
from collections.abc import Iterable

from cloudckpt import chunks, protocol
from cloudckpt.committer import edit_latest, read_latest, run_has_data
from cloudckpt.errors import NeedsRepairError
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.protocol import CorruptRecordError, Latest
from cloudckpt.stores import MultipartUpload, ObjectInfo, PendingUpload, Store

log = logging.getLogger("cloudckpt.gc")


@dataclasses.dataclass
class GCReport:
    """What a GC run deleted (or, with ``dry_run``, would delete)."""

    dry_run: bool
    grace_seconds: int
    store_now: dt.datetime
    deleted_checkpoints: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    deleted_orphans: list[str] = dataclasses.field(default_factory=list)
    aborted_uploads: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    deleted_commit_records: list[str] = dataclasses.field(default_factory=list)
    kept_young: list[str] = dataclasses.field(default_factory=list)
    deleted_objects: int = 0
    freed_bytes: int = 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["store_now"] = protocol.iso(self.store_now)
        return d


def _age(now: dt.datetime, then: dt.datetime | None) -> float:
    return (now - then).total_seconds() if then is not None else 0.0


def _attempt_of(key: str) -> str | None:
    parts = key.split("/", 2)
    if len(parts) < 3 or parts[0] != "ckpt":
        return None
    prefix = f"ckpt/{parts[1]}/"
    return prefix if protocol.parse_ckpt_prefix(prefix) else None


class _Inventory:
    """Everything under ckpt/ and commits/, grouped, with store-clock times."""

    def __init__(self, store: Store) -> None:
        self.attempts: dict[str, list[ObjectInfo]] = defaultdict(list)
        for obj in store.list(protocol.CKPT_PREFIX):
            prefix = _attempt_of(obj.key)
            if prefix is not None:
                self.attempts[prefix].append(obj)
        self.records: dict[int, ObjectInfo] = {}
        for obj in store.list(protocol.COMMITS_PREFIX):
            name = obj.key[len(protocol.COMMITS_PREFIX) :].removesuffix(".json")
            if name.isdigit():
                self.records[int(name)] = obj
        self.uploads: list[PendingUpload] = store.list_multipart("")

    def born(self, prefix: str) -> dt.datetime | None:
        times = [o.last_modified for o in self.attempts.get(prefix, ()) if o.last_modified]
        return min(times) if times else None

    def seq_time(self, seq: int, latest_time: dt.datetime | None) -> dt.datetime | None:
        """When LATEST seq ``seq`` was written, or a later time if its record is missing
        (later = younger = safer)."""
        record = self.records.get(seq)
        if record is not None:
            return record.last_modified
        later = [o.last_modified for s, o in self.records.items() if s > seq and o.last_modified]
        return min(later) if later else latest_time


def _deletable(objects: Iterable[ObjectInfo], protected: set[str] | None) -> list[ObjectInfo]:
    """The objects of an attempt GC may delete: all but the chunks a manifest still names
    (``protected``; None: every chunk, because a manifest could not be read)."""
    return [
        o
        for o in objects
        if not chunks.is_chunk_key(o.key) or (protected is not None and o.key not in protected)
    ]


def _protected(store: Store, latest: Latest, deleting: Iterable[str] = ()) -> set[str] | None:
    keys = chunks.protected_chunk_keys(store, latest, deleting)
    if keys is None:
        log.warning("a retained manifest is unreadable; GC keeps every chunk this time")
    return keys


def _delete_prefix(
    store: Store, prefix: str, objects: Iterable[ObjectInfo], report: GCReport
) -> None:
    """Delete one attempt: manifest first, then files, ATTEMPT.json last."""
    objs = sorted(objects, key=lambda o: o.key)
    manifest = [o for o in objs if o.key == prefix + protocol.MANIFEST_NAME]
    marker = [o for o in objs if o.key == prefix + protocol.ATTEMPT_NAME]
    data = [o for o in objs if o not in manifest and o not in marker]
    for group, name in ((manifest, "manifest"), (data, "data"), (marker, "marker")):
        if group:
            store.delete_many([o.key for o in group])
            report.deleted_objects += len(group)
            report.freed_bytes += sum(o.size for o in group)
        failpoint(f"gc.after_delete_{name}")


def collect_garbage(
    store: Store,
    *,
    grace_seconds: float | None = None,
    dry_run: bool = False,
    keep_commit_records: int = 100,
) -> GCReport:
    """Delete unreferenced checkpoint data older than the grace period (see module doc).

    ``grace_seconds`` below the run's ``gc_grace_s`` is raised to it (with a warning):
    running writers rely on that value to stop committing old attempts.

    Raises:
        NeedsRepairError: LATEST is missing or unreadable (GC cannot tell what is referenced).
        StoreError: the store failed; re-running GC continues where it stopped.
    """
    try:
        head = read_latest(store)
    except CorruptRecordError as exc:
        raise NeedsRepairError(f"LATEST of {store.url} is unreadable ({exc}); GC stopped") from None
    if head is None and run_has_data(store):
        # Read again: a writer may have created the run between the two reads.
        try:
            head = read_latest(store)
        except CorruptRecordError as exc:
            raise NeedsRepairError(f"LATEST of {store.url} is unreadable ({exc})") from None
        if head is None:
            raise NeedsRepairError(f"{store.url} has checkpoint data but no LATEST; GC stopped")
    if head is None:
        return GCReport(dry_run, int(grace_seconds or 0), store.now())
    latest = head.latest
    grace = latest.settings.gc_grace_s
    if grace_seconds is not None and grace_seconds < grace:
        log.warning(
            "grace %ss is shorter than the run's gc_grace_s=%ss; using %ss",
            grace_seconds,
            grace,
            grace,
        )
    elif grace_seconds is not None:
        grace = int(grace_seconds)
    now = store.now()
    inv = _Inventory(store)
    latest_time = store.head(protocol.LATEST_KEY).last_modified
    report = GCReport(dry_run, grace, now)
    failpoint("gc.after_inventory")

    # 1. Expired tombstones.
    expired = [
        t for t in latest.tombstones if _age(now, inv.seq_time(t.dropped_seq, latest_time)) > grace
    ]
    if expired and not dry_run:
        # A tombstone is identified by its checkpoint AND the seq that dropped it: a pin
        # and an unpin between our read and our mark drop the checkpoint anew, and its
        # grace period starts again.
        keys = {(t.record.commit_id, t.dropped_seq) for t in expired}

        def mark(cur: Latest, at: dt.datetime) -> Latest | None:
            todo = {
                t.record.commit_id
                for t in cur.tombstones
                if (t.record.commit_id, t.dropped_seq) in keys and t.state == "pending"
            }
            return protocol.mark_deleting(cur, todo, at) if todo else None

        marked = edit_latest(store, mark)
        failpoint("gc.after_mark")
        # Delete only what the LATEST we wrote (or found) marks: a pin may have brought a
        # checkpoint back between our read and our mark.
        expired = [
            t
            for t in marked.tombstones
            if (t.record.commit_id, t.dropped_seq) in keys and t.state == "deleting"
        ]
    if expired:
        # Chunks other checkpoints still name stay (cloudckpt.chunks: why this LATEST).
        protected = _protected(
            store, marked if not dry_run else latest, {t.record.commit_id for t in expired}
        )
    for t in expired:
        report.deleted_checkpoints.append((t.record.step, t.record.ckpt))
        if not dry_run:
            _abort_uploads_under(store, inv, t.record.ckpt, report)
            objects = _deletable(inv.attempts.get(t.record.ckpt, ()), protected)
            _delete_prefix(store, t.record.ckpt, objects, report)
    if expired and not dry_run:
        ids = {t.record.commit_id for t in expired}

        def forget(cur: Latest, at: dt.datetime) -> Latest | None:
            present = any(t.record.commit_id in ids for t in cur.tombstones)
            return protocol.forget_tombstones(cur, ids, at) if present else None

        edit_latest(store, forget)
        failpoint("gc.after_forget")

    # 2. Orphan attempts, judged against a fresh read of LATEST.
    fresh = read_latest(store) if not dry_run else head
    referenced = (fresh.latest if fresh else latest).referenced_prefixes()
    referenced |= {ckpt for _, ckpt in report.deleted_checkpoints}  # handled above
    orphans = []
    for prefix in sorted(inv.attempts):
        if prefix in referenced:
            continue
        if _age(now, inv.born(prefix)) <= grace:
            report.kept_young.append(prefix)
            continue
        orphans.append(prefix)
    if orphans:
        # A checkpoint GC deleted earlier leaves the chunks later checkpoints still name:
        # its prefix then looks like an orphan whose chunks are protected.
        protected = _protected(store, (fresh.latest if fresh else latest))
        orphans = [p for p in orphans if _deletable(inv.attempts[p], protected)]
    if orphans and not dry_run:
        # Fence commits still in flight (see protocol.sweep), then judge again against
        # the LATEST we wrote: whatever committed before it is referenced there.
        swept = edit_latest(store, protocol.sweep)
        failpoint("gc.after_sweep")
        orphans = [p for p in orphans if p not in swept.referenced_prefixes()]
        protected = _protected(store, swept)
    for prefix in orphans:
        objects = _deletable(inv.attempts[prefix], protected)
        if not objects:
            continue
        report.deleted_orphans.append(prefix)
        if not dry_run:
            _abort_uploads_under(store, inv, prefix, report)
            _delete_prefix(store, prefix, objects, report)

    # 3. Incomplete uploads not already handled with their attempt.
    handled = {u for u, _ in report.aborted_uploads}
    for upload in inv.uploads:
        if upload.key in handled:
            continue
        attempt = _attempt_of(upload.key)
        born = [t for t in (upload.initiated, inv.born(attempt) if attempt else None) if t]
        if _age(now, max(born) if born else None) > grace:
            report.aborted_uploads.append((upload.key, upload.upload_id))
            if not dry_run:
                store.abort_multipart(MultipartUpload(upload.key, upload.upload_id))

    # 4. Old commit records (keep those that date live tombstones).
    live = (fresh.latest if fresh else latest).tombstones
    oldest_needed = min((t.dropped_seq for t in live), default=None)
    seqs = sorted(inv.records)
    for seq in seqs[: max(0, len(seqs) - keep_commit_records)]:
        if oldest_needed is not None and seq >= oldest_needed:
            break
        obj = inv.records[seq]
        if _age(now, obj.last_modified) > grace:
            report.deleted_commit_records.append(obj.key)
            if not dry_run:
                store.delete(obj.key)
                report.deleted_objects += 1
    log.info(
        "gc %s: %d checkpoints, %d orphan attempts, %d uploads, %d commit records%s",
        store.url,
        len(report.deleted_checkpoints),
        len(report.deleted_orphans),
        len(report.aborted_uploads),
        len(report.deleted_commit_records),
        " (dry run)" if dry_run else "",
    )
    return report


def _abort_uploads_under(store: Store, inv: _Inventory, prefix: str, report: GCReport) -> None:
    for upload in inv.uploads:
        if upload.key.startswith(prefix):
            store.abort_multipart(MultipartUpload(upload.key, upload.upload_id))
            report.aborted_uploads.append((upload.key, upload.upload_id))
