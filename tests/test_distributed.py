"""Multi-rank checkpoints (cloudckpt.distributed) under torchrun, against the moto server.

The 2-rank jobs are launched with ``python -m torch.distributed.run --nproc_per_node=2``
(gloo, CPU, loopback only); each rank writes JSON events (tests/scripts/dist_ckpt.py) and
the tests check them against what the store holds. To keep the slow torchrun start-ups
few, one job checks many things (tests/scripts/distrun.py, shared with test_dcp.py), and
the two kill jobs run side by side:

- ``main``: a multi-rank save commits once with both ranks' files; a rank whose upload
  fails, or whose ``save()`` block raises, means no commit and the same error on every
  rank at once; colliding paths are refused;
  a new job resumes once per node; a restore where each rank is its own node.
- ``kill``: rank 1 stalls after its first uploaded file; the test SIGKILLs it (a dead rank)
  or SIGSTOPs it (a hung rank). No commit lands, the previous checkpoint stays current,
  and the surviving rank raises a clear ``CollectiveError`` at once (dead peer) or within
  the collective timeout (hung peer), never hanging.

Single-process behaviour (world size 1, no process group) is tested in-process.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from distrun import Launch, main_run

from cloudckpt import (
    CommitInfo,
    ConfigurationError,
    DestinationNotEmptyError,
    attempt_layout,
    digest,
    protocol,
)
from cloudckpt.committer import read_latest
from cloudckpt.distributed import (
    WORLD_SIZE_KEY,
    DistributedCheckpointManager,
    DistributedRestoreResult,
    RankFailedError,
    rank_dir,
)
from cloudckpt.distributed._save import find_collision as _find_collision
from cloudckpt.errors import StoreError
from cloudckpt.reader import fetch_manifest
from cloudckpt.stores import open_store

KILL_TIMEOUT = 8.0  # the kill jobs' collective timeout, seconds


def payload(rank: int) -> bytes:
    """What rank ``rank`` saves as shard.bin in the main job (see dist_ckpt.py)."""
    return f"shard of rank {rank} ".encode() * (1000 * (rank + 1))


@pytest.fixture(scope="module")
def run(moto_server, tmp_path_factory):
    return main_run(moto_server, tmp_path_factory)


@pytest.fixture
def store(run):
    s = open_store(run["url"], run["options"])
    yield s
    s.close()


def attempts(store, step: int) -> dict[str, list[str]]:
    """Attempt prefix -> object names under it, for the attempts of ``step``."""
    found: dict[str, list[str]] = {}
    for obj in store.list(attempt_layout.CKPT_PREFIX):
        prefix = "/".join(obj.key.split("/")[:2]) + "/"
        parsed = attempt_layout.parse_ckpt_prefix(prefix)
        if parsed and parsed[0] == step:
            found.setdefault(prefix, []).append(obj.key[len(prefix) :])
    return found


def commit_records(store) -> list[protocol.Latest]:
    out = []
    for obj in sorted(store.list(protocol.COMMITS_PREFIX), key=lambda o: o.key):
        out.append(protocol.parse_latest(store.get(obj.key)[0]))
    return out


# ------------------------------------------------------------------------------ 2 ranks


def test_a_multi_rank_save_commits_once_with_every_ranks_files(run, store):
    main = run["main"]
    saved = [main.one(r, "saved", step=1) for r in (0, 1)]
    assert saved[0]["commit_id"] == saved[1]["commit_id"] and saved[0]["seq"] == saved[1]["seq"]
    assert saved[0]["num_files"] == 4

    # One attempt prefix for the step, shared by both ranks; ATTEMPT.json from rank 0 only;
    # the ranks' files stored as chunks (chunking is on by default).
    (prefix, names), *others = attempts(store, 1).items()
    assert not others
    chunk_names = {n for n in names if n.startswith(attempt_layout.CHUNKS_DIR)}
    assert sorted(set(names) - chunk_names) == sorted(
        [attempt_layout.ATTEMPT_NAME, attempt_layout.MANIFEST_NAME]
    )

    latest = read_latest(store).latest
    record = next(r for r in latest.retained() if r.step == 1)
    assert record.commit_id == saved[0]["commit_id"] and record.ckpt == prefix
    assert record.metadata == {"loss": 0.5, WORLD_SIZE_KEY: 2}
    manifest = fetch_manifest(store, record)
    files = {f.path: f for f in manifest.files}
    assert sorted(files) == [
        f"{rank_dir(r)}/{name}" for r in (0, 1) for name in ("extra.pt", "shard.bin")
    ]
    named = {c.key for f in manifest.files for c in f.chunks}
    assert named == {prefix + n for n in chunk_names}  # 4 files, each one chunk of its own
    assert len(named) == 4
    for rank in (0, 1):
        shard = files[f"{rank_dir(rank)}/shard.bin"]
        assert shard.size == len(payload(rank))
        assert shard.digest == digest.tree_digest(payload(rank))

    # Exactly one write of LATEST made step 1 current, by the first job's single writer.
    commits = [c for c in commit_records(store) if c.op == "commit" and c.current.step == 1]
    assert len(commits) == 1 and commits[0].current.commit_id == record.commit_id


def test_multi_rank_saves_upload_only_the_chunks_that_changed(run):
    """Issue 30 item 1, with 2 real ranks (``scenario_chunks``): step 2, whose frozen files
    are unchanged on both ranks, stores only each rank's changed file (counted from what
    the store holds under step 2's attempt); a chunk step 2 reused, deleted before step
    3, is uploaded again by a second attempt of step 3 and never named while missing;
    every step restores bit-exact on both ranks."""
    main = run["main"]
    store = open_store(run["url"] + "-chunks", run["options"])
    try:
        latest = read_latest(store).latest
        records = {r.step: r for r in latest.retained()}
        assert sorted(records) == [1, 2, 3]
        manifests = {step: fetch_manifest(store, r) for step, r in records.items()}
        sizes = {step: _chunk_objects(store, r.ckpt) for step, r in records.items()}

        # Step 1 stored everything (less the chunk deleted before step 3); step 2 only the
        # two changing.bin files, naming the frozen chunks in step 1's attempt.
        (deleted,) = [e["key"] for e in main.events(0, "chunk-deleted")]
        (lost,) = [c for f in manifests[1].files for c in f.chunks if c.key == deleted]
        assert sum(sizes[1].values()) + lost.size == manifests[1].total_bytes
        changing = [f.size for f in manifests[2].files if f.path.endswith("changing.bin")]
        assert sorted(sizes[2].values()) == sorted(changing) and len(changing) == 2
        frozen2 = [c for f in manifests[2].files if "frozen" in f.path for c in f.chunks]
        assert len(frozen2) == 6 and {c.owner for c in frozen2} == {records[1].ckpt}

        # Step 3: the deleted chunk is not named where it was; it was uploaded again, by
        # the second of step 3's attempts (the first is an orphan left for GC).
        named3 = {c.key: c for f in manifests[3].files for c in f.chunks}
        assert deleted not in named3 and not store.exists(deleted)
        assert all(store.exists(k) for k in named3)
        again = [c for c in named3.values() if c.key.endswith(deleted.rsplit("/", 1)[1])]
        assert [c.owner for c in again] == [records[3].ckpt]
        assert len(attempts(store, 3)) == 2
        assert sorted(sizes[3].values()) == sorted(
            [again[0].size, *(f.size for f in manifests[3].files if "changing" in f.path)]
        )
    finally:
        store.close()
    for rank in (0, 1):
        saved = [e["step"] for e in main.events(rank, "chunks-saved")]
        assert saved == [1, 2, 3]
        restored = main.events(rank, "chunks-restored")
        assert [(e["step"], e["exact"]) for e in restored] == [(s, True) for s in (1, 2, 3)]


def test_a_failed_rank_means_no_commit_and_the_same_error_everywhere(run, store):
    main = run["main"]
    for rank in (0, 1):
        failed = main.one(rank, "save-failed", step=4)
        assert failed["type"] == "RankFailedError"
        assert "step 4 was not committed" in failed["message"]
        assert failed["failures"] == {"1": "StoreError: injected upload failure on rank 1"}
    latest = read_latest(store).latest
    assert 4 not in {r.step for r in latest.retained()}
    assert all(t.record.step != 4 for t in latest.tombstones)
    # The coordinator opened the attempt and rank 0 uploaded; no manifest was written.
    ((_, names),) = attempts(store, 4).items()
    assert attempt_layout.ATTEMPT_NAME in names and attempt_layout.MANIFEST_NAME not in names
    # Rank 0's one chunk (b"doomed"; rank 1 failed before uploading the same bytes).
    assert len([n for n in names if n.startswith(attempt_layout.CHUNKS_DIR)]) == 1


def test_a_rank_whose_block_raises_fails_the_save_everywhere_at_once(run, store):
    for rank in (0, 1):
        failed = run["main"].one(rank, "save-failed", step=6)
        assert failed["type"] == "RankFailedError"
        assert (
            "rank 1: CloudCkptError: its save() block raised RuntimeError: the model refused "
            "to serialize" in failed["message"]
        )
        assert failed["seconds"] < 10  # not the 30 s collective timeout
    assert not attempts(store, 6)  # refused before the attempt was opened


def test_colliding_user_paths_are_refused_before_anything_is_uploaded(run):
    main = run["main"]
    for rank in (0, 1):
        failed = main.one(rank, "save-failed", step="collide")
        assert failed["type"] == "ConfigurationError"
        assert "ranks 0 and 1 both write 'same.bin'" in failed["message"]
    other = open_store(run["url"] + "-collide", run["options"])
    try:
        assert list(other.list("")) == []  # not even a claim
    finally:
        other.close()


def test_resume_claims_on_rank_0_and_downloads_once_per_node(run, store):
    main = run["main"]
    resumed = [main.one(r, "resumed") for r in (0, 1)]
    step1 = main.one(0, "saved", step=1)
    for r in resumed:
        assert r["step"] == 1 and r["commit_id"] == step1["commit_id"]
        assert r["ok"] and r["saved_world_size"] == 2
        assert r["files"] == [
            "rank-00000/extra.pt",
            "rank-00000/shard.bin",
            "rank-00001/extra.pt",
            "rank-00001/shard.bin",
        ]
    record = next(r for r in read_latest(store).latest.retained() if r.step == 1)
    assert resumed[0]["downloaded"] == record.total_bytes  # the node leader fetched it all
    assert resumed[1]["downloaded"] == 0  # and rank 1 read the leader's copy
    # Only rank 0 claimed: one epoch bump over the first job's.
    assert read_latest(store).latest.writer.epoch == 2
    claims = [c for c in commit_records(store) if c.op == "claim"]
    assert [c.writer.epoch for c in claims] == [1, 2]

    # As if each rank were its own node: each downloads only its own directory.
    for rank in (0, 1):
        split = main.one(rank, "restored-split")
        assert split["ok"]
        assert split["files"] == [f"{rank_dir(rank)}/extra.pt", f"{rank_dir(rank)}/shard.bin"]


def test_a_restore_at_world_size_1_fetches_every_ranks_files(run):
    restored = run["load1"].one(0, "restored")
    assert restored["saved_world_size"] == 2
    assert len(restored["files"]) == 4
    assert restored["shards"] == [hashlib.sha256(payload(r)).hexdigest() for r in (0, 1)]


# ------------------------------------------------------------------------------ kills


@pytest.fixture(scope="module")
def kills(moto_server, tmp_path_factory):
    """Two 2-rank jobs side by side; in each, rank 1 stalls mid-upload of step 2 and is
    then SIGKILLed (dead) or SIGSTOPped (hung). Returns what happened to each."""
    work = tmp_path_factory.mktemp("dist-kill")
    jobs = {}
    for how in ("sigkill", "sigstop"):
        bucket = f"kill-{how}-{os.urandom(3).hex()}"
        moto_server.create_bucket(bucket)
        url = f"s3://{bucket}/run"
        jobs[how] = (
            url,
            Launch(
                "kill",
                url,
                work / how,
                moto_server.storage_options(),
                extra=("--timeout", str(KILL_TIMEOUT)),
            ),
        )
    out = {}
    try:
        waiting, deadline = dict(jobs), time.monotonic() + 120
        while waiting:  # signal each job's rank 1 as soon as it stalls
            for how, (url, job) in list(waiting.items()):
                stalled = job.work / "stalled.json"
                if stalled.exists():
                    victim = json.loads(stalled.read_text())["pid"]
                    os.kill(victim, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
                    out[how] = {"url": url, "job": job, "victim": victim, "at": time.time()}
                    del waiting[how]
                elif job.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"rank 1 of {how} never stalled:\n{job.log_tail()}")
            time.sleep(0.02)
        job = out["sigstop"]["job"]
        job.wait_for(lambda: job.events(0, "save-failed"), 60, "rank 0's error")
        os.kill(out["sigstop"]["victim"], signal.SIGKILL)  # done with it; torchrun may finish
        for how in jobs:
            out[how]["rc"] = out[how]["job"].wait(60)
    finally:
        for _, job in jobs.values():
            job.kill()
    return out


@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_a_dead_or_hung_rank_leaves_no_commit_and_the_survivor_fails_clearly(
    kills, moto_server, how
):
    job, url = kills[how]["job"], kills[how]["url"]
    assert kills[how]["rc"] != 0  # torchrun reports the failed job
    assert job.one(0, "saved", step=1) and job.one(1, "saved", step=1)
    failed = job.one(0, "save-failed", step=2)
    assert failed["type"] == "CollectiveError"
    assert "rank 0 lost contact with the other ranks while uploading step 2" in failed["message"]
    # It names the rank: rank 1 never reached the heartbeat the survivor failed in (it was
    # stopped before its first one: its last collective opened the save).
    assert (
        "rank 1 never reached it (its last: 'starting the save of step 2')" in (failed["message"])
    )
    waited = failed["at"] - kills[how]["at"]  # from the signal to the survivor's error
    if how == "sigkill":  # gloo sees the closed connection at once
        assert waited < KILL_TIMEOUT / 2
    else:  # a hung peer: the collective timeout ends the wait
        assert "Timed out" in failed["message"]
        assert KILL_TIMEOUT - 1.5 <= waited < KILL_TIMEOUT + 5
    # The group is unusable now: further saves are refused at once, with the same error.
    assert job.one(0, "refused")["type"] == "CollectiveError"
    assert job.one(0, "exit")

    store = open_store(url, moto_server.storage_options())
    try:
        latest = read_latest(store).latest
        assert latest.current.step == 1 and not latest.history
        ((_, names),) = attempts(store, 2).items()
        assert attempt_layout.MANIFEST_NAME not in names  # the attempt never got a manifest
        # though rank 0 had uploaded its part-0.bin (one chunk)
        assert any(n.startswith(attempt_layout.CHUNKS_DIR) for n in names)
    finally:
        store.close()


# ------------------------------------------------------------------------------ 1 process


def test_single_process_save_and_resume(memory_target, tmp_path):
    mgr = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s", timeout=5)
    assert (mgr.rank, mgr.world_size, mgr.is_coordinator, mgr.local_ranks) == (0, 1, True, (0,))
    assert mgr.resume(tmp_path / "empty") is None
    handle = mgr.save(3, metadata={"k": 1})
    with handle as d:
        (d / "sub").mkdir()
        (d / "sub" / "a.bin").write_bytes(b"abc")
    info = handle.result(timeout=30)
    assert isinstance(info, CommitInfo) and info.num_files == 1
    assert (tmp_path / "s" / "rank-00000").is_dir()  # each rank stages in its own directory
    mgr.close()

    again = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s2")
    res = again.resume(tmp_path / "r")
    assert isinstance(res, DistributedRestoreResult)
    assert res.step == 3 and res.saved_world_size == 1
    assert res.metadata == {"k": 1, WORLD_SIZE_KEY: 1}
    assert (res.rank_path / "sub" / "a.bin").read_bytes() == b"abc"
    again.close()


def test_user_paths_and_a_failed_upload_in_a_single_process(memory_target, tmp_path):
    mgr = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path, per_rank_dirs=False)

    def failing(*args, **kwargs):
        raise StoreError("injected")

    mgr.attempts.upload_chunks = failing  # a rank's chunked upload (chunking is on)
    handle = mgr.save(1)
    with handle as d:
        (d / "model.bin").write_bytes(b"m")
    with pytest.raises(RankFailedError, match="rank 0: StoreError: injected") as err:
        handle.result(timeout=30)
    assert err.value.failures == {0: "StoreError: injected"}
    assert isinstance(err.value.__cause__, StoreError)
    del mgr.attempts.upload_chunks  # a rank failure does not break the manager
    abandoned = mgr.save(2)
    with pytest.raises(ValueError), abandoned as d:
        raise ValueError("boom")
    with pytest.raises(RankFailedError, match=r"block raised ValueError: boom"):
        abandoned.result(timeout=30)
    with mgr.save(2) as d:
        (d / "model.bin").write_bytes(b"m2")
    mgr.wait()
    assert mgr.latest().step == 2
    restored = mgr.restore(tmp_path / "r")
    assert (restored.path / "model.bin").read_bytes() == b"m2"
    with pytest.raises(DestinationNotEmptyError):  # checked before anything is claimed
        mgr.resume(tmp_path / "r")
    mgr.close()


def test_arguments_that_would_misalign_ranks_are_refused(memory_target, tmp_path):
    with pytest.raises(ConfigurationError, match="backpressure='block'"):
        DistributedCheckpointManager(memory_target.url, backpressure="drop_oldest")
    with pytest.raises(ConfigurationError, match="timeout"):
        DistributedCheckpointManager(memory_target.url, timeout=0)


@pytest.mark.parametrize(
    ("paths", "problem"),
    [
        ([["a", "b"], ["c"]], None),
        ([["rank-00000/a"], ["rank-00001/a"]], None),
        ([["a"], ["b", "a"]], "ranks 0 and 1 both write 'a'"),
        ([["x/y"], ["x"]], "rank 1 writes the file 'x', but rank 0 writes 'x/y'"),
    ],
)
def test_collisions_between_ranks(paths, problem):
    found = _find_collision(paths)
    assert found == problem if problem is None else problem in found


def test_a_rank_rebuilds_every_error_class_by_name():
    """An error crosses ranks as a typed RankError; the receiving rank rebuilds the same
    cloudckpt.errors class (CorruptRecordError, ActiveWriterError, RankFailedError and
    CollectiveError moved there for this), never crashing on one it cannot rebuild."""
    import cloudckpt.errors as errors
    from cloudckpt.distributed._comm import RankError

    classes = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.CloudCkptError)
    ]
    for name in ("CorruptRecordError", "ActiveWriterError", "RankFailedError", "CollectiveError"):
        assert name in {c.__name__ for c in classes}
    for cls in classes:
        try:
            original = cls("it broke", hint="do this")
        except TypeError:  # needs more than a message (MissingDependencyError's extra)
            original = None
        sent = RankError.of(original or ValueError("it broke"), rank=3)
        sent = RankError(sent.rank, cls.__name__, "it broke", "do this", sent.damaged)
        rebuilt = sent.rebuild()
        if original is not None:
            assert type(rebuilt) is cls, cls
            assert (rebuilt.message, rebuilt.hint) == ("it broke", "do this")
        else:
            assert type(rebuilt) is errors.CloudCkptError
            assert rebuilt.message == f"{cls.__name__}: it broke"
    foreign = RankError.of(KeyError("k"), rank=1)
    assert foreign.summary == "rank 1: KeyError: 'k'"
    assert type(foreign.rebuild()) is errors.CloudCkptError
    assert RankError.of(errors.MissingChunkError("gone"), rank=0).damaged


# ------------------------------------------------------------------------------ chunks, 1 process


def _chunk_objects(store, prefix: str) -> dict[str, int]:
    """Chunk key -> size, for the chunks stored under the attempt ``prefix``."""
    where = prefix + attempt_layout.CHUNKS_DIR
    return {o.key: o.size for o in store.list(where)}


def test_a_multi_rank_save_reuploads_a_reused_chunk_that_is_gone(memory_target, tmp_path):
    """Issue 30 item 1: a rank names the chunks of the checkpoint the save builds on; one
    of them deleted meanwhile is found by the coordinator's pre-commit listing, and every
    rank saves again (new attempt) uploading it: no commit names a missing chunk."""
    store = open_store(memory_target.url)
    frozen = os.urandom(300_000)
    mgr = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s", auto_gc=False)
    with mgr.save(1) as d:
        (d / "base.bin").write_bytes(frozen)
        (d / "adapter.bin").write_bytes(b"one")
    mgr.wait()
    step1 = fetch_manifest(store, read_latest(store).latest.current)
    (lost,) = [c for f in step1.files for c in f.chunks if f.path.endswith("base.bin")]
    store.delete(lost.key)  # gone from the store; the rank's index still has it

    for step in (2, 3):
        with mgr.save(step) as d:
            (d / "base.bin").write_bytes(frozen)
            (d / "adapter.bin").write_bytes(b"%d" % step)
        mgr.wait()
        record = read_latest(store).latest.current
        assert record.step == step
        named = {c.key for f in fetch_manifest(store, record).files for c in f.chunks}
        assert lost.key not in named and all(store.exists(k) for k in named)
    # Step 2 uploaded the lost chunk again, in its second attempt (the first is an orphan);
    # step 3 uploaded only its adapter, reusing that copy.
    assert len(attempts(store, 2)) == 2
    ((step3, _),) = attempts(store, 3).items()
    assert list(_chunk_objects(store, step3).values()) == [1]
    res = mgr.restore(tmp_path / "out")
    assert res.step == 3
    assert (res.rank_path / "base.bin").read_bytes() == frozen
    assert (res.rank_path / "adapter.bin").read_bytes() == b"3"
    mgr.close()
    store.close()


def test_a_multi_rank_commit_requires_the_sources_of_reused_chunks(
    memory_target, tmp_path, monkeypatch
):
    """The ranks report which checkpoints their reused chunks come from, and the commit
    requires them retained: a source dropped meanwhile (as by an unpin) refuses the commit
    and every rank saves again in full, naming no older chunk; ``CommitInfo`` counts what
    both tries sent."""
    from cloudckpt import chunks
    from cloudckpt.errors import ChunkSourceDroppedError

    store = open_store(memory_target.url)
    frozen = os.urandom(100_000)
    mgr = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s", auto_gc=False)
    with mgr.save(1) as d:
        (d / "base.bin").write_bytes(frozen)
    mgr.wait()
    step1 = read_latest(store).latest.current.commit_id
    real = chunks.UploadStats.requires
    refused = []

    def dropped_once(self, base):
        if step1 in self.sources and not refused:
            refused.append(True)
            raise ChunkSourceDroppedError(f"checkpoint {step1} is no longer retained")
        return real(self, base)

    monkeypatch.setattr(chunks.UploadStats, "requires", dropped_once)
    handle = mgr.save(2)
    with handle as d:
        (d / "base.bin").write_bytes(frozen)
        (d / "new.bin").write_bytes(b"two")
    info = handle.result()
    record = read_latest(store).latest.current
    assert refused and record.step == 2
    owners = {c.owner for f in fetch_manifest(store, record).files for c in f.chunks}
    assert owners == {record.ckpt}  # everything uploaded again under the retry's attempt
    tries = attempts(store, 2)
    assert len(tries) == 2
    # bytes_uploaded counts what both tries put (the first: new.bin; the second: all),
    # as the store holds it; bytes_reused, what the committed try named (nothing).
    sent = sum(sum(_chunk_objects(store, prefix).values()) for prefix in tries)
    assert info.bytes_uploaded == sent == 3 + info.total_bytes and info.bytes_reused == 0
    res = mgr.restore(tmp_path / "out")
    assert (res.rank_path / "base.bin").read_bytes() == frozen
    mgr.close()
    store.close()


def test_a_multi_rank_save_refused_twice_fails_clearly(memory_target, tmp_path, monkeypatch):
    """Reused chunks missing at both tries: the save raises ReusedChunkMissingError (on
    every rank), nothing is committed, and the manager takes the next save."""
    from cloudckpt import chunks
    from cloudckpt.errors import ReusedChunkMissingError

    store = open_store(memory_target.url)
    mgr = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s", auto_gc=False)
    with mgr.save(1) as d:
        (d / "a.bin").write_bytes(b"a" * 5000)
    mgr.wait()

    def always_missing(store, prefix, entries):
        raise ReusedChunkMissingError("injected: gone", missing=frozenset({"x"}))

    monkeypatch.setattr(chunks, "check_uploaded", always_missing)
    handle = mgr.save(2)
    with handle as d:
        (d / "a.bin").write_bytes(b"a" * 5000)
    with pytest.raises(ReusedChunkMissingError, match="injected"):
        handle.result(timeout=30)
    assert read_latest(store).latest.current.step == 1
    assert len(attempts(store, 2)) == 2  # the first try and the retry, both left for GC
    monkeypatch.undo()
    with mgr.save(3) as d:
        (d / "a.bin").write_bytes(b"a" * 5000)
    mgr.wait()
    assert read_latest(store).latest.current.step == 3
    mgr.close()
    store.close()
