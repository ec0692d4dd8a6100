"""Cross-rank dedup and replica agreement of multi-rank saves (issue 30, items 1 and 2).

Fast tests run the ranks as threads of one process: each rank is a real
``DistributedCheckpointManager`` on its own staging directory and its own store client,
whose collectives go through ``ThreadComm`` (the ``Comm`` of the real manager, its four
primitives exchanged through a barrier instead of gloo). Bytes are counted on the store's
side of each rank's client (``Counting``: every put the store received, refused ones
included). The same rules with real processes (torchrun, gloo on 127.0.0.1) are checked by
``test_dp2_dedup_and_agreement_with_real_processes`` (tests/scripts/dist_dedup.py).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from cloudckpt import attempt_layout, digest
from cloudckpt.committer import read_latest
from cloudckpt.distributed import DistributedCheckpointManager, _manager
from cloudckpt.distributed._chunks import Reusable, owners, split_owned
from cloudckpt.distributed._comm import Comm
from cloudckpt.distributed._replicas import check_groups, divergence
from cloudckpt.errors import (
    ConfigurationError,
    RankFailedError,
    ReplicaDivergedError,
    StoreError,
)
from cloudckpt.manifests import ChunkRef, FileEntry, chunk_name
from cloudckpt.reader import fetch_manifest
from cloudckpt.stores import OVERWRITE, open_store
from cloudckpt.testing.wrappers import ForwardingStore

sys.path.insert(0, str(Path(__file__).parent / "scripts"))


# ------------------------------------------------------------------------------ harness


class Hub:
    """Where the thread ranks meet: one slot per rank, a barrier on each side."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.slots: list[Any] = [None] * world

    def exchange(self, rank: int, obj: Any, timeout: float) -> list[Any]:
        self.barrier.wait(timeout)  # everyone has read the previous exchange
        self.slots[rank] = obj
        self.barrier.wait(timeout)
        return list(self.slots)


class ThreadComm(Comm):
    """``Comm`` whose collectives run between threads (a broken barrier is a
    ``CollectiveError``, as a dead peer is over gloo)."""

    def __init__(self, hub: Hub, rank: int, world: int, timeout: float) -> None:
        super().__init__(None, None, rank, world, timeout)
        self.hub = hub

    def _swap(self, obj: Any, what: str) -> list[Any]:
        return self._call(what, lambda: self.hub.exchange(self.rank, obj, self.timeout))

    def gather(self, obj, what):
        out = self._swap(obj, what)
        return out if self.rank == 0 else None

    def broadcast(self, obj, what):
        return self._swap(obj, what)[0]

    def all_gather(self, obj, what):
        return self._swap(obj, what)

    def heartbeat(self, code, what):
        return self._swap(code, what)


class Counting(ForwardingStore):
    """Counts the bytes of every chunk put this rank's client made to the store (what the
    store received: a create-only put it refused still carried its body); ``drop``: chunk
    names whose puts are swallowed (answered as done, never stored); ``manifests_fail``:
    reads of manifests fail (a rank that cannot load the index of the save's base)."""

    def __init__(self, inner, drop: frozenset[str] = frozenset()) -> None:
        super().__init__(inner)
        self.chunk_puts: list[tuple[str, int]] = []
        self.gets: list[str] = []  # the keys of whole-object reads
        self.drop = drop
        self.manifests_fail = False
        self._lock = threading.Lock()

    def _check_read(self, key: str) -> None:
        if self.manifests_fail and key.endswith(attempt_layout.MANIFEST_NAME):
            raise StoreError(f"injected: cannot read {key}")

    def get(self, key):
        self._check_read(key)
        with self._lock:
            self.gets.append(key)
        return self.inner.get(key)

    def get_range(self, key, start, length):
        self._check_read(key)
        return self.inner.get_range(key, start, length)

    def put(self, key, data, *, mode=OVERWRITE):
        if f"/{attempt_layout.CHUNKS_DIR}" in key:
            with self._lock:
                self.chunk_puts.append((key.rsplit("/", 1)[1], memoryview(data).nbytes))
            if key.rsplit("/", 1)[1] in self.drop:
                return self.inner.head(key) if self.inner.exists(key) else None
        return self.inner.put(key, data, mode=mode)

    @property
    def chunk_bytes(self) -> int:
        return sum(n for _, n in self.chunk_puts)


def on_ranks(world: int, fn: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """``fn(rank)`` on ``world`` threads; every result (or the exception it raised)."""
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread rank hung"
    return out


@pytest.fixture
def ranks(monkeypatch, memory_target, tmp_path):
    """``start(world, **kwargs)`` -> (managers, their Counting stores), one per thread rank,
    on one memory bucket; ``drop``: {rank: chunk names that rank's puts lose}."""
    local = threading.local()
    made: list[list[DistributedCheckpointManager]] = []

    def start(world: int, drop: dict[int, frozenset[str]] | None = None, **kwargs):
        hub = Hub(world)
        monkeypatch.setattr(
            _manager, "_join", lambda d, g, t: (local.rank, local.rank, world, None)
        )
        monkeypatch.setattr(_manager, "Comm", lambda d, g, rank, w, t: ThreadComm(hub, rank, w, t))
        stores = [
            Counting(open_store(memory_target.url), (drop or {}).get(r, frozenset()))
            for r in range(world)
        ]

        def make(rank: int) -> DistributedCheckpointManager:
            local.rank = rank
            return DistributedCheckpointManager(
                stores[rank],
                staging_dir=tmp_path / "staging",
                auto_gc=False,
                timeout=30,
                **kwargs,
            )

        mgrs = on_ranks(world, make)
        for m in mgrs:
            if isinstance(m, BaseException):
                raise m
        made.append(mgrs)
        return mgrs, stores

    yield start
    for group in made:  # closing twice is harmless
        on_ranks(len(group), lambda r, group=group: group[r].close())


def save_on(mgrs, step: int, files: Callable[[int], dict[str, bytes]]) -> list[Any]:
    """Every rank saves ``files(rank)`` as ``step``; each rank's CommitInfo or error."""

    def one(rank: int):
        handle = mgrs[rank].save(step)
        with handle as d:
            for name, data in files(rank).items():
                (d / name).write_bytes(data)
        return handle.result(timeout=60)

    return on_ranks(len(mgrs), one)


def name_of(data: bytes) -> str:
    """The chunk name of ``data`` stored as one chunk (a file under 8 MiB, no tensors)."""
    return chunk_name(digest.ALGORITHM, digest.hexleaf(data))


SHARED = os.urandom(3 * 1024 * 1024 + 17)  # what data-parallel replicas hold alike


def dp_files(rank: int, step: int = 1) -> dict[str, bytes]:
    """A shard every rank holds alike (a replicated tensor), and a file of its own."""
    return {"shard.bin": SHARED, "own.bin": f"rank {rank} step {step} ".encode() * 100}


def replica_files(step: int) -> dict[str, bytes]:
    """What data-parallel replicas save at ``step``: the same files on every rank."""
    return {"shard.bin": SHARED, "step.bin": f"step {step} ".encode() * 100}


# ------------------------------------------------------------------------------ dedup


def test_a_dp2_save_uploads_each_shared_chunk_once_and_restores_exactly(ranks, tmp_path):
    """Two ranks hold the same 3 MiB shard: the store receives it once (from rank 0,
    the lowest holder), each rank's own file once; both ranks' CommitInfo report the bytes
    the store received; each rank restores its files bit-exact."""
    mgrs, stores = ranks(2)
    infos = save_on(mgrs, 1, dp_files)
    assert infos[0].commit_id == infos[1].commit_id, infos
    own = [len(dp_files(r)["own.bin"]) for r in (0, 1)]
    assert sorted(stores[0].chunk_puts) == sorted(
        [(name_of(SHARED), len(SHARED)), (name_of(dp_files(0)["own.bin"]), own[0])]
    )
    assert stores[1].chunk_puts == [(name_of(dp_files(1)["own.bin"]), own[1])]
    received = stores[0].chunk_bytes + stores[1].chunk_bytes
    assert received == len(SHARED) + sum(own)
    assert infos[0].bytes_uploaded == infos[1].bytes_uploaded == received
    assert infos[0].total_bytes == 2 * len(SHARED) + sum(own)

    # Both ranks' manifest entries name the one copy, in the attempt's own prefix.
    store = stores[0].inner
    manifest = fetch_manifest(store, read_latest(store).latest.current)
    shard = {f.path: f.chunks for f in manifest.files if f.path.endswith("shard.bin")}
    assert len(shard) == 2 and len(set(shard.values())) == 1

    results = on_ranks(2, lambda r: mgrs[r].restore(tmp_path / "out"))
    for r, res in enumerate(results):
        got = {p.name: p.read_bytes() for p in res.rank_path.iterdir()}
        assert got == dp_files(r)


def test_without_dedup_both_replicas_send_the_shared_chunk(ranks):
    """The baseline of the test above: with dedup=False the store receives the shared
    shard from both ranks (one put refused as already there)."""
    mgrs, stores = ranks(2, dedup=False)
    infos = save_on(mgrs, 1, dp_files)
    assert not isinstance(infos[0], BaseException), infos
    for s in stores:
        assert (name_of(SHARED), len(SHARED)) in s.chunk_puts


def test_dedup_owner_is_the_lowest_rank_that_must_upload():
    """The owner of a chunk several ranks hold is the lowest holder that cannot name it
    from its kept index (valid only when kept from the checkpoint the save builds on);
    the same plans give the same owners whatever order the ranks' chunks are listed in."""
    names = [f"b3-{i:064x}" for i in range(20)]
    held = [frozenset(names), frozenset(names[:10]), frozenset(names)]
    none = Reusable(None, frozenset())
    assert owners(held, [none] * 3, None) == {
        **{n: 0 for n in names},
    }
    # Rank 0 keeps the first five from the base: the next holder that cannot uploads them.
    kept = Reusable("base", frozenset(names[:5]))
    chosen = owners(held, [kept, none, none], "base")
    assert chosen == {**{n: 1 for n in names[:5]}, **{n: 0 for n in names[5:]}}
    # A kept index of another checkpoint does not count; chunks every holder can name
    # have no owner (each names its own copy).
    assert owners(held, [Reusable("older", frozenset(names)), none, none], "base") == {
        n: 0 for n in names
    }
    every = Reusable("base", frozenset(names))
    assert owners(held, [every] * 3, "base") == {}
    # One holder: no owner.
    assert owners([frozenset({"x"}), frozenset({"y"})], [none] * 2, None) == {}
    # Deterministic over any order of arrival of the same plans.
    for perm in itertools.permutations(range(3)):
        shuffled = [frozenset(random.sample(sorted(held[r]), len(held[r]))) for r in perm]
        again = owners(shuffled, [none] * 3, None)
        assert again == {n: min(r for r in range(3) if n in shuffled[r]) for n in names}
    elsewhere, owed = split_owned({"a": 0, "b": 1, "c": 2}, 1)
    assert (elsewhere, owed) == (frozenset({"a", "c"}), frozenset({"b"}))


def test_three_ranks_two_of_which_share_a_chunk(ranks, tmp_path):
    """Ranks 1 and 2 share a file rank 0 lacks: rank 1 (the lowest holder) uploads it,
    rank 2 names it; the owner is chosen the same way on every save."""
    mgrs, stores = ranks(3)
    common = os.urandom(200_000)

    def files(rank: int) -> dict[str, bytes]:
        return {"x.bin": common if rank else b"rank 0 alone"}

    infos = save_on(mgrs, 1, files)
    assert not any(isinstance(i, BaseException) for i in infos), infos
    assert (name_of(common), len(common)) in stores[1].chunk_puts
    assert all(n != name_of(common) for n, _ in stores[2].chunk_puts + stores[0].chunk_puts)
    results = on_ranks(3, lambda r: mgrs[r].restore(tmp_path / "out"))
    for r, res in enumerate(results):
        assert (res.rank_path / "x.bin").read_bytes() == files(r)["x.bin"]


def test_a_replicated_tensor_inside_files_that_differ_is_uploaded_once(ranks, tmp_path):
    """``torch.save`` files that differ between ranks but hold the same large tensor (a
    replicated layer beside each rank's own): with tensor chunking the replicated tensor's
    chunk is put once, by rank 0; each rank restores its own file exactly."""
    import torch

    mgrs, stores = ranks(2)
    replicated = torch.randn(600_000, generator=torch.Generator().manual_seed(3))
    blobs = {}
    for r in (0, 1):
        path = tmp_path / f"model-{r}.pt"
        torch.save({"replicated": replicated, "own": torch.full((1000,), float(r))}, path)
        blobs[r] = path.read_bytes()
    assert blobs[0] != blobs[1]
    infos = save_on(mgrs, 1, lambda r: {"model.pt": blobs[r]})
    assert not isinstance(infos[0], BaseException), infos
    size = replicated.numel() * replicated.element_size()
    assert (size in [n for _, n in stores[0].chunk_puts]) and all(
        n != size for _, n in stores[1].chunk_puts
    ), (stores[0].chunk_puts, stores[1].chunk_puts)
    assert infos[0].bytes_uploaded == stores[0].chunk_bytes + stores[1].chunk_bytes
    assert infos[0].bytes_uploaded < infos[0].total_bytes - size // 2
    results = on_ranks(2, lambda r: mgrs[r].restore(tmp_path / "out"))
    for r, res in enumerate(results):
        assert (res.rank_path / "model.pt").read_bytes() == blobs[r]


def test_an_owner_that_fails_its_upload_means_no_commit(ranks):
    """Rank 1 owns a chunk rank 2 names without a put, and rank 1's upload fails: no
    commit, every rank raises RankFailedError naming rank 1."""
    mgrs, stores = ranks(3)
    common = os.urandom(100_000)

    def failing(key, data, *, mode=OVERWRITE):
        raise StoreError("injected: rank 1 cannot upload")

    stores[1].put = failing
    results = save_on(mgrs, 1, lambda r: {"x.bin": common if r else b"zero"})
    for res in results:
        assert isinstance(res, RankFailedError), results
        assert set(res.failures) == {1}
    assert read_latest(stores[0].inner).latest is None or (
        read_latest(stores[0].inner).latest.current is None
    )


def test_incremental_dp2_saves_and_a_restart_keep_one_copy_and_commit(ranks, tmp_path):
    """Step 2 of two ranks with the shard unchanged uploads nothing of it. After a
    restart (new managers: no kept index, so the coordinator assigns the shard an owner,
    rank 0) where rank 1 cannot read the base's manifest (an empty index: it names the
    shard under the new attempt), the owner puts the shard although its own index names
    it, and the commit's listing finds it there."""
    mgrs, stores = ranks(2)
    assert not isinstance(save_on(mgrs, 1, dp_files)[0], BaseException)
    before = [s.chunk_bytes for s in stores]
    infos = save_on(mgrs, 2, lambda r: dp_files(r, 2))
    assert not isinstance(infos[0], BaseException), infos
    sent = [s.chunk_bytes - b for s, b in zip(stores, before, strict=True)]
    assert sent == [len(dp_files(r, 2)["own.bin"]) for r in (0, 1)]
    assert infos[0].bytes_reused == 2 * len(SHARED)
    on_ranks(2, lambda r: mgrs[r].close())

    mgrs, stores = ranks(2)
    stores[1].manifests_fail = True
    infos = save_on(mgrs, 3, lambda r: dp_files(r, 3))
    stores[1].manifests_fail = False
    assert not any(isinstance(i, BaseException) for i in infos), infos
    assert [n for n, _ in stores[1].chunk_puts] == [name_of(dp_files(1, 3)["own.bin"])]
    assert (name_of(SHARED), len(SHARED)) in stores[0].chunk_puts
    results = on_ranks(2, lambda r: mgrs[r].restore(tmp_path / "out3"))
    for r, res in enumerate(results):
        assert {p.name: p.read_bytes() for p in res.rank_path.iterdir()} == dp_files(r, 3)


def test_an_owner_whose_chunk_never_landed_means_no_commit(ranks):
    """Rank 0 owns the shared shard but its put is lost (answered, never stored): rank 1
    named the chunk without a put, and the coordinator's pre-commit listing refuses the
    commit on every rank; step 1 stays current."""
    mgrs, stores = ranks(2, drop={0: frozenset({name_of(SHARED)})})
    assert not isinstance(save_on(mgrs, 1, lambda r: {"own.bin": b"%d" % r})[0], BaseException)
    results = save_on(mgrs, 2, dp_files)
    for res in results:
        assert isinstance(res, StoreError), results
        assert name_of(SHARED) in res.message and "not committed" in res.message
    store = stores[0].inner
    assert read_latest(store).latest.current.step == 1


# ------------------------------------------------------------------------------ agreement


def test_a_divergent_replica_is_not_committed_and_names_ranks_and_file(ranks, tmp_path):
    """One flipped byte in rank 1's copy of the shard: no commit, every rank raises
    ReplicaDivergedError naming both ranks, the file and where it first differs; the
    manager takes the next (agreeing) save, whose per-rank RNG file ``replica_exclude``
    leaves out of the comparison."""
    mgrs, stores = ranks(2, replica_groups=[[0, 1]], replica_exclude=["rng-*.pt"])
    infos = save_on(mgrs, 1, lambda r: replica_files(1))
    assert not isinstance(infos[0], BaseException), infos
    flipped = bytearray(SHARED)
    flipped[1_000_000] ^= 1

    def files(rank: int) -> dict[str, bytes]:
        out = replica_files(2)
        if rank == 1:
            out["shard.bin"] = bytes(flipped)
        return out

    results = save_on(mgrs, 2, files)
    for res in results:
        assert isinstance(res, ReplicaDivergedError), results
        assert "ranks 0 and 1 differ in 'shard.bin'" in res.message
        assert "first differing chunk at byte 0" in res.message
        assert "step.bin" not in res.message  # the files that agree are not named
    store = stores[0].inner
    assert read_latest(store).latest.current.step == 1
    infos = save_on(mgrs, 3, lambda r: {**replica_files(3), "rng-0.pt": b"%d" % r})
    assert not isinstance(infos[0], BaseException), infos
    assert read_latest(store).latest.current.step == 3


def test_replica_divergence_is_computed_from_the_entries():
    def entry(path: str, chunks: list[tuple[str, int]]) -> FileEntry:
        refs = tuple(ChunkRef("ckpt/x/", sha, n, digest.ALGORITHM) for sha, n in chunks)
        return FileEntry(
            path,
            sum(n for _, n in chunks),
            "d" + "".join(s for s, _ in chunks),
            refs,
            algorithm=digest.ALGORITHM,
        )

    a = [entry("rank-00000/m.pt", [("aa", 8), ("bb", 8)]), entry("rank-00000/o.pt", [("cc", 4)])]
    b = [entry("rank-00002/m.pt", [("aa", 8), ("bd", 8)])]
    c = [entry("rank-00001/z.pt", [("ee", 1)])]
    problems = divergence(((0, 2),), [a, c, b])
    assert problems == [
        "ranks 0 and 2 differ in 'm.pt': first differing chunk at byte 8 (8 bytes)",
        "rank 0 saved 'o.pt', its replica rank 2 did not",
    ]
    assert divergence(((0, 2),), [a, c, a]) == []
    assert divergence(((0, 2),), [a, c, b], exclude=["m.pt", "o.*"]) == []
    assert check_groups([[2, 0], [1, 3]], 4) == ((0, 2), (1, 3))
    for bad in ([[0]], [[0, 1], [1, 2]], [[0, 5]], [["x", 1]]):
        with pytest.raises(ConfigurationError):
            check_groups(bad, 4)


def test_replica_groups_need_per_rank_dirs(memory_target, tmp_path):
    with pytest.raises(ConfigurationError, match="per_rank_dirs"):
        DistributedCheckpointManager(
            memory_target.url, staging_dir=tmp_path, per_rank_dirs=False, replica_groups=[[0, 1]]
        )


# ------------------------------------------------------------------------------ real processes


def test_dp2_dedup_and_agreement_with_real_processes(moto_server, tmp_path):
    """torchrun, 2 ranks, gloo on 127.0.0.1, against the moto server (tests/scripts/
    dist_dedup.py): a DP=2 save whose shared shard each rank's counting client saw put
    once in all (by rank 0), restored exact on both ranks; a divergent replica is no
    commit and both ranks name the ranks and the file; the owner's lost put of the shared
    chunk is found by the commit's listing: no commit."""
    from distrun import Launch

    bucket = f"dedup-{os.getpid()}"
    moto_server.create_bucket(bucket)
    job = Launch(
        "dedup",
        f"s3://{bucket}/run",
        tmp_path,
        moto_server.storage_options(),
        script=Path(__file__).parent / "scripts" / "dist_dedup.py",
    )
    job.wait(timeout=240)
    events = {r: job.events(r) for r in (0, 1)}
    for r in (0, 1):
        kinds = [e["event"] for e in events[r]]
        assert "done" in kinds, (r, kinds, job.log_path.read_text()[-3000:])
    saved = [job.one(r, "saved") for r in (0, 1)]
    shared = saved[0]["shared_bytes"]
    assert saved[0]["shared_puts"] == 1 and saved[1]["shared_puts"] == 0
    assert saved[0]["chunk_bytes"] + saved[1]["chunk_bytes"] == saved[0]["bytes_uploaded"]
    assert saved[0]["bytes_uploaded"] == shared + saved[0]["own_bytes"] + saved[1]["own_bytes"]
    for r in (0, 1):
        assert job.one(r, "restored")["exact"] is True
        failed = job.one(r, "diverged")
        assert failed["type"] == "ReplicaDivergedError", failed
        assert "ranks 0 and 1 differ in 'shard.bin'" in failed["message"]
        assert job.one(r, "after")["current"] == 1
        lost = job.one(r, "lost")
        assert lost["type"] == "StoreError" and "not committed" in lost["message"], lost
        assert job.one(r, "lost-after")["current"] is None


def test_no_node_leader_reads_back_the_manifest_just_committed(ranks, monkeypatch, tmp_path):
    """Each rank its own node, so each is its node's leader and keeps the manifest: the
    coordinator sends the bytes it committed with the outcome, checked against LATEST, so
    no rank GETs the manifest after the save (counted at the store wrapper), and each kept
    manifest is byte-identical to the stored one (the digest a restore checks)."""
    monkeypatch.setattr(_manager, "node_key", lambda: threading.current_thread().name)
    mgrs, stores = ranks(2, peer_copies=0)
    assert all(m.is_node_leader for m in mgrs) and mgrs[0].num_nodes == 2
    infos = save_on(mgrs, 1, dp_files)
    assert not any(isinstance(i, BaseException) for i in infos), infos
    key = infos[0].ckpt + attempt_layout.MANIFEST_NAME
    assert [k for s in stores for k in s.gets if k.endswith(attempt_layout.MANIFEST_NAME)] == []
    stored, _ = stores[0].inner.get(key)
    record = read_latest(stores[0].inner).latest.current
    for rank in range(2):
        (copy,) = (tmp_path / "staging" / f"rank-{rank:05d}" / "committed").glob("*")
        assert (copy / "MANIFEST.json").read_bytes() == stored
        assert copy.name.endswith(record.commit_id)


def test_the_outcome_carries_a_manifest_only_as_committed_and_only_if_leaders_keep_it(
    ranks, memory_target
):
    """``committed_body``: the manifest's bytes only if they are exactly what the commit
    record names (its SHA-256 and size); and no manifest rides the commit's outcome
    where no node's leader keeps local copies (``keep_local=0``)."""
    import dataclasses

    from cloudckpt.distributed._save import committed_body
    from cloudckpt.manifests import parse_manifest

    mgrs, stores = ranks(2, keep_local=0)
    assert not any(m._leaders_keep for m in mgrs)
    infos = save_on(mgrs, 1, dp_files)
    assert not any(isinstance(i, BaseException) for i in infos), infos
    record = read_latest(stores[0].inner).latest.current
    stored, _ = stores[0].inner.get(record.ckpt + attempt_layout.MANIFEST_NAME)
    manifest = parse_manifest(stored, record)
    assert committed_body(manifest, record) == stored
    other = dataclasses.replace(record, manifest_sha256="0" * 64)
    assert committed_body(manifest, other) is None
    assert committed_body(manifest, None) is None
