"""The upload path sends every part without copying it (issue 24 item 7: client CPU per GiB).

A fresh 8 MiB ``bytes`` per part (``pread``, ``MemoryFile.read``, ``bytes(memoryview)``)
cost more CPU in page faults than the CRC32C and half the SHA-256; parts are now read into
reused buffers or viewed in place, CRC32C'd through ctypes on the buffer itself, and handed
to botocore as views. These tests pin the mechanics against real servers (SeaweedFS checks
the CRC32C of every body; moto records the payload hash a signing client sends).
"""

from __future__ import annotations

import hashlib
import os

import google_crc32c
import numpy as np
import pytest

from cloudckpt import _crc32c, digest
from cloudckpt.stores import CREATE, crc32c_b64, open_store
from cloudckpt.transfer import MemoryFile, TransferConfig, TransferEngine

MiB = 1024 * 1024


def _sent_bodies(store):
    """Record the body object and headers of every PutObject/UploadPart this store's
    client sends (the prepared request, just before it goes on the wire)."""
    seen: list[tuple[object, dict]] = []

    def record(request, **kwargs):
        headers = {k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        seen.append((request.body, headers))

    for op in ("PutObject", "UploadPart"):
        store._client.meta.events.register(f"before-send.s3.{op}", record)
    return seen


@pytest.mark.parametrize(
    "make",
    [
        lambda b: memoryview(bytearray(b)),  # a reused part buffer
        lambda b: memoryview(bytearray(b))[3:],  # a slice of one
        lambda b: memoryview(np.frombuffer(b, dtype=np.uint8).copy()).toreadonly(),  # host memory
        lambda b: memoryview(np.frombuffer(b[: len(b) // 4 * 4], dtype=np.float32).copy()),
    ],
    ids=["bytearray", "slice", "readonly-numpy", "float32-format"],
)
def test_views_are_sent_as_they_are_and_the_store_checks_their_crc32c(
    seaweedfs_target, open_target, make
):
    store = open_target(seaweedfs_target)
    seen = _sent_bodies(store)
    raw = os.urandom(5 * MiB + 7)
    view = make(raw)
    expected = view.cast("B").tobytes() if view.format != "B" else view.tobytes()

    store.put("single", view, mode=CREATE)
    upload = store.create_multipart("multi")
    parts = [store.upload_part(upload, 1, view), store.upload_part(upload, 2, view[:100])]
    store.complete_multipart(upload, parts)

    assert store.get("single")[0] == expected
    assert store.get("multi")[0][: len(expected)] == expected
    # What went on the wire is the caller's memory itself, not a copy of it.
    bodies = [body for body, _ in seen]
    assert len(bodies) == 3 and all(isinstance(b, memoryview) for b in bodies)
    assert bodies[0].obj is view.obj and bodies[1].obj is view.obj
    for body, headers in seen:
        assert int(headers["Content-Length"]) == body.nbytes
        assert headers["x-amz-checksum-crc32c"] == crc32c_b64(body.tobytes())


def test_a_signed_payload_hashes_the_view_or_reuses_its_known_digest(moto_server):
    target_bucket = f"sig-{os.urandom(4).hex()}"
    moto_server.create_bucket(target_bucket)
    options = dict(moto_server.storage_options())
    options["config_kwargs"] = {"s3": {"payload_signing_enabled": True}}
    store = open_store(f"s3://{target_bucket}/run", options)
    seen = _sent_bodies(store)
    data = memoryview(bytearray(os.urandom(MiB)))
    store.put("a", data)
    with digest.known_sha256(data, hashlib.sha256(data).digest()):
        store.put("b", data)
    for _, headers in seen:
        assert headers["X-Amz-Content-SHA256"] == hashlib.sha256(data).hexdigest()
    assert store.get("a")[0] == store.get("b")[0] == data.tobytes()


@pytest.mark.parametrize("n", [0, 1, 9, 4095, 8 * MiB + 3])
def test_crc32c_of_any_buffer_matches_google_crc32c(n):
    raw = os.urandom(n)
    expected = google_crc32c.value(raw)
    assert _crc32c._extend is not None, "the C library google_crc32c links was not found"
    for data in (raw, bytearray(raw), memoryview(bytearray(raw)), memoryview(raw).toreadonly()):
        assert _crc32c.value(data) == expected
    with pytest.raises(BufferError):
        _crc32c.value(memoryview(bytearray(16))[::2])


def test_parts_are_read_into_reused_buffers_and_memory_files_are_viewed_in_place(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 * MiB))
    engine = TransferEngine(TransferConfig(concurrency=2))
    try:
        with engine.reading(path, MiB, MiB) as first:
            owner = first.obj
            assert first.tobytes() == path.read_bytes()[MiB : 2 * MiB]
        with engine.reading(path, 0, 2 * MiB) as second:
            assert second.obj is owner  # the same buffer, not a new allocation
            assert second.tobytes() == path.read_bytes()[: 2 * MiB]
    finally:
        engine.close()

    array = np.arange(MiB, dtype=np.uint8)
    mem = MemoryFile([b"head", memoryview(array)])
    view = mem.view(4, 1000)
    assert view.obj is not None and np.shares_memory(np.frombuffer(view, np.uint8), array)
    assert mem.view(2, 4).tobytes() == b"ad" + bytes(array[:2])  # across segments: joined


def test_default_parts_hold_several_chunks_each_checked_and_verified(seaweedfs_target, tmp_path):
    """Parts of 32 MiB (issue 31: botocore's CPU per request): each part carries four digest
    leaves and one CRC32C of all of its bytes (SeaweedFS refuses a wrong one), the short last
    part too, and the restore verifies every leaf against the manifest."""
    from cloudckpt import CheckpointManager

    assert TransferConfig().part_size == 4 * digest.CHUNK_SIZE
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(TransferConfig().part_size + digest.CHUNK_SIZE + 3)
    (src / "w.bin").write_bytes(data)
    mgr = CheckpointManager(
        seaweedfs_target.url,
        storage_options=seaweedfs_target.storage_options,
        staging_dir=tmp_path / "staging",
        chunking="off",
    )
    try:
        seen = _sent_bodies(mgr.store)
        mgr.save_dir(1, src).result()
        # The parts go up in parallel: in any order.
        parts = sorted(
            ((b.nbytes, h) for b, h in seen if isinstance(b, memoryview)), key=lambda p: -p[0]
        )
        assert [n for n, _ in parts] == [32 * MiB, 8 * MiB + 3]
        assert [h["x-amz-checksum-crc32c"] for _, h in parts] == [
            crc32c_b64(data[: 32 * MiB]),
            crc32c_b64(data[32 * MiB :]),
        ]
        restored = mgr.restore(tmp_path / "out")
        assert (restored.path / "w.bin").read_bytes() == data
    finally:
        mgr.close()


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_part_buffers_are_page_aligned(tmp_path):
    """A bytearray's memory starts 16 bytes into its page: every 64-byte load of the
    digest, the CRC and the copies would span two cache lines (docs/performance.md)."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(2 * MiB))
    engine = TransferEngine(TransferConfig(concurrency=2))
    try:
        with engine.reading(path, 0, MiB) as view:
            assert _address(view) % 4096 == 0
        with engine.reading_digested(path, 5, MiB) as (view, _, _):
            assert _address(view) % 4096 == 0
    finally:
        engine.close()


@pytest.mark.parametrize(
    "length",
    [0, 1, digest.FUSED_BLOCK + 7, digest.CHUNK_SIZE + 3 * MiB + 5],
    ids=["empty", "one-byte", "blocks", "chunks"],
)
def test_a_part_read_block_by_block_gets_the_leaves_and_crc_of_its_bytes(tmp_path, length):
    """Each block is read, then hashed and CRC'd (in cache); the buffer is reused and held
    other bytes before: the leaves and the CRC are of exactly the bytes read, and of the
    bytes the view hands the store."""
    data = os.urandom(2 * digest.CHUNK_SIZE)
    path = tmp_path / "f"
    path.write_bytes(data)
    engine = TransferEngine(TransferConfig(concurrency=1))
    try:
        with engine.reading(path, 0, 2 * digest.CHUNK_SIZE) as stale:
            owner = stale.obj  # the buffer now holds the file's first bytes
        offset = 12345
        expected = data[offset : offset + length]
        with engine.reading_digested(path, offset, length) as (view, leaves, crc):
            assert view.obj is owner
            assert view.tobytes() == expected
            assert leaves == digest.leaves_of(expected)
            assert crc == _crc32c.value(expected)
        mem = MemoryFile([data[:offset], data[offset:]])
        with engine.reading_digested(mem, offset, length) as (view, leaves, crc):
            assert view.tobytes() == expected
            assert (leaves, crc) == (digest.leaves_of(expected), _crc32c.value(expected))
    finally:
        engine.close()


def test_files_uploaded_through_reused_buffers_get_the_digests_of_their_bytes(tmp_path):
    """Several files of several parts each, through two reused part buffers: each entry's
    digest is the file's, and the store holds the file's bytes."""
    from cloudckpt.stores import memory

    store = memory.MemoryStore(f"reuse-{os.urandom(4).hex()}")
    files = []
    for i, size in enumerate([3 * digest.CHUNK_SIZE + 17, 2 * digest.CHUNK_SIZE, 5 * MiB]):
        path = tmp_path / f"f{i}"
        path.write_bytes(os.urandom(size))
        files.append((path.name, path))
    config = TransferConfig(
        concurrency=2, part_size=digest.CHUNK_SIZE, multipart_threshold=digest.CHUNK_SIZE
    )
    engine = TransferEngine(config)
    try:
        entries = engine.upload_files(store, "ck/", files)
    finally:
        engine.close()
    for entry, (name, path) in zip(entries, files, strict=True):
        assert entry.digest == digest.tree_digest_of_file(path)
        assert store.get(f"ck/{name}")[0] == path.read_bytes()
