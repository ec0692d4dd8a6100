"""BLAKE3 for new checkpoints, SHA-256 checkpoints still read (issue 31, item 1).

New checkpoints digest with ``blake3-tree`` and say so (manifest/3, LATEST/4, chunk names
``b3-<hex>``); a run saved before (``sha256-tree``) restores, verifies, collects and copies
as before, also mixed with BLAKE3 checkpoints; a digest this version does not know is a
newer format (UnknownFormatError, exit 10), never damage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloudckpt import (
    CheckpointManager,
    CorruptionError,
    UnknownFormatError,
    attempt_layout,
    canonical,
    digest,
    manifests,
    protocol,
)
from cloudckpt.catalog import copy_checkpoint
from cloudckpt.cli import cli
from cloudckpt.gc import collect_garbage
from cloudckpt.reader import fetch_manifest
from cloudckpt.restore import restore
from cloudckpt.stores import Update, open_store
from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket
from cloudckpt.transfer import TransferEngine
from cloudckpt.verify import verify_run

MiB = 1024 * 1024


@pytest.fixture
def mem():
    clock = ManualClock()
    name = f"digest-{random.getrandbits(32):08x}"
    store = MemoryStore(name, "run", clock=clock)
    yield store, clock
    drop_memory_bucket(name)


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _read(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _files(step: int) -> dict[str, bytes]:
    rng = random.Random(7)  # the same big file every step: chunk reuse
    return {"big.bin": rng.randbytes(9 * MiB), "step.txt": f"step {step}".encode()}


def _latest(store) -> protocol.Latest:
    return protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])


def _save(store, tmp_path, steps, chunking="fixed", **kw):
    with CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False, **kw) as mgr:
        mgr.resume(tmp_path / f"r{steps[0]}")
        for step in steps:
            with mgr.save(step) as d:
                _write(d, _files(step))
            mgr.wait()
        return mgr.last_upload


@pytest.mark.parametrize("chunking", ["fixed", "off"])
def test_new_checkpoints_use_blake3_and_say_so(mem, tmp_path, chunking):
    store, _ = mem
    with CheckpointManager(
        store, staging_dir=tmp_path / "s", auto_gc=False, chunking=chunking
    ) as m:
        m.resume(tmp_path / "r0")
        with m.save(1) as d:
            _write(d, _files(1))
    latest = _latest(store)
    assert json.loads(store.get(protocol.LATEST_KEY)[0])["format"] == "cloudckpt.latest/4"
    assert latest.current.digest == "blake3-tree"
    body = json.loads(store.get(latest.current.manifest_key)[0])
    assert body["format"] == "cloudckpt.manifest/3"
    assert body["digest"] == {"algorithm": "blake3-tree", "chunk_size": 8 * MiB}
    manifest = fetch_manifest(store, latest.current)
    big = next(f for f in manifest.files if f.path == "big.bin")
    data = _files(1)["big.bin"]
    assert big.digest == digest.tree_digest(data, algorithm="blake3-tree")
    assert big.digest != digest.tree_digest(data, algorithm="sha256-tree")
    if chunking == "fixed":
        names = [c.key.rsplit("/", 1)[1] for c in big.chunks]
        assert names and all(n.startswith("b3-") and len(n) == 67 for n in names)
        stored = {o.key for o in store.list(latest.current.ckpt + "chunks/")}
        assert {c.key for c in big.chunks} <= stored
    with CheckpointManager(store, staging_dir=tmp_path / "s2", auto_gc=False) as m:
        assert m.restore(tmp_path / "out").step == 1
    assert _read(tmp_path / "out") == _files(1)
    assert verify_run(store, read_data=True).ok


def test_a_sha256_run_mixes_with_blake3_restore_verify_gc_cp_fallback(
    mem, tmp_path, monkeypatch, memory_target
):
    """Steps 1-2 saved with SHA-256 (as a cloudckpt before BLAKE3 did), 3-4 with BLAKE3:
    step 3 uploads the unchanged big file again (a chunk is reused only by a save with
    the same algorithm: its name is a digest of it), step 4 reuses step 3's. Every step
    restores and verifies; a damaged BLAKE3 checkpoint falls back to a SHA-256 one; GC
    drops the SHA-256 ones and leaves BLAKE3's chunks; cp copies a SHA-256 checkpoint."""
    store, clock = mem
    monkeypatch.setattr(digest, "ALGORITHM", digest.SHA256_TREE)
    old = _save(store, tmp_path / "a", [1, 2], keep_last=4)
    monkeypatch.undo()
    assert old is not None and old.bytes_reused >= 9 * MiB  # step 2 reused step 1's
    latest = _latest(store)
    assert latest.current.digest is None
    assert json.loads(store.get(protocol.LATEST_KEY)[0])["format"] == "cloudckpt.latest/2"
    assert fetch_manifest(store, latest.current).algorithm == "sha256-tree"

    with CheckpointManager(store, staging_dir=tmp_path / "b", auto_gc=False, keep_last=4) as m:
        assert m.resume(tmp_path / "r") is not None
        assert _read(tmp_path / "r") == _files(2)
        with m.save(3) as d:
            _write(d, _files(3))
        m.wait()
        third = m.last_upload
        with m.save(4) as d:
            _write(d, _files(4))
        m.wait()
        fourth = m.last_upload
    assert third is not None and third.bytes_uploaded >= 9 * MiB and third.bytes_reused == 0
    assert fourth is not None and fourth.bytes_reused >= 9 * MiB
    latest = _latest(store)
    assert [r.digest for r in latest.retained()] == ["blake3-tree", "blake3-tree", None, None]
    report = verify_run(store, all=True, read_data=True)
    assert report.ok and len(report.checkpoints) == 4, report.to_dict()
    for step in (1, 2, 3, 4):
        with CheckpointManager(store, staging_dir=tmp_path / f"s{step}", auto_gc=False) as m:
            assert m.restore(tmp_path / f"o{step}", step=step).step == step
        assert _read(tmp_path / f"o{step}") == _files(step)

    # cp: a SHA-256 checkpoint keeps its digests in the destination, which verifies.
    dest = open_store(memory_target.url)
    copy_checkpoint(store, memory_target.url, step=2)
    copied = fetch_manifest(dest, _latest(dest).current)
    assert copied.algorithm == "sha256-tree" and _latest(dest).current.digest is None
    assert verify_run(dest, read_data=True).ok

    # Fallback: steps 4 and 3 damaged (BLAKE3) -> step 2 (SHA-256) restores.
    intact = {}
    for rec in latest.retained()[:2]:
        manifest = fetch_manifest(store, rec)
        own = [c for f in manifest.files for c in f.chunks or () if c.owner == rec.ckpt]
        data = intact[own[-1].key] = store.get(own[-1].key)[0]
        store.put(own[-1].key, bytes([data[0] ^ 1]) + data[1:])
    with TransferEngine() as engine:
        res = restore(store, tmp_path / "fallback", engine)
    assert res.step == 2 and [s.step for s in res.skipped] == [4, 3]
    assert _read(tmp_path / "fallback") == _files(2)
    for key, data in intact.items():
        store.put(key, data)

    # GC: keep the two BLAKE3 checkpoints; the SHA-256 ones and their chunks go.
    with CheckpointManager(store, staging_dir=tmp_path / "g", auto_gc=False, keep_last=1) as m:
        m.resume(tmp_path / "rg")
        with m.save(5) as d:
            _write(d, _files(5))
    clock.advance(3 * 3600)
    collect_garbage(store)
    clock.advance(3 * 3600)
    collect_garbage(store)
    keys = [o.key for o in store.list("ckpt/")]
    chunk_names = [k.rsplit("/", 1)[1] for k in keys if "/chunks/" in k]
    assert chunk_names and all(n.startswith("b3-") for n in chunk_names)
    assert _latest(store).current.step == 5 and not _latest(store).history
    assert verify_run(store, read_data=True).ok


def test_a_damaged_byte_is_detected_under_blake3(mem, tmp_path):
    store, _ = mem
    for chunking, step in (("off", 1), ("fixed", 2)):
        with CheckpointManager(
            store, staging_dir=tmp_path / f"s{step}", auto_gc=False, chunking=chunking
        ) as m:
            m.resume(tmp_path / f"r{step}")
            with m.save(step) as d:
                _write(d, _files(step))
    latest = _latest(store)
    assert {r.digest for r in latest.retained()} == {"blake3-tree"}
    plain = latest.history[0].ckpt + attempt_layout.FILES_DIR + "big.bin"
    data = bytearray(store.get(plain)[0])
    data[5 * MiB] ^= 0x10
    store.put(plain, bytes(data))
    manifest = fetch_manifest(store, latest.current)
    ref = next(f for f in manifest.files if f.path == "big.bin").chunks[1]
    chunk = bytearray(store.get(ref.key)[0])
    chunk[7] ^= 0x01
    store.put(ref.key, bytes(chunk))
    report = verify_run(store, all=True, read_data=True)
    assert [c.ok for c in report.checkpoints] == [False, False], report.to_dict()
    with TransferEngine() as engine, pytest.raises(CorruptionError):
        restore(store, tmp_path / "out", engine)


def _forge_digest(store, name: str) -> protocol.CheckpointRecord:
    """Rewrite the current manifest to name digest ``name`` (sealed, and LATEST records
    its new size and digest): what a newer cloudckpt with another digest would write."""
    data, info = store.get(protocol.LATEST_KEY)
    latest = protocol.parse_latest(data)
    body = json.loads(store.get(latest.current.manifest_key)[0])
    body.pop("self_sha256")
    body["digest"]["algorithm"] = name
    sealed = canonical.seal(body)
    store.put(latest.current.manifest_key, sealed)
    rec = dataclasses.replace(
        latest.current,
        manifest_sha256=hashlib.sha256(sealed).hexdigest(),
        manifest_size=len(sealed),
    )
    store.put(
        protocol.LATEST_KEY,
        dataclasses.replace(latest, current=rec).to_bytes(),
        mode=Update(info.version),
    )
    return rec


def test_an_unknown_digest_is_a_newer_format_not_damage(memory_target, tmp_path):
    store = open_store(memory_target.url)
    for step in (1, 2):
        with CheckpointManager(store, staging_dir=tmp_path / f"s{step}", auto_gc=False) as m:
            m.resume(tmp_path / f"r{step}")
            with m.save(step) as d:
                _write(d, {"f.txt": b"x" * step})
    rec = _forge_digest(store, "k12-tree")
    data = store.get(rec.manifest_key)[0]
    with pytest.raises(UnknownFormatError, match="k12-tree") as caught:
        manifests.parse_manifest(data, rec)
    assert caught.value.found == "k12-tree" and "blake3-tree" in caught.value.known
    # A restore does not fall back past it (to step 1): it is not damage.
    with TransferEngine() as engine, pytest.raises(UnknownFormatError):
        restore(store, tmp_path / "out", engine)
    result = CliRunner().invoke(cli, ["restore", memory_target.url, str(tmp_path / "cli-out")])
    assert result.exit_code == 10, result.output
    assert "k12-tree" in result.output and "Upgrade" in result.output


def test_an_older_reader_refuses_a_blake3_run_at_the_pointer(mem, tmp_path, monkeypatch):
    """A LATEST naming a BLAKE3 checkpoint is /4, a format /3 readers (every cloudckpt
    before BLAKE3) refuse by name: they never open its manifest, whose digest they would
    take for damage (and fall back past it, or let GC judge its chunks)."""
    store, _ = mem
    monkeypatch.setattr(digest, "ALGORITHM", digest.SHA256_TREE)
    _save(store, tmp_path / "a", [1])
    monkeypatch.undo()
    older = ("cloudckpt.latest/1", "cloudckpt.latest/2", "cloudckpt.latest/3")
    assert json.loads(store.get(protocol.LATEST_KEY)[0])["format"] in older
    _save(store, tmp_path / "b", [2])
    assert json.loads(store.get(protocol.LATEST_KEY)[0])["format"] not in older
    monkeypatch.setattr(protocol, "LATEST_FORMATS_READ", older)
    with pytest.raises(
        (protocol.CorruptRecordError, UnknownFormatError), match=r"cloudckpt\.latest/4"
    ):
        protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    monkeypatch.undo()
    body = json.loads(store.get(_latest(store).current.manifest_key)[0])
    assert body["format"] not in ("cloudckpt.manifest/1", "cloudckpt.manifest/2")
