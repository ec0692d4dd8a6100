"""Resume in seconds (issue 23): ``load_state`` / ``resume_state`` straight from the store
into memory, every byte verified, falling back past damage; the local tier (a verified
staged copy of the committed checkpoint: zero bytes downloaded); the GPU path's ordering,
with the device abstracted so it runs on CPU.

Against the in-memory store (protocol faults) and moto (a real S3 server, real HTTP).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import shutil
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from torch_states import tied_state  # noqa: E402

from cloudckpt import CheckpointManager, attempt_layout, failpoints  # noqa: E402
from cloudckpt.committer import read_latest  # noqa: E402
from cloudckpt.errors import (  # noqa: E402
    CheckpointNotFoundError,
    CloudCkptError,
    CorruptionError,
    PermissionDeniedError,
)
from cloudckpt.integrations import _torch_restore as tr  # noqa: E402
from cloudckpt.integrations.torch import (  # noqa: E402
    LoadReport,
    load_state,
    resume_state,
    save_state,
)
from cloudckpt.localcopy import COMMITTED_DIR  # noqa: E402
from cloudckpt.reader import fetch_manifest  # noqa: E402
from cloudckpt.stores import open_store  # noqa: E402
from cloudckpt.testing.faults import (  # noqa: E402
    FailBefore,
    Fault,
    FaultInjectingStore,
    Rule,
    flip_bit,
)
from cloudckpt.transfer import MemoryFile  # noqa: E402

MiB = 1024 * 1024


def _state(seed: int) -> dict:
    """A state with big tensors (own chunks), small packed ones, odd dtypes, a tie,
    plain values and a pickled leaf."""
    return {**tied_state(seed), "counts": collections.Counter(a=seed)}


def _same(a: dict, b: dict) -> bool:
    ma, mb = a["model"], b["model"]
    return (
        all(torch.equal(ma[k], mb[k]) and ma[k].dtype == mb[k].dtype for k in mb)
        and ma["tied"] is ma["w"]
        and a["step"] == b["step"]
        and a["counts"] == b["counts"]
    )


def _tensors_key(store, record, which: str = "last") -> str:
    """A stored object of the record's tensors.safetensors that no other checkpoint
    shares (a chunk it stored first, or the whole file)."""
    entry = next(f for f in fetch_manifest(store, record).files if f.path == "tensors.safetensors")
    if entry.chunks is None:
        return record.ckpt + attempt_layout.FILES_DIR + entry.path
    own = [c for c in entry.chunks if c.owner == record.ckpt]
    return (own[-1] if which == "last" else own[0]).key


def _two_checkpoints(target, manager_factory, chunking="tensor", **kwargs):
    mgr = manager_factory(target, chunking=chunking, **kwargs)
    for step in (1, 2):
        save_state(mgr, step, _state(step)).result(timeout=60)
    return mgr


# ------------------------------------------------------------------------------ from the store


@pytest.mark.parametrize("chunking", ["tensor", "off"])
def test_a_new_host_loads_the_state_from_the_store_verified(s3_target, manager_factory, chunking):
    _two_checkpoints(s3_target, manager_factory, chunking)
    report = LoadReport()
    state = load_state(
        s3_target.url,
        storage_options=s3_target.storage_options,
        weights_only=False,
        report=report,
    )
    assert _same(state, _state(2))
    assert report.step == 2 and report.skipped == ()
    assert report.bytes_downloaded >= report.total_bytes > 6 * MiB  # every byte read
    assert report.bytes_local == 0 and report.source == "store"
    assert report.requests > 1
    assert report.total_s >= report.listing_s + report.transfer_s + report.verify_s


def test_load_state_of_a_step_and_of_an_empty_run(memory_target, manager_factory):
    mgr = _two_checkpoints(memory_target, manager_factory)
    assert _same(load_state(memory_target.url, step=1, weights_only=False), _state(1))
    with pytest.raises(CheckpointNotFoundError):
        load_state(memory_target.url, step=7)
    with pytest.raises(CheckpointNotFoundError):
        load_state(memory_target.url + "-empty")
    assert mgr.latest().step == 2


@pytest.mark.parametrize("chunking", ["tensor", "fixed", "off"])
def test_a_flipped_byte_falls_back_and_no_damaged_tensor_reaches_the_caller(
    s3_target, manager_factory, chunking
):
    _two_checkpoints(s3_target, manager_factory, chunking)
    store = open_store(s3_target.url, s3_target.storage_options)
    current = read_latest(store).latest.current
    flip_bit(store, _tensors_key(store, current), seed=3)
    report = LoadReport()
    state = load_state(store, weights_only=False, report=report)
    # Step 2's tensors were allocated and partly filled, then dropped: what comes back is
    # step 1, every tensor of it.
    assert _same(state, _state(1))
    assert report.step == 1 and [s.step for s in report.skipped] == [2]
    assert "digest" in report.skipped[0].reason
    store.close()


def test_a_flipped_byte_in_the_header_falls_back(memory_target, manager_factory):
    mgr = _two_checkpoints(memory_target, manager_factory, "off")
    current = read_latest(mgr.store).latest.current
    key = _tensors_key(mgr.store, current)
    flip_bit(mgr.store, key, bit=8 * 20)  # inside the JSON header
    state = load_state(mgr.store, weights_only=False)
    assert _same(state, _state(1))


def test_a_missing_chunk_falls_back(s3_target, manager_factory):
    _two_checkpoints(s3_target, manager_factory)
    store = open_store(s3_target.url, s3_target.storage_options)
    current = read_latest(store).latest.current
    store.delete(_tensors_key(store, current, "first"))
    report = LoadReport()
    state = load_state(store, weights_only=False, report=report)
    assert _same(state, _state(1)) and [s.step for s in report.skipped] == [2]
    assert "missing" in report.skipped[0].reason
    store.close()


def test_every_checkpoint_damaged_raises_and_returns_nothing(memory_target, manager_factory):
    mgr = _two_checkpoints(memory_target, manager_factory)
    latest = read_latest(mgr.store).latest
    for record in latest.retained():
        flip_bit(mgr.store, _tensors_key(mgr.store, record))
    with pytest.raises(CorruptionError) as err:
        load_state(mgr.store)
    assert [s.step for s in err.value.skipped] == [2, 1]


def test_a_damaged_response_is_read_again_not_taken_for_damage(memory_target, manager_factory):
    """A chunk that arrives damaged once (a bad proxy) is read again: no fallback."""
    mgr = _two_checkpoints(memory_target, manager_factory)
    key = _tensors_key(mgr.store, read_latest(mgr.store).latest.current)

    class Garbled(Fault):
        name = "garble"

        def run(self, call, op, k, store):
            data = bytearray(call())
            data[0] ^= 1
            return bytes(data)

    faulty = FaultInjectingStore(mgr.store)
    rule = faulty.add(Rule(Garbled(), ops={"get_range"}, key=key, times=1))
    report = LoadReport()
    assert _same(load_state(faulty, weights_only=False, report=report), _state(2))
    assert rule.fired == 1 and report.skipped == ()


def test_a_store_failure_is_not_damage(memory_target, manager_factory):
    mgr = _two_checkpoints(memory_target, manager_factory)
    faulty = FaultInjectingStore(mgr.store)
    rule = faulty.add(
        Rule(FailBefore(PermissionDeniedError), ops={"get_range"}, key="*/chunks/*", times=None)
    )
    with pytest.raises(PermissionDeniedError):
        load_state(faulty)
    assert rule.fired >= 1


def test_a_checkpoint_not_written_by_save_state_is_refused(memory_target, manager_factory):
    mgr = manager_factory(memory_target)
    with mgr.save(step=1) as d:
        (d / "weights.bin").write_bytes(b"x" * 10)
    mgr.wait()
    with pytest.raises(CloudCkptError, match="not written by save_state"):
        load_state(mgr)


# ------------------------------------------------------------------------------ the local tier


def test_a_same_host_restart_resumes_from_the_local_copy_with_nothing_downloaded(
    s3_target, tmp_path
):
    staging = tmp_path / "staging"
    first = CheckpointManager(
        s3_target.url, storage_options=s3_target.storage_options, staging_dir=staging
    )
    for step in (1, 2):
        save_state(first, step, _state(step)).result(timeout=60)
    first.close()
    kept = list((staging / COMMITTED_DIR).iterdir())
    assert len(kept) == 1 and kept[0].name.startswith("000000000002-")  # keep_local=1

    again = CheckpointManager(
        s3_target.url, storage_options=s3_target.storage_options, staging_dir=staging
    )
    report = LoadReport()
    state = resume_state(again, weights_only=False, report=report)
    assert _same(state, _state(2))
    assert report.source == "local" and report.bytes_downloaded == 0
    assert report.bytes_local == report.total_bytes and report.requests == 0
    assert read_latest(again.store).latest.writer.id == again.writer_id  # it claimed
    again.close()


def test_a_same_host_restart_restores_a_directory_from_the_local_copy(memory_target, tmp_path):
    staging = tmp_path / "staging"
    first = CheckpointManager(memory_target.url, staging_dir=staging)
    with first.save(step=1) as d:
        (d / "a").write_bytes(os.urandom(3 * MiB))
        (d / "sub").mkdir()
        (d / "sub" / "b").write_bytes(b"")
    first.close()
    again = CheckpointManager(memory_target.url, staging_dir=staging)
    res = again.resume(into=tmp_path / "r")
    assert res.bytes_downloaded == 0 and res.bytes_local == 3 * MiB
    assert (res.path / "a").stat().st_size == 3 * MiB and (res.path / "sub" / "b").exists()
    again.close()


@pytest.mark.parametrize("when", ["after-verifying", "before-linking"])
def test_a_local_copy_deleted_under_a_restore_is_held_or_downloaded(
    memory_target, tmp_path, monkeypatch, when
):
    """The local tier's retention deletes a copy when a newer save commits, which may
    happen while a restore of that copy runs (CI found the race: the copy was verified,
    then gone before it was linked). What the restore verifies is what it keeps (its own
    hard links), and a file already gone is downloaded."""
    import cloudckpt.restore as restore_mod

    staging = tmp_path / "staging"
    first = CheckpointManager(memory_target.url, staging_dir=staging)
    data = {"a": os.urandom(3 * MiB), "b": os.urandom(MiB)}
    with first.save(step=1) as d:
        for name, blob in data.items():
            (d / name).write_bytes(blob)
    first.close()
    (copy_dir,) = (staging / COMMITTED_DIR).iterdir()
    deleted = []
    if when == "after-verifying":
        real = restore_mod.fetch.verify_local

        def verify_then_delete(*args, **kwargs):
            ok = real(*args, **kwargs)
            shutil.rmtree(copy_dir)  # retention, right after the check
            deleted.append(copy_dir)
            return ok

        monkeypatch.setattr(restore_mod.fetch, "verify_local", verify_then_delete)
    else:
        real_link = restore_mod._link_local

        def delete_then_link(copy, entry, tmp, *link):
            if entry.path == "b" and copy_dir.exists():
                shutil.rmtree(copy_dir)
                deleted.append(copy_dir)
            return real_link(copy, entry, tmp, *link)

        monkeypatch.setattr(restore_mod, "_link_local", delete_then_link)
    again = CheckpointManager(memory_target.url, staging_dir=staging)
    res = again.restore(into=tmp_path / "r")
    again.close()
    assert deleted == [copy_dir]  # the deletion happened inside the restore
    if when == "after-verifying":
        assert (res.bytes_local, res.bytes_downloaded) == (4 * MiB, 0)
    else:  # "a" was linked before the copy went; "b" is downloaded
        assert (res.bytes_local, res.bytes_downloaded) == (3 * MiB, MiB)
    assert {name: (res.path / name).read_bytes() for name in data} == data


def _save_keeping_the_copy(mgr, step: int) -> None:
    """Save ``step`` and wait until its local copy is kept: a copy still being written
    when the next save starts is cut short (tests/test_save_stall.py)."""
    handle = save_state(mgr, step, _state(step))
    handle.result(timeout=60)
    handle._job.local_copy.result(timeout=60)


@pytest.mark.parametrize("damage", ["flip", "truncate", "other-step", "manifest"])
def test_a_damaged_local_copy_is_never_used(memory_target, tmp_path, damage):
    staging = tmp_path / "staging"
    first = CheckpointManager(memory_target.url, staging_dir=staging, keep_local=2)
    for step in (1, 2):
        _save_keeping_the_copy(first, step)
    first.close()
    copies = sorted((staging / COMMITTED_DIR).iterdir())
    older, newer = copies[0], copies[1]
    tensors = newer / "files" / "tensors.safetensors"
    if damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[len(data) // 2] ^= 0x10
        tensors.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(tensors, tensors.stat().st_size - 1)
    elif damage == "other-step":  # the copy of step 1 under step 2's name
        tensors.write_bytes((older / "files" / "tensors.safetensors").read_bytes())
        (newer / "files" / "state.json").write_bytes((older / "files" / "state.json").read_bytes())
    else:  # a manifest that is not the one LATEST names: read from the store instead
        (newer / "MANIFEST.json").write_bytes(b"{}")

    again = CheckpointManager(memory_target.url, staging_dir=staging)
    report = LoadReport()
    state = resume_state(again, weights_only=False, report=report)
    assert _same(state, _state(2))  # the committed bytes, whatever the local copy held
    if damage == "manifest":
        assert report.source == "local"  # the files still verify against the real one
    else:
        assert report.bytes_downloaded > 0 and report.step == 2 and report.skipped == ()
    dir_restore = again.restore(into=tmp_path / "r")
    assert dir_restore.step == 2
    restored = (dir_restore.path / "tensors.safetensors").read_bytes()
    store_bytes = load_state(dir_restore, weights_only=False)
    assert _same(store_bytes, _state(2)) and restored != b""
    if damage != "manifest":
        assert dir_restore.bytes_downloaded > 0
    again.close()


def _wait_for_journal(staging, state: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = []
        for p in staging.glob("attempts/*/journal.json"):
            with contextlib.suppress(OSError, ValueError):
                states.append(json.loads(p.read_text())["state"])
        if state in states:
            return
        time.sleep(0.01)
    raise AssertionError(f"no staged attempt reached {state}")


def test_a_crash_between_the_commit_and_the_local_copy_bookkeeping(
    memory_target, tmp_path, monkeypatch
):
    """The commit landed, the process died before its journal said so: the next manager
    adopts the staged attempt as a copy of the committed step, proven by its content."""
    staging = tmp_path / "staging"
    first = CheckpointManager(memory_target.url, staging_dir=staging)
    _save_keeping_the_copy(first, 1)  # step 1's attempt is gone before step 2's is staged
    durable = threading.Event()
    real_read = MemoryFile.read

    def read_once_durable(self, offset, length):
        durable.wait(30)  # the upload waits for the staged copy: a deterministic crash
        return real_read(self, offset, length)

    monkeypatch.setattr(MemoryFile, "read", read_once_durable)
    with failpoints.armed("commit.after_record"):
        handle = save_state(first, 2, _state(2))
        _wait_for_journal(staging, "durable")
        durable.set()
        with pytest.raises(failpoints.SimulatedCrash):
            handle.result(timeout=60)
    first.staging.close()  # the process is gone
    assert read_latest(first.store).latest.current.step == 2  # committed
    left = [json.loads(p.read_text())["state"] for p in staging.glob("attempts/*/journal.json")]
    assert left == ["durable"]

    again = CheckpointManager(memory_target.url, staging_dir=staging)
    report = LoadReport()
    state = resume_state(again, weights_only=False, report=report)
    assert _same(state, _state(2)) and report.source == "local"
    assert not list((staging / "attempts").iterdir())
    again.close()


def test_a_crash_while_keeping_the_local_copy(memory_target, tmp_path, monkeypatch):
    """Journal ``committed``, ``copy.json`` written, the move never happened."""
    from cloudckpt import localcopy

    staging = tmp_path / "staging"
    first = CheckpointManager(memory_target.url, staging_dir=staging)
    moves = []

    def dies(src, dst):
        moves.append(dst)
        raise failpoints.SimulatedCrash("killed before the move")

    monkeypatch.setattr(localcopy.os, "rename", dies)
    handle = save_state(first, 1, _state(1))
    assert handle.result(timeout=60).step == 1  # committed; the copy is kept afterwards
    with pytest.raises(failpoints.SimulatedCrash):
        handle._job.local_copy.result(timeout=60)  # the process dies while keeping it
    monkeypatch.undo()
    first.staging.close()
    assert moves and list(staging.glob("attempts/*/copy.json"))

    again = CheckpointManager(memory_target.url, staging_dir=staging)
    report = LoadReport()
    assert _same(resume_state(again, weights_only=False, report=report), _state(1))
    assert report.source == "local"
    again.close()


def hold_staged_writes(monkeypatch) -> threading.Event:
    """Hold every staged copy's writing (``Attempt.write_files``) until the returned event
    is set (at most 60 s)."""
    from cloudckpt.staging import Attempt

    gate = threading.Event()
    real = Attempt.write_files

    def held(self, files, cancelled=None):
        gate.wait(60)
        return real(self, files, cancelled)

    monkeypatch.setattr(Attempt, "write_files", held)
    return gate


def test_the_commit_does_not_wait_for_the_local_copy_but_buffer_reuse_does(
    memory_target, tmp_path, monkeypatch
):
    """save_state's staged copy is finished after the commit (it is written at a low
    priority): the commit is reported at once, the host buffers stay reserved until the
    copy is on disk, and close() waits for it."""
    from cloudckpt.integrations import torch as ct

    gate = hold_staged_writes(monkeypatch)
    staging = tmp_path / "staging"
    mgr = CheckpointManager(memory_target.url, staging_dir=staging)
    handle = save_state(mgr, 1, _state(1))
    assert handle.result(timeout=60).step == 1  # committed while the copy is held
    assert not handle._job.local_copy.done()
    assert not ct._savers[mgr]._previous.done()  # the buffers are still being read
    gate.set()
    handle._job.local_copy.result(timeout=60)
    mgr.close()
    assert [p.name[:12] for p in (staging / COMMITTED_DIR).iterdir()] == ["000000000001"]


def test_local_copy_retention_and_budget(memory_target, tmp_path):
    staging = tmp_path / "staging"
    mgr = CheckpointManager(memory_target.url, staging_dir=staging, keep_local=2)
    for step in (1, 2, 3):
        _save_keeping_the_copy(mgr, step)
    mgr.close()  # waits for the last copy being kept
    names = sorted(p.name[:12] for p in (staging / COMMITTED_DIR).iterdir())
    assert names == ["000000000002", "000000000003"]
    # A budget below one copy keeps none; a manager that keeps none removes them at start.
    small = CheckpointManager(
        memory_target.url, staging_dir=staging, keep_local=2, local_budget_bytes=1000
    )
    assert not list((staging / COMMITTED_DIR).iterdir())
    save_state(small, 4, _state(4)).result(timeout=60)
    small.close()
    assert not list((staging / COMMITTED_DIR).iterdir())
    none = CheckpointManager(memory_target.url, staging_dir=tmp_path / "other", keep_local=0)
    save_state(none, 5, _state(5)).result(timeout=60)
    none.close()
    assert not (tmp_path / "other" / COMMITTED_DIR).exists() or not list(
        (tmp_path / "other" / COMMITTED_DIR).iterdir()
    )


# ------------------------------------------------------------------------------ the GPU path


class AsyncCopies:
    """A stand-in for a CUDA device on the CPU: ``copy`` returns at once and a thread does
    the copy a little later, as a stream would. It checks the ordering the GPU path
    relies on: a staging buffer is not reused (its bytes do not change) until its copy's
    waiter returned, every copy is done before the state is returned, and no copy is
    pending when the tensors of a damaged checkpoint are dropped."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.pending: collections.deque = collections.deque()
        self.cv = threading.Condition()
        self.copies = 0
        self.waited = 0
        self.finished = 0
        self.violations: list[str] = []
        self.staged = 0
        self._worker = threading.Thread(target=self._run, daemon=True)
        self._worker.start()

    def empty(self, shape, dtype):
        return torch.empty(tuple(shape), dtype=dtype)

    def staging(self, nbytes):
        self.staged += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst, src):
        job = {"dst": dst, "src": src, "sum": hashlib.sha256(src.numpy()).digest(), "done": False}
        with self.cv:
            self.pending.append(job)
            self.copies += 1
            self.cv.notify_all()

        def wait():
            with self.cv:
                while not job["done"]:
                    self.cv.wait()
                self.waited += 1

        return wait

    def _run(self):
        while True:
            with self.cv:
                while not self.pending:
                    self.cv.wait()
                job = self.pending[0]
            time.sleep(0.002)  # the copy lags behind the call
            if hashlib.sha256(job["src"].numpy()).digest() != job["sum"]:
                self.violations.append("a staging buffer changed before its copy ran")
            job["dst"].copy_(job["src"])
            with self.cv:
                job["done"] = True
                self.pending.popleft()
                self.cv.notify_all()

    def finish(self):
        with self.cv:
            while self.pending:
                self.cv.wait()
        self.finished += 1


def test_the_gpu_path_copies_each_range_from_staging_and_waits_before_returning(
    memory_target, manager_factory, monkeypatch
):
    mgr = _two_checkpoints(memory_target, manager_factory, keep_local=0)
    ops = AsyncCopies()
    monkeypatch.setattr(tr, "device_ops", lambda device: ops)
    report = LoadReport()
    state = load_state(mgr, device="cuda", weights_only=False, report=report)
    assert _same(state, _state(2))
    assert ops.violations == [] and ops.copies > 2 and ops.waited == ops.copies
    assert ops.finished >= 1 and not ops.pending
    # Staging is bounded by the workers, not by the checkpoint's size.
    assert ops.staged <= mgr.engine.config.concurrency + 1
    # Every tensor byte went through staging (state.json and the safetensors header land
    # in host memory).
    record = read_latest(mgr.store).latest.current
    files = {f.path: f.size for f in fetch_manifest(mgr.store, record).files}
    assert 0 <= files["tensors.safetensors"] - report.bytes_scratch < tr.HEAD_PROBE
    assert report.bytes_downloaded == sum(files.values())


def test_the_gpu_path_drains_its_copies_before_dropping_a_damaged_checkpoint(
    memory_target, manager_factory, monkeypatch
):
    mgr = _two_checkpoints(memory_target, manager_factory, keep_local=0)
    flip_bit(mgr.store, _tensors_key(mgr.store, read_latest(mgr.store).latest.current))
    ops = AsyncCopies()
    drained = []
    real = tr._Loader.try_one

    def watched(self, record):
        out = real(self, record)
        drained.append((record.step, len(ops.pending)))
        return out

    monkeypatch.setattr(tr, "device_ops", lambda device: ops)
    monkeypatch.setattr(tr._Loader, "try_one", watched)
    state = load_state(mgr, device="cuda", weights_only=False)
    assert _same(state, _state(1))
    assert drained == [(2, 0), (1, 0)] and ops.violations == []


@pytest.mark.cuda
def test_restore_into_a_real_gpu(memory_target, manager_factory):
    """Runs where CUDA is present (``pytest -m cuda``); CI deselects it (pyproject)."""
    assert torch.cuda.is_available(), "run the cuda-marked tests on a machine with a GPU"
    mgr = _two_checkpoints(memory_target, manager_factory, keep_local=0)
    report = LoadReport()
    state = load_state(mgr, device="cuda", weights_only=False, report=report)
    assert report.device.startswith("cuda")
    assert state["model"]["w"].is_cuda and state["model"]["tied"] is state["model"]["w"]
    expected = _state(2)
    for k, v in expected["model"].items():
        assert torch.equal(state["model"][k].cpu(), v)
