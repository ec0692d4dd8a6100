"""Garbage collection (docs/design.md §8): delete only what LATEST no longer references, and only
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

Plan, then execute (as restic's ``PlanPrune`` and ``Execute``; a dry run does not execute):

- ``plan_gc`` reads LATEST once, the store's clock once and the inventory once (everything
  under ``ckpt/`` and ``commits/``, and the incomplete uploads), then decides phase by phase,
  each phase one small function: expired tombstones, old orphan attempts (and the young ones
  kept), old uploads, old commit records. It writes nothing and reads no manifest.
- ``preview_gc`` resolves the plan against the LATEST it was made from (which chunk objects
  stay because a manifest still names them) and reports what would go. It writes nothing.
  This is ``collect_garbage(dry_run=True)`` and what ``cloudckpt gc --dry-run`` prints.
- ``execute_gc`` carries the plan out. The plan comes from one read of LATEST, but LATEST
  moves while GC runs (writers commit, a pin brings a tombstone back), so execute judges
  again after each LATEST write of its own and only ever drops from the plan, never adds.
  Before its first write it reads every manifest the plan's LATEST names: a format this
  version does not know (``UnknownFormatError``) is refused with the run untouched, never
  after GC has marked or deleted anything (``preview_gc`` refuses it the same way). Nor is
  anything deleted by its name alone: the old commit records, the orphans' manifests and
  ``ATTEMPT.json``s (and the young attempts' manifests, which may name an orphan's chunks)
  are read first, and a newer version's stops GC the same way (``_judge_garbage``). Then:

  * after ``gc-mark`` it deletes only the planned tombstones that the LATEST it wrote (or
    found) marks ``deleting`` (same checkpoint AND same dropping seq: a pin and an unpin in
    between drop the checkpoint anew and restart its grace period), and protects the chunks
    that LATEST's other checkpoints name;
  * after ``gc-forget`` it reads LATEST again: planned orphans it references are dropped,
    and so are those whose every object is a chunk a manifest still names;
  * ``gc-sweep`` (a write that fences commits still in flight, see ``protocol.sweep``) comes
    before any orphan is deleted; planned orphans the LATEST it wrote references are dropped
    and the protected chunks are taken from that LATEST;
  * the commit records that date a live tombstone are kept, judged on that fresh read.

  So a plan may delete less than a dry run printed, never more; an old plan stays safe to
  execute (what it calls old stays old).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable

from cloudckpt import attempt_layout, canonical, chunks, formats, manifests, protocol
from cloudckpt.committer import VersionedLatest, edit_latest, read_latest, run_has_data
from cloudckpt.errors import NeedsRepairError, ObjectNotFoundError, UnsafePathError
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.protocol import CorruptRecordError, Latest, Tombstone
from cloudckpt.retry import call_with_retries
from cloudckpt.stores import MultipartUpload, ObjectInfo, PendingUpload, Store

log = logging.getLogger("cloudckpt.gc")


@dataclasses.dataclass
class GCReport:
    """What a GC run deleted (or, with ``dry_run``, would delete).

    ``latest_seq``: the seq of the LATEST the run's plan was made from (None: no run here).
    ``latest_writes``: the LATEST edits it made, in order (dry run: would make), among
    ``gc-mark``, ``gc-forget`` and ``gc-sweep``.
    """

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
    latest_seq: int | None = None
    latest_writes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["store_now"] = canonical.iso(self.store_now)
        return d


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class AttemptGarbage:
    """One attempt prefix the plan means to delete, as the inventory found it.

    ``objects``: everything under the prefix (chunks a manifest still names are kept when
    the plan is previewed or executed); ``uploads``: the incomplete uploads under it, aborted
    with it whatever their age; ``tombstone``: set for a checkpoint retention dropped."""

    prefix: str
    step: int
    age_s: float
    objects: tuple[ObjectInfo, ...]
    uploads: tuple[PendingUpload, ...]
    tombstone: Tombstone | None = None


@dataclasses.dataclass(frozen=True)
class CommitRecordGarbage:
    seq: int
    obj: ObjectInfo
    age_s: float


@dataclasses.dataclass
class GCPlan:
    """What one GC run intends, decided from one read of LATEST (``head``) and one
    inventory, all ages on the store's clock at ``store_now``. ``head`` None: no run here,
    nothing to do. Built by ``plan_gc``; see the module doc for how it is executed."""

    store: Store
    grace_seconds: int
    store_now: dt.datetime
    head: VersionedLatest | None
    checkpoints: list[AttemptGarbage] = dataclasses.field(default_factory=list)
    orphans: list[AttemptGarbage] = dataclasses.field(default_factory=list)
    kept_young: list[str] = dataclasses.field(default_factory=list)
    uploads: list[PendingUpload] = dataclasses.field(default_factory=list)
    commit_records: list[CommitRecordGarbage] = dataclasses.field(default_factory=list)
    # The manifests of the young unreferenced attempts (kept): read before the first write,
    # because a newer version's may name chunks under an old orphan (``_judge_garbage``).
    young_manifests: list[ObjectInfo] = dataclasses.field(default_factory=list)

    @property
    def latest(self) -> Latest | None:
        return self.head.latest if self.head is not None else None

    def ages(self) -> dict[str, float]:
        """Age in seconds (store clock) of every planned attempt prefix and record key."""
        ages = {a.prefix: a.age_s for a in [*self.checkpoints, *self.orphans]}
        ages.update({r.obj.key: r.age_s for r in self.commit_records})
        return ages


def _age(now: dt.datetime, then: dt.datetime | None) -> float:
    return (now - then).total_seconds() if then is not None else 0.0


def _tombstone_key(t: Tombstone) -> tuple[str, int]:
    # A tombstone is its checkpoint AND the seq that dropped it: a pin and an unpin between
    # the plan and the mark drop the checkpoint anew, and its grace period starts again.
    return (t.record.commit_id, t.dropped_seq)


def _attempt_of(key: str) -> str | None:
    parts = key.split("/", 2)
    if len(parts) < 3 or parts[0] != "ckpt":
        return None
    prefix = f"ckpt/{parts[1]}/"
    return prefix if attempt_layout.parse_ckpt_prefix(prefix) else None


class _Inventory:
    """The store's clock, then everything under ckpt/ and commits/ grouped, the incomplete
    uploads, and when LATEST was last written: all times on the store's clock."""

    def __init__(self, store: Store) -> None:
        self.now = store.now()
        self.attempts: dict[str, list[ObjectInfo]] = defaultdict(list)
        for obj in store.list(attempt_layout.CKPT_PREFIX):
            prefix = _attempt_of(obj.key)
            if prefix is not None:
                self.attempts[prefix].append(obj)
        self.records: dict[int, ObjectInfo] = {}
        for obj in store.list(protocol.COMMITS_PREFIX):
            name = obj.key[len(protocol.COMMITS_PREFIX) :].removesuffix(".json")
            if name.isdigit():
                self.records[int(name)] = obj
        self.uploads: list[PendingUpload] = store.list_multipart("")
        self.latest_time = store.head(protocol.LATEST_KEY).last_modified

    def born(self, prefix: str) -> dt.datetime | None:
        times = [o.last_modified for o in self.attempts.get(prefix, ()) if o.last_modified]
        return min(times) if times else None

    def seq_time(self, seq: int) -> dt.datetime | None:
        """When LATEST seq ``seq`` was written, or a later time if its record is missing
        (later = younger = safer)."""
        record = self.records.get(seq)
        if record is not None:
            return record.last_modified
        later = [o.last_modified for s, o in self.records.items() if s > seq and o.last_modified]
        return min(later) if later else self.latest_time

    def upload_age(self, upload: PendingUpload) -> float:
        attempt = _attempt_of(upload.key)
        born = [t for t in (upload.initiated, self.born(attempt) if attempt else None) if t]
        return _age(self.now, max(born) if born else None)

    def garbage(
        self, prefix: str, age_s: float, tombstone: Tombstone | None = None
    ) -> AttemptGarbage:
        parsed = attempt_layout.parse_ckpt_prefix(prefix)
        return AttemptGarbage(
            prefix,
            tombstone.record.step if tombstone else parsed[0] if parsed else -1,
            age_s,
            tuple(self.attempts.get(prefix, ())),
            tuple(u for u in self.uploads if u.key.startswith(prefix)),
            tombstone,
        )


def _read_head(store: Store) -> VersionedLatest | None:
    """LATEST as GC plans from it; None for a location with no run at all.

    Raises:
        NeedsRepairError: LATEST is unreadable, or missing while checkpoint data exists.
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
    return head


def _effective_grace(latest: Latest, grace_seconds: float | None) -> int:
    """The asked grace, never below the run's ``gc_grace_s`` (writers rely on it)."""
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
    return grace


def _plan_tombstones(latest: Latest, inv: _Inventory, grace: int) -> list[AttemptGarbage]:
    """Phase 1: the tombstones older than grace, counted from their dropping commit."""
    planned = []
    for t in latest.tombstones:
        age = _age(inv.now, inv.seq_time(t.dropped_seq))
        if age > grace:
            planned.append(inv.garbage(t.record.ckpt, age, t))
    return planned


def _plan_orphans(
    latest: Latest, inv: _Inventory, grace: int
) -> tuple[list[AttemptGarbage], list[str]]:
    """Phase 2: attempts LATEST does not reference, split into old (to delete) and young
    (kept: their writer may still commit them)."""
    referenced = latest.referenced_prefixes()
    old, young = [], []
    for prefix in sorted(inv.attempts):
        if prefix in referenced:
            continue
        age = _age(inv.now, inv.born(prefix))
        if age <= grace:
            young.append(prefix)
        else:
            old.append(inv.garbage(prefix, age))
    return old, young


def _plan_uploads(inv: _Inventory, grace: int) -> list[PendingUpload]:
    """Phase 3: incomplete uploads older than grace (those under a planned attempt go with
    it whatever their age)."""
    return [u for u in inv.uploads if inv.upload_age(u) > grace]


def _oldest_needed(tombstones: Iterable[Tombstone]) -> int | None:
    """The lowest seq whose commit record dates a live tombstone (records from it on stay)."""
    return min((t.dropped_seq for t in tombstones), default=None)


def _plan_commit_records(
    latest: Latest, inv: _Inventory, grace: int, keep: int, forgotten: list[AttemptGarbage]
) -> list[CommitRecordGarbage]:
    """Phase 4: records beyond the newest ``keep``, older than grace, below the oldest one
    that dates a tombstone still live once phase 1 forgot its own."""
    gone = {_tombstone_key(a.tombstone) for a in forgotten if a.tombstone}
    cut = _oldest_needed(t for t in latest.tombstones if _tombstone_key(t) not in gone)
    seqs = sorted(inv.records)
    planned = []
    for seq in seqs[: max(0, len(seqs) - keep)]:
        if cut is not None and seq >= cut:
            break
        age = _age(inv.now, inv.records[seq].last_modified)
        if age > grace:
            planned.append(CommitRecordGarbage(seq, inv.records[seq], age))
    return planned


def plan_gc(
    store: Store, *, grace_seconds: float | None = None, keep_commit_records: int = 100
) -> GCPlan:
    """Decide what a GC run would delete, from one read of LATEST and one inventory.
    Writes nothing (see the module doc; ``preview_gc`` and ``execute_gc`` take the plan).

    Raises:
        NeedsRepairError: LATEST is missing or unreadable (GC cannot tell what is referenced).
        StoreError: the store failed.
    """
    head = _read_head(store)
    if head is None:
        return GCPlan(store, int(grace_seconds or 0), store.now(), None)
    grace = _effective_grace(head.latest, grace_seconds)
    inv = _Inventory(store)
    failpoint("gc.after_inventory")
    checkpoints = _plan_tombstones(head.latest, inv, grace)
    orphans, young = _plan_orphans(head.latest, inv, grace)
    uploads = _plan_uploads(inv, grace)
    records = _plan_commit_records(head.latest, inv, grace, keep_commit_records, checkpoints)
    manifest_keys = {p + attempt_layout.MANIFEST_NAME for p in young}
    young_manifests = [o for p in young for o in inv.attempts.get(p, ()) if o.key in manifest_keys]
    return GCPlan(
        store, grace, inv.now, head, checkpoints, orphans, young, uploads, records, young_manifests
    )


# --------------------------------------------------------------------------- shared steps


def _deletable(objects: Iterable[ObjectInfo], protected: set[str] | None) -> list[ObjectInfo]:
    """The objects of an attempt GC may delete: all but the chunks a manifest still names
    (``protected``; None: every chunk, because a manifest could not be read)."""
    return [
        o
        for o in objects
        if not chunks.is_chunk_key(o.key) or (protected is not None and o.key not in protected)
    ]


def _protected(store: Store, latest: Latest, deleting: Iterable[str] = ()) -> set[str] | None:
    # Through the module attribute: tests/mutants.py patches it.
    keys = chunks.protected_chunk_keys(store, latest, deleting)
    if keys is None:
        log.warning("a retained manifest is unreadable; GC keeps every chunk this time")
    return keys


def _has_work(plan: GCPlan) -> bool:
    return bool(plan.checkpoints or plan.orphans or plan.uploads or plan.commit_records)


def _judge(store: Store, latest: Latest) -> set[str] | None:
    """Read every manifest the plan's LATEST names (retained and tombstoned), before GC
    writes or deletes anything: "I do not understand this" is refused while the run is
    still as GC found it. Returns the chunks they name (None: one was unreadable).

    Raises:
        UnknownFormatError: a manifest a newer cloudckpt wrote (nothing written).
        StoreError: the store failed (nothing written).
    """
    return chunks.protected_chunk_keys(store, latest)


def _check_attempt_marker(data: bytes, what: str) -> None:
    # ATTEMPT.json is unsealed canonical JSON; what does not parse is damage.
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return
    if isinstance(body, dict):
        formats.check_format(
            body, "cloudckpt.attempt/", (formats.ATTEMPT_FORMAT,), what, "attempt marker"
        )


def _check_manifest(data: bytes, what: str) -> None:
    manifests.parse_manifest(data)


def _check_commit_record(data: bytes, what: str) -> None:
    protocol.parse_latest(data, what=what)


def _refuse_newer(store: Store, obj: ObjectInfo, check: Callable[[bytes, str], None]) -> None:
    """Raise UnknownFormatError if ``obj`` is a record a newer cloudckpt wrote. Damage
    (it does not parse, fails its seal, is over the size limit) and a record already gone
    are no newer version's: GC collects them as before."""
    if obj.size > formats.MAX_MANIFEST_BYTES:
        return
    try:
        data, _ = call_with_retries(lambda: store.get(obj.key), what=f"read {obj.key}")
        check(data, obj.key)
    except (ObjectNotFoundError, CorruptRecordError, UnsafePathError):
        return


def _judge_garbage(plan: GCPlan) -> None:
    """Read every record GC would delete by its name alone, before its first write: an
    old commit record, the manifest and ATTEMPT.json of each planned attempt (a tombstone's
    manifest is read by ``_judge``), and the manifest of each young unreferenced attempt (a
    newer version's may name chunks under an old orphan). "An unknown format is refused,
    never collected": one a newer cloudckpt wrote stops GC with the run untouched.

    Raises:
        UnknownFormatError: such a record (nothing written).
        StoreError: the store failed (nothing written).
    """
    store = plan.store
    for record in plan.commit_records:
        _refuse_newer(store, record.obj, _check_commit_record)
    for item in [*plan.checkpoints, *plan.orphans]:
        for obj in item.objects:
            if obj.key == item.prefix + attempt_layout.ATTEMPT_NAME:
                _refuse_newer(store, obj, _check_attempt_marker)
            elif obj.key == item.prefix + attempt_layout.MANIFEST_NAME and not item.tombstone:
                _refuse_newer(store, obj, _check_manifest)
    for obj in plan.young_manifests:
        _refuse_newer(store, obj, _check_manifest)


def _commit_ids(items: Iterable[AttemptGarbage]) -> set[str]:
    return {a.tombstone.record.commit_id for a in items if a.tombstone is not None}


# --------------------------------------------------------------------------- dry run


def preview_gc(plan: GCPlan) -> GCReport:
    """What executing ``plan`` would delete if LATEST did not change meanwhile: the plan
    resolved against the LATEST it was made from (its manifests say which chunks stay).
    Writes and deletes nothing.

    Raises:
        UnknownFormatError: a manifest the run holds is a newer version's (as execute_gc).
        StoreError: the store failed while reading manifests.
    """
    report = GCReport(True, plan.grace_seconds, plan.store_now)
    latest = plan.latest
    if latest is None:
        return report
    report.latest_seq = latest.seq
    if _has_work(plan):
        _judge(plan.store, latest)  # what execute_gc refuses before its first write
        _judge_garbage(plan)
    if plan.checkpoints:
        if any(a.tombstone and a.tombstone.state == "pending" for a in plan.checkpoints):
            report.latest_writes.append("gc-mark")
        protected = _protected(plan.store, latest, _commit_ids(plan.checkpoints))
        for item in plan.checkpoints:
            report.deleted_checkpoints.append((item.step, item.prefix))
            _would_delete(report, item, _deletable(item.objects, protected))
        report.latest_writes.append("gc-forget")
    if plan.orphans:
        protected = _protected(plan.store, latest)
        for item in plan.orphans:
            objects = _deletable(item.objects, protected)
            if objects:
                report.deleted_orphans.append(item.prefix)
                _would_delete(report, item, objects)
        if report.deleted_orphans:
            report.latest_writes.append("gc-sweep")
    report.kept_young = list(plan.kept_young)
    handled = {k for k, _ in report.aborted_uploads}
    report.aborted_uploads += [(u.key, u.upload_id) for u in plan.uploads if u.key not in handled]
    report.deleted_commit_records = [r.obj.key for r in plan.commit_records]
    report.deleted_objects += len(plan.commit_records)
    _log(plan, report)
    return report


def _would_delete(report: GCReport, item: AttemptGarbage, objects: list[ObjectInfo]) -> None:
    report.aborted_uploads.extend((u.key, u.upload_id) for u in item.uploads)
    report.deleted_objects += len(objects)
    report.freed_bytes += sum(o.size for o in objects)


def _log(plan: GCPlan, report: GCReport) -> None:
    log.info(
        "gc %s: %d checkpoints, %d orphan attempts, %d uploads, %d commit records%s",
        plan.store.url,
        len(report.deleted_checkpoints),
        len(report.deleted_orphans),
        len(report.aborted_uploads),
        len(report.deleted_commit_records),
        " (dry run)" if report.dry_run else "",
    )


# --------------------------------------------------------------------------- execute


def execute_gc(plan: GCPlan) -> GCReport:
    """Carry ``plan`` out, judging again after each LATEST write of its own (module doc):
    what became referenced since the plan was made stays.

    Raises:
        UnknownFormatError: a manifest the run holds is a newer version's; read before the
            first write, so nothing was written or deleted (unless LATEST moved meanwhile
            and a newer manifest arrived with it: then GC stops at its next read).
        NeedsRepairError: LATEST became missing or unreadable while GC edited it.
        CommitConflictError: LATEST kept changing under GC's edits.
        StoreError: the store failed; re-running GC continues where it stopped.
    """
    report = GCReport(False, plan.grace_seconds, plan.store_now)
    if plan.latest is None:
        return report
    report.latest_seq = plan.latest.seq
    if _has_work(plan):
        # Everything GC must understand is read before its first write (a newer version's
        # manifest stops it with the run untouched); after each LATEST write of its own it
        # reads them again, because LATEST may have moved since the plan.
        _judge(plan.store, plan.latest)
        _judge_garbage(plan)
    deleted = _execute_tombstones(plan, report)
    fresh = read_latest(plan.store)
    latest = fresh.latest if fresh is not None else plan.latest
    _execute_orphans(plan, latest, deleted, report)
    _execute_uploads(plan, report)
    _execute_commit_records(plan, latest, report)
    _log(plan, report)
    return report


def _edit(
    store: Store, change: Callable[[Latest, dt.datetime], Latest | None], report: GCReport
) -> Latest:
    """``edit_latest``, noting in the report whether it wrote (``change`` may find nothing
    to do). Returns the LATEST it wrote, or the one it found."""
    wrote: list[str] = []

    def noted(cur: Latest, at: dt.datetime) -> Latest | None:
        new = change(cur, at)
        wrote[:] = [new.op] if new is not None else []
        return new

    latest = edit_latest(store, noted)
    if latest is None:  # edit_latest returns what it wrote or found; never None
        raise NeedsRepairError(f"{store.url} has no LATEST to edit")
    report.latest_writes.extend(wrote)
    return latest


def _execute_tombstones(plan: GCPlan, report: GCReport) -> set[str]:
    """Phase 1: mark, delete what the marked LATEST says, forget. Returns the prefixes
    deleted (they are no orphans: their chunks may stay for later checkpoints)."""
    if not plan.checkpoints:
        return set()
    planned = {_tombstone_key(a.tombstone): a for a in plan.checkpoints if a.tombstone}

    def mark(cur: Latest, at: dt.datetime) -> Latest | None:
        todo = {
            t.record.commit_id
            for t in cur.tombstones
            if _tombstone_key(t) in planned and t.state == "pending"
        }
        return protocol.mark_deleting(cur, todo, at) if todo else None

    marked = _edit(plan.store, mark, report)
    failpoint("gc.after_mark")
    # Delete only what the LATEST we wrote (or found) marks: a pin may have brought a
    # checkpoint back between the plan and the mark.
    todo = [
        planned[_tombstone_key(t)]
        for t in marked.tombstones
        if _tombstone_key(t) in planned and t.state == "deleting"
    ]
    if not todo:
        return set()
    # Chunks other checkpoints still name stay (cloudckpt.chunks: why this LATEST).
    protected = _protected(plan.store, marked, _commit_ids(todo))
    for item in todo:
        report.deleted_checkpoints.append((item.step, item.prefix))
        _delete_attempt(plan.store, item, _deletable(item.objects, protected), report)
    ids = _commit_ids(todo)

    def forget(cur: Latest, at: dt.datetime) -> Latest | None:
        present = any(t.record.commit_id in ids for t in cur.tombstones)
        return protocol.forget_tombstones(cur, ids, at) if present else None

    _edit(plan.store, forget, report)
    failpoint("gc.after_forget")
    return {item.prefix for item in todo}


def _execute_orphans(plan: GCPlan, fresh: Latest, deleted: set[str], report: GCReport) -> None:
    """Phase 2: the planned orphans a fresh read of LATEST does not reference; then the
    sweep, and again only those the swept LATEST does not reference."""
    referenced = fresh.referenced_prefixes() | deleted
    report.kept_young = [p for p in plan.kept_young if p not in referenced]
    orphans = [a for a in plan.orphans if a.prefix not in referenced]
    if orphans:
        # A checkpoint GC deleted earlier leaves the chunks later checkpoints still name:
        # its prefix then looks like an orphan whose chunks are protected.
        protected = _protected(plan.store, fresh)
        orphans = [a for a in orphans if _deletable(a.objects, protected)]
    if not orphans:
        return
    # Fence commits still in flight (see protocol.sweep, looked up here: tests/mutants.py
    # patches it), then judge again against the LATEST we wrote: whatever committed before
    # it is referenced there.
    swept = _edit(plan.store, protocol.sweep, report)
    failpoint("gc.after_sweep")
    orphans = [a for a in orphans if a.prefix not in swept.referenced_prefixes()]
    protected = _protected(plan.store, swept)
    for item in orphans:
        objects = _deletable(item.objects, protected)
        if objects:
            report.deleted_orphans.append(item.prefix)
            _delete_attempt(plan.store, item, objects, report)


def _delete_attempt(
    store: Store, item: AttemptGarbage, objects: list[ObjectInfo], report: GCReport
) -> None:
    """Abort the attempt's incomplete uploads, then delete its objects: manifest first,
    then files, ATTEMPT.json last."""
    for upload in item.uploads:
        store.abort_multipart(MultipartUpload(upload.key, upload.upload_id))
        report.aborted_uploads.append((upload.key, upload.upload_id))
    prefix = item.prefix
    objs = sorted(objects, key=lambda o: o.key)
    manifest = [o for o in objs if o.key == prefix + attempt_layout.MANIFEST_NAME]
    marker = [o for o in objs if o.key == prefix + attempt_layout.ATTEMPT_NAME]
    data = [o for o in objs if o not in manifest and o not in marker]
    for group, name in ((manifest, "manifest"), (data, "data"), (marker, "marker")):
        if group:
            store.delete_many([o.key for o in group])
            report.deleted_objects += len(group)
            report.freed_bytes += sum(o.size for o in group)
        failpoint(f"gc.after_delete_{name}")


def _execute_uploads(plan: GCPlan, report: GCReport) -> None:
    """Phase 3: old uploads not already aborted with their attempt (including those of a
    planned attempt that was kept after all)."""
    handled = {k for k, _ in report.aborted_uploads}
    for upload in plan.uploads:
        if upload.key in handled:
            continue
        report.aborted_uploads.append((upload.key, upload.upload_id))
        plan.store.abort_multipart(MultipartUpload(upload.key, upload.upload_id))


def _execute_commit_records(plan: GCPlan, fresh: Latest, report: GCReport) -> None:
    """Phase 4: the planned records, except those dating a tombstone live in ``fresh``."""
    cut = _oldest_needed(fresh.tombstones)
    for record in plan.commit_records:
        if cut is not None and record.seq >= cut:
            break
        report.deleted_commit_records.append(record.obj.key)
        plan.store.delete(record.obj.key)
        report.deleted_objects += 1


# --------------------------------------------------------------------------- the entry point


def collect_garbage(
    store: Store,
    *,
    grace_seconds: float | None = None,
    dry_run: bool = False,
    keep_commit_records: int = 100,
) -> GCReport:
    """Delete unreferenced checkpoint data older than the grace period (see module doc):
    ``plan_gc``, then ``execute_gc``, or with ``dry_run`` ``preview_gc`` (nothing written).

    ``grace_seconds`` below the run's ``gc_grace_s`` is raised to it (with a warning):
    running writers rely on that value to stop committing old attempts.

    Raises:
        NeedsRepairError: LATEST is missing or unreadable (GC cannot tell what is referenced).
        StoreError: the store failed; re-running GC continues where it stopped.
    """
    plan = plan_gc(store, grace_seconds=grace_seconds, keep_commit_records=keep_commit_records)
    return preview_gc(plan) if dry_run else execute_gc(plan)
