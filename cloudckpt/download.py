"""Verified downloads of a checkpoint's files into a directory: the one read path every
restore into a directory takes (``restore``, distributed restores, ``get``, ``export``).

Every file is created up front (sparse, ``O_EXCL``: nothing is written through what
already exists) and fetched in verification units on the transfer engine's workers:

- a chunked file leaf by leaf: each chunk checked against its name as it lands
  (``chunks.fetch_chunk``); a leaf of one chunk has the chunk's name as its digest, a leaf
  cut into several chunks is assembled in a reused buffer and hashed once more;
- a whole file in chunk-aligned ranges, read straight into reused buffers where the store
  can (``get_range_into``; a short answer judged by ``transfer.read_exact``) and hashed
  there.

Each unit is written with ``pwrite`` at its offset and its leaf digests go to the file's
``digest.LeafDigests``; the worker that lands a file's last unit checks the file's digest
and fsyncs it, so flushing one file overlaps downloading the others. A file counts only
when every leaf matches its recorded digest.

Memory: at most ``concurrency`` buffers of one range (whole files: kept by the engine
between transfers) and of one leaf (chunked files: kept for one download).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from cloudckpt import digest
from cloudckpt.chunks import LEAF, fetch_chunk, leaf_groups
from cloudckpt.errors import CorruptionError, ObjectNotFoundError
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.manifests import ChunkRef, FileEntry
from cloudckpt.stores import Store
from cloudckpt.transfer import BufferPool, Progress, TransferEngine, round_up


def create_sized(dest: Path, path: str, size: int) -> Path:
    """Create the new file ``path`` (``/``-separated) under ``dest``, ``size`` bytes long
    (sparse), for ranges to be written into. Raises OSError, FileExistsError included:
    O_EXCL never writes through something that already exists (a planted link)."""
    target = dest.joinpath(*path.split("/"))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return target


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_at(target: Path, offset: int, view: memoryview) -> None:
    """``view`` written at ``offset`` of the existing file ``target`` (no ``O_CREAT``: a
    worker left running after an interrupt never creates anything). Raises OSError."""
    fd = os.open(target, os.O_WRONLY)
    try:
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], offset + written)
    finally:
        os.close(fd)


class _Target:
    """One file being downloaded: its leaf digests as units land; the worker that adds
    the last unit checks the file's digest (``finish``) and fsyncs it."""

    def __init__(self, key: str, entry: FileEntry, target: Path, chunk_size: int) -> None:
        self.key, self.entry, self.target, self.chunk_size = key, entry, target, chunk_size
        self.leaves = digest.LeafDigests(entry.size, entry.digest, chunk_size, entry.algorithm)

    def finish(self) -> None:
        """Raises CorruptionError if the file's leaves are not its recorded digest (for a
        chunked file: valid chunks that do not make up the file, listed in the wrong
        order, say)."""
        if not self.leaves.root_ok():
            if self.entry.chunks is None:
                raise CorruptionError(f"{self.key} does not match its digest")
            raise CorruptionError(
                f"{self.entry.path} does not match its digest: its chunks are intact but do "
                "not make up the file the manifest records"
            )
        _fsync_path(self.target)


def _fetch_leaf(
    engine: TransferEngine, store: Store, pieces: Sequence[ChunkRef], buf: bytearray
) -> tuple[memoryview | bytes, bytes]:
    """The bytes of one leaf made of ``pieces`` (each chunk verified against its name) and
    the leaf's digest. A leaf of one chunk has the chunk's name as its digest: no extra
    hashing. A leaf cut into several chunks (tensor boundaries) is assembled in ``buf``
    and hashed once more as a whole. Raises MissingChunkError."""
    view = memoryview(buf)
    if len(pieces) == 1:
        return fetch_chunk(engine, store, pieces[0], view), bytes.fromhex(pieces[0].sha256)
    filled = 0
    for ref in pieces:
        data = fetch_chunk(engine, store, ref, view[filled:])
        if not (isinstance(data, memoryview) and data.obj is buf):
            view[filled : filled + ref.size] = data  # the store cannot read in place
        filled += ref.size
    return view[:filled], digest.leaf(view[:filled], pieces[0].algorithm)


def _chunked_leaf(
    engine: TransferEngine,
    store: Store,
    t: _Target,
    index: int,
    pieces: Sequence[ChunkRef],
    report: Progress,
    buffers: BufferPool[bytearray],
) -> None:
    """Fetch leaf ``index`` of the chunked file ``t``, write it, record its digest; the
    call that completes the file checks it. Raises MissingChunkError, CorruptionError,
    StoreError, OSError."""
    buf = buffers.take(LEAF)
    try:
        data, leaf = _fetch_leaf(engine, store, pieces, buf)
        failpoint("restore.after_range")
        view = memoryview(data)
        _write_at(t.target, index * LEAF, view)
        size = len(view)
    finally:
        buffers.give(buf)
    report(size)
    if t.leaves.add(index, [leaf]):
        t.finish()


def _plain_range(
    engine: TransferEngine,
    store: Store,
    t: _Target,
    offset: int,
    length: int,
    report: Progress,
) -> None:
    """Fetch, hash and write the range at ``offset`` of the whole file ``t``; the call
    that completes the file checks it. Raises CorruptionError (missing, short, wrong),
    StoreError, OSError."""
    key, entry, chunk_size = t.key, t.entry, t.chunk_size
    buffers = engine.buffers
    buf = buffers.take(round_up(engine.config.range_size, chunk_size))
    try:
        view = memoryview(buf)[:length]
        try:
            got = engine.read_exact(store, key, offset, view)
        except ObjectNotFoundError:
            raise CorruptionError(f"{key} is missing from the store") from None
        if got != length:
            raise CorruptionError(
                f"{key} is shorter than the {entry.size} bytes its manifest records"
            )
        leaves = digest.leaves_of(view, chunk_size, entry.algorithm)
        failpoint("restore.after_range")
        _write_at(t.target, offset, view)
        view.release()
    finally:
        buffers.give(buf)
    report(length)
    if t.leaves.add(offset // chunk_size, leaves):
        t.finish()


def download(
    engine: TransferEngine,
    store: Store,
    files_prefix: str,
    entries: Sequence[FileEntry],
    dest: Path,
    chunk_size: int = LEAF,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Download ``entries`` (validated manifest entries; whole files under
    ``files_prefix``) into the directory ``dest``, every byte verified (module
    docstring); every file fsynced once verified. ``chunk_size``: the manifest's.

    Raises:
        CorruptionError: a file or chunk is missing, short, or fails its digest
            (MissingChunkError for a chunk).
        StoreError: the store failed after retries.
        OSError: a file could not be created or written (FileExistsError included).
    """
    report = Progress(progress)
    chunked, plain = [], []
    try:
        buffers: BufferPool[bytearray] = BufferPool(bytearray)  # leaves, for this download
        for entry in (e for e in entries if e.chunks is not None):
            t = _Target(entry.path, entry, create_sized(dest, entry.path, entry.size), LEAF)
            if entry.size == 0:
                t.finish()  # no leaves: check the digest of nothing now
                continue
            groups = leaf_groups(entry)
            t.leaves.expect(len(groups))
            for index, pieces in enumerate(groups):
                chunked.append(
                    engine.submit(_chunked_leaf, engine, store, t, index, pieces, report, buffers)
                )
        step = round_up(engine.config.range_size, chunk_size)
        for entry in (e for e in entries if e.chunks is None):
            key = files_prefix + entry.path
            t = _Target(key, entry, create_sized(dest, entry.path, entry.size), chunk_size)
            if entry.size == 0:
                t.finish()  # no ranges: check the digest of nothing now
                continue
            offsets = range(0, entry.size, step)
            t.leaves.expect(len(offsets))
            for offset in offsets:
                length = min(step, entry.size - offset)
                plain.append(engine.submit(_plain_range, engine, store, t, offset, length, report))
        engine.wait_all(plain)
    except BaseException as exc:
        # As TransferEngine.wait_all: after an interrupt, do not wait for running units.
        for f in chunked + plain:
            f.cancel()
        if isinstance(exc, Exception):
            cf.wait(chunked + plain)
        raise
    engine.wait_all(chunked)
