"""Seeded deterministic simulation of cloudckpt's commit protocol (DESIGN §9).

One seed builds one small world and runs it for a number of scheduler ticks:

- a memory store (the exact-semantics oracle) on a virtual clock;
- two writers, each a real ``CheckpointManager`` that claims the run with ``resume()`` and
  saves a stream of checkpoints. When the other writer claims, the first becomes a zombie:
  it keeps calling ``save()`` until it is fenced, and later restarts as a new process
  (fresh manager, same or fresh staging directory) and claims the run back;
- a garbage collector (``gc.collect_garbage``), a restorer (``restore.restore``) and a
  pinner (``admin.pin`` / ``admin.unpin``);
- faults drawn from the seed: every actor talks to the store through a
  ``FaultInjectingStore`` whose rules (fail before, lose the answer, deliver twice, 409,
  lying 412, latency, truncation) and probabilities come from the seed's RNG; and crashes:
  at any store call (before it, or after it was applied) and at every failpoint of
  ``cloudckpt.failpoints``, an actor may die (``SimulatedCrash``); a dead process makes no
  further call, and the actor restarts from scratch like a new process.

After EVERY tick the world is checked against the invariants of DESIGN §9 (see
``Checker``); every write of LATEST is checked as a transition from the one before it.
A final phase removes the faults, restarts a writer (exercising crash recovery and the
staging journal), runs GC until it converges, restores every retained checkpoint, and then
damages the store on purpose (a bit flip in LATEST, a commit record, a manifest, a data
file; LATEST deleted) and checks that every damage is detected.

Determinism. Actors are threads, but never concurrent: a baton passes between the
scheduler and exactly one actor, and an actor hands it back at every store call (and at
every sleep). The scheduler picks the next actor with the seed's RNG. Saves run in the
actor's own thread (the manager's synchronous test mode) and transfers run inline, so no
other thread touches the store. While a simulation runs, ``time.sleep`` and
``time.monotonic`` are virtual (they advance and read the store's ``ManualClock``), the
``random`` module is seeded, and attempt and writer ids come from the seed. So a seed
replays exactly (``SimResult.trace_digest`` proves it); a failure prints the seed and the
one command that replays it::

    python -m cloudckpt.testing.simulation --seed 1234
    python -m cloudckpt.testing.simulation --seeds 0:10000 --jobs 2     # the soak

Do not run a simulation in a process that does other work at the same time: the virtual
clock and the seeded ``random`` module are process-wide while it runs.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from cloudckpt import admin, digest, failpoints, protocol
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    CommitStateUnknownError,
    ConfigurationError,
    CorruptionError,
    FencedError,
    NeedsRepairError,
    OutcomeUnknownError,
    PreconditionFailedError,
    StoreError,
)
from cloudckpt.failpoints import SimulatedCrash
from cloudckpt.gc import collect_garbage
from cloudckpt.protocol import CheckpointRecord, Latest
from cloudckpt.restore import RestoreResult, fetch_manifest, restore
from cloudckpt.stores.base import MultipartUpload, PutMode, Store
from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket
from cloudckpt.testing.faults import (
    Conflict,
    DeliverTwice,
    FailBefore,
    FaultInjectingStore,
    Latency,
    LoseResponse,
    Rule,
    Truncate,
    flip_bit,
)
from cloudckpt.testing.wrappers import ForwardingStore
from cloudckpt.transfer import TransferConfig, TransferEngine

__all__ = ["SimResult", "Simulation", "replay_command", "run_seed", "run_seeds"]

DEFAULT_STEPS = 250
_T0 = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
_HANG_SECONDS = 120.0  # real seconds an actor may hold the baton before we call it a hang


def replay_command(seed: int, steps: int = DEFAULT_STEPS) -> str:
    """The one command that replays ``seed``."""
    extra = "" if steps == DEFAULT_STEPS else f" --steps {steps}"
    return f"python -m cloudckpt.testing.simulation --seed {seed}{extra}"


class InvariantViolation(AssertionError):
    """The simulated world broke an invariant of DESIGN §9."""


# --------------------------------------------------------------------------- profile


@dataclasses.dataclass(frozen=True)
class Profile:
    """Everything a seed decides up front: settings, fault rates, scheduling weights."""

    keep_last: int | None
    keep_every: int | None
    grace: int
    p_fail_before: float
    p_unknown_before: float
    p_lose_write: float
    p_lose_read: float
    p_twice: float
    p_conflict: float
    p_lie_412: float
    p_latency: float
    p_truncate: float
    p_crash_call: float
    p_crash_failpoint: float
    p_clock_jump: float
    big_files: bool
    weights: dict[str, float]
    # A host suspended (VM hibernated or paused): the store's clock jumps, the host's
    # monotonic clock does not, and the host makes no call while it sleeps.
    p_suspend: float = 0.0

    @classmethod
    def draw(cls, rng: random.Random) -> Profile:
        def rate(*choices: float) -> float:
            return rng.choice(choices)

        return cls(
            keep_last=rng.choice([1, 2, 3, None]),
            keep_every=rng.choice([None, None, 2, 3]),
            grace=rng.choice([60, 600, 7200]),
            p_fail_before=rate(0, 0.01, 0.05),
            p_unknown_before=rate(0, 0.01, 0.04),
            p_lose_write=rate(0, 0.02, 0.08),
            p_lose_read=rate(0, 0.01, 0.04),
            p_twice=rate(0, 0.02, 0.08),
            p_conflict=rate(0, 0.05, 0.2),
            p_lie_412=rate(0, 0, 0.05),
            p_latency=rate(0, 0.02, 0.05),
            p_truncate=rate(0, 0, 0.01, 0.03),
            p_crash_call=rate(0, 0.002, 0.005),
            p_crash_failpoint=rate(0, 0.01, 0.03, 0.08),
            p_clock_jump=rate(0.005, 0.02, 0.05),
            big_files=rng.random() < 0.03,
            weights={n: rng.uniform(0.2, 1.0) for n in ("A", "B", "gc", "restorer", "pinner")},
            p_suspend=rate(0, 0.002, 0.005, 0.01),
        )

    def rules(self, rng: random.Random) -> list[Rule]:
        """Fault rules for one actor's store (probabilities from the seed)."""
        writes = {"put", "delete", "upload_part", "complete_multipart", "create_multipart"}
        reads = {"get", "get_range", "head", "list", "list_multipart"}
        rules = [
            Rule(FailBefore(), ops=writes | reads, times=None, probability=self.p_fail_before),
            Rule(
                FailBefore(OutcomeUnknownError),
                ops=writes,
                times=None,
                probability=self.p_unknown_before,
            ),
            Rule(LoseResponse(), ops=writes, times=None, probability=self.p_lose_write),
            Rule(LoseResponse(), ops=reads, times=None, probability=self.p_lose_read),
            Rule(DeliverTwice(), ops=writes, times=None, probability=self.p_twice),
            Rule(Conflict(), ops={"put"}, key="LATEST", times=None, probability=self.p_conflict),
            Rule(
                FailBefore(PreconditionFailedError),
                ops={"put"},
                key="LATEST",
                modes={"update"},
                times=None,
                probability=self.p_lie_412,
            ),
            Rule(
                Latency(rng.uniform(1, self.grace * 0.7)),
                ops=writes | reads,
                times=None,
                probability=self.p_latency,
            ),
            Rule(
                Truncate(rng.randrange(0, 64)),
                ops={"put", "upload_part"},
                key=lambda k: "/files/" in k or "/chunks/" in k,
                times=None,
                probability=self.p_truncate,
            ),
        ]
        return [r for r in rules if r.probability > 0]


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class SimResult:
    """What one seed did. ``violations`` is empty when every invariant held."""

    seed: int
    steps: int
    ticks: int = 0
    counters: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    violations: list[str] = dataclasses.field(default_factory=list)
    trace_digest: str = ""
    trace_tail: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self) -> str:
        """A human-readable failure report with the replay command."""
        lines = [
            f"simulation seed {self.seed} ({self.ticks} ticks): "
            + ("OK" if self.ok else f"{len(self.violations)} invariant violation(s)"),
            *(f"  - {v}" for v in self.violations[:10]),
        ]
        if not self.ok:
            lines += ["  last store calls:", *(f"    {t}" for t in self.trace_tail[-40:])]
            lines.append(f"  replay: {replay_command(self.seed, self.steps)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- plumbing


class InlineExecutor(cf.Executor):
    """Runs every submitted call at once in the caller's thread (deterministic transfers).
    A ``SimulatedCrash`` propagates at once: the process is gone."""

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> cf.Future:
        future: cf.Future = cf.Future()
        try:
            result = fn(*args, **kwargs)
        except SimulatedCrash:
            raise
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


def inline_engine(config: TransferConfig) -> TransferEngine:
    engine = TransferEngine(config)
    engine._pool.shutdown()
    engine._pool = InlineExecutor()
    return engine


def _baton() -> threading.Lock:
    """A binary semaphore that starts taken: the fastest hand-off CPython threads have."""
    lock = threading.Lock()
    lock.acquire()
    return lock


class _Actor:
    """One simulated process (restarted in place after a crash)."""

    def __init__(self, sim: Simulation, name: str, program: Callable[[_Actor], None]) -> None:
        self.sim = sim
        self.name = name
        self.program = program
        self.rng = random.Random(f"{sim.seed}/{name}")
        self.go = _baton()
        self.thread = threading.Thread(target=self._main, name=f"sim-{name}", daemon=True)
        self.finished = False
        self.killed = False  # the scheduler killed the current incarnation
        self.dead = False  # the current incarnation has crashed
        self.incarnation = 0
        self.op = 0  # the operation this actor is in (attributes LATEST writes)
        self.writer_id: str | None = None
        self.wake_at = 0  # the tick before which the scheduler leaves this actor idle
        self.asleep_s = 0.0  # store seconds this actor's host spent suspended
        self.sleep_rate = 0.0  # while suspended: store seconds that pass per tick
        self.next_call = ""  # the store call this actor is about to make
        self.port: Store | None = None
        self.faults: FaultInjectingStore | None = None
        sim.actors.append(self)

    def _main(self) -> None:
        self.go.acquire()
        try:
            self.program(self)
        except (SimulatedCrash, InvariantViolation):
            pass  # a violation was recorded where it was detected
        except BaseException as exc:  # an error the actor did not expect: report it
            self.sim.violation(
                f"{self.name} raised {type(exc).__name__}: {exc}\n"
                + "".join(traceback.format_exception(exc)[-6:])
            )
        finally:
            self.finished = True
            self.sim._back.release()

    # -- called from the actor's own thread --

    def new_incarnation(self) -> Store:
        """A new process: fresh store clients (fault rules from the seed)."""
        self.incarnation += 1
        self.dead = self.killed = False
        if self.faults is not None:
            self.sim.result.faults.update(self.faults.injected)
        port = _Port(self.sim, self, self.sim.recorder)
        self.faults = FaultInjectingStore(
            port,
            self.sim.profile.rules(self.rng) if self.sim.faults_on else [],
            seed=self.rng.getrandbits(32),
        )
        self.port = self.faults
        return self.faults

    def die(self, where: str) -> SimulatedCrash:
        self.dead = True
        self.sim.result.counters["crashes"] += 1
        self.sim.result.counters[f"crash@{where}"] += 1
        return SimulatedCrash(where)

    def check_alive(self) -> None:
        if self.dead:
            raise SimulatedCrash("dead")
        if self.killed:
            raise self.die("killed")


class _Port(ForwardingStore):
    """An actor's connection to the store: every call is a scheduling point, and may crash
    the actor before it is sent or after it was applied."""

    def __init__(self, sim: Simulation, actor: _Actor, inner: Store) -> None:
        super().__init__(inner)
        self.sim, self.actor = sim, actor

    def _do(self, op: str, key: str, call: Callable[[], Any]) -> Any:
        actor, sim = self.actor, self.sim
        actor.check_alive()
        sim.yield_(actor, f"{op} {key}")
        actor.check_alive()
        crash = sim.crash_rng.random() < sim.crash_rate(actor)
        after = crash and sim.crash_rng.random() < 0.5
        if crash and not after:
            raise actor.die(f"before-{op}")
        result = call()
        if crash:
            raise actor.die(f"after-{op}")
        return result

    def head(self, key):
        return self._do("head", key, lambda: self.inner.head(key))

    def now(self):
        # A scheduling point too: a host may sleep between reading the clock and writing.
        return self._do("now", "", lambda: self.inner.now())

    def get(self, key):
        return self._do("get", key, lambda: self.inner.get(key))

    def get_range(self, key, start, length):
        return self._do("get_range", key, lambda: self.inner.get_range(key, start, length))

    def put(self, key, data, *, mode=None):
        kw = {} if mode is None else {"mode": mode}
        return self._do("put", key, lambda: self.inner.put(key, data, **kw))

    def delete(self, key):
        return self._do("delete", key, lambda: self.inner.delete(key))

    def list(self, prefix=""):
        return iter(self._do("list", prefix, lambda: list(self.inner.list(prefix))))

    def create_multipart(self, key):
        return self._do("create_multipart", key, lambda: self.inner.create_multipart(key))

    def upload_part(self, upload, part_number, data, *, crc32c=None):
        return self._do(
            "upload_part",
            upload.key,
            lambda: self.inner.upload_part(upload, part_number, data, crc32c=crc32c),
        )

    def complete_multipart(self, upload, parts, *, mode=None):
        kw = {} if mode is None else {"mode": mode}
        return self._do(
            "complete_multipart",
            upload.key,
            lambda: self.inner.complete_multipart(upload, parts, **kw),
        )

    def abort_multipart(self, upload):
        return self._do("abort_multipart", upload.key, lambda: self.inner.abort_multipart(upload))

    def list_multipart(self, prefix=""):
        return self._do("list_multipart", prefix, lambda: self.inner.list_multipart(prefix))


def _prefix_of(key: str) -> str | None:
    parts = key.split("/", 2)
    if len(parts) >= 2 and parts[0] == "ckpt":
        prefix = f"ckpt/{parts[1]}/"
        return prefix if protocol.parse_ckpt_prefix(prefix) else None
    return None


class _Recorder(ForwardingStore):
    """Sits right above the memory store: sees every write as it is applied, in order, and
    checks each one (LATEST transitions, GC deletions) against the invariants."""

    def __init__(self, sim: Simulation, memory: MemoryStore, inner: Store | None) -> None:
        super().__init__(inner or memory)
        self.sim = sim
        self.memory = memory

    def _touch(self, key: str) -> None:
        prefix = _prefix_of(key)
        if prefix is not None:
            self.sim.checker.touched(prefix, self.memory.now())

    def put(self, key: str, data, *, mode: PutMode | None = None) -> Any:
        kw = {} if mode is None else {"mode": mode}
        info = self.inner.put(key, data, **kw)
        self._touch(key)
        if key == protocol.LATEST_KEY:
            self.sim.checker.latest_written(bytes(data), mode, self.sim.current)
        return info

    def delete(self, key: str) -> None:
        self.sim.checker.before_delete(key, self.sim.current)
        self.inner.delete(key)
        self._touch(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.delete(key)

    def create_multipart(self, key: str) -> MultipartUpload:
        upload = self.inner.create_multipart(key)
        self._touch(key)
        return upload

    def complete_multipart(self, upload, parts, *, mode=None):
        kw = {} if mode is None else {"mode": mode}
        info = self.inner.complete_multipart(upload, parts, **kw)
        self._touch(upload.key)
        return info

    def abort_multipart(self, upload: MultipartUpload) -> None:
        self.sim.checker.before_abort(upload, self.sim.current)
        self.inner.abort_multipart(upload)


# --------------------------------------------------------------------------- checker


@dataclasses.dataclass
class _RecordState:
    record: CheckpointRecord
    current_seq: int  # the LATEST seq at which it became current
    dropped_at: dt.datetime | None = None  # store time it became a tombstone
    gone: bool = False  # its tombstone was forgotten after GC deleted it


class Checker:
    """The invariants of DESIGN §9, checked on every LATEST write, every deletion, and
    after every scheduler tick. Raises ``InvariantViolation``."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.raw = sim.memory
        self.chain: list[Latest] = []  # every LATEST body ever applied, in order
        self.records: dict[str, _RecordState] = {}  # commit_id -> state
        self.acked: dict[str, str] = {}  # commit_id -> sim key of acknowledged saves
        self.failed_keys: set[str] = set()  # sim keys of saves that failed definitely
        self.first_write: dict[str, dt.datetime] = {}  # prefix -> store time
        self.gc_deleted: set[str] = set()  # prefixes GC deleted (some of)
        self.verified: set[str] = set()  # referenced prefixes verified complete
        self.chunk_users: dict[str, set[str]] = collections.defaultdict(set)  # owner -> ckpts
        self._manifests: dict[str, protocol.Manifest | None] = {}  # commit_id -> parsed
        self.op_writes: collections.Counter = collections.Counter()  # (actor, op) -> LATEST writes
        self._latest_version = ""

    def fail(self, message: str) -> None:
        """Record a violation (where it is detected, so no handler can hide it) and stop."""
        self.sim.violation(message)
        raise InvariantViolation(message)

    @property
    def latest(self) -> Latest | None:
        return self.chain[-1] if self.chain else None

    # -- hooks from the recorder --

    def touched(self, prefix: str, now: dt.datetime) -> None:
        self.first_write.setdefault(prefix, now)
        self.verified.discard(prefix)
        self.verified -= self.chunk_users.get(prefix, set())

    def manifest_of(self, rec: CheckpointRecord) -> protocol.Manifest | None:
        """The parsed manifest of a record (immutable, so cached), None if unreadable."""
        if rec.commit_id not in self._manifests:
            try:
                parsed = protocol.parse_manifest(self.raw.get(rec.manifest_key)[0], rec)
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

    def latest_written(self, body: bytes, mode: PutMode | None, actor: _Actor | None) -> None:
        """I1, I3, I4, I5: every applied LATEST is the next link of one chain, and a legal
        transition from the one before it."""
        who = actor.name if actor else "?"
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
        self.chain.append(new)
        now = self.raw.now()
        for rec in new.retained():
            if rec.commit_id not in self.records:
                self.records[rec.commit_id] = _RecordState(rec, new.seq)
        for t in new.tombstones:
            state = self.records.get(t.record.commit_id)
            if state is not None and state.dropped_at is None:
                state.dropped_at = now
        for rec in new.retained():
            self.records[rec.commit_id].dropped_at = None

    def _transition(self, prev: Latest, new: Latest, actor: _Actor | None) -> None:
        who = actor.name if actor else "?"
        op = new.op

        def ids(records):
            return {r.commit_id for r in records}

        prev_ret, new_ret = ids(prev.retained()), ids(new.retained())
        prev_tomb = {t.record.commit_id: t for t in prev.tombstones}
        new_tomb = {t.record.commit_id: t for t in new.tombstones}
        # I4: the writer changes only by a claim, which bumps the epoch by one; only the
        # writer that owns the epoch commits.
        if op == "claim":
            if new.writer.epoch != prev.writer.epoch + 1:
                self.fail(f"I4: claim by {who} went from epoch {prev.writer.epoch} to "
                          f"{new.writer.epoch}")  # fmt: skip
            if actor is None or new.writer.id != actor.writer_id:
                self.fail(f"I4: {who} wrote a claim for writer {new.writer.id}")
            if new_ret != prev_ret or set(new_tomb) != set(prev_tomb):
                self.fail(f"I3: the claim by {who} changed the retained checkpoints")
        elif new.writer != prev.writer:
            self.fail(f"I4: a {op} by {who} changed the writer from {prev.writer} to {new.writer}")
        if op == "commit":
            if actor is None or actor.writer_id != new.writer.id:
                self.fail(
                    f"I4: {who} (writer {actor.writer_id if actor else None}) committed "
                    f"{new.current.ckpt} on top of epoch {new.writer.epoch} owned by "
                    f"{new.writer.id}: a fenced writer's commit landed after a newer claim"
                )
            if new.current.epoch != new.writer.epoch:
                self.fail(
                    f"I4: commit of {new.current.ckpt} (epoch {new.current.epoch}) under "
                    f"writer epoch {new.writer.epoch}"
                )
            if new.current.commit_id in prev_ret or new.current.commit_id in prev_tomb:
                self.fail(f"I5: {new.current.commit_id} committed twice")
            if new.current.ckpt in self.gc_deleted:
                self.fail(f"I7: {new.current.ckpt} was committed after GC deleted some of it")
            key = new.current.metadata.get("sim")
            if key in self.failed_keys:
                self.fail(f"I6: save {key} was reported failed, yet it was committed by {who}")
        elif (new.current and new.current.commit_id) != (prev.current and prev.current.commit_id):
            self.fail(f"I3: a {op} by {who} changed the current checkpoint")
        # I3: nothing vanishes. Retained -> tombstone only by retention (commit, unpin);
        # tombstone -> retained only by a pin of a pending tombstone; pending -> deleting
        # only by GC; a tombstone leaves only after it was marked deleting.
        for cid in prev_ret - new_ret:
            if cid not in new_tomb or op not in ("commit", "unpin"):
                self.fail(f"I3: {cid} left the retained set by a {op} of {who}")
            if cid in {p.commit_id for p in new.pins}:
                self.fail(f"I3: pinned {cid} was dropped by retention")
            step = self.records[cid].record.step
            if new.settings.keep_every and step % new.settings.keep_every == 0:
                self.fail(f"I3: milestone step {step} dropped despite keep_every")
            if new.settings.keep_last is not None and len(new_ret) < new.settings.keep_last:
                self.fail(f"I3: {cid} dropped with only {len(new_ret)} retained")
        for cid, t in prev_tomb.items():
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
        pinned = {p.commit_id for p in new.pins}
        if not pinned <= new_ret:
            self.fail(f"I3: pins {sorted(pinned - new_ret)} are not retained")

    def before_delete(self, key: str, actor: _Actor | None) -> None:
        """I6, I7: GC deletes only unreferenced objects older than grace; manifest first."""
        who = actor.name if actor else "?"
        latest = self.latest
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
            if info and (now - info.last_modified).total_seconds() <= grace:
                self.fail(f"I7: {who} deleted {key} younger than grace")
            return
        prefix = _prefix_of(key)
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
            manifest = prefix + protocol.MANIFEST_NAME
            if key != manifest and self.raw.exists(manifest):
                self.fail(f"I7: {who} deleted {key} before the manifest of {prefix}")
        else:
            born = self.first_write.get(prefix)
            if born is not None and (now - born).total_seconds() <= grace:
                self.fail(f"I7: {who} deleted {key} of an attempt younger than grace")

    def before_abort(self, upload: MultipartUpload, actor: _Actor | None) -> None:
        if actor is None or actor.name not in ("gc", "final"):
            return  # a writer abandoning its own upload
        state = self.raw.bucket.uploads.get(upload.upload_id)
        if state is None:
            return
        # GC may abort an upload older than grace, or any upload of an attempt older
        # than grace (such an attempt can no longer commit: StaleAttemptError).
        prefix = _prefix_of(upload.key)
        grace = self.latest.settings.gc_grace_s if self.latest else 0
        now = self.raw.now()
        ages = [now - t for t in (state.initiated, self.first_write.get(prefix)) if t]
        if all(age.total_seconds() <= grace for age in ages):
            self.fail(f"I7: GC aborted the upload of {upload.key}, younger than grace")

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
            manifest = protocol.parse_manifest(data, rec)
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
                    if hashlib.sha256(parts[-1]).hexdigest() != chunk.sha256:
                        self.fail(f"{what}: chunk {chunk.key} does not match its name")
                body = b"".join(parts)
            else:
                key = rec.ckpt + protocol.FILES_DIR + entry.path
                try:
                    body, _ = self.raw.get(key)
                except StoreError:
                    self.fail(f"{what}: {entry.path} is missing")
            if len(body) != entry.size or digest.tree_digest(body) != entry.digest:
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

    def ack_floor(self) -> int:
        """The newest LATEST seq at which an acknowledged save became current."""
        return max((self.records[c].current_seq for c in self.acked), default=0)


# --------------------------------------------------------------------------- simulation


class Simulation:
    """One seed's world. ``run()`` returns a ``SimResult``; see the module docstring."""

    def __init__(
        self,
        seed: int,
        steps: int = DEFAULT_STEPS,
        *,
        workdir: str | None = None,
        mutate: Callable[[Store], Store] | None = None,
    ) -> None:
        """``mutate`` wraps the store below the checker (e.g. in ``DropPreconditions``),
        to show that the checker catches a broken store."""
        self.seed = seed
        self.steps = steps
        self.rng = random.Random(seed)
        self.profile = Profile.draw(self.rng)
        self.sched_rng = random.Random(f"{seed}/scheduler")
        self.crash_rng = random.Random(f"{seed}/crash")
        self.id_rng = random.Random(f"{seed}/ids")
        self.suspend_rng = random.Random(f"{seed}/suspend")
        self.chunking_rng = random.Random(f"{seed}/chunking")
        self.result = SimResult(seed, steps)
        self.bucket = f"sim-{seed}-{os.getpid()}-{id(self):x}"
        self.clock = ManualClock(_T0)
        self.memory = MemoryStore(self.bucket, "run", clock=self.clock)
        self.checker = Checker(self)
        self.recorder = _Recorder(self, self.memory, mutate(self.memory) if mutate else None)
        self._workdir_arg = workdir
        self.work: Path = Path(".")
        self.faults_on = True
        self.checks_on = True  # off while the final phase damages the store on purpose
        self.stopping = False
        self.current: _Actor | None = None
        self.actors: list[_Actor] = []
        self._back = _baton()
        self._trace = hashlib.sha256()
        self._tail: collections.deque[str] = collections.deque(maxlen=60)
        self._counter = 0
        self._store_call = False

    # -- scheduling --

    def yield_(self, actor: _Actor, what: str, *, store_call: bool = True) -> None:
        """Called by an actor: record what it is about to do and hand the baton back."""
        self._store_call = store_call
        actor.next_call = what
        line = f"{self.result.ticks} {actor.name}#{actor.incarnation} {what}"
        self._trace.update(line.encode() + b"\n")
        self._tail.append(line)
        self._back.release()
        actor.go.acquire()

    def pause(self, actor: _Actor, ticks: int) -> None:
        """Stay idle while ``ticks`` store calls of other actors happen (a process busy
        with something else). The scheduler does not pick an idle actor."""
        actor.check_alive()
        if ticks > 0 and not self.stopping:
            actor.wake_at = self.result.ticks + ticks
            self.yield_(actor, f"idle {ticks}", store_call=False)
            actor.check_alive()

    def crash_rate(self, actor: _Actor) -> float:
        return self.profile.p_crash_call if self.faults_on else 0.0

    def _failpoint(self, name: str) -> None:
        actor = self.current
        if actor is None or not self.faults_on or actor.dead:
            return
        if self.crash_rng.random() < self.profile.p_crash_failpoint:
            raise actor.die(name)

    def violation(self, message: str) -> None:
        self.result.violations.append(f"tick {self.result.ticks}: {message}")
        self.stopping = True

    def _tick(self, actor: _Actor) -> None:
        self.current = actor
        actor.go.release()
        if not self._back.acquire(timeout=_HANG_SECONDS):
            self.violation(f"{actor.name} did not yield within {_HANG_SECONDS}s (a hang)")
            raise InvariantViolation("hang")
        self.current = None
        if not self._store_call:
            return  # an actor went idle: nothing happened
        self._store_call = False
        self.result.ticks += 1
        # Time passes: a little each tick, now and then a long pause.
        self.clock.advance(0.5)
        if self.faults_on and self.sched_rng.random() < self.profile.p_clock_jump:
            self.clock.advance(self.profile.grace * self.sched_rng.uniform(0.2, 1.5))
        self._pass_sleep()
        if self.faults_on and self.suspend_rng.random() < self._suspend_rate(actor):
            self._suspend(actor)
        if self.checks_on and not self.result.violations:
            with contextlib.suppress(InvariantViolation):
                self.checker.check_world()

    def _schedule(self, actors: list[_Actor], max_ticks: int) -> None:
        for a in actors:
            a.thread.start()
        while True:
            alive = [a for a in actors if not a.finished]
            if not alive:
                return
            ticks = self.result.ticks
            if ticks >= max_ticks and not self.stopping:
                self.stopping = True
                if self.sched_rng.random() < 0.5:  # SIGKILL everyone
                    for a in alive:
                        a.killed = True
                        self.result.counters["kills"] += 1
            if ticks >= max_ticks + 3000 or len(self.result.violations) > 0:
                for a in alive:
                    a.killed = True
            if self.stopping:
                for a in alive:
                    a.wake_at = 0
            ready = [a for a in alive if a.wake_at <= ticks]
            if not ready:  # everyone is idle: let the time pass
                self.result.ticks = min(a.wake_at for a in alive)
                continue
            weights = [self.profile.weights.get(a.name, 1.0) for a in ready]
            self._tick(self.sched_rng.choices(ready, weights)[0])

    # -- virtual time --

    def elapsed(self) -> float:
        """Seconds on the store's clock since the world began (what GC's ages count)."""
        return (self.clock() - _T0).total_seconds()

    def monotonic(self) -> float:
        """``time.monotonic()`` of the calling actor's host: the store's clock, less the
        time that host spent suspended (a hibernated VM's monotonic clock stops)."""
        actor = self.current
        if actor is not None and threading.current_thread() is actor.thread:
            return self.elapsed() - actor.asleep_s
        return self.elapsed()

    def _pass_sleep(self) -> None:
        """One tick of every suspended host's sleep: the store's clock moves on, the
        sleeper's monotonic clock does not."""
        for a in self.actors:
            if a.sleep_rate and a.wake_at > self.result.ticks:
                self.clock.advance(a.sleep_rate)
                a.asleep_s += a.sleep_rate
            else:
                a.sleep_rate = 0.0

    def _suspend_rate(self, actor: _Actor) -> float:
        """The chance that ``actor``'s host sleeps before its next call: 20x higher in
        the windows that matter most: right before a write of LATEST or of a manifest (a
        commit's checks guard them), and before a read of checkpoint data (a restore
        whose checkpoint may be collected under it)."""
        rate = self.profile.p_suspend
        op, _, key = actor.next_call.partition(" ")
        writing = op == "put" and key.endswith((protocol.LATEST_KEY, protocol.MANIFEST_NAME))
        reading = op in ("get", "get_range", "list") and ("/chunks/" in key or "/files/" in key)
        return min(1.0, 20 * rate) if writing or reading else rate

    def _suspend(self, actor: _Actor) -> None:
        """Host suspend: ``actor``'s host sleeps (VM hibernate, GCE suspend, a paused VM)
        for 1.2-4 x grace of store time while the others go on; its monotonic clock does
        not move meanwhile. It may sleep anywhere: between its upload and its commit,
        inside GC between the inventory and the deletions, in the middle of a restore.
        Half the time (never for a restorer: its checkpoint must have time to be
        dropped and collected under it) the store's clock jumps at once (the others were
        quiet while it slept); otherwise the time passes over the ticks of the sleep (``_pass_sleep``),
        so what the others do meanwhile (commits dropping a checkpoint, GC collecting it
        once it is past grace) happens at the store times it would."""
        seconds = self.profile.grace * self.suspend_rng.uniform(1.2, 4.0)
        ticks = self.suspend_rng.randint(5, 150)
        actor.wake_at = self.result.ticks + ticks
        reading = actor.next_call.startswith(("get", "list")) and actor.name == "restorer"
        if not reading and self.suspend_rng.random() < 0.5:  # the world was quiet meanwhile
            self.clock.advance(seconds)
            actor.asleep_s += seconds
        else:
            actor.sleep_rate = seconds / ticks
        self.result.counters["host_suspends"] += 1
        self._trace.update(f"suspend {actor.name} {seconds:.1f}\n".encode())

    def _sleep(self, seconds: float) -> None:
        self.clock.advance(max(0.0, float(seconds)))
        actor = self.current
        if actor is not None and threading.current_thread() is actor.thread:
            actor.check_alive()
            self.yield_(actor, f"sleep {seconds:.3f}")
            actor.check_alive()

    def _attempt_id(self, now: dt.datetime | None = None) -> str:
        stamp = self.clock().strftime("%Y%m%dT%H%M%S")
        return f"{stamp}{self.clock().microsecond // 1000:03d}Z-{self.id_rng.getrandbits(32):08x}"

    @contextlib.contextmanager
    def _virtual_world(self) -> Iterator[None]:
        saved = (time.sleep, time.monotonic, protocol.new_attempt_id, protocol.new_writer_id)
        random_state = random.getstate()
        time.sleep = self._sleep
        time.monotonic = self.monotonic
        protocol.new_attempt_id = self._attempt_id
        protocol.new_writer_id = lambda: f"sim-{self.id_rng.getrandbits(32):08x}"
        random.seed(self.seed)
        for point in failpoints.POINTS:
            failpoints.arm(point, self._failpoint, once=False)
        try:
            yield
        finally:
            failpoints.disarm()
            time.sleep, time.monotonic, protocol.new_attempt_id, protocol.new_writer_id = saved
            random.setstate(random_state)

    # -- content --

    def content(self, key: str) -> dict[str, bytes]:
        """The files of save ``key`` (derived from the key, so any copy can be checked)."""
        rng = random.Random(key)
        names = rng.sample(["model.bin", "optim/state.bin", "rng.pt", "meta/trainer.json"], rng.randint(1, 3))  # fmt: skip
        files = {}
        for name in sorted(names):
            size = rng.choice([0, rng.randint(1, 300), rng.randint(300, 6000)])
            files[name] = rng.randbytes(size)
        if self.profile.big_files and rng.random() < 0.3:
            files["big.bin"] = rng.randbytes(digest.CHUNK_SIZE + rng.randint(1, 5000))
        if rng.random() < 0.8:
            # Frozen weights shared by most saves: chunks that later checkpoints reuse. The
            # base changes every few steps (a new stage of training), so a chunk can end up
            # named by dropped checkpoints only, which GC must keep while a pin could still
            # bring one of them back.
            parts = key.split(".")
            stage = int(parts[2]) // 4 if len(parts) > 2 and parts[2].isdigit() else 0
            files["base/frozen.bin"] = random.Random(f"base{stage % 3}").randbytes(3000)
        return files

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(concurrency=1, multipart_threshold=4096, attempts=4)

    def new_dir(self, kind: str) -> Path:
        self._counter += 1
        return self.work / f"{kind}-{self._counter}"

    # -- checks on restores --

    def check_restore(
        self, res: RestoreResult, floor: int, started: float, who: str, *, damage: bool = False
    ) -> None:
        """I8: a restore yields exactly the bytes of one committed checkpoint, the newest
        one (at least as new as every acknowledged save) unless it reports a fallback."""
        c = self.checker
        state = c.records.get(res.commit_id)
        if state is None:
            c.fail(f"I8: {who} restored {res.commit_id}, which was never committed")
        expected = self.content(res.metadata.get("sim", "?"))
        got = {
            p.relative_to(res.path).as_posix(): p.read_bytes()
            for p in sorted(res.path.rglob("*"))
            if p.is_file()
        }
        if got != expected:
            c.fail(f"I8: {who} restored step {res.step} with bytes that are not its checkpoint's")
        slow = self.elapsed() - started > (c.latest.settings.gc_grace_s if c.latest else 0)
        damaged = [s for s in res.skipped if not s.dropped]
        if damaged and not damage:
            c.fail(f"I8: {who}'s restore skipped {damaged} with no damage injected")
        if len(damaged) < len(res.skipped):
            # Collected under the restore: only after the grace period, and then the
            # restore read LATEST again (so what it restored is not older than an ack).
            if not slow and not damage:
                c.fail(f"I7/I8: {who}'s checkpoint was collected under a fast restore")
            self.result.counters["slow_reader_rereads"] += 1
        if not damaged and not res.from_commit_records and state.current_seq < floor:
            c.fail(
                f"I3/I8: {who} restored step {res.step} (current at seq {state.current_seq}), "
                f"older than an acknowledged save (current at seq {floor})"
            )
        self.result.counters["restores_verified"] += 1

    # -- actors --

    def _writer(self, actor: _Actor) -> None:
        staging = self.new_dir(f"staging-{actor.name}")
        self.pause(actor, actor.rng.randint(0, 60))
        while not self.stopping:
            if actor.incarnation and actor.rng.random() < 0.4:
                staging = self.new_dir(f"staging-{actor.name}")  # a new host
            port = actor.new_incarnation()
            try:
                self._writer_life(actor, port, staging)
            except SimulatedCrash:
                self.result.counters["writer_crashes"] += 1
            if self.stopping:
                return
            self.result.counters["writer_restarts"] += 1
            with contextlib.suppress(SimulatedCrash):
                actor.killed = False
                self.pause(actor, actor.rng.randint(1, 40))

    def _manager(self, actor: _Actor, port: Store, staging: Path, **kw: Any):
        from cloudckpt.manager import CheckpointManager

        p = self.profile
        mgr = CheckpointManager(
            port,
            staging_dir=staging,
            keep_last=p.keep_last,
            keep_every=p.keep_every,
            gc_grace=p.grace,
            auto_gc=False,
            transfer=self.transfer_config(),
            # Whole files too: a run may mix chunked and whole-file checkpoints.
            chunking=self.chunking_rng.choice(("tensor", "tensor", "fixed", "off")),
            **kw,
        )
        mgr._synchronous = True
        mgr.engine.close()
        mgr.engine = inline_engine(self.transfer_config())
        return mgr

    def _writer_life(self, actor: _Actor, port: Store, staging: Path) -> None:
        mgr = self._manager(actor, port, staging)
        actor.writer_id = mgr.writer_id
        try:
            actor.op += 1
            step = actor.rng.randint(1, 30)
            if actor.rng.random() < 0.75:
                step = self._resume(actor, mgr)
                if step is None:
                    return
            # else: the first save claims the run (and recovers the staging journal).
            for i in range(actor.rng.randint(1, 10)):
                if self.stopping:
                    break
                actor.op += 1
                key = f"{actor.name}.{actor.incarnation}.{step}.{i}"
                if not self._one_save(actor, mgr, step, key):
                    return  # fenced
                step += actor.rng.choice([1, 1, 2])
                self.pause(actor, actor.rng.randint(0, 8))
            with contextlib.suppress(CloudCkptError):
                mgr.close()
        finally:
            mgr.staging.close()  # a dead process's flock goes with it

    def _resume(self, actor: _Actor, mgr: Any) -> int | None:
        """``resume()`` and check what it restored; the next step, or None if it failed."""
        c = self.checker
        floor, started = c.ack_floor(), self.elapsed()
        into = self.new_dir("resume")
        try:
            res = mgr.resume(into=into)
        except (NeedsRepairError, ConfigurationError) as exc:
            c.fail(f"I10: {actor.name} could not resume: {exc}")
        except CloudCkptError as exc:  # faults: the store kept failing
            self.result.counters[f"resume_failed:{type(exc).__name__}"] += 1
            return None
        step = 1
        if res is not None:
            self.check_restore(res, floor, started, f"{actor.name}.resume")
            step = res.step + 1
        shutil.rmtree(into, ignore_errors=True)
        latest = mgr.committer.latest
        if latest is not None and latest.current is not None:
            step = max(step, latest.current.step + 1)
        return step

    def _one_save(self, actor: _Actor, mgr: Any, step: int, key: str) -> bool:
        """One save; False once this writer is fenced (it then acts as a zombie)."""
        c = self.checker
        files = self.content(key)
        try:
            handle = mgr.save(step=step, metadata={"sim": key})
            directory = handle.__enter__()
        except FencedError:
            return False
        for n, (name, data) in enumerate(files.items()):
            path = directory / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if self.faults_on and self.crash_rng.random() < self.profile.p_crash_call:
                raise actor.die(f"staging-file-{n}")  # dies inside the with-block
        handle.__exit__(None, None, None)
        try:
            info = handle.result()
        except SimulatedCrash:
            actor.dead = True
            raise
        except FencedError as exc:
            c.failed(key, exc, actor.name)
            self.result.counters["fenced"] += 1
            # A zombie keeps going for a bit: every further save must be refused.
            for _ in range(actor.rng.randint(0, 2)):
                try:
                    mgr.save(step=step + 1, metadata={"sim": key + "z"}).__enter__()
                except FencedError:
                    self.result.counters["zombie_refused"] += 1
                else:
                    c.fail(f"I4: fenced {actor.name} could start another save")
            return False
        except CommitStateUnknownError:
            self.result.counters["save_unknown"] += 1
        except CloudCkptError as exc:
            c.failed(key, exc, actor.name)
            self.result.counters[f"save_failed:{type(exc).__name__}"] += 1
        else:
            c.acknowledged(info.commit_id, key, actor.name)
            self.result.counters["acks"] += 1
            if mgr.last_upload is not None:
                self.result.counters["chunks_reused"] += mgr.last_upload.chunks_reused
        return True

    def _gc(self, actor: _Actor) -> None:
        while not self.stopping:
            port = actor.new_incarnation()
            try:
                while not self.stopping:
                    self.pause(actor, actor.rng.randint(1, 30))
                    actor.op += 1
                    try:
                        report = collect_garbage(port)
                    except (StoreError, NeedsRepairError) as exc:
                        self.result.counters[f"gc_failed:{type(exc).__name__}"] += 1
                        if isinstance(exc, NeedsRepairError) and self.checker.latest:
                            self.checker.fail(f"GC found no readable LATEST: {exc}")
                        continue
                    except CloudCkptError as exc:
                        self.result.counters[f"gc_failed:{type(exc).__name__}"] += 1
                        continue
                    self.result.counters["gc_runs"] += 1
                    self.result.counters["gc_deleted_objects"] += report.deleted_objects
            except SimulatedCrash:
                self.result.counters["gc_crashes"] += 1

    def _pinner(self, actor: _Actor) -> None:
        c = self.checker
        while not self.stopping:
            port = actor.new_incarnation()
            try:
                while not self.stopping:
                    self.pause(actor, actor.rng.randint(1, 25))
                    latest = c.latest
                    if latest is None:
                        continue
                    actor.op += 1
                    tag = (actor.name, actor.incarnation, actor.op)
                    pins = sorted({p.step for p in latest.pins})
                    try:
                        if pins and actor.rng.random() < 0.5:
                            admin.unpin(port, actor.rng.choice(pins))
                        else:
                            steps = [r.step for r in latest.retained()]
                            steps += [t.record.step for t in latest.tombstones]
                            if not steps:
                                continue
                            label = actor.rng.choice(["best", "eval"])
                            admin.pin(port, actor.rng.choice(steps), label)
                        self.result.counters["pin_ops"] += 1
                    except (CheckpointNotFoundError, ConfigurationError) as exc:
                        # A definite refusal: nothing of this operation may have landed.
                        if c.op_writes[tag]:
                            c.fail(f"I6: pin/unpin reported {type(exc).__name__} ({exc}) "
                                   "but its LATEST write landed")  # fmt: skip
                        self.result.counters["pin_refused"] += 1
                    except CloudCkptError as exc:
                        self.result.counters[f"pin_failed:{type(exc).__name__}"] += 1
            except SimulatedCrash:
                self.result.counters["pinner_crashes"] += 1

    def _restorer(self, actor: _Actor) -> None:
        c = self.checker
        while not self.stopping:
            port = actor.new_incarnation()
            engine = inline_engine(self.transfer_config())
            try:
                while not self.stopping:
                    self.pause(actor, actor.rng.randint(1, 30))
                    actor.op += 1
                    step = None
                    if c.latest and c.latest.history and actor.rng.random() < 0.3:
                        step = actor.rng.choice(c.latest.history).step
                    into = self.new_dir("restore")
                    floor, started = c.ack_floor(), self.elapsed()
                    try:
                        res = restore(port, into, engine, step=step)
                    except CheckpointNotFoundError:
                        self.result.counters["restore_nothing"] += 1
                    except CorruptionError as exc:
                        # Slow or not: a checkpoint collected under a slow restore is not
                        # damage (the restore reads LATEST again).
                        c.fail(f"I8: restore found damage where none was injected: {exc}")
                    except StoreError as exc:
                        self.result.counters[f"restore_failed:{type(exc).__name__}"] += 1
                    except SimulatedCrash:
                        self._check_untouched(into)
                        raise
                    else:
                        if step is None:
                            self.check_restore(res, floor, started, actor.name)
                        else:
                            self.check_restore(res, 0, started, actor.name)
                        shutil.rmtree(into, ignore_errors=True)
                        continue
                    self._check_untouched(into)
            except SimulatedCrash:
                self.result.counters["restorer_crashes"] += 1

    def _check_untouched(self, into: Path) -> None:
        if into.exists() and any(into.iterdir()):
            self.checker.fail(f"I8: a failed restore left files in {into}")

    # -- the final phase --

    def _finisher(self, actor: _Actor) -> None:
        """No more faults: recovery converges, GC converges, every retained checkpoint
        restores, and every injected damage is detected (I9, I10)."""
        c = self.checker
        p = self.profile
        port = actor.new_incarnation()
        engine = inline_engine(self.transfer_config())
        # 1. A writer restarts (on a crashed writer's staging dir: journal recovery).
        dirs = sorted(self.work.glob("staging-*"))
        staging = actor.rng.choice(dirs) if dirs and actor.rng.random() < 0.7 else self.new_dir("staging-final")  # fmt: skip
        mgr = self._manager(actor, port, staging)
        actor.writer_id = mgr.writer_id
        floor, started = c.ack_floor(), self.elapsed()
        into = self.new_dir("final-resume")
        try:
            res = mgr.resume(into=into)
        except CloudCkptError as exc:
            c.fail(f"I10: resume after the faults stopped failed: {type(exc).__name__}: {exc}")
        if res is not None:
            self.check_restore(res, floor, started, "final resume")
        top = c.latest.current.step if c.latest and c.latest.current else 0
        key = f"final.{top + 1}"
        if not self._one_save(actor, mgr, top + 1, key) or key not in c.acked.values():
            c.fail("I10: a save after the faults stopped did not commit")
        mgr.close()
        # 2. GC converges: after enough time nothing unreferenced is left.
        for _ in range(4):
            self.clock.advance(p.grace + 1)
            collect_garbage(port)
        latest = c.latest
        if latest.tombstones:
            c.fail(f"I10: tombstones left after GC converged: {latest.tombstones}")
        refs = latest.referenced_prefixes()
        named = self.checker.named_chunks(latest)
        leftovers = {
            _prefix_of(o.key) for o in self.memory.list("ckpt/") if o.key not in named
        } - refs
        if leftovers:
            c.fail(f"I10: unreferenced attempts left after GC converged: {sorted(leftovers)}")
        if self.memory.list_multipart(""):
            c.fail("I10: incomplete uploads left after GC converged")
        if collect_garbage(port).deleted_objects:
            c.fail("I10: a second converged GC still deleted something")
        # 3. Every retained checkpoint restores to its exact bytes.
        for rec in latest.retained():
            into = self.new_dir("final-restore")
            res = restore(port, into, engine, step=rec.step)
            self.check_restore(res, 0, self.elapsed(), f"final restore of step {rec.step}")
            shutil.rmtree(into, ignore_errors=True)
        # 4. Damage: every single bit flip is detected (I9); a missing LATEST falls back.
        self.checks_on = False
        self._damage(actor, port, engine)
        self.checks_on = True

    def _damage(self, actor: _Actor, port: Store, engine: TransferEngine) -> None:
        c = self.checker
        latest = c.latest
        raw = self.memory
        rng = actor.rng
        current = latest.current
        manifest = protocol.parse_manifest(raw.get(current.manifest_key)[0], current)
        targets = [protocol.LATEST_KEY, current.manifest_key]
        targets += [k.key for k in raw.list(protocol.COMMITS_PREFIX)][-1:]
        files = [e for e in manifest.files if e.size]
        if files:
            entry = rng.choice(files)
            if entry.chunks is not None:
                targets.append(rng.choice(entry.chunks).key)
                self.result.counters["chunk_flips"] += 1
            else:
                targets.append(current.ckpt + protocol.FILES_DIR + entry.path)
        for key in targets:
            original, _ = raw.get(key)
            bit = flip_bit(raw, key, seed=rng.getrandbits(32))
            self.result.counters["bit_flips"] += 1
            detected = self._detect(key, current, port, engine)
            raw.put(key, original)
            if not detected:
                c.fail(f"I9: a flip of bit {bit} of {key} went unnoticed")
            self.result.counters["bit_flips_detected"] += 1
        self._forge(rng, port, engine, current, manifest)
        self._forge_with_latest(rng, port, engine, current, manifest)
        # LATEST deleted: readers fall back to the commit records, writers refuse.
        original, _ = raw.get(protocol.LATEST_KEY)
        raw.delete(protocol.LATEST_KEY)
        into = self.new_dir("damage")
        res = restore(port, into, engine)
        if not res.from_commit_records:
            c.fail("I9: restore without LATEST did not say it used the commit records")
        self.check_restore(res, 0, self.elapsed(), "restore without LATEST")
        try:
            collect_garbage(port)
        except NeedsRepairError:
            pass
        else:
            c.fail("I9: GC ran without LATEST")
        raw.put(protocol.LATEST_KEY, original)

    def _forge(
        self,
        rng: random.Random,
        port: Store,
        engine: TransferEngine,
        current: CheckpointRecord,
        manifest: protocol.Manifest,
    ) -> None:
        """A consistent forgery (I9): one file of the current checkpoint rewritten and its
        manifest re-sealed to match, so only the digest LATEST recorded can tell. The
        manifest must be refused, and no restore may return the forged bytes."""
        c, raw = self.checker, self.memory
        entry = rng.choice(manifest.files)
        evil = b"forged " + rng.randbytes(rng.randint(1, 64))
        if entry.chunks is None:
            key = current.ckpt + protocol.FILES_DIR + entry.path
            forged = protocol.FileEntry(entry.path, len(evil), digest.tree_digest(evil))
        else:
            sha = hashlib.sha256(evil).hexdigest()
            key = f"{current.ckpt}{protocol.CHUNKS_DIR}{sha}"
            ref = protocol.ChunkRef(current.ckpt, sha, len(evil))
            tree = digest.tree_digest(evil, manifest.chunk_size)
            forged = protocol.FileEntry(entry.path, len(evil), tree, (ref,))
        files = tuple(forged if e is entry else e for e in manifest.files)
        saved = {k: raw.get(k)[0] for k in (key, current.manifest_key) if raw.exists(k)}
        raw.put(key, evil)
        raw.put(current.manifest_key, dataclasses.replace(manifest, files=files).to_bytes())
        self.result.counters["forgeries"] += 1
        try:
            if not self._detect(current.manifest_key, current, port, engine):
                c.fail(f"I9: a re-sealed manifest of step {current.step} was accepted")
            into = self.new_dir("forgery")
            with contextlib.suppress(CorruptionError):
                res = restore(port, into, engine, step=current.step)
                self.check_restore(res, 0, self.elapsed(), "restore of a forgery", damage=True)
            self.result.counters["forgeries_detected"] += 1
        finally:
            for k in (key, current.manifest_key):
                if k in saved:
                    raw.put(k, saved[k])
                else:
                    raw.delete(k)

    def _forge_with_latest(
        self,
        rng: random.Random,
        port: Store,
        engine: TransferEngine,
        current: CheckpointRecord,
        manifest: protocol.Manifest,
    ) -> None:
        """A forgery consistent up to LATEST (I9): one file's content replaced by other
        intact data (another chunk, or other bytes for a whole file), its size changed to
        match, the manifest re-sealed and LATEST's record of it re-sealed too. Every chunk
        and every seal verifies; only the file's recorded digest can tell. No restore may
        return the forged bytes."""
        c, raw = self.checker, self.memory
        entry = rng.choice(manifest.files)
        saved: dict[str, bytes | None] = {protocol.LATEST_KEY: raw.get(protocol.LATEST_KEY)[0]}
        if entry.chunks is None:
            key = current.ckpt + protocol.FILES_DIR + entry.path
            other = raw.get(key)[0] + b"!"
            saved[key] = raw.get(key)[0]
            raw.put(key, other)
            forged = protocol.FileEntry(entry.path, len(other), entry.digest)
        else:
            mine = {ch.sha256 for ch in entry.chunks}  # other bytes, not another copy
            others = [
                o for o in raw.list("ckpt/") if "/chunks/" in o.key and o.key[-64:] not in mine
            ]
            if not others:
                return
            pick = rng.choice(others)
            owner, sha = pick.key.split(protocol.CHUNKS_DIR)
            ref = protocol.ChunkRef(owner, sha, pick.size)
            forged = protocol.FileEntry(entry.path, pick.size, entry.digest, (ref,))
        files = tuple(forged if e is entry else e for e in manifest.files)
        body = dataclasses.replace(manifest, files=files).to_bytes()
        saved[current.manifest_key] = raw.get(current.manifest_key)[0]
        raw.put(current.manifest_key, body)
        latest = protocol.parse_latest(saved[protocol.LATEST_KEY])
        record = dataclasses.replace(
            current, manifest_sha256=hashlib.sha256(body).hexdigest(), manifest_size=len(body)
        )
        raw.put(protocol.LATEST_KEY, dataclasses.replace(latest, current=record).to_bytes())
        self.result.counters["consistent_forgeries"] += 1
        try:
            into = self.new_dir("forgery")
            try:
                res = restore(port, into, engine, step=current.step)
            except CorruptionError:
                pass
            else:
                if res.commit_id == current.commit_id:
                    c.fail(f"I9: a consistent forgery of {entry.path} (step {current.step}) "
                           "was restored")  # fmt: skip
                self.check_restore(res, 0, self.elapsed(), "restore of a forgery", damage=True)
            self.result.counters["consistent_forgeries_detected"] += 1
        finally:
            for k, v in saved.items():
                raw.put(k, v)

    def _detect(self, key: str, current: CheckpointRecord, port: Store, engine) -> bool:
        if key == protocol.LATEST_KEY or key.startswith(protocol.COMMITS_PREFIX):
            try:
                protocol.parse_latest(self.memory.get(key)[0])
            except CloudCkptError:
                pass
            else:
                return False
            if key != protocol.LATEST_KEY:
                return True
            into = self.new_dir("damage")
            res = restore(port, into, engine)
            self.check_restore(res, 0, self.elapsed(), "restore with a damaged LATEST")
            return res.from_commit_records
        if key == current.manifest_key:
            try:
                fetch_manifest(port, current)
            except CorruptionError:
                return True
            return False
        into = self.new_dir("damage")
        try:
            res = restore(port, into, engine, step=current.step)
        except CorruptionError:
            return not (into.exists() and any(into.iterdir()))
        # Another retained checkpoint of the same step may stand in, with a report.
        self.check_restore(res, 0, self.elapsed(), "restore of a damaged step", damage=True)
        return current.commit_id in {s.commit_id for s in res.skipped}

    # -- run --

    def run(self) -> SimResult:
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if self._workdir_arg is None:
                base = "/dev/shm" if os.path.isdir("/dev/shm") else None
                self.work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cloudckpt-sim-", dir=base)))  # fmt: skip
            else:
                self.work = Path(self._workdir_arg)
                self.work.mkdir(parents=True, exist_ok=True)
            stack.callback(drop_memory_bucket, self.bucket)
            stack.enter_context(self._virtual_world())
            try:
                actors = [
                    _Actor(self, "A", self._writer),
                    _Actor(self, "B", self._writer),
                    _Actor(self, "gc", self._gc),
                    _Actor(self, "restorer", self._restorer),
                    _Actor(self, "pinner", self._pinner),
                ]
                self._schedule(actors, self.steps)
                if not self.result.violations:
                    self.faults_on = False
                    self.stopping = False
                    self._schedule([_Actor(self, "final", self._finisher)], 10**6)
            except InvariantViolation:
                pass
            for a in self.actors:
                if a.faults is not None:
                    self.result.faults.update(a.faults.injected)
        self.result.trace_digest = self._trace.hexdigest()
        self.result.trace_tail = list(self._tail)
        self.result.seconds = time.perf_counter() - started
        return self.result


def run_seed(
    seed: int, steps: int = DEFAULT_STEPS, mutate: Callable[[Store], Store] | None = None
) -> SimResult:
    """Run one seed and return its result (never raises for a violation)."""
    return Simulation(seed, steps, mutate=mutate).run()


def _quiet(level: int = 50) -> None:
    """The simulated faults make cloudckpt chatty: show only ``level`` and above."""
    import logging

    logging.basicConfig(level=level)


def run_seeds(
    seeds: Sequence[int],
    steps: int = DEFAULT_STEPS,
    jobs: int = 1,
    progress: Callable[[SimResult], None] | None = None,
) -> list[SimResult]:
    """Run many seeds (in ``jobs`` processes); results in seed order."""
    if jobs <= 1:
        results = []
        for s in seeds:
            results.append(run_seed(s, steps))
            if progress:
                progress(results[-1])
        return results
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_quiet) as pool:
        results = []
        for r in pool.map(run_seed, seeds, [steps] * len(seeds), chunksize=8):
            results.append(r)
            if progress:
                progress(r)
        return results


def summarize(results: Sequence[SimResult]) -> dict[str, Any]:
    counters: collections.Counter = collections.Counter()
    faults: collections.Counter = collections.Counter()
    for r in results:
        counters.update(r.counters)
        faults.update(r.faults)
    return {
        "seeds": len(results),
        "ticks": sum(r.ticks for r in results),
        "violations": sum(len(r.violations) for r in results),
        "failed_seeds": [r.seed for r in results if not r.ok],
        "faults_injected": dict(sorted(faults.items())),
        "crashes": counters["crashes"],
        "counters": dict(sorted(counters.items())),
        "cpu_seconds": round(sum(r.seconds for r in results), 1),
    }


def _parse_seeds(text: str) -> list[int]:
    if ":" in text:
        a, b = text.split(":", 1)
        return list(range(int(a), int(b)))
    return [int(s) for s in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cloudckpt.testing.simulation",
        description="Seeded deterministic simulation of the cloudckpt commit protocol.",
    )
    parser.add_argument("--seed", type=int, help="replay one seed (prints its trace tail)")
    parser.add_argument("--seeds", default="0:300", help="a range A:B or a list a,b,c")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="scheduler ticks")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--json", help="write the summary as JSON to this file")
    parser.add_argument(
        "--verbose", action="store_true", help="print every seed, and cloudckpt's warnings"
    )
    args = parser.parse_args(argv)
    _quiet(30 if args.verbose else 50)
    seeds = [args.seed] if args.seed is not None else _parse_seeds(args.seeds)
    started = time.perf_counter()
    done = collections.Counter()

    def progress(r: SimResult) -> None:
        done["seeds"] += 1
        done["violations"] += len(r.violations)
        if done["seeds"] % 500 == 0 and len(seeds) > 500:
            print(
                f"{done['seeds']}/{len(seeds)} seeds, {done['violations']} violations, "
                f"{time.perf_counter() - started:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    results = run_seeds(seeds, args.steps, args.jobs, progress)
    for r in results:
        if args.verbose or not r.ok or args.seed is not None:
            print(r.report())
            if args.seed is not None:
                print(f"  trace digest {r.trace_digest}")
                print(f"  counters {dict(sorted(r.counters.items()))}")
                print(f"  faults {dict(sorted(r.faults.items()))}")
    summary = summarize(results)
    summary["wall_seconds"] = round(time.perf_counter() - started, 1)
    summary["steps_per_seed"] = args.steps
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
