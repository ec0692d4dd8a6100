"""No collective waits forever (issue 30 item 6), in the restore path: a rank that stops
(or dies) before the barrier that ends a multi-rank restore (its "placing" phase) makes
the other rank fail within the collective timeout (at once), with a ``CollectiveError``
naming it.

The save path's dead and hung ranks are tests/test_distributed.py's kill jobs; the list of
collectives and their timeouts is in docs/integrations/distributed.md ("Failures and
timeouts").
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from distrun import Launch

MORE = Path(__file__).parent / "scripts" / "dist_more.py"
TIMEOUT = 8.0  # the job's collective timeout, seconds


@pytest.mark.parametrize("how", ["stall", "die"])
def test_a_rank_that_never_reaches_the_post_restore_barrier_is_named_within_the_timeout(
    moto_server, tmp_path, how
):
    bucket = f"stall-{os.urandom(3).hex()}"
    moto_server.create_bucket(bucket)
    url = f"s3://{bucket}/run"
    job = Launch(
        "restore-stall",
        url,
        tmp_path / "job",
        moto_server.storage_options(),
        extra=("--timeout", str(TIMEOUT), "--how", how),
        script=MORE,
    )
    try:
        job.wait_for(lambda: job.events(0, "restore-failed"), 90, "rank 0's error")
        stalled_at = (job.work / "stalled.json").stat().st_mtime
        failed = job.one(0, "restore-failed")
        stalled = json.loads((job.work / "stalled.json").read_text())
    finally:
        job.kill()  # rank 1 sleeps on: the test is done with it
    assert stalled["pid"] == job.one(1, "start")["pid"]
    assert failed["type"] == "CollectiveError"
    assert (
        "rank 0 lost contact with the other ranks while restoring: placing step 1"
        in (failed["message"])
    )
    assert "rank 1 never reached it (its last: 'restoring step 1')" in failed["message"]
    waited = failed["at"] - stalled_at
    # Bounded by the 90 s wait above, far below rank 1's 600 s sleep (what a collective
    # without a timeout would wait); no tighter bound: a busy CI machine delays both ranks.
    if how == "stall":  # given up by the timeout itself, never before it
        assert "Timed out" in failed["message"]
        assert waited >= TIMEOUT - 1.5


@pytest.mark.parametrize("how", ["stall", "die"])
def test_a_fan_out_sender_that_dies_or_stalls_fails_the_restore_never_hangs_it(
    moto_server, tmp_path, how
):
    """Read once, fan out (issue 30 item 5): 2 simulated nodes of one rank each, DP
    replicas. Rank 1 dies or stalls where it would send its first shared chunk: rank 0,
    waiting to receive it, raises a ``CollectiveError`` saying so (at once for a dead
    sender, after the timeout for a silent one), and restores nothing."""
    bucket = f"fanout-dead-{os.urandom(3).hex()}"
    moto_server.create_bucket(bucket)
    job = Launch(
        "fanout-dead",
        f"s3://{bucket}/run",
        tmp_path / "job",
        moto_server.storage_options(),
        extra=("--timeout", str(TIMEOUT), "--how", how),
        script=MORE,
    )
    try:
        job.wait_for(lambda: job.events(0, "restore-failed"), 90, "rank 0's error")
        failed = job.one(0, "restore-failed")
    finally:
        job.kill()
    assert (job.work / "stalled.json").exists()
    assert failed["type"] == "CollectiveError"
    assert "receiving a chunk from rank 1" in failed["message"], failed["message"]
    assert not job.events(0, "unexpected-restore")
    assert not (job.work / "node0" / "r").exists()  # nothing half-restored in place
    if how == "stall":
        assert "Timed out" in failed["message"]


# ------------------------------------------------------------------------------ in-process


class NotesStore:
    """A stand-in for the rendezvous store: a dict, or one that never answers reads."""

    def __init__(self, hang: bool = False) -> None:
        import threading

        self.notes: dict[str, bytes] = {}
        self.hang = hang
        self.noted = threading.Event()
        self._never = threading.Event()

    def set(self, key, value):
        self.notes[key] = value.encode()
        self.noted.set()

    def check(self, keys):
        if self.hang:
            self._never.wait()
        return all(k in self.notes for k in keys)

    def multi_get(self, keys):
        return [self.notes[k] for k in keys]


def test_the_error_names_the_ranks_behind_and_never_waits_on_the_store(monkeypatch):
    from cloudckpt.distributed import _comm

    monkeypatch.setattr(_comm, "_SETTLE_S", 0.0)
    monkeypatch.setattr(_comm, "_LOOKUP_S", 0.2)
    store = NotesStore()
    store.notes = {"1": b"7\tuploading step 2", "2": b"9\tuploading step 2"}
    here = _comm.Whereabouts(store, 0, 4)
    here.entered(9, "uploading step 2")
    assert store.noted.wait(10)
    said = here.culprits(9)
    assert "rank 1 never reached it (its last: 'uploading step 2')" in said
    assert "rank 3 never reached any" in said and "rank 2" not in said
    here.close()

    store.notes = {"1": b"9\tx"}
    assert "every rank had entered it" in _comm.Whereabouts(store, 0, 2).culprits(9)
    # A store that never answers: the error comes anyway, naming no rank.
    said = _comm.Whereabouts(NotesStore(hang=True), 0, 2).culprits(9)
    assert "which one is unknown" in said
