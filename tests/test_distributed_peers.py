"""Peer copies (issue 30 item 4; ``cloudckpt/distributed/_peers.py``): 2 simulated hosts x
2 ranks under torchrun (tests/scripts/dist_peers.py), every byte a restore read counted on
the store's side (``Served``), every restored file compared with what was saved."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from dist_peers import NAMES, content
from distrun import Launch

from cloudckpt import digest
from cloudckpt.attempt_layout import chunk_name
from cloudckpt.committer import read_latest
from cloudckpt.stores import open_store

PEERS = Path(__file__).parent / "scripts" / "dist_peers.py"
pytestmark = pytest.mark.timeout(600)  # two 4-rank torchrun jobs in the first test's setup
_cache: dict = {}


def peer_jobs(moto_server, tmp_path_factory) -> dict:
    """The save job, host 1's loss, the restore job: once per session."""
    if "jobs" in _cache:
        return _cache["jobs"]
    bucket = f"peers-{os.urandom(3).hex()}"
    moto_server.create_bucket(bucket)
    url, options = f"s3://{bucket}/run", moto_server.storage_options()
    work = tmp_path_factory.mktemp("peers")
    root = work / "hosts"
    save = Launch(
        "save", url, work / "save", options, nproc=4, extra=("--root", str(root)), script=PEERS
    )
    save.wait(240)
    shutil.rmtree(root / "host1")  # host 1 is lost with its disk; a replacement starts empty
    restore = Launch(
        "restore", url, work / "restore", options, nproc=4, extra=("--root", str(root)),
        script=PEERS,
    )  # fmt: skip
    restore.wait(240)
    store = open_store(url, options)
    try:
        records = {r.step: r for r in read_latest(store).latest.retained()}
    finally:
        store.close()
    _cache["jobs"] = {"save": save, "restore": restore, "records": records}
    return _cache["jobs"]


@pytest.fixture
def jobs(moto_server, tmp_path_factory):
    return peer_jobs(moto_server, tmp_path_factory)


def names(step: int, ranks) -> set[str]:
    """The chunk names of ``ranks``' files of ``step`` (each file is one chunk)."""
    return {
        chunk_name(digest.ALGORITHM, digest.hexleaf(content(step, r, n)))
        for r in ranks
        for n in NAMES
    }


def own(step: int, ranks) -> int:
    return sum(len(content(step, r, n)) for r in ranks for n in NAMES)


def test_peer_copies_are_held_verified_and_a_failed_transfer_leaves_the_commit(jobs):
    """After each commit host 0 holds host 1's files and host 1 holds host 0's, every
    chunk verified on receipt: a chunk rank 0 flipped while sending is not held (a warning
    on rank 2's save) and the older copy stays until a newer one is complete. Host 1 (ranks
    2 and 3) killed in step 3's peer transfer leaves step 3 committed: the surviving ranks'
    saves return their CommitInfo with a warning naming rank 2, and LATEST names step 3."""
    save = jobs["save"]
    one = lambda r, step: save.one(r, "saved", step=step)  # noqa: E731
    first = one(0, 1)["pool"]
    assert set(first["names"]) == names(1, (2, 3)) and first["verify"]
    assert first["bytes"] == own(1, (2, 3))
    assert one(2, 1)["pool"]["names"] == sorted(names(1, (0, 1)))
    assert all(one(r, s)["warnings"] == [] for r in range(4) for s in (1, 2) if (r, s) != (2, 2))

    second = one(0, 2)["pool"]  # complete: step 1's copy dropped, its chunks with it
    assert set(second["names"]) == names(2, (2, 3)) and second["verify"]
    assert [i[:12] for i in second["indexes"]] == ["000000000002"]
    flipped = one(2, 2)  # the chunk rank 0 flipped is not held; step 1's copy stays
    assert one(0, 2)["flipped"] == [524288]
    assert flipped["warnings"] == ["step 2: peer copies: 1 chunk(s) of the peer copy were not held"]
    held = set(flipped["pool"]["names"])
    assert flipped["pool"]["verify"] and len(held & names(2, (0, 1))) == 3
    assert held >= names(1, (0, 1))

    for r in (2, 3):  # host 1 died in step 3's peer transfer
        assert all(e["step"] != 3 for e in save.events(r, "saved"))
    for r in (0, 1):
        (warning,) = one(r, 3)["warnings"]
        assert "step 3 is committed, but could not make its peer copies" in warning
        assert "rank 2" in warning
    assert "receiving a chunk from rank 2" in one(0, 3)["warnings"][0]
    assert one(0, 3)["pool"]["indexes"][0].startswith("000000000002")  # still held
    assert max(jobs["records"]) == 3


def test_a_replacement_host_restores_from_its_peer(jobs):
    """Host 1 replaced (empty directory). Resuming step 3 (no complete peer copy of host
    1's step 3: rank 2 died in its transfer), host 1 reads its files from the store.
    Step 2, whose copy host 0 holds: host 1 reads only the manifest from the store, every
    file exact. A peer answering wrong bytes: host 1 reads exactly those chunks from the
    store. Step 1, with a forged chunk in host 0's peer store under a name of host 1's
    step 1: sent, refused, read from the store. Every restore exact on every rank."""
    restore, records = jobs["restore"], jobs["records"]
    runs = {w: [restore.one(r, "restored", what=w) for r in range(4)] for w in
            ("resume", "step-2", "corrupt", "forged")}  # fmt: skip
    assert all(run["exact"] for both in runs.values() for run in both)
    host1 = lambda w: sum(runs[w][r]["served_checkpoint"] for r in (2, 3))  # noqa: E731
    assert all(runs[w][1]["served"] == {} for w in runs)  # host 0 reads from its kept copy
    assert runs["resume"][0]["served_checkpoint"] == 0

    assert host1("resume") == records[3].manifest_size + own(3, (2, 3))
    assert host1("step-2") == records[2].manifest_size  # everything else from host 0
    # The result says so too: host 1's downloading rank (2) took its share from its peer.
    assert runs["step-2"][2]["bytes_from_peers"] == own(2, (2, 3))
    assert runs["step-2"][2]["bytes_downloaded"] == 0  # the manifest is no file's bytes
    assert runs["corrupt"][2]["bytes_from_peers"] == 0  # every chunk sent was refused
    assert records[2].manifest_size / own(2, (2, 3)) <= 0.05
    sent = restore.one(0, "sent", what="corrupt")["sent"]
    assert sent == own(2, (2, 3))
    assert host1("corrupt") == records[2].manifest_size + own(2, (2, 3))
    forged = restore.one(0, "sent", what="forged")
    assert forged["forged"] in names(1, (2, 3)) and forged["sent"] > 0
    assert host1("forged") == records[1].manifest_size + own(1, (2, 3))


def test_a_peer_dying_while_it_sends_is_a_clear_error(jobs):
    """Rank 0 dies sending host 1's chunks: every other rank's restore raises a
    CollectiveError (rank 2's naming rank 0), nothing restored in place, no hang."""
    restore = jobs["restore"]
    for r in (1, 2, 3):
        failed = restore.one(r, "restore-failed")
        assert failed["type"] == "CollectiveError"
        assert not restore.events(r, "unexpected-restore")
    assert "receiving a chunk from rank 0" in restore.one(2, "restore-failed")["message"]
