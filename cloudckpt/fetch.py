"""The one verified-read engine: every read of a checkpoint's files (docs/design.md §7).

``read_files`` lands byte ranges of a checkpoint's files where a ``Sink`` wants them (the
memory of freshly allocated tensors, pinned staging slots on their way to a GPU, the
buffers of a DCP plan's items, files of a directory: ``cloudckpt.download``, or nowhere:
``verify_files``), and checks every byte before the caller may use any of it:

- The unit of work is a **verification unit**: for a chunked file, one 8 MiB digest leaf
  (its chunks, each checked against its SHA-256 as it lands); for a whole file, one
  chunk-aligned range (its leaf digests computed as it lands; the file's digest, from the
  leaf digests, is checked when its last range lands). Units run in parallel on the
  transfer engine's workers, so hashing one unit overlaps the transfer of the others.
- A unit whose bytes have one destination is read straight into it (``get_range_into``
  where the store offers it: from the socket into the tensor). A unit that spans several
  destinations (small tensors packed together, a header and a tensor) or none (bytes a
  partial read needs only to check a digest) lands in a reused scratch buffer and is
  handed to the sink (``Sink.deliver``), which copies out what it wants.
- A partial read (``FileJob.ranges``: a DCP rank's plan) of a chunked file whose leaves
  are each one chunk fetches only the chunks it needs: the file's digest is checked from
  the manifest's chunk list up front, and each chunk against its name as it lands. Any
  other file is read whole (its digest needs every leaf), and only the wanted bytes are
  kept.
- A local copy (``FileJob.local``: the staged copy of a committed checkpoint,
  ``cloudckpt.localcopy``) is read first, at local-disk speed, with the same checks; what
  does not verify (a chunk, or a whole file without chunks) is then read from the store.
  It is read on one worker per core (``_local_units``), ``HOT_PIECE`` bytes at a time,
  each piece hashed as soon as it landed, while it is still in cache.

Hashing: each unit is hashed by the worker that landed it, on that one thread, when the
read has at least as many units as the machine has cores (the workers are the
parallelism: handing each 8 MiB leaf to BLAKE3's own thread pool as well cost ~10% more
CPU and no time, docs/performance.md); a read of fewer units hashes each on several cores.

Memory: besides the destinations, ``concurrency`` scratch buffers of at most one range
(16 MiB by default) each. Nothing here allocates per byte of the checkpoint.

Order: the store's units are requested job by job, each job's in file order; the failpoint
``restore.after_range`` is hit once a unit (a leaf, a range) landed intact.

Errors: a missing or damaged object raises ``CorruptionError`` (``MissingChunkError`` for
a chunk; a chunk that came back short or wrong is read once more first: a damaged answer
is not a damaged object): the caller treats the checkpoint as damaged
(``reader.first_intact`` falls back to an older one). Network failures raise
``StoreError``: never damage. Deliveries may repeat (a range read from a local copy that
failed to verify is read again from the store); the last one wins, and nothing is final
before ``read_files`` returns.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from cloudckpt import digest
from cloudckpt.chunks import leaf_groups
from cloudckpt.errors import (
    CorruptionError,
    MissingChunkError,
    ObjectNotFoundError,
    StagingError,
)
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.manifests import ChunkRef, FileEntry
from cloudckpt.stores import Store
from cloudckpt.transfer import (
    BufferPool,
    Progress,
    TransferEngine,
    aligned_buffer,
    pread_full,
    round_up,
)

LEAF = digest.CHUNK_SIZE

#: Returned by ``Sink.deliver`` when the sink still reads the scratch buffer it was handed
#: (an asynchronous copy to a GPU): called before the buffer is reused.
Waiter = Callable[[], None]


class Sink(Protocol):
    """Where the bytes of ``read_files`` go. ``job`` is the index of the ``FileJob``."""

    def direct(self, job: int, offset: int, length: int) -> memoryview | None:
        """A writable byte view of exactly ``length`` bytes to land file bytes
        ``[offset, offset + length)`` in, or None (they then go through ``deliver``)."""

    def deliver(self, job: int, offset: int, data: memoryview) -> Waiter | None:
        """File bytes ``[offset, offset + len(data))`` landed in a scratch buffer: take
        what is wanted. Return a ``Waiter`` if ``data`` is still being read on return."""

    def landed(self, job: int, offset: int, length: int) -> None:
        """Bytes landed through ``direct`` (for sinks that act as data arrives)."""

    def scratch(self, size: int) -> memoryview:
        """A new scratch buffer of ``size`` bytes (pinned host memory for a GPU)."""


@dataclasses.dataclass(frozen=True)
class FileJob:
    """One file to read. ``ranges``: the (offset, length) pieces wanted, or None for the
    whole file. ``local``: a local copy to try first (its bytes are checked like the
    store's)."""

    entry: FileEntry
    ranges: tuple[tuple[int, int], ...] | None = None
    local: Path | None = None


@dataclasses.dataclass
class ReadStats:
    """What a read did and where its time went (wall clock: ``time.perf_counter``)."""

    bytes_from_store: int = 0
    bytes_from_local: int = 0
    bytes_scratch: int = 0  # landed in a scratch buffer and handed over (a copy)
    requests: int = 0  # GETs sent to the store
    local_rejected: int = 0  # units of a local copy that did not verify (read again)
    hash_cpu_s: float = 0.0  # thread CPU time spent hashing, over all workers
    first_request: float | None = None
    last_landed: float | None = None
    finished: float | None = None  # every digest checked
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def _landed(self, nbytes: int, local: bool, scratch: bool, hashed: float) -> None:
        now = time.perf_counter()
        with self._lock:
            if local:
                self.bytes_from_local += nbytes
            else:
                self.bytes_from_store += nbytes
            if scratch:
                self.bytes_scratch += nbytes
            self.hash_cpu_s += hashed
            self.last_landed = now

    def _request(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self.requests += 1
            if self.first_request is None:
                self.first_request = now


@dataclasses.dataclass(frozen=True)
class _Piece:
    offset: int  # in the file
    size: int
    ref: ChunkRef | None  # None: a range of a whole file


@dataclasses.dataclass(frozen=True)
class _Unit:
    job: int
    leaf: int  # index of its first digest leaf
    pieces: tuple[_Piece, ...]


class _NoStore:
    """``verify_local`` reads nothing from a store."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        raise AssertionError("verify_local read from the store")


_NO_STORE: Store = _NoStore()  # type: ignore[assignment]


class _LocalRejected(Exception):
    """A unit of a local copy did not verify: it is read from the store instead."""


class _File(digest.LeafDigests):
    """One job's progress: its leaf digests as units land (``expect``: one piece per
    unit); the unit that completes a whole read checks the file's digest."""

    def __init__(self, job: FileJob, leaf_size: int) -> None:
        super().__init__(job.entry.size, job.entry.digest, leaf_size, job.entry.algorithm)
        self.job, self.entry, self.leaf_size = job, job.entry, leaf_size


# --------------------------------------------------------------------------- planning


def _chunk_leaves(entry: FileEntry) -> list[tuple[_Piece, ...]]:
    """A chunked file's chunks grouped by the digest leaf they lie in
    (``chunks.leaf_groups``), each with its offset in the file."""
    out: list[tuple[_Piece, ...]] = []
    offset = 0
    for group in leaf_groups(entry):
        pieces = []
        for ref in group:
            pieces.append(_Piece(offset, ref.size, ref))
            offset += ref.size
        out.append(tuple(pieces))
    return out


def manifest_root(entry: FileEntry) -> str | None:
    """The digest of a chunked file computed from its manifest alone (every leaf one
    chunk, whose name is the leaf's digest), or None when a leaf is cut into several
    chunks (its digest needs its bytes)."""
    leaves = _chunk_leaves(entry)
    if any(len(g) != 1 for g in leaves):
        return None
    refs = [g[0].ref for g in leaves]
    digests = [bytes.fromhex(r.sha256) for r in refs if r is not None]
    return digest.root(digests, entry.size, LEAF, entry.algorithm)


def _overlaps(pieces: Sequence[_Piece], ranges: Sequence[tuple[int, int]]) -> bool:
    lo, hi = pieces[0].offset, pieces[-1].offset + pieces[-1].size
    return any(off < hi and lo < off + n for off, n in ranges if n > 0)


def plan_units(
    index: int, job: FileJob, leaf_size: int, range_size: int
) -> tuple[list[_Unit], bool]:
    """The units of ``job`` and whether the file's digest must be checked from what lands
    (a whole read); a partial read of a chunked file whose leaves are one chunk each keeps
    only the leaves it needs, its digest checked from the manifest here.

    Raises CorruptionError: the manifest's chunks do not make up the recorded file.
    """
    entry = job.entry
    if entry.chunks is not None:
        leaves = _chunk_leaves(entry)
        units = [_Unit(index, i, g) for i, g in enumerate(leaves)]
        if job.ranges is not None and all(len(g) == 1 for g in leaves):
            if manifest_root(entry) != entry.digest:
                raise CorruptionError(
                    f"{entry.path}: its chunks are not the file its manifest records"
                )
            return [u for u in units if _overlaps(u.pieces, job.ranges)], False
        return units, True
    step = max(leaf_size, range_size // leaf_size * leaf_size)
    units = [
        _Unit(index, off // leaf_size, (_Piece(off, min(step, entry.size - off), None),))
        for off in range(0, entry.size, step)
    ]
    return units, True


# --------------------------------------------------------------------------- reading


class _Reader:
    def __init__(
        self,
        engine: TransferEngine,
        store: Store,
        files_prefix: str,
        jobs: Sequence[FileJob],
        sink: Sink,
        stats: ReadStats,
        leaf_size: int,
        *,
        buffers: BufferPool[memoryview] | None = None,
        progress: Callable[[int], None] | None = None,
        verified: Callable[[int], None] | None = None,
    ) -> None:
        self.engine, self.store, self.prefix, self.sink = engine, store, files_prefix, sink
        self.stats = stats
        self.files = [_File(j, LEAF if j.entry.chunks is not None else leaf_size) for j in jobs]
        range_size = round_up(engine.config.range_size, leaf_size)
        # Scratch buffers: the caller's pool (kept between reads), else reused within one
        # read, made by the sink (pinned for a GPU).
        self.scratch: BufferPool[Any] = buffers if buffers is not None else BufferPool(sink.scratch)
        self.scratch_size = max(range_size, LEAF)
        self.range_size = range_size
        self.threaded = True  # BLAKE3's thread pool per leaf (``hash_on_workers``)
        self.progress = Progress(progress)
        self.verified = verified
        # With ``read_files(damaged=...)``: each damaged job's first failure (by unit), and
        # whether it is the file's digest (every unit landed intact).
        self.damage: dict[int, tuple[int, CorruptionError, bool]] | None = None
        self._lock = threading.Lock()

    def hash_on_workers(self, units: int) -> None:
        """Hash each leaf on its worker's thread alone when ``units`` (the units about to
        run) give every core one (module docstring)."""
        self.threaded = units < (os.cpu_count() or 1)

    # -- one piece --------------------------------------------------------------------

    def _fill(
        self, job: FileJob, index: int, piece: _Piece, view: memoryview, local: bool
    ) -> tuple[list[bytes], float]:
        """Fill ``view`` with the piece's bytes and check them: a chunk against its name
        (``fetch_chunk``), a whole file's range by its leaf digests, returned. Returns
        them (or []) and the thread CPU time spent hashing. Raises as ``fetch_chunk``,
        CorruptionError (missing, short), _LocalRejected (``local``), StoreError."""
        ref, hashed = piece.ref, [0.0]

        def check(data: memoryview, ref: ChunkRef) -> bool:
            started = time.thread_time()
            ok = _chunk_ok(data, ref, self.threaded)
            hashed[0] += time.thread_time() - started
            return ok

        if local:
            assert job.local is not None
            f = self.files[index]
            algorithm = ref.algorithm if ref is not None else f.entry.algorithm
            # A chunk is one leaf of its own (its name); a whole file's range is cut into
            # the file's leaves.
            leaf_size = max(piece.size, 1) if ref is not None else f.leaf_size
            leaves, hash_s = _pread_leaves(
                job.local, piece.offset, view, leaf_size, algorithm, self.threaded
            )
            if leaves is None or (ref is not None and not _named(leaves, view, ref)):
                raise _LocalRejected
            return ([] if ref is not None else leaves), hash_s
        if ref is not None:
            fetch_chunk(self.engine, self.store, ref, view, check, self.stats._request)
        else:
            self.stats._request()
            key = self.prefix + job.entry.path
            read_range(self.engine, self.store, key, piece.offset, view, job.entry.size)
        if ref is not None:
            return [], hashed[0]
        started, f = time.thread_time(), self.files[index]
        leaves = digest.leaves_of(view, f.leaf_size, f.entry.algorithm, threaded=self.threaded)
        return leaves, time.thread_time() - started

    def _land(
        self, job: FileJob, index: int, piece: _Piece, local: bool, leaf: digest.Hasher | None
    ) -> list[bytes]:
        """Read one piece to where the sink wants it, check it (``_fill``), and return its
        leaf digests (a whole file's range) or []."""
        view = self.sink.direct(index, piece.offset, piece.size)
        scratch = None
        if view is None:
            scratch = self.scratch.take(self.scratch_size)
            view = memoryview(scratch)[: piece.size]
        try:
            leaves, hashed = self._fill(job, index, piece, view, local)
            if leaf is not None:
                started = time.thread_time()
                leaf.update(view)
                hashed += time.thread_time() - started
            self.stats._landed(piece.size, local, scratch is not None, hashed)
            if scratch is None:
                self.sink.landed(index, piece.offset, piece.size)
            else:
                wait = self.sink.deliver(index, piece.offset, view)
                if wait is not None:
                    wait()
        finally:
            if scratch is not None:
                self.scratch.give(scratch)
        return leaves

    # -- one unit ---------------------------------------------------------------------

    def run_unit(self, unit: _Unit, local: bool, check_root: bool) -> None:
        """Land every piece of ``unit``; record its leaf digests; the unit that completes
        a whole read checks the file's digest (``file_done``). Raises as ``_land``,
        CorruptionError (the file's digest), _LocalRejected."""
        f = self.files[unit.job]
        pieces = unit.pieces
        multi = pieces[0].ref is not None and len(pieces) > 1
        leaf = digest.hasher(f.entry.algorithm, LEAF if self.threaded else 0) if multi else None
        leaves: list[bytes] = []
        for piece in pieces:
            leaves += self._land(f.job, unit.job, piece, local, leaf)
        failpoint("restore.after_range")  # once a unit (a leaf, a range) landed intact
        if not local:
            self.progress(sum(p.size for p in pieces))
        if pieces[0].ref is not None:
            leaves = [leaf.digest() if leaf is not None else bytes.fromhex(pieces[0].ref.sha256)]
        if f.add(unit.leaf, leaves) and check_root:
            self.file_done(unit.job, local)

    def run_checked(self, unit: _Unit, check_root: bool) -> None:
        """``run_unit`` from the store (a unit without pieces: check the digest of an empty
        file); where damage is collected (``self.damage``), a CorruptionError is recorded
        for its job instead of raised."""
        try:
            if unit.pieces:
                self.run_unit(unit, False, check_root)
            else:
                self.file_done(unit.job)
        except CorruptionError as exc:
            if self.damage is None:
                raise
            whole = self.files[unit.job].missing == 0  # a failed unit is never added
            with self._lock:
                first = self.damage.get(unit.job)
                if first is None or unit.leaf < first[0]:
                    self.damage[unit.job] = (unit.leaf, exc, whole)

    def file_done(self, index: int, local: bool = False) -> None:
        """Every leaf of job ``index`` (read whole) is in: check the file's digest, then
        tell the caller (``verified``: a directory fsyncs the file). Raises
        CorruptionError, _LocalRejected (``local``)."""
        f = self.files[index]
        if not f.root_ok():
            if local:
                raise _LocalRejected
            if f.entry.chunks is None:
                raise CorruptionError(f"{self.prefix}{f.entry.path} does not match its digest")
            raise CorruptionError(
                f"{f.entry.path} does not match its digest: its chunks are intact but do "
                "not make up the file the manifest records"
            )
        if self.verified is not None:
            self.verified(index)


def _chunk_ok(data: memoryview, ref: ChunkRef, threaded: bool = True) -> bool:
    """Whether ``data`` is the chunk ``ref`` names (its leaf digest)."""
    return digest.hexleaf(data, ref.algorithm, threaded=threaded) == ref.sha256


def read_range(
    engine: TransferEngine, store: Store, key: str, offset: int, view: memoryview, size: int
) -> None:
    """Fill ``view`` with the bytes at ``offset`` of ``key``, a file stored whole whose
    manifest records ``size`` bytes (a short answer is read again:
    ``TransferEngine.read_exact``). Raises CorruptionError (the object is missing or
    shorter), StoreError."""
    try:
        got = engine.read_exact(store, key, offset, view)
    except ObjectNotFoundError:
        raise CorruptionError(f"{key} is missing from the store") from None
    if got != len(view):
        raise CorruptionError(f"{key} is shorter than the {size} bytes its manifest records")


def fetch_chunk(
    engine: TransferEngine,
    store: Store,
    ref: ChunkRef,
    into: memoryview | None = None,
    check: Callable[[memoryview, ChunkRef], bool] | None = None,
    requested: Callable[[], None] | None = None,
) -> memoryview:
    """A chunk's bytes (read into ``into``, at least ``ref.size`` long, or a new buffer),
    verified against its name (``check``, default ``_chunk_ok``): the one chunk read of
    every reader (this engine, ``cp``, the distributed fan-out). A short answer is read
    again (``TransferEngine.read_exact``), and a short or wrong chunk once more: a
    damaged response is not a damaged object. ``requested()``: called per GET.

    Raises MissingChunkError (missing, or wrong twice), StoreError."""
    view = (into if into is not None else memoryview(bytearray(ref.size)))[: ref.size]
    for _ in range(2):
        if requested is not None:
            requested()
        try:
            got = engine.read_exact(store, ref.key, 0, view)
        except ObjectNotFoundError:
            raise MissingChunkError(f"chunk {ref.key} is missing from the store") from None
        if got == ref.size and (check(view, ref) if check is not None else _chunk_ok(view, ref)):
            return view
    raise MissingChunkError(f"chunk {ref.key} does not match its digest")


#: A local copy is read this much at a time, each piece hashed right after it landed,
#: while it (and the page-cache bytes it was copied from) are still in the core's L2 (1
#: MiB on the benchmark's EPYC): hashing a whole 8 MiB leaf after it was read finds most
#: of it evicted (docs/performance.md, "hashing while hot").
HOT_PIECE = 512 * 1024
#: Workers that read local copies at least (more, one per core, on larger machines): a
#: copy not in the page cache still gets a few reads in flight.
LOCAL_WORKERS_MIN = 4


def _pread_leaves(
    path: Path, offset: int, view: memoryview, leaf_size: int, algorithm: str | None, threaded: bool
) -> tuple[list[bytes] | None, float]:
    """Fill ``view`` from ``path`` at ``offset``, ``HOT_PIECE`` bytes at a time, each piece
    hashed as soon as it landed. Returns the leaf digests of ``view`` (a leaf every
    ``leaf_size`` bytes from its start; None if the file is missing, unreadable or
    short) and the thread CPU time spent hashing. ``threaded``: BLAKE3 on several cores
    (``_Reader.hash_on_workers``)."""
    hashed = 0.0
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None, hashed
    try:
        leaves = []
        for lo in range(0, len(view), leaf_size):
            hi = min(lo + leaf_size, len(view))
            h = digest.hasher(algorithm, hi - lo if threaded else 0)
            # Several threads hash each leaf (few units): it is read whole, then hashed.
            step = hi - lo if threaded else HOT_PIECE
            for at in range(lo, hi, step):
                part = view[at : min(at + step, hi)]
                pread_full(fd, path, offset + at, part)
                started = time.thread_time()
                h.update(part)
                hashed += time.thread_time() - started
            leaves.append(h.digest())
        return leaves, hashed
    except (StagingError, OSError):  # short, or unreadable
        return None, hashed
    finally:
        os.close(fd)


def _named(leaves: list[bytes], data: memoryview, ref: ChunkRef) -> bool:
    """Whether a chunk whose bytes ``data`` hashed to ``leaves`` (one leaf; none for an
    empty chunk) is the chunk ``ref`` names."""
    got = leaves[0] if leaves else digest.leaf(data, ref.algorithm)
    return got.hex() == ref.sha256


def read_files(
    engine: TransferEngine,
    store: Store,
    files_prefix: str,
    jobs: Sequence[FileJob],
    sink: Sink,
    *,
    leaf_size: int = LEAF,
    stats: ReadStats | None = None,
    buffers: BufferPool[memoryview] | None = None,
    progress: Callable[[int], None] | None = None,
    verified: Callable[[int], None] | None = None,
    damaged: Callable[[int, CorruptionError, bool], None] | None = None,
) -> ReadStats:
    """Read ``jobs`` (validated manifest entries of the checkpoint whose whole files lie
    under ``files_prefix``) into ``sink``, every byte checked (module docstring): local
    copies first, then the store for everything else and for whatever a local copy failed
    to verify. ``leaf_size``: the manifest's ``chunk_size``. ``buffers``: where scratch
    buffers come from (default: ``sink.scratch``, reused within this read);
    ``progress(n)``: n more bytes landed from the store, verified; ``verified(job)``: a
    job read whole matched its digest (called once, by the worker that checked it);
    ``damaged(job, error, digest)``: when given, damage does not stop the read: it is
    reported once per damaged job (its first unit's error; ``digest``: every piece was
    intact but the file's digest is not the recorded one), in job order, once every unit
    ran.

    The store's units are requested in job order (for each job: its leaves or ranges in
    order); if several fail, a whole file's failure is raised before a chunk's.

    Raises:
        CorruptionError: a file or chunk is missing, short, or does not match its digest
            (MissingChunkError for a chunk); the checkpoint is damaged.
        StoreError: the store failed after retries (not damage).
        Whatever ``sink`` or ``verified`` raise (OSError for a directory).
    """
    stats = stats if stats is not None else ReadStats()
    reader = _Reader(
        engine,
        store,
        files_prefix,
        jobs,
        sink,
        stats,
        leaf_size,
        buffers=buffers,
        progress=progress,
        verified=verified,
    )
    reader.damage = {} if damaged is not None else None
    planned = [
        plan_units(i, j, reader.files[i].leaf_size, reader.range_size) for i, j in enumerate(jobs)
    ]
    # Local copies are read only whole (a partial read has no local tier).
    local = {
        i for i, j in enumerate(jobs) if j.local is not None and planned[i][1] and planned[i][0]
    }
    todo = [u for i, (units, _) in enumerate(planned) if i not in local for u in units]
    reader.hash_on_workers(sum(len(planned[i][0]) for i in local))
    todo += _run_local(reader, planned, sorted(local))
    reader.hash_on_workers(len(todo))
    try:
        _from_store(reader, planned, todo)
    finally:
        stats.finished = time.perf_counter()
    for i, (_, exc, whole) in sorted((reader.damage or {}).items()):
        assert damaged is not None
        damaged(i, exc, whole)
    return stats


def _from_store(
    reader: _Reader, planned: list[tuple[list[_Unit], bool]], todo: list[_Unit]
) -> None:
    """Run ``todo`` on the engine's workers, job by job (a whole file without any byte
    checked in its turn); wait for the whole files' units, then the chunks'. On a failure
    the rest is cancelled and, but after an interrupt, the running ones waited for (as
    ``TransferEngine.wait_all``). Raises as ``read_files``."""
    by_job: dict[int, list[_Unit]] = {}
    for u in todo:
        by_job.setdefault(u.job, []).append(u)
    for i, units in by_job.items():
        reader.files[i].expect(len(units))
    engine = reader.engine
    whole: list[cf.Future] = []
    chunked: list[cf.Future] = []
    try:
        for i, (units, check_root) in enumerate(planned):
            if check_root and not units:  # a file without any byte: check it now
                reader.run_checked(_Unit(i, 0, ()), True)
            into = chunked if reader.files[i].entry.chunks is not None else whole
            into += [engine.submit(reader.run_checked, u, check_root) for u in by_job.get(i, ())]
        engine.wait_all(whole)
    except BaseException as exc:
        for f in chunked + whole:
            f.cancel()
        if isinstance(exc, Exception):
            cf.wait(chunked + whole)
        raise
    engine.wait_all(chunked)


def _run_local(
    reader: _Reader, planned: list[tuple[list[_Unit], bool]], local: list[int]
) -> list[_Unit]:
    """Read the jobs in ``local`` from their local copies; return the units to read from
    the store instead: the chunks that did not verify, and every unit of a whole file that
    did not. Raises StoreError / CorruptionError only from sinks."""
    wrong_size = [i for i in local if not _has_size(reader.files[i].job)]
    local = [i for i in local if i not in wrong_size]
    redo = [u for i in wrong_size for u in planned[i][0]]
    reader.stats.local_rejected += len(redo)
    if not local:
        return redo
    units = [u for i in local for u in planned[i][0]]
    for i in local:
        reader.files[i].expect(len(planned[i][0]))
    verified = _local_units(reader, units)
    rejected_units: list[_Unit] = []
    rejected_files: set[int] = set()
    for u, ok in zip(units, verified, strict=True):
        if not ok:
            if u.pieces[0].ref is not None:
                rejected_units.append(u)
            else:
                rejected_files.add(u.job)
    again = [u for u in rejected_units if u.job not in rejected_files]
    again += [u for i in sorted(rejected_files) for u in planned[i][0]]
    reader.stats.local_rejected += len(again)
    return redo + again


def _local_units(reader: _Reader, units: Sequence[_Unit]) -> list[bool]:
    """``_local_unit`` for each of ``units``, on one worker per core (at least
    ``LOCAL_WORKERS_MIN``), each taking the next unit as it finishes one: reading a copy
    in the page cache is CPU work (the copy, the hash), and more threads than cores only
    add hand-offs and evict each other's pieces from cache (docs/performance.md). Raises
    as ``_local_unit`` (the other workers then stop)."""
    ok = [False] * len(units)
    todo = iter(range(len(units)))
    lock = threading.Lock()
    failed = threading.Event()

    def drain() -> None:
        while not failed.is_set():
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                ok[i] = _local_unit(reader, units[i])
            except BaseException:
                failed.set()
                raise

    workers = min(len(units), max(LOCAL_WORKERS_MIN, os.cpu_count() or 1))
    try:
        reader.engine.wait_all([reader.engine.submit(drain) for _ in range(workers)])
    except BaseException:
        # An interrupt is not waited for (``wait_all``): the workers still running take
        # no further unit, as cancelled units would not have started.
        failed.set()
        raise
    return ok


def _has_size(job: FileJob) -> bool:
    """Whether the local copy exists with exactly the recorded size (a longer file would
    verify on its first bytes and still not be the file)."""
    try:
        return job.local is not None and os.stat(job.local).st_size == job.entry.size
    except OSError:
        return False


def _local_unit(reader: _Reader, unit: _Unit) -> bool:
    """One unit from its local copy; False if it did not verify (or the whole file it
    completes did not)."""
    try:
        reader.run_unit(unit, True, True)
    except _LocalRejected:
        return False
    return True


class _Discard:
    """A sink that keeps nothing: for checking a local copy before it is linked, or what
    a streaming reader will read before it applies any of it."""

    def direct(self, job: int, offset: int, length: int) -> memoryview | None:
        return None

    def deliver(self, job: int, offset: int, data: memoryview) -> Waiter | None:
        return None

    def landed(self, job: int, offset: int, length: int) -> None:
        return None

    def scratch(self, size: int) -> memoryview:
        return aligned_buffer(size)  # a local copy is hashed while hot: aligned pays


def verify_files(
    engine: TransferEngine,
    store: Store,
    files_prefix: str,
    jobs: Sequence[FileJob],
    *,
    leaf_size: int = LEAF,
    stats: ReadStats | None = None,
    progress: Callable[[int], None] | None = None,
    damaged: Callable[[int, CorruptionError, bool], None] | None = None,
) -> ReadStats:
    """Read ``jobs`` as ``read_files`` does, every byte checked, keeping nothing (memory:
    the engine's scratch buffers only): the hash-only sink, for a reader that must know
    its later reads are intact before it applies its first ones, and ``verify
    --read-data`` (``damaged``: each damaged job reported, the others read on). Raises as
    ``read_files``."""
    return read_files(
        engine,
        store,
        files_prefix,
        jobs,
        _Discard(),
        leaf_size=leaf_size,
        stats=stats,
        buffers=engine.buffers,
        progress=progress,
        damaged=damaged,
    )


def verify_local(
    engine: TransferEngine,
    jobs: Sequence[FileJob],
    *,
    leaf_size: int = LEAF,
    stats: ReadStats | None = None,
) -> list[bool]:
    """Check each job's local copy (``FileJob.local``, read whole) against its manifest
    entry, at local-disk speed, keeping nothing; True for each that matches exactly.
    Reads nothing from the store. Raises only on a bug."""
    stats = stats if stats is not None else ReadStats()
    reader = _Reader(engine, _NO_STORE, "", jobs, _Discard(), stats, leaf_size)
    planned = [
        plan_units(
            i, dataclasses.replace(j, ranges=None), reader.files[i].leaf_size, reader.range_size
        )
        for i, j in enumerate(jobs)
    ]
    ok = [j.local is not None for j in jobs]
    with_units = [i for i, (units, _) in enumerate(planned) if units and ok[i]]
    reader.hash_on_workers(sum(len(planned[i][0]) for i in with_units))
    for u in _run_local(reader, planned, with_units):
        ok[u.job] = False
    for i, (units, _) in enumerate(planned):
        if ok[i] and not units:  # an empty file: it must exist and be empty
            path = jobs[i].local
            ok[i] = path is not None and path.is_file() and path.stat().st_size == 0
            ok[i] = ok[i] and reader.files[i].root_ok()
    stats.finished = time.perf_counter()
    return ok
