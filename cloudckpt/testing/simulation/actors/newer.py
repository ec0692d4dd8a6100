"""A newer cloudckpt (I11, issue 28 item 1), in the final phase with the checks paused: it
commits the next LATEST in a format this version does not know (``cloudckpt.latest/99``,
and its commit record), as a newer version that took over the run would. Then every
program of this version meets it: restore (also with LATEST gone, so that the newest
commit record is the newer one), GC (past the grace period), repair (also forced), a
writer's claim and a pin. Each must refuse (``UnknownFormatError``) and change nothing: no
reader restores an older step past it, nobody rolls it back, collects by it or writes over
it (the checker's I11: ``Checker.newer_seq`` is set while the newer LATEST is there, so a
LATEST write or a deletion by anyone is a violation where it happens). Then the run is put
back as it was."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cloudckpt import admin, canonical, protocol
from cloudckpt.errors import UnknownFormatError
from cloudckpt.gc import collect_garbage
from cloudckpt.repair import repair
from cloudckpt.restore import restore
from cloudckpt.stores.base import CREATE, Store
from cloudckpt.testing.simulation.actors import writer
from cloudckpt.testing.simulation.result import InvariantViolation
from cloudckpt.transfer import TransferEngine

if TYPE_CHECKING:
    from cloudckpt.testing.simulation.actor import Actor, World

NEWER_FORMAT = "cloudckpt.latest/99"
NEWER_VERSION = "99.0.0"


def newer_latest(base: protocol.Latest) -> bytes:
    """The LATEST a newer version commits after ``base``: the next seq, a format this
    version does not know, sealed (it passes its self-check: not damage)."""
    body = json.loads(base.to_bytes())
    body.update(
        format=NEWER_FORMAT,
        written_by=NEWER_VERSION,
        seq=base.seq + 1,
        parent_seq=base.seq,
        op="commit",
        nonce=secrets.token_hex(8),
    )
    return canonical.seal(body)


def run(actor: Actor, port: Store, engine: TransferEngine) -> None:
    """The newer version commits; every program of this version must refuse it."""
    sim = actor.sim
    c, raw = sim.checker, sim.memory
    base = c.latest
    if base is None:  # the finisher's save committed: there is one
        c.fail("I11: no LATEST for a newer version to take over")
    original = raw.get(protocol.LATEST_KEY)[0]
    body = newer_latest(base)
    record_key = protocol.commit_record_key(base.seq + 1)
    raw.put(protocol.LATEST_KEY, body)
    raw.put(record_key, body, mode=CREATE)
    c.newer_seq = base.seq + 1
    sim.clock.advance(sim.profile.grace * 2 + 1)  # everything old enough for GC
    try:
        _meet(sim, "a restore", lambda: _restore(sim, port, engine))
        with actor.doing("gc"):
            _meet(sim, "GC", lambda: collect_garbage(port))
        _meet(sim, "repair", lambda: repair(port))
        _meet(sim, "repair --force", lambda: repair(port, force=True))
        _meet(sim, "a writer's claim", lambda: _claim(actor, port))
        if base.current is not None:
            _meet(sim, "pin", lambda: admin.pin(port, base.current.step, "newer"))  # type: ignore[union-attr]
        # Without LATEST, the newest commit record is the newer version's: a reader
        # must stop at it, not fall back to the record before it; repair must refuse.
        raw.delete(protocol.LATEST_KEY)
        _meet(sim, "a restore without LATEST", lambda: _restore(sim, port, engine))
        _meet(sim, "repair without LATEST", lambda: repair(port))
    finally:
        c.newer_seq = None
        raw.put(protocol.LATEST_KEY, original)
        raw.delete(record_key)


def _restore(sim: World, port: Store, engine: TransferEngine) -> Any:
    into = sim.new_dir("newer")
    try:
        res = restore(port, into, engine)
    except UnknownFormatError:
        if into.exists() and any(into.iterdir()):
            sim.checker.fail(f"I11: a restore refused by a newer format left files in {into}")
        raise
    sim.checker.restored_past_newer(res, "a restore")


def _claim(actor: Actor, port: Store) -> None:
    mgr = writer.new_manager(actor.sim, port, actor.sim.new_dir("staging-newer"))
    try:
        mgr.resume(into=actor.sim.new_dir("newer-resume"))
    finally:
        mgr.close()


def _meet(sim: World, who: str, call: Callable[[], Any]) -> None:
    """``call`` must raise UnknownFormatError naming the newer version, and change nothing
    under the run."""
    c, raw = sim.checker, sim.memory
    before = {o.key: raw.get(o.key)[0] for o in raw.list()}
    try:
        call()
    except InvariantViolation:
        raise  # recorded where it was detected
    except UnknownFormatError as exc:
        if exc.written_by != NEWER_VERSION:
            c.fail(f"I11: {who} refused a newer format without naming its writer: {exc}")
        sim.result.counters["newer_format_refused"] += 1
    except Exception as exc:
        c.fail(f"I11: {who} met a newer format and raised {type(exc).__name__}: {exc}")
    else:
        c.fail(f"I11: {who} went on over a LATEST a newer version wrote")
    after = {o.key: raw.get(o.key)[0] for o in raw.list()}
    if after != before:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        c.fail(f"I11: {who} changed a run a newer version wrote: {changed[:5]}")
