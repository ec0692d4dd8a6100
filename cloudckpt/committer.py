"""Reading and writing LATEST: claims, fenced commits, and same-epoch edits (docs/design.md §5, §6).

Every write of LATEST is conditional: create-only for a new run, compare-and-swap from a
known version otherwise. When a conditional write is refused or its answer is lost, the
writer re-reads LATEST and decides:

- its own ``commit_id`` is there: the write landed (an SDK retry can turn our own success
  into a 412), so the commit succeeded;
- a higher epoch (or another writer id) is there: a newer writer claimed the run: fenced;
- otherwise the same writer's run was edited (a pin, GC): re-apply on the new LATEST.

After an unknown outcome, nothing the attempt uploaded is deleted (docs/design.md §6.7).

How old an attempt is, is judged on the STORE's clock, never the host's (docs/design.md §6.8,
§8): GC dates an attempt by its objects' ``last_modified`` and its own ``store.now()``, and a
host's ``time.monotonic()`` stops while the VM is suspended or hibernated. Before every
compare-and-swap the commit reads the store's clock, after the LATEST it is based on was
read or written, and refuses (``StaleAttemptError``) once the attempt is older than
``max_attempt_age``. GC writes LATEST (``protocol.sweep``) before it deletes an orphan and
judged that orphan older than grace at a store time before that write; so a commit based on
a LATEST from before the sweep fails its compare-and-swap, and one based on a later LATEST
reads a clock past GC's and refuses, however long the host slept in between.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import random
import time
from collections.abc import Callable, Iterable

from cloudckpt import attempt_layout, canonical, protocol
from cloudckpt.errors import (
    CommitConflictError,
    CommitStateUnknownError,
    ConfigurationError,
    FencedError,
    NeedsRepairError,
    NotARunError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PreconditionFailedError,
    ResumedChunksTooOldError,
    StaleAttemptError,
    StoreConflictError,
    StoreError,
    TransientStoreError,
)
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.protocol import CheckpointRecord, CorruptRecordError, Latest, Settings
from cloudckpt.retry import call_with_retries
from cloudckpt.stores import CREATE, PutMode, Store, Update
from cloudckpt.stores.base import INTERNAL_PREFIX

log = logging.getLogger("cloudckpt.commit")

MAX_CAS_ATTEMPTS = 20


def max_attempt_age(grace_s: float, clock_resolution: float) -> float:
    """The oldest (in store seconds) an attempt may be when its commit is written: the
    GC grace period less a margin of 10 % (at most 10 minutes), and never less than two
    steps of the store's clock (the attempt's birth and the current time are each read
    truncated to that step, so an age can read up to two steps short)."""
    return grace_s - min(600.0, max(0.1 * grace_s, 2.0 * clock_resolution))


def check_grace(grace_s: float, store: Store) -> None:
    """Raises ConfigurationError if no attempt could be committed under a GC grace of
    ``grace_s`` on ``store`` (its clock counts in steps too coarse for so short a grace):
    checked when a manager is built with ``gc_grace`` and at each attempt's start (a
    grace read from LATEST)."""
    if max_attempt_age(grace_s, store.clock_resolution) <= 0:
        raise ConfigurationError(
            f"gc_grace={grace_s:g}s is too short for {store.url}, whose clock counts "
            f"whole {store.clock_resolution:g} s steps: no save could be committed safely",
            hint="Use a gc_grace of at least a minute (the default is 2 hours)",
        )


@dataclasses.dataclass(frozen=True)
class AttemptAge:
    """When an attempt was born on the store's clock (read before its first object was
    written, so never later than the time GC dates it by) and the age past which it may
    not be committed.

    ``resumed``: the oldest birth, on the store's clock, of the unreferenced attempts
    (interrupted saves of the same step) whose chunks this attempt names instead of
    uploading them again (``chunks.interrupted_chunks``). GC dates such an attempt as it
    dates this one, so the same bound keeps the commit from naming a chunk GC may own
    (docs/design.md §11, "Resuming an interrupted save")."""

    born: dt.datetime
    max_age_s: float
    resumed: dt.datetime | None = None

    def resuming(self, born: dt.datetime | None) -> AttemptAge:
        """This age, also bounded by an interrupted attempt born at ``born`` (None: no
        chunks of one are named)."""
        if born is None:
            return self
        oldest = born if self.resumed is None else min(self.resumed, born)
        return dataclasses.replace(self, resumed=oldest)

    def dated(self, times: Iterable[dt.datetime | None]) -> AttemptAge:
        """This age with its birth moved back to the oldest of ``times`` (the
        ``last_modified`` of the attempt's own objects, listed: how GC dates the attempt)
        where one is earlier: a store clock that stepped back between the birth read and a
        write dates that object earlier than the birth, and GC by it."""
        oldest = min((t for t in times if t is not None), default=None)
        if oldest is None or oldest >= self.born:
            return self
        return dataclasses.replace(self, born=oldest)

    def check(self, store: Store, step: int) -> dt.datetime:
        """Read the store's clock; raise if the attempt, or an interrupted attempt whose
        chunks it names, is too old. Returns the store's time read (the commit's
        ``committed_at``).

        Raises: StaleAttemptError (this attempt); ResumedChunksTooOldError (an interrupted
        one: the save can be retried without its chunks); StoreError if the clock cannot
        be read (after retries).
        """
        now = call_with_retries(store.now, what="read the store's clock")
        age = (now - self.born).total_seconds()
        if age > self.max_age_s:
            raise StaleAttemptError(
                f"the save of step {step} began {age:.0f} s ago on the store's clock, more "
                f"than the {self.max_age_s:.0f} s the run's GC grace period allows (the host "
                "may have been suspended, or the upload was slow); it was not committed, "
                "since garbage collection may already own its files"
            )
        if self.resumed is not None:
            resumed = (now - self.resumed).total_seconds()
            if resumed > self.max_age_s:
                raise ResumedChunksTooOldError(
                    f"the save of step {step} names chunks of an interrupted attempt that "
                    f"began {resumed:.0f} s ago on the store's clock, more than the "
                    f"{self.max_age_s:.0f} s the run's GC grace period allows; it was not "
                    "committed, since garbage collection may already own those chunks"
                )
        return now


_SETTING_FIELDS = frozenset(f.name for f in dataclasses.fields(Settings))


@dataclasses.dataclass(frozen=True)
class VersionedLatest:
    """A parsed LATEST with the store version of the bytes it came from."""

    latest: Latest
    version: str


def read_latest(store: Store) -> VersionedLatest | None:
    """The current LATEST, or None if the run has none.

    Raises:
        CorruptRecordError: LATEST exists but does not parse or verify.
        StoreError: the store failed (transient errors are retried first).
    """
    try:
        data, info = call_with_retries(lambda: store.get(protocol.LATEST_KEY), what="read LATEST")
    except ObjectNotFoundError:
        return None
    return VersionedLatest(protocol.parse_latest(data), info.version)


def run_has_data(store: Store) -> bool:
    """Whether anything (checkpoint attempts or commit records) exists under the run."""
    for prefix in (attempt_layout.CKPT_PREFIX, protocol.COMMITS_PREFIX):
        for _ in store.list(prefix):
            return True
    return False


#: Where cloudckpt writes under a run, besides LATEST (``.cloudckpt/``: a store's scratch).
_OWN_PREFIXES = (attempt_layout.CKPT_PREFIX, protocol.COMMITS_PREFIX, INTERNAL_PREFIX)


def refuse_foreign_data(store: Store) -> None:
    """Before a new run is started at ``store``: refuse a location that holds objects
    cloudckpt did not write (a user's checkpoint, another tool's files, other runs under
    a parent prefix), so that a new run never mixes with them.

    Raises:
        NotARunError: such an object exists (the message names one).
        StoreError: the listing failed.
    """
    for obj in store.list(""):
        if obj.key != protocol.LATEST_KEY and not obj.key.startswith(_OWN_PREFIXES):
            raise NotARunError(
                f"{store.url} is not empty and is not a cloudckpt run: it holds "
                f"{obj.key!r} (and no LATEST)"
            )


def write_commit_record(store: Store, body: bytes, seq: int) -> None:
    """Create ``commits/<seq>.json`` (best effort: LATEST is already durable)."""
    key = protocol.commit_record_key(seq)
    try:
        call_with_retries(lambda: store.put(key, body, mode=CREATE), what="write commit record")
    except PreconditionFailedError:
        pass  # an SDK retry of our own write, or a record we wrote before a crash
    except StoreError as exc:
        log.warning("could not write the commit record %s (%s); LATEST is committed", key, exc)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Committer:
    """One writer's view of LATEST: claims the run, then commits with fencing.

    Not thread-safe: the manager calls it from one thread.
    """

    def __init__(
        self,
        store: Store,
        writer_id: str,
        settings: Settings,
        *,
        inherit: Iterable[str] = (),
        clock: Callable[[], dt.datetime] = _utcnow,
    ) -> None:
        """``settings`` are written into LATEST by the claim and every commit, except the
        fields named in ``inherit``, which keep the run's current values."""
        self.store = store
        self.writer_id = writer_id
        self.settings = settings
        self._inherit = frozenset(inherit)
        self._clock = clock
        self._mine: VersionedLatest | None = None  # what this writer last wrote

    @property
    def epoch(self) -> int | None:
        return self._mine.latest.writer.epoch if self._mine else None

    def update_settings(self, **changes: object) -> None:
        """Commit with these settings from now on (also when the run is claimed later: the
        fields changed here are no longer inherited from the run).

        Raises: ConfigurationError (an invalid combination; nothing changes).
        """
        self.settings = dataclasses.replace(self.settings, **changes)  # type: ignore[arg-type]
        self._inherit = self._inherit - set(changes)

    @property
    def latest(self) -> Latest | None:
        return self._mine.latest if self._mine else None

    def _reread(self) -> VersionedLatest:
        try:
            current = read_latest(self.store)
        except CorruptRecordError as exc:
            raise NeedsRepairError(f"LATEST of {self.store.url} became unreadable: {exc}") from None
        except StoreError as exc:
            raise CommitStateUnknownError(
                f"cannot read LATEST of {self.store.url} to learn the commit's outcome ({exc})"
            ) from None
        if current is None:
            raise NeedsRepairError(f"LATEST of {self.store.url} disappeared while writing")
        return current

    def _write(self, new: Latest, mode: PutMode) -> VersionedLatest:
        body = new.to_bytes()
        failpoint("commit.before_cas")
        info = self.store.put(protocol.LATEST_KEY, body, mode=mode)
        failpoint("commit.after_cas")
        written = VersionedLatest(new, info.version)
        write_commit_record(self.store, body, new.seq)
        failpoint("commit.after_record")
        return written

    # -- claim --------------------------------------------------------------------------

    def claim(self) -> Latest:
        """Take over the run: bump the epoch (fencing older writers) or start a new run.

        Raises:
            NeedsRepairError: LATEST is missing or corrupt but checkpoints exist.
            NotARunError: no LATEST, and the location holds data cloudckpt did not write.
            CommitConflictError: the claim kept losing races.
            StoreError: the store failed.
        """
        last_error: Exception | None = None
        for attempt in range(MAX_CAS_ATTEMPTS):
            try:
                current = read_latest(self.store)
            except CorruptRecordError as exc:
                raise NeedsRepairError(f"LATEST of {self.store.url} is unreadable: {exc}") from None
            now = self._clock()
            mode: PutMode
            if current is None:
                if run_has_data(self.store):
                    if self._reread_quietly() is not None:
                        continue  # a racing writer created the run after our read
                    raise NeedsRepairError(f"{self.store.url} holds checkpoints but no LATEST")
                refuse_foreign_data(self.store)
                writer = protocol.Writer(1, self.writer_id, canonical.iso(now))
                new, mode = protocol.initial(writer, self.settings, now), CREATE
            else:
                if self._inherit:
                    mine = {f: getattr(self.settings, f) for f in _SETTING_FIELDS - self._inherit}
                    self.settings = dataclasses.replace(current.latest.settings, **mine)
                new = protocol.claim(current.latest, self.writer_id, self.settings, now)
                mode = Update(current.version)
            try:
                self._mine = self._write(new, mode)
                log.info("claimed %s as epoch %d", self.store.url, new.writer.epoch)
                return new
            except (
                PreconditionFailedError,
                StoreConflictError,
                OutcomeUnknownError,
                TransientStoreError,
            ) as exc:
                last_error = exc
                seen = self._reread_quietly()
                if seen and seen.latest.writer.id == self.writer_id:
                    self._mine = seen  # our claim landed; the answer was lost
                    return seen.latest
                # Back off: a store that answers 503 needs a moment, racing claimers too.
                time.sleep(min(0.05 * 2**attempt, 2.0) * (0.5 + random.random()))
        if isinstance(last_error, (TransientStoreError, OutcomeUnknownError)):
            raise last_error
        raise CommitConflictError(f"could not claim {self.store.url}: LATEST kept changing")

    def _reread_quietly(self) -> VersionedLatest | None:
        try:
            return read_latest(self.store)
        except (CorruptRecordError, StoreError):
            return None

    # -- commit -------------------------------------------------------------------------

    # Long by its docstring (the protocol's commit, every error it raises); the code is
    # ~40 lines, the age check and the landed-after-all case in helpers.
    def commit(
        self,
        record: CheckpointRecord,
        *,
        age: AttemptAge | None = None,
        requires: Callable[[Latest], None] | None = None,
    ) -> Latest:
        """Make ``record`` current with a compare-and-swap from this writer's last version.

        ``age``: checked on the store's clock before every compare-and-swap (see the module
        docstring): an attempt old enough for GC to own its files is refused. The store's
        time read for it becomes the record's ``committed_at``, which time-based retention
        buckets by (``cloudckpt.retention``): the host's clock is never trusted with that.
        ``requires(base)``: called with every LATEST the commit would replace; raising
        refuses the commit.

        Raises:
            FencedError: a newer writer claimed the run.
            CommitConflictError: same-epoch edits kept winning the race.
            CommitStateUnknownError: the store stopped answering; the outcome is unknown.
            StaleAttemptError: the attempt grew too old before the commit could be written.
            NeedsRepairError: LATEST vanished or became corrupt.
            StoreError: the store's clock could not be read before any write was sent.
        """
        if self._mine is None:
            raise RuntimeError("claim() the run before committing")
        base = self._mine
        unknown_rounds = 0
        for _ in range(MAX_CAS_ATTEMPTS):
            self._check_fence(base.latest)
            if age is not None:
                # After ``base`` was read or written, before the write that replaces it.
                store_now = self._check_age(age, record.step, unknown_rounds)
                record = dataclasses.replace(record, committed_at=canonical.iso(store_now))
            if requires is not None:
                # E.g. the checkpoints whose chunks this save reuses must still be retained
                # in the very LATEST the compare-and-swap replaces (cloudckpt.chunks).
                requires(base.latest)
            new = protocol.commit(base.latest, record, self.settings, self._clock())
            try:
                self._mine = self._write(new, Update(base.version))
                return new
            except (PreconditionFailedError, StoreConflictError):
                pass
            except (OutcomeUnknownError, TransientStoreError):
                unknown_rounds += 1
                if unknown_rounds > 5:
                    raise CommitStateUnknownError(
                        f"the commit of step {record.step} to {self.store.url} got no answer "
                        "after several tries"
                    ) from None
                time.sleep(min(0.2 * 2**unknown_rounds, 5.0))
            seen = self._reread()
            if seen.latest.find(record.commit_id):
                # Our write landed; its answer was lost, or an SDK retry met our own write.
                return self._landed(seen, new, base)
            if seen.version == base.version:
                continue  # nothing changed: the write did not land; send it again
            base = seen  # a same-epoch edit (pin, GC) or a newer writer: loop re-checks
        raise CommitConflictError(
            f"the commit of step {record.step} to {self.store.url} lost "
            f"{MAX_CAS_ATTEMPTS} compare-and-swap races in a row"
        )

    def _check_age(self, age: AttemptAge, step: int, unknown_rounds: int) -> dt.datetime:
        """``age.check`` before a compare-and-swap; returns the store's time it read.
        Raises StaleAttemptError, or StoreError when the clock cannot be read:
        CommitStateUnknownError if an earlier write of this commit got no answer (its fate
        is unknown)."""
        try:
            return age.check(self.store, step)
        except StaleAttemptError:
            raise
        except StoreError as exc:
            if unknown_rounds:  # an earlier write's fate is unknown: say so
                raise CommitStateUnknownError(
                    f"the commit of step {step} to {self.store.url} got no "
                    f"answer, and the store's clock cannot be read ({exc})"
                ) from None
            raise

    def _landed(self, seen: VersionedLatest, new: Latest, base: VersionedLatest) -> Latest:
        """Our commit ``new`` (written over ``base``) is in ``seen``, the LATEST read back:
        record it, and keep the right fencing reference. Returns ``seen``'s LATEST."""
        write_commit_record(self.store, new.to_bytes(), new.seq)
        if self._mine is not None and seen.latest.writer == self._mine.latest.writer:
            self._mine = seen
        else:
            # A newer writer claimed after our commit landed. Keep our own writer
            # (not theirs) as the fencing reference: the next commit must fail.
            self._mine = VersionedLatest(new, base.version)
        return seen.latest

    def _check_fence(self, latest: Latest) -> None:
        mine = self._mine.latest.writer if self._mine else None
        w = latest.writer
        if mine is not None and (w.epoch != mine.epoch or w.id != mine.id):
            raise FencedError(
                f"{self.store.url} was claimed by writer {w.id} (epoch {w.epoch}) after this "
                f"writer (epoch {mine.epoch}); this writer may no longer commit"
            )


def edit_latest(
    store: Store,
    change: Callable[[Latest, dt.datetime], Latest | None],
    *,
    clock: Callable[[], dt.datetime] = _utcnow,
) -> Latest | None:
    """Apply a same-epoch edit (pin, unpin, GC bookkeeping) with compare-and-swap.

    ``change(latest, now)`` returns the next LATEST, or None when nothing needs writing.
    It must be idempotent: after a lost answer it is re-applied to whatever LATEST holds.
    The writer's epoch is preserved, so editing never fences the training process.

    Raises:
        CheckpointNotFoundError-like errors from ``change``; NeedsRepairError (no or
        corrupt LATEST); CommitConflictError; CommitStateUnknownError.
    """
    for _ in range(MAX_CAS_ATTEMPTS):
        try:
            current = read_latest(store)
        except CorruptRecordError as exc:
            raise NeedsRepairError(f"LATEST of {store.url} is unreadable: {exc}") from None
        if current is None:
            raise NeedsRepairError(f"{store.url} has no LATEST to edit")
        new = change(current.latest, clock())
        if new is None:
            return current.latest
        body = new.to_bytes()
        try:
            store.put(protocol.LATEST_KEY, body, mode=Update(current.version))
        except (
            PreconditionFailedError,
            StoreConflictError,
            OutcomeUnknownError,
            TransientStoreError,
        ):
            time.sleep(0.05)
            continue  # re-read and re-apply (change is idempotent)
        write_commit_record(store, body, new.seq)
        return new
    raise CommitConflictError(f"could not edit LATEST of {store.url}: it kept changing")
