"""A multi-rank manager's ``close(timeout)`` is bounded and releases nothing while this
rank's own work from a failed phase still runs (``Comm.run_phase``: a heartbeat that
raised ``CollectiveError`` fails the save while the rank's upload, on the collectives'
helper thread, goes on into a store that stopped answering)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

from cloudckpt.distributed import DistributedCheckpointManager, _comm
from cloudckpt.errors import CollectiveError
from cloudckpt.stores import open_store
from cloudckpt.testing.faults import Callback, FaultInjectingStore, Rule

CHUNKS = "*/chunks/*"


def _noting(part, released: list[str]):
    """``part.close`` that notes its class name in ``released`` first."""
    real, name = part.close, type(part).__name__

    def close(*args, **kwargs):
        released.append(name)
        return real(*args, **kwargs)

    return close


def _lost_contact(self, code, what):
    raise CollectiveError(f"rank 1 lost contact while {what} (simulated)")


def test_close_is_bounded_and_releases_nothing_under_a_failed_phase_s_work(
    monkeypatch, memory_target, tmp_path
):
    """A heartbeat raises CollectiveError while this rank's upload hangs: the save fails,
    the upload goes on. close(timeout=1) returns within about 1 s with a TimeoutError
    naming that work, releases nothing (staging, the engine); close() after the work ends
    releases everything. (Before: close() released everything under the upload, then
    waited in the helper's shutdown for as long as the store hung.)"""
    store = FaultInjectingStore(open_store(memory_target.url))
    entered, release = threading.Event(), threading.Event()

    def hang() -> None:
        entered.set()
        release.wait(60)

    store.add(Rule(Callback(before=hang), ops={"put"}, key=CHUNKS, times=1))
    monkeypatch.setattr(_comm.Comm, "heartbeat", _lost_contact)
    mgr = DistributedCheckpointManager(store, staging_dir=tmp_path / "s")
    released: list[str] = []
    for part in (mgr.staging, mgr.engine, mgr.store):
        monkeypatch.setattr(part, "close", _noting(part, released))
    try:
        handle = mgr.save(1)
        with handle as d:
            (d / "a.bin").write_bytes(b"x" * 1000)
        assert entered.wait(15)
        with pytest.raises(CollectiveError):
            handle.result(timeout=15)
        outcome: list[BaseException | None] = []

        def close() -> None:
            try:
                mgr.close(timeout=1)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        started = time.monotonic()
        closing = threading.Thread(target=close, daemon=True)
        closing.start()
        closing.join(10)
        took = time.monotonic() - started
        assert not closing.is_alive(), "close(timeout=1) did not return"
        assert took < 5, took
        (raised,) = outcome
        assert isinstance(raised, TimeoutError), repr(raised)
        assert "failed collective phase" in str(raised) and "nothing was released" in str(raised)
        assert "(uploading step 1)" in str(raised), str(raised)
        assert not mgr.closed and released == []
        assert (tmp_path / "s").exists()
    finally:
        release.set()
    mgr.close(timeout=15)
    assert mgr.closed and len(released) >= 2
