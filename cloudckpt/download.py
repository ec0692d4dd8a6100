"""Verified downloads of a checkpoint's files into a directory: the one read path every
restore into a directory takes (``restore``, distributed restores, ``get``, ``export``),
as a sink of the one verified-read engine, ``fetch.read_files``.

Every file is created up front (sparse, ``O_EXCL``: nothing is written through what
already exists) and read in ``fetch``'s verification units on the transfer engine's
workers (a chunked file leaf by leaf, each chunk checked against its name; a whole file in
chunk-aligned ranges, hashed as they land), chunked files first. Each unit is written with
``pwrite`` at its offset from a reused buffer (``TransferEngine.buffers``); the worker
that lands a file's last unit checks the file's digest and fsyncs it, so flushing one
file overlaps downloading the others. A file counts only when every leaf matches its
recorded digest.

Memory: at most ``concurrency`` buffers of one range, kept by the engine between
transfers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from cloudckpt.fetch import LEAF, FileJob, Waiter, read_files
from cloudckpt.manifests import FileEntry
from cloudckpt.stores import Store
from cloudckpt.transfer import TransferEngine, aligned_buffer


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


class _Directory:
    """``fetch.Sink`` into files created beforehand: every unit lands in a scratch buffer
    and is written at its offset; a file is fsynced once its digest matched."""

    def __init__(self, targets: Sequence[Path]) -> None:
        self.targets = targets

    def direct(self, job: int, offset: int, length: int) -> memoryview | None:
        return None

    def deliver(self, job: int, offset: int, data: memoryview) -> Waiter | None:
        _write_at(self.targets[job], offset, data)
        return None

    def landed(self, job: int, offset: int, length: int) -> None:
        return None

    def scratch(self, size: int) -> memoryview:
        return aligned_buffer(size)

    def verified(self, job: int) -> None:
        _fsync_path(self.targets[job])


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
    # Chunked files first, then whole ones: the order of requests this path has always had.
    ordered = [e for e in entries if e.chunks is not None]
    ordered += [e for e in entries if e.chunks is None]
    sink = _Directory([create_sized(dest, e.path, e.size) for e in ordered])
    read_files(
        engine,
        store,
        files_prefix,
        [FileJob(e) for e in ordered],
        sink,
        leaf_size=chunk_size,
        buffers=engine.buffers,
        progress=progress,
        verified=sink.verified,
    )
