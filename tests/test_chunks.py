"""Incremental checkpoints: chunks shared across saves (cloudckpt.chunks)."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest

from cloudckpt import (
    CheckpointManager,
    MissingChunkError,
    attempt_layout,
    canonical,
    digest,
    formats,
    manifests,
    protocol,
)
from cloudckpt.chunks import ChunkIndex, plan, tensor_cuts
from cloudckpt.errors import ChunkSourceDroppedError
from cloudckpt.gc import collect_garbage
from cloudckpt.reader import fetch_manifest
from cloudckpt.stores import open_store
from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket
from cloudckpt.verify import verify_run

MiB = 1024 * 1024


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


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def _read(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def mem():
    clock = ManualClock()
    name = f"chunks-{random.getrandbits(32):08x}"
    store = MemoryStore(name, "run", clock=clock)
    yield store, clock
    drop_memory_bucket(name)


def test_plan_cuts_at_tensor_boundaries(tmp_path):
    rng = random.Random(1)
    base = rng.randbytes(3 * MiB)
    data = _safetensors(
        {"a.base": base, "a.lora": rng.randbytes(1000), "b.base": rng.randbytes(9 * MiB)}
    )
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    fixed = plan(path, len(data), "fixed")
    tensor = plan(path, len(data), "tensor")
    assert [n for _, n in fixed][:1] == [8 * MiB]
    assert len(tensor) > len(fixed)
    cuts = tensor_cuts(path, len(data))
    assert cuts and all(0 < c <= len(data) for c in cuts)
    for off, n in tensor:  # every chunk within one 8 MiB leaf
        assert off // (8 * MiB) == (off + n - 1) // (8 * MiB)
    assert sum(n for _, n in tensor) == len(data)


def test_plan_cuts_torch_save_zips_at_their_members(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "model.pt"
    torch.save(
        {"big": torch.zeros(600_000), "small": torch.ones(10), "b2": torch.ones(400_000)}, path
    )
    size = path.stat().st_size
    cuts = tensor_cuts(path, size)
    assert len(cuts) == 4  # start and end of the two tensors over 1 MiB
    data = path.read_bytes()
    assert data[cuts[0] : cuts[1]] == torch.zeros(600_000).numpy().tobytes()
    assert len(plan(path, size, "tensor")) >= 3


def test_second_save_uploads_only_changed_chunks_and_restores(mem, tmp_path):
    store, _ = mem
    rng = random.Random(2)
    base = rng.randbytes(5 * MiB)
    files = {
        "model.safetensors": _safetensors(
            {"a": base, "b.lora": rng.randbytes(4000), "c": base[::-1]}
        ),
        "rng.pt": b"rng",
        "empty": b"",
    }
    with CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False) as mgr:
        assert mgr.resume(tmp_path / "r0") is None
        for step in (1, 2):
            if step == 2:
                files["model.safetensors"] = _safetensors(
                    {"a": base, "b.lora": rng.randbytes(4000), "c": base[::-1]}
                )
                files["rng.pt"] = b"rng2"
            with mgr.save(step) as d:
                _write(d, files)
            mgr.wait()
        stats = mgr.last_upload
    assert stats is not None and stats.bytes_reused >= 2 * 5 * MiB
    assert stats.bytes_uploaded < 1 * MiB  # the small tensors' run and rng.pt
    latest = protocol.parse_latest(store.get("LATEST")[0])
    manifest = fetch_manifest(store, latest.current)
    assert manifest.chunked
    owners = {c.owner for f in manifest.files for c in f.chunks}
    assert owners == {latest.current.ckpt, latest.history[0].ckpt}  # shares with step 1
    assert latest.current.owned_bytes < latest.current.total_bytes / 4
    with CheckpointManager(store, staging_dir=tmp_path / "s2", auto_gc=False) as reader:
        res = reader.resume(tmp_path / "restored")
    assert res.step == 2 and _read(tmp_path / "restored") == files
    report = verify_run(store, all=True, read_data=True)
    assert report.ok, report.to_dict()


def test_missing_chunk_falls_back_and_verify_reports_it(mem, tmp_path):
    store, _ = mem
    rng = random.Random(3)
    with CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False) as mgr:
        mgr.resume(tmp_path / "r0")
        for step in (1, 2):
            with mgr.save(step) as d:
                _write(d, {"a.bin": rng.randbytes(1000), "shared.bin": b"x" * 5000})
    latest = protocol.parse_latest(store.get("LATEST")[0])
    manifest = fetch_manifest(store, latest.current)
    own = [c for f in manifest.files for c in f.chunks if c.owner == latest.current.ckpt]
    store.delete(own[0].key)
    report = verify_run(store, read_data=True)
    assert not report.ok and "missing" in report.checkpoints[0].reasons[0]
    from cloudckpt.restore import restore
    from cloudckpt.transfer import TransferEngine

    with TransferEngine() as engine:
        res = restore(store, tmp_path / "out", engine)
    assert res.step == 1 and res.skipped and res.skipped[0].step == 2
    with pytest.raises(MissingChunkError):
        from cloudckpt.chunks import check_chunk_objects

        check_chunk_objects(store, manifest, 2)


def test_gc_keeps_chunks_later_checkpoints_name(mem, tmp_path):
    store, clock = mem
    shared = random.Random(4).randbytes(3000)
    with CheckpointManager(
        store, staging_dir=tmp_path / "s", keep_last=1, gc_grace=60, auto_gc=False
    ) as mgr:
        mgr.resume(tmp_path / "r0")
        for step in range(1, 5):
            handle = mgr.save(step)
            with handle as d:
                _write(d, {"shared.bin": shared, "step.txt": str(step).encode()})
            handle.result()
            clock.advance(120)
            collect_garbage(store)
    clock.advance(120)
    collect_garbage(store)
    latest = protocol.parse_latest(store.get("LATEST")[0])
    assert not latest.history
    manifest = fetch_manifest(store, latest.current)
    first = next(c for f in manifest.files for c in f.chunks if f.path == "shared.bin")
    assert first.owner != latest.current.ckpt  # still the chunk step 1 uploaded
    assert store.head(first.key).size == 3000
    # Everything else of the old attempts is gone.
    leftovers = [o.key for o in store.list("ckpt/") if not o.key.startswith(latest.current.ckpt)]
    assert leftovers == [first.key]
    with CheckpointManager(store, staging_dir=tmp_path / "s2", auto_gc=False) as reader:
        assert reader.resume(tmp_path / "out").step == 4


def test_commit_refused_when_a_source_left_retention(mem, tmp_path):
    store, _ = mem
    with CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False) as mgr:
        mgr.resume(tmp_path / "r0")
        with mgr.save(1) as d:
            _write(d, {"f": b"abc" * 1000})
    latest = protocol.parse_latest(store.get("LATEST")[0])
    manifest = fetch_manifest(store, latest.current)
    from cloudckpt.chunks import UploadStats

    stats = UploadStats(sources={manifest.commit_id})
    stats.requires(latest)  # retained: fine
    dropped = protocol.commit(
        latest,
        protocol.CheckpointRecord(**{**latest.current.to_dict(), "commit_id": "x-1", "step": 2}),
        protocol.Settings(keep_last=1),
        clock_now(),
    )
    with pytest.raises(ChunkSourceDroppedError):
        stats.requires(dropped)
    assert len(ChunkIndex.of(manifest)) == 1


def clock_now():
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc)


def test_chunking_off_writes_plain_manifests(mem, tmp_path):
    store, _ = mem
    with CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False, chunking="off") as mgr:
        mgr.resume(tmp_path / "r0")
        with mgr.save(1) as d:
            _write(d, {"f": b"abc"})
    latest = protocol.parse_latest(store.get("LATEST")[0])
    assert not fetch_manifest(store, latest.current).chunked
    assert store.head(latest.current.ckpt + "files/f").size == 3


def test_old_format_run_still_restores(tmp_path, monkeypatch):
    """A run written before chunks (LATEST/1, manifest/1, SHA-256) restores and takes new
    saves (BLAKE3: LATEST/4)."""
    url = f"memory://old-{random.getrandbits(32):08x}/run"
    store = open_store(url)
    monkeypatch.setattr(digest, "ALGORITHM", digest.SHA256_TREE)
    with CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False, chunking="off") as mgr:
        mgr.resume(tmp_path / "r0")
        with mgr.save(1) as d:
            _write(d, {"f": b"old"})
    monkeypatch.undo()
    data, info = store.get("LATEST")
    body = json.loads(data)
    body["format"] = "cloudckpt.latest/1"
    body.pop("self_sha256")
    old = canonical.seal(body)
    store.put("LATEST", old, mode=protocol_update(info.version))
    with CheckpointManager(store, staging_dir=tmp_path / "s2", auto_gc=False) as mgr:
        assert _read(mgr.resume(tmp_path / "r1").path) == {"f": b"old"}
        with mgr.save(2) as d:
            _write(d, {"f": b"new"})
    latest = protocol.parse_latest(store.get("LATEST")[0])
    assert latest.current.step == 2
    assert json.loads(store.get("LATEST")[0])["format"] == formats.LATEST_FORMAT_DIGEST


def protocol_update(version):
    from cloudckpt.stores import Update

    return Update(version)


def test_a_save_whose_chunk_source_was_dropped_uploads_in_full(mem, tmp_path, monkeypatch):
    """The commit check refuses (as if an unpin dropped the source meanwhile): the manager
    uploads the save again under a new attempt, naming no older chunk, and commits it."""
    from cloudckpt import chunks

    store, _ = mem
    shared = b"s" * 5000
    with CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False) as mgr:
        mgr.resume(tmp_path / "r0")
        with mgr.save(1) as d:
            _write(d, {"shared.bin": shared, "a": b"1"})
        mgr.wait()
        real = chunks.UploadStats.requires
        calls = []

        def refuse_once(self, base):
            calls.append(bool(self.sources))
            if len(calls) == 1:
                raise ChunkSourceDroppedError("dropped meanwhile")
            return real(self, base)

        monkeypatch.setattr(chunks.UploadStats, "requires", refuse_once)
        handle = mgr.save(2)
        with handle as d:
            _write(d, {"shared.bin": shared, "a": b"2"})
        info = handle.result()
    assert calls == [True, False]  # the retry reuses nothing
    latest = protocol.parse_latest(store.get("LATEST")[0])
    manifest = fetch_manifest(store, latest.current)
    assert {c.owner for f in manifest.files for c in f.chunks} == {latest.current.ckpt}
    attempts = {o.key.split("/")[1] for o in store.list("ckpt/") if "000000000002" in o.key}
    assert len(attempts) == 2  # the refused attempt stays for GC
    # What the save sent counts both tries: every data object of both attempts.
    sent = [
        o.size
        for o in store.list("ckpt/")
        if "000000000002" in o.key
        and o.key.rsplit("/", 1)[1] not in ("ATTEMPT.json", "MANIFEST.json")
    ]
    assert info.bytes_uploaded == sum(sent) > manifest.total_bytes


@pytest.mark.parametrize(
    "chunks, error",
    [
        ([[0, "0" * 64, 10]], "do not add up"),
        ([[0, "0" * 64, 8 * MiB + 1]], "crosses a digest leaf"),
        ([[0, "zz", 11]], "not a hex digest"),
        ([[1, "0" * 64, 11]], "malformed chunk reference"),
        ([[0, "0" * 64, True]], "malformed chunk reference"),
    ],
)
def test_hostile_chunk_lists_are_refused(chunks, error):
    prefix = attempt_layout.ckpt_prefix(1, 1, "20300101T000000000Z-deadbeef")
    manifest = manifests.Manifest(
        ckpt=prefix,
        step=1,
        epoch=1,
        commit_id="20300101T000000000Z-deadbeef",
        writer_id="w",
        created_at="t",
        files=(
            manifests.FileEntry("f", 11, "0" * 64, (manifests.ChunkRef(prefix, "0" * 64, 11),)),
        ),
    )
    body = json.loads(manifest.to_bytes())
    assert body["format"] == formats.MANIFEST_FORMAT_DIGEST  # BLAKE3, chunked
    body["files"][0]["chunks"] = chunks
    body.pop("self_sha256")
    with pytest.raises(protocol.CorruptRecordError, match=error):
        manifests.parse_manifest(canonical.seal(body))
    body["chunk_owners"] = ["../../etc/"]
    with pytest.raises(protocol.CorruptRecordError, match="not a checkpoint prefix"):
        manifests.parse_manifest(canonical.seal(body))


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_a_save_never_names_a_reused_chunk_that_is_gone(backend, mem, tmp_path, request):
    """Issue 21 item 2: a checkpoint whose chunk was lost (a lifecycle rule, a deletion by
    hand, a commit over GC) must not spread the loss: the next save of the unchanged data
    finds the chunk missing in its pre-commit listing and uploads it again, so every
    checkpoint it commits restores. Before, it named the missing chunk and, with
    keep_last=1, nothing in the run restored once the intact step aged out."""
    if backend == "memory":
        store = mem[0]
    else:
        target = request.getfixturevalue("s3_target")
        store = open_store(target.url, target.storage_options)
    frozen = random.Random(5).randbytes(200_000)
    with CheckpointManager(store, staging_dir=tmp_path / "s", keep_last=1, auto_gc=False) as mgr:
        mgr.resume(tmp_path / "r0")
        with mgr.save(1) as d:
            _write(d, {"base.bin": frozen, "adapter.bin": b"one"})
        mgr.wait()
        step1 = fetch_manifest(store, mgr.committer.latest.current)
        (lost,) = [c for f in step1.files for c in f.chunks if f.path == "base.bin"]
        store.delete(lost.key)  # gone from the store; the manager's index still has it

        for step in (2, 3):
            with mgr.save(step) as d:
                _write(d, {"base.bin": frozen, "adapter.bin": b"%d" % step})
            mgr.wait()
            manifest = fetch_manifest(store, mgr.committer.latest.current)
            named = {c.key for f in manifest.files for c in f.chunks}
            assert lost.key not in named
            assert all(store.exists(k) for k in named)
        # Step 2 uploaded the lost chunk again (in its own prefix); step 3 reused that copy.
        assert mgr.last_upload.chunks_uploaded == 1 and mgr.last_upload.chunks_reused == 1
        res = mgr.restore(tmp_path / "out")
    assert res.step == 3 and not res.skipped
    assert _read(res.path) == {"base.bin": frozen, "adapter.bin": b"3"}
    if backend == "s3":
        store.close()
