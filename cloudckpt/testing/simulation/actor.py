"""An actor: one simulated process, a thread that runs only while it holds the baton.

An actor's program (``actors/``) runs in the actor's thread and gets the actor as its
one argument: its name, its own seeded RNG, and ``actor.sim``, the world it lives in
(``World``: what the actors need of ``world.Simulation``, which builds them). After a
crash the program starts again from scratch, like a new process. ``Port`` is an actor's
connection to the store; every call is a scheduling point (the actor hands the baton
back) and may crash the actor before or after it is applied.
"""

from __future__ import annotations

import contextlib
import random
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from cloudckpt.failpoints import SimulatedCrash
from cloudckpt.stores.base import Store
from cloudckpt.stores.memory import ManualClock
from cloudckpt.testing.faults import FaultInjectingStore
from cloudckpt.testing.simulation.checker import Checker
from cloudckpt.testing.simulation.result import InvariantViolation
from cloudckpt.testing.simulation.roles import CheckedWorld
from cloudckpt.testing.wrappers import ForwardingStore


def baton() -> threading.Lock:
    """A binary semaphore that starts taken: the fastest hand-off CPython threads have."""
    lock = threading.Lock()
    lock.acquire()
    return lock


class World(CheckedWorld, Protocol):
    """What an actor, its store connection and its programs need of the world (besides
    what the checker needs): the scheduler, the seed's generators, the checker, the store
    below the actors, the work dir and the switches of the run's phases."""

    checks_on: bool  # the final phase turns the checks off while it damages the store

    @property
    def seed(self) -> int: ...

    @property
    def actors(self) -> list[Actor]: ...

    @property
    def checker(self) -> Checker: ...

    @property
    def recorder(self) -> Store: ...

    @property
    def clock(self) -> ManualClock: ...

    @property
    def work(self) -> Path: ...

    @property
    def crash_rng(self) -> random.Random: ...

    @property
    def chunking_rng(self) -> random.Random: ...

    @property
    def faults_on(self) -> bool: ...

    @property
    def stopping(self) -> bool: ...

    def yield_(self, actor: Actor, what: str, *, store_call: bool = True) -> None: ...

    def hand_back(self) -> None: ...

    def pause(self, actor: Actor, ticks: int) -> None: ...

    def crash_rate(self, actor: Actor) -> float: ...

    def new_dir(self, kind: str) -> Path: ...

    def cut_short(self, key: str) -> bool: ...


class Actor:
    """One simulated process (restarted in place after a crash)."""

    def __init__(self, sim: World, name: str, program: Callable[[Actor], None]) -> None:
        self.sim = sim
        self.name = name
        self.program = program
        self.rng = random.Random(f"{sim.seed}/{name}")
        self.go = baton()
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
        # Why it calls the store: "gc" while it collects garbage (the checker judges its
        # aborts of uploads as GC's, by the grace period; others abandon their own).
        self.task = "gc" if name == "gc" else ""
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
            self.sim.hand_back()

    # -- called from the actor's own thread --

    def new_incarnation(self) -> Store:
        """A new process: fresh store clients (fault rules from the seed)."""
        self.incarnation += 1
        self.dead = self.killed = False
        if self.faults is not None:
            self.sim.result.faults.update(self.faults.injected)
        port = Port(self.sim, self, self.sim.recorder)
        self.faults = FaultInjectingStore(
            port,
            self.sim.profile.rules(self.rng, self.sim.cut_short) if self.sim.faults_on else [],
            seed=self.rng.getrandbits(32),
        )
        self.port = self.faults
        return self.faults

    @contextlib.contextmanager
    def doing(self, task: str) -> Iterator[None]:
        """Calls made meanwhile are for ``task`` (e.g. the final phase collecting garbage)."""
        before, self.task = self.task, task
        try:
            yield
        finally:
            self.task = before

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


class Port(ForwardingStore):
    """An actor's connection to the store: every call is a scheduling point, and may crash
    the actor before it is sent or after it was applied. It lives with ``Actor``: each
    builds the other's half (the actor its port, the port calls the actor back and hands it
    to the scheduler), so apart they would import each other."""

    def __init__(self, sim: World, actor: Actor, inner: Store) -> None:
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

    def get_range_into(self, key, start, buf):
        return self._do("get_range", key, lambda: self.inner.get_range_into(key, start, buf))

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
