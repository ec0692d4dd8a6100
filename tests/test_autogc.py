"""Automatic GC after saves (``cloudckpt.autogc``): its failure is logged, never the
saves' failure, and never stops the saves that follow (docs/design.md §8)."""

from __future__ import annotations

import logging

from cloudckpt import CheckpointManager, protocol
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
