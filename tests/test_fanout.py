"""Read once, fan out (issue 30 item 5; ``cloudckpt/distributed/_fanout.py``): the plan
every rank derives, the rounds, and the receiver's check. The transfers themselves, over a
real gloo group between 2 simulated nodes, are
``test_distributed_local.py::test_data_parallel_replicas_on_2_nodes_read_each_chunk_once``.
"""

from __future__ import annotations

from cloudckpt import digest
from cloudckpt.distributed import _fanout
from cloudckpt.distributed._fanout import Transfer, accept, catalog, need_of, plan, rounds
from cloudckpt.manifests import ChunkRef, FileEntry

MiB = 1 << 20


def refs(n: int) -> list[ChunkRef]:
    return [ChunkRef("ckpt/x/", f"{i:064x}", 8 * MiB) for i in range(n)]


def entry(path: str, chunks: list[ChunkRef]) -> FileEntry:
    return FileEntry(path, sum(c.size for c in chunks), "d", tuple(chunks))


def test_each_chunk_several_nodes_need_gets_one_sender_spread_by_bytes():
    """Leaders 0 and 2 (rank 1 is not a leader) need the same 4 chunks; leader 0 alone
    needs one more. Each shared chunk has one sender, a leader that needs it, the
    senders share them evenly, and every rank derives the same plan from the bit masks
    (one bit per chunk of the manifest)."""
    chunks = refs(9)
    shared, only0 = chunks[2:6], chunks[7]
    files = [entry("rank-00000/a", [*shared, only0]), entry("rank-00002/a", list(shared))]
    assert catalog([*files, entry("rank-00000/a", shared)]) == [*shared, only0]
    needs = [need_of(chunks, files[:1]), None, need_of(chunks, files[1:])]
    assert len(needs[0].mask) == 2  # type: ignore[union-attr]
    transfers = plan(needs)
    assert [t.index for t in transfers] == [2, 3, 4, 5]  # chunk 7 is nobody else's: not sent
    load = {0: 0, 2: 0}
    for t in transfers:
        assert t.sender in (0, 2) and t.receivers == tuple({0, 2} - {t.sender})
        load[t.sender] += 1
    assert load == {0: 2, 2: 2}
    assert plan(list(needs)) == transfers  # deterministic


def test_no_plan_without_a_chunk_two_nodes_need():
    chunks = refs(2)
    a, b = entry("a", chunks[:1]), entry("b", chunks[1:])
    assert plan([need_of(chunks, [a]), need_of(chunks, [b])]) == []
    assert plan([need_of(chunks, [a]), None]) == []


def test_rounds_hold_at_most_round_chunks_and_every_transfer_once():
    transfers = [Transfer(i, 0, (1,)) for i in range(2 * _fanout.ROUND_CHUNKS + 1)]
    cut = rounds(transfers)
    assert [t for r in cut for t in r] == transfers
    assert [len(r) for r in cut] == [_fanout.ROUND_CHUNKS, _fanout.ROUND_CHUNKS, 1]
    assert rounds([]) == []


def test_a_received_chunk_is_kept_only_if_it_is_exactly_the_chunk_its_name_names():
    data = bytes(range(256)) * 4096
    ref = ChunkRef("ckpt/x/", digest.hexleaf(data), len(data))
    assert accept(ref, data)
    flipped = bytearray(data)
    flipped[1000] ^= 1
    assert not accept(ref, bytes(flipped))
    assert not accept(ref, data[:-1])
    assert not accept(ref, data + b"\0")


def test_received_chunks_are_served_from_memory_and_the_rest_from_the_store(tmp_path):
    class Inner:
        url = "memory://x/"

        def get_range_into(self, key, start, buf):
            buf[: len(buf)] = b"s" * len(buf)
            return len(buf)

    for spill in (None, tmp_path / "spill"):  # in memory, or on disk beside the restore
        got = _fanout.Received(spill)
        got.add(ChunkRef("o/", "ab" * 32, 10), b"0123456789")
        source = _fanout.WithReceived(Inner(), got)  # type: ignore[arg-type]
        buf = bytearray(4)
        key = ChunkRef("o/", "ab" * 32, 10).key
        assert source.get_range_into(key, 3, buf) == 4 and bytes(buf) == b"3456"
        assert source.get_range_into("other", 0, buf) == 4 and bytes(buf) == b"ssss"
        assert source.served == 4 and source.url == "memory://x/"
        assert source.from_peers == 0  # a chunk this node read itself
        peer = ChunkRef("o/", "cd" * 32, 10)
        got.add(peer, b"abcdefghij", peer=True)  # sent by another node
        assert source.get_range_into(peer.key, 0, buf) == 4 and bytes(buf) == b"abcd"
        assert source.served == 8 and source.from_peers == 4
