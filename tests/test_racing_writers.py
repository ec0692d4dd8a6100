"""Racing writers in separate processes against S3 (moto and SeaweedFS), fake-gcs-server
(GCS) and Azurite (Azure Blob).

- Racing compare-and-swaps of LATEST from the same base: exactly one wins, every other one
  gets a precondition failure (or S3's 409), never a silent overwrite.
- Racing claims: every claim lands once (epochs never reused); then racing commits, each
  from its own claim: exactly one (the newest epoch's) wins, the others are fenced.
- Racing CheckpointManagers that resume one after another while the previous one is still
  saving: each older writer is fenced; no acknowledged save is lost; the commit records
  form one chain in which no older epoch ever commits after a newer claim.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import multiprocessing
import sys
import time
from pathlib import Path

import pytest

from cloudckpt import attempt_layout, digest, protocol
from cloudckpt.committer import Committer, read_latest
from cloudckpt.reader import fetch_manifest
from cloudckpt.stores import open_store

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import race_worker

WRITERS = 4


@pytest.fixture(scope="module")
def pool():
    # Workers fork from a server that has imported everything once (fast start-up).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["race_worker", "cloudckpt.stores.s3", "cloudckpt.stores.gcs", "cloudckpt.stores.azure"]
    )
    with cf.ProcessPoolExecutor(WRITERS, mp_context=ctx) as executor:
        yield executor


@pytest.fixture(params=["s3", "seaweedfs", "gcs", "azurite"])
def race_target(request, pool):
    target = request.getfixturevalue(f"{request.param}_target")
    # Every worker has imported the backend before the race starts.
    list(pool.map(race_worker.warm, [target.url] * WRITERS, [target.storage_options] * WRITERS))
    return target


def _start(delay: float = 0.5) -> float:
    return time.time() + delay


def _race_with_barrier(pool, worker, target, prefix: str, *columns: list) -> list:
    """Run ``worker(url, options, name, *column values, barrier)`` once per writer, all
    at once, with one barrier they share; the results in writer order."""
    with multiprocessing.Manager() as sync:
        barrier = sync.Barrier(WRITERS)
        return list(
            pool.map(
                worker,
                [target.url] * WRITERS,
                [target.storage_options] * WRITERS,
                [f"{prefix}{i}" for i in range(WRITERS)],
                *columns,
                [barrier] * WRITERS,
            )
        )


def test_racing_compare_and_swaps_from_one_base_have_one_winner(race_target, pool):
    store = open_store(race_target.url, race_target.storage_options)
    owner = Committer(store, "owner", protocol.Settings())
    owner.claim()
    for _round in range(2):
        base = read_latest(store)
        now = dt.datetime.now(dt.timezone.utc)
        # Distinct bodies (random nonces) of the same next seq, as racing writers send.
        bodies = [protocol.sweep(base.latest, now).to_bytes() for _ in range(WRITERS)]
        at = _start()
        outcomes = list(
            pool.map(
                race_worker.raw_cas,
                [race_target.url] * WRITERS,
                [race_target.storage_options] * WRITERS,
                [base.version] * WRITERS,
                bodies,
                [at] * WRITERS,
            )
        )
        assert outcomes.count("won") == 1, outcomes
        assert set(outcomes) <= {"won", "PreconditionFailedError", "StoreConflictError"}
        after, _ = store.get(protocol.LATEST_KEY)
        assert after == bodies[outcomes.index("won")]
        assert protocol.parse_latest(after).seq == base.latest.seq + 1
    store.close()


def test_racing_claims_then_racing_commits_one_winner_the_rest_fenced(race_target, pool):
    store = open_store(race_target.url, race_target.storage_options)
    Committer(store, "first", protocol.Settings(keep_last=None)).claim()
    start = read_latest(store).latest
    claim_at = _start()
    # The barrier: every claim lands before any commit.
    results = _race_with_barrier(
        pool, race_worker.claim_then_commit, race_target, "w", [claim_at] * WRITERS
    )
    epochs = sorted(r["epoch"] for r in results)
    assert epochs == list(range(start.writer.epoch + 1, start.writer.epoch + 1 + WRITERS))
    winners = [r for r in results if r["outcome"] == "committed"]
    assert len(winners) == 1 and winners[0]["epoch"] == epochs[-1], results
    assert all(r["outcome"] == "fenced" for r in results if r is not winners[0])
    latest = read_latest(store).latest
    assert latest.current.commit_id == winners[0]["id"] and latest.history == ()
    assert latest.writer.epoch == epochs[-1]
    store.close()


def test_racing_managers_lose_no_acknowledged_save(race_target, pool):
    at = _start(1.0)
    # The barrier: every claim lands before each writer's last save.
    results = _race_with_barrier(
        pool,
        race_worker.manager_race,
        race_target,
        "m",
        [at + 0.6 * i for i in range(WRITERS)],  # each resumes while the last saves
        [at + 0.6 * WRITERS + 1.0] * WRITERS,
    )
    store = open_store(race_target.url, race_target.storage_options)
    latest = read_latest(store).latest
    retained = {r.commit_id: r for r in latest.retained()}  # keep_last=None keeps all
    acked = [(r["name"], step, cid) for r in results for step, cid in r["acks"]]
    assert acked, results
    for name, step, cid in acked:
        assert cid in retained and retained[cid].metadata["writer"] == name, (name, step)
    newest = max(results, key=lambda r: r["epoch"])
    assert latest.writer.epoch == newest["epoch"] and not newest["fenced"]
    assert sum(r["fenced"] for r in results) == WRITERS - 1  # every older writer
    # The commit records: one chain; commits only by the writer that owns the epoch.
    records = [
        protocol.parse_latest(store.get(o.key)[0]) for o in store.list(protocol.COMMITS_PREFIX)
    ]
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    seen_epoch = 0
    for rec in records:
        assert rec.writer.epoch >= seen_epoch
        seen_epoch = rec.writer.epoch
        if rec.op == "commit":
            assert rec.current.epoch == rec.writer.epoch
    # Every acknowledged checkpoint is intact, byte for byte.
    for name, step, cid in acked:
        record = retained[cid]
        manifest = fetch_manifest(store, record)
        (entry,) = manifest.files
        if entry.chunks is None:
            data, _ = store.get(record.ckpt + attempt_layout.FILES_DIR + entry.path)
        else:  # chunked (the default): the chunks, each named by its SHA-256
            data = b"".join(store.get(c.key)[0] for c in entry.chunks)
        assert data == race_worker.content(name, step)
        assert digest.tree_digest(data) == entry.digest
    store.close()
