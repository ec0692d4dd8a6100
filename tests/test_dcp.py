"""torch.distributed.checkpoint through cloudckpt (CloudStorageWriter / CloudStorageReader).

Multi-rank: the 2-rank torchrun job of tests/scripts/distrun.py (shared with
test_distributed.py) saves DTensors sharded over both ranks with ``dcp.save`` (step 2) and
``dcp.async_save`` (step 3), fails a DCP save on rank 1 (step 5), and, as a new job, loads
steps 3 and 2 resharded onto another placement; a 1-process job then loads step 3 into
plain tensors, and a 3-rank job loads both resharded over 3 ranks (2 -> 3). Every load must
give the saved tensors exactly, each rank streaming what its plan reads (no local files).

Single process (no process group; DCP's no-dist mode): round trips, checkpoint ids,
fencing through a claiming reader, fallback past a damaged checkpoint, and refusals.
"""

from __future__ import annotations

import pickle
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import torch
import torch.distributed.checkpoint as dcp
from distrun import main_run

from cloudckpt import CheckpointManager, attempt_layout, canonical, protocol
from cloudckpt.committer import read_latest
from cloudckpt.distributed import WORLD_SIZE_KEY, DistributedCheckpointManager
from cloudckpt.errors import ConfigurationError
from cloudckpt.integrations.dcp import (
    DCP_KEY,
    METADATA_FILE,
    CloudStorageReader,
    CloudStorageWriter,
)
from cloudckpt.reader import fetch_manifest
from cloudckpt.stores import OVERWRITE, open_store
from cloudckpt.testing.faults import flip_bit

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def run(moto_server, tmp_path_factory):
    return main_run(moto_server, tmp_path_factory)


# ------------------------------------------------------------------------------ 2 ranks


def test_dcp_save_and_async_save_commit_every_ranks_shards_once(run):
    main = run["main"]
    store = open_store(run["url"], run["options"])
    try:
        latest = read_latest(store).latest
        records = {r.step: r for r in latest.retained()}
        assert records[3].commit_id == main.one(0, "dcp-saved", step=3)["commit"]
        assert records[2].commit_id == main.one(0, "dcp-saved", step=2)["commit"]
        assert main.one(1, "dcp-saved", step=2)["commit"] is None  # only rank 0 commits
        for step, kind in ((2, "dcp"), (3, "dcp-async")):
            record = records[step]
            assert record.metadata == {"kind": kind, WORLD_SIZE_KEY: 2, DCP_KEY: "1.0.0"}
            manifest = fetch_manifest(store, record)
            assert sorted(f.path for f in manifest.files) == [
                METADATA_FILE,
                "__0_0.distcp",
                "__1_0.distcp",
            ]
            # Each rank's file is stored as checksummed chunks a reader can verify alone.
            for f in manifest.files:
                assert (f.chunks is None) == (f.path == METADATA_FILE)
            # .metadata is DCP's own: a plain FileSystemReader can read a restored copy.
            data, _ = store.get(record.ckpt + attempt_layout.FILES_DIR + METADATA_FILE)
            metadata = pickle.loads(data)
            assert {i.relative_path for i in metadata.storage_data.values()} == {
                "__0_0.distcp",
                "__1_0.distcp",
            }
        for record in latest.retained():  # no commit for the DCP save that failed
            assert record.step != 5
        step5 = [o.key for o in store.list("ckpt/000000000005-")]
        assert any(k.endswith("/" + attempt_layout.ATTEMPT_NAME) for k in step5)  # it was opened
        assert not any(k.endswith("/" + attempt_layout.MANIFEST_NAME) for k in step5)
    finally:
        store.close()


def test_a_failed_rank_fails_the_dcp_save_on_every_rank(run):
    for rank in (0, 1):
        failed = run["main"].one(rank, "save-failed", step=5)
        assert failed["type"] == "CheckpointException"
        assert "injected upload failure on rank 1" in failed["message"]


def test_loads_on_2_ranks_and_on_1_process_give_the_saved_tensors(run):
    main, load1 = run["main"], run["load1"]
    for step in (2, 3):
        expected = main.one(0, "expected", step=step)
        for rank in (0, 1):  # resharded: saved Shard(0), loaded as Shard(1)
            loaded = main.one(rank, "dcp-loaded", step=step)
            assert (loaded["w"], loaded["b"]) == (expected["w"], expected["b"])
            assert loaded["extra"] == {"step": step, "name": f"step-{step}"}
            assert loaded["streamed"] > 0 and loaded["files_written"] == []  # nothing local
    one = load1.one(0, "dcp-loaded", step=3)
    two = main.one(0, "dcp-loaded", step=3)
    assert (one["w"], one["b"], one["extra"]) == (two["w"], two["b"], two["extra"])


def test_a_2_rank_checkpoint_loads_resharded_over_3_ranks(run):
    main, load3 = run["main"], run["load3"]
    for step in (2, 3):
        expected = main.one(0, "expected", step=step)
        rows = []
        for rank in (0, 1, 2):
            loaded = load3.one(rank, "dcp-loaded", step=step)
            assert (loaded["w"], loaded["b"]) == (expected["w"], expected["b"])
            assert loaded["extra"] == {"step": step, "name": f"step-{step}"}
            assert loaded["streamed"] > 0
            rows.append(loaded["local_rows"])
        assert rows == [3, 3, 2]  # 8 rows saved as 4 + 4, loaded as 3 + 3 + 2


# ------------------------------------------------------------------------------ 1 process


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
        "opt": {"step": seed, "lr": 0.1 * seed},
    }


def _empty() -> dict:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "opt": {"step": 0, "lr": 0.0}}


def _same(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["model"]["w"], b["model"]["w"])
        and torch.equal(a["model"]["b"], b["model"]["b"])
        and a["opt"] == b["opt"]
    )


@pytest.fixture
def mgr(s3_target, tmp_path):
    m = DistributedCheckpointManager(
        s3_target.url, storage_options=s3_target.storage_options, staging_dir=tmp_path / "s"
    )
    yield m
    m.close()


def test_save_async_save_and_load_in_one_process(mgr, tmp_path):
    writer = CloudStorageWriter(mgr, step=10, metadata={"loss": 1.5})
    dcp.save(_state(10), storage_writer=writer)
    assert writer.commit_info.step == 10 and writer.commit_info.num_files == 2
    fut = dcp.async_save(_state(20), storage_writer=CloudStorageWriter(mgr), checkpoint_id=20)
    fut.result(timeout=60)
    assert mgr.latest().step == 20
    assert not any((mgr.staging.root / "dcp").iterdir())  # local staging is released

    reader = CloudStorageReader(mgr, cache_dir=tmp_path / "cache")
    assert reader.step == 20
    got = _empty()
    dcp.load(got, storage_reader=reader)
    assert _same(got, _state(20))
    older = _empty()
    dcp.load(older, storage_reader=CloudStorageReader(mgr, step="step-10"))
    assert _same(older, _state(10))
    assert not (tmp_path / "cache").exists()  # streamed: nothing written locally


def test_a_claiming_reader_fences_the_old_writer(s3_target, tmp_path):
    opts = s3_target.storage_options
    old = CheckpointManager(s3_target.url, storage_options=opts, staging_dir=tmp_path / "a")
    dcp.save(_state(1), storage_writer=CloudStorageWriter(old, step=1))
    new = DistributedCheckpointManager(
        s3_target.url, storage_options=opts, staging_dir=tmp_path / "b"
    )
    reader = CloudStorageReader(new, claim=True)  # resuming: fences the old writer
    got = _empty()
    dcp.load(got, storage_reader=reader)
    assert _same(got, _state(1))
    with pytest.raises(BaseException, match=r"FencedError|claimed by writer"):
        dcp.save(_state(2), storage_writer=CloudStorageWriter(old, step=2))
    with pytest.raises(BaseException, match=r"FencedError|claimed by writer"):  # stays fenced
        dcp.save(_state(3), storage_writer=CloudStorageWriter(old, step=3))
    dcp.save(_state(4), storage_writer=CloudStorageWriter(new, step=4))
    assert [c.step for c in new.list()] == [4, 1]
    old.close()
    new.close()


def test_a_damaged_checkpoint_is_skipped_for_an_older_one(mgr):
    dcp.save(_state(1), storage_writer=CloudStorageWriter(mgr, step=1))
    writer = CloudStorageWriter(mgr, step=2)
    dcp.save(_state(2), storage_writer=writer)
    key = writer.commit_info.ckpt + attempt_layout.FILES_DIR + METADATA_FILE
    data, _ = mgr.store.get(key)
    mgr.store.put(key, bytes([data[0] ^ 1]) + data[1:], mode=OVERWRITE)  # one flipped bit
    reader = CloudStorageReader(mgr)
    assert reader.step == 1
    assert [s.step for s in reader.skipped] == [2]
    assert "does not match its digest" in reader.skipped[0].reason
    got = _empty()
    dcp.load(got, storage_reader=reader)
    assert _same(got, _state(1))


def test_refusals(mgr):
    # No step: refused before anything is uploaded.
    with pytest.raises(BaseException, match="needs the step"):
        dcp.save(_state(1), storage_writer=CloudStorageWriter(mgr))
    with pytest.raises(ConfigurationError, match="is not a step"):
        CloudStorageWriter(mgr, step="latest")
    # Nothing committed yet: the reader says so, and dcp.load fails clearly.
    empty = CloudStorageReader(mgr)
    assert empty.step is None
    with pytest.raises(BaseException, match="no committed checkpoint"):
        dcp.load(_empty(), storage_reader=empty)
    # A checkpoint not written by DCP.
    with mgr.save(5) as d:
        (d / "f").write_bytes(b"x")
    mgr.wait()
    with pytest.raises(ConfigurationError, match="was not saved by DCP"):
        CloudStorageReader(mgr)
    # Writers hold threads and clients: DCP's process-based async executor cannot take one.
    with pytest.raises(TypeError, match="THREAD"):
        pickle.dumps(CloudStorageWriter(mgr, step=6))
    # DCP's plan caching reuses an old plan, which would name an old attempt: refused.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = DefaultSavePlanner(enable_plan_caching=True)
        dcp.save(_state(7), storage_writer=CloudStorageWriter(mgr, step=7), planner=planner)
        with pytest.raises(BaseException, match=r"[Pp]lan caching"):
            dcp.save(_state(7), storage_writer=CloudStorageWriter(mgr, step=8), planner=planner)
    assert mgr.latest().step == 7


def test_a_checkpoint_collected_while_the_reader_picks_it_gives_the_current_one(tmp_path):
    """Retention drops the checkpoint the reader is checking and GC deletes it (past the
    grace period on the store's clock) before the reader reads its ``.metadata``: the
    reader reads LATEST again and loads the current checkpoint."""
    import random

    from cloudckpt.gc import collect_garbage
    from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket
    from cloudckpt.testing.faults import Callback, FaultInjectingStore, Rule

    clock, name = ManualClock(), f"dcp-{random.getrandbits(32):08x}"
    store = MemoryStore(name, "run", clock=clock)
    writer = CheckpointManager(
        store, staging_dir=tmp_path / "w", keep_last=1, gc_grace=60, auto_gc=False
    )
    dcp.save(_state(1), storage_writer=CloudStorageWriter(writer, step=1))
    collected = []

    def train_and_collect() -> None:
        dcp.save(_state(2), storage_writer=CloudStorageWriter(writer, step=2))
        clock.advance(120)
        collected.extend(s for s, _ in collect_garbage(store).deleted_checkpoints)

    faulty = FaultInjectingStore(store)
    rule = faulty.add(
        Rule(Callback(before=train_and_collect), ops={"get_range"}, key=f"*/{METADATA_FILE}")
    )
    reader_mgr = CheckpointManager(faulty, staging_dir=tmp_path / "r", auto_gc=False)
    reader = CloudStorageReader(reader_mgr, cache_dir=tmp_path / "cache")
    assert rule.fired == 1 and collected == [1]
    assert reader.step == 2
    assert [(s.step, s.dropped) for s in reader.skipped] == [(1, True)]
    got = _empty()
    dcp.load(got, storage_reader=reader)
    assert _same(got, _state(2))
    reader_mgr.close()
    writer.close()
    drop_memory_bucket(name)


# ------------------------------------------------------------------------------ streaming


def _big(seed: int) -> dict:
    """Two 6 MiB tensors in one rank file: more than one 8 MiB chunk."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(1536, 1024, generator=g), "b": torch.randn(1536, 1024, generator=g)}


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_the_reader_streams_only_the_chunks_its_plan_needs(request, backend, tmp_path):
    target = request.getfixturevalue(f"{backend}_target")
    mgr = CheckpointManager(
        target.url, storage_options=target.storage_options, staging_dir=tmp_path / "s"
    )
    dcp.save(_big(1), storage_writer=CloudStorageWriter(mgr, step=1))
    reader = CloudStorageReader(mgr)
    shard = next(f for f in reader.manifest.files if f.path.endswith(".distcp"))
    assert len(shard.chunks) == 2
    only_a = {"a": torch.zeros(1536, 1024)}
    dcp.load(only_a, storage_reader=reader)
    assert torch.equal(only_a["a"], _big(1)["a"])
    # "a" lies in the first chunk (and, by its header, maybe the second): never all of it.
    stats = reader.read_stats
    assert 0 < stats.bytes_from_store < shard.size + 2 * 1024 * 1024
    everything = {"a": torch.zeros(1536, 1024), "b": torch.zeros(1536, 1024)}
    dcp.load(everything, storage_reader=CloudStorageReader(mgr))
    assert all(torch.equal(everything[k], v) for k, v in _big(1).items())
    mgr.close()


@pytest.mark.parametrize("chunking", ["tensor", "off"])
def test_the_reader_verifies_what_it_reads(memory_target, tmp_path, chunking):
    """A bit flipped in a rank's file after the reader chose the checkpoint: the load
    fails before any planned tensor is written (chunked: the chunk's SHA-256; whole file,
    ``chunking="off"``: the file's digest, checked before its items are decoded)."""
    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s", chunking=chunking)
    writer = CloudStorageWriter(mgr, step=1)
    dcp.save(_big(1), storage_writer=writer)
    reader = CloudStorageReader(mgr)
    shard = next(f for f in reader.manifest.files if f.path.endswith(".distcp"))
    if chunking == "off":
        assert shard.chunks is None
        key = writer.commit_info.ckpt + attempt_layout.FILES_DIR + shard.path
    else:
        key = shard.chunks[0].key
    flip_bit(mgr.store, key, bit=8 * 4096)  # inside "a"
    got = {"a": torch.zeros(1536, 1024), "b": torch.zeros(1536, 1024)}
    with pytest.raises(BaseException, match="does not match its digest"):
        dcp.load(got, storage_reader=reader)
    assert not got["a"].any() and not got["b"].any()  # nothing of it reached the tensors
    mgr.close()


def test_a_missing_chunk_fails_the_load(memory_target, tmp_path):
    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    dcp.save(_big(1), storage_writer=CloudStorageWriter(mgr, step=1))
    reader = CloudStorageReader(mgr)
    shard = next(f for f in reader.manifest.files if f.path.endswith(".distcp"))
    mgr.store.delete(shard.chunks[-1].key)
    with pytest.raises(BaseException, match="missing"):
        dcp.load(
            {"a": torch.zeros(1536, 1024), "b": torch.zeros(1536, 1024)}, storage_reader=reader
        )
    mgr.close()


def test_a_small_read_window_loads_in_batches(memory_target, tmp_path):
    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    dcp.save(_big(2), storage_writer=CloudStorageWriter(mgr, step=1))
    reader = CloudStorageReader(mgr, read_window_bytes=1024)
    got = {"a": torch.zeros(1536, 1024), "b": torch.zeros(1536, 1024)}
    dcp.load(got, storage_reader=reader)
    assert all(torch.equal(got[k], v) for k, v in _big(2).items())
    mgr.close()


def _windows(seed: int) -> dict:
    """Four 4 MiB tensors in one rank file: two 8 MiB chunks, four read windows of 1 KiB."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(1024, 1024, generator=g) for k in "abcd"}


@pytest.mark.parametrize("chunking", ["tensor", "fixed"])
def test_a_damaged_later_window_leaves_every_planned_tensor_untouched(
    memory_target, tmp_path, chunking
):
    """A file several read windows long whose last chunk is damaged: the load fails with
    the caller's tensors as they were (on main the first windows were already applied)."""
    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s", chunking=chunking)
    dcp.save(_windows(1), storage_writer=CloudStorageWriter(mgr, step=1))
    reader = CloudStorageReader(mgr, read_window_bytes=1024)
    shard = next(f for f in reader.manifest.files if f.path.endswith(".distcp"))
    assert len(shard.chunks) >= 2
    flip_bit(mgr.store, shard.chunks[-1].key, bit=8 * 4096)  # inside the last tensor
    got = {k: torch.zeros(1024, 1024) for k in "abcd"}
    with pytest.raises(BaseException, match="does not match its digest"):
        dcp.load(got, storage_reader=reader)
    assert not any(t.any() for t in got.values())  # nothing of it reached the tensors
    mgr.close()


def test_a_fallback_in_windows_overwrites_every_planned_tensor(memory_target, tmp_path):
    """Step 2 lost a later chunk before the reader chose: it loads step 1, every planned
    tensor of it, window by window."""
    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s", chunking="fixed")
    for step in (1, 2):
        dcp.save(_windows(step), storage_writer=CloudStorageWriter(mgr, step=step))
    shard = next(
        f
        for f in fetch_manifest(mgr.store, read_latest(mgr.store).latest.current).files
        if f.path.endswith(".distcp")
    )
    mgr.store.delete(shard.chunks[-1].key)
    reader = CloudStorageReader(mgr, read_window_bytes=1024)
    assert reader.step == 1 and [s.step for s in reader.skipped] == [2]
    got = {k: torch.full((1024, 1024), 7.0) for k in "abcd"}
    dcp.load(got, storage_reader=reader)
    assert all(torch.equal(got[k], v) for k, v in _windows(1).items())
    mgr.close()


def test_a_chunk_list_that_is_not_the_file_fails_the_load_untouched(memory_target, tmp_path):
    """Every chunk intact and the manifest consistent with LATEST (re-sealed), but its chunk
    list swaps two leaves of the rank file: the partial read checks the file's digest from
    the chunk list before it reads anything, and applies nothing."""
    import hashlib
    import json

    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s", chunking="fixed")
    dcp.save(_windows(1), storage_writer=CloudStorageWriter(mgr, step=1))
    latest = json.loads(mgr.store.get(protocol.LATEST_KEY)[0])
    record = latest["current"]
    key = record["ckpt"] + attempt_layout.MANIFEST_NAME
    body = json.loads(mgr.store.get(key)[0])
    shard = next(f for f in body["files"] if f["path"].endswith(".distcp"))
    assert shard["chunks"][0][2] == shard["chunks"][1][2]  # two whole leaves
    shard["chunks"][0], shard["chunks"][1] = shard["chunks"][1], shard["chunks"][0]
    manifest = canonical.seal(body)
    mgr.store.put(key, manifest, mode=OVERWRITE)
    latest["current"] = {
        **record,
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        "manifest_size": len(manifest),
    }
    mgr.store.put(protocol.LATEST_KEY, canonical.seal(latest), mode=OVERWRITE)
    for window in (1024, 1 << 30):
        reader = CloudStorageReader(mgr, read_window_bytes=window)
        got = {k: torch.zeros(1024, 1024) for k in "abcd"}
        with pytest.raises(BaseException, match="its chunks are not the file"):
            dcp.load(got, storage_reader=reader)
        assert not any(t.any() for t in got.values())
    mgr.close()
