"""CheckpointManager end to end on memory, file, moto S3 and fake-gcs-server GCS."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from cloudckpt import (
    CheckpointNotFoundError,
    CorruptionError,
    DestinationNotEmptyError,
    FencedError,
    protocol,
)
from cloudckpt.stores import open_store
from cloudckpt.testing.faults import FaultInjectingStore, Latency, Rule, flip_bit
from cloudckpt.testing.layout import data_key

MiB = 1024 * 1024


def _write_tree(root: Path, seed: int) -> dict[str, bytes]:
    rng = __import__("random").Random(seed)
    files = {
        "model.bin": rng.randbytes(6 * MiB + 123),  # multipart (6 MiB threshold in tests)
        "optimizer/state.bin": rng.randbytes(100_000),
        "optimizer/empty": b"",
        "trainer_state.json": b'{"step": %d}' % seed,
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def _read_tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def small_parts():
    from cloudckpt import TransferConfig

    return TransferConfig(
        concurrency=4, part_size=5 * MiB, multipart_threshold=6 * MiB, range_size=5 * MiB
    )


def test_save_commit_restore_on_a_new_host(target, manager_factory, tmp_path, small_parts):
    writer = manager_factory(target, transfer=small_parts)
    assert writer.resume(into=tmp_path / "nothing") is None
    handle = writer.save(step=100, metadata={"loss": 0.25, "note": "first"})
    with handle as d:
        expected = _write_tree(d, 100)
    info = handle.result(timeout=120)
    assert info.step == 100 and info.num_files == 4
    assert info.total_bytes == sum(len(v) for v in expected.values())

    new_host = manager_factory(target)
    result = new_host.resume(into=tmp_path / "restored")
    assert result.step == 100 and result.metadata == {"loss": 0.25, "note": "first"}
    assert result.skipped == ()
    assert _read_tree(tmp_path / "restored") == expected
    # The new host claimed the run: the old writer is fenced.
    with pytest.raises(FencedError):
        with writer.save(step=101) as d:
            (d / "x").write_bytes(b"x")
        writer.wait()


def test_save_dir_snapshot_survives_deleting_the_source(target, manager_factory, tmp_path):
    src = tmp_path / "out" / "checkpoint-7"
    expected = _write_tree(src, 7)
    mgr = manager_factory(target)
    handle = mgr.save_dir(step=7, src=src)
    # The trainer rotates the directory away at once (save_total_limit).
    for p in sorted(src.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    src.rmdir()
    handle.result(timeout=120)
    res = mgr.restore(into=tmp_path / "back")
    assert _read_tree(res.path) == expected


def test_reader_never_sees_an_uncommitted_or_partial_checkpoint(
    target, manager_factory, tmp_path, small_parts
):
    base = open_store(target.url, target.storage_options)
    slow = FaultInjectingStore(base)
    writer = manager_factory(slow, transfer=small_parts)
    reader = manager_factory(target)
    with writer.save(step=1) as d:
        first = _write_tree(d, 1)
    writer.wait()
    # Slow every data upload down so the reader polls while the next save is half done.
    slow.add(Rule(Latency(0.2), ops={"put", "upload_part"}, key="ckpt/*", times=None))

    seen: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def poll() -> None:
        n = 0
        while not stop.is_set():
            try:
                latest = reader.latest()
                seen.append(latest.step)
                n += 1
                res = reader.restore(into=tmp_path / f"poll-{n}")
                got = _read_tree(res.path)
                assert got == (first if res.step == 1 else second), "mixed or torn restore"
            except BaseException as exc:  # reported below
                failures.append(exc)
                return

    handle = writer.save(step=2)
    with handle as d:
        second = _write_tree(d, 2)
    poller = threading.Thread(target=poll)
    poller.start()
    while not handle.done():
        # Until the commit lands, LATEST names step 1 only.
        if not handle.done():
            assert reader.latest().step in (1, 2)
        time.sleep(0.05)
    handle.result()
    time.sleep(0.3)
    stop.set()
    poller.join(60)
    assert not failures, failures
    assert seen and set(seen) <= {1, 2} and seen[0] == 1
    assert reader.latest().step == 2
    base.close()


def test_zombie_writer_is_fenced_and_its_attempt_never_referenced(
    target, manager_factory, tmp_path
):
    a = manager_factory(target)
    with a.save(step=1) as d:
        (d / "w").write_bytes(b"A1")
    a.wait()
    b = manager_factory(target)
    assert b.resume(into=tmp_path / "b").step == 1  # B claims (epoch 2)

    zombie = a.save(step=2)
    with zombie as d:
        (d / "w").write_bytes(b"A2-zombie")
    with pytest.raises(FencedError):
        zombie.result(timeout=120)
    # The zombie stays fenced: later saves fail fast, without uploading.
    with pytest.raises(FencedError):
        a.save(step=3).__enter__()

    with b.save(step=2) as d:
        (d / "w").write_bytes(b"B2")
    b.wait()
    store = open_store(target.url, target.storage_options)
    data, _ = store.get(protocol.LATEST_KEY)
    latest = protocol.parse_latest(data)
    assert latest.writer.epoch == 2 and latest.current.step == 2
    referenced = latest.referenced_prefixes()
    zombie_prefixes = {
        o.key.split("/")[0] + "/" + o.key.split("/")[1] + "/"
        for o in store.list("ckpt/")
        if "-e1-" in o.key and o.key.startswith("ckpt/000000000002")
    }
    assert zombie_prefixes, "the zombie's attempt should have uploaded something"
    assert not (zombie_prefixes & referenced)
    res = manager_factory(target).restore(into=tmp_path / "final")
    assert (res.path / "w").read_bytes() == b"B2"
    store.close()


def test_flipped_byte_falls_back_then_fails_cleanly(target, manager_factory, tmp_path):
    mgr = manager_factory(target, keep_local=0)  # no local copy: every byte from the store
    for step in (1, 2):
        with mgr.save(step=step) as d:
            (d / "weights").write_bytes(os.urandom(200_000))
            (d / "step").write_bytes(b"%d" % step)
    mgr.wait()
    store = open_store(target.url, target.storage_options)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    flip_bit(store, data_key(store, latest.current, "weights"), seed=1)

    res = mgr.restore(into=tmp_path / "r1")
    assert res.step == 1 and (res.path / "step").read_bytes() == b"1"
    assert [s.step for s in res.skipped] == [2]
    assert "digest" in res.skipped[0].reason

    flip_bit(store, data_key(store, latest.history[0], "step"), seed=2)
    dest = tmp_path / "r2"
    dest.mkdir()
    with pytest.raises(CorruptionError) as err:
        mgr.restore(into=dest)
    assert [s.step for s in err.value.skipped] == [2, 1]
    assert list(dest.iterdir()) == []  # untouched
    assert not [p for p in tmp_path.iterdir() if "cloudckpt-tmp" in p.name]
    store.close()


def test_missing_file_falls_back(target, manager_factory, tmp_path):
    mgr = manager_factory(target, keep_local=0)  # no local copy: every byte from the store
    for step in (1, 2):
        with mgr.save(step=step) as d:
            (d / "a").write_bytes(b"%d" % step)
    mgr.wait()
    store = open_store(target.url, target.storage_options)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    store.delete(data_key(store, latest.current, "a"))
    res = mgr.restore(into=tmp_path / "r")
    assert res.step == 1 and "missing" in res.skipped[0].reason
    store.close()


def test_retention_keeps_exactly_the_configured_set(target, manager_factory, tmp_path):
    mgr = manager_factory(target, keep_last=2, keep_every=3, auto_gc=False)
    for step in range(1, 8):
        with mgr.save(step=step) as d:
            (d / "s").write_bytes(b"%d" % step)
        if step == 1:
            mgr.wait()
            mgr.pin(1, label="baseline")
    mgr.wait()
    with mgr.save(step=8) as d:
        (d / "s").write_bytes(b"8")
    mgr.wait()
    assert [c.step for c in mgr.list()] == [8, 7, 6, 3, 1]
    assert [c.pins for c in mgr.list()][-1] == ("baseline",)
    store = open_store(target.url, target.storage_options)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert sorted(t.record.step for t in latest.tombstones) == [2, 4, 5]
    # Nothing was deleted by committing: tombstoned data is all still there.
    for t in latest.tombstones:
        assert store.exists(t.record.manifest_key)
    for step in (3, 1):
        res = mgr.restore(into=tmp_path / f"r{step}", step=step)
        assert (res.path / "s").read_bytes() == b"%d" % step
    with pytest.raises(CheckpointNotFoundError):
        mgr.restore(into=tmp_path / "gone", step=2)
    store.close()


def test_destination_not_empty(target, manager_factory, tmp_path):
    mgr = manager_factory(target)
    with mgr.save(step=1) as d:
        (d / "a").write_bytes(b"new")
    mgr.wait()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_bytes(b"old")
    with pytest.raises(DestinationNotEmptyError):
        mgr.restore(into=dest)
    assert _read_tree(dest) == {"keep": b"old"}
    res = mgr.restore(into=dest, overwrite=True)
    assert _read_tree(res.path) == {"a": b"new"}


def test_leftovers_of_a_killed_restore_are_cleaned_up(memory_target, manager_factory, tmp_path):
    mgr = manager_factory(memory_target)
    with mgr.save(step=1) as d:
        (d / "a").write_bytes(b"1")
    mgr.wait()
    dest = tmp_path / "dest"
    leftover = tmp_path / ".dest.cloudckpt-tmp-0123abcd"  # as a SIGKILLed restore leaves it
    leftover.mkdir()
    (leftover / "a").write_bytes(b"partial")
    unrelated = tmp_path / ".other.cloudckpt-tmp-0123abcd"
    unrelated.mkdir()
    mgr.restore(into=dest)
    assert not leftover.exists() and unrelated.exists()
    assert (dest / "a").read_bytes() == b"1"
