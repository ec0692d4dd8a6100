"""Damage on purpose (I9), in the final phase with the checks paused: every single bit
flip (in LATEST, the newest commit record, the current manifest, a current data file or
chunk) is detected; consistent forgeries (a file rewritten and its manifest re-sealed, and
one re-sealed up to LATEST) are never restored; without LATEST, readers fall back to the
commit records and GC refuses."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import random
from typing import TYPE_CHECKING

from cloudckpt import attempt_layout, digest, manifests, protocol
from cloudckpt.errors import CloudCkptError, CorruptionError, NeedsRepairError
from cloudckpt.gc import collect_garbage
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.reader import fetch_manifest
from cloudckpt.restore import restore
from cloudckpt.stores.base import Store
from cloudckpt.testing.faults import flip_bit
from cloudckpt.transfer import TransferEngine

if TYPE_CHECKING:
    from cloudckpt.testing.simulation.actor import Actor, World


def run(actor: Actor, port: Store, engine: TransferEngine) -> None:
    """Damage the store in every way above, one at a time, restoring it after each."""
    sim = actor.sim
    latest = sim.checker.latest
    current = latest.current if latest else None
    if current is None:  # the finisher's save committed: there is one
        sim.checker.fail("I10: no current checkpoint to damage after the final save")
    manifest = manifests.parse_manifest(sim.memory.get(current.manifest_key)[0], current)
    _flip_bits(sim, actor.rng, port, engine, current, manifest)
    _forge(sim, actor.rng, port, engine, current, manifest)
    _forge_with_latest(sim, actor.rng, port, engine, current, manifest)
    _delete_latest(actor, port, engine)


def _flip_bits(
    sim: World,
    rng: random.Random,
    port: Store,
    engine: TransferEngine,
    current: CheckpointRecord,
    manifest: manifests.Manifest,
) -> None:
    """One bit flipped in LATEST, the newest commit record, the current manifest and one
    current data file (or chunk): each is detected."""
    c, raw = sim.checker, sim.memory
    targets = [protocol.LATEST_KEY, current.manifest_key]
    targets += [k.key for k in raw.list(protocol.COMMITS_PREFIX)][-1:]
    files = [e for e in manifest.files if e.size]
    if files:
        entry = rng.choice(files)
        if entry.chunks is not None:
            targets.append(rng.choice(entry.chunks).key)
            sim.result.counters["chunk_flips"] += 1
        else:
            targets.append(current.ckpt + attempt_layout.FILES_DIR + entry.path)
    for key in targets:
        original, _ = raw.get(key)
        bit = flip_bit(raw, key, seed=rng.getrandbits(32))
        sim.result.counters["bit_flips"] += 1
        detected = _detect(sim, key, current, port, engine)
        raw.put(key, original)
        if not detected:
            c.fail(f"I9: a flip of bit {bit} of {key} went unnoticed")
        sim.result.counters["bit_flips_detected"] += 1


def _delete_latest(actor: Actor, port: Store, engine: TransferEngine) -> None:
    """LATEST deleted: readers fall back to the commit records, GC refuses."""
    sim = actor.sim
    c, raw = sim.checker, sim.memory
    original, _ = raw.get(protocol.LATEST_KEY)
    raw.delete(protocol.LATEST_KEY)
    into = sim.new_dir("damage")
    res = restore(port, into, engine)
    if not res.from_commit_records:
        c.fail("I9: restore without LATEST did not say it used the commit records")
    c.check_restore(res, 0, sim.elapsed(), "restore without LATEST")
    try:
        with actor.doing("gc"):
            collect_garbage(port)
    except NeedsRepairError:
        pass
    else:
        c.fail("I9: GC ran without LATEST")
    raw.put(protocol.LATEST_KEY, original)


def _forge(
    sim: World,
    rng: random.Random,
    port: Store,
    engine: TransferEngine,
    current: CheckpointRecord,
    manifest: manifests.Manifest,
) -> None:
    """A consistent forgery (I9): one file of the current checkpoint rewritten and its
    manifest re-sealed to match, so only the digest LATEST recorded can tell. The
    manifest must be refused, and no restore may return the forged bytes."""
    c, raw = sim.checker, sim.memory
    entry = rng.choice(manifest.files)
    evil = b"forged " + rng.randbytes(rng.randint(1, 64))
    if entry.chunks is None:
        key = current.ckpt + attempt_layout.FILES_DIR + entry.path
        tree = digest.tree_digest(evil, algorithm=manifest.algorithm)
        forged = manifests.FileEntry(entry.path, len(evil), tree, algorithm=manifest.algorithm)
    else:
        sha = digest.hexleaf(evil, manifest.algorithm)
        ref = manifests.ChunkRef(current.ckpt, sha, len(evil), manifest.algorithm)
        key = ref.key
        tree = digest.tree_digest(evil, manifest.chunk_size, manifest.algorithm)
        forged = manifests.FileEntry(
            entry.path, len(evil), tree, (ref,), algorithm=manifest.algorithm
        )
    files = tuple(forged if e is entry else e for e in manifest.files)
    saved = {k: raw.get(k)[0] for k in (key, current.manifest_key) if raw.exists(k)}
    raw.put(key, evil)
    raw.put(current.manifest_key, dataclasses.replace(manifest, files=files).to_bytes())
    sim.result.counters["forgeries"] += 1
    try:
        if not _detect(sim, current.manifest_key, current, port, engine):
            c.fail(f"I9: a re-sealed manifest of step {current.step} was accepted")
        into = sim.new_dir("forgery")
        with contextlib.suppress(CorruptionError):
            res = restore(port, into, engine, step=current.step)
            c.check_restore(res, 0, sim.elapsed(), "restore of a forgery", damage=True)
        sim.result.counters["forgeries_detected"] += 1
    finally:
        for k in (key, current.manifest_key):
            if k in saved:
                raw.put(k, saved[k])
            else:
                raw.delete(k)


def _forge_with_latest(
    sim: World,
    rng: random.Random,
    port: Store,
    engine: TransferEngine,
    current: CheckpointRecord,
    manifest: manifests.Manifest,
) -> None:
    """A forgery consistent up to LATEST (I9): one file's content replaced by other
    intact data (another chunk, or other bytes for a whole file), its size changed to
    match, the manifest re-sealed and LATEST's record of it re-sealed too. Every chunk
    and every seal verifies; only the file's recorded digest can tell. No restore may
    return the forged bytes."""
    c, raw = sim.checker, sim.memory
    entry = rng.choice(manifest.files)
    saved: dict[str, bytes] = {protocol.LATEST_KEY: raw.get(protocol.LATEST_KEY)[0]}
    if entry.chunks is None:
        key = current.ckpt + attempt_layout.FILES_DIR + entry.path
        other = raw.get(key)[0] + b"!"
        saved[key] = raw.get(key)[0]
        raw.put(key, other)
        forged = manifests.FileEntry(
            entry.path, len(other), entry.digest, algorithm=manifest.algorithm
        )
    else:
        mine = {ch.sha256 for ch in entry.chunks}  # other bytes, not another copy
        others = [
            o
            for o in raw.list("ckpt/")
            if "/chunks/" in o.key
            and o.key[-64:] not in mine
            and (
                attempt_layout.parse_chunk_name(o.key.split(attempt_layout.CHUNKS_DIR)[1]) or ("",)
            )[0]
            == manifest.algorithm
        ]
        if not others:
            return
        pick = rng.choice(others)
        owner, name = pick.key.split(attempt_layout.CHUNKS_DIR)
        sha = name[-64:]
        ref = manifests.ChunkRef(owner, sha, pick.size, manifest.algorithm)
        forged = manifests.FileEntry(
            entry.path, pick.size, entry.digest, (ref,), algorithm=manifest.algorithm
        )
    files = tuple(forged if e is entry else e for e in manifest.files)
    body = dataclasses.replace(manifest, files=files).to_bytes()
    saved[current.manifest_key] = raw.get(current.manifest_key)[0]
    raw.put(current.manifest_key, body)
    latest = protocol.parse_latest(saved[protocol.LATEST_KEY])
    record = dataclasses.replace(
        current, manifest_sha256=hashlib.sha256(body).hexdigest(), manifest_size=len(body)
    )
    raw.put(protocol.LATEST_KEY, dataclasses.replace(latest, current=record).to_bytes())
    sim.result.counters["consistent_forgeries"] += 1
    try:
        into = sim.new_dir("forgery")
        try:
            res = restore(port, into, engine, step=current.step)
        except CorruptionError:
            pass
        else:
            if res.commit_id == current.commit_id:
                c.fail(f"I9: a consistent forgery of {entry.path} (step {current.step}) "
                       "was restored")  # fmt: skip
            c.check_restore(res, 0, sim.elapsed(), "restore of a forgery", damage=True)
        sim.result.counters["consistent_forgeries_detected"] += 1
    finally:
        for k, v in saved.items():
            raw.put(k, v)


def _detect(
    sim: World, key: str, current: CheckpointRecord, port: Store, engine: TransferEngine
) -> bool:
    """Whether the damage to ``key`` is noticed by the reader that must notice it."""
    if key == protocol.LATEST_KEY or key.startswith(protocol.COMMITS_PREFIX):
        try:
            protocol.parse_latest(sim.memory.get(key)[0])
        except CloudCkptError:
            pass
        else:
            return False
        if key != protocol.LATEST_KEY:
            return True
        into = sim.new_dir("damage")
        res = restore(port, into, engine)
        sim.checker.check_restore(res, 0, sim.elapsed(), "restore with a damaged LATEST")
        return res.from_commit_records
    if key == current.manifest_key:
        try:
            fetch_manifest(port, current)
        except CorruptionError:
            return True
        return False
    into = sim.new_dir("damage")
    try:
        res = restore(port, into, engine, step=current.step)
    except CorruptionError:
        return not (into.exists() and any(into.iterdir()))
    # Another retained checkpoint of the same step may stand in, with a report.
    sim.checker.check_restore(res, 0, sim.elapsed(), "restore of a damaged step", damage=True)
    return current.commit_id in {s.commit_id for s in res.skipped}
