"""The invariant checker: the invariants of docs/design.md §9, checked on every LATEST write, every
deletion, every restore, and after every scheduler tick.

It reads the truth from the memory store directly (below every fault), keeps the chain
of every LATEST ever applied, and raises ``InvariantViolation`` at the first broken rule
(after recording it on the result, so no handler in the code under test can hide it).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import math
from collections.abc import Iterable
from typing import NoReturn

from cloudckpt import attempt_layout, canonical, digest, manifests, protocol
from cloudckpt.errors import CloudCkptError, StoreError
from cloudckpt.protocol import CheckpointRecord, Latest, Tombstone
from cloudckpt.restore import RestoreResult
from cloudckpt.stores.base import MultipartUpload, PutMode
from cloudckpt.testing.simulation.plumbing import prefix_of
from cloudckpt.testing.simulation.result import InvariantViolation
from cloudckpt.testing.simulation.roles import CheckedWorld, Process


def _ids(records: Iterable[CheckpointRecord]) -> set[str]:
    return {r.commit_id for r in records}


def _tombs(latest: Latest) -> dict[str, Tombstone]:
    return {t.record.commit_id: t for t in latest.tombstones}


def _finite(value: object) -> float | None:
    """A metric's value if it is a finite number (the checker's own reading of the rule)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _epoch(iso_time: str) -> float | None:
    """Seconds since the Unix epoch of a record's ``committed_at``, or None."""
    try:
        return canonical.parse_iso(iso_time).timestamp()
    except ValueError:
        return None


@dataclasses.dataclass
class RecordState:
    record: CheckpointRecord
    current_seq: int  # the LATEST seq at which it became current
    dropped_at: dt.datetime | None = None  # store time it became a tombstone
    gone: bool = False  # its tombstone was forgotten after GC deleted it


class Checker:
    """The invariants of docs/design.md §9, checked on every LATEST write, every deletion, and
    after every scheduler tick. Raises ``InvariantViolation``."""

    def __init__(self, sim: CheckedWorld) -> None:
        self.sim = sim
        self.raw = sim.memory
        self.chain: list[Latest] = []  # every LATEST body ever applied, in order
        self.records: dict[str, RecordState] = {}  # commit_id -> state
        self.acked: dict[str, str] = {}  # commit_id -> sim key of acknowledged saves
        self.failed_keys: set[str] = set()  # sim keys of saves that failed definitely
        self.first_write: dict[str, dt.datetime] = {}  # prefix -> store time
        self.gc_deleted: set[str] = set()  # prefixes GC deleted (some of)
        # Unreferenced prefixes older than grace when GC wrote a sweep: GC may delete them
        # from then on, so no later commit may name their chunks (docs/design.md §11).
        self.gc_owned: set[str] = set()
        self.verified: set[str] = set()  # referenced prefixes verified complete
        self.upload_owners: dict[str, tuple[str, int]] = {}  # upload id -> (actor, incarnation)
        self.chunk_users: dict[str, set[str]] = collections.defaultdict(set)  # owner -> ckpts
        self._manifests: dict[str, manifests.Manifest | None] = {}  # commit_id -> parsed
        self.op_writes: collections.Counter = collections.Counter()  # (actor, op) -> LATEST writes
        self._latest_version = ""
        # I11: the seq of a LATEST a newer cloudckpt wrote (``actors/newer``), while it is
        # there: this version must not write LATEST or delete anything until it is gone.
        self.newer_seq: int | None = None

    def fail(self, message: str) -> NoReturn:
        """Record a violation (where it is detected, so no handler can hide it) and stop."""
        self.sim.violation(message)
        raise InvariantViolation(message)

    @property
    def latest(self) -> Latest | None:
        return self.chain[-1] if self.chain else None

    # -- hooks from the recorder --

    def touched(self, prefix: str, now: dt.datetime) -> None:
        # The oldest write's store time, as GC dates an attempt: with the store's clock
        # stepping back (``Simulation.clock_stepped_back``) a later write can be older.
        first = self.first_write.get(prefix)
        self.first_write[prefix] = now if first is None else min(first, now)
        self.verified.discard(prefix)
        self.verified -= self.chunk_users.get(prefix, set())

    def manifest_of(self, rec: CheckpointRecord) -> manifests.Manifest | None:
        """The parsed manifest of a record (immutable, so cached), None if unreadable."""
        if rec.commit_id not in self._manifests:
            try:
                parsed = manifests.parse_manifest(self.raw.get(rec.manifest_key)[0], rec)
            except CloudCkptError:
                return None  # not cached: I2 reports it where it matters
            self._manifests[rec.commit_id] = parsed
        return self._manifests[rec.commit_id]

    def named_chunks(self, latest: Latest) -> dict[str, CheckpointRecord]:
        """Chunk key -> a checkpoint that names it, over every checkpoint GC must keep:
        retained ones and tombstones not yet marked deleting."""
        named = {}
        for rec in [*latest.retained(), *(t.record for t in latest.tombstones if t.state == "pending")]:  # fmt: skip
            m = self.manifest_of(rec)
            for f in m.files if m else ():
                for chunk in f.chunks or ():
                    named[chunk.key] = rec
        return named

    def latest_written(self, body: bytes, mode: PutMode | None, actor: Process | None) -> None:
        """I1, I3, I4, I5: every applied LATEST is the next link of one chain, and a legal
        transition from the one before it."""
        who = actor.name if actor else "?"
        if self.newer_seq is not None:
            self.fail(
                f"I11: {who} wrote LATEST over the one a newer version wrote (seq "
                f"{self.newer_seq}): the run was rolled back"
            )
        try:
            new = protocol.parse_latest(body)
        except CloudCkptError as exc:
            self.fail(f"I1: {who} wrote a LATEST that does not verify: {exc}")
        prev = self.latest
        if actor is not None:
            self.op_writes[(actor.name, actor.incarnation, actor.op)] += 1
        if prev is None:
            if new.seq != 1 or new.op != "claim":
                self.fail(f"I1: first LATEST has seq {new.seq} op {new.op}")
        elif new.seq != prev.seq + 1 or new.parent_seq != prev.seq:
            self.fail(
                f"I1/I5: LATEST seq {new.seq} (parent {new.parent_seq}) written by {who} "
                f"after seq {prev.seq}: the chain is broken (a seq reused or skipped)"
            )
        if prev is not None:
            self._transition(prev, new, actor)
            self._count_extra_keeps(new)
        self.chain.append(new)
        now = self.raw.now()
        for rec in new.retained():
            if rec.commit_id not in self.records:
                self.records[rec.commit_id] = RecordState(rec, new.seq)
        for t in new.tombstones:
            state = self.records.get(t.record.commit_id)
            if state is not None and state.dropped_at is None:
                state.dropped_at = now
        for rec in new.retained():
            self.records[rec.commit_id].dropped_at = None
        if new.op == "gc-sweep":
            self._swept(new, now)

    def _swept(self, swept: Latest, now: dt.datetime) -> None:
        """GC wrote a sweep: every unreferenced attempt older than grace (by its oldest
        object, GC's own measure) is GC's from now on."""
        referenced = swept.referenced_prefixes()
        born: dict[str, dt.datetime] = {}
        for obj in self.raw.list(attempt_layout.CKPT_PREFIX):
            prefix = prefix_of(obj.key)
            if prefix is None or prefix in referenced or obj.last_modified is None:
                continue
            born[prefix] = min(born.get(prefix, obj.last_modified), obj.last_modified)
        grace = swept.settings.gc_grace_s
        self.gc_owned.update(p for p, t in born.items() if (now - t).total_seconds() > grace)

    def _transition(self, prev: Latest, new: Latest, actor: Process | None) -> None:
        """I3-I7 on one applied LATEST write: a legal step from ``prev`` to ``new``."""
        who = actor.name if actor else "?"
        self._writer_change(prev, new, actor, who)
        self._current_change(prev, new, actor, who)
        self._retained_change(prev, new, who)
        self._tombstone_change(prev, new, who)
        pinned = {p.commit_id for p in new.pins}
        new_ret = _ids(new.retained())
        if not pinned <= new_ret:
            self.fail(f"I3: pins {sorted(pinned - new_ret)} are not retained")

    def _writer_change(self, prev: Latest, new: Latest, actor: Process | None, who: str) -> None:
        """I4: the writer changes only by a claim, which bumps the epoch by one and keeps
        the retained checkpoints as they were."""
        if new.op == "claim":
            if new.writer.epoch != prev.writer.epoch + 1:
                self.fail(f"I4: claim by {who} went from epoch {prev.writer.epoch} to "
                          f"{new.writer.epoch}")  # fmt: skip
            if actor is None or new.writer.id != actor.writer_id:
                self.fail(f"I4: {who} wrote a claim for writer {new.writer.id}")
            if _ids(new.retained()) != _ids(prev.retained()) or set(_tombs(new)) != set(_tombs(prev)):  # fmt: skip
                self.fail(f"I3: the claim by {who} changed the retained checkpoints")
        elif new.writer != prev.writer:
            self.fail(
                f"I4: a {new.op} by {who} changed the writer from {prev.writer} to {new.writer}"
            )

    def _current_change(self, prev: Latest, new: Latest, actor: Process | None, who: str) -> None:
        """I4-I7: only the writer that owns the epoch commits, each attempt once, never one
        GC touched or one reported failed; nothing but a commit changes the current one."""
        op, current = new.op, new.current
        if op == "commit":
            if current is None:
                self.fail(f"I4: a commit by {who} left no current checkpoint")
            if actor is None or actor.writer_id != new.writer.id:
                self.fail(
                    f"I4: {who} (writer {actor.writer_id if actor else None}) committed "
                    f"{current.ckpt} on top of epoch {new.writer.epoch} owned by "
                    f"{new.writer.id}: a fenced writer's commit landed after a newer claim"
                )
            if current.epoch != new.writer.epoch:
                self.fail(
                    f"I4: commit of {current.ckpt} (epoch {current.epoch}) under "
                    f"writer epoch {new.writer.epoch}"
                )
            if current.commit_id in _ids(prev.retained()) or current.commit_id in _tombs(prev):
                self.fail(f"I5: {current.commit_id} committed twice")
            if current.ckpt in self.gc_deleted:
                self.fail(f"I7: {current.ckpt} was committed after GC deleted some of it")
            self._committed_at_on_store_clock(current, who)
            key = current.metadata.get("sim")
            if key in self.failed_keys:
                self.fail(f"I6: save {key} was reported failed, yet it was committed by {who}")
            self._names_no_chunk_gc_may_own(prev, current, who)
        elif (current and current.commit_id) != (prev.current and prev.current.commit_id):
            self.fail(f"I3: a {op} by {who} changed the current checkpoint")

    def _names_no_chunk_gc_may_own(self, prev: Latest, current: CheckpointRecord, who: str) -> None:
        """I7: a commit names only chunks GC cannot own: its own attempt's, those a
        manifest GC must keep names (in ``prev``, the LATEST it replaces: retained checkpoints and
        pending tombstones), and those of an unreferenced attempt (an interrupted save it
        resumed) that was not older than grace at any GC sweep before this commit (GC
        deletes orphans only after a sweep, judged old before it: ``_swept``)."""
        manifest = self.manifest_of(current)
        if manifest is None:
            return  # I2 reports an unreadable manifest
        named = self.named_chunks(prev)
        for entry in manifest.files:
            for chunk in entry.chunks or ():
                if chunk.owner == current.ckpt or chunk.key in named:
                    continue
                if chunk.owner in self.gc_owned or chunk.owner in self.gc_deleted:
                    self.fail(
                        f"I7: the commit of {current.ckpt} by {who} names chunk "
                        f"{chunk.key} of an unreferenced attempt that was older than grace "
                        "at a GC sweep, which GC may own"
                    )
                self.sim.result.counters["resumed_chunks_committed"] += 1

    def _count_extra_keeps(self, new: Latest) -> None:
        """Counters: commits after which a checkpoint that keep_last, keep_every and pins
        would have dropped is retained, with keep-best or periods on (the soak must
        exercise them)."""
        s = new.settings
        if new.op != "commit" or s.keep_last is None:
            return
        pinned = {p.commit_id for p in new.pins}
        extra = [
            r
            for r in new.retained()[s.keep_last :]
            if r.commit_id not in pinned and not (s.keep_every and r.step % s.keep_every == 0)
        ]
        counters = self.sim.result.counters
        if extra and s.keep_best is not None:
            counters["kept_by_best"] += 1
        if extra and s.keep_periods:
            counters["kept_by_period"] += 1

    def _committed_at_on_store_clock(self, rec: CheckpointRecord, who: str) -> None:
        """A commit's ``committed_at`` is the store's time between the attempt's first
        write and this write of LATEST: time-based retention buckets by it, and a host's
        clock (suspended, skewed) must play no part (docs/design.md §6.8)."""
        t = _epoch(rec.committed_at)
        born = self.first_write.get(rec.ckpt)
        now = self.raw.now().timestamp()
        if t is None or t > now or (born is not None and t < born.timestamp() - 0.001):
            self.fail(
                f"I3: {who} committed step {rec.step} with committed_at {rec.committed_at}, "
                f"not the store's time (attempt begun {born}, LATEST written "
                f"{canonical.iso(self.raw.now())})"
            )

    def _retained_change(self, prev: Latest, new: Latest, who: str) -> None:
        """I3: retained -> tombstone only by retention (a commit or an unpin), never a
        pinned checkpoint, a milestone, while fewer than ``keep_last`` remain, while among
        the best ``keep_best``, or while the only one of its period in the window."""
        op, new_ret, new_tomb = new.op, _ids(new.retained()), _tombs(new)
        for cid in _ids(prev.retained()) - new_ret:
            if cid not in new_tomb or op not in ("commit", "unpin"):
                self.fail(f"I3: {cid} left the retained set by a {op} of {who}")
            if cid in {p.commit_id for p in new.pins}:
                self.fail(f"I3: pinned {cid} was dropped by retention")
            record = self.records[cid].record
            step = record.step
            if new.settings.keep_every and step % new.settings.keep_every == 0:
                self.fail(f"I3: milestone step {step} dropped despite keep_every")
            if new.settings.keep_last is not None and len(new_ret) < new.settings.keep_last:
                self.fail(f"I3: {cid} dropped with only {len(new_ret)} retained")
            self._best_kept(record, new, who)
            self._period_kept(record, new, who)

    def _best_kept(self, dropped: CheckpointRecord, new: Latest, who: str) -> None:
        """I3, keep-best: a checkpoint with a finite value of the metric leaves only if at
        least ``keep_best`` retained ones are as good or better (whatever the tie rule)."""
        s = new.settings
        if s.keep_best is None or s.best_metric is None:
            return
        value = _finite(dropped.metrics.get(s.best_metric))
        if value is None:
            return  # no (finite) value: never among the best
        as_good = [
            r.step
            for r in new.retained()
            if (v := _finite(r.metrics.get(s.best_metric))) is not None
            and (v <= value if s.best_mode == "min" else v >= value)
        ]
        if len(as_good) < s.keep_best:
            self.fail(
                f"I3: step {dropped.step} ({s.best_metric}={value}) dropped by a {new.op} of "
                f"{who} while among the best {s.keep_best} ({s.best_mode}); as good or "
                f"better and retained: {as_good}"
            )

    def _period_kept(self, dropped: CheckpointRecord, new: Latest, who: str) -> None:
        """I3, one per period: a checkpoint inside a window leaves only if another retained
        one lies in the same period bucket of that window (times: ``committed_at``, on the
        store's clock; "now": the current checkpoint's)."""
        t, now = _epoch(dropped.committed_at), new.current and _epoch(new.current.committed_at)
        if t is None or not now:
            return
        for period, window in new.settings.keep_periods:
            if t <= now - window:
                continue
            bucket = t // period
            others = [
                r.step
                for r in new.retained()
                if (rt := _epoch(r.committed_at)) is not None
                and rt > now - window
                and rt // period == bucket
            ]
            if not others:
                self.fail(
                    f"I3: step {dropped.step} dropped by a {new.op} of {who} though it was "
                    f"the only checkpoint of its {period} s period in the last {window} s"
                )

    def _tombstone_change(self, prev: Latest, new: Latest, who: str) -> None:
        """I3, I7: tombstone -> retained only by a pin of a pending tombstone; pending ->
        deleting only by GC; a tombstone leaves only after it was marked deleting."""
        op, new_ret, new_tomb = new.op, _ids(new.retained()), _tombs(new)
        for cid, t in _tombs(prev).items():
            n = new_tomb.get(cid)
            if n is None:
                if cid in new_ret:
                    if op != "pin" or t.state != "pending":
                        self.fail(f"I3/I7: tombstone {cid} ({t.state}) came back by a {op}")
                elif op != "gc-forget" or t.state != "deleting":
                    self.fail(f"I3: tombstone {cid} ({t.state}) vanished by a {op} of {who}")
                else:
                    self.records[cid].gone = True
            elif n.state != t.state and (op != "gc-mark" or n.state != "deleting"):
                self.fail(f"I7: tombstone {cid} went {t.state} -> {n.state} by a {op}")

    def before_delete(self, key: str, actor: Process | None) -> None:
        """I6, I7: GC deletes only unreferenced objects older than grace; manifest first."""
        who = actor.name if actor else "?"
        latest = self.latest
        self._nothing_deleted_under_newer(who, key)
        if key == protocol.LATEST_KEY:
            self.fail(f"I7: {who} deleted LATEST")
        now = self.raw.now()
        grace = latest.settings.gc_grace_s if latest else 0
        if key.startswith(protocol.COMMITS_PREFIX):
            info = self.raw.head(key) if self.raw.exists(key) else None
            seq = int(key[len(protocol.COMMITS_PREFIX) :].removesuffix(".json"))
            live = [t.dropped_seq for t in latest.tombstones] if latest else []
            if latest and seq >= latest.seq:
                self.fail(f"I7: {who} deleted the newest commit record {key}")
            if live and seq >= min(live):
                self.fail(f"I7: {who} deleted {key}, which dates a live tombstone")
            written = info.last_modified if info else None  # (always set by MemoryStore)
            if written and (now - written).total_seconds() <= grace:
                self.fail(f"I7: {who} deleted {key} younger than grace")
            return
        prefix = prefix_of(key)
        if prefix is None or latest is None:
            return
        if key.split("/")[2:3] == ["chunks"]:
            named = self.named_chunks(latest).get(key)
            if named is not None:
                self.fail(
                    f"I7: {who} deleted chunk {key}, which step {named.step} ({named.ckpt}) "
                    "still names"
                )
        self.gc_deleted.add(prefix)
        retained = {r.ckpt: r for r in latest.retained()}
        tomb = {t.record.ckpt: t for t in latest.tombstones}
        if prefix in retained:
            self.fail(f"I7: {who} deleted {key} of retained step {retained[prefix].step}")
        if prefix in tomb and tomb[prefix].state != "deleting":
            self.fail(f"I7: {who} deleted {key} of a tombstone not yet marked deleting")
        state = next((s for s in self.records.values() if s.record.ckpt == prefix), None)
        if state is not None:
            # A committed checkpoint: dropped at least grace ago, manifest first.
            dropped = state.dropped_at
            if dropped is None or (now - dropped).total_seconds() <= grace:
                self.fail(f"I7: {who} deleted {key} of a checkpoint dropped < grace ago")
            manifest = prefix + attempt_layout.MANIFEST_NAME
            if key != manifest and self.raw.exists(manifest):
                self.fail(f"I7: {who} deleted {key} before the manifest of {prefix}")
        else:
            born = self.first_write.get(prefix)
            if born is not None and (now - born).total_seconds() <= grace:
                self.fail(f"I7: {who} deleted {key} of an attempt younger than grace")

    def upload_created(self, upload: MultipartUpload, actor: Process | None) -> None:
        """Who began each multipart upload (process and incarnation), for ``before_abort``."""
        if actor is not None:
            self.upload_owners[upload.upload_id] = (actor.name, actor.incarnation)

    def before_abort(self, upload: MultipartUpload, actor: Process | None) -> None:
        """I7: an abort is GC's (the process is collecting garbage: ``task`` "gc"), judged
        by the grace period, or a process abandoning an upload it began itself (a save
        whose upload failed), at any age. Any other abort fails."""
        if actor is None:
            return  # not through an actor's store (the final phase's own damage)
        state = self.raw.bucket.uploads.get(upload.upload_id)
        if state is None:
            return  # already gone: the abort changes nothing
        counters = self.sim.result.counters
        if actor.task != "gc":
            owner = self.upload_owners.get(upload.upload_id)
            if owner != (actor.name, actor.incarnation):
                self.fail(
                    f"I7: {actor.name}#{actor.incarnation} aborted the upload of {upload.key}, "
                    f"begun by {owner[0] + '#' + str(owner[1]) if owner else 'no one seen'}, "
                    "outside GC"
                )
            counters["uploads_abandoned_by_their_process"] += 1
            return
        # GC may abort an upload older than grace, or any upload of an attempt older
        # than grace (such an attempt can no longer commit: StaleAttemptError).
        prefix = prefix_of(upload.key)
        grace = self.latest.settings.gc_grace_s if self.latest else 0
        now = self.raw.now()
        born = self.first_write.get(prefix) if prefix else None
        ages = [now - t for t in (state.initiated, born) if t]
        if all(age.total_seconds() <= grace for age in ages):
            self.fail(
                f"I7: GC ({actor.name}) aborted the upload of {upload.key}, younger than grace"
            )
        counters["uploads_aborted_by_gc"] += 1

    # -- after every tick --

    def check_world(self) -> None:
        latest = self.latest
        if latest is None:
            if self.raw.exists(protocol.LATEST_KEY):
                self.fail("I1: a LATEST exists that no one was seen writing")
            return
        data, info = self.raw.get(protocol.LATEST_KEY)
        if info.version != self._latest_version:  # unchanged bytes need no second look
            try:
                parsed = protocol.parse_latest(data)
            except CloudCkptError as exc:
                self.fail(f"I1: LATEST does not verify: {exc}")
            if parsed.seq != latest.seq or parsed.nonce != latest.nonce:
                self.fail("I1: LATEST is not the last body the chain recorded")
            self._latest_version = info.version
        # I2: every referenced checkpoint (retained, and pending tombstones a pin may
        # bring back) is complete and matches its digests.
        for rec in [*latest.retained(), *(t.record for t in latest.tombstones if t.state == "pending")]:  # fmt: skip
            if rec.ckpt not in self.verified:
                self.verify_complete(rec)
                self.verified.add(rec.ckpt)
        # I3: every acknowledged save is still referenced, or left through retention/GC.
        known = {r.commit_id for r in latest.retained()} | {
            t.record.commit_id for t in latest.tombstones
        }
        for cid in self.acked:
            if cid not in known and not self.records[cid].gone:
                self.fail(f"I3: acknowledged save {cid} is no longer in LATEST")

    def verify_complete(self, rec: CheckpointRecord) -> None:
        what = f"I2: step {rec.step} ({rec.ckpt})"
        try:
            data, _ = self.raw.get(rec.manifest_key)
        except StoreError:
            self.fail(f"{what}: the manifest is missing")
        try:
            manifest = manifests.parse_manifest(data, rec)
        except CloudCkptError as exc:
            self.fail(f"{what}: the manifest does not verify: {exc}")
        for entry in manifest.files:
            if entry.chunks is not None:
                parts = []
                for chunk in entry.chunks:
                    self.chunk_users[chunk.owner].add(rec.ckpt)
                    try:
                        parts.append(self.raw.get(chunk.key)[0])
                    except StoreError:
                        self.fail(f"{what}: chunk {chunk.key} of {entry.path} is missing")
                    if digest.hexleaf(parts[-1], chunk.algorithm) != chunk.sha256:
                        self.fail(f"{what}: chunk {chunk.key} does not match its name")
                body = b"".join(parts)
            else:
                key = rec.ckpt + attempt_layout.FILES_DIR + entry.path
                try:
                    body, _ = self.raw.get(key)
                except StoreError:
                    self.fail(f"{what}: {entry.path} is missing")
            if (
                len(body) != entry.size
                or digest.tree_digest(body, algorithm=entry.algorithm) != entry.digest
            ):
                self.fail(f"{what}: {entry.path} does not match its size and digest")

    # -- outcomes reported to actors --

    def acknowledged(self, commit_id: str, key: str, who: str) -> None:
        """I3: a save that returned success is in LATEST."""
        state = self.records.get(commit_id)
        if state is None:
            self.fail(f"I3: {who} acknowledged {key} ({commit_id}), which never became current")
        if state.record.metadata.get("sim") != key:
            self.fail(f"I3: {who} acknowledged {key} but LATEST holds other content")
        self.acked[commit_id] = key

    def failed(self, key: str, exc: BaseException, who: str) -> None:
        """I6: a save that failed definitely is not committed (and never will be)."""
        latest = self.latest
        if latest is not None:
            for rec in latest.retained():
                if rec.metadata.get("sim") == key:
                    self.fail(
                        f"I6: {who}'s save {key} failed with {type(exc).__name__} ({exc}), "
                        "but it is committed"
                    )
        self.failed_keys.add(key)

    def _nothing_deleted_under_newer(self, who: str, key: str) -> None:
        """I11: nothing is deleted from a run while LATEST is a newer version's."""
        if self.newer_seq is not None:
            self.fail(f"I11: {who} deleted {key} from a run a newer version wrote")

    def restored_past_newer(self, res: RestoreResult, who: str) -> NoReturn:
        """I11: a restore that returned anything while LATEST is a newer version's went
        past it (to an older step)."""
        self.fail(
            f"I11: {who} returned step {res.step} ({res.commit_id}) past a LATEST a newer "
            f"version wrote (seq {self.newer_seq})"
        )

    def ack_floor(self) -> int:
        """The newest LATEST seq at which an acknowledged save became current."""
        return max((self.records[c].current_seq for c in self.acked), default=0)

    # -- restores --

    def check_restore(
        self, res: RestoreResult, floor: int, started: float, who: str, *, damage: bool = False
    ) -> None:
        """I8: a restore yields exactly the bytes of one committed checkpoint, the newest
        one (at least as new as every acknowledged save) unless it reports a fallback."""
        state = self.records.get(res.commit_id)
        if state is None:
            self.fail(f"I8: {who} restored {res.commit_id}, which was never committed")
        expected = self.sim.profile.content(res.metadata.get("sim", "?"))
        got = {
            p.relative_to(res.path).as_posix(): p.read_bytes()
            for p in sorted(res.path.rglob("*"))
            if p.is_file()
        }
        if got != expected:
            self.fail(
                f"I8: {who} restored step {res.step} with bytes that are not its checkpoint's"
            )
        slow = self.sim.elapsed() - started > (
            self.latest.settings.gc_grace_s if self.latest else 0
        )
        damaged = [s for s in res.skipped if not s.dropped]
        if damaged and not damage:
            self.fail(f"I8: {who}'s restore skipped {damaged} with no damage injected")
        if len(damaged) < len(res.skipped):
            # Collected under the restore: only after the grace period, and then the
            # restore read LATEST again (so what it restored is not older than an ack).
            if not slow and not damage:
                self.fail(f"I7/I8: {who}'s checkpoint was collected under a fast restore")
            self.sim.result.counters["slow_reader_rereads"] += 1
        if not damaged and not res.from_commit_records and state.current_seq < floor:
            self.fail(
                f"I3/I8: {who} restored step {res.step} (current at seq {state.current_seq}), "
                f"older than an acknowledged save (current at seq {floor})"
            )
        self.sim.result.counters["restores_verified"] += 1
