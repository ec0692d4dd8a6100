"""The pinner: ``admin.pin`` a retained step or a tombstone, or ``admin.unpin`` one; a
definite refusal must have written nothing (I6)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloudckpt import admin
from cloudckpt.errors import CheckpointNotFoundError, CloudCkptError, ConfigurationError
from cloudckpt.failpoints import SimulatedCrash

if TYPE_CHECKING:
    from cloudckpt.testing.simulation.actor import Actor


def run(actor: Actor) -> None:
    """The program of the pinner: ``admin.pin``/``admin.unpin`` of retained steps."""
    sim = actor.sim
    c = sim.checker
    while not sim.stopping:
        port = actor.new_incarnation()
        try:
            while not sim.stopping:
                sim.pause(actor, actor.rng.randint(1, 25))
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
                    sim.result.counters["pin_ops"] += 1
                except (CheckpointNotFoundError, ConfigurationError) as exc:
                    # A definite refusal: nothing of this operation may have landed.
                    if c.op_writes[tag]:
                        c.fail(f"I6: pin/unpin reported {type(exc).__name__} ({exc}) "
                               "but its LATEST write landed")  # fmt: skip
                    sim.result.counters["pin_refused"] += 1
                except CloudCkptError as exc:
                    sim.result.counters[f"pin_failed:{type(exc).__name__}"] += 1
        except SimulatedCrash:
            sim.result.counters["pinner_crashes"] += 1
