"""The writers (A and B): each a real ``CheckpointManager`` that claims the run with
``resume()`` and saves a stream of checkpoints. When the other writer claims, this one is
a zombie: it keeps saving until it is fenced, tries a couple more saves (each must be
refused), and later restarts as a new process (same or fresh staging directory).

``new_manager`` and ``one_save`` also serve the final phase (``finisher``).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloudckpt.errors import (
    CloudCkptError,
    CommitStateUnknownError,
    ConfigurationError,
    FencedError,
    NeedsRepairError,
)
from cloudckpt.failpoints import SimulatedCrash
from cloudckpt.manager import CheckpointManager
from cloudckpt.stores.base import Store
from cloudckpt.testing.simulation.plumbing import inline_engine, transfer_config

if TYPE_CHECKING:
    from cloudckpt.testing.simulation.actor import Actor, World


def run(actor: Actor) -> None:
    """The program of a writer (A, B): a manager's life, again and again."""
    sim = actor.sim
    staging = sim.new_dir(f"staging-{actor.name}")
    sim.pause(actor, actor.rng.randint(0, 60))
    while not sim.stopping:
        if actor.incarnation and actor.rng.random() < 0.4:
            staging = sim.new_dir(f"staging-{actor.name}")  # a new host
        port = actor.new_incarnation()
        try:
            _life(actor, port, staging)
        except SimulatedCrash:
            sim.result.counters["writer_crashes"] += 1
        if sim.stopping:
            return
        sim.result.counters["writer_restarts"] += 1
        with contextlib.suppress(SimulatedCrash):
            actor.killed = False
            sim.pause(actor, actor.rng.randint(1, 40))


def new_manager(
    sim: World, port: Store, staging: Path, writer: str = "A", **kw: Any
) -> CheckpointManager:
    """A real ``CheckpointManager`` with the seed's settings (``writer``'s rules by metric
    and by time), saving in the calling thread."""
    p = sim.profile
    kw = {**p.retention_options(writer), **kw}
    mgr = CheckpointManager(
        port,
        staging_dir=staging,
        keep_last=p.keep_last,
        keep_every=p.keep_every,
        gc_grace=p.grace,
        auto_gc=False,
        transfer=transfer_config(),
        # Whole files too: a run may mix chunked and whole-file checkpoints.
        chunking=sim.chunking_rng.choice(("tensor", "tensor", "fixed", "off")),
        **kw,
    )
    mgr.queue.synchronous = True
    mgr.engine.close()
    mgr.engine = inline_engine(transfer_config())
    return mgr


def _life(actor: Actor, port: Store, staging: Path) -> None:
    """One process: resume (mostly), then a few saves; returns once fenced."""
    sim = actor.sim
    mgr = new_manager(sim, port, staging, actor.name)
    actor.writer_id = mgr.writer_id
    try:
        actor.op += 1
        step = actor.rng.randint(1, 30)
        if actor.rng.random() < 0.75:
            resumed = _resume(actor, mgr)
            if resumed is None:
                return
            step = resumed
        # else: the first save claims the run (and recovers the staging journal).
        for i in range(actor.rng.randint(1, 10)):
            if sim.stopping:
                break
            actor.op += 1
            key = f"{actor.name}.{actor.incarnation}.{step}.{i}"
            if not one_save(actor, mgr, step, key):
                return  # fenced
            step += actor.rng.choice([1, 1, 2])
            sim.pause(actor, actor.rng.randint(0, 8))
        with contextlib.suppress(CloudCkptError):
            mgr.close()
    finally:
        mgr.staging.close()  # a dead process's flock goes with it


def _resume(actor: Actor, mgr: CheckpointManager) -> int | None:
    """``resume()`` and check what it restored; the next step, or None if it failed."""
    sim = actor.sim
    c = sim.checker
    floor, started = c.ack_floor(), sim.elapsed()
    into = sim.new_dir("resume")
    try:
        res = mgr.resume(into=into)
    except (NeedsRepairError, ConfigurationError) as exc:
        c.fail(f"I10: {actor.name} could not resume: {exc}")
    except CloudCkptError as exc:  # faults: the store kept failing
        sim.result.counters[f"resume_failed:{type(exc).__name__}"] += 1
        return None
    step = 1
    if res is not None:
        sim.checker.check_restore(res, floor, started, f"{actor.name}.resume")
        step = res.step + 1
    shutil.rmtree(into, ignore_errors=True)
    latest = mgr.committer.latest
    if latest is not None and latest.current is not None:
        step = max(step, latest.current.step + 1)
    return step


def one_save(actor: Actor, mgr: CheckpointManager, step: int, key: str) -> bool:
    """One save; False once this writer is fenced (it then acts as a zombie)."""
    sim = actor.sim
    c = sim.checker
    files = sim.profile.content(key)
    try:
        handle = mgr.save(step=step, metadata={"sim": key}, metrics=sim.profile.metrics(key))
        directory = handle.__enter__()
    except FencedError:
        return False
    for n, (name, data) in enumerate(files.items()):
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if sim.faults_on and sim.crash_rng.random() < sim.profile.p_crash_call:
            raise actor.die(f"staging-file-{n}")  # dies inside the with-block
    handle.__exit__(None, None, None)
    try:
        info = handle.result()
    except SimulatedCrash:
        actor.dead = True
        raise
    except FencedError as exc:
        c.failed(key, exc, actor.name)
        sim.result.counters["fenced"] += 1
        # A zombie keeps going for a bit: every further save must be refused.
        for _ in range(actor.rng.randint(0, 2)):
            try:
                mgr.save(step=step + 1, metadata={"sim": key + "z"}).__enter__()
            except FencedError:
                sim.result.counters["zombie_refused"] += 1
            else:
                c.fail(f"I4: fenced {actor.name} could start another save")
        return False
    except CommitStateUnknownError:
        sim.result.counters["save_unknown"] += 1
    except CloudCkptError as exc:
        c.failed(key, exc, actor.name)
        sim.result.counters[f"save_failed:{type(exc).__name__}"] += 1
    else:
        c.acknowledged(info.commit_id, key, actor.name)
        sim.result.counters["acks"] += 1
        if mgr.last_upload is not None:
            sim.result.counters["chunks_reused"] += mgr.last_upload.chunks_reused
            sim.result.counters["chunks_resumed"] += mgr.last_upload.chunks_resumed
    return True
