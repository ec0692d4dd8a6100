"""Read once, fan out (issue 30 item 5; ``cloudckpt/distributed/_fanout.py``): the plan
every rank derives, the rounds, and the receiver's check. The transfers themselves, over a
real gloo group between 2 simulated nodes, are
``test_distributed_local.py::test_data_parallel_replicas_on_2_nodes_read_each_chunk_once``.
"""

from __future__ import annotations

from cloudckpt import digest
from cloudckpt.distributed import _fanout
from cloudckpt.distributed._fanout import Need, Transfer, accept, plan, rounds
from cloudckpt.manifests import ChunkRef

MiB = 1 << 20


def test_each_chunk_several_nodes_need_gets_one_sender_spread_by_bytes():
    """Leaders 0 and 2 (rank 1 is not a leader) need the same 4 chunks; leader 0 alone
    needs ``only0``. Each shared chunk has one sender, a leader that needs it, the
    senders share the bytes evenly, and every rank derives the same plan."""
    shared = {f"c{i}": 8 * MiB for i in range(4)}
    needs = [Need({**shared, "only0": MiB}), None, Need(dict(shared))]
    transfers = plan(needs)
    assert [t.key for t in transfers] == sorted(shared)  # only0 is nobody else's: not sent
    load = {0: 0, 2: 0}
    for t in transfers:
        assert t.sender in (0, 2) and t.receivers == tuple({0, 2} - {t.sender})
        load[t.sender] += t.size
    assert load == {0: 16 * MiB, 2: 16 * MiB}
    assert plan(list(needs)) == transfers  # deterministic


def test_no_plan_without_a_chunk_two_nodes_need():
    assert plan([Need({"a": 1}), Need({"b": 1})]) == []
    assert plan([Need({"a": 1}), None]) == []


def test_rounds_hold_at_most_round_bytes_and_every_transfer_once():
    big = _fanout.ROUND_BYTES // 3
    transfers = [Transfer(f"k{i}", big, 0, (1,)) for i in range(7)]
    cut = rounds(transfers)
    assert [t for r in cut for t in r] == transfers
    assert all(r and sum(t.size for t in r) <= _fanout.ROUND_BYTES for r in cut)
    huge = [Transfer("h", 2 * _fanout.ROUND_BYTES, 0, (1,))]
    assert rounds(huge) == [huge]
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


def test_received_chunks_are_served_from_memory_and_the_rest_from_the_store():
    class Inner:
        url = "memory://x/"

        def get_range_into(self, key, start, buf):
            buf[: len(buf)] = b"s" * len(buf)
            return len(buf)

    source = _fanout.WithReceived(Inner(), {"k": b"0123456789"})  # type: ignore[arg-type]
    buf = bytearray(4)
    assert source.get_range_into("k", 3, buf) == 4 and bytes(buf) == b"3456"
    assert source.get_range_into("other", 0, buf) == 4 and bytes(buf) == b"ssss"
    assert source.served == 4 and source.url == "memory://x/"
