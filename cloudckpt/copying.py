"""Copying a committed checkpoint into another run (``cloudckpt.catalog.copy_checkpoint``,
``cloudckpt cp``; docs/design.md §11, "Copying a checkpoint").

The destination is written only through its own protocol: a writer that claims the
destination run (fencing its writer, which the caller must have agreed to), an attempt of
its own (``ATTEMPT.json`` first, born on the destination's clock), chunks written
create-only, the pre-commit listing, the manifest create-only and the fenced
compare-and-swap of the destination's LATEST, with the commit and age rules of any save
(``attempts.AttemptWriter.run``). So a copy is exactly a save whose bytes come from
another run.

Every file is stored as chunks at the destination. A chunk the destination already holds
(named by a checkpoint it retains, or uploaded by an interrupted copy of the same step) is
named, not sent: its bytes need not even be read when it is a whole digest leaf, since its
name is then the leaf's digest. Every byte read from the source is verified: each chunk
against its SHA-256 as it arrives, each file against the digest its manifest records
(from the leaf digests) before the commit. A source checkpoint that turns out damaged is
reported and not committed; the caller (``reader.first_intact``) then tries the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence

from cloudckpt import chunks, digest, protocol
from cloudckpt.attempts import AttemptWriter, BegunAttempt
from cloudckpt.errors import (
    CloudCkptError,
    CorruptionError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from cloudckpt.protocol import ChunkRef, FileEntry, Manifest
from cloudckpt.reader import fetch_manifest
from cloudckpt.stores import CREATE, Store
from cloudckpt.transfer import TransferEngine

LEAF = digest.CHUNK_SIZE


@dataclasses.dataclass
class CopyStats:
    """Bytes read from the source, besides what the upload's ``UploadStats`` counts."""

    bytes_read: int = 0


class _Copier:
    """Copies one source checkpoint's files into one destination attempt."""

    def __init__(
        self,
        engine: TransferEngine,
        src: Store,
        dst: Store,
        source_ckpt: str,
        prefix: str,
        index: chunks.ChunkIndex,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.engine, self.src, self.dst = engine, src, dst
        self.source_ckpt, self.prefix, self.index = source_ckpt, prefix, index
        self.progress = progress
        self.stats = chunks.UploadStats()
        self.read = CopyStats()
        self._lock = threading.Lock()
        self._sent: set[str] = set()

    def _count_read(self, n: int) -> None:
        with self._lock:
            self.read.bytes_read += n

    def _store(self, sha: str, data: bytes) -> ChunkRef:
        """Name a chunk of the destination with these (verified) bytes: one it holds, or
        one this attempt stores (once, create-only: a lost race left the same bytes)."""
        known = self.index.get(sha, len(data))
        with self._lock:
            if known is not None:
                self.stats.reuse(known, len(data))
                return known.ref
            first = sha not in self._sent
            self._sent.add(sha)
        ref = ChunkRef(self.prefix, sha, len(data))
        if first:
            # Content-addressed and create-only: a lost race left these very bytes.
            with contextlib.suppress(PreconditionFailedError):
                self.engine.retry(
                    lambda: self.dst.put(ref.key, data, mode=CREATE), f"upload {ref.key}"
                )
            with self._lock:
                self.stats.chunks_uploaded += 1
                self.stats.bytes_uploaded += len(data)
        return ref

    def chunked_leaf(self, pieces: Sequence[ChunkRef]) -> tuple[bytes, list[ChunkRef]]:
        """One digest leaf of a chunked source file: its digest and the destination's
        chunks. A leaf that is one chunk the destination holds is not read at all (its
        name is its digest); any other is read from the source, chunk by chunk, each
        verified against its SHA-256. Raises CorruptionError (MissingChunkError)."""
        if len(pieces) == 1:
            ref = pieces[0]
            known = self.index.get(ref.sha256, ref.size)
            if known is not None:
                with self._lock:
                    self.stats.reuse(known, ref.size)
                return bytes.fromhex(ref.sha256), [known.ref]
        datas, refs = [], []
        for ref in pieces:
            data = bytes(chunks._fetch_chunk(self.engine, self.src, ref))
            self._count_read(len(data))
            datas.append(data)
            refs.append(self._store(ref.sha256, data))
        leaf = bytes.fromhex(pieces[0].sha256) if len(pieces) == 1 else digest.leaf(b"".join(datas))
        return leaf, refs

    def plain_leaf(self, entry: FileEntry, offset: int) -> tuple[bytes, list[ChunkRef]]:
        """The leaf at ``offset`` of a source file stored whole: read, hashed (its digest
        names its chunk) and stored as one chunk. Raises CorruptionError (missing or
        short: the file's digest is checked once every leaf is in)."""
        key = self.source_ckpt + protocol.FILES_DIR + entry.path
        length = min(LEAF, entry.size - offset)
        try:
            data = self.engine.retry(
                lambda: self.src.get_range(key, offset, length), f"download {key}"
            )
        except ObjectNotFoundError:
            raise CorruptionError(f"{key} is missing from the store") from None
        if len(data) != length:
            raise CorruptionError(f"{key} is shorter than the {entry.size} bytes recorded")
        data = bytes(data)
        self._count_read(length)
        leaf = digest.leaf(data)
        return leaf, [self._store(leaf.hex(), data)]

    def _tracked(self, fn: Callable[[], tuple[bytes, list[ChunkRef]]], size: int):
        result = fn()
        if self.progress is not None:
            with self._lock:
                self.progress(size)
        return result

    def copy(self, files: Sequence[FileEntry]) -> list[FileEntry]:
        """Every file, leaf by leaf in parallel; each file checked against its recorded
        digest. Raises CorruptionError, StoreError."""
        jobs = []
        for entry in files:
            futures = []
            if entry.chunks is not None:
                for pieces in chunks._leaves(entry):
                    size = sum(p.size for p in pieces)
                    futures.append(
                        self.engine.submit(
                            self._tracked, lambda p=pieces: self.chunked_leaf(p), size
                        )
                    )
            else:
                for offset in range(0, entry.size, LEAF):
                    size = min(LEAF, entry.size - offset)
                    futures.append(
                        self.engine.submit(
                            self._tracked, lambda o=offset, e=entry: self.plain_leaf(e, o), size
                        )
                    )
            jobs.append((entry, futures))
        entries = []
        try:
            for entry, futures in jobs:
                results = self.engine.wait_all(futures)
                leaves = [leaf for leaf, _ in results]
                if digest.root(leaves, entry.size) != entry.digest:
                    raise CorruptionError(
                        f"{entry.path} of {self.source_ckpt} does not match its digest"
                    )
                refs = tuple(r for _, rs in results for r in rs)
                entries.append(FileEntry(entry.path, entry.size, entry.digest, refs, entry.mode))
        except BaseException:
            for _, futures in jobs:
                for f in futures:
                    f.cancel()
            raise
        return entries


def copy_into(
    writer: AttemptWriter,
    src: Store,
    record: protocol.CheckpointRecord,
    manifest: Manifest,
    step: int,
    progress: Callable[[int], None] | None = None,
) -> tuple[BegunAttempt, protocol.Latest, Manifest, CopyStats]:
    """Copy the source checkpoint ``record`` (whose verified manifest is ``manifest``)
    into ``writer``'s run as step ``step``, committed by ``writer`` (which claims the run
    if it has not). Returns the attempt, the LATEST that commits it, its manifest and what
    was read from the source (``writer.last_upload``: what was sent and reused).

    Raises:
        CorruptionError: the source checkpoint is damaged (nothing was committed).
        As ``AttemptWriter.run``: FencedError, StaleAttemptError, StoreError, ...
    """
    read = CopyStats()

    def upload(begun: BegunAttempt, index: chunks.ChunkIndex | None):
        if index is None:
            index = writer.chunk_index(begun).plus(_retained_chunks(writer))
        copier = _Copier(
            writer.engine, src, writer.store, record.ckpt, begun.prefix, index, progress
        )
        try:
            entries = copier.copy(manifest.files)
        finally:
            read.bytes_read += copier.read.bytes_read
        return entries, copier.stats

    begun, latest, written = writer.run(step, upload, dict(manifest.metadata))
    return begun, latest, written, read


def _retained_chunks(writer: AttemptWriter) -> list[chunks._Known]:
    """The chunks of every checkpoint the destination retains (each protected until the
    commit by the chunk-source rule); a manifest that cannot be read adds nothing."""
    latest = writer.committer.latest
    known: list[chunks._Known] = []
    for record in latest.retained() if latest is not None else ():
        try:
            manifest = fetch_manifest(writer.store, record)
        except CloudCkptError:
            continue
        known.extend(
            chunks._Known(c, manifest.commit_id) for f in manifest.files for c in f.chunks or ()
        )
    return known
