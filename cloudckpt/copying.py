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
The copy records the source's metadata and metrics (so keep-best can rank it there).

A checkpoint the destination already retains as the same step with the same content
(``already_held``: every file's path, size, digest and mode, the metadata and the metrics)
is not copied again: the copy is a no-op, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence

from cloudckpt import attempt_layout, chunks, digest, protocol
from cloudckpt.attempts import AttemptWriter, BegunAttempt
from cloudckpt.errors import (
    CloudCkptError,
    CorruptionError,
    PreconditionFailedError,
    StaleAttemptError,
    UnsafePathError,
)
from cloudckpt.fetch import fetch_chunk, read_range
from cloudckpt.manifests import ChunkRef, FileEntry, Manifest
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
        self.checked = chunks._Checked()

    def _count_read(self, n: int) -> None:
        with self._lock:
            self.read.bytes_read += n

    def _store(self, sha: str, data: bytes, algorithm: str) -> ChunkRef:
        """Name a chunk of the destination with these (verified) bytes, whose ``algorithm``
        leaf digest is ``sha``: one it holds, or one this attempt stores (once,
        create-only: a lost race left the same bytes)."""
        ref = ChunkRef(self.prefix, sha, len(data), algorithm)
        known = self.index.get(ref.name, len(data))
        if known is not None and not self.checked.trusted(self.engine, self.dst, known, data):
            known = None  # an interrupted copy's chunk with other bytes: store it again
        with self._lock:
            if known is not None:
                self.stats.reuse(known, len(data))
                return known.ref
            first = ref.name not in self._sent
            self._sent.add(ref.name)
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
            known = self.index.get(ref.name, ref.size)
            # Unread only where a commit checked the chunk: a resumed one is read below.
            if known is not None and not known.resumed:
                with self._lock:
                    self.stats.reuse(known, ref.size)
                return bytes.fromhex(ref.sha256), [known.ref]
        datas, refs = [], []
        for ref in pieces:
            data = bytes(fetch_chunk(self.engine, self.src, ref))
            self._count_read(len(data))
            datas.append(data)
            refs.append(self._store(ref.sha256, data, ref.algorithm))
        if len(pieces) == 1:
            leaf = bytes.fromhex(pieces[0].sha256)
        else:
            leaf = digest.leaf(b"".join(datas), pieces[0].algorithm)
        return leaf, refs

    def plain_leaf(self, entry: FileEntry, offset: int) -> tuple[bytes, list[ChunkRef]]:
        """The leaf at ``offset`` of a source file stored whole: read, hashed (its digest
        names its chunk) and stored as one chunk. Raises CorruptionError (missing or
        short: the file's digest is checked once every leaf is in)."""
        key = self.source_ckpt + attempt_layout.FILES_DIR + entry.path
        length = min(LEAF, entry.size - offset)
        buf = bytearray(length)
        read_range(self.engine, self.src, key, offset, memoryview(buf), entry.size)
        data = bytes(buf)
        self._count_read(length)
        leaf = digest.leaf(data, entry.algorithm)
        return leaf, [self._store(leaf.hex(), data, entry.algorithm)]

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
                for pieces in chunks.leaf_groups(entry):
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
                if not _file_ok(entry, [leaf for leaf, _ in results]):
                    raise CorruptionError(
                        f"{entry.path} of {self.source_ckpt} does not match its digest"
                    )
                refs = tuple(r for _, rs in results for r in rs)
                entries.append(
                    FileEntry(
                        entry.path, entry.size, entry.digest, refs, entry.mode, entry.algorithm
                    )
                )
        except BaseException:
            for _, futures in jobs:
                for f in futures:
                    f.cancel()
            raise
        return entries


def _file_ok(entry: FileEntry, leaves: Sequence[bytes]) -> bool:
    """Whether the leaf digests read for ``entry`` make up the digest its manifest records
    (each chunk matching its name is not enough: chunks in the wrong order, or a whole
    file stored with another file's digest, pass that)."""
    return digest.root(leaves, entry.size, algorithm=entry.algorithm) == entry.digest


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
        StaleAttemptError: the copy was slower than the destination's grace period.
        As ``AttemptWriter.run``: FencedError, StoreError, ...
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

    metrics = dict(manifest.metrics or record.metrics)  # what keep-best ranks by, there too
    try:
        begun, latest, written = writer.run(step, upload, dict(manifest.metadata), metrics=metrics)
    except StaleAttemptError as exc:
        raise _slower_than_grace(writer, record.step, step, exc) from exc
    return begun, latest, written, read


def _slower_than_grace(
    writer: AttemptWriter, src_step: int, step: int, exc: StaleAttemptError
) -> StaleAttemptError:
    """A copy that outlived the destination's grace period: what happened, what to do."""
    grace = writer.committer.settings.gc_grace_s
    return StaleAttemptError(
        f"the copy of step {src_step} into {writer.store.url} (as step {step}) was slower "
        f"than the destination run's gc grace period ({grace} s): it was not committed, "
        f"since garbage collection may already own what it uploaded ({exc.message})",
        hint="Copy again with a grace period longer than a copy takes: give the destination "
        "run a longer gc_grace (CheckpointManager(DEST, gc_grace=...)), and run `cloudckpt "
        "gc DEST` with a longer --grace, while copies run; or copy fewer checkpoints at "
        "once",
    )


def same_content(a: Manifest, b: Manifest) -> bool:
    """Whether two manifests describe the same checkpoint content: the same files (path,
    size, digest, mode), metadata and metrics. Where the bytes are stored (chunks, owner
    prefixes) and who wrote them does not count."""

    def files(m: Manifest) -> list[tuple[str, int, str, int | None]]:
        return sorted((f.path, f.size, f.digest, f.mode) for f in m.files)

    return (
        files(a) == files(b)
        and dict(a.metadata) == dict(b.metadata)
        and dict(a.metrics) == dict(b.metrics)
    )


def already_held(
    dst: Store, latest: protocol.Latest | None, manifest: Manifest, step: int
) -> protocol.CheckpointRecord | None:
    """The checkpoint of ``step`` that ``latest`` (the destination's) retains with the
    content of ``manifest`` (``same_content``), newest first; None if there is none (a
    manifest that cannot be read counts as different: the copy goes ahead).

    Raises: StoreError (the store failed).
    """
    for record in latest.retained() if latest is not None else ():
        if record.step != step:
            continue
        try:
            theirs = fetch_manifest(dst, record)
        except (CorruptionError, UnsafePathError):
            continue
        if same_content(theirs, manifest):
            return record
    return None


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
