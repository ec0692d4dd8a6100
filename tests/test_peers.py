"""Peer copies (issue 30 item 4; ``cloudckpt/distributed/_peers.py``), fast: the ring plan,
the restore plan with holders, and ``share`` between 2 node leaders run as threads over an
in-memory stand-in for the gloo group (``FakeComm``: the same ``all_gather``, ``heartbeat``,
``send`` and ``recv`` calls), with real ``PeerStore`` directories. The same over real
processes, 2 hosts x 2 ranks under torchrun: tests/test_distributed_peers.py."""

from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch")

from cloudckpt import digest
from cloudckpt.distributed import DistributedCheckpointManager, _fanout, _peers
from cloudckpt.distributed._fanout import Need, plan
from cloudckpt.distributed._peers import Holdings, PeerStore, copy_plan, targets
from cloudckpt.errors import CollectiveError, ConfigurationError
from cloudckpt.manifests import ChunkRef, FileEntry

# ------------------------------------------------------------------------------ plans


def test_the_ring_sends_each_node_s_copy_to_the_next_k_nodes():
    leaders = [0, 2, 4]
    assert targets(leaders, 0, 1) == [2] and targets(leaders, 4, 1) == [0]
    assert targets(leaders, 2, 2) == [4, 0]
    assert targets(leaders, 2, 5) == [4, 0]  # never to itself
    n = 6  # chunks 0-1 node 0's, 2-3 node 2's, 4-5 node 4's
    offer = lambda own: _peers.Offer(_peers._mask(own, n), _peers._mask(own, n), 1 << 30)  # noqa: E731
    offers = [offer([0, 1]), None, offer([2, 3]), None, offer([4, 5])]
    got = copy_plan(offers, leaders, 1)
    assert [(t.index, t.sender, t.receivers) for t in got] == [
        (0, 0, (2,)), (1, 0, (2,)), (2, 2, (4,)), (3, 2, (4,)), (4, 4, (0,)), (5, 4, (0,)),
    ]  # fmt: skip
    both = copy_plan(offers, leaders, 2)
    assert {(t.index, t.receivers) for t in both if t.sender == 0} == {(0, (2, 4)), (1, (2, 4))}
    # A target that holds a chunk already (its own, or an earlier peer copy) is not sent it;
    # a target that has no room is sent nothing.
    offers[2] = _peers.Offer(_peers._mask([2, 3], n), _peers._mask([0, 2, 3], n), 0)
    assert [t.index for t in copy_plan(offers, leaders, 1) if t.sender == 0] == [1]
    accepts = [True, None, False, None, True]  # node 2 has no room: node 0 sends nothing
    assert [t.sender for t in copy_plan(offers, leaders, 1, accepts)] == [2, 2, 4, 4]


def test_a_chunk_a_peer_holds_is_sent_by_a_holder_spread_by_bytes():
    """Leaders 0 and 2 hold what leader 4 (a replacement) needs; each chunk gets one
    holder, the one with fewer bytes assigned so far; nothing is read from the store."""
    full, none = b"\xff", b"\x00"
    needs = [Need(none, full), None, Need(none, full), None, Need(full, none)]
    sizes = [8, 1, 1, 1, 1, 1, 1, 1]
    got = plan(needs, sizes=sizes)
    assert [t.index for t in got] == list(range(8)) and all(t.held for t in got)
    assert all(t.receivers == (4,) for t in got)
    load = {0: 0, 2: 0}
    for t in got:
        load[t.sender] += sizes[t.index]
    assert load == {0: 8, 2: 7}
    assert len(plan(needs)) == 8  # every rank derives as many transfers (the rounds)
    # Without peer copies (no ``held``), a chunk one node needs is not sent at all.
    assert plan([Need(none), None, Need(none), None, Need(full)]) == []
    # With fanout off, only what a peer holds is sent.
    mixed = [Need(b"\x03", b"\x04"), Need(b"\x07")]
    assert [(t.index, t.held) for t in plan(mixed, fanout=False)] == [(2, True)]
    assert [(t.index, t.held) for t in plan(mixed)] == [(0, False), (1, False), (2, True)]


def test_holdings_are_the_placed_files_and_the_peer_store(tmp_path):
    refs, data = chunks("h", 3)
    store = PeerStore(tmp_path, None)
    store.put(refs[2], data[2])
    placed = tmp_path / "placed"
    placed.write_bytes(data[0] + data[1])
    entry = FileEntry("f", len(placed.read_bytes()), "d", (refs[0], refs[1]))
    held = Holdings(_peers.node_chunks([entry], {"f": placed}), store)
    assert held.mask(refs) == b"\x07"
    assert [held.read(r) for r in refs] == data
    assert Holdings({}, None).mask(refs) == b"\x00"


# ------------------------------------------------------------------------------ saving


def chunks(tag: str, n: int, size: int = 4096) -> tuple[list[ChunkRef], list[bytes]]:
    data = [hashlib.sha256(f"{tag}{i}".encode()).digest() * (size // 32) for i in range(n)]
    refs = [ChunkRef("ckpt/x/", digest.hexleaf(d), len(d)) for d in data]
    return refs, data


class Hub:
    """What the ranks' ``FakeComm``s share: a barrier, the gathered objects, the mail."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=10)
        self.slots: list = [None] * world
        self.mail = {(s, d): queue.Queue() for s in range(world) for d in range(world)}


class FakeComm:
    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.world, self.timeout = hub, rank, hub.world, 10.0

    def all_gather(self, obj, what):
        self.hub.slots[self.rank] = obj
        self.hub.barrier.wait()
        out = list(self.hub.slots)
        self.hub.barrier.wait()
        return out

    def heartbeat(self, code, what):
        return self.all_gather(code, what)

    def send(self, tensor, dst, what):
        self.hub.mail[(self.rank, dst)].put(tensor.clone())

    def recv(self, tensor, src, what):
        try:
            tensor.copy_(self.hub.mail[(src, self.rank)].get(timeout=10))
        except queue.Empty:
            raise CollectiveError(f"rank {self.rank}: nothing from rank {src} ({what})") from None


class Leader:
    """A node of one rank: its files (one per chunk), its peer store."""

    def __init__(self, root: Path, rank: int, budget: int | None = None) -> None:
        self.rank, self.root = rank, root / f"node{rank}"
        self.store = PeerStore(self.root, budget)
        self.ranks = type("R", (), {"is_node_leader": True})()


def node(leader: Leader, catalog: list[ChunkRef], data: dict[str, bytes]) -> _peers._Node:
    files = leader.root / "files"
    files.mkdir(parents=True, exist_ok=True)
    local = {}
    for ref in catalog:
        if ref.key in data:
            path = files / ref.name
            path.write_bytes(data[ref.key])
            local[ref.key] = (path, 0)
    return _peers._Node(list(catalog), local)


def share(monkeypatch, leaders: list[Leader], catalog, owned: list[dict], step: int):
    """``share`` on every leader at once (threads); returns each one's warnings."""
    nodes = {ld.rank: node(ld, catalog, own) for ld, own in zip(leaders, owned, strict=True)}
    monkeypatch.setattr(_peers, "_load", lambda copies, commit_id: nodes[copies])
    hub = Hub(len(leaders))
    out: dict[int, list[str]] = {}

    def run(ld: Leader) -> None:
        comm = FakeComm(hub, ld.rank)
        out[ld.rank] = _peers.share(comm, ld.ranks, step, f"c{step}", ld.rank, ld.store, 1)  # type: ignore[arg-type]

    threads = [threading.Thread(target=run, args=(ld,)) for ld in leaders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(out) == {ld.rank for ld in leaders}
    return out


@pytest.fixture
def pair(tmp_path):
    a_refs, a_data = chunks("a", 2)
    b_refs, b_data = chunks("b", 2)
    catalog = a_refs + b_refs
    owned = [
        dict(zip([r.key for r in a_refs], a_data, strict=True)),
        dict(zip([r.key for r in b_refs], b_data, strict=True)),
    ]
    return [Leader(tmp_path, 0), Leader(tmp_path, 1)], catalog, owned


def test_each_node_holds_the_other_s_copy_verified(monkeypatch, pair):
    leaders, catalog, owned = pair
    warnings = share(monkeypatch, leaders, catalog, owned, 1)
    assert warnings == {0: [], 1: []}
    assert leaders[0].store.holds() == {r.name for r in catalog[2:]}
    assert leaders[1].store.holds() == {r.name for r in catalog[:2]}
    for ref in catalog[2:]:
        assert leaders[0].store.read(ref) == owned[1][ref.key]
    assert [p.name[:12] for p in leaders[0].store.root.glob("*.json")] == ["000000000001"]


def test_a_chunk_that_does_not_verify_is_not_held(monkeypatch, pair):
    """Rank 0 flips a byte of a chunk it sends: rank 1 does not hold it and says so."""
    leaders, catalog, owned = pair
    original = _fanout.outgoing
    bad = owned[0][catalog[0].key]

    def flipping(data):
        out = bytearray(original(data))
        if bytes(data) == bad:
            out[7] ^= 1
        return bytes(out)

    monkeypatch.setattr(_fanout, "outgoing", flipping)
    warnings = share(monkeypatch, leaders, catalog, owned, 1)
    assert warnings[1] == ["step 1: peer copies: 1 chunk(s) of the peer copy were not held"]
    assert leaders[1].store.holds() == {catalog[1].name}


def test_a_copy_that_does_not_fit_the_budget_is_not_held(monkeypatch, tmp_path, pair):
    leaders, catalog, owned = pair
    leaders[1] = Leader(tmp_path, 1, budget=4096)  # room for one chunk of the two
    warnings = share(monkeypatch, leaders, catalog, owned, 1)
    assert len(warnings[1]) == 1 and "holds no peer copy of this step" in warnings[1][0]
    assert "needs 8192 bytes, it has room for 4096" in warnings[1][0]
    assert leaders[1].store.holds() == set() and leaders[1].store.used() == 0
    assert leaders[0].store.holds() == {r.name for r in catalog[2:]}  # the other way: held


def test_an_older_copy_goes_only_once_a_newer_one_is_complete(monkeypatch, pair):
    """Step 2 changes one of node 1's chunks: node 0 is sent only that one (it holds the
    other) and then holds exactly step 2's chunks. Step 3's transfer to node 0 fails
    verification: step 2's copy stays, beside what step 3's brought."""
    leaders, catalog, owned = pair
    share(monkeypatch, leaders, catalog, owned, 1)
    new_refs, new_data = chunks("b-step2", 1)
    cat2 = [*catalog[:3], new_refs[0]]
    owned2 = [owned[0], {catalog[2].key: owned[1][catalog[2].key], new_refs[0].key: new_data[0]}]
    sent: list[int] = []
    original = _fanout.outgoing
    monkeypatch.setattr(_fanout, "outgoing", lambda d: sent.append(len(d)) or original(d))
    assert share(monkeypatch, leaders, cat2, owned2, 2) == {0: [], 1: []}
    assert sent == [4096]  # node 0 had chunk 2: only the new one travelled to it
    assert leaders[0].store.holds() == {catalog[2].name, new_refs[0].name}
    assert [p.name[:12] for p in leaders[0].store.root.glob("*.json")] == ["000000000002"]

    step3_refs, step3_data = chunks("b-step3", 1)
    cat3 = [*catalog[:2], step3_refs[0]]
    owned3 = [owned[0], {step3_refs[0].key: step3_data[0]}]
    monkeypatch.setattr(_fanout, "outgoing", lambda d: b"\0" * len(d))  # nothing verifies
    warnings = share(monkeypatch, leaders, cat3, owned3, 3)
    assert warnings[0] == ["step 3: peer copies: 1 chunk(s) of the peer copy were not held"]
    indexes = sorted(p.name[:12] for p in leaders[0].store.root.glob("*.json"))
    assert indexes == ["000000000002", "000000000003"]
    assert leaders[0].store.holds() >= {catalog[2].name, new_refs[0].name}


def test_a_failed_peer_transfer_is_a_warning_on_the_committed_save(
    monkeypatch, memory_target, tmp_path
):
    """Whatever the peer transfer raises after the commit, even a CollectiveError (a dead
    peer), the save returns its CommitInfo with a warning (issue 28's rule, I6)."""

    def dead(self, info):
        raise CollectiveError("rank 2 lost contact (simulated)")

    monkeypatch.setattr(DistributedCheckpointManager, "_share_peers", dead)
    mgr = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    try:
        handle = mgr.save(1)
        with handle as d:
            (d / "a.bin").write_bytes(b"x" * 1000)
        info = handle.result()
        assert info.step == 1
        assert info.warnings == (
            "step 1 is committed, but could not make its peer copies: rank 2 lost contact "
            "(simulated)",
        )
        assert mgr.restore(tmp_path / "r").step == 1
    finally:
        mgr.close()


def test_a_leader_uses_its_own_peer_chunk_only_if_it_verifies(tmp_path):
    """A leader needing a chunk its peer store holds (a replica's, or any step's under the
    same name) takes it only if the bytes are exactly the committed manifest's: a wrong
    one (another step's bytes under that name) stays needed, read from the store."""
    refs, data = chunks("own", 2)
    store = PeerStore(tmp_path, None)
    store.put(refs[0], data[0])
    store.put(refs[1], data[0][: refs[1].size])  # forged: another chunk's bytes
    entry = FileEntry("rank-00000/f", refs[0].size + refs[1].size, "d", tuple(refs))
    comm = FakeComm(Hub(1), 0)
    shared = _fanout.exchange(
        comm, refs, [entry], None, None, "t", Holdings({}, store), spill=tmp_path / "spill"
    )  # type: ignore[arg-type]
    assert refs[0].key in shared.got and refs[1].key not in shared.got
    buf = bytearray(refs[0].size)
    assert shared.got.read_into(refs[0].key, 0, buf) == refs[0].size and bytes(buf) == data[0]


def test_a_chunk_held_only_by_the_node_that_needs_it_is_not_sent():
    assert plan([Need(b"\x01", b"\x01"), Need(b"\x00", b"\x00")]) == []
    assert plan([Need(b"\x01", b"\x01"), Need(b"\x01")]) == [_fanout.Transfer(0, 0, (1,))]


def test_a_leader_that_fails_locally_takes_no_part_and_the_others_go_on(monkeypatch, pair):
    """Reading its node's copy raises on leader 1 (a bug, a broken disk): it offers
    nothing, joins every collective all the same, and leader 0 completes its part."""
    leaders, catalog, owned = pair
    nodes = {ld.rank: node(ld, catalog, own) for ld, own in zip(leaders, owned, strict=True)}

    def load(copies, commit_id):
        if copies == 1:
            raise RuntimeError("simulated: cannot read the kept copy")
        return nodes[copies]

    monkeypatch.setattr(_peers, "_load", load)
    hub = Hub(2)
    out: dict[int, list[str]] = {}

    def run(ld: Leader) -> None:
        out[ld.rank] = _peers.share(FakeComm(hub, ld.rank), ld.ranks, 1, "c1", ld.rank, ld.store, 1)  # type: ignore[arg-type]

    threads = [threading.Thread(target=run, args=(ld,)) for ld in leaders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: [], 1: []}  # nobody waited for a collective that never came
    assert leaders[0].store.holds() == set() and leaders[1].store.holds() == set()


@pytest.mark.parametrize("bad", [{"peer_copies": -1}, {"peer_copies": 1.5},
                                 {"peer_copies": True}, {"peer_budget_bytes": -1}])  # fmt: skip
def test_bad_peer_arguments_are_refused(memory_target, tmp_path, bad):
    with pytest.raises(ConfigurationError):
        DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s", **bad)


def test_one_node_makes_no_peer_copies(memory_target, tmp_path):
    mgr = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    try:
        assert not mgr.peers_active and mgr.peer_store is None
        with mgr.save(1) as d:
            (d / "a.bin").write_bytes(b"x")
        mgr.wait()
        assert not (tmp_path / "s" / "rank-00000" / "peers").exists()
    finally:
        mgr.close()


def test_plans_over_a_large_catalog_stay_linear():
    """125,000 chunks (a 1 TB checkpoint of 8 MiB chunks) over 8 nodes: both plans are
    derived from the masks without a per-bit shift of a 125,000-bit integer."""
    n, nodes = 125_000, 8
    share_of = [set(range(k, n, nodes)) for k in range(nodes)]
    offers = [_peers.Offer(_peers._mask(s, n), _peers._mask(s, n), 1 << 60) for s in share_of]
    transfers = copy_plan(offers, list(range(nodes)), 1)
    assert len(transfers) == n and all(t.receivers == ((t.sender + 1) % nodes,) for t in transfers)
    needs = [Need(_peers._mask(s, n), _peers._mask(share_of[(k - 1) % nodes], n))
             for k, s in enumerate(share_of)]  # fmt: skip
    got = plan(needs)
    assert len(got) == n and all(t.held and t.receivers == ((t.sender - 1) % nodes,) for t in got)
    assert _fanout.indices(0b1010_0000_0001) == [0, 9, 11] and _fanout.indices(0) == []


def test_a_budget_of_one_copy_replaces_the_older_copy_first(monkeypatch, tmp_path, pair):
    """peer_budget_bytes holding one copy: a new copy whose chunks all changed fits only
    without the older one, which goes first (else the old copy would stay forever)."""
    leaders, catalog, owned = pair
    leaders[0] = Leader(tmp_path, 0, budget=8192)  # node 1's copy: 2 chunks of 4096
    share(monkeypatch, leaders, catalog, owned, 1)
    assert leaders[0].store.used() == 8192
    new_refs, new_data = chunks("b-new", 2)
    cat2 = [*catalog[:2], *new_refs]
    owned2 = [owned[0], dict(zip([r.key for r in new_refs], new_data, strict=True))]
    assert share(monkeypatch, leaders, cat2, owned2, 2) == {0: [], 1: []}
    assert leaders[0].store.holds() == {r.name for r in new_refs}
    assert [p.name[:12] for p in leaders[0].store.root.glob("*.json")] == ["000000000002"]
