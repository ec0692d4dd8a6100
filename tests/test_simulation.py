"""The seeded deterministic simulation (cloudckpt.testing.simulation), and regression tests
for the protocol bugs it found.

CI runs seeds 0..CLOUDCKPT_SIM_SEEDS (default 300) on two processes. A failing seed prints
its report and the one command that replays it. To run other seeds through pytest::

    CLOUDCKPT_SIM_SEEDS=1000:2000 pytest tests/test_simulation.py -k seeds
"""

from __future__ import annotations

import datetime as dt
import os
import time

import pytest

from cloudckpt import (
    CheckpointManager,
    FencedError,
    StaleAttemptError,
    StoreError,
    attempt_layout,
    failpoints,
    manifests,
    protocol,
)
from cloudckpt.admin import pin, unpin
from cloudckpt.committer import AttemptAge, Committer, read_latest
from cloudckpt.errors import PreconditionFailedError
from cloudckpt.gc import collect_garbage
from cloudckpt.restore import restore
from cloudckpt.stores import CREATE, open_store
from cloudckpt.stores.memory import ManualClock
from cloudckpt.testing import simulation
from cloudckpt.testing.faults import (
    Callback,
    FaultInjectingStore,
    LoseResponse,
    Rule,
    Truncate,
)
from cloudckpt.testing.wrappers import DropPreconditions
from cloudckpt.transfer import TransferEngine


def _seed_range() -> list[int]:
    spec = os.environ.get("CLOUDCKPT_SIM_SEEDS", "300")
    if ":" in spec:
        a, b = spec.split(":")
        return list(range(int(a), int(b)))
    return list(range(int(spec)))


def test_seeds():
    """Every invariant of docs/design.md §9 after every step, for 300 seeds (0 violations)."""
    seeds = _seed_range()
    started = time.perf_counter()
    results = simulation.run_seeds(seeds, jobs=2)
    summary = simulation.summarize(results)
    print(
        f"\nsimulation: {summary['seeds']} seeds, {summary['ticks']} steps, "
        f"{sum(summary['faults_injected'].values())} faults {summary['faults_injected']}, "
        f"{summary['crashes']} crashes, {summary['violations']} violations, "
        f"{time.perf_counter() - started:.0f}s"
    )
    failed = [r for r in results if not r.ok]
    assert not failed, "\n\n".join(r.report() for r in failed[:5])
    # The harness must actually exercise what it claims to.
    c = summary["counters"]
    # (2 per seed: a save lists its attempt once more before its commit and the store's
    # clock steps back for some writes, so fewer saves commit than the 2.5 per seed of
    # before, issue 28 item 4: seeds 0-299 acknowledged 766 saves before, 716 since.)
    assert c["acks"] > 2 * len(seeds) and c["fenced"] > 0 and c["gc_deleted_objects"] > 0
    assert c["bit_flips_detected"] == c["bit_flips"] > 0
    # Checkpoints share chunks, GC had to keep some, and flips of chunks were caught.
    assert c["chunks_reused"] > 0 and c["chunk_flips"] > 0
    # Interrupted saves were resumed: commits named chunks of unreferenced attempts.
    assert c["resumed_chunks_committed"] > 0
    # Keep-best and one-per-period retention kept checkpoints that keep_last would drop.
    assert c["kept_by_best"] > 0 and c["kept_by_period"] > 0
    # A newer version's LATEST was met by restore (with and without LATEST), GC, repair
    # (also forced), a writer and a pin in every seed, and each refused it (I11).
    assert c["newer_format_refused"] == 8 * len(seeds)
    # Hosts were suspended, and writers that woke too late were refused.
    assert c["host_suspends"] > 0 and c["save_failed:StaleAttemptError"] > 0
    assert set(summary["faults_injected"]) >= {
        "fail_before",
        "lose_response",
        "deliver_twice",
        "conflict",
        "latency",
        "truncate",
        "short_read",
        "sticky_short_read",
    }
    # GC aborted abandoned uploads (I7 judges each against the grace period).
    assert c["uploads_aborted_by_gc"] > 0


def test_a_seed_replays_exactly():
    a, b = simulation.run_seed(11), simulation.run_seed(11)
    assert a.ok and a.trace_digest == b.trace_digest and a.counters == b.counters
    assert simulation.run_seed(12).trace_digest != a.trace_digest
    assert simulation.replay_command(11) == "python -m cloudckpt.testing.simulation --seed 11"


def test_main_prints_the_replay_command_of_a_failing_seed(monkeypatch, capsys):
    def broken(self, latest):  # a mutant: zombies are never fenced
        return None

    monkeypatch.setattr(Committer, "_check_fence", broken)
    code = simulation.main(["--seeds", "0:12"])
    out = capsys.readouterr().out
    assert code == 1
    assert "invariant violation" in out and "python -m cloudckpt.testing.simulation --seed" in out


# --- the checker is not vacuous: known-broken protocols are caught -----------------------


def _violations(seeds: range, mutate=None, steps: int = 200) -> list[str]:
    return [v for s in seeds for v in simulation.run_seed(s, steps, mutate).violations]


def test_catches_a_store_that_ignores_preconditions():
    found = _violations(range(20), DropPreconditions)
    assert any("I1" in v or "I4" in v or "I3" in v for v in found), found[:3]


def test_catches_gc_that_ignores_the_grace_period(monkeypatch):
    import cloudckpt.gc as gc

    monkeypatch.setattr(gc, "_age", lambda now, then: 10**9)
    assert any("I7" in v or "I2" in v for v in _violations(range(20)))


def test_catches_gc_that_ignores_chunk_references(monkeypatch):
    """The mutation test of GC by reference: GC that deletes chunks later checkpoints still
    name (as if no manifest named any) is caught by the simulation."""
    import cloudckpt.chunks as chunks

    monkeypatch.setattr(chunks, "protected_chunk_keys", lambda store, latest, deleting=(): set())
    found = _violations(range(60))
    assert any("I7" in v and "chunk" in v for v in found), found[:3]


def test_catches_a_writer_that_is_never_fenced(monkeypatch):
    monkeypatch.setattr(Committer, "_check_fence", lambda self, latest: None)
    assert any("I4" in v for v in _violations(range(20)))


# --- regression tests for the bugs the simulation found ---------------------------------

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)


def _attempt(store, step: int, epoch: int, data: bytes = b"x") -> protocol.CheckpointRecord:
    """Upload a one-file attempt by hand; return its record."""
    attempt = attempt_layout.new_attempt_id(NOW)
    prefix = attempt_layout.ckpt_prefix(step, epoch, attempt)
    store.put(prefix + attempt_layout.ATTEMPT_NAME, b"{}")
    store.put(prefix + "files/f", data)
    from cloudckpt import digest

    manifest = manifests.Manifest(
        ckpt=prefix,
        step=step,
        epoch=epoch,
        commit_id=attempt,
        writer_id="w",
        created_at="t",
        files=(manifests.FileEntry("f", len(data), digest.tree_digest(data)),),
    )
    body = manifest.to_bytes()
    store.put(prefix + attempt_layout.MANIFEST_NAME, body)
    return manifest.record(body, NOW)


def test_zombie_whose_commit_answer_was_lost_is_still_fenced(memory_target):
    """Seed 185: A's commit lands but its answer is lost; B claims in the gap. A learned
    that its commit landed, and adopted B's LATEST (B's writer!) as its own, so its NEXT
    commit passed the fence check and landed on B's epoch."""
    store = FaultInjectingStore(open_store(memory_target.url))
    settings = protocol.Settings(keep_last=None)
    a = Committer(store, "writer-a", settings)
    b = Committer(store, "writer-b", settings)
    a.claim()
    a.commit(_attempt(store, 1, 1))
    store.add(Rule(LoseResponse(meanwhile=b.claim), ops={"put"}, key="LATEST", modes={"update"}))
    first = _attempt(store, 2, 1)
    assert a.commit(first).find(first.commit_id) == "current"  # it did land, before B
    with pytest.raises(FencedError):
        a.commit(_attempt(store, 3, 1))
    latest = read_latest(store).latest
    assert latest.writer.id == "writer-b" and latest.current.step == 2
    assert [r.step for r in latest.retained()] == [2, 1]


def test_gc_does_not_delete_a_checkpoint_dropped_again_during_its_run(memory_target):
    """Seed 188: GC read a tombstone dropped long ago; before GC marked it, a pin brought
    it back and an unpin dropped it anew. GC marked by checkpoint id alone and deleted
    a checkpoint dropped a second earlier (readers get a grace period after a drop)."""
    clock = ManualClock()
    store = open_store(memory_target.url, {"clock": clock})
    mgr = CheckpointManager(store, keep_last=1, gc_grace=100, auto_gc=False)
    for step in (1, 2):
        with mgr.save(step=step) as d:
            (d / "f").write_bytes(b"%d" % step)
        mgr.wait()
    clock.advance(150)  # step 1's tombstone is past grace

    def pin_and_unpin(point: str) -> None:
        pin(store, 1, "keep")
        unpin(store, 1)

    with failpoints.armed("gc.after_inventory", pin_and_unpin):
        report = collect_garbage(store)
    assert report.deleted_checkpoints == []
    (tomb,) = read_latest(store).latest.tombstones
    assert tomb.record.step == 1 and tomb.state == "pending"
    assert store.exists(tomb.record.manifest_key)
    clock.advance(150)  # the new drop is past grace now
    assert [s for s, _ in collect_garbage(store).deleted_checkpoints] == [1]
    mgr.close()


def test_a_commit_delayed_in_flight_cannot_land_after_gc_deleted_its_attempt(memory_target):
    """Seed 591: a writer checked its deadline, then its compare-and-swap was delayed
    (a paused VM, SDK retries) past the grace period. GC deleted the attempt as an
    orphan without touching LATEST, so the delayed CAS still matched and committed a
    checkpoint whose files were gone. GC now writes LATEST (gc-sweep) before deleting
    orphans: the delayed CAS fails, re-reads, and the deadline refuses it."""
    clock = ManualClock()
    store = FaultInjectingStore(open_store(memory_target.url, {"clock": clock}))
    settings = protocol.Settings(keep_last=None, gc_grace_s=100)
    writer = Committer(store, "w", settings)
    writer.claim()
    age = AttemptAge(born=clock(), max_age_s=90)
    record = _attempt(store.inner, 1, 1)

    def stall_then_gc() -> None:
        clock.advance(200)  # the store's clock passes the grace period
        report = collect_garbage(store.inner)
        assert report.deleted_orphans == [record.ckpt]

    rule = Rule(Callback(before=stall_then_gc), ops={"put"}, key="LATEST", modes={"update"})
    store.add(rule)
    with pytest.raises(StaleAttemptError):
        writer.commit(record, age=age)
    assert rule.fired == 1
    latest = read_latest(store).latest
    assert latest.current is None and latest.op == "gc-sweep"


def test_first_claims_racing_on_a_new_run_do_not_ask_for_repair(memory_target):
    """Seed 27: A found no LATEST, then B created the run and uploaded, then A listed the
    run, found data and raised NeedsRepairError ("holds checkpoints but no LATEST")."""
    store = FaultInjectingStore(open_store(memory_target.url))
    b = Committer(store.inner, "b", protocol.Settings())

    def b_starts_the_run() -> None:
        b.claim()
        _attempt(store.inner, 1, 1)

    store.add(Rule(Callback(before=b_starts_the_run), ops={"list"}, key="ckpt/"))
    a = Committer(store, "a", protocol.Settings())
    assert a.claim().writer.epoch == 2  # A claims over B; no false alarm

    # GC had the same race.
    store.inner.delete(protocol.LATEST_KEY)
    for obj in list(store.inner.list("")):
        store.inner.delete(obj.key)
    store.add(Rule(Callback(before=b_starts_the_run), ops={"list"}, key="ckpt/"))
    collect_garbage(store)


def test_unpin_whose_answer_was_lost_reports_success(memory_target):
    """Seed 37: the unpin landed (and retention dropped the checkpoint), its answer was
    lost; the retry found no pin and no retained step and raised CheckpointNotFoundError
    for an unpin that had succeeded."""
    store = FaultInjectingStore(open_store(memory_target.url))
    mgr = CheckpointManager(store, keep_last=1, auto_gc=False)
    for step in (1, 2):
        with mgr.save(step=step) as d:
            (d / "f").write_bytes(b"x")
        mgr.wait()
        if step == 1:
            mgr.pin(1)
    store.add(Rule(LoseResponse(), ops={"put"}, key="LATEST", modes={"update"}))
    unpin(store, 1)
    latest = read_latest(store).latest
    assert latest.pins == () and [t.record.step for t in latest.tombstones] == [1]
    mgr.close()


def test_a_silently_truncated_upload_is_never_committed(memory_target, tmp_path):
    """Seed 33: a store (or proxy) kept fewer bytes than were sent and said nothing; the
    save committed a checkpoint whose file did not match its manifest."""
    store = FaultInjectingStore(open_store(memory_target.url))
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False)
    with mgr.save(step=1) as d:
        (d / "f").write_bytes(b"good")
    mgr.wait()
    store.add(
        Rule(Truncate(3), ops={"put"}, key=lambda k: k.endswith("/files/f") or "/chunks/" in k)
    )
    handle = mgr.save(step=2)
    with handle as d:
        (d / "f").write_bytes(b"longer than three bytes")
    with pytest.raises(StoreError, match="holds 3 bytes after uploading 23 bytes"):
        handle.result()
    assert read_latest(store).latest.current.step == 1
    res = restore(store, tmp_path / "r", TransferEngine())
    assert res.step == 1 and (res.path / "f").read_bytes() == b"good"
    mgr.close()  # the failure was collected through result(): close() does not repeat it


def test_unpinning_a_step_with_two_pinned_checkpoints_writes_seq_plus_one(memory_target):
    """Seed 202: two retained checkpoints of the same step (two writers saved step 5)
    were both pinned; unpin(5) applied one transition per pin, so the LATEST it wrote
    skipped a seq (23 after 21): the chain broke and a commit record went missing."""
    from cloudckpt.committer import edit_latest

    store = open_store(memory_target.url)
    writer = Committer(store, "w", protocol.Settings(keep_last=None))
    writer.claim()
    first, second = _attempt(store, 5, 1), _attempt(store, 5, 1)
    writer.commit(first)
    writer.commit(second)
    for record in (first, second):
        edit_latest(
            store, lambda latest, now, r=record: protocol.pin(latest, r.commit_id, "x", now)
        )
    before = read_latest(store).latest
    assert len(before.pins) == 2
    after = unpin(store, 5)
    assert after.pins == () and (after.seq, after.parent_seq) == (before.seq + 1, before.seq)
    assert store.exists(protocol.commit_record_key(after.seq))


def test_the_fault_wrapper_does_what_its_docs_say(memory_target):
    from cloudckpt.errors import TransientStoreError
    from cloudckpt.failpoints import SimulatedCrash
    from cloudckpt.testing.faults import (
        Crash,
        DeliverTwice,
        FailBefore,
        delete_latest,
        truncate_object,
    )

    store = FaultInjectingStore(open_store(memory_target.url), seed=3)
    third = store.add(Rule(FailBefore(), ops={"put"}, key="p*", skip=2))
    for key in ("p1", "p2"):
        store.put(key, b"x")
    with pytest.raises(TransientStoreError):
        store.put("p3", b"x")
    assert third.fired == 1 and not store.inner.exists("p3")
    store.add(Rule(Crash(after=True), ops={"delete"}, key="p1"))
    with pytest.raises(SimulatedCrash):
        store.delete("p1")
    assert not store.inner.exists("p1")  # applied, then the process died
    store.add(Rule(DeliverTwice(), ops={"put"}, key="c", modes={"create"}))
    with pytest.raises(PreconditionFailedError):
        store.put("c", b"x", mode=CREATE)  # the second delivery meets the first
    assert store.inner.get("c")[0] == b"x"
    truncate_object(store.inner, "p2", 0)
    assert store.inner.get("p2")[0] == b""
    store.inner.put(protocol.LATEST_KEY, b"L")
    assert delete_latest(store.inner) == b"L" and not store.inner.exists(protocol.LATEST_KEY)
    with pytest.raises(ValueError, match="unknown store operation"):
        Rule(FailBefore(), ops={"putt"})
    assert store.injected == {"fail_before": 1, "crash": 1, "deliver_twice": 1}
