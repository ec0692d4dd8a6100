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

from cloudckpt import (
    CheckpointManager,
    CorruptionError,
    FencedError,
    NotARunError,
    manifests,
    protocol,
)
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
    manifest = manifests.parse_manifest(store.get(latest.current.manifest_key)[0])
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
    manifest = manifests.parse_manifest(store.get(latest.current.manifest_key)[0])
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
    chunks the first attempt uploaded instead of sending them again. It reads them from
    the source all the same: no commit checked them, so their content is checked against
    the bytes they stand for before the manifest names them (issue 28 item 2)."""
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
    assert result.bytes_read == result.total_bytes  # read to check the resumed chunks
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


def _cli(*args) -> tuple[int, str, str]:
    done = CliRunner().invoke(cli, [str(a) for a in args])
    return done.exit_code, done.stdout, done.stderr


def _metric_push(url, options, tmp_path, step, loss, **kw):
    src = tmp_path / f"m-{url.split('/')[-1]}-{step}"
    _tree(src, step)
    mgr = CheckpointManager(url, storage_options=options, staging_dir=tmp_path / f"ms-{step}",
                            auto_gc=False, **kw)  # fmt: skip
    mgr.save_dir(step, src, metrics={"eval_loss": loss}).result()
    mgr.close()


def test_cp_keeps_metrics_and_retention_and_carries_the_sources_on_request(
    s3_target, file_target, tmp_path
):
    """`cp` records the source's metrics (so keep-best can rank the copy), keeps every
    retention setting of the destination (its keep-best too), and `--keep-settings` gives
    a new archive the source's rules: it then keeps the source's best."""
    best = {"keep_last": 1, "keep_best": 1, "best_metric": "eval_loss"}
    so = s3_target.storage_options
    for step, loss in ((100, 0.2), (200, 0.5)):
        _metric_push(s3_target.url, so, tmp_path, step, loss, **best)
    _metric_push(file_target.url, {}, tmp_path, 10, 0.1, **best)  # the destination's best
    # --force: DEST's writer is this (live) process.
    argv = ["cp", s3_target.url, file_target.url, "--step", 200, "--json", "--force"]
    code, out, err = _cli(*argv, *_flags(s3_target))
    assert code == 0, err
    dest = open_store(file_target.url)
    latest = protocol.parse_latest(dest.get(protocol.LATEST_KEY)[0])
    assert [(r.step, dict(r.metrics)) for r in latest.retained()] == [
        (200, {"eval_loss": 0.5}),
        (10, {"eval_loss": 0.1}),  # still the best: the copy kept DEST's keep-best
    ]
    assert (latest.settings.keep_best, latest.settings.best_metric) == (1, "eval_loss")
    assert json.loads(out)["settings_copied"] is False
    dest.close()

    archive = f"file://{tmp_path}/archive/run"
    for step in (100, 200):
        code, out, err = _cli("cp", s3_target.url, archive, "--step", step, "--keep-settings",
                              *_flags(s3_target))  # fmt: skip
        assert code == 0, err
        assert "now keeps checkpoints by the retention settings of SRC" in out
    store = open_store(archive)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert [(r.step, dict(r.metrics)) for r in latest.retained()] == [
        (200, {"eval_loss": 0.5}),
        (100, {"eval_loss": 0.2}),
    ]
    assert latest.settings.keep_last == 1 and latest.settings.best_metric == "eval_loss"
    assert latest.settings.gc_grace_s == protocol.Settings().gc_grace_s
    store.close()


def test_copying_the_same_checkpoint_twice_commits_it_once(s3_target, file_target, tmp_path):
    """The second `cp` of the same content as the same step reads and writes nothing and
    says so; the same step with other content is copied, and `show --commit` and `diff`
    with commit ids tell the two apart."""
    first = _push(s3_target.url, s3_target.storage_options, tmp_path, step=5, seed=1)
    argv = ["cp", s3_target.url, file_target.url, *_flags(s3_target)]
    code, _, err = _cli(*argv)
    assert code == 0, err
    dest = open_store(file_target.url)
    before = protocol.parse_latest(dest.get(protocol.LATEST_KEY)[0])
    objects = sorted(o.key for o in dest.list(""))
    code, out, err = _cli(*argv)
    assert code == 0, err
    assert "already holds step 5" in out and "nothing copied" in out
    code, out, err = _cli(*argv, "--json")
    doc = json.loads(out)
    assert doc["noop"] is True and doc["dest_commit_id"] == before.current.commit_id
    assert (doc["bytes_read"], doc["bytes_uploaded"], doc["fenced_writer"]) == (0, 0, None)
    assert protocol.parse_latest(dest.get(protocol.LATEST_KEY)[0]).seq == before.seq
    assert sorted(o.key for o in dest.list("")) == objects  # not even an attempt

    # Step 5 again at the source, other bytes: copied, so DEST retains step 5 twice.
    src = tmp_path / "other-5"
    _tree(src, 2)
    mgr = CheckpointManager(s3_target.url, storage_options=s3_target.storage_options,
                            staging_dir=tmp_path / "st-other", auto_gc=False)  # fmt: skip
    mgr.save_dir(5, src).result()
    mgr.close()
    code, out, err = _cli(*argv, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["noop"] is False and doc["dest_step"] == 5
    assert doc["dest_commit_id"] != before.current.commit_id
    latest = protocol.parse_latest(dest.get(protocol.LATEST_KEY)[0])
    newer, older = (r.commit_id for r in latest.retained())
    assert [r.step for r in latest.retained()] == [5, 5]
    shown = {}
    for cid in (newer, older):
        code, out, err = _cli("show", file_target.url, "--commit", cid, "--json")
        assert code == 0, err
        shown[cid] = {f["path"]: f["digest"] for f in json.loads(out)["manifest"]["files"]}
    assert shown[newer]["config.json"] != shown[older]["config.json"]
    code, out, err = _cli("diff", file_target.url, older, newer, "--json")
    assert code == 0, err
    diff = json.loads(out)
    assert (diff["a"]["commit_id"], diff["b"]["commit_id"]) == (older, newer)
    assert {f["path"] for f in diff["files"] if f["change"] == "modified"} == {
        "config.json", "model.bin"
    }  # fmt: skip
    code, out, err = _cli("show", file_target.url, "--commit", "no-such-commit")
    assert code == 3 and older in err  # the message lists the retained commits
    dest.close()
    assert first  # (the first source tree, copied above)
