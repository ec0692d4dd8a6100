"""Guards of the safety rules that had no test, or one (issue 21, item 7).

Each test here is one guard of a rule listed in ``tests/mutants.py``; ``tests/test_mutations.py``
shows that each fails when its rule is broken. The simulation's checker guards the same
rules (docs/reliability.md, "Mutation check").
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

import pytest

from cloudckpt import (
    CheckpointManager,
    FencedError,
    StaleAttemptError,
    attempt_layout,
    digest,
    manifests,
    protocol,
)
from cloudckpt.admin import pin
from cloudckpt.gc import collect_garbage
from cloudckpt.reader import fetch_manifest
from cloudckpt.stores import open_store
from cloudckpt.stores.memory import ManualClock
from cloudckpt.testing.faults import Callback, FaultInjectingStore, Rule, flip_bit


def _store(request, backend: str, **options):
    target = request.getfixturevalue(f"{backend}_target")
    store = open_store(target.url, {**target.storage_options, **options})
    request.addfinalizer(store.close)
    return store


def _save(mgr: CheckpointManager, step: int, files: dict[str, bytes]):
    handle = mgr.save(step=step)
    with handle as d:
        for name, data in files.items():
            (d / name).write_bytes(data)
    return handle


def _latest(store) -> protocol.Latest:
    return protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])


def _read(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


def _own_data_key(store, record: protocol.CheckpointRecord) -> str:
    """A data object (file or chunk) the checkpoint stored under its own prefix."""
    manifest = fetch_manifest(store, record)
    for entry in manifest.files:
        if entry.chunks is None:
            return record.ckpt + attempt_layout.FILES_DIR + entry.path
        for chunk in entry.chunks:
            if chunk.owner == record.ckpt:
                return chunk.key
    raise AssertionError(f"step {record.step} stored nothing of its own")


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_fallback_never_restores_an_uncommitted_attempt(request, backend, tmp_path):
    """A fenced writer leaves step 3 complete (files and manifest) but uncommitted; the
    current step 2 is damaged. The fallback goes to step 1, the newest COMMITTED
    checkpoint that verifies, never to the newer complete attempt."""
    store = _store(request, backend)
    zombie = CheckpointManager(store, staging_dir=tmp_path / "a", auto_gc=False)
    for step in (1, 2):
        _save(zombie, step, {"f": b"%d" % step}).result()
    successor = CheckpointManager(store, staging_dir=tmp_path / "b", auto_gc=False)
    assert successor.resume(tmp_path / "r0").step == 2  # fences the zombie
    with pytest.raises(FencedError):
        _save(zombie, 3, {"f": b"3"}).result()
    manifests = [o.key for o in store.list("ckpt/000000000003-") if o.key.endswith("MANIFEST.json")]
    assert len(manifests) == 1  # the uncommitted attempt is complete
    latest = _latest(store)
    flip_bit(store, _own_data_key(store, latest.current))  # step 2 is damaged

    res = successor.restore(tmp_path / "r")
    assert res.step == 1 and _read(res.path) == {"f": b"1"}
    assert res.commit_id in {r.commit_id for r in latest.retained()}
    assert [s.step for s in res.skipped] == [2]
    zombie.close()
    successor.close()


def test_gc_keeps_a_chunk_named_only_by_a_pending_tombstone(memory_target, tmp_path):
    """Step 1 uploads the chunk of ``base``; step 2 names it; step 3 does not. When step 1's
    tombstone expires, the chunk is named only by step 2's pending tombstone, which a pin
    may still bring back: GC must keep it, and the pinned step 2 must restore."""
    clock = ManualClock()
    store = open_store(memory_target.url, {"clock": clock})
    mgr = CheckpointManager(
        store, staging_dir=tmp_path / "s", keep_last=1, gc_grace=100, auto_gc=False
    )
    base = b"frozen base weights " * 500
    _save(mgr, 1, {"base": base, "head": b"1"}).result()
    _save(mgr, 2, {"base": base, "head": b"2"}).result()  # step 1 dropped now
    clock.advance(60)
    _save(mgr, 3, {"base": b"a new base " * 500, "head": b"3"}).result()  # step 2 dropped
    clock.advance(60)  # step 1's tombstone is past grace, step 2's is not
    step2 = next(t.record for t in _latest(store).tombstones if t.record.step == 2)
    (shared,) = [
        c for f in fetch_manifest(store, step2).files for c in f.chunks if f.path == "base"
    ]
    assert shared.owner != step2.ckpt  # step 2 names step 1's chunk

    report = collect_garbage(store)
    assert [s for s, _ in report.deleted_checkpoints] == [1]
    assert store.exists(shared.key)
    pin(store, 2, "keep")
    res = mgr.restore(tmp_path / "r", step=2)
    assert _read(res.path) == {"base": base, "head": b"2"}
    mgr.close()


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_a_resealed_manifest_is_refused(request, backend, tmp_path):
    """Step 2's file and manifest are rewritten consistently (the manifest re-sealed, so it
    parses and its own digest matches): only the digest LATEST recorded tells. The restore
    skips step 2 and never returns the forged bytes."""
    store = _store(request, backend)
    # keep_local=0: no local copy, so the restore reads the store (a kept copy would be
    # proven against LATEST's digest and restore the genuine step 2 without reading it).
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False, keep_local=0)
    for step in (1, 2):
        _save(mgr, step, {"f": b"genuine %d" % step}).result()
    current = _latest(store).current
    manifest = fetch_manifest(store, current)
    evil = b"forged weights"
    assert [e.path for e in manifest.files] == ["f"]
    sha = hashlib.sha256(evil).hexdigest()
    ref = manifests.ChunkRef(current.ckpt, sha, len(evil))
    forged = manifests.FileEntry("f", len(evil), digest.tree_digest(evil), (ref,))
    store.put(ref.key, evil)
    store.put(current.manifest_key, dataclasses.replace(manifest, files=(forged,)).to_bytes())

    res = mgr.restore(tmp_path / "r")
    assert res.step == 1 and _read(res.path) == {"f": b"genuine 1"}
    assert [s.step for s in res.skipped] == [2]
    assert "LATEST recorded" in res.skipped[0].reason
    mgr.close()


def test_gc_sweeps_latest_before_deleting_an_orphan_on_s3(s3_target, tmp_path):
    """On a real S3 server: a commit delayed past the grace period (its compare-and-swap
    held in flight while GC runs from another client) fails, because GC wrote LATEST
    (gc-sweep) before it deleted the attempt as an orphan; the writer re-reads and is
    refused as stale. Without the sweep the held write would still match and commit a
    checkpoint whose files GC had just deleted."""
    grace = 5  # the shortest a whole-second store clock allows with a little upload time
    store = FaultInjectingStore(open_store(s3_target.url, s3_target.storage_options))
    mgr = CheckpointManager(
        store, staging_dir=tmp_path / "s", gc_grace=grace, auto_gc=False, chunking="off"
    )
    _save(mgr, 1, {"f": b"one"}).result()
    swept: list[str] = []

    def hold_then_gc() -> None:
        time.sleep(grace + 2.5)  # past grace on the store's clock
        swept.extend(collect_garbage(store.inner).deleted_orphans)

    rule = Rule(Callback(before=hold_then_gc), ops={"put"}, key="LATEST", modes={"update"})
    store.add(rule)
    with pytest.raises(StaleAttemptError):
        _save(mgr, 2, {"f": b"two"}).result()
    assert rule.fired == 1 and len(swept) == 1
    latest = _latest(store.inner)
    assert latest.current.step == 1 and latest.op == "gc-sweep"
    mgr.close()


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_a_damaged_whole_file_falls_back(request, backend, tmp_path):
    """A file stored whole (chunking off) whose bytes no longer match its recorded digest
    (one bit flipped at rest, same size, so the listing of sizes passes) is damage: the
    restore falls back to the previous checkpoint and reports why."""
    store = _store(request, backend)
    mgr = CheckpointManager(
        store, staging_dir=tmp_path / "s", auto_gc=False, chunking="off", keep_local=0
    )
    for step in (1, 2):
        _save(mgr, step, {"f": b"%d" % step * 1000}).result()
    current = _latest(store).current
    flip_bit(store, current.ckpt + attempt_layout.FILES_DIR + "f", seed=3)
    res = mgr.restore(tmp_path / "r")
    assert res.step == 1 and _read(res.path) == {"f": b"1" * 1000}
    assert [s.step for s in res.skipped] == [2] and "digest" in res.skipped[0].reason
    mgr.close()
