"""The transfer CRC32C computed in the digest's pass (issue 31 item 2): the value a store
sends is the CRC of the very bytes sent, and a first save's chunks are read once."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt import CheckpointManager, _crc32c, digest
from cloudckpt.errors import ChecksumMismatchError, OutcomeUnknownError
from cloudckpt.stores import open_store

BLOCK = digest.FUSED_BLOCK


@settings(max_examples=40, deadline=None)
@given(
    size=st.sampled_from([0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17])
    | st.integers(0, 5000),
    algorithm=st.sampled_from(digest.ALGORITHMS),
)
def test_one_pass_gives_the_leaf_and_crc_of_two_passes(size, algorithm):
    data = os.urandom(size)
    leaf, crc = digest.leaf_and_crc32c(memoryview(data), algorithm)
    assert leaf == digest.leaf(data, algorithm)
    assert crc == _crc32c.value(data)


def test_a_part_of_several_chunks_gets_each_leaf_and_one_crc():
    data = os.urandom(3 * 4096 + 5)
    leaves, crc = digest.leaves_and_crc32c(data, chunk_size=4096)
    assert leaves == digest.leaves_of(data, chunk_size=4096)
    assert crc == _crc32c.value(data)


@pytest.fixture(params=["seaweedfs", "gcs"])
def checking_target(request):
    """Stores that notice a CRC32C that is not the bytes': SeaweedFS answers BadDigest (as
    S3 does); fake-gcs-server keeps the bytes and the adapter compares the CRC it answers."""
    return request.getfixturevalue(f"{request.param}_target")


def test_the_store_sends_the_registered_crc_of_exactly_that_buffer(checking_target):
    store = open_store(checking_target.url, checking_target.storage_options)
    data = os.urandom(100_000)
    wrong = _crc32c.value(data) ^ 1
    with (
        digest.known_crc32c(data, wrong),
        pytest.raises((ChecksumMismatchError, OutcomeUnknownError)),
    ):
        store.put("k", data)
    with digest.known_crc32c(data, _crc32c.value(data)):
        store.put("k", data)
    assert store.get("k")[0] == data
    # By identity, never by value: equal bytes in another object are not covered.
    with digest.known_crc32c(data, wrong):
        store.put("k2", bytes(bytearray(data)))
    assert digest.crc32c_if_known(data) is None  # gone once the block ends


def test_a_first_save_sends_the_crc_from_the_digest_pass(seaweedfs_target, tmp_path, monkeypatch):
    """Every put asks for a known CRC (records and pointers have none); a first save's chunks
    each have one, an incremental save's new chunks do not (the store computes it)."""
    sent = []
    real = digest.crc32c_if_known

    def spy(data):
        known = real(data)
        sent.append(known is not None)
        return known

    monkeypatch.setattr(digest, "crc32c_if_known", spy)
    url, opts = seaweedfs_target.url, seaweedfs_target.storage_options
    blob = {"a.bin": os.urandom(3 * digest.CHUNK_SIZE + 5), "b.bin": os.urandom(1000)}
    mgr = CheckpointManager(url, storage_options=opts, staging_dir=tmp_path / "s")
    with mgr.save(1) as d:
        for name, data in blob.items():
            (d / name).write_bytes(data)
    mgr.wait()
    chunks = sum(-(-len(b) // digest.CHUNK_SIZE) for b in blob.values())
    assert sent.count(True) == chunks, sent  # each chunk's CRC came from the digest pass
    sent.clear()
    with mgr.save(2) as d:  # incremental: most chunks reused, the store computes the CRC
        (d / "a.bin").write_bytes(blob["a.bin"])
        (d / "b.bin").write_bytes(os.urandom(1000))
    mgr.wait()
    assert sent and True not in sent  # b.bin's new chunk, sent with the store's own CRC
    res = mgr.restore(tmp_path / "r")
    assert res.step == 2 and (res.path / "a.bin").read_bytes() == blob["a.bin"]
    mgr.close()
