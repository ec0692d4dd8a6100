"""A chunked save reads each leaf a block at a time and hashes it while hot (issue 31):
every chunk's name is the digest of exactly the bytes sent under it, and a first save's
chunks carry the CRC32C of exactly those bytes, whatever the reused buffer held before and
wherever a tensor cut falls inside a block."""

from __future__ import annotations

import itertools
import mmap
import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_chunks import _safetensors

from cloudckpt import _crc32c, chunks, digest, transfer
from cloudckpt.chunks import ChunkIndex, upload_chunked
from cloudckpt.distributed._chunks import chunk_names
from cloudckpt.stores import OVERWRITE, ObjectInfo, PutMode
from cloudckpt.stores.memory import MemoryStore, drop_memory_bucket
from cloudckpt.testing.wrappers import ForwardingStore
from cloudckpt.transfer import MemoryFile, TransferConfig, TransferEngine

MiB = 1024 * 1024
BLOCK = digest.FUSED_BLOCK


class RecordingStore(ForwardingStore):
    """Records each put's key, bytes, and the CRC32C registered for its very buffer."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.puts: dict[str, tuple[bytes, int | None]] = {}

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        self.puts[key] = (bytes(data), digest.crc32c_if_known(data))
        return self.inner.put(key, data, mode=mode)


def _model() -> bytes:
    """A safetensors file whose tensor cuts fall inside 1 MiB blocks (odd sizes) and whose
    leaves are cut into several chunks, one small tensor packed with its neighbour."""
    rng = random.Random(7)
    sizes = [3 * MiB // 2 + 3, 2 * MiB + 5, 100_000, 6 * MiB + 7, 9 * MiB + 11, 2 * MiB - 1]
    return _safetensors({f"t{i}": rng.randbytes(n) for i, n in enumerate(sizes)})


@pytest.fixture
def store():
    name = f"hot-{os.urandom(4).hex()}"
    yield RecordingStore(MemoryStore(name))
    drop_memory_bucket(name)


def _stale_engine(tmp_path: Path) -> TransferEngine:
    """One worker whose reused part buffer already holds other bytes."""
    engine = TransferEngine(TransferConfig(concurrency=1))
    other = tmp_path / "other"
    other.write_bytes(os.urandom(digest.CHUNK_SIZE))
    with engine.reading(other, 0, digest.CHUNK_SIZE):
        pass
    return engine


@pytest.mark.parametrize("source", ["file", "memory"])
def test_each_chunk_is_named_and_crcd_from_exactly_the_bytes_sent(tmp_path, store, source):
    data = _model()
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    src: Path | MemoryFile = path if source == "file" else MemoryFile([data[:777], data[777:]])
    cut = chunks.plan(src, len(data), "tensor", name=path.name)
    assert any(off % BLOCK and off % chunks.LEAF for off, _ in cut)  # cuts inside blocks
    engine = _stale_engine(tmp_path)
    try:
        (entry,), stats = upload_chunked(
            engine, store, "ck/a/", [(path.name, src)], ChunkIndex(), "tensor"
        )
    finally:
        engine.close()
    assert entry.digest == digest.tree_digest(data)
    assert [ref.size for ref in entry.chunks or ()] == [n for _, n in cut]
    assert stats.chunks_uploaded == len(cut) == len(store.puts)
    for (off, n), ref in zip(cut, entry.chunks or (), strict=True):
        sent, crc = store.puts[ref.key]
        assert sent == data[off : off + n]
        assert ref.sha256 == digest.hexleaf(sent, ref.algorithm)
        assert crc == _crc32c.value(sent)  # a first save: every chunk's CRC from the pass


def test_an_incremental_save_names_new_chunks_from_their_bytes_and_sends_no_crc(tmp_path, store):
    data = bytearray(_model())
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    engine = _stale_engine(tmp_path)
    try:
        (first,), _ = upload_chunked(engine, store, "ck/a/", [(path.name, path)], ChunkIndex())
        data[-5 * MiB] ^= 1  # one tensor changes
        path.write_bytes(data)
        store.puts.clear()
        (second,), stats = upload_chunked(
            engine, store, "ck/b/", [(path.name, path)], ChunkIndex.of_files([first], "c1")
        )
    finally:
        engine.close()
    assert second.digest == digest.tree_digest(bytes(data))
    assert stats.chunks_uploaded == len(store.puts) >= 1 and stats.chunks_reused >= 1
    for key, (sent, crc) in store.puts.items():
        assert key.startswith("ck/b/") and crc is None  # the store computes it
        assert key.endswith(digest.hexleaf(sent))


def test_a_chunked_save_reads_each_leaf_a_block_at_a_time_into_aligned_buffers(
    tmp_path, store, monkeypatch
):
    data = _model()
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    reads: list[int] = []
    real = transfer.pread_full

    def spy(fd, p, offset, buf):
        reads.append(len(buf))
        real(fd, p, offset, buf)

    monkeypatch.setattr(transfer, "pread_full", spy)
    engine = TransferEngine(TransferConfig(concurrency=2))
    taken: list[memoryview] = []
    take = engine._part_buffers.take
    monkeypatch.setattr(engine._part_buffers, "take", lambda n: taken.append(take(n)) or taken[-1])
    try:
        upload_chunked(engine, store, "ck/a/", [(path.name, path)], ChunkIndex())
    finally:
        engine.close()
    assert reads and max(reads) <= BLOCK  # never a whole leaf at once
    assert sum(reads) == len(data)
    assert taken and all(isinstance(b.obj, mmap.mmap) for b in taken)  # aligned_buffer's


@settings(max_examples=60, deadline=None)
@given(
    size=st.sampled_from([1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17]) | st.integers(1, 5000),
    cuts=st.lists(st.floats(0, 1), max_size=5),
    algorithm=st.sampled_from(digest.ALGORITHMS),
    crc32c=st.booleans(),
)
def test_one_pass_gives_the_leaf_chunks_and_crcs_of_separate_passes(size, cuts, algorithm, crc32c):
    data = os.urandom(size)
    points = sorted({0, size, *(int(c * size) for c in cuts)})
    sizes = [b - a for a, b in itertools.pairwise(points)]
    buf = bytearray(b"\xee" * size)  # held other bytes before

    def read(block: memoryview, at: int) -> None:
        block[:] = data[at : at + len(block)]

    leaf, names, crcs = digest.leaf_and_pieces_as_read(buf, read, sizes, algorithm, crc32c=crc32c)
    assert bytes(buf) == data and leaf == digest.leaf(data, algorithm)
    pieces = [data[a:b] for a, b in itertools.pairwise(points)]
    assert names == [digest.leaf(p, algorithm) for p in pieces]
    assert crcs == ([_crc32c.value(p) for p in pieces] if crc32c else None)
    # The pieces alone (a multi-rank save's naming pass): the same names, from a buffer
    # that held other bytes again.
    buf[:] = b"\xee" * size
    assert digest.pieces_as_read(buf, read, sizes, algorithm) == names
    assert bytes(buf) == data


def test_pieces_that_do_not_make_up_the_leaf_are_refused():
    with pytest.raises(ValueError):
        digest.leaf_and_pieces_as_read(bytearray(10), None, [4, 5])


# ------------------------------------------------------------------------------ chunk_names


def _files(tmp_path: Path) -> list[tuple[str, Path]]:
    """Staged files of every shape a save cuts: the safetensors model (tensor cuts inside
    blocks, leaves of several chunks), a file of whole leaves and a ragged tail, a small
    one, an empty one."""
    made = {
        "model.safetensors": _model(),
        "blob.bin": os.urandom(2 * chunks.LEAF + 3 * MiB + 5),
        "small.json": b'{"step": 7}',
        "empty.bin": b"",
    }
    for name, data in made.items():
        (tmp_path / name).write_bytes(data)
    return [(f"rank-00001/{name}", tmp_path / name) for name in made]


@pytest.mark.parametrize("mode", ["tensor", "fixed"])
def test_chunk_names_are_the_names_the_upload_puts(tmp_path, store, monkeypatch, mode):
    """A multi-rank save's naming pass (``chunk_names``, cross-rank dedup) gives exactly
    the names ``upload_chunked`` puts the same files under, each the digest of the bytes
    sent, reading each leaf a block at a time into a reused buffer that held other bytes
    before, every byte once."""
    files = _files(tmp_path)
    reads: list[int] = []
    real = transfer.pread_full

    def spy(fd, p, offset, buf):
        reads.append(len(buf))
        real(fd, p, offset, buf)

    engine = _stale_engine(tmp_path)
    try:
        monkeypatch.setattr(transfer, "pread_full", spy)
        names = chunk_names(engine, files, mode)
        monkeypatch.setattr(transfer, "pread_full", real)
        entries, _ = upload_chunked(engine, store, "ck/a/", files, ChunkIndex(), mode)
    finally:
        engine.close()
    put = {ref.name for e in entries for ref in e.chunks or ()}
    assert names == put
    assert len(names) > len(files) + 2  # several chunks (and cut leaves) among them
    for ref in (r for e in entries for r in e.chunks or ()):
        assert ref.sha256 == digest.hexleaf(store.puts[ref.key][0], ref.algorithm)
    assert reads and max(reads) <= BLOCK  # never a whole leaf at once
    assert sum(reads) == sum(path.stat().st_size for _, path in files)


def test_chunk_names_hash_each_byte_once(tmp_path, monkeypatch):
    """The naming pass computes the chunks' digests only: no leaf digest beside a leaf's
    several chunks (it would hash their bytes twice) and no CRC32C."""
    files = _files(tmp_path)[:2]
    hashed = 0
    real = digest.hasher

    class Counting:
        def __init__(self, inner: digest.Hasher) -> None:
            self.inner = inner

        def update(self, data: bytes | bytearray | memoryview, /) -> object:
            nonlocal hashed
            hashed += memoryview(data).nbytes
            return self.inner.update(data)

        def digest(self) -> bytes:
            return self.inner.digest()

    monkeypatch.setattr(digest, "hasher", lambda *a, **k: Counting(real(*a, **k)))
    monkeypatch.setattr(_crc32c, "extend", lambda *a: pytest.fail("a CRC32C in the naming pass"))
    engine = TransferEngine(TransferConfig(concurrency=2))
    try:
        chunk_names(engine, files, "tensor")
    finally:
        engine.close()
    model = files[0][1]
    cut = chunks.plan(model, model.stat().st_size, "tensor")
    leaves = [off // chunks.LEAF for off, _ in cut]
    assert len(set(leaves)) < len(leaves)  # some leaf holds several chunks
    assert hashed == sum(path.stat().st_size for _, path in files)
