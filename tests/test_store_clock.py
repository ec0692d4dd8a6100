"""Issue 21 item 1: an attempt's age is judged on the store's clock, not the host's.

A host's ``time.monotonic()`` stops while its VM is suspended or hibernated; GC's grace
period runs on the store's clock. Each test here suspends the host by moving only the
store's clock (``ManualClock``) at an exact point of a save, the way a hibernated VM sees
the world when it wakes: the host's own clocks barely moved.
"""

from __future__ import annotations

import pytest

from cloudckpt import CheckpointManager, ConfigurationError, StaleAttemptError, protocol
from cloudckpt.gc import collect_garbage
from cloudckpt.stores import open_store
from cloudckpt.stores.memory import ManualClock
from cloudckpt.testing.faults import Callback, FaultInjectingStore, Rule

GRACE = 100


@pytest.fixture
def clocked(memory_target):
    clock = ManualClock()
    return FaultInjectingStore(open_store(memory_target.url, {"clock": clock})), clock


def _save(mgr, step, data):
    handle = mgr.save(step=step)
    with handle as d:
        (d / "f").write_bytes(data)
    return handle


def _latest(store) -> protocol.Latest:
    return protocol.parse_latest(store.inner.get(protocol.LATEST_KEY)[0])


# Where a host can fall asleep in a save with the most at stake: after the upload, before
# the manifest; after the manifest, before the compare-and-swap of LATEST.
WINDOWS = {
    "before-manifest": dict(ops={"put"}, key="ckpt/*/MANIFEST.json"),
    "before-commit": dict(ops={"put"}, key="LATEST", modes={"update"}),
}


CASES = [
    ("before-manifest", True),
    ("before-commit", True),
    # Asleep before the manifest: the commit's own clock check, made after waking, refuses.
    ("before-manifest", False),
]


@pytest.mark.parametrize(("window", "gc_meanwhile"), CASES, ids=lambda v: str(v))
def test_a_suspended_host_cannot_commit_after_waking(clocked, tmp_path, window, gc_meanwhile):
    store, clock = clocked
    mgr = CheckpointManager(
        store, staging_dir=tmp_path / "s", keep_last=2, gc_grace=GRACE, auto_gc=False
    )
    _save(mgr, 1, b"one").result()
    swept = []

    def suspend() -> None:
        clock.advance(3.5 * GRACE)  # the store's clock moves on; this host's does not
        if gc_meanwhile:  # another host's GC finds the attempt orphaned and deletes it
            swept.extend(collect_garbage(store.inner).deleted_orphans)

    rule = Rule(Callback(before=suspend), **WINDOWS[window], times=1)
    store.add(rule)
    with pytest.raises(StaleAttemptError, match="store's clock"):
        _save(mgr, 2, b"two").result()
    assert rule.fired == 1
    if gc_meanwhile:
        assert len(swept) == 1 and swept[0].startswith("ckpt/000000000002-")
    latest = _latest(store)
    assert latest.current.step == 1 and [r.step for r in latest.retained()] == [1]
    # The run still restores, and the next save (a fresh attempt) commits.
    assert mgr.restore(tmp_path / "r").step == 1
    assert _save(mgr, 3, b"three").result().step == 3
    mgr.close()


def test_asleep_between_its_clock_check_and_its_write_with_no_gc_it_commits(clocked, tmp_path):
    """The clock is read, then the host sleeps before the compare-and-swap. If no GC swept
    LATEST meanwhile, the write still matches and lands; that is safe: GC deletes an orphan
    only after its sweep, judged against the LATEST the sweep wrote, which names this
    checkpoint. The checkpoint is current and intact, and a GC after it keeps it."""
    store, clock = clocked
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", gc_grace=GRACE, auto_gc=False)
    _save(mgr, 1, b"one").result()
    rule = Rule(Callback(before=lambda: clock.advance(3.5 * GRACE)), **WINDOWS["before-commit"])
    store.add(rule)
    assert _save(mgr, 2, b"two").result().step == 2
    assert rule.fired == 1
    assert collect_garbage(store.inner).deleted_orphans == []
    res = mgr.restore(tmp_path / "r")
    assert res.step == 2 and (res.path / "f").read_bytes() == b"two"
    mgr.close()


def test_a_pause_shorter_than_the_limit_still_commits(clocked, tmp_path):
    store, clock = clocked
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", gc_grace=GRACE, auto_gc=False)
    rule = Rule(Callback(before=lambda: clock.advance(0.8 * GRACE)), **WINDOWS["before-commit"])
    store.add(rule)
    _save(mgr, 1, b"one").result()
    assert rule.fired == 1 and _latest(store).current.step == 1
    mgr.close()


def test_a_grace_period_the_stores_clock_cannot_resolve_is_refused(s3_target, tmp_path):
    """S3's clock (Date, LastModified) counts whole seconds: an attempt's age can read two
    seconds short, so a 1 s grace period cannot protect anything. Refused when the manager
    is built (issue 32), before anything is staged or uploaded."""
    with pytest.raises(ConfigurationError, match="too short"):
        CheckpointManager(
            s3_target.url,
            storage_options=s3_target.storage_options,
            staging_dir=tmp_path / "s",
            gc_grace=1,
            auto_gc=False,
        )
    # A grace period a few clock steps long works on the same store.
    mgr = CheckpointManager(
        s3_target.url,
        storage_options=s3_target.storage_options,
        staging_dir=tmp_path / "s2",
        gc_grace=10,
        auto_gc=False,
    )
    assert _save(mgr, 1, b"one").result().step == 1
    mgr.close()


def test_a_store_clock_stepping_back_before_attempt_json_cannot_let_gc_own_a_commit(
    clocked, tmp_path
):
    """Issue 28 item 4: the store's clock steps back 30 s between the writer's reading of
    it (the attempt's birth) and the write of its ``ATTEMPT.json``, which GC then dates
    the attempt by: 30 s older than the writer thought. 75 s later the writer's own
    reckoning (75 s) is inside the 90 s bound, GC's (105 s) past the 100 s grace: GC
    sweeps and deletes the attempt just before the compare-and-swap. The writer dates its
    attempt as GC does (its objects' oldest ``last_modified``) and refuses to commit."""
    store, clock = clocked
    mgr = CheckpointManager(
        store, staging_dir=tmp_path / "s", keep_last=2, gc_grace=GRACE, auto_gc=False
    )
    writer = mgr.attempts
    writer.claim()
    back = Rule(
        Callback(before=lambda: clock.advance(-30), after=lambda _: clock.advance(30)),
        ops={"put"},
        key="ckpt/*/ATTEMPT.json",
    )
    store.add(back)
    src = tmp_path / "f"
    src.write_bytes(b"weights" * 100)
    begun = writer.begin(1)
    entries, _ = writer.upload(begun, [("f", src)])
    assert back.fired == 1
    clock.advance(75)

    def gc_first() -> None:  # GC's sweep and deletions land right before the CAS
        report = collect_garbage(store.inner)
        assert report.deleted_orphans == [begun.prefix]

    gc = Rule(Callback(before=gc_first), ops={"put"}, key="LATEST", modes={"update"})
    store.add(gc)
    with pytest.raises(StaleAttemptError):
        writer.finish(begun, entries, {})
    latest = _latest(store)
    assert latest.current is None  # nothing names the files GC owns (or deleted)
    mgr.close()
