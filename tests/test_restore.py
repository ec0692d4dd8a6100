"""Restore: every file checked against its recorded digest, whatever path brought its bytes
(whole files, chunks, multi-rank); and a restore slower than the grace period, whose
checkpoint was dropped and collected under it, reads LATEST again and restores the current
checkpoint instead of reporting damage.

The hostile manifests here are consistent: the manifest is resealed and LATEST records its
new size and digest, so only the file digests can tell (``verify`` without ``--read-data``
passes them).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from cloudckpt import CheckpointManager, CheckpointNotFoundError, protocol
from cloudckpt.chunks import MIN_PIECE
from cloudckpt.distributed import DistributedCheckpointManager
from cloudckpt.gc import collect_garbage
from cloudckpt.restore import MAX_LATEST_REREADS, fetch_manifest, restore
from cloudckpt.stores import open_store
from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket
from cloudckpt.testing.faults import Callback, FaultInjectingStore, Rule
from cloudckpt.transfer import TransferEngine
from cloudckpt.verify import verify_run

MiB = 1024 * 1024


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _save(mgr: CheckpointManager, step: int, files: dict[str, bytes]) -> None:
    handle = mgr.save(step)
    with handle as d:
        for rel, data in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)
    handle.result()


def _safetensors(tensors: dict[str, bytes]) -> bytes:
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {
            "dtype": "U8",
            "shape": [len(data)],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())


def _rewrite_current_manifest(store, edit: Callable[[dict], None]) -> None:
    """Edit the current checkpoint's manifest as a hostile bucket writer could, keeping
    everything consistent: the manifest is resealed and LATEST records its new digest."""
    latest = json.loads(store.get(protocol.LATEST_KEY)[0])
    record = latest["current"]
    key = record["ckpt"] + protocol.MANIFEST_NAME
    body = json.loads(store.get(key)[0])
    edit(body)
    manifest = protocol._sealed(body)
    store.put(key, manifest)
    latest["current"] = {
        **record,
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        "manifest_size": len(manifest),
    }
    store.put(protocol.LATEST_KEY, protocol._sealed(latest))


def _by_path(body: dict) -> dict[str, dict]:
    return {f["path"]: f for f in body["files"]}


def _swap_chunks_of_two_files(body: dict) -> None:
    a, b = _by_path(body)["a.bin"], _by_path(body)["b.bin"]
    a["chunks"], b["chunks"] = b["chunks"], a["chunks"]


def _swap_two_leaves(body: dict) -> None:
    chunks = _by_path(body)["big.bin"]["chunks"]
    assert [c[2] for c in chunks] == [8 * MiB, 8 * MiB]  # two whole leaves
    chunks.reverse()


def _swap_two_tensors_in_one_leaf(body: dict) -> None:
    chunks = _by_path(body)["model.safetensors"]["chunks"]
    # header, tensor x, tensor y: all within the first leaf
    assert len(chunks) == 3 and sum(c[2] for c in chunks) < 8 * MiB
    chunks[1], chunks[2] = chunks[2], chunks[1]


def _swap_digests_of_two_whole_files(body: dict) -> None:
    a, b = _by_path(body)["a.bin"], _by_path(body)["b.bin"]
    assert "chunks" not in a and a["size"] == b["size"]
    a["digest"], b["digest"] = b["digest"], a["digest"]


def _files(case: str, rng: random.Random) -> dict[str, bytes]:
    if case == "two whole leaves swapped":
        return {"big.bin": rng.randbytes(16 * MiB)}
    if case == "two chunks inside one leaf swapped":
        x, y = rng.randbytes(MIN_PIECE), rng.randbytes(MIN_PIECE + 4096)
        return {"model.safetensors": _safetensors({"x": x, "y": y})}
    return {"a.bin": rng.randbytes(3000), "b.bin": rng.randbytes(3000)}


WRONG_ORDER = {
    "chunks of two files swapped": ("tensor", _swap_chunks_of_two_files),
    "two whole leaves swapped": ("tensor", _swap_two_leaves),
    "two chunks inside one leaf swapped": ("tensor", _swap_two_tensors_in_one_leaf),
    "whole files' digests swapped": ("off", _swap_digests_of_two_whole_files),
}


@pytest.mark.parametrize("backend", ["memory", "s3"])
@pytest.mark.parametrize("case", sorted(WRONG_ORDER))
def test_valid_chunks_in_the_wrong_order_never_restore(request, backend, case, tmp_path):
    """Every chunk (every object) is intact and the manifest verifies against LATEST, but
    the bytes it assembles are not the files it records: the restore refuses the
    checkpoint and falls back, through every reader."""
    target = request.getfixturevalue(f"{backend}_target")
    store = open_store(target.url, target.storage_options)
    chunking, edit = WRONG_ORDER[case]
    rng = random.Random(case)
    good = {"a.bin": b"step one"}
    with CheckpointManager(store, staging_dir=tmp_path / "s", chunking=chunking) as mgr:
        _save(mgr, 1, good)
        _save(mgr, 2, _files(case, rng))
    _rewrite_current_manifest(store, edit)
    assert verify_run(store).ok  # consistent: only the file digests can tell
    assert not verify_run(store, read_data=True).ok

    with TransferEngine() as engine:
        res = restore(store, tmp_path / "out", engine)
    assert res.step == 1 and _tree(tmp_path / "out") == good
    assert [s.step for s in res.skipped] == [2]
    assert "does not match its digest" in res.skipped[0].reason
    assert not res.skipped[0].dropped
    assert not list(tmp_path.glob(".out.cloudckpt-*"))

    if backend == "memory":  # the multi-rank reader (world size 1) shares the check
        dist = DistributedCheckpointManager(store, staging_dir=tmp_path / "d", timeout=30)
        try:
            got = dist.restore(tmp_path / "dist")
        finally:
            dist.close()
        assert got.step == 1 and [s.step for s in got.skipped] == [2]
        assert _tree(tmp_path / "dist") == good
    store.close()


# --- a checkpoint dropped and collected while it is restored ----------------------------


@pytest.fixture
def mem():
    clock = ManualClock()
    name = f"restore-{random.getrandbits(32):08x}"
    yield MemoryStore(name, "run", clock=clock), clock
    drop_memory_bucket(name)


def _content(step: int) -> dict[str, bytes]:
    """Different bytes per step: no chunk is shared, so GC deletes a dropped step's."""
    return {"model.bin": random.Random(step).randbytes(20_000), "step.txt": b"%d" % step}


class _Trainer:
    """A writer that keeps training while a restore runs: each ``step()`` commits the next
    checkpoint (retention drops the previous one), lets the grace period pass on the store's
    clock, and runs GC, which deletes the dropped checkpoint."""

    def __init__(
        self,
        store,
        clock: ManualClock,
        tmp_path: Path,
        content: Callable[[int], dict[str, bytes]] = _content,
    ) -> None:
        self.store, self.clock, self.content = store, clock, content
        self.mgr = CheckpointManager(
            store, staging_dir=tmp_path / "trainer", keep_last=1, gc_grace=60, auto_gc=False
        )
        self.mgr.resume(tmp_path / "nothing")
        self.last = 0
        self.collected: list[int] = []

    def step(self) -> None:
        self.last += 1
        _save(self.mgr, self.last, self.content(self.last))
        self.clock.advance(120)
        report = collect_garbage(self.store)
        self.collected += [step for step, _ in report.deleted_checkpoints]


def _under_gc(store, trainer: _Trainer, key: str, times: int | None = 1):
    """The store as a slow reader sees it: ``trainer.step()`` runs just before it reads an
    object matching ``key`` (before the read, so that read already finds it gone)."""
    faulty = FaultInjectingStore(store)
    rule = faulty.add(Rule(Callback(before=trainer.step), ops={"get_range"}, key=key, times=times))
    return faulty, rule


@pytest.mark.parametrize("when", ["manifest", "chunk"])
def test_a_checkpoint_collected_under_a_slow_restore_restores_the_current_one(mem, tmp_path, when):
    store, clock = mem
    trainer = _Trainer(store, clock, tmp_path)
    trainer.step()
    trainer.step()  # step 2 is current; step 1 was dropped and collected
    key = f"ckpt/*/{protocol.MANIFEST_NAME}" if when == "manifest" else "ckpt/*/chunks/*"
    faulty, rule = _under_gc(store, trainer, key)
    with TransferEngine() as engine:
        res = restore(faulty, tmp_path / "out", engine)
    assert rule.fired == 1 and trainer.collected == [1, 2]  # step 2 went while being read
    assert res.step == 3 and _tree(tmp_path / "out") == _content(3)
    (skip,) = res.skipped
    assert skip.step == 2 and skip.dropped
    assert "dropped by retention" in skip.reason and "missing" in skip.reason
    assert not list(tmp_path.glob(".out.cloudckpt-*"))
    trainer.mgr.close()


def test_a_requested_step_collected_under_the_restore_is_not_found(mem, tmp_path):
    store, clock = mem
    trainer = _Trainer(store, clock, tmp_path)
    trainer.step()
    trainer.step()
    faulty, rule = _under_gc(store, trainer, "ckpt/*/chunks/*")
    with TransferEngine() as engine, pytest.raises(CheckpointNotFoundError) as err:
        restore(faulty, tmp_path / "out", engine, step=2)
    assert rule.fired == 1 and 2 in trainer.collected
    assert "no longer retains step 2" in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.cloudckpt-*"))
    trainer.mgr.close()


def test_reading_latest_again_is_bounded(mem, tmp_path):
    """Every checkpoint is collected under the restore: it gives up after
    MAX_LATEST_REREADS fresh reads, saying the restore is slower than the grace period."""
    store, clock = mem
    # One chunk per checkpoint: each checkpoint tried is read (and collected) once.
    trainer = _Trainer(store, clock, tmp_path, lambda step: {"model.bin": b"%d" % step})
    trainer.step()
    faulty, rule = _under_gc(store, trainer, "ckpt/*/chunks/*", times=None)
    with TransferEngine() as engine, pytest.raises(CheckpointNotFoundError) as err:
        restore(faulty, tmp_path / "out", engine)
    assert rule.fired == MAX_LATEST_REREADS + 1
    assert "grace period (60s)" in str(err.value) and "gc_grace" in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.cloudckpt-*"))
    trainer.mgr.close()


def test_damage_in_a_checkpoint_still_retained_still_falls_back(mem, tmp_path):
    """Reading LATEST again changes nothing for real damage: the checkpoint is still
    retained, so the restore falls back to the older one as before."""
    store, _ = mem
    with CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False) as mgr:
        mgr.resume(tmp_path / "nothing")
        _save(mgr, 1, _content(1))
        _save(mgr, 2, _content(2))
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    manifest = fetch_manifest(store, latest.current)
    store.delete(manifest.files[0].chunks[0].key)
    with TransferEngine() as engine:
        res = restore(store, tmp_path / "out", engine)
    assert res.step == 1 and [(s.step, s.dropped) for s in res.skipped] == [(2, False)]


def test_the_multi_rank_reader_reads_latest_again_too(mem, tmp_path):
    store, clock = mem
    trainer = _Trainer(store, clock, tmp_path)
    trainer.step()
    trainer.step()
    faulty, rule = _under_gc(store, trainer, "ckpt/*/chunks/*")
    dist = DistributedCheckpointManager(faulty, staging_dir=tmp_path / "d", timeout=30)
    try:
        res = dist.restore(tmp_path / "out")
    finally:
        dist.close()
    assert rule.fired == 1 and 2 in trainer.collected
    assert res.step == 3 and _tree(tmp_path / "out") == _content(3)
    assert [(s.step, s.dropped) for s in res.skipped] == [(2, True)]
    trainer.mgr.close()


def test_a_slow_restore_from_s3_restores_the_current_checkpoint(s3_target, tmp_path):
    """Against moto: a new commit drops the checkpoint being restored and GC deletes it
    under the restore (GC looks from two grace periods ahead of the server's clock: no
    test waits out a grace period); the restore reads LATEST again."""
    store = open_store(s3_target.url, s3_target.storage_options)
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", keep_last=1, auto_gc=False)
    _save(mgr, 1, _content(1))
    grace = dt.timedelta(seconds=mgr.settings.gc_grace_s)
    collected: list[int] = []

    def train_and_collect() -> None:
        _save(mgr, 2, _content(2))
        ahead = store.now() + 2 * grace
        server_clock = store.now
        store.now = lambda: ahead
        try:
            report = collect_garbage(store)
        finally:
            store.now = server_clock
        collected.extend(step for step, _ in report.deleted_checkpoints)

    faulty = FaultInjectingStore(store)
    rule = faulty.add(
        Rule(Callback(before=train_and_collect), ops={"get_range"}, key="ckpt/*/chunks/*")
    )
    with TransferEngine() as engine:
        res = restore(faulty, tmp_path / "out", engine)
    assert rule.fired == 1 and collected == [1]
    assert res.step == 2 and _tree(tmp_path / "out") == _content(2)
    assert [(s.step, s.dropped) for s in res.skipped] == [(1, True)]
    mgr.close()
    store.close()
