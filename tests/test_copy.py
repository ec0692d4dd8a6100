"""Copying a committed checkpoint into another run (issue 25 item 3): verified, committed
through the destination's own LATEST, reusing the chunks the destination holds; across
stores (moto -> fake-gcs-server through the CLI, memory -> file://)."""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloudckpt import CheckpointManager, CorruptionError, FencedError, NotARunError, protocol
from cloudckpt.catalog import copy_checkpoint
from cloudckpt.cli import cli
from cloudckpt.digest import CHUNK_SIZE
from cloudckpt.errors import ActiveWriterError, ConfigurationError
from cloudckpt.failpoints import SimulatedCrash, arm, disarm
from cloudckpt.restore import restore
from cloudckpt.stores import open_store
from cloudckpt.testing.faults import flip_bit
from cloudckpt.transfer import TransferEngine
from cloudckpt.verify import verify_run


def _tree(root: Path, seed: int, big: int = 3) -> dict[str, bytes]:
    """A checkpoint: a large file of ``big`` leaves that changes in one leaf per seed, and
    small ones that change every time."""
    base = bytearray(random.Random(0).randbytes(big * CHUNK_SIZE + 7))
    base[CHUNK_SIZE + seed] ^= 0xFF
    files = {
        "model.bin": bytes(base),
        "config.json": b'{"seed": %d}' % seed,
        "run.sh": b"#!/bin/sh\necho trained\n",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    os.chmod(root / "run.sh", 0o755)
    return files


def _push(url: str, options: dict, tmp_path: Path, step: int, seed: int, **kw) -> dict:
    src = tmp_path / f"src-{url.split('/')[-1]}-{step}"
    files = _tree(src, seed)
    mgr = CheckpointManager(
        url, storage_options=options, staging_dir=tmp_path / f"st-{step}", auto_gc=False, **kw
    )
    mgr.save_dir(step, src).result()
    mgr.close()
    return files


def _restored(url: str, options: dict, tmp_path: Path, name: str, step: int | None = None):
    store = open_store(url, options)
    with TransferEngine() as engine:
        result = restore(store, tmp_path / name, engine, step=step)
    store.close()
    root = tmp_path / name
    return result, {
        p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()
    }


def _flags(target, prefix: str = "") -> list[str]:
    so = target.storage_options
    if target.backend == "s3":
        return [f"--{prefix}endpoint-url", so["endpoint_url"], f"--{prefix}region", "us-east-1",
                f"--{prefix}option" if prefix else "-o", f"key={so['key']}",
                f"--{prefix}option" if prefix else "-o", f"secret={so['secret']}"]  # fmt: skip
    opt = f"--{prefix}option" if prefix else "-o"
    return [f"--{prefix}endpoint-url", so["endpoint_url"], opt, "token=anon", opt, "project=test"]


def test_cp_from_s3_to_gcs_verified_and_incremental(s3_target, gcs_target, tmp_path):
    """s3 -> gs with the CLI: the copy restores byte for byte at the destination (modes
    too) and verifies; a second copy of a newer step sends and reads only what changed."""
    first = _push(s3_target.url, s3_target.storage_options, tmp_path, step=100, seed=1)
    second = _push(s3_target.url, s3_target.storage_options, tmp_path, step=200, seed=2)
    argv = ["cp", s3_target.url, gcs_target.url, "--json", *_flags(s3_target),
            *_flags(gcs_target, "dest-")]  # fmt: skip
    done = CliRunner().invoke(cli, [*argv, "--step", "100"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    total = sum(map(len, first.values()))
    assert (doc["step"], doc["dest_step"], doc["total_bytes"], doc["num_files"]) == (
        100,
        100,
        total,
        3,
    )
    assert doc["bytes_uploaded"] == doc["bytes_read"] == total and doc["bytes_reused"] == 0
    assert doc["dest"] == open_store(gcs_target.url, gcs_target.storage_options).url
    result, got = _restored(gcs_target.url, gcs_target.storage_options, tmp_path, "a")
    assert got == first and result.step == 100
    assert stat.S_IMODE((tmp_path / "a" / "run.sh").stat().st_mode) & 0o111

    again = CliRunner().invoke(cli, argv)  # the newest: step 200
    assert again.exit_code == 0, again.output
    doc = json.loads(again.stdout)
    changed = CHUNK_SIZE + len(second["config.json"])  # one leaf of model.bin, config.json
    assert doc["step"] == 200 and doc["bytes_reused"] == doc["total_bytes"] - changed
    assert doc["bytes_uploaded"] == doc["bytes_read"] == changed  # nothing else was read
    _, got = _restored(gcs_target.url, gcs_target.storage_options, tmp_path, "b")
    assert got == second
    dest = open_store(gcs_target.url, gcs_target.storage_options)
    assert verify_run(dest, all=True, read_data=True).ok
    latest = protocol.parse_latest(dest.get(protocol.LATEST_KEY)[0])
    assert [r.step for r in latest.retained()] == [200, 100] and latest.writer.epoch == 2
    dest.close()


def test_copy_from_a_bucket_to_a_local_run(memory_target, file_target, tmp_path):
    """Python: memory:// -> file://, whole-file source (chunking off) stored as chunks at
    the destination, another step number, modes kept."""
    files = _push(memory_target.url, {}, tmp_path, step=5, seed=3, chunking="off")
    result = copy_checkpoint(memory_target.url, file_target.url, dest_step=50)
    assert (result.step, result.dest_step, result.fenced_writer) == (5, 50, None)
    assert result.bytes_uploaded == result.total_bytes == sum(map(len, files.values()))
    _, got = _restored(file_target.url, {}, tmp_path, "out")
    assert got == files
    assert stat.S_IMODE((tmp_path / "out" / "run.sh").stat().st_mode) == 0o755 & ~_umask()
    store = open_store(file_target.url)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert latest.current.step == 50 and latest.current.metadata == {}
    manifest = protocol.parse_manifest(store.get(latest.current.manifest_key)[0])
    assert manifest.chunked and all(f.chunks is not None for f in manifest.files)


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_copy_refuses_to_fence_an_active_writer_unless_forced(memory_target, tmp_path):
    """A copy into a run a trainer is writing would fence the trainer: refused unless
    forced; forced, the trainer's next save fails with FencedError."""
    src_url = memory_target.url
    dst_url = src_url.rsplit("/", 1)[0] + "/training"
    _push(src_url, {}, tmp_path, step=1, seed=1)
    trainer = CheckpointManager(dst_url, staging_dir=tmp_path / "trainer", auto_gc=False)
    with trainer.save(7) as d:
        (d / "w.bin").write_bytes(b"trainer")
    trainer.wait()
    with pytest.raises(ActiveWriterError, match="fences that writer"):
        copy_checkpoint(src_url, dst_url)
    store = open_store(dst_url)
    assert protocol.parse_latest(store.get(protocol.LATEST_KEY)[0]).current.step == 7
    result = copy_checkpoint(src_url, dst_url, force=True)
    assert result.fenced_writer is not None and result.fenced_writer.id == trainer.writer_id
    with pytest.raises(FencedError):
        with trainer.save(8) as d:
            (d / "w.bin").write_bytes(b"zombie")
        trainer.wait()
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert [r.step for r in latest.retained()] == [1, 7]
    trainer.close()  # (its failure was reported by wait())


def test_a_damaged_source_is_skipped_and_nothing_of_it_committed(memory_target, tmp_path):
    src_url = memory_target.url
    dst_url = src_url.rsplit("/", 1)[0] + "/copy"
    first = _push(src_url, {}, tmp_path, step=1, seed=1)
    _push(src_url, {}, tmp_path, step=2, seed=2)
    store = open_store(src_url)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    manifest = protocol.parse_manifest(store.get(latest.current.manifest_key)[0])
    own = [c for f in manifest.files for c in f.chunks if c.owner == latest.current.ckpt]
    flip_bit(store, own[0].key, seed=5)  # a chunk only step 2 has
    with pytest.raises(CorruptionError):
        copy_checkpoint(src_url, dst_url, step=2)
    dest = open_store(dst_url)
    dest_latest = protocol.parse_latest(dest.get(protocol.LATEST_KEY)[0])
    assert dest_latest.current is None  # claimed, nothing committed
    result = copy_checkpoint(src_url, dst_url)
    assert result.step == 1 and [s.step for s in result.skipped] == [2]
    _, got = _restored(dst_url, {}, tmp_path, "out")
    assert got == first


def test_an_interrupted_copy_resumes(memory_target, tmp_path):
    """A copy killed after its upload, before its commit, then run again: it names the
    chunks the first attempt uploaded and reads nothing of them from the source."""
    src_url = memory_target.url
    dst_url = src_url.rsplit("/", 1)[0] + "/copy"
    files = _push(src_url, {}, tmp_path, step=3, seed=1)
    arm("save.after_upload")  # SimulatedCrash: the process dies there
    try:
        with pytest.raises(SimulatedCrash):
            copy_checkpoint(src_url, dst_url)
    finally:
        disarm()
    result = copy_checkpoint(src_url, dst_url)
    assert result.bytes_resumed == result.bytes_reused == result.total_bytes
    assert result.bytes_uploaded == 0
    assert result.bytes_read == 0  # every chunk a whole leaf: named without being read
    _, got = _restored(dst_url, {}, tmp_path, "out")
    assert got == files


def test_copy_refuses_a_location_that_is_not_a_run_and_the_source_itself(memory_target, tmp_path):
    src_url = memory_target.url
    _push(src_url, {}, tmp_path, step=1, seed=1)
    other = open_store(src_url.rsplit("/", 1)[0] + "/theirs")
    other.put("weights.bin", b"someone else's")
    with pytest.raises(NotARunError):
        copy_checkpoint(src_url, other)
    assert [o.key for o in other.list()] == ["weights.bin"]  # nothing written
    with pytest.raises(ConfigurationError, match="both the source and the destination"):
        copy_checkpoint(src_url, src_url)
    result = CliRunner().invoke(cli, ["cp", src_url, src_url])
    assert result.exit_code == 2, result.output
