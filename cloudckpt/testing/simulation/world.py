"""The world of one seed (``Simulation``): the store, the scheduler that passes the baton
between the actors, virtual time (the store's clock, each host's monotonic clock, host
suspend), and the run: the actors under faults, then the final phase without them."""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import hashlib
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import SupportsIndex

from cloudckpt import attempt_layout, failpoints, protocol
from cloudckpt.stores.base import Store
from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket
from cloudckpt.testing.simulation.actor import Actor, baton
from cloudckpt.testing.simulation.actors import collector, finisher, pinner, restorer, writer
from cloudckpt.testing.simulation.checker import Checker
from cloudckpt.testing.simulation.plumbing import Recorder
from cloudckpt.testing.simulation.profile import Profile
from cloudckpt.testing.simulation.result import DEFAULT_STEPS, InvariantViolation, SimResult

_T0 = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
_HANG_SECONDS = 120.0  # real seconds an actor may hold the baton before we call it a hang


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
        self.profile = Profile.draw(
            self.rng,
            random.Random(f"{seed}/retention"),
            random.Random(f"{seed}/short-reads"),
            random.Random(f"{seed}/tensors"),
            random.Random(f"{seed}/sticky-short"),
        )
        # Each data key's window of sticky short reads (store seconds since the world
        # began, from its first ranged read under faults; empty for most keys).
        self._sticky: dict[str, tuple[float, float]] = {}
        self.sched_rng = random.Random(f"{seed}/scheduler")
        self.crash_rng = random.Random(f"{seed}/crash")
        self.id_rng = random.Random(f"{seed}/ids")
        self.suspend_rng = random.Random(f"{seed}/suspend")
        self.chunking_rng = random.Random(f"{seed}/chunking")
        # The store's clock stepping back for a write into an attempt (a frontend whose
        # clock is behind, or a step back corrected at once), from a generator of its own
        # so that every other draw of a seed stays as it was.
        self.clockback_rng = random.Random(f"{seed}/clockback")
        self.p_clock_back = self.clockback_rng.choice([0.0, 0.01, 0.03, 0.1])
        self.result = SimResult(seed, steps)
        self.bucket = f"sim-{seed}-{os.getpid()}-{id(self):x}"
        self.clock = ManualClock(_T0)
        self.memory = MemoryStore(self.bucket, "run", clock=self.clock)
        self.checker = Checker(self)
        self.recorder = Recorder(self, self.memory, mutate(self.memory) if mutate else None)
        self._workdir_arg = workdir
        self.work: Path = Path(".")
        self.faults_on = True
        self.checks_on = True  # off while the final phase damages the store on purpose
        self.stopping = False
        self.current: Actor | None = None
        self.actors: list[Actor] = []
        self._back = baton()
        self._trace = hashlib.sha256()
        self._tail: collections.deque[str] = collections.deque(maxlen=60)
        self._counter = 0
        self._store_call = False

    # -- scheduling --

    def yield_(self, actor: Actor, what: str, *, store_call: bool = True) -> None:
        """Called by an actor: record what it is about to do and hand the baton back."""
        self._store_call = store_call
        actor.next_call = what
        line = f"{self.result.ticks} {actor.name}#{actor.incarnation} {what}"
        self._trace.update(line.encode() + b"\n")
        self._tail.append(line)
        self._back.release()
        actor.go.acquire()

    def hand_back(self) -> None:
        """Called by an actor whose program ended: the baton goes back to the scheduler."""
        self._back.release()

    def pause(self, actor: Actor, ticks: int) -> None:
        """Stay idle while ``ticks`` store calls of other actors happen (a process busy
        with something else). The scheduler does not pick an idle actor."""
        actor.check_alive()
        if ticks > 0 and not self.stopping:
            actor.wake_at = self.result.ticks + ticks
            self.yield_(actor, f"idle {ticks}", store_call=False)
            actor.check_alive()

    def crash_rate(self, actor: Actor) -> float:
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

    def _tick(self, actor: Actor) -> None:
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

    def _schedule(self, actors: list[Actor], max_ticks: int) -> None:
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

    def _suspend_rate(self, actor: Actor) -> float:
        """The chance that ``actor``'s host sleeps before its next call: 20x higher in
        the windows that matter most: right before a write of LATEST or of a manifest (a
        commit's checks guard them), and before a read of checkpoint data (a restore
        whose checkpoint may be collected under it)."""
        rate = self.profile.p_suspend
        op, _, key = actor.next_call.partition(" ")
        writing = op == "put" and key.endswith((protocol.LATEST_KEY, attempt_layout.MANIFEST_NAME))
        reading = op in ("get", "get_range", "list") and ("/chunks/" in key or "/files/" in key)
        return min(1.0, 20 * rate) if writing or reading else rate

    def _suspend(self, actor: Actor) -> None:
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

    @contextlib.contextmanager
    def clock_stepped_back(self, key: str) -> Iterator[None]:
        """Now and then (``p_clock_back``, faults on), the store's clock steps back for
        one write of an object into an attempt (``ATTEMPT.json``, a file, a chunk, a
        manifest): by more than the commit's margin (up to half the grace period), so the
        object is dated earlier than a birth its writer read before it. GC dates the
        attempt by that object (issue 28 item 4)."""
        back = 0.0
        if (
            self.faults_on
            and key.startswith(attempt_layout.CKPT_PREFIX)
            and self.clockback_rng.random() < self.p_clock_back
        ):
            grace = self.profile.grace
            margin = min(600.0, max(0.1 * grace, 2.0))
            back = self.clockback_rng.uniform(1.2 * margin, 0.5 * grace)
            self.clock.advance(-back)
            self.result.counters["store_clock_steps_back"] += 1
            self._trace.update(f"clock back {back:.1f} {key}\n".encode())
        try:
            yield
        finally:
            if back:
                self.clock.advance(back)

    def _sleep(self, seconds: float | SupportsIndex) -> None:  # (time.sleep's signature)
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
        saved = (time.sleep, time.monotonic, attempt_layout.new_attempt_id, protocol.new_writer_id)
        random_state = random.getstate()
        time.sleep = self._sleep
        time.monotonic = self.monotonic
        attempt_layout.new_attempt_id = self._attempt_id
        protocol.new_writer_id = lambda: f"sim-{self.id_rng.getrandbits(32):08x}"
        random.seed(self.seed)
        for point in failpoints.POINTS:
            failpoints.arm(point, self._failpoint, once=False)
        try:
            yield
        finally:
            failpoints.disarm()
            time.sleep, time.monotonic, attempt_layout.new_attempt_id, protocol.new_writer_id = (
                saved
            )
            random.setstate(random_state)

    # -- for the actors --

    def cut_short(self, key: str) -> bool:
        """Whether a ranged answer of ``key`` is cut short now (``p_sticky_short``): for
        a share of data keys, every answer from the key's first ranged read under faults
        until 20 s to 10 min of store time later, each key drawn from a generator of its
        own (the seed and the key), so the windows do not depend on the order of reads."""
        if not self.faults_on or not ("/files/" in key or "/chunks/" in key):
            return False
        window = self._sticky.get(key)
        now = self.elapsed()
        if window is None:
            rng = random.Random(f"{self.seed}/sticky-short/{key}")
            cut = rng.random() < self.profile.p_sticky_short
            window = (now, now + rng.uniform(20, 600)) if cut else (0.0, 0.0)
            self._sticky[key] = window
        return window[0] <= now < window[1]

    def new_dir(self, kind: str) -> Path:
        """A fresh directory under the seed's work dir (numbered in the order of asking)."""
        self._counter += 1
        return self.work / f"{kind}-{self._counter}"

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
                    Actor(self, "A", writer.run),
                    Actor(self, "B", writer.run),
                    Actor(self, "gc", collector.run),
                    Actor(self, "restorer", restorer.run),
                    Actor(self, "pinner", pinner.run),
                ]
                self._schedule(actors, self.steps)
                if not self.result.violations:
                    self.faults_on = False
                    self.stopping = False
                    self._schedule([Actor(self, "final", finisher.run)], 10**6)
            except InvariantViolation:
                pass
            for a in self.actors:
                if a.faults is not None:
                    self.result.faults.update(a.faults.injected)
        self.result.trace_digest = self._trace.hexdigest()
        self.result.trace_tail = list(self._tail)
        self.result.seconds = time.perf_counter() - started
        return self.result
