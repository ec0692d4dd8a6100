"""The final phase (I9, I10), run alone once the faults are off: recovery converges (a
writer restarts, often on a crashed writer's staging directory, resumes and saves), GC
converges, every retained checkpoint restores to its exact bytes, every damage ``damage``
injects is detected, and a LATEST a newer version commits (``newer``) is refused by every
program of this version, which changes nothing (I11)."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

from cloudckpt.errors import CloudCkptError
from cloudckpt.gc import collect_garbage
from cloudckpt.protocol import Latest
from cloudckpt.restore import restore
from cloudckpt.stores.base import Store
from cloudckpt.testing.simulation.actors import damage, newer, writer
from cloudckpt.testing.simulation.plumbing import inline_engine, prefix_of, transfer_config
from cloudckpt.transfer import TransferEngine

if TYPE_CHECKING:
    from cloudckpt.testing.simulation.actor import Actor, World


def run(actor: Actor) -> None:
    """No more faults: recovery converges, GC converges, every retained checkpoint
    restores, and every injected damage is detected (I9, I10)."""
    sim = actor.sim
    port = actor.new_incarnation()
    engine = inline_engine(transfer_config())
    _restart_and_save(actor, port)
    with actor.doing("gc"):
        latest = _gc_converges(sim, port)
    _every_retained_restores(sim, latest, port, engine)
    # Damage: every single bit flip is detected (I9); a missing LATEST falls back.
    sim.checks_on = False
    damage.run(actor, port, engine)
    # A newer version takes over: nobody restores past it, rolls it back or collects (I11).
    newer.run(actor, port, engine)
    sim.checks_on = True


def _restart_and_save(actor: Actor, port: Store) -> None:
    """A writer restarts (on a crashed writer's staging dir: journal recovery), resumes,
    and its next save commits."""
    sim = actor.sim
    c = sim.checker
    dirs = sorted(sim.work.glob("staging-*"))
    staging = actor.rng.choice(dirs) if dirs and actor.rng.random() < 0.7 else sim.new_dir("staging-final")  # fmt: skip
    mgr = writer.new_manager(sim, port, staging)
    actor.writer_id = mgr.writer_id
    floor, started = c.ack_floor(), sim.elapsed()
    into = sim.new_dir("final-resume")
    try:
        res = mgr.resume(into=into)
    except CloudCkptError as exc:
        c.fail(f"I10: resume after the faults stopped failed: {type(exc).__name__}: {exc}")
    if res is not None:
        c.check_restore(res, floor, started, "final resume")
    top = c.latest.current.step if c.latest and c.latest.current else 0
    key = f"final.{top + 1}"
    if not writer.one_save(actor, mgr, top + 1, key) or key not in c.acked.values():
        c.fail("I10: a save after the faults stopped did not commit")
    mgr.close()


def _gc_converges(sim: World, port: Store) -> Latest:
    """After enough time nothing unreferenced is left, and a further GC deletes nothing.
    Returns the LATEST that GC converged to."""
    c = sim.checker
    for _ in range(4):
        sim.clock.advance(sim.profile.grace + 1)
        collect_garbage(port)
    latest = c.latest
    if latest is None:  # the final save committed: there is one
        c.fail("I10: no LATEST after GC converged")
    if latest.tombstones:
        c.fail(f"I10: tombstones left after GC converged: {latest.tombstones}")
    refs = latest.referenced_prefixes()
    named = c.named_chunks(latest)
    # (an object outside any attempt prefix is reported by its key)
    listed = sim.memory.list("ckpt/")
    leftovers = {prefix_of(o.key) or o.key for o in listed if o.key not in named} - refs
    if leftovers:
        c.fail(f"I10: unreferenced attempts left after GC converged: {sorted(leftovers)}")
    if sim.memory.list_multipart(""):
        c.fail("I10: incomplete uploads left after GC converged")
    if collect_garbage(port).deleted_objects:
        c.fail("I10: a second converged GC still deleted something")
    return latest


def _every_retained_restores(
    sim: World, latest: Latest, port: Store, engine: TransferEngine
) -> None:
    """Every retained checkpoint of ``latest`` restores to its exact bytes."""
    for rec in latest.retained():
        into = sim.new_dir("final-restore")
        res = restore(port, into, engine, step=rec.step)
        sim.checker.check_restore(res, 0, sim.elapsed(), f"final restore of step {rec.step}")
        shutil.rmtree(into, ignore_errors=True)
