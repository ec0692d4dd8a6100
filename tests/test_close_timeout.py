"""``close(timeout)`` is bounded in total, and releases nothing a save still being written
needs: a store that stops answering mid-upload leaves the save running in the background,
its staging in place and the manager open; ``close()`` again commits it, and a process that
exits instead is recovered by a restart (``cloudckpt.manager``, docs/design.md §12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cloudckpt import CheckpointManager
from cloudckpt.errors import PermissionDeniedError
from cloudckpt.manager import close_call
from cloudckpt.stores import open_store
from cloudckpt.testing.faults import Callback, FailBefore, FaultInjectingStore, Rule

CHUNKS = "*/chunks/*"  # a save's data (not LATEST, a manifest or ATTEMPT.json)


def _save(mgr: CheckpointManager, step: int):
    handle = mgr.save(step=step)
    with handle as d:
        (d / "weights").write_bytes(b"w%d" % step * 1000)
    return handle


def _hung_store(url: str) -> tuple[FaultInjectingStore, threading.Event, threading.Event]:
    """A store whose first chunk upload hangs until ``release`` is set (a store that stops
    answering); ``entered`` is set once it hangs."""
    store = FaultInjectingStore(open_store(url))
    entered, release = threading.Event(), threading.Event()

    def hang() -> None:
        entered.set()
        release.wait(120)

    store.add(Rule(Callback(before=hang), ops={"put"}, key=CHUNKS, times=1))
    return store, entered, release


def _journals(staging: Path) -> dict[int, str]:
    """{step: journal state} of the attempts in staging."""
    found = {}
    for journal in (staging / "attempts").glob("*/journal.json"):
        body = json.loads(journal.read_text())
        found[body["step"]] = body["state"]
    return found


def _until(condition, within: float = 15) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _close_in_thread(
    mgr, timeout: float | None, within: float
) -> tuple[float, BaseException | None]:
    """Close ``mgr`` on a thread; fails unless it returns within ``within`` seconds. Returns
    how long it took and what it raised."""
    raised: list[BaseException] = []

    def close() -> None:
        try:
            mgr.close(timeout=timeout)
        except BaseException as exc:
            raised.append(exc)

    started = time.monotonic()
    closing = threading.Thread(target=close)
    closing.start()
    closing.join(within)
    assert not closing.is_alive(), f"close(timeout={timeout}) waited on past its bound"
    return time.monotonic() - started, (raised[0] if raised else None)


def test_close_with_a_hung_upload_returns_in_time_and_releases_nothing(memory_target, tmp_path):
    """close(timeout=1) with a save hung mid-upload raises TimeoutError within the bound
    (before: it joined the worker, waiting as long as the store hung); the save's staging,
    the store and the manager stay; a second close() after the store answers commits it."""
    store, entered, release = _hung_store(memory_target.url)
    staging = tmp_path / "s"
    mgr = CheckpointManager(store, staging_dir=staging, auto_gc=False)
    try:
        handle = _save(mgr, 1)
        assert entered.wait(15)
        _until(lambda: _journals(staging) == {1: "durable"})
        took, exc = _close_in_thread(mgr, 1.0, within=6)
        assert isinstance(exc, TimeoutError), exc
        assert 0.8 <= took < 4
        message = str(exc)
        assert message.startswith("close(timeout=1) timed out: ")
        assert "1 save(s) still being written (steps 1)" in message
        assert "close() again" in message and "background" in message
        assert "durable in staging (steps 1)" in message and "LATEST" in message
        # Nothing the running save needs was released.
        assert not mgr.closed and not handle.done()
        assert _journals(staging) == {1: "durable"}
        assert list((staging / "attempts").glob("*/files/weights"))
        assert mgr.staging._lock_fd is not None  # the staging directory is still held
        release.set()
        _, exc = _close_in_thread(mgr, 30, within=40)
        assert exc is None, exc
        assert mgr.closed and handle.result(timeout=0).step == 1
    finally:
        release.set()
        mgr.close(timeout=30)
    reader = CheckpointManager(memory_target.url, staging_dir=tmp_path / "r")
    try:
        latest = reader.latest()
        assert latest is not None and latest.step == 1
    finally:
        reader.close(timeout=30)


def test_a_timeout_is_named_in_three_figures():
    """finish_pending passes what is left of its deadline: the message names it readably."""
    assert close_call(0.9999932) == "close(timeout=1)"
    assert close_call(12.345678) == "close(timeout=12.3)" and close_call(None) == "close()"


def test_a_close_that_timed_out_keeps_an_earlier_failure_for_the_next_close(
    memory_target, tmp_path
):
    """Step 1 fails, step 2 hangs: close(timeout=1) raises TimeoutError (it takes no
    failure); the close() after the store answers commits step 2 and raises step 1's."""
    store, entered, release = _hung_store(memory_target.url)
    denied = store.add(
        Rule(FailBefore(error=PermissionDeniedError), ops={"put"}, key=CHUNKS, times=1)
    )
    store.rules.reverse()  # step 1 meets the failure, step 2 the hang
    staging = tmp_path / "s"
    mgr = CheckpointManager(store, staging_dir=staging, auto_gc=False, max_pending=2)
    try:
        h1 = _save(mgr, 1)
        h2 = _save(mgr, 2)
        assert entered.wait(15) and denied.fired == 1 and h1.done()
        _, exc = _close_in_thread(mgr, 1.0, within=6)
        assert isinstance(exc, TimeoutError), exc
        assert "(steps 2)" in str(exc)
        assert not mgr.closed
        release.set()
        _, exc = _close_in_thread(mgr, 30, within=40)
        assert isinstance(exc, PermissionDeniedError), exc
        assert mgr.closed and h2.result(timeout=0).step == 2
    finally:
        release.set()
        mgr.close(timeout=30)


def test_a_save_still_in_its_block_at_the_deadline_is_not_released_under_it(
    memory_target, tmp_path
):
    """A save another thread is still writing (inside its block) when the timeout
    expires: close() raises TimeoutError, its staging stays, and it commits afterwards."""
    staging = tmp_path / "s"
    mgr = CheckpointManager(memory_target.url, staging_dir=staging, auto_gc=False)
    try:
        handle = mgr.save(step=5)
        files = handle.__enter__()
        _, exc = _close_in_thread(mgr, 0.3, within=6)
        assert isinstance(exc, TimeoutError), exc
        assert "(steps 5)" in str(exc) and "lost" in str(exc)
        assert files.is_dir() and not mgr.closed
        (files / "weights").write_bytes(b"x" * 100)
        handle.__exit__(None, None, None)
        assert handle.result(timeout=30).step == 5
    finally:
        mgr.close(timeout=30)


def test_exiting_after_a_close_that_timed_out_is_recovered_by_a_restart(file_target, tmp_path):
    """The process exits after close(timeout) raised (the upload still hung): a restart on
    the same staging_dir commits the durable save, as the TimeoutError said."""
    staging = tmp_path / "s"
    script = textwrap.dedent(
        """
        import json, os, sys, threading, time
        from pathlib import Path
        from cloudckpt import CheckpointManager
        from cloudckpt.stores import open_store
        from cloudckpt.testing.faults import Callback, FaultInjectingStore, Rule

        url, staging = sys.argv[1], Path(sys.argv[2])
        store = FaultInjectingStore(open_store(url))
        store.add(Rule(Callback(before=lambda: threading.Event().wait()),
                       ops={"put"}, key="*/chunks/*", times=1))  # never answers
        mgr = CheckpointManager(store, staging_dir=staging, auto_gc=False)
        with mgr.save(step=1) as d:
            (d / "weights").write_bytes(b"w1" * 1000)
        journal = lambda: [json.loads(p.read_text())["state"]
                           for p in (staging / "attempts").glob("*/journal.json")]
        while journal() != ["durable"]:
            time.sleep(0.02)
        started = time.monotonic()
        try:
            mgr.close(timeout=1)
        except TimeoutError as exc:
            print("TIMEOUT", round(time.monotonic() - started, 1), exc, flush=True)
        os._exit(0)  # a hung transfer thread would hold up the interpreter's own exit
        """
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        [sys.executable, "-c", script, file_target.url, str(staging)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "TIMEOUT" in done.stdout and "durable in staging (steps 1)" in done.stdout, done.stdout
    assert float(done.stdout.split()[1]) < 4
    restarted = CheckpointManager(file_target.url, staging_dir=staging)
    try:
        info = restarted.claim()
        assert info is not None and info.step == 1
        restored = restarted.restore(tmp_path / "out")
        assert restored.step == 1
        assert (tmp_path / "out" / "weights").read_bytes() == b"w1" * 1000
    finally:
        restarted.close(timeout=30)


def test_a_local_copy_still_being_written_at_the_deadline_is_not_released_under(
    file_target, monkeypatch, tmp_path
):
    """``save_state``'s staged copy, finished after the commit as the local tier, still
    being written at the deadline: close() raises TimeoutError (before: it waited for it
    unbounded); staging stays; the next close() keeps the copy and releases everything."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from test_resume_state import hold_staged_writes

    from cloudckpt.integrations.torch import save_state
    from cloudckpt.localcopy import COMMITTED_DIR

    gate = hold_staged_writes(monkeypatch)
    staging = tmp_path / "s"
    mgr = CheckpointManager(file_target.url, staging_dir=staging, auto_gc=False, keep_local=1)
    try:
        assert save_state(mgr, 1, {"w": torch.ones(1000)}).result(timeout=60).step == 1
        took, exc = _close_in_thread(mgr, 0.5, within=6)
        assert isinstance(exc, TimeoutError) and "local copies" in str(exc), exc
        assert took < 3 and not mgr.closed and mgr.staging._lock_fd is not None
        gate.set()
        _, exc = _close_in_thread(mgr, 30, within=40)
        assert exc is None, exc
        assert mgr.closed
        assert [p.name[:12] for p in (staging / COMMITTED_DIR).iterdir()] == ["000000000001"]
    finally:
        gate.set()
        mgr.close(timeout=30)


def test_close_without_a_timeout_waits_for_a_save_begun_during_its_wait(memory_target, tmp_path):
    """close() waits for step 1's hung upload; meanwhile another thread opens step 2's block
    (close() has not yet stopped the worker). close() (no timeout) then waits for step 2 as
    well and commits it (before: it raised 'close(timeout=None) timed out')."""
    store, entered, release = _hung_store(memory_target.url)
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False)
    try:
        _save(mgr, 1)
        assert entered.wait(15)
        closing = threading.Thread(target=lambda: _close_in_thread(mgr, None, within=20))
        closing.start()
        time.sleep(0.3)  # close() is waiting for step 1
        handle = mgr.save(step=2)
        files = handle.__enter__()
        release.set()
        time.sleep(0.3)  # step 1 commits: close() sees step 2 still in its block
        (files / "w").write_bytes(b"x")
        handle.__exit__(None, None, None)
        closing.join(25)
        assert not closing.is_alive()
        assert mgr.closed and handle.result(timeout=0).step == 2
    finally:
        release.set()
        mgr.close(timeout=30)


def _save_racing_close(mgr: CheckpointManager, *, opens_after: str) -> dict:
    """Another thread's ``save()`` passes ``check_open`` before ``close()`` stops the worker,
    and opens its block either after ``settle`` returned (``opens_after="settle"``) or after
    the worker was told to stop (``"stop"``); returns what that thread got."""
    checked, go, opened = threading.Event(), threading.Event(), threading.Event()
    caller = threading.get_ident()
    check_open, settle, stop = mgr.check_open, mgr.queue.settle, mgr.queue.stop

    def held_check_open() -> None:
        check_open()
        if threading.get_ident() != caller:
            checked.set()
            assert go.wait(10)

    def racing(original):
        def call(timeout=None):
            if original is stop and opens_after == "settle":
                go.set()  # the block opens before the worker is told to stop
                assert opened.wait(10)
            result = original(timeout)
            if original is stop and opens_after == "stop":
                go.set()
                opened.wait(2)
            return result

        return call

    mgr.check_open = held_check_open
    mgr.queue.settle, mgr.queue.stop = racing(settle), racing(stop)
    got: dict = {}

    def saver() -> None:
        try:
            handle = mgr.save(step=2)
            with handle as files:
                opened.set()
                time.sleep(0.3)
                (files / "w").write_bytes(b"x" * 1000)
            got["handle"] = handle
        except BaseException as exc:
            got["raised"] = exc
            opened.set()

    thread = threading.Thread(target=saver)
    thread.start()
    assert checked.wait(10)
    _, got["close"] = _close_in_thread(mgr, None, within=20)
    thread.join(10)
    return got


@pytest.mark.parametrize("opens_after", ["settle", "stop"])
def test_a_save_begun_as_close_stops_the_worker_is_run_or_refused(
    memory_target, tmp_path, opens_after
):
    """A save whose block opens after close() waited for the saves: opened before the
    worker is told to stop, the worker waits for it, runs it, and close() releases
    nothing until it committed; opened after, it is refused. Before: the worker ended,
    close() released staging under the block, and the save, accepted, never ran."""
    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s", auto_gc=False)
    _save(mgr, 1).result(timeout=15)
    got = _save_racing_close(mgr, opens_after=opens_after)
    assert got["close"] is None, got["close"]
    assert mgr.closed
    if opens_after == "settle":
        assert "raised" not in got, got
        assert got["handle"].result(timeout=0).step == 2
    else:
        assert "closed" in str(got.get("raised")), got


def test_finish_pending_raises_a_failure_no_handle_covered_when_close_times_out(
    memory_target, tmp_path
):
    """The integrations' finish_pending drops the manager when its close() times out: step
    1's failure (no handle given covers it) must be raised then, not lost (before: it
    returned normally, and no one was ever told)."""
    from cloudckpt.integrations._pending import finish_pending

    store, entered, release = _hung_store(memory_target.url)
    denied = store.add(
        Rule(FailBefore(error=PermissionDeniedError), ops={"put"}, key=CHUNKS, times=1)
    )
    store.rules.reverse()  # step 1 meets the failure, step 2 the hang
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False, max_pending=2)
    try:
        h1 = _save(mgr, 1)
        _save(mgr, 2)
        assert entered.wait(15) and denied.fired == 1 and h1.done()
        with pytest.raises(PermissionDeniedError):
            finish_pending(mgr, [], 1.0, lambda info: None)
        assert not mgr.closed
    finally:
        release.set()
        mgr.close(timeout=30)


def test_an_attempt_is_durable_only_once_its_journal_says_so(tmp_path, monkeypatch):
    """close()'s TimeoutError names as durable (a restart commits them) the saves whose
    attempt says ``durable``: that must be so only once the journal is on disk, not while
    its write hangs (a stuck disk) nor after it failed (before: set at once)."""
    from cloudckpt import staging as staging_module
    from cloudckpt.errors import StagingError
    from cloudckpt.staging import DURABLE, StagingArea

    area = StagingArea(tmp_path / "s")
    try:
        attempt = area.new_attempt("a1", 1, {}, {})
        before = attempt.state
        entered, release = threading.Event(), threading.Event()
        fsync = os.fsync

        def hung_fsync(fd: int) -> None:
            entered.set()
            assert release.wait(15)
            fsync(fd)

        monkeypatch.setattr(staging_module.os, "fsync", hung_fsync)
        writing = threading.Thread(target=attempt.set_state, args=(DURABLE,))
        writing.start()
        assert entered.wait(15)
        assert attempt.state == before  # the journal is still being written
        release.set()
        writing.join(15)
        assert attempt.state == DURABLE
        monkeypatch.setattr(staging_module.os, "fsync", fsync)

        attempt2 = area.new_attempt("a2", 2, {}, {})

        def failing_replace(src: object, dst: object) -> None:
            raise OSError(5, "I/O error")

        monkeypatch.setattr(staging_module.os, "replace", failing_replace)
        with pytest.raises(StagingError):
            attempt2.set_state(DURABLE)
        assert attempt2.state != DURABLE
    finally:
        area.close()
