"""The garbage collector: ``collect_garbage`` now and then, under faults and crashes.
What it deletes is checked by ``Checker.before_delete`` and ``before_abort`` (I7)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloudckpt.errors import CloudCkptError, NeedsRepairError, StoreError
from cloudckpt.failpoints import SimulatedCrash
from cloudckpt.gc import collect_garbage

if TYPE_CHECKING:
    from cloudckpt.testing.simulation.actor import Actor


def run(actor: Actor) -> None:
    """The program of the garbage collector: ``collect_garbage`` now and then."""
    sim = actor.sim
    while not sim.stopping:
        port = actor.new_incarnation()
        try:
            while not sim.stopping:
                sim.pause(actor, actor.rng.randint(1, 30))
                actor.op += 1
                try:
                    report = collect_garbage(port)
                except (StoreError, NeedsRepairError) as exc:
                    sim.result.counters[f"gc_failed:{type(exc).__name__}"] += 1
                    if isinstance(exc, NeedsRepairError) and sim.checker.latest:
                        sim.checker.fail(f"GC found no readable LATEST: {exc}")
                    continue
                except CloudCkptError as exc:
                    sim.result.counters[f"gc_failed:{type(exc).__name__}"] += 1
                    continue
                sim.result.counters["gc_runs"] += 1
                sim.result.counters["gc_deleted_objects"] += report.deleted_objects
        except SimulatedCrash:
            sim.result.counters["gc_crashes"] += 1
