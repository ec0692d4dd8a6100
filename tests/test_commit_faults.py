"""The commit protocol under injected faults, on the memory oracle (fast and exact)."""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import hashlib
import threading
import time

import pytest

from cloudckpt import (
    CloudCkptError,
    CommitConflictError,
    CommitStateUnknownError,
    CorruptionError,
    NeedsRepairError,
    StagingError,
    StaleAttemptError,
    attempt_layout,
    canonical,
    failpoints,
    manifests,
    protocol,
)
from cloudckpt.errors import (
    OutcomeUnknownError,
    PermissionDeniedError,
    PreconditionFailedError,
    SaveDroppedError,
)
from cloudckpt.stores import open_store
from cloudckpt.stores.memory import ManualClock
from cloudckpt.testing.faults import (
    Callback,
    Conflict,
    DeliverTwice,
    FailBefore,
    Fault,
    FaultInjectingStore,
    Latency,
    LoseResponse,
    Rule,
)


@pytest.fixture
def faulty(memory_target):
    return FaultInjectingStore(open_store(memory_target.url), seed=1)


def _latest(store) -> protocol.Latest:
    return protocol.parse_latest(store.inner.get(protocol.LATEST_KEY)[0])


def _save(mgr, step, data=b"x"):
    handle = mgr.save(step=step)
    with handle as d:
        (d / "f").write_bytes(data)
    return handle


LATEST_UPDATE = dict(ops={"put"}, key="LATEST", modes={"update"})


@pytest.mark.parametrize(
    "fault", [LoseResponse(), DeliverTwice(), Conflict()], ids=lambda f: f.name
)
def test_commit_survives_lost_answers_and_retries(faulty, manager_factory, fault):
    mgr = manager_factory(faulty)
    _save(mgr, 1).result()
    faulty.add(Rule(fault, **LATEST_UPDATE, times=1))
    info = _save(mgr, 2).result()
    assert faulty.injected[fault.name] == 1
    latest = _latest(faulty)
    assert latest.current.commit_id == info.commit_id
    # One commit, one seq: the hidden retry did not commit twice.
    assert [r.step for r in latest.retained()] == [2, 1]


def test_commit_reapplies_over_a_same_epoch_edit(faulty, manager_factory):
    mgr = manager_factory(faulty)
    _save(mgr, 1).result()
    mgr.pin(1, "keep")  # LATEST changed behind the writer's cached version
    info = _save(mgr, 2).result()
    latest = _latest(faulty)
    assert latest.current.commit_id == info.commit_id
    assert [p.step for p in latest.pins] == [1]


def test_a_commit_that_never_lands_is_not_reported_as_success(faulty, manager_factory):
    mgr = manager_factory(faulty)
    _save(mgr, 1).result()
    faulty.add(Rule(FailBefore(PreconditionFailedError), **LATEST_UPDATE, times=None))
    with pytest.raises(CommitConflictError):
        _save(mgr, 2).result()
    latest = _latest(faulty)
    assert latest.current.step == 1 and len(latest.retained()) == 1
    # Never clean up after a failed commit: the attempt's data stays for GC.
    assert any(o.key.startswith("ckpt/000000000002") for o in faulty.inner.list("ckpt/"))


def test_unknown_outcome_that_persists_raises_and_keeps_data(faulty, manager_factory):
    mgr = manager_factory(faulty)
    _save(mgr, 1).result()
    faulty.add(Rule(FailBefore(OutcomeUnknownError), **LATEST_UPDATE, times=None))
    with pytest.raises(CommitStateUnknownError):
        _save(mgr, 2).result()
    assert _latest(faulty).current.step == 1
    assert any(
        o.key.endswith("MANIFEST.json") and "000000000002" in o.key
        for o in faulty.inner.list("ckpt/")
    )


def test_unknown_outcome_then_answer_resolves_to_latest(faulty, manager_factory):
    mgr = manager_factory(faulty)
    _save(mgr, 1).result()
    faulty.add(Rule(FailBefore(OutcomeUnknownError), **LATEST_UPDATE, times=2))
    info = _save(mgr, 2).result()
    assert _latest(faulty).current.commit_id == info.commit_id


def test_stale_attempt_is_refused(faulty, manager_factory):
    mgr = manager_factory(faulty, gc_grace=1)
    faulty.add(Rule(Latency(1.2), ops={"put"}, key="ckpt/*/MANIFEST.json", times=1))
    with pytest.raises(StaleAttemptError):
        _save(mgr, 1).result()
    assert not faulty.inner.exists(protocol.LATEST_KEY) or _latest(faulty).current is None


def test_crash_after_upload_is_recovered_from_the_staging_journal(memory_target, tmp_path):
    from cloudckpt import CheckpointManager

    staging = tmp_path / "staging"
    first = CheckpointManager(memory_target.url, staging_dir=staging)
    _save(first, 1, b"one").result()
    with failpoints.armed("save.after_upload"):
        crashed = _save(first, 2, b"two")
        with pytest.raises(failpoints.SimulatedCrash):
            crashed.result(timeout=30)
    first.staging.close()  # the process is gone; its staging lock with it

    again = CheckpointManager(memory_target.url, staging_dir=staging)
    res = again.resume(into=tmp_path / "restore")
    assert res.step == 2 and (res.path / "f").read_bytes() == b"two"
    assert list((staging / "attempts").iterdir()) == []
    again.close()


def test_crash_while_staging_is_abandoned(memory_target, tmp_path):
    from cloudckpt import CheckpointManager

    staging = tmp_path / "staging"
    first = CheckpointManager(memory_target.url, staging_dir=staging)
    _save(first, 1, b"one").result()
    handle = first.save(step=2)
    d = handle.__enter__()
    (d / "f").write_bytes(b"half")  # the process dies inside the with-block
    first.staging.close()
    again = CheckpointManager(memory_target.url, staging_dir=staging)
    assert again.resume(into=tmp_path / "r").step == 1
    assert list((staging / "attempts").iterdir()) == []
    again.close()


def test_two_managers_cannot_share_a_staging_dir(memory_target, tmp_path):
    from cloudckpt import CheckpointManager, ConfigurationError

    a = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    with pytest.raises(ConfigurationError, match="in use"):
        CheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    a.close()


def test_backpressure_block_keeps_every_save(faulty, manager_factory):
    faulty.add(Rule(Latency(0.3), ops={"put"}, key="ckpt/*/ATTEMPT.json", times=None))
    mgr = manager_factory(faulty, max_pending=1, backpressure="block")
    handles = [_save(mgr, s) for s in range(1, 5)]
    mgr.wait()
    assert [h.result().step for h in handles] == [1, 2, 3, 4]
    assert [c.step for c in mgr.list()] == [4, 3, 2]


def test_backpressure_drop_oldest_drops_queued_saves(faulty, manager_factory):
    faulty.add(Rule(Latency(0.5), ops={"put"}, key="ckpt/*/ATTEMPT.json", times=None))
    mgr = manager_factory(faulty, max_pending=1, backpressure="drop_oldest")
    first = _save(mgr, 1)
    time.sleep(0.2)  # step 1 is uploading
    second = _save(mgr, 2)  # queued
    third = _save(mgr, 3)  # replaces step 2
    with pytest.raises(SaveDroppedError):
        second.result(timeout=30)
    assert first.result(timeout=30).step == 1 and third.result(timeout=30).step == 3
    assert [c.step for c in mgr.list()] == [3, 1]


def test_close_waits_for_pending_saves(faulty, tmp_path):
    from cloudckpt import CheckpointManager

    faulty.add(Rule(Latency(0.2), ops={"put"}, key="ckpt/*", times=None))
    mgr = CheckpointManager(faulty, staging_dir=tmp_path / "s", max_pending=5)
    handles = [_save(mgr, s) for s in (1, 2, 3)]
    mgr.close()
    assert all(h.done() and h.exception() is None for h in handles)
    assert _latest(faulty).current.step == 3


def test_failed_block_abandons_the_save(faulty, manager_factory):
    mgr = manager_factory(faulty)
    handle = mgr.save(step=1)
    with pytest.raises(ZeroDivisionError), handle as d:
        (d / "f").write_bytes(b"x")
        1 / 0  # noqa: B018
    with pytest.raises(CloudCkptError, match="abandoned"):
        handle.result()
    assert mgr.latest() is None


def test_source_modified_in_place_during_upload_fails_the_save(faulty, manager_factory, tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.bin").write_bytes(b"a" * 1000)
    gate = threading.Event()

    def slow(name: str) -> None:
        gate.wait(10)

    faulty.add(
        Rule(
            Latency(0.5),
            ops={"put"},
            key=lambda k: k.endswith("/files/model.bin") or "/chunks/" in k,
            times=1,
        )
    )
    mgr = manager_factory(faulty)
    handle = mgr.save_dir(step=1, src=src)
    time.sleep(0.1)
    with open(src / "model.bin", "r+b") as f:  # rewrites the hard-linked inode in place
        f.write(b"b" * 2000)
    with pytest.raises(StagingError, match="changed"):
        handle.result(timeout=30)
    assert mgr.latest() is None
    del slow


def test_missing_latest_needs_repair_but_restore_uses_commit_records(
    faulty, manager_factory, tmp_path, caplog
):
    mgr = manager_factory(faulty)
    _save(mgr, 1, b"one").result()
    _save(mgr, 2, b"two").result()
    faulty.inner.delete(protocol.LATEST_KEY)
    with pytest.raises(NeedsRepairError):
        manager_factory(faulty).resume(into=tmp_path / "r")
    res = manager_factory(faulty).restore(into=tmp_path / "r2")
    assert res.step == 2 and res.from_commit_records
    assert "commit record" in caplog.text


def test_corrupt_latest_falls_back_to_commit_records(faulty, manager_factory, tmp_path):
    from cloudckpt.testing.faults import flip_bit

    mgr = manager_factory(faulty)
    _save(mgr, 1, b"one").result()
    flip_bit(faulty.inner, protocol.LATEST_KEY, seed=3)
    res = manager_factory(faulty).restore(into=tmp_path / "r")
    assert res.step == 1 and res.from_commit_records


def _plant_manifest(store, files, step=9):
    """Commit a hand-made manifest (as a hostile bucket writer could) with valid digests."""
    attempt = attempt_layout.new_attempt_id(dt.datetime.now(dt.timezone.utc))
    prefix = attempt_layout.ckpt_prefix(step, 1, attempt)
    entries = []
    for path, data in files:
        entries.append(manifests.FileEntry(path, len(data), protocol_digest(data)))
        store.put(prefix + "files/" + path.replace("../", "up/").lstrip("/"), data)
    manifest = manifests.Manifest(
        ckpt=prefix,
        step=step,
        epoch=1,
        commit_id=attempt,
        writer_id="evil",
        created_at="t",
        files=tuple(entries),
    )
    body = canonical.seal({**_manifest_dict(manifest)})
    store.put(prefix + "MANIFEST.json", body)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    record = protocol.CheckpointRecord(
        ckpt=prefix,
        step=step,
        epoch=1,
        commit_id=attempt,
        manifest_sha256=hashlib.sha256(body).hexdigest(),
        manifest_size=len(body),
        committed_at="2030-01-01T00:00:00.000Z",
        total_bytes=0,
        num_files=len(entries),
    )
    new = protocol.commit(latest, record, latest.settings, dt.datetime.now(dt.timezone.utc))
    store.put(protocol.LATEST_KEY, new.to_bytes())


def protocol_digest(data: bytes) -> str:
    from cloudckpt import digest

    return digest.tree_digest(data)


def _manifest_dict(m: manifests.Manifest) -> dict:
    import json

    return json.loads(m.to_bytes())


@pytest.mark.parametrize("path", ["../escape.txt", "/etc/cloudckpt-evil", "a/../../b"])
def test_hostile_manifest_is_refused_and_nothing_lands_outside(
    memory_target, manager_factory, tmp_path, path
):
    store = open_store(memory_target.url)
    mgr = manager_factory(memory_target)
    _save(mgr, 1, b"good").result()
    _plant_manifest(store, [(path, b"pwned")])
    dest = tmp_path / "deep" / "dest"
    res = mgr.restore(into=dest)
    assert res.step == 1 and (dest / "f").read_bytes() == b"good"
    assert res.skipped and "path" in res.skipped[0].reason
    everything = {p.name for p in tmp_path.rglob("*")}
    assert "escape.txt" not in everything and "b" not in everything
    assert not (tmp_path / "escape.txt").exists()


def test_hostile_manifest_with_nothing_older_raises(memory_target, manager_factory, tmp_path):
    from cloudckpt import UnsafePathError

    store = open_store(memory_target.url)
    mgr = manager_factory(memory_target)
    mgr.resume(into=tmp_path / "none")
    _plant_manifest(store, [("../../x", b"pwned")], step=1)
    with pytest.raises(CorruptionError) as err:
        mgr.restore(into=tmp_path / "d")
    assert "path" in str(err.value)
    assert issubclass(UnsafePathError, CloudCkptError)


def test_gc_deletes_only_unreferenced_data_past_grace(memory_target, manager_factory):
    clock = ManualClock()
    store = FaultInjectingStore(open_store(memory_target.url, {"clock": clock}))
    deletes: list[str] = []
    store.add(Rule(Latency(0), ops={"delete"}, key=lambda k: deletes.append(k) or False))
    mgr = manager_factory(store, keep_last=1, gc_grace=100, auto_gc=False)
    _save(mgr, 1, b"one").result()
    _save(mgr, 2, b"two").result()  # step 1 -> tombstone (nothing shared)
    # An orphan: a crashed attempt's upload, and an incomplete multipart upload.
    orphan = attempt_layout.ckpt_prefix(3, 1, "20300101T000000000Z-deadbeef")
    store.inner.put(orphan + "ATTEMPT.json", b"{}")
    store.inner.put(orphan + "files/f", b"junk")
    upload = store.inner.create_multipart(orphan + "files/big")

    report = mgr.gc(dry_run=True)
    assert not report.deleted_checkpoints and not report.deleted_orphans
    clock.advance(50)
    assert mgr.gc().deleted_objects == 0  # younger than grace
    clock.advance(60)
    dry = mgr.gc(dry_run=True)
    assert [s for s, _ in dry.deleted_checkpoints] == [1] and dry.deleted_orphans == [orphan]
    assert not deletes, "a dry run deleted something"

    report = mgr.gc()
    assert [s for s, _ in report.deleted_checkpoints] == [1]
    assert report.deleted_orphans == [orphan]
    assert [u for _, u in report.aborted_uploads] == [upload.upload_id]
    assert store.inner.list_multipart("") == []
    # Manifest before data, ATTEMPT.json last, per checkpoint.
    step1 = [k for k in deletes if k.startswith("ckpt/000000000001")]
    assert step1[0].endswith("MANIFEST.json") and step1[-1].endswith("ATTEMPT.json")
    latest = _latest(store)
    assert latest.tombstones == () and latest.current.step == 2
    remaining = {o.key.split("/")[1] for o in store.inner.list("ckpt/")}
    assert remaining == {latest.current.ckpt.split("/")[1]}
    res = mgr.restore(into=mgr.staging.root / "check")
    assert res.step == 2


def test_gc_grace_cannot_undercut_the_runs_setting(memory_target, manager_factory):
    clock = ManualClock()
    store = open_store(memory_target.url, {"clock": clock})
    mgr = manager_factory(store, keep_last=1, gc_grace=1000, auto_gc=False)
    _save(mgr, 1).result()
    _save(mgr, 2).result()
    clock.advance(10)
    report = mgr.gc(grace=1)
    assert report.grace_seconds == 1000 and not report.deleted_checkpoints


def test_run_settings_are_inherited_unless_given(memory_target, manager_factory, tmp_path):
    first = manager_factory(memory_target, keep_last=5, gc_grace=9000)
    _save(first, 1).result()
    again = manager_factory(memory_target)  # defaults: keep the run's settings
    again.resume(into=tmp_path / "r1")
    assert (again.settings.keep_last, again.settings.gc_grace_s) == (5, 9000)
    _save(again, 2).result()
    latest = protocol.parse_latest(open_store(memory_target.url).get(protocol.LATEST_KEY)[0])
    assert latest.settings.keep_last == 5 and latest.settings.gc_grace_s == 9000
    changed = manager_factory(memory_target, keep_last=2)
    changed.resume(into=tmp_path / "r2")
    assert (changed.settings.keep_last, changed.settings.gc_grace_s) == (2, 9000)
    fresh = manager_factory(open_store("memory://fresh-run-settings/run"))
    assert fresh.settings.keep_last == 3


def test_claim_rides_out_a_transient_store_error(faulty, manager_factory, tmp_path):
    _save(manager_factory(faulty), 1).result()
    faulty.add(Rule(FailBefore(), ops={"put"}, key="LATEST", times=2))  # 503 twice
    res = manager_factory(faulty).resume(into=tmp_path / "r")
    assert res.step == 1 and faulty.injected["fail_before"] == 2
    assert _latest(faulty).writer.epoch == 2


def test_close_does_not_reraise_an_error_the_caller_already_handled(faulty, tmp_path):
    from cloudckpt import CheckpointManager

    def failing_manager(name):
        faulty.clear()
        mgr = CheckpointManager(faulty, staging_dir=tmp_path / name)
        _save(mgr, 1).result()
        faulty.add(Rule(FailBefore(PreconditionFailedError), **LATEST_UPDATE, times=None))
        return mgr

    mgr = failing_manager("a")
    handled = _save(mgr, 2)
    with pytest.raises(CommitConflictError):
        handled.result()
    mgr.close()  # the caller saw that failure already: nothing to report

    mgr = failing_manager("b")
    unhandled = _save(mgr, 3)
    with pytest.raises(CommitConflictError):
        mgr.close()  # never collected: close() reports it
    assert unhandled.exception() is not None


# -- failures are never silent: raised once, by the first waiting call (issue 21) --


def _settled(handle) -> None:
    """Wait for a save's outcome without collecting it: result() and exception() hand a
    failure to the caller, and the manager then rightly does not raise it again."""
    cf.wait([handle._future], timeout=30)
    assert handle.done()


class _GatedRefusal(Fault):
    """Refuse the write (403), once ``gate`` opens: until then the save stays in flight."""

    name = "gated_refusal"

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def run(self, call, op, key, store):
        assert self.gate.wait(30)
        raise PermissionDeniedError(f"injected refusal of {op} {key}", key=key)


def _refuse_steps(faulty, gate, *steps):
    """Refuse every write of the saves of ``steps`` (their first is ATTEMPT.json)."""
    prefixes = tuple(f"ckpt/{step:012d}-" for step in steps)
    return faulty.add(Rule(_GatedRefusal(gate), key=lambda k: k.startswith(prefixes), times=None))


def test_a_background_failure_is_raised_once_by_the_next_save(faulty, manager_factory):
    gate = threading.Event()
    gate.set()
    refused = _refuse_steps(faulty, gate, 1)
    mgr = manager_factory(faulty)
    failed = _save(mgr, 1)
    _settled(failed)
    with pytest.raises(PermissionDeniedError) as raised:
        mgr.save(step=2)  # the loop learns at its next checkpoint, not at the end
    assert raised.value is failed._future.exception()
    assert _save(mgr, 2).result(timeout=30).step == 2  # told once: this save goes ahead
    mgr.wait()
    mgr.close()
    assert refused.fired == 1


def test_wait_raises_each_failure_once_and_a_later_commit_hides_none(faulty, manager_factory):
    gate = threading.Event()
    refused = _refuse_steps(faulty, gate, 1, 2)
    mgr = manager_factory(faulty, max_pending=2)
    first, second = _save(mgr, 1), _save(mgr, 2)  # held in flight: save() has nothing to tell
    third = _save(mgr, 3)
    gate.set()
    for handle in (first, second, third):
        _settled(handle)
    assert mgr.latest().step == 3
    with pytest.raises(PermissionDeniedError) as raised:
        mgr.wait()
    assert raised.value is first._future.exception()
    with pytest.raises(PermissionDeniedError) as raised:
        mgr.wait()  # the second failure was kept for the next waiting call, not logged away
    assert raised.value is second._future.exception()
    mgr.wait()
    mgr.close()
    assert refused.fired == 2


def test_close_raises_the_first_failure_and_logs_the_others(faulty, tmp_path, caplog):
    from cloudckpt import CheckpointManager

    gate = threading.Event()
    refused = _refuse_steps(faulty, gate, 1, 2)
    mgr = CheckpointManager(faulty, staging_dir=tmp_path / "s", max_pending=2)
    first, second = _save(mgr, 1), _save(mgr, 2)
    gate.set()
    with pytest.raises(PermissionDeniedError) as raised:
        mgr.close()  # nothing can raise after close(): the second failure is logged
    assert raised.value is first._future.exception()
    assert second.done() and "the save of step 2 also failed" in caplog.text
    assert refused.fired == 2


def test_a_save_dropped_by_policy_is_not_a_failure_of_wait_or_close(faulty, manager_factory):
    uploading, gate = threading.Event(), threading.Event()

    def hold() -> None:
        uploading.set()
        assert gate.wait(30)

    held = faulty.add(Rule(Callback(before=hold), key="ckpt/000000000001-*", times=1))
    mgr = manager_factory(faulty, max_pending=1, backpressure="drop_oldest")
    first = _save(mgr, 1)
    assert uploading.wait(30)  # in flight, held at its first write
    second = _save(mgr, 2)  # queued
    third = _save(mgr, 3)  # replaces step 2, as asked
    gate.set()
    mgr.wait()  # nothing failed: the drop is the policy the caller chose
    mgr.close()
    with pytest.raises(SaveDroppedError):
        second.result()  # the dropped save's own handle still says so
    assert [first.result().step, third.result().step] == [1, 3]
    assert held.fired == 1


def test_finish_pending_raises_an_older_failure_after_a_newer_commit(faulty, manager_factory):
    """The HF callback's and Lightning IO's end of training: a newer commit used to
    supersede an older failure, which was only logged, and the run exited 0."""
    from cloudckpt.integrations._pending import finish_pending

    gate = threading.Event()
    refused = _refuse_steps(faulty, gate, 1)
    mgr = manager_factory(faulty)
    handles = [_save(mgr, 1), _save(mgr, 2)]
    gate.set()
    commits = []
    with pytest.raises(PermissionDeniedError):
        finish_pending(mgr, handles, None, commits.append)
    assert [c.step for c in commits] == [2]  # every save was waited for,
    assert mgr._closed  # and the manager closed, before raising
    assert refused.fired == 1


def test_a_failed_hand_over_releases_its_queue_slot(faulty, manager_factory, monkeypatch):
    from cloudckpt.staging import Attempt

    mgr = manager_factory(faulty)
    real = Attempt.set_state

    def full_disk(self, state, **kw):
        if state == "staged":
            raise StagingError("the staging disk is full while trying to write the journal")
        return real(self, state, **kw)

    monkeypatch.setattr(Attempt, "set_state", full_disk)
    failed = mgr.save(step=1)
    with pytest.raises(StagingError), failed as d:
        (d / "f").write_bytes(b"x")
    with pytest.raises(CloudCkptError):
        failed.result(timeout=5)
    # The slot is released (a leaked one would make every later save wait for the upload
    # ahead of it) and the staging directory is gone.
    assert mgr.queue._reserved == 0 and not mgr.queue._open
    assert not any((mgr.staging.attempts_dir).iterdir())
    monkeypatch.setattr(Attempt, "set_state", real)
    _save(mgr, 2).result(timeout=30)
