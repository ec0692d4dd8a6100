"""A save worker stopped for good (a BaseException on it: a simulated crash, Ctrl-C or
SystemExit on that thread) refuses every later save at once and loudly; nothing waits for
it (``cloudckpt.savequeue``, issue 31)."""

from __future__ import annotations

import threading
import time

import pytest

from cloudckpt import CheckpointManager, failpoints, protocol
from cloudckpt.errors import CloudCkptError, SaverStoppedError
from cloudckpt.failpoints import SimulatedCrash

STOPPED = "the background saver stopped"


def _write(d, step: int) -> None:
    (d / "weights").write_bytes(b"w%d" % step * 100)


def _save(mgr: CheckpointManager, step: int):
    handle = mgr.save(step=step)
    with handle as d:
        _write(d, step)
    return handle


def _assert_stopped(exc: BaseException, cause: type[BaseException]) -> None:
    """``exc`` says the saver stopped, why (chained) and what to do, in a class of its own:
    a loop that retries failed saves must tell it apart (cloudckpt.SaverStoppedError)."""
    assert type(exc) is SaverStoppedError and isinstance(exc, CloudCkptError)
    assert STOPPED in str(exc) and "Restart the process" in str(exc) and "LATEST" in str(exc)
    assert isinstance(exc.__cause__, cause)
    assert cause.__name__ in str(exc)


def _staged(staging) -> list[str]:
    return sorted(p.name for p in (staging / "attempts").iterdir())


def test_after_a_crash_on_the_worker_every_later_save_is_refused_at_once(memory_target, tmp_path):
    staging = tmp_path / "s"
    mgr = CheckpointManager(memory_target.url, staging_dir=staging)
    try:
        with failpoints.armed("commit.before_cas"), pytest.raises(SimulatedCrash):
            _save(mgr, 1).result(timeout=30)
        left = _staged(staging)  # the crashed save's journal stays, as a dead process's
        # Before the fix each of these was accepted and never run: its result(), wait()
        # and close() waited forever (with max_pending full, save() blocked at hand-over).
        with pytest.raises(SaverStoppedError) as raised:
            mgr.save(step=2)
        _assert_stopped(raised.value, SimulatedCrash)
        src = tmp_path / "src"
        src.mkdir()
        _write(src, 3)
        with pytest.raises(SaverStoppedError, match=STOPPED):
            mgr.save_dir(3, src)
        assert _staged(staging) == left  # nothing new staged
        mgr.wait(timeout=10)  # the crash was reported (result above): nothing to raise
        assert not mgr.store.exists(protocol.LATEST_KEY)  # nothing was committed
    finally:
        mgr.close(timeout=10)


def test_saves_waiting_for_a_slot_or_still_in_their_block_fail_when_the_worker_stops(
    memory_target, tmp_path
):
    """The worker dies with step 1 in flight, step 2 queued, step 3 in its block and step
    4 waiting for a queue slot: 1 and 2 fail with the crash, 3's hand-over and 4's entry
    raise that the saver stopped, and nothing waits."""
    gate = threading.Event()

    def crash_when_let(point: str) -> None:
        gate.wait(30)
        raise SimulatedCrash(point)

    staging = tmp_path / "s"
    mgr = CheckpointManager(memory_target.url, staging_dir=staging, max_pending=2)
    outcome: dict[str, BaseException | None] = {}

    def save_4() -> None:
        try:
            with mgr.save(step=4) as d:  # blocks: the queue is full
                _write(d, 4)
            outcome["4"] = None
        except BaseException as exc:
            outcome["4"] = exc

    failpoints.arm("commit.before_cas", crash_when_let)
    try:
        h1 = _save(mgr, 1)  # in flight, held at the failpoint
        h2 = _save(mgr, 2)  # queued
        h3 = mgr.save(step=3)
        d3 = h3.__enter__()  # in its block: the queue is full now
        _write(d3, 3)
        waiter = threading.Thread(target=save_4)
        waiter.start()
        time.sleep(0.3)
        assert "4" not in outcome  # still waiting for a slot
        gate.set()
        waiter.join(15)
        assert not waiter.is_alive(), "a save waiting for a slot was never let go"
        exc4 = outcome["4"]
        assert exc4 is not None, "a save entered after the worker stopped was accepted"
        _assert_stopped(exc4, SimulatedCrash)
        for handle in (h1, h2):
            with pytest.raises(SimulatedCrash):
                handle.result(timeout=15)
        with pytest.raises(SaverStoppedError, match=STOPPED):
            h3.__exit__(None, None, None)  # the hand-over
        with pytest.raises(SaverStoppedError, match=STOPPED):
            h3.result(timeout=0)
        assert len(_staged(staging)) == 2  # 1 and 2, as a dead process left them; not 3
        mgr.wait(timeout=10)
    finally:
        gate.set()
        failpoints.disarm()
        mgr.close(timeout=10)
    restarted = CheckpointManager(memory_target.url, staging_dir=staging)
    try:
        # Step 1 was made durable and uploaded before the crash: a restart commits it.
        # Step 2 never reached the worker's sync (staged only): abandoned, as after a
        # real crash (recovery.decide).
        assert restarted.claim().step == 1
        assert [c.step for c in restarted.list()] == [1]
    finally:
        restarted.close(timeout=10)


class InterruptedAfterSave(CheckpointManager):
    """A manager whose after-save hook gets a KeyboardInterrupt on the save worker."""

    def gc_if_due(self) -> None:
        raise KeyboardInterrupt


def test_a_keyboard_interrupt_on_the_worker_refuses_later_saves_and_close_returns(
    memory_target, tmp_path
):
    mgr = InterruptedAfterSave(memory_target.url, staging_dir=tmp_path / "s")
    try:
        assert _save(mgr, 1).result(timeout=30).step == 1  # committed before the hook ran
        worker = mgr.queue._worker
        assert worker is not None
        worker.join(15)  # the interrupt ends the worker thread
        assert not worker.is_alive()
        with pytest.raises(SaverStoppedError) as raised:
            _save(mgr, 2)
        _assert_stopped(raised.value, KeyboardInterrupt)
        mgr.wait(timeout=10)
        latest = mgr.latest()
        assert latest is not None and latest.step == 1
    finally:
        mgr.close(timeout=10)  # nothing unreported: step 1 committed, step 2 raised
