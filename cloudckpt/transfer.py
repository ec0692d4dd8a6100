"""The transfer engine: parallel multipart uploads, and the workers ranged downloads run on.

Uploads: each file above ``multipart_threshold`` goes up in parts sized from the file size
within S3's limits (5 MiB..5 GiB, at most 10,000 parts), always a multiple of the 8 MiB
digest chunk. Workers read their part with ``preadv`` (no shared file position) into a
reused, page-aligned buffer (a fresh 8 MiB ``bytes`` per part cost more CPU in page faults
than the copy itself: 0.7 against 0.04 CPU-s per GiB; a ``bytearray``'s memory is not
cache-line aligned: ``aligned_buffer``; docs/performance.md), 1 MiB at a time, each block
hashed and CRC'd right after it is read, while it is still in cache
(``reading_digested``; a chunked file's leaves, ``cloudckpt.chunks``, are read the same way
into the same buffers: ``reading_hashed``), or take a ``MemoryFile``'s part as a view of its memory (no copy
at all) and compute the part's digest leaves and its CRC32C in one pass; then upload it
(one ``sendall``, no copy) with the CRC32C the store verifies. A part of exactly one chunk (``part_size=8 * MiB``) has its leaf registered as its SHA-256 (``digest.known_sha256``): a store that signs
payloads (S3 over plain HTTP) uses it instead of hashing the bytes a second time.

Downloads: the workers, the retry policy and the short-read rule (``read_exact``) every
verified read uses; the downloads themselves are ``cloudckpt.download`` (into a directory)
and ``cloudckpt.fetch`` (into memory).

Memory in flight is bounded by ``concurrency x part_size`` (uploads) and ``concurrency x
range_size`` (downloads). Buffers are kept between transfers (``BufferPool``: fresh memory
costs a page fault per 4 KiB on first touch); ``close()`` frees them.

Retries: transient errors and checksum mismatches are retried with backoff; part uploads
and fresh-prefix puts are idempotent, so a lost answer is retried too.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Generic, TypeVar

from cloudckpt import digest
from cloudckpt.errors import (
    CloudCkptError,
    ObjectNotFoundError,
    StagingError,
    TransientStoreError,
)
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.manifests import FileEntry
from cloudckpt.retry import IDEMPOTENT_RETRY, SAFE_TO_RETRY, call_with_retries
from cloudckpt.stores import OVERWRITE, MultipartUpload, PartInfo, Store
from cloudckpt.stores.base import crc32c_text

MiB = 1024 * 1024
ProgressCallback = Callable[[int], None]


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """Tuning for the transfer engine. The defaults suit a VM talking to S3/GCS.

    ``concurrency``: parallel requests (and buffers in flight).
    ``part_size``: preferred multipart part size; raised when a file would need more parts
    than the store allows. ``multipart_threshold``: files at least this big go multipart.
    ``range_size``: download range size. All sizes are rounded up to the 8 MiB chunk.
    Parts of 32 MiB (four chunks): botocore spends about a millisecond of CPU per request
    whatever its size, and parts of one chunk cost 0.25-0.4 more client CPU-seconds per
    GiB uploaded than parts of four (docs/performance.md, "Upload client CPU"); the price
    is up to ``concurrency x 32 MiB`` of part buffers for files (none for ``save_state``).
    With ``sha256-tree`` digests and payload signing, one chunk per part (``8 * MiB``) lets
    the store sign with the chunk's digest instead of hashing the part again.
    """

    concurrency: int = 16
    part_size: int = 32 * MiB
    multipart_threshold: int = 16 * MiB
    range_size: int = 16 * MiB
    attempts: int = 6

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")


def read_exact(
    retry: Callable[[Callable[[], int], str], int],
    store: Store,
    key: str,
    start: int,
    view: memoryview,
) -> int:
    """Read ``len(view)`` bytes of ``key`` from ``start`` into ``view`` (the store's
    ``get_range_into``) with ``retry``; return how many arrived. Callers ask
    for bytes a manifest says exist, so a short answer is read again, within the same
    retry budget: a response cut short that the store did not notice is not a short
    object. Only an answer short every time, of an object whose stored size (HEAD) ends
    before the range, comes back short (the caller then judges the object damaged).
    Raises StoreError (ObjectNotFoundError, TransientStoreError once the retries are
    spent, or when the object holds the bytes every answer cut short)."""
    short: list[int | None] = [None]  # the last try's count, if it came back short

    def once() -> int:
        short[0] = None
        got = store.get_range_into(key, start, view)
        if got < len(view):
            short[0] = got
            raise TransientStoreError(f"{store.url}{key}: {got} of {len(view)} bytes")
        return got

    try:
        return int(retry(once, f"download {key}"))
    except TransientStoreError:
        if short[0] is None:
            raise
        got = short[0]
    # Short every time. Judge the object, not the answers: only an object whose stored size
    # ends before this range is short; one that holds the bytes had its answers cut.
    size = int(retry(lambda: store.head(key).size, f"stat {key}"))
    if size >= start + len(view):
        raise TransientStoreError(
            f"{store.url}{key}: every answer held {got} of the {len(view)} bytes asked for, "
            f"although the object holds {size}: the store or a proxy cut the answers short"
        )
    return got


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def choose_part_size(size: int, store: Store, preferred: int) -> int:
    """A part size for a ``size``-byte file: a multiple of the digest chunk, at least the
    store's minimum, and large enough to stay within its part-count limit."""
    caps = store.capabilities
    part = max(preferred, caps.min_part_size, -(-size // caps.max_parts))
    part = round_up(part, digest.CHUNK_SIZE)
    if part > caps.max_part_size:
        raise StagingError(
            f"a {size}-byte file needs parts over the store's {caps.max_part_size}-byte limit",
            hint="Split the file; S3 objects are limited to 5 TiB",
        )
    return part


@dataclasses.dataclass(frozen=True)
class _Stat:
    size: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, path: Path) -> _Stat:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


class Progress:
    """A progress callback for parallel workers: called under a lock, never with 0."""

    def __init__(self, callback: ProgressCallback | None) -> None:
        self._callback = callback
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        if self._callback is not None and n:
            with self._lock:
                self._callback(n)


B = TypeVar("B", bytearray, memoryview)
T = TypeVar("T")


class BufferPool(Generic[B]):
    """Buffers reused across reads, parts and transfers (fresh memory costs a page fault
    per 4 KiB on first touch): the one pool uploads, downloads and verified reads into
    memory take their buffers from. ``make(size)`` makes a new one (pinned host memory
    for a GPU); at most ``keep`` are kept (None: every one given back)."""

    def __init__(self, make: Callable[[int], B], keep: int | None = None) -> None:
        self._make: Callable[[int], B] = make
        self._keep = keep
        self._free: list[B] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> B:
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if len(self._free[i]) == size:
                    return self._free.pop(i)
        return self._make(size)

    def give(self, buf: B) -> None:
        with self._lock:
            if self._keep is None or len(self._free) < self._keep:
                self._free.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def _open_staged(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise StagingError(f"cannot read staged file {path}: {exc.strerror}") from None


def pread_full(fd: int, path: Path, offset: int, buf: memoryview) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``. Raises StagingError (the file is shorter)."""
    got = 0
    while got < len(buf):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buf[got:]], offset + got)
        else:  # (platforms without preadv: one copy more)
            chunk = os.pread(fd, len(buf) - got, offset + got)
            n = len(chunk)
            buf[got : got + n] = chunk
        if not n:
            raise StagingError(f"staged file {path} shrank while it was being uploaded")
        got += n


def aligned_buffer(size: int) -> memoryview:
    """``size`` bytes of fresh page-aligned memory (anonymous ``mmap``), writable: the
    upload's part buffers and the restore's read and scratch buffers. A large
    ``bytearray`` starts 16 bytes into its page (malloc's header), so every 64-byte load of
    BLAKE3, CRC32C and the copies into and out of the buffer spans two cache lines: a part
    read, digested and sent from one costs 0.05-0.1 CPU-s per GiB more, a kept copy read
    and hashed 0.1 (docs/performance.md, "Upload client CPU", "Restore buffers"). The
    memory lives as long as the view (or a view of it). Raises MemoryError (ENOMEM)."""
    if size <= 0:
        return memoryview(bytearray(0))
    # Private anonymous memory (not shmem): a forked worker (a DataLoader's) gets
    # copy-on-write pages, not shared ones, and transparent huge pages apply.
    flags = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
    try:
        return memoryview(mmap.mmap(-1, size, **flags))
    except OSError as exc:  # ENOMEM: say so, not "staged file unreadable"
        raise MemoryError(f"cannot map a {size}-byte buffer: {exc.strerror}") from exc


def read_into(path: Path, offset: int, buf: memoryview) -> None:
    """Fill ``buf`` with the bytes of ``path`` at ``offset`` (``preadv``: no new object).

    Raises StagingError when the file cannot be opened or is shorter than the range."""
    fd = _open_staged(path)
    try:
        pread_full(fd, path, offset, buf)
    finally:
        os.close(fd)


def read_at(path: Path, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset``; each worker opens its own descriptor, so thousands
    of files never hold thousands of descriptors open."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise StagingError(f"cannot read staged file {path}: {exc.strerror}") from None
    try:
        chunks, got = [], 0
        while got < length:
            chunk = os.pread(fd, length - got, offset + got)
            if not chunk:
                raise StagingError(f"staged file {path} shrank while it was being uploaded")
            chunks.append(chunk)
            got += len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


class MemoryFile:
    """A file to upload straight from memory: the concatenation of ``segments`` (bytes or
    C-contiguous buffers the caller keeps unchanged until the upload returns), e.g. a
    safetensors header followed by host buffers. Parts are cut across segments; a part
    inside one segment is a view of it (no copy), one that spans segments is joined.

    ``ready(end)``, when given, is called before bytes up to file offset ``end`` are read
    (by ``view``, ``read`` and ``write_to``): it blocks until they are in memory, or raises
    (``save_state`` uploads parts while later tensors are still being copied from the GPU).
    """

    def __init__(
        self,
        segments: Sequence[bytes | memoryview],
        ready: Callable[[int], None] | None = None,
    ) -> None:
        self.segments = [memoryview(s).cast("B") for s in segments if len(s)]
        self.starts: list[int] = []
        pos = 0
        for seg in self.segments:
            self.starts.append(pos)
            pos += len(seg)
        self.size = pos
        self._ready = ready

    def view(self, offset: int, length: int) -> memoryview:
        """The bytes at ``offset`` (a read-only view of the caller's memory when they lie in
        one segment, else a joined copy); waits for ``ready`` first."""
        end = offset + length
        if self._ready is not None:
            self._ready(end)
        out = []
        for start, seg in zip(self.starts, self.segments, strict=True):
            lo, hi = max(offset, start), min(end, start + len(seg))
            if lo < hi:
                out.append(seg[lo - start : hi - start])
        if len(out) == 1:
            return out[0].toreadonly()
        return memoryview(b"".join(out))

    def read(self, offset: int, length: int) -> bytes:
        """The bytes at ``offset`` as a new ``bytes`` object."""
        return self.view(offset, length).tobytes()

    def write_to(self, fd: int, cancelled: threading.Event | None = None) -> bool:
        """Write the whole file at ``fd``'s position; False if ``cancelled`` stopped it."""
        piece = 64 * MiB
        for start, seg in zip(self.starts, self.segments, strict=True):
            for i in range(0, len(seg), piece):
                if cancelled is not None and cancelled.is_set():
                    return False
                view = seg[i : i + piece]
                if self._ready is not None:
                    self._ready(start + i + len(view))
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
        return True


class TransferEngine:
    """A pool of transfer workers shared by the saves and restores of one manager."""

    def __init__(
        self, config: TransferConfig | None = None, *, executor: cf.Executor | None = None
    ) -> None:
        """``executor``: the workers (default: ``config.concurrency`` threads); the
        simulation passes one that runs each call at once."""
        self.config = config or TransferConfig()
        self._pool: cf.Executor = executor or cf.ThreadPoolExecutor(
            self.config.concurrency, thread_name_prefix="cloudckpt-transfer"
        )
        # Read buffers (cloudckpt.download, fetch.verify_files), kept between transfers:
        # page-aligned too (a kept copy read into them is hashed while hot, ``fetch``).
        self.buffers = BufferPool(aligned_buffer, self.config.concurrency)
        # Part buffers (uploads): page-aligned (``aligned_buffer``).
        self._part_buffers = BufferPool(aligned_buffer, self.config.concurrency)

    def close(self, *, wait: bool = True, timeout: float | None = None) -> bool:
        """Stop the workers; with ``wait=False`` do not wait for the ones still running,
        with ``timeout`` wait at most that long. Returns whether none still runs."""
        left: list[threading.Thread] = []
        if timeout is None or not wait:
            self._pool.shutdown(wait=wait, cancel_futures=True)
        else:
            self._pool.shutdown(wait=False, cancel_futures=True)
            deadline = time.monotonic() + timeout
            for thread in list(getattr(self._pool, "_threads", ())):  # a ThreadPoolExecutor's
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    left.append(thread)
        self.buffers.clear()
        self._part_buffers.clear()
        return not left

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Leaving on an interrupt (Ctrl-C, SIGTERM): see _wait_all for why running
        # transfers are not waited for.
        interrupted = exc_type is not None and not issubclass(exc_type, Exception)
        self.close(wait=not interrupted)

    # -- for other layers (cloudckpt.chunks): the same workers and retry policy ---------

    def submit(self, fn: Callable, /, *args: object) -> cf.Future:
        """Run ``fn(*args)`` on a transfer worker."""
        return self._pool.submit(fn, *args)

    def wait_all(self, futures: Sequence[cf.Future]) -> list:
        """Results in order; on the first failure cancel the rest and raise it."""
        return self._wait_all(futures)

    def retry(self, fn: Callable, what: str, idempotent: bool = True):
        """Call ``fn`` with this engine's retry policy for store calls."""
        return self._retry(fn, what, idempotent)

    def read_exact(self, store: Store, key: str, start: int, view: memoryview) -> int:
        """``read_exact`` with this engine's retries."""
        return read_exact(self._retry, store, key, start, view)

    @contextlib.contextmanager
    def reading(self, source: Path | MemoryFile, offset: int, length: int) -> Iterator[memoryview]:
        """The ``length`` bytes of ``source`` at ``offset``, for the block's duration: a view
        of a ``MemoryFile``'s memory, or a reused buffer filled by ``preadv`` (given back
        afterwards: nothing may keep the view). Raises StagingError (unreadable file)."""
        if isinstance(source, MemoryFile):
            yield source.view(offset, length)
            return
        size = max(length, self.config.part_size)
        buf = self._part_buffers.take(round_up(size, digest.CHUNK_SIZE))
        view = memoryview(buf)[:length]
        try:
            read_into(source, offset, view)
            yield view
        finally:
            view.release()
            self._part_buffers.give(buf)

    @contextlib.contextmanager
    def reading_hashed(
        self,
        source: Path | MemoryFile,
        offset: int,
        length: int,
        hash_pass: Callable[[memoryview, digest.Reader | None], T],
    ) -> Iterator[tuple[memoryview, T]]:
        """``reading(source, offset, length)`` with what ``hash_pass(view, read)`` returns,
        computed as the view is filled: a file's range is read into the reused buffer by
        ``read(block, at)`` a block at a time (``digest.blocks_as_read``), each block hashed
        while it is still in cache; a ``MemoryFile``'s view already holds its bytes (``read``
        is None). What ``hash_pass`` returns is of exactly the bytes in the view, which is
        what is sent. Raises StagingError, and what ``hash_pass`` raises."""
        if isinstance(source, MemoryFile):
            view = source.view(offset, length)
            yield view, hash_pass(view, None)
            return
        size = max(length, self.config.part_size)
        buf = self._part_buffers.take(round_up(size, digest.CHUNK_SIZE))
        view = memoryview(buf)[:length]
        try:
            fd = _open_staged(source)
            try:
                value = hash_pass(
                    view, lambda block, at: pread_full(fd, source, offset + at, block)
                )
            finally:
                os.close(fd)
            yield view, value
        finally:
            view.release()
            self._part_buffers.give(buf)

    @contextlib.contextmanager
    def reading_digested(
        self, source: Path | MemoryFile, offset: int, length: int
    ) -> Iterator[tuple[memoryview, list[bytes], int]]:
        """``reading_hashed`` with the digest leaves and the CRC32C of the bytes
        (``digest.leaves_and_crc32c_as_read``): a whole file's part."""
        with self.reading_hashed(
            source, offset, length, lambda view, read: digest.leaves_and_crc32c_as_read(view, read)
        ) as (view, (leaves, crc)):
            yield view, leaves, crc

    # -- helpers ------------------------------------------------------------------------

    def _retry(self, fn: Callable, what: str, idempotent: bool = True):
        return call_with_retries(
            fn,
            retry_on=IDEMPOTENT_RETRY if idempotent else SAFE_TO_RETRY,
            attempts=self.config.attempts,
            what=what,
        )

    def _wait_all(self, futures: Sequence[cf.Future]) -> list:
        """Results in order; on the first failure cancel the rest and raise it.

        After a failure the tasks already running are waited for, so the caller's cleanup
        comes after them. After an interrupt (Ctrl-C, SIGTERM: not an ``Exception``) they
        are not: one blocked on a stalled connection would hold the interrupt for minutes.
        Left running, they can only write into files that already exist (downloads open
        their targets without ``O_CREAT``) or send parts of an upload nothing will commit."""
        try:
            for f in cf.as_completed(futures):
                f.result()
        except BaseException as exc:
            for f in futures:
                f.cancel()
            if isinstance(exc, Exception):
                cf.wait(futures)
            raise
        return [f.result() for f in futures]

    # -- upload -------------------------------------------------------------------------

    def upload_files(
        self,
        store: Store,
        prefix: str,
        files: Sequence[tuple[str, Path | MemoryFile]],
        progress: ProgressCallback | None = None,
    ) -> list[FileEntry]:
        """Upload ``files`` (relative path, local path or ``MemoryFile``) under ``prefix``;
        return their manifest entries (size and digest of exactly the bytes uploaded).

        Raises:
            StagingError: a local file is unreadable or changed during the upload.
            StoreError: the store failed after retries.
        """
        report = Progress(progress)
        jobs: list[_FileUpload] = []
        try:
            for rel, path in files:
                jobs.append(self._start_file(store, prefix + rel, rel, path, report))
            return [job() for job in jobs]
        except BaseException:
            for job in jobs:
                job.abort()
            raise

    def _start_file(
        self, store: Store, key: str, rel: str, path: Path | MemoryFile, report: Progress
    ) -> _FileUpload:
        try:
            before = _Stat(path.size, 0, 0) if isinstance(path, MemoryFile) else _Stat.of(path)
        except OSError as exc:
            raise StagingError(f"cannot read staged file {path}: {exc.strerror}") from None
        multipart = store.capabilities.multipart and before.size >= self.config.multipart_threshold
        upload = _FileUpload(self, store, key, rel, path, before, report)
        upload.start(multipart)
        return upload


class _FileUpload:
    """One file's upload: single put, or multipart with one pool task per part."""

    def __init__(
        self,
        engine: TransferEngine,
        store: Store,
        key: str,
        rel: str,
        path: Path | MemoryFile,
        before: _Stat,
        report: Progress,
    ) -> None:
        self.engine, self.store, self.key, self.rel, self.path = engine, store, key, rel, path
        self.before, self.report = before, report
        self.upload: MultipartUpload | None = None
        self.futures: list[cf.Future] = []
        self.part_size = 0

    def start(self, multipart: bool) -> None:
        pool = self.engine._pool
        if not multipart:
            self.futures = [pool.submit(self._single)]
            return
        self.part_size = choose_part_size(
            self.before.size, self.store, self.engine.config.part_size
        )
        upload = self.engine._retry(
            lambda: self.store.create_multipart(self.key), f"start upload of {self.key}", False
        )
        self.upload = upload
        self.futures = [
            pool.submit(self._part, upload, n, offset)
            for n, offset in enumerate(range(0, self.before.size, self.part_size), start=1)
        ]

    def _single(self) -> tuple[list[bytes], None]:
        with self.engine.reading_digested(self.path, 0, self.before.size) as (data, leaves, crc):
            known = digest.known_leaf(data, leaves[0]) if len(leaves) == 1 else nullcontext()
            with known, digest.known_crc32c(data, crc):
                self.engine._retry(
                    lambda: self.store.put(self.key, data, mode=OVERWRITE), f"upload {self.key}"
                )
        self.report(self.before.size)
        return leaves, None

    def _part(
        self, upload: MultipartUpload, number: int, offset: int
    ) -> tuple[list[bytes], PartInfo]:
        length = min(self.part_size, self.before.size - offset)
        # One pass over the part: read, digest leaves and CRC32C, block by block.
        with self.engine.reading_digested(self.path, offset, length) as (data, leaves, crc_value):
            crc = crc32c_text(crc_value)
            # A one-chunk SHA-256 part's leaf is its SHA-256: a payload-signing store reuses it.
            known = digest.known_leaf(data, leaves[0]) if len(leaves) == 1 else nullcontext()
            with known:
                part = self.engine._retry(
                    lambda: self.store.upload_part(upload, number, data, crc32c=crc),
                    f"upload part {number} of {self.key}",
                )
        failpoint("save.after_part")
        self.report(length)
        return leaves, part

    def __call__(self) -> FileEntry:
        """Wait for the parts, complete the upload, and return the manifest entry."""
        try:
            results = self.engine._wait_all(self.futures)
            leaves = [leaf for part_leaves, _ in results for leaf in part_leaves]
            if self.upload is not None:
                self._complete(self.upload, [part for _, part in results])
            if isinstance(self.path, MemoryFile):
                return FileEntry(self.rel, self.before.size, digest.root(leaves, self.before.size))
            after = _Stat.of(self.path)
        except OSError as exc:
            raise StagingError(f"staged file {self.path} became unreadable: {exc}") from None
        if after != self.before:
            raise StagingError(f"staged file {self.path} changed while it was being uploaded")
        return FileEntry(self.rel, self.before.size, digest.root(leaves, self.before.size))

    def _complete(self, upload: MultipartUpload, parts: list[PartInfo]) -> None:
        try:
            self.engine._retry(
                lambda: self.store.complete_multipart(upload, parts, mode=OVERWRITE),
                f"complete upload of {self.key}",
            )
        except ObjectNotFoundError:
            # A retried completion finds the upload gone when the first one landed.
            if self.store.head(self.key).size != self.before.size:
                raise
        self.upload = None

    def abort(self) -> None:
        """Best effort: cancel pending parts and abort the multipart upload."""
        for f in self.futures:
            f.cancel()
        cf.wait(self.futures)
        if self.upload is not None:
            # Best effort: GC removes incomplete uploads after the grace period anyway.
            with contextlib.suppress(CloudCkptError):
                self.store.abort_multipart(self.upload)
