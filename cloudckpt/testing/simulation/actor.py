"""An actor: one simulated process, a thread that runs only while it holds the baton.

An actor's program (``actors/``) runs in the actor's thread and gets the actor as its
one argument: its name, its own seeded RNG, and ``actor.sim``, the world it lives in.
After a crash the program starts again from scratch, like a new process.
"""

from __future__ import annotations

import random
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from cloudckpt.failpoints import SimulatedCrash
from cloudckpt.stores.base import Store
from cloudckpt.testing.faults import FaultInjectingStore
from cloudckpt.testing.simulation.plumbing import Port
from cloudckpt.testing.simulation.result import InvariantViolation

if TYPE_CHECKING:
    from cloudckpt.testing.simulation.world import Simulation


def baton() -> threading.Lock:
    """A binary semaphore that starts taken: the fastest hand-off CPython threads have."""
    lock = threading.Lock()
    lock.acquire()
    return lock


class Actor:
    """One simulated process (restarted in place after a crash)."""

    def __init__(self, sim: Simulation, name: str, program: Callable[[Actor], None]) -> None:
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
