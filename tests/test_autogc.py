"""Automatic GC after saves (``cloudckpt.autogc``): its failure is logged, never the
saves' failure, and never stops the saves that follow; it runs off the save worker, so a
slow or hung one never holds up a later save, and is never stacked (docs/design.md §8)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import pytest

from cloudckpt import CheckpointManager, autogc, protocol
from cloudckpt.errors import SaverStoppedError
from cloudckpt.failpoints import SimulatedCrash
from cloudckpt.stores import open_store
from cloudckpt.testing.wrappers import ForwardingStore


class BrokenUploadListing(ForwardingStore):
    """A store whose listing of incomplete uploads (only GC asks) fails with an error no
    adapter turned into a StoreError: an adapter's bug, or a library's new exception."""

    def list_multipart(self, prefix=""):
        raise RuntimeError("an exception the adapter did not translate")


def test_an_unexpected_gc_error_never_stops_the_saves_after_it(memory_target, tmp_path, caplog):
    store = BrokenUploadListing(open_store(memory_target.url))
    # max_pending=3: the saves' hand-over never blocks, so the guard below can fire (with
    # the default of one, before the fix, the second save's hand-over blocked forever).
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", gc_interval=0, max_pending=3)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        for step in (1, 2, 3):
            with mgr.save(step=step) as d:
                (d / "weights").write_bytes(b"w%d" % step * 100)
        # A hang guard, not a timing: before the fix the save worker died in GC after
        # step 1, and steps 2 and 3 were never run (wait() never returned).
        mgr.wait(timeout=30)
        mgr.close()
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert latest.current is not None and latest.current.step == 3
    # Reported by GC's own guard, as GC's failure (not only by the save worker's guard
    # of its after-save hook, which says "after the save of step N").
    own = [
        r
        for r in caplog.records
        if r.getMessage().startswith("background garbage collection failed: ")
    ]
    assert own and all("an exception the adapter did not translate" in r.getMessage() for r in own)


class GCRaises(CheckpointManager):
    """A manager whose after-save hook (``gc_if_due``, the queue's ``after_each``) raises
    itself, past ``AutoGC``'s own guard: a failure to start GC's thread, a bug."""

    calls = 0

    def gc_if_due(self) -> None:
        GCRaises.calls += 1
        raise RuntimeError("the after-save hook broke")


def test_a_failing_after_each_never_stops_later_saves_nor_fails_a_committed_one(
    memory_target, tmp_path, caplog
):
    GCRaises.calls = 0
    # max_pending=3: the hand-overs never block, so the hang guard below can fire.
    mgr = GCRaises(memory_target.url, staging_dir=tmp_path / "s", max_pending=3)
    handles = []
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        for step in (1, 2, 3):
            handle = mgr.save(step=step)
            with handle as d:
                (d / "weights").write_bytes(b"w%d" % step * 100)
            handles.append(handle)
        # A hang guard, not a timing: before the fix the hook's exception ended the save
        # worker after step 1; steps 2 and 3 never ran, their handles never resolved, and
        # wait() and close() (no timeout) waited forever.
        mgr.wait(timeout=30)
        mgr.close()
    assert [h.result(timeout=0).step for h in handles] == [1, 2, 3]  # each one committed
    assert GCRaises.calls == 3
    latest = mgr.latest()
    assert latest is not None and latest.step == 3
    failed = [r for r in caplog.records if "background garbage collection failed" in r.message]
    assert len(failed) == 3 and all(r.levelno == logging.ERROR for r in failed)
    assert "the after-save hook broke" in caplog.text


class HangingGC(ForwardingStore):
    """A store whose listing of incomplete uploads (only GC asks) hangs until ``release``
    is set: a store that stopped answering one kind of request."""

    def __init__(self, inner):
        super().__init__(inner)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def list_multipart(self, prefix=""):
        self.calls += 1
        self.entered.set()
        self.release.wait(60)
        return self.inner.list_multipart(prefix)


def _save(mgr, step):
    handle = mgr.save(step=step)
    with handle as d:
        (d / "weights").write_bytes(b"w%d" % step * 100)
    return handle


@contextlib.contextmanager
def _hung_gc(memory_target, tmp_path):
    """A manager (the default ``max_pending=1``) whose first automatic GC, due after step 1
    committed, hangs; released and closed at the end."""
    store = HangingGC(open_store(memory_target.url))
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", gc_interval=0)
    try:
        assert _save(mgr, 1).result(timeout=30).step == 1
        assert store.entered.wait(15), "GC never started"
        yield mgr, store
    finally:
        store.release.set()
        mgr.close(timeout=30)


def test_a_hung_gc_never_holds_up_a_later_save(memory_target, tmp_path):
    with _hung_gc(memory_target, tmp_path) as (mgr, _):
        # Before the fix GC ran on the save worker: step 2 waited behind it (forever).
        for step in (2, 3):
            assert _save(mgr, step).result(timeout=15).step == step
        latest = mgr.latest()
        assert latest is not None and latest.step == 3


def test_a_gc_still_running_when_the_next_is_due_is_skipped_and_logged(
    memory_target, tmp_path, caplog
):
    with (
        caplog.at_level(logging.WARNING, logger="cloudckpt"),
        _hung_gc(memory_target, tmp_path) as (mgr, store),
    ):
        for step in (2, 3):
            _save(mgr, step).result(timeout=15)
        deadline = time.monotonic() + 10
        while "garbage collection skipped" not in caplog.text:
            assert time.monotonic() < deadline, "a due GC was neither run nor skipped"
            time.sleep(0.05)
        time.sleep(0.2)  # step 3's turn, had it started one
        assert store.calls == 1  # never stacked beside the hung one
    skips = [r for r in caplog.records if "garbage collection skipped" in r.getMessage()]
    assert len(skips) == 1  # once per running collection, not once per save


def test_close_does_not_wait_forever_for_a_hung_gc(memory_target, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(autogc, "CLOSE_WAIT_S", 0.5)
    store = HangingGC(open_store(memory_target.url))
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", gc_interval=0)
    try:
        _save(mgr, 1).result(timeout=30)
        assert store.entered.wait(15)
        with caplog.at_level(logging.WARNING, logger="cloudckpt"):
            _close_in_thread(mgr, None, within=10)
        assert "still running at close" in caplog.text
    finally:
        store.release.set()


def _close_in_thread(mgr, timeout: float | None, within: float) -> float:
    """Close ``mgr`` on a thread; fails unless it returns within ``within`` seconds (a
    close that waits on is left to the hung GC's release). Returns how long it took."""
    started = time.monotonic()
    closing = threading.Thread(target=mgr.close, kwargs={"timeout": timeout})
    closing.start()
    closing.join(within)
    assert not closing.is_alive(), f"close(timeout={timeout}) waited on for a hung GC"
    return time.monotonic() - started


def test_close_with_a_timeout_gives_a_hung_gc_only_what_is_left_of_it(
    memory_target, tmp_path, monkeypatch, caplog
):
    """close(timeout=1) returns in about 1 s, not after CLOSE_WAIT_S (before, the GC wait
    ignored the caller's timeout: up to 60 s more)."""
    monkeypatch.setattr(autogc, "CLOSE_WAIT_S", 30.0)
    store = HangingGC(open_store(memory_target.url))
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", gc_interval=0)
    try:
        _save(mgr, 1).result(timeout=30)
        assert store.entered.wait(15)
        with caplog.at_level(logging.WARNING, logger="cloudckpt"):
            took = _close_in_thread(mgr, 1.0, within=8)
        assert took >= 0.8  # what was left of the timeout was given to GC
        assert "still running at close" in caplog.text
    finally:
        store.release.set()


def test_a_long_close_timeout_still_waits_for_a_hung_gc_at_most_close_wait_s(
    memory_target, tmp_path, monkeypatch, caplog
):
    """A timeout longer than CLOSE_WAIT_S is for the saves: GC still gets at most that."""
    monkeypatch.setattr(autogc, "CLOSE_WAIT_S", 0.5)
    store = HangingGC(open_store(memory_target.url))
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", gc_interval=0)
    try:
        _save(mgr, 1).result(timeout=30)
        assert store.entered.wait(15)
        with caplog.at_level(logging.WARNING, logger="cloudckpt"):
            _close_in_thread(mgr, 120.0, within=8)
        assert "still running at close" in caplog.text
    finally:
        store.release.set()


class CrashingGC(ForwardingStore):
    """A store whose listing of incomplete uploads (only GC asks) is where the process
    dies (a simulated crash)."""

    def list_multipart(self, prefix=""):
        raise SimulatedCrash("gc: list_multipart")


def test_a_simulated_crash_in_automatic_gc_stops_the_saves_as_a_dead_process(
    memory_target, tmp_path
):
    """GC runs beside the save worker now; a simulated crash there is still the whole
    process's death: no later save runs (``cloudckpt.savequeue``)."""
    mgr = CheckpointManager(
        CrashingGC(open_store(memory_target.url)), staging_dir=tmp_path / "s", gc_interval=0
    )
    try:
        _save(mgr, 1).result(timeout=30)
        deadline = time.monotonic() + 15
        while mgr.auto_gc._thread is None or mgr.auto_gc._thread.is_alive():
            assert time.monotonic() < deadline, "GC never ran"
            time.sleep(0.05)
        with pytest.raises(SaverStoppedError, match="the background saver stopped") as raised:
            _save(mgr, 2)
        assert isinstance(raised.value.__cause__, SimulatedCrash)
    finally:
        mgr.close(timeout=10)
