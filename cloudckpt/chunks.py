"""Incremental checkpoints: files stored as content-addressed chunks shared across saves.

Layout. A chunk is stored once, under the attempt that uploaded it first::

    ckpt/<attempt>/chunks/<name>        the chunk's bytes, written create-only; the name
                                        is its leaf digest, "b3-" first for BLAKE3

A chunked manifest (``cloudckpt.manifest/2``) lists each file as its chunks, each a
(owner prefix, SHA-256, size) triple; a later checkpoint whose file holds the same bytes
names the chunk where it already lies, in an earlier attempt's prefix. See docs/design.md
("Chunks") for why chunks live in attempt prefixes and not in a shared directory.

Cut points. Every chunk lies inside one 8 MiB digest leaf (``cloudckpt.digest``), so a
chunk that is a whole leaf has the leaf's digest as its name and costs no hashing beyond
the file digest. With ``mode="tensor"`` a safetensors file or a ``torch.save`` zip is also
cut where each tensor (zip member) of at least ``MIN_PIECE`` bytes starts and ends: a
tensor that did not change keeps its chunks even when a neighbour in the same leaf changed
(LoRA adapters stored between frozen base weights). Smaller tensors stay together.

Which chunks to upload. The manager keeps a ``ChunkIndex`` of the chunks of the last
checkpoint it committed (or, after a restart, of the current checkpoint's manifest: one
GET). Only chunks missing from it are uploaded; nothing is asked of the store per chunk.

Safety (the commit and GC rules):

- A save may name a chunk of an earlier checkpoint only if that checkpoint (the chunk's
  *source* in the index) is retained (current or history) in the LATEST its commit
  replaces: ``ChunkIndex.requires`` runs inside the compare-and-swap loop. A checkpoint
  can leave the retained set but never re-enter it (a pin of a pending tombstone aside,
  and GC marks a tombstone ``deleting`` before it deletes anything, after which no pin
  brings it back), so the chunk is referenced by a retained manifest at the instant of
  the commit and by the new manifest ever after.
- GC (``protected_chunk_keys``) deletes a chunk only if no manifest of any checkpoint in
  the LATEST that GC itself wrote (retained, pinned, or tombstoned and not being deleted
  in this pass) names it. Every commit after that write can only name chunks that some
  manifest in it names (the rule above, by induction over commits), or chunks of its own
  attempt (young, so protected by the grace period like any in-flight attempt). If a
  manifest cannot be read, GC keeps every chunk.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import logging
import os
import struct
import threading
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Literal

from cloudckpt import attempt_layout, digest, protocol
from cloudckpt.errors import (
    ChunkSourceDroppedError,
    CorruptionError,
    ObjectNotFoundError,
    PreconditionFailedError,
    ReusedChunkMissingError,
    StagingError,
    StoreError,
    UnknownFormatError,
)
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.manifests import ChunkRef, FileEntry, Manifest
from cloudckpt.protocol import Latest

# The listing a reader checks a chunked checkpoint with lives in ``cloudckpt.reader`` (it
# was defined here first and is still imported from here).
from cloudckpt.reader import check_chunk_objects as check_chunk_objects
from cloudckpt.reader import fetch_manifest
from cloudckpt.retry import call_with_retries
from cloudckpt.stores import CREATE, ObjectInfo, Store, crc32c_b64
from cloudckpt.transfer import MemoryFile, read_at

log = logging.getLogger("cloudckpt")

ChunkingMode = Literal["tensor", "fixed", "off"]
MODES = ("tensor", "fixed", "off")
LEAF = digest.CHUNK_SIZE
#: Tensors (zip members) at least this big get chunk boundaries of their own.
MIN_PIECE = 1024 * 1024


# --------------------------------------------------------------------------- cut points


def _safetensors_cuts(read: Callable[[int, int], bytes], size: int) -> list[int]:
    """Cut points of a safetensors file whose bytes ``read(offset, length)`` returns."""
    head = read(0, 8)
    if len(head) < 8:
        return []
    (n,) = struct.unpack("<Q", head)
    if n <= 1 or 8 + n > size or n > 100 * 1024 * 1024:
        return []
    header = json.loads(read(8, n))
    base = 8 + n
    cuts = [base]
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        start, end = info["data_offsets"]
        if end - start >= MIN_PIECE:
            cuts += [base + start, base + end]
    return cuts


def _zip_cuts(path: Path) -> list[int]:
    cuts = []
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.file_size < MIN_PIECE:
                continue
            f.seek(info.header_offset)
            local = f.read(30)
            if local[:4] != b"PK\x03\x04":
                return []
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            start = info.header_offset + 30 + name_len + extra_len
            cuts += [start, start + info.file_size]
    return cuts


def tensor_cuts(source: Path | MemoryFile, size: int, name: str | None = None) -> list[int]:
    """Offsets where tensors of at least ``MIN_PIECE`` bytes start and end, for
    safetensors files and ``torch.save`` zips (a file on disk, or ``save_state``'s
    in-memory safetensors); [] for anything else (or unparsable). ``name`` is the file's
    name in the checkpoint (default: the path's)."""
    if size < MIN_PIECE:
        return []
    name = name if name is not None else getattr(source, "name", "")
    try:
        if isinstance(source, MemoryFile):
            return _safetensors_cuts(source.read, size) if name.endswith(".safetensors") else []
        with open(source, "rb") as f:
            magic = f.read(4)
        if magic == b"PK\x03\x04":
            return _zip_cuts(source)
        if name.endswith(".safetensors"):
            return _safetensors_cuts(lambda off, n: read_at(source, off, n), size)
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, struct.error):
        return []
    return []


def plan(
    source: Path | MemoryFile, size: int, mode: ChunkingMode, name: str | None = None
) -> list[tuple[int, int]]:
    """(offset, length) of every chunk of the file: the 8 MiB leaf grid, plus tensor
    boundaries with ``mode="tensor"``."""
    cuts = set(range(0, size, LEAF))
    if mode == "tensor":
        cuts.update(c for c in tensor_cuts(source, size, name) if 0 < c < size)
    points = [*sorted(cuts), size]
    return [(a, b - a) for a, b in itertools.pairwise(points) if b > a]


# --------------------------------------------------------------------------- the index


@dataclasses.dataclass(frozen=True)
class _Known:
    """A chunk a save may name instead of uploading it, and what protects it from GC until
    the save's commit: ``source``, the commit id of a checkpoint whose manifest names it
    (the commit rule: it must still be retained), or, for a chunk an interrupted attempt
    uploaded (``source`` empty), ``born``: that attempt's birth on the store's clock (the
    commit's age bound, ``committer.AttemptAge.resuming``)."""

    ref: ChunkRef
    source: str
    born: dt.datetime | None = None

    @property
    def resumed(self) -> bool:
        return self.born is not None


class ChunkIndex:
    """The chunks a save may reuse without uploading: those of committed manifests, and
    those of interrupted attempts of the same step (``interrupted_chunks``)."""

    def __init__(self, known: Iterable[_Known] = ()) -> None:
        self._by_sha: dict[str, _Known] = {}
        for k in known:
            self._by_sha.setdefault(k.ref.name, k)

    @classmethod
    def of(cls, manifest: Manifest) -> ChunkIndex:
        return cls.of_many([manifest])

    @classmethod
    def of_many(cls, manifests: Iterable[Manifest]) -> ChunkIndex:
        """The chunks of every manifest (the first manifest naming a chunk is its source)."""
        return cls(
            _Known(c, m.commit_id) for m in manifests for f in m.files for c in f.chunks or ()
        )

    @classmethod
    def of_files(cls, files: Iterable[FileEntry], source: str) -> ChunkIndex:
        """The chunks of ``files``, entries of the committed checkpoint ``source`` (commit
        id): a multi-rank save's rank keeps its own files' chunks after each commit."""
        return cls(_Known(c, source) for f in files for c in f.chunks or ())

    def __len__(self) -> int:
        return len(self._by_sha)

    def without(self, names: Iterable[str]) -> ChunkIndex:
        """This index less the chunks ``names`` (``ChunkRef.name``: found missing from the
        store)."""
        gone = set(names)
        return ChunkIndex(k for sha, k in self._by_sha.items() if sha not in gone)

    def plus(self, known: Iterable[_Known]) -> ChunkIndex:
        """This index and ``known`` (a chunk this index holds keeps its source)."""
        return ChunkIndex([*self._by_sha.values(), *known])

    def has(self, name: str) -> bool:
        """Whether the index holds a chunk named ``name`` (of any size: ``get`` checks)."""
        return name in self._by_sha

    def get(self, name: str, size: int) -> _Known | None:
        """The chunk named ``name`` (``ChunkRef.name``: the algorithm is part of it, so a
        chunk is reused only by a save that digests with the same algorithm)."""
        known = self._by_sha.get(name)
        return known if known is not None and known.ref.size == size else None


#: An interrupted attempt's chunks are reused only while it is younger than this share of
#: the commit's age bound: the rest is the time the save has to upload and commit.
RESUME_WITHIN = 0.5


def interrupted_chunks(
    store: Store,
    step: int,
    referenced: set[str],
    own_prefix: str,
    now: dt.datetime,
    max_age_s: float,
) -> list[_Known]:
    """The chunks that interrupted attempts of ``step`` uploaded (a push stopped with
    Ctrl-C, a trainer killed in the middle of an upload), as index entries dated by their
    attempt's birth, from one listing of ``ckpt/<step>-``. ``referenced``: the attempt
    prefixes LATEST names (committed or dropped checkpoints: not interrupted ones);
    ``now``: the store's clock; ``max_age_s``: the commit's age bound.

    An attempt is used only if its ``ATTEMPT.json`` is listed and it is younger than
    ``RESUME_WITHIN`` of the bound. Its birth is the oldest ``last_modified`` among its
    objects, which is when GC dates it from as long as ``ATTEMPT.json`` (written before
    any other object of its attempt, deleted by GC after all of them) is there: see
    docs/design.md §11, "Resuming an interrupted save", for why a commit that names these
    chunks under that age bound never names one GC may own.

    Raises StoreError (the listing failed).
    """
    where = f"{attempt_layout.CKPT_PREFIX}{step:012d}-"
    listed = call_with_retries(lambda: list(store.list(where)), what=f"list {where}")
    attempts: dict[str, list[ObjectInfo]] = {}
    for obj in listed:
        head, _, rest = obj.key[len(attempt_layout.CKPT_PREFIX) :].partition("/")
        prefix = f"{attempt_layout.CKPT_PREFIX}{head}/"
        if rest and prefix != own_prefix and prefix not in referenced:
            attempts.setdefault(prefix, []).append(obj)
    found: list[_Known] = []
    for prefix, objects in sorted(attempts.items()):
        born = _interrupted_birth(prefix, step, objects)
        if born is None or (now - born).total_seconds() > RESUME_WITHIN * max_age_s:
            continue
        for obj in objects:
            name = obj.key[len(prefix + attempt_layout.CHUNKS_DIR) :]
            parsed = attempt_layout.parse_chunk_name(name)
            if obj.key.startswith(prefix + attempt_layout.CHUNKS_DIR) and parsed is not None:
                algorithm, sha = parsed
                found.append(_Known(ChunkRef(prefix, sha, obj.size, algorithm), "", born))
    return found


def _interrupted_birth(prefix: str, step: int, objects: Sequence[ObjectInfo]) -> dt.datetime | None:
    """When GC dates the attempt at ``prefix`` from (the oldest object's time), or None if
    it cannot be resumed: not an attempt of ``step``, no ``ATTEMPT.json`` (never written,
    or GC is deleting it), or an object without a time."""
    parsed = attempt_layout.parse_ckpt_prefix(prefix)
    if parsed is None or parsed[0] != step:
        return None
    if not any(o.key == prefix + attempt_layout.ATTEMPT_NAME for o in objects):
        return None
    times = [o.last_modified for o in objects]
    if any(t is None for t in times):
        return None
    return min(t for t in times if t is not None)


def resumed_chunk_ok(engine, store: Store, known: _Known, data: bytes | memoryview) -> bool:
    """Whether the chunk ``known`` (one an interrupted attempt uploaded, found by a listing:
    no commit ever checked it) holds ``data``, the bytes its name stands for. Cheaply where
    the store recorded a checksum of the whole object (S3: the CRC32C each put sent),
    compared with the CRC32C of ``data``; otherwise it is read back and hashed. A chunk
    gone meanwhile is not ok. Raises StoreError (the store failed)."""
    ref = known.ref
    try:
        crc = engine.retry(lambda: store.stored_crc32c(ref.key), f"check {ref.key}")
        if crc is not None:
            return bool(crc == crc32c_b64(data))
        stored = engine.retry(lambda: store.get_range(ref.key, 0, ref.size), f"check {ref.key}")
    except ObjectNotFoundError:
        return False
    return len(stored) == ref.size and digest.hexleaf(stored, ref.algorithm) == ref.sha256


class _Checked:
    """Resumed chunks checked by ``resumed_chunk_ok`` in one save (each once)."""

    def __init__(self) -> None:
        self._ok: dict[str, bool] = {}
        self._lock = threading.Lock()

    def trusted(self, engine, store: Store, known: _Known, data: bytes | memoryview) -> bool:
        """Whether the save may name ``known`` for ``data``: any chunk of a committed
        checkpoint (see docs/design.md §11, "What is reused by name, and why"), a resumed
        one only once its content checks."""
        if not known.resumed:
            return True
        with self._lock:
            seen = self._ok.get(known.ref.key)
        if seen is None:
            seen = resumed_chunk_ok(engine, store, known, data)
            if not seen:
                log.warning(
                    "%s%s does not hold the bytes its name stands for; uploading them again",
                    store.url,
                    known.ref.key,
                )
            with self._lock:
                self._ok[known.ref.key] = seen
        return seen


@dataclasses.dataclass
class UploadStats:
    """What an upload did: chunks and bytes sent, and reused by reference (``reused``
    includes ``resumed``: chunks an interrupted attempt of the same step had uploaded).
    ``resumed_born``: the oldest birth of those attempts (the commit's age bound).
    An upload of whole files counts its bytes as uploaded, in no chunk."""

    chunks_uploaded: int = 0
    bytes_uploaded: int = 0
    chunks_reused: int = 0
    bytes_reused: int = 0
    chunks_resumed: int = 0
    bytes_resumed: int = 0
    sources: set[str] = dataclasses.field(default_factory=set)
    resumed_born: dt.datetime | None = None

    def reuse(self, known: _Known, size: int) -> None:
        """Count ``known`` (``size`` bytes) as named instead of uploaded."""
        self.chunks_reused += 1
        self.bytes_reused += size
        if known.born is None:
            self.sources.add(known.source)
            return
        self.chunks_resumed += 1
        self.bytes_resumed += size
        if self.resumed_born is None or known.born < self.resumed_born:
            self.resumed_born = known.born

    def requires(self, base: Latest) -> None:
        """Refuse a commit over a LATEST in which a reused chunk's source checkpoint is no
        longer retained (see the module docstring)."""
        retained = {r.commit_id for r in base.retained()}
        lost = self.sources - retained
        if lost:
            raise ChunkSourceDroppedError(
                f"checkpoint(s) {', '.join(sorted(lost))} whose chunks this save reuses are "
                "no longer retained"
            )


# --------------------------------------------------------------------------- upload


class _Uploader:
    def __init__(
        self,
        engine,
        store: Store,
        prefix: str,
        index: ChunkIndex,
        progress,
        elsewhere: Iterable[str] = (),
        owed: Iterable[str] = (),
    ) -> None:
        self.engine, self.store, self.prefix, self.index = engine, store, prefix, index
        self.progress = progress
        self.stats = UploadStats()
        self.algorithm = digest.check(None)  # one algorithm for the whole save
        self._lock = threading.Lock()
        # Chunks another uploader into the same prefix puts (a multi-rank save's owner of
        # a chunk several ranks hold): named under ``prefix``, never put here.
        self._claimed: set[str] = set(elsewhere)
        # Chunks this uploader owes those others: put under ``prefix`` even if the index
        # holds them, since the others name them there.
        self.owed = frozenset(owed)
        self.checked = _Checked()

    def _put(self, ref: ChunkRef, data: memoryview, crc: int | None) -> None:
        key = ref.key
        known_crc = contextlib.nullcontext() if crc is None else digest.known_crc32c(data, crc)
        try:
            with digest.known_leaf(data, bytes.fromhex(ref.sha256), ref.algorithm), known_crc:
                self.engine.retry(lambda: self.store.put(key, data, mode=CREATE), f"upload {key}")
        except PreconditionFailedError:
            pass  # content-addressed and create-only: whoever won wrote these bytes
        failpoint("save.after_part")

    def span(self, source: Path | MemoryFile, offset: int, pieces: list[tuple[int, int]]):
        """One leaf: read it into a reused page-aligned buffer a block at a time, hashing
        the leaf and its chunks (and, on a first save, each chunk's CRC32C) while each block
        is in cache (``TransferEngine.reading_hashed``, ``digest.leaf_and_pieces_as_read``),
        then upload the chunks the index lacks."""
        length = sum(n for _, n in pieces)
        # With nothing to reuse every chunk is sent: its transfer CRC32C is computed in the
        # same pass as its digest. With an index most chunks of an incremental save are
        # reused, and a CRC of them would be wasted: the store computes it for those sent.
        crc32c = not self.index
        sizes = [n for _, n in pieces]
        with self.engine.reading_hashed(
            source,
            offset,
            length,
            lambda view, read: digest.leaf_and_pieces_as_read(
                view, read, sizes, self.algorithm, crc32c=crc32c
            ),
        ) as (data, hashed):
            return self._span(data, offset, pieces, *hashed)

    def _span(
        self,
        data: memoryview,
        offset: int,
        pieces: list[tuple[int, int]],
        leaf: bytes,
        names: list[bytes],
        crcs: list[int] | None,
    ) -> tuple[bytes, list[ChunkRef]]:
        """Name and upload (or reuse) the chunks of one leaf, ``data``, whose digest is
        ``leaf``: ``pieces`` (file offset, size) with digests ``names`` and, where known,
        CRC32Cs ``crcs``, all computed from exactly these bytes."""
        length = len(data)
        algorithm = self.algorithm
        refs = []
        for i, (off, n) in enumerate(pieces):
            chunk = data if n == length else data[off - offset : off - offset + n]
            sha, chunk_crc = names[i].hex(), None if crcs is None else crcs[i]
            ref = ChunkRef(self.prefix, sha, n, algorithm)
            known = None if ref.name in self.owed else self.index.get(ref.name, n)
            if known is not None and not self.checked.trusted(
                self.engine, self.store, known, chunk
            ):
                known = None  # an interrupted attempt's chunk with other bytes: upload
            with self._lock:
                if known is not None:
                    self.stats.reuse(known, n)
                    refs.append(known.ref)
                    continue
                first = ref.name not in self._claimed
                self._claimed.add(ref.name)
            if first:
                self._put(ref, chunk, chunk_crc)
                with self._lock:
                    self.stats.chunks_uploaded += 1
                    self.stats.bytes_uploaded += n
            refs.append(ref)
        if self.progress is not None:
            with self._lock:
                self.progress(length)
        return leaf, refs


def _identity(source: Path | MemoryFile) -> tuple[int, int, int]:
    """(size, mtime, inode) of a staged file, to notice a change during the upload; a
    ``MemoryFile``'s buffers are the caller's to keep unchanged, so only its size."""
    if isinstance(source, MemoryFile):
        return source.size, 0, 0
    st = os.stat(source)
    return st.st_size, st.st_mtime_ns, st.st_ino


def upload_chunked(
    engine,
    store: Store,
    prefix: str,
    files: Sequence[tuple[str, Path | MemoryFile]],
    index: ChunkIndex,
    mode: ChunkingMode = "tensor",
    progress: Callable[[int], None] | None = None,
    *,
    elsewhere: Iterable[str] = (),
    owed: Iterable[str] = (),
) -> tuple[list[FileEntry], UploadStats]:
    """Upload ``files`` (relative path, local path or ``MemoryFile``) as chunks under the
    attempt ``prefix``, skipping chunks ``index`` holds; return their manifest entries and
    what was sent. A multi-rank save's ranks share the prefix: ``elsewhere`` (chunk
    names) are another rank's to put, and named under ``prefix`` without a put;
    ``owed`` are put even if ``index`` holds them (other ranks name them under
    ``prefix``). The commit's listing (``check_uploaded``) confirms them all.

    Raises StagingError (a file unreadable or changed meanwhile) or StoreError.
    """
    up = _Uploader(engine, store, prefix, index, progress, elsewhere, owed)
    jobs = []
    for rel, source in files:
        try:
            before = _identity(source)
        except OSError as exc:
            raise StagingError(f"cannot read staged file {source}: {exc.strerror}") from None
        size = before[0]
        spans: dict[int, list[tuple[int, int]]] = {}
        for off, n in plan(source, size, mode, name=rel.rsplit("/", 1)[-1]):
            spans.setdefault(off // LEAF * LEAF, []).append((off, n))
        futures = [engine.submit(up.span, source, start, p) for start, p in sorted(spans.items())]
        jobs.append((rel, source, before, futures))
    entries = []
    try:
        for rel, source, before, futures in jobs:
            results = engine.wait_all(futures)
            try:
                after = _identity(source)
            except OSError as exc:
                raise StagingError(f"staged file {source} became unreadable: {exc}") from None
            if after != before:
                raise StagingError(f"staged file {source} changed while it was being uploaded")
            leaves = [leaf for leaf, _ in results]
            refs = tuple(r for _, rs in results for r in rs)
            root = digest.root(leaves, before[0], algorithm=up.algorithm)
            entries.append(FileEntry(rel, before[0], root, refs, algorithm=up.algorithm))
    except BaseException:
        for _, _, _, futures in jobs:
            for f in futures:
                f.cancel()
        cf.wait([f for *_, fs in jobs for f in fs])
        raise
    return entries, up.stats


def _stored_chunk_sizes(store: Store, owner_prefixes: Iterable[str]) -> dict[str, int]:
    """Chunk key -> stored size, by one listing of each owner prefix's ``chunks/``."""
    sizes: dict[str, int] = {}
    for owner in sorted(set(owner_prefixes)):
        sizes.update((o.key, o.size) for o in _listed(store, owner + attempt_layout.CHUNKS_DIR))
    return sizes


def _listed(store: Store, prefix: str) -> list[ObjectInfo]:
    """Every object under ``prefix``, the listing retried whole on a transient error."""
    return call_with_retries(lambda: list(store.list(prefix)), what=f"list {prefix}")


def check_uploaded(store: Store, prefix: str, entries: Sequence[FileEntry]) -> None:
    """Before the manifest is written: every chunk ``entries`` name is in the store whole,
    by one listing per owner prefix. Those this attempt uploaded (a store or proxy that
    silently kept fewer bytes must not get a torn checkpoint committed), and those it
    reuses from earlier checkpoints: a chunk lost to a lifecycle rule, a deletion by hand
    or a damaged commit would otherwise spread to every later save of unchanged data.
    From here to the commit, ``UploadStats.requires`` keeps the reused ones protected.

    Raises:
        StoreError: a chunk this attempt uploaded is missing or short.
        ReusedChunkMissingError: reused chunks are missing (``missing``: their SHA-256s).
    """
    named = {c.key: c for e in entries for c in e.chunks or ()}
    if not named:
        return
    sizes = _stored_chunk_sizes(store, (c.owner for c in named.values()))
    bad = [c for key, c in sorted(named.items()) if sizes.get(key) != c.size]
    for c in bad:
        if c.owner == prefix:
            raise StoreError(
                f"{store.url}{c.key} holds {sizes.get(c.key)} bytes after uploading {c.size} "
                "bytes; the checkpoint was not committed",
                key=c.key,
                hint="The store or a proxy lost part of the upload. Save again",
            )
    if bad:
        raise ReusedChunkMissingError(
            f"{len(bad)} chunk(s) this save reuses from earlier checkpoints are not in "
            f"{store.url} (first: {bad[0].key})",
            missing=frozenset(c.name for c in bad),
        )


# --------------------------------------------------------------------------- a file's chunks by leaf


def leaf_groups(entry: FileEntry) -> list[list[ChunkRef]]:
    """The chunks of ``entry`` grouped by the digest leaf they lie in (a validated
    manifest's chunks never cross a leaf)."""
    groups: list[list[ChunkRef]] = []
    offset = 0
    for ref in entry.chunks or ():
        if offset // LEAF == len(groups):
            groups.append([])
        groups[-1].append(ref)
        offset += ref.size
    return groups


# --------------------------------------------------------------------------- GC


def chunk_keys(manifest: Manifest) -> set[str]:
    return {c.key for f in manifest.files for c in f.chunks or ()}


def protected_chunk_keys(
    store: Store, latest: Latest, deleting: Iterable[str] = ()
) -> set[str] | None:
    """Keys of every chunk named by a manifest of a checkpoint in ``latest`` (retained or
    tombstoned), except the checkpoints in ``deleting`` (commit ids). None if a manifest
    could not be read: then no chunk may be deleted.

    Raises UnknownFormatError (a manifest a newer cloudckpt wrote) or StoreError."""
    skip = set(deleting)
    records = [*latest.retained(), *(t.record for t in latest.tombstones)]
    keys: set[str] = set()
    for rec in records:
        if rec.commit_id in skip:
            continue
        try:
            manifest = fetch_manifest(store, rec)
        except (CorruptionError, protocol.CorruptRecordError, ValueError):
            return None
        except Exception as exc:  # UnsafePathError and the like: be conservative
            # A newer version's manifest is not damage: GC stops (collects nothing by it).
            if isinstance(exc, (StoreError, UnknownFormatError)):
                raise
            return None
        keys |= chunk_keys(manifest)
    return keys


def is_chunk_key(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 4 and parts[0] == "ckpt" and parts[2] + "/" == attempt_layout.CHUNKS_DIR
