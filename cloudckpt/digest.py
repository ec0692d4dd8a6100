"""File digests: a SHA-256 tree over fixed 8 MiB chunks.

Why a tree and not one SHA-256 over the file: uploads send parts in parallel and restores
fetch ranges in parallel. With fixed chunks every worker hashes the chunks it already holds
in memory, so digests cost no second read of the file and no ordering between workers, and
a 2-core machine hashes on both cores. The root binds the chunk size and file size:

    leaf_i = SHA-256(chunk_i)                        chunk_i = bytes [i*C, (i+1)*C)
    root   = SHA-256(b"cloudckpt-tree-v1" || C as u64be || size as u64be || leaf_0 || ...)

An empty file has no leaves. ``tree_digest_of_file`` computes the same value for a file on
disk, for users who want to check a restored file by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator, Sequence

ALGORITHM = "sha256-tree"
CHUNK_SIZE = 8 * 1024 * 1024
_TAG = b"cloudckpt-tree-v1"


def leaf(chunk: bytes | memoryview) -> bytes:
    """Digest of one chunk (hashlib releases the GIL for large buffers)."""
    return hashlib.sha256(chunk).digest()


def leaves_of(buf: bytes | memoryview, chunk_size: int = CHUNK_SIZE) -> list[bytes]:
    """Leaf digests of ``buf``, which must start on a chunk boundary of its file."""
    view = memoryview(buf)
    return [leaf(view[i : i + chunk_size]) for i in range(0, len(view), chunk_size)]


def root(leaves: Sequence[bytes], size: int, chunk_size: int = CHUNK_SIZE) -> str:
    """The file digest (hex) from its leaves in order."""
    expected = -(-size // chunk_size)
    if len(leaves) != expected:
        raise ValueError(f"{len(leaves)} leaves for a {size}-byte file, expected {expected}")
    h = hashlib.sha256(_TAG)
    h.update(chunk_size.to_bytes(8, "big"))
    h.update(size.to_bytes(8, "big"))
    for d in leaves:
        h.update(d)
    return h.hexdigest()


def tree_digest(data: bytes | memoryview, chunk_size: int = CHUNK_SIZE) -> str:
    """The digest of an in-memory file."""
    return root(leaves_of(data, chunk_size), len(data), chunk_size)


def tree_digest_of_file(path: str | os.PathLike[str], chunk_size: int = CHUNK_SIZE) -> str:
    """The digest of a file on disk, read once in chunks."""
    leaves = []
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            leaves.append(leaf(chunk))
            size += len(chunk)
    return root(leaves, size, chunk_size)


# --- known payload digests -----------------------------------------------------------

_known: dict[int, tuple[object, bytes]] = {}
_known_lock = threading.Lock()


@contextlib.contextmanager
def known_sha256(data: bytes | bytearray | memoryview, sha256: bytes) -> Iterator[None]:
    """While the block runs, ``sha256_if_known(data)`` answers ``sha256`` for exactly this
    object (by identity, never by value). The transfer engine registers a one-chunk part's
    leaf (which is the part's SHA-256) around its upload, so a store that signs payloads
    need not hash the same bytes again. The caller guarantees that ``data`` does not change
    while the block runs (``bytes``; or a part's reused buffer or view, which nothing
    writes before its upload returns)."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(sha256) != 32:
        raise TypeError("known_sha256 takes a bytes-like part and a 32-byte SHA-256")
    key = id(data)
    with _known_lock:
        _known[key] = (data, sha256)
    try:
        yield
    finally:
        with _known_lock:
            entry = _known.get(key)
            if entry is not None and entry[0] is data:
                del _known[key]


def sha256_if_known(data: object) -> bytes | None:
    """The SHA-256 registered for this very object by ``known_sha256``, else None."""
    entry = _known.get(id(data))
    return entry[1] if entry is not None and entry[0] is data else None
