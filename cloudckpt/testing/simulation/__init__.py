"""Seeded deterministic simulation of cloudckpt's commit protocol (docs/design.md §9).

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

After EVERY tick the world is checked against the invariants of docs/design.md §9 (see
``Checker``); every write of LATEST is checked as a transition from the one before it.
A final phase removes the faults, restarts a writer (exercising crash recovery and the
staging journal), runs GC until it converges, restores every retained checkpoint, and then
damages the store on purpose (a bit flip in LATEST, a commit record, a manifest, a data
file; LATEST deleted) and checks that every damage is detected. Last, a newer cloudckpt
commits a LATEST in a format this version does not know (``actors/newer``): restore, GC,
repair, a writer and a pin must each refuse it and change nothing.

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

Where things live (one module per role):

- ``profile``: what a seed decides up front (settings, fault rates, weights, content);
- ``world``: ``Simulation``, one seed's world: the scheduler and the baton, virtual time
  and host suspend, the run (actors under faults, then the final phase);
- ``actor``: ``Actor``, one simulated process (a thread that runs while it holds the baton),
  its ``Port`` (its store connection: every call a scheduling point and a chance to
  crash), and ``World``, what the actors need of the world;
- ``plumbing``: ``Recorder`` (shows the checker every applied write), inline transfers;
- ``checker``: ``Checker``, the invariants;
- ``roles``: what the checker and the recorder need of the world and of an actor
  (``Protocol`` s, so that nothing the world builds imports the world back);
- ``actors/``: one module per actor program: ``writer``, ``collector``, ``restorer``,
  ``pinner``, and the final phase's ``finisher``, ``damage`` and ``newer``;
- ``result``: ``SimResult`` and the replay command;
- ``runner``: ``run_seed``, ``run_seeds``, ``summarize``; ``cli``: ``main`` (``__main__``).
"""

# Importable from here as before the package was split; ``x as x`` marks a re-export.
from cloudckpt.testing.simulation.checker import Checker as Checker
from cloudckpt.testing.simulation.cli import main as main
from cloudckpt.testing.simulation.profile import Profile as Profile
from cloudckpt.testing.simulation.result import DEFAULT_STEPS as DEFAULT_STEPS
from cloudckpt.testing.simulation.result import InvariantViolation as InvariantViolation
from cloudckpt.testing.simulation.result import SimResult, replay_command
from cloudckpt.testing.simulation.runner import run_seed, run_seeds
from cloudckpt.testing.simulation.runner import summarize as summarize
from cloudckpt.testing.simulation.world import _T0 as _T0
from cloudckpt.testing.simulation.world import Simulation

__all__ = ["SimResult", "Simulation", "replay_command", "run_seed", "run_seeds"]
