"""The restorer: ``restore`` the newest checkpoint (or an older step) while the writers and
GC go on; every result is checked byte for byte (I8), and a failed or crashed restore
must leave nothing in its destination."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from cloudckpt.errors import CheckpointNotFoundError, CorruptionError, StoreError
from cloudckpt.failpoints import SimulatedCrash
from cloudckpt.restore import restore
from cloudckpt.testing.simulation.plumbing import inline_engine, transfer_config

if TYPE_CHECKING:
    from cloudckpt.testing.simulation.actor import Actor, World


def run(actor: Actor) -> None:
    """The program of the restorer: restore the newest checkpoint, now and then an older one."""
    sim = actor.sim
    c = sim.checker
    while not sim.stopping:
        port = actor.new_incarnation()
        engine = inline_engine(transfer_config())
        try:
            while not sim.stopping:
                sim.pause(actor, actor.rng.randint(1, 30))
                actor.op += 1
                step = None
                if c.latest and c.latest.history and actor.rng.random() < 0.3:
                    step = actor.rng.choice(c.latest.history).step
                into = sim.new_dir("restore")
                floor, started = c.ack_floor(), sim.elapsed()
                try:
                    res = restore(port, into, engine, step=step)
                except CheckpointNotFoundError:
                    sim.result.counters["restore_nothing"] += 1
                except CorruptionError as exc:
                    # Slow or not: a checkpoint collected under a slow restore is not
                    # damage (the restore reads LATEST again).
                    c.fail(f"I8: restore found damage where none was injected: {exc}")
                except StoreError as exc:
                    sim.result.counters[f"restore_failed:{type(exc).__name__}"] += 1
                except SimulatedCrash:
                    _check_untouched(sim, into)
                    raise
                else:
                    if step is None:
                        c.check_restore(res, floor, started, actor.name)
                    else:
                        c.check_restore(res, 0, started, actor.name)
                    shutil.rmtree(into, ignore_errors=True)
                    continue
                _check_untouched(sim, into)
        except SimulatedCrash:
            sim.result.counters["restorer_crashes"] += 1


def _check_untouched(sim: World, into: Path) -> None:
    if into.exists() and any(into.iterdir()):
        sim.checker.fail(f"I8: a failed restore left files in {into}")
