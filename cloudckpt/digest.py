"""File digests: a hash tree over fixed 8 MiB chunks, with SHA-256 or BLAKE3.

Why a tree and not one hash over the file: uploads send parts in parallel and restores
fetch ranges in parallel. With fixed chunks every worker hashes the chunks it already holds
in memory, so digests cost no second read of the file and no ordering between workers, and
a 2-core machine hashes on both cores. The root binds the algorithm, the chunk size and
the file size:

    leaf_i = H(chunk_i)                              chunk_i = bytes [i*C, (i+1)*C)
    root   = H(TAG || C as u64be || size as u64be || leaf_0 || ...)

    "sha256-tree": H = SHA-256, TAG = b"cloudckpt-tree-v1"      (checkpoints before BLAKE3)
    "blake3-tree": H = BLAKE3,  TAG = b"cloudckpt-blake3-tree-v1" (what new checkpoints use)

An empty file has no leaves. A manifest names its algorithm (``manifests.Manifest``); every
function here takes ``algorithm`` (None: ``ALGORITHM``, read at call time, what a save
writes). BLAKE3 (the ``blake3`` package, Rust) hashes 2-3x faster than SHA-256 with
SHA-NI, releases the GIL, and hashes one buffer of at least ``THREADED_MIN`` bytes on
several cores (``max_threads``), which helps where one thread hashes a large file
(``tree_digest_of_file``, a restore of one big range). ``tree_digest_of_file`` computes the
same value for a file on disk, for users who want to check a restored file by hand.

Raises UnknownFormatError for an algorithm this version does not know (a newer cloudckpt
wrote the checkpoint).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, cast

import blake3

from cloudckpt import _crc32c
from cloudckpt.errors import UnknownFormatError

SHA256_TREE = "sha256-tree"
BLAKE3_TREE = "blake3-tree"
#: Every algorithm this version reads.
ALGORITHMS = (SHA256_TREE, BLAKE3_TREE)
#: What new checkpoints use (the tests set it to SHA-256 to write an older run).
ALGORITHM = BLAKE3_TREE
CHUNK_SIZE = 8 * 1024 * 1024
_TAGS = {SHA256_TREE: b"cloudckpt-tree-v1", BLAKE3_TREE: b"cloudckpt-blake3-tree-v1"}
#: BLAKE3 buffers at least this big are hashed on several cores (below it the thread
#: hand-off costs more than it saves).
THREADED_MIN = 1024 * 1024


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def digest(self) -> bytes: ...


def check(algorithm: str | None, what: str = "") -> str:
    """``algorithm`` (None: ``ALGORITHM``) if this version knows it. Raises
    UnknownFormatError (``what``: whose digest, for the message)."""
    name = ALGORITHM if algorithm is None else algorithm
    if name not in _TAGS:
        raise UnknownFormatError(
            f"{what + ': ' if what else ''}digest {name!r} is not one this cloudckpt knows "
            f"(it reads {' and '.join(map(repr, ALGORITHMS))})",
            what=what or "digest",
            found=str(name),
            known=ALGORITHMS,
        )
    return name


def hasher(algorithm: str | None = None, size_hint: int = 0) -> Hasher:
    """An incremental hash of ``algorithm`` (BLAKE3 on several cores when the bytes it will
    see, ``size_hint``, are at least ``THREADED_MIN``). Raises UnknownFormatError."""
    if check(algorithm) == SHA256_TREE:
        return hashlib.sha256()
    threads = blake3.blake3.AUTO if size_hint >= THREADED_MIN else 1
    return blake3.blake3(max_threads=threads)


def leaf(
    chunk: bytes | bytearray | memoryview, algorithm: str | None = None, *, threaded: bool = True
) -> bytes:
    """Digest of one chunk (both hashes release the GIL for large buffers). ``threaded``:
    False where the caller's own workers already hash in parallel (one BLAKE3 thread: no
    hand-off to its thread pool). Raises UnknownFormatError."""
    h = hasher(algorithm, memoryview(chunk).nbytes if threaded else 0)
    h.update(chunk)
    return h.digest()


def hexleaf(
    chunk: bytes | bytearray | memoryview, algorithm: str | None = None, *, threaded: bool = True
) -> str:
    """``leaf`` in hex: a chunk's name (``manifests.ChunkRef``)."""
    return leaf(chunk, algorithm, threaded=threaded).hex()


FUSED_BLOCK = 1 << 20  # small enough that the CRC reads each block while it is still cached


def leaf_and_crc32c(
    chunk: bytes | bytearray | memoryview, algorithm: str | None = None, crc: int = 0
) -> tuple[bytes, int]:
    """``leaf(chunk)`` and the CRC32C of ``crc``'s bytes followed by the chunk, in one pass
    over memory: block by block, each block hashed and then CRC'd while it is in cache (a
    save sends S3 and GCS a CRC32C of every payload; two passes cost 16 % more CPU,
    docs/performance.md). One thread per chunk: the upload already runs chunks in
    parallel. Raises UnknownFormatError."""
    view = memoryview(chunk).cast("B")
    h = hasher(algorithm)
    for i in range(0, len(view), FUSED_BLOCK):
        block = view[i : i + FUSED_BLOCK]
        h.update(block)
        crc = _crc32c.extend(crc, block)
    return h.digest(), crc


def leaves_and_crc32c(
    buf: bytes | bytearray | memoryview, chunk_size: int = CHUNK_SIZE, algorithm: str | None = None
) -> tuple[list[bytes], int]:
    """``leaves_of(buf)`` and the CRC32C of all of ``buf``, in one pass (``leaf_and_crc32c``)."""
    view = memoryview(buf).cast("B")
    leaves, crc = [], 0
    for i in range(0, len(view), chunk_size):
        digest, crc = leaf_and_crc32c(view[i : i + chunk_size], algorithm, crc)
        leaves.append(digest)
    return leaves, crc


#: Fills ``block`` with the bytes at offset ``at`` of the buffer being digested.
Reader = Callable[[memoryview, int], None]


def blocks_as_read(
    buf: bytearray | memoryview, read: Reader | None, cuts: Iterable[int] = ()
) -> Iterator[tuple[int, memoryview]]:
    """The one loop that fills a buffer and digests it while in cache: each
    ``FUSED_BLOCK`` of ``buf`` is first filled by ``read(block, at)`` (None: ``buf``
    already holds its bytes), then yielded as ``(at, piece)`` pieces, split at every
    offset of ``cuts`` (ascending) inside it, so that each piece lies within one range
    between cuts (a leaf, a chunk). Nothing of a block is yielded before it was read: a
    caller's hash and CRC are of exactly the bytes ``buf`` ends up holding."""
    view = memoryview(buf).cast("B")
    pending = iter(cuts)
    cut = next(pending, None)
    for at in range(0, len(view), FUSED_BLOCK):
        block = view[at : at + FUSED_BLOCK]
        if read is not None:
            read(block, at)  # before the block is yielded: the hash is of these bytes
        lo, end = at, at + len(block)
        while cut is not None and cut < end:
            if cut > lo:
                yield lo, view[lo:cut]
                lo = cut
            cut = next(pending, None)
        yield lo, view[lo:end]


def leaves_and_crc32c_as_read(
    buf: bytearray | memoryview,
    read: Reader | None,
    chunk_size: int = CHUNK_SIZE,
    algorithm: str | None = None,
) -> tuple[list[bytes], int]:
    """``leaves_and_crc32c(buf)`` of a buffer that ``read(block, at)`` fills as the pass
    goes (``blocks_as_read``): each ``FUSED_BLOCK`` of ``buf`` is first filled with the
    bytes at offset ``at`` of ``buf``, then hashed and CRC'd while it is still in cache. A
    32 MiB part read whole and hashed afterwards has left the cache by then (the upload of
    a file costs about 0.05 CPU-s per GiB more, docs/performance.md "Upload client CPU").
    On return ``buf`` holds exactly the bytes the leaves and the CRC are of. Raises what
    ``read`` raises, and UnknownFormatError."""
    size = memoryview(buf).nbytes
    hashers = [hasher(algorithm) for _ in range(0, size, chunk_size)]
    crc = 0
    for at, piece in blocks_as_read(buf, read, range(chunk_size, size, chunk_size)):
        hashers[at // chunk_size].update(piece)
        crc = _crc32c.extend(crc, piece)
    return [h.digest() for h in hashers], crc


def leaf_and_pieces_as_read(
    buf: bytearray | memoryview,
    read: Reader | None,
    sizes: Sequence[int],
    algorithm: str | None = None,
    *,
    crc32c: bool = False,
) -> tuple[bytes, list[bytes], list[int] | None]:
    """The digest of ``buf`` (one leaf, or less), the digests of its pieces (consecutive,
    of ``sizes`` bytes: a chunked file's chunks in that leaf) and, with ``crc32c``, each
    piece's CRC32C, in one pass over a buffer that ``read`` fills as it goes
    (``blocks_as_read``): each block hashed (and CRC'd) while in cache, as
    ``leaves_and_crc32c_as_read`` does for a whole file's part. A single piece is the leaf:
    its digest is the leaf's, not computed twice. Raises ValueError (the sizes do not
    add up to ``buf``), what ``read`` raises, and UnknownFormatError."""
    leaf, names, crcs = _pieces_pass(buf, read, sizes, algorithm, leaf=True, crc32c=crc32c)
    assert leaf is not None
    return leaf, names, crcs


def pieces_as_read(
    buf: bytearray | memoryview,
    read: Reader | None,
    sizes: Sequence[int],
    algorithm: str | None = None,
) -> list[bytes]:
    """The digests of ``buf``'s pieces only (``leaf_and_pieces_as_read`` without the leaf
    and the CRCs): the chunk names of a leaf, for a caller that needs no file digest (a
    multi-rank save's naming pass, ``distributed._chunks.chunk_names``), so that a leaf cut
    into several chunks is hashed once, not twice. Same pass, same loop, same errors."""
    return _pieces_pass(buf, read, sizes, algorithm, leaf=False, crc32c=False)[1]


def _pieces_pass(
    buf: bytearray | memoryview,
    read: Reader | None,
    sizes: Sequence[int],
    algorithm: str | None,
    *,
    leaf: bool,
    crc32c: bool,
) -> tuple[bytes | None, list[bytes], list[int] | None]:
    """``leaf_and_pieces_as_read``, the leaf's digest only with ``leaf`` (None without)."""
    size = memoryview(buf).nbytes
    ends = list(itertools.accumulate(sizes))
    if not ends or ends[-1] != size or any(n < 0 for n in sizes):
        raise ValueError(f"pieces of {list(sizes)} bytes do not make up {size} bytes")
    # One piece: its digest is the leaf's. Several: one hash each, and the leaf's only if
    # asked for.
    whole = hasher(algorithm) if leaf or len(sizes) == 1 else None
    split = [hasher(algorithm) for _ in sizes] if len(sizes) > 1 else []
    crcs = [0] * len(sizes)
    i = 0
    for at, piece in blocks_as_read(buf, read, ends[:-1]):
        while at >= ends[i]:
            i += 1
        if whole is not None:
            whole.update(piece)
        if split:
            split[i].update(piece)
        if crc32c:
            crcs[i] = _crc32c.extend(crcs[i], piece)
    whole_digest = whole.digest() if whole is not None else None
    names = [h.digest() for h in split] if split else [cast("bytes", whole_digest)]
    return whole_digest if leaf else None, names, crcs if crc32c else None


def leaves_of(
    buf: bytes | bytearray | memoryview,
    chunk_size: int = CHUNK_SIZE,
    algorithm: str | None = None,
    *,
    threaded: bool = True,
) -> list[bytes]:
    """Leaf digests of ``buf``, which must start on a chunk boundary of its file."""
    view = memoryview(buf)
    return [
        leaf(view[i : i + chunk_size], algorithm, threaded=threaded)
        for i in range(0, len(view), chunk_size)
    ]


def root(
    leaves: Sequence[bytes], size: int, chunk_size: int = CHUNK_SIZE, algorithm: str | None = None
) -> str:
    """The file digest (hex) from its leaves in order. Raises ValueError (a wrong number of
    leaves) or UnknownFormatError."""
    name = check(algorithm)
    expected = -(-size // chunk_size)
    if len(leaves) != expected:
        raise ValueError(f"{len(leaves)} leaves for a {size}-byte file, expected {expected}")
    h = hasher(name)
    h.update(_TAGS[name])
    h.update(chunk_size.to_bytes(8, "big"))
    h.update(size.to_bytes(8, "big"))
    for d in leaves:
        h.update(d)
    return h.digest().hex()


class LeafDigests:
    """The leaf digests of one file as its pieces land, from parallel workers and in any
    order: the one collector every verified read uses (into a directory, into memory).
    ``expect`` says how many pieces will land; the ``add`` that lands the last one says
    so, and ``root_ok`` then compares the file's digest, from the leaves, with
    ``expected`` (the manifest's)."""

    def __init__(
        self,
        size: int,
        expected: str,
        chunk_size: int = CHUNK_SIZE,
        algorithm: str | None = None,
        pieces: int = 0,
    ) -> None:
        self.size, self.expected, self.chunk_size = size, expected, chunk_size
        self.algorithm = algorithm
        self.leaves: list[bytes | None] = [None] * -(-size // chunk_size)
        self.missing = pieces
        self._lock = threading.Lock()

    def expect(self, pieces: int) -> None:
        """``pieces`` more ``add`` calls complete the file (read again: counted anew)."""
        self.missing = pieces

    def add(self, first: int, leaves: Sequence[bytes]) -> bool:
        """Record the leaves of one piece from leaf ``first`` on; True for the call that
        lands the last expected piece."""
        with self._lock:
            self.leaves[first : first + len(leaves)] = leaves
            self.missing -= 1
            return self.missing == 0

    def root_ok(self) -> bool:
        """Whether the leaves make up the recorded digest (False while any is missing).
        Raises UnknownFormatError (an algorithm this version does not know)."""
        if any(leaf is None for leaf in self.leaves):
            return False
        try:
            done = cast("list[bytes]", self.leaves)
            return root(done, self.size, self.chunk_size, self.algorithm) == self.expected
        except ValueError:
            return False


def tree_digest(
    data: bytes | bytearray | memoryview, chunk_size: int = CHUNK_SIZE, algorithm: str | None = None
) -> str:
    """The digest of an in-memory file."""
    return root(leaves_of(data, chunk_size, algorithm), len(data), chunk_size, algorithm)


def tree_digest_of_file(
    path: str | os.PathLike[str], chunk_size: int = CHUNK_SIZE, algorithm: str | None = None
) -> str:
    """The digest of a file on disk, read once in chunks."""
    leaves = []
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            leaves.append(leaf(chunk, algorithm))
            size += len(chunk)
    return root(leaves, size, chunk_size, algorithm)


# --- known payload digests -----------------------------------------------------------


class _KnownValues:
    """Values computed from one buffer object, registered by identity (never by value)
    while a block runs, so that a store need not compute them from the same bytes again.
    The registering caller guarantees the buffer does not change while the block runs."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[object, object]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def registered(self, data: object, value: object) -> Iterator[None]:
        key = id(data)
        with self._lock:
            self._values[key] = (data, value)
        try:
            yield
        finally:
            with self._lock:
                entry = self._values.get(key)
                if entry is not None and entry[0] is data:
                    del self._values[key]

    def get(self, data: object) -> object | None:
        entry = self._values.get(id(data))
        return entry[1] if entry is not None and entry[0] is data else None


_sha256s = _KnownValues()
_crc32cs = _KnownValues()


def known_sha256(
    data: bytes | bytearray | memoryview, sha256: bytes
) -> contextlib.AbstractContextManager[None]:
    """While the block runs, ``sha256_if_known(data)`` answers ``sha256`` for exactly this
    object (by identity, never by value). The transfer engine registers a one-chunk part's
    leaf (which is the part's SHA-256 when the checkpoint's digest is ``sha256-tree``)
    around its upload, so a store that signs payloads need not hash the same bytes again.
    The caller guarantees that ``data`` does not change while the block runs (``bytes``;
    or a part's reused buffer or view, which nothing writes before its upload returns)."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(sha256) != 32:
        raise TypeError("known_sha256 takes a bytes-like part and a 32-byte SHA-256")
    return _sha256s.registered(data, sha256)


def known_crc32c(
    data: bytes | bytearray | memoryview, crc: int
) -> contextlib.AbstractContextManager[None]:
    """While the block runs, ``crc32c_if_known(data)`` answers ``crc`` for exactly this
    object: the CRC32C computed in the same pass as the leaf (``leaf_and_crc32c``), which a
    store sends as the payload's transfer checksum instead of reading the bytes again. Same
    guarantee from the caller as ``known_sha256``."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or not 0 <= crc < 1 << 32:
        raise TypeError("known_crc32c takes a bytes-like payload and a 32-bit CRC")
    return _crc32cs.registered(data, crc)


def known_leaf(
    data: bytes | bytearray | memoryview, leaf_digest: bytes, algorithm: str | None = None
) -> contextlib.AbstractContextManager[None]:
    """``known_sha256(data, leaf_digest)`` where the leaf is a SHA-256 (``sha256-tree``);
    otherwise nothing (a signing store then hashes the payload itself)."""
    if check(algorithm) == SHA256_TREE:
        return known_sha256(data, leaf_digest)
    return contextlib.nullcontext()


def sha256_if_known(data: object) -> bytes | None:
    """The SHA-256 registered for this very object by ``known_sha256``, else None."""
    return cast("bytes | None", _sha256s.get(data))


def crc32c_if_known(data: object) -> int | None:
    """The CRC32C registered for this very object by ``known_crc32c``, else None."""
    return cast("int | None", _crc32cs.get(data))
