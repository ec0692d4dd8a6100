"""The save pipeline: begin an attempt, upload into it, finish it (manifest and commit).

One ``AttemptWriter`` serves one writer of a run. Its callers:

- ``CheckpointManager`` (one host): ``save()`` runs the three steps for each staged save,
  from its background thread;
- ``DistributedCheckpointManager`` (many ranks, one commit): the coordinator calls
  ``begin()``, every rank ``upload_chunks()`` (``upload_files()`` with chunking off) into
  the prefix it was told, and the coordinator ``finish()`` with every rank's entries;
- the DCP writer (``cloudckpt.integrations.dcp``): the same split, inside DCP's own calls.

The steps (docs/design.md, "Writing: claim, save, commit"):

1. ``begin(step)``: claim the run if no one has yet (through the owner's ``prepare``
   hook), read the store's clock (the attempt's birth: ``committer.AttemptAge``), pick a
   fresh ``ckpt/<step>-e<epoch>-<id>/`` prefix and write its ``ATTEMPT.json``;
2. ``upload(begun, files)``: as content-addressed chunks, skipping those of the last
   committed checkpoint (``ChunkIndex``), or whole files with chunking off;
3. ``finish(begun, entries, metadata)``: list what was uploaded (a store that kept fewer
   bytes must not get a torn checkpoint committed; chunks reused from earlier checkpoints
   must still exist), write the manifest create-only and commit it with the fenced
   compare-and-swap of LATEST.

``save()`` runs all three and retries once, under a new attempt, when chunks it meant to
reuse turn out missing (``ReusedChunkMissingError``: they are uploaded again) or their
checkpoint left retention meanwhile (``ChunkSourceDroppedError``: everything is uploaded
in full).

Fencing: the first ``FencedError`` a commit raises is kept (``fenced``); every later
``begin()`` raises it again, without touching the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cloudckpt import attempt_layout, canonical, chunks, digest, manifests
from cloudckpt.committer import AttemptAge, Committer, check_grace, max_attempt_age
from cloudckpt.errors import (
    ChunkSourceDroppedError,
    CloudCkptError,
    FencedError,
    PreconditionFailedError,
    ResumedChunksTooOldError,
    ReusedChunkMissingError,
    StoreError,
    UnknownFormatError,
)
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import Latest
from cloudckpt.reader import fetch_manifest
from cloudckpt.retention import clean_metrics, unranked
from cloudckpt.retry import IDEMPOTENT_RETRY, call_with_retries
from cloudckpt.stores import CREATE, OVERWRITE, Store
from cloudckpt.transfer import MemoryFile, ProgressCallback, TransferEngine

log = logging.getLogger("cloudckpt")

#: What a save uploads: (path in the checkpoint, a staged file or an in-memory buffer).
Files = Sequence[tuple[str, Path | MemoryFile]]


@dataclasses.dataclass(frozen=True)
class BegunAttempt:
    """An attempt whose prefix is chosen and whose ``ATTEMPT.json`` is written."""

    step: int
    epoch: int
    commit_id: str  # the attempt id; also the save's commit_id
    prefix: str  # ckpt/<step>-e<epoch>-<commit_id>/
    age: AttemptAge  # born on the store's clock; past max age, GC may own it


@dataclasses.dataclass(frozen=True)
class CommitInfo:
    """A committed save: what landed and what it cost.

    ``blocking_seconds``: how long ``save()``/``save_dir()`` held the caller.
    ``commit_seconds``: from the save being handed over to LATEST naming it.
    ``bytes_uploaded``: bytes this save sent to the store; ``bytes_reused``: bytes it named
    where they already lay instead (chunks of earlier checkpoints, and ``bytes_resumed``
    of them: chunks an interrupted save of the same step had uploaded). ``uploaded +
    reused = total_bytes`` (less a chunk a save names twice, uploaded once), except after
    a retry: a save whose commit refused its reused chunks (missing, or their checkpoint
    dropped) uploads again under a new attempt, and ``bytes_uploaded`` counts what both
    tries sent, ``bytes_reused`` what the committed one named. A multi-rank
    save sums its ranks' (a chunk one rank put for several counts once: there the sum can
    be well below ``total_bytes``); None where unknown (a DCP save).
    ``warnings``: what failed after the commit landed (the journal's ``committed`` write
    on a full staging disk, keeping the local copy): the save is committed all the same
    (invariant I6: a committed save is never reported as failed).
    """

    step: int
    commit_id: str
    ckpt: str
    epoch: int
    seq: int
    num_files: int
    total_bytes: int
    blocking_seconds: float
    commit_seconds: float
    metadata: Mapping[str, Any]
    bytes_uploaded: int | None = None
    bytes_reused: int | None = None
    bytes_resumed: int | None = None
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        begun: BegunAttempt,
        latest: Latest,
        manifest: Manifest,
        *,
        blocking_seconds: float,
        commit_seconds: float,
        metadata: Mapping[str, Any],
        stats: chunks.UploadStats | None = None,
    ) -> CommitInfo:
        """The ``CommitInfo`` of ``begun``, committed as ``manifest`` in ``latest``;
        ``stats``: what its upload did (None: unknown)."""
        return cls(
            step=begun.step,
            commit_id=begun.commit_id,
            ckpt=begun.prefix,
            epoch=begun.epoch,
            seq=latest.seq,
            num_files=len(manifest.files),
            total_bytes=manifest.total_bytes,
            blocking_seconds=blocking_seconds,
            commit_seconds=commit_seconds,
            metadata=metadata,
            bytes_uploaded=None if stats is None else stats.bytes_uploaded,
            bytes_reused=None if stats is None else stats.bytes_reused,
            bytes_resumed=None if stats is None else stats.bytes_resumed,
            metrics=dict(manifest.metrics),
        )


#: How a save's files reach its attempt: ``upload(begun, index)`` uploads into
#: ``begun.prefix``, reusing the chunks ``index`` holds (None: the writer's own choice,
#: ``AttemptWriter.chunk_index``), and returns the manifest entries and what it did.
Upload = Callable[
    [BegunAttempt, "chunks.ChunkIndex | None"], tuple[list[FileEntry], chunks.UploadStats]
]


def with_modes(entries: Sequence[FileEntry], files: Files) -> list[FileEntry]:
    """``entries`` with the permission bits of their staged files (``manifests.MODE_BITS``
    at most); entries of in-memory files, or of files gone meanwhile, stay without."""
    sources = dict(files)
    out = []
    for entry in entries:
        source = sources.get(entry.path)
        mode = None
        if isinstance(source, Path):
            try:
                mode = stat.S_IMODE(os.stat(source).st_mode) & manifests.MODE_BITS
            except OSError:
                mode = None  # the upload read it; its mode is a nicety, not the data
        out.append(entry if mode is None else dataclasses.replace(entry, mode=mode))
    return out


class AttemptWriter:
    """The save pipeline of one writer (see the module docstring).

    Args:
        store, engine: where and how files are uploaded.
        committer: the writer's view of LATEST (claims, fenced commits).
        chunking: ``chunks.MODES``; ``"off"`` uploads whole files.
        progress: called with byte counts as uploads advance.
        prepare: called by every ``begin()`` before anything is written; the manager's
            hook claims the run on the first save (committing saves a crashed process
            staged, first). Default: claim the run if this writer has not.

    ``commit_lock`` serialises use of the committer (it is single-threaded): hold it to
    claim the run by hand. ``last_upload``: what the last chunked upload sent and reused.
    """

    def __init__(
        self,
        store: Store,
        engine: TransferEngine,
        committer: Committer,
        *,
        chunking: chunks.ChunkingMode,
        progress: ProgressCallback | None = None,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        self.committer = committer
        self.chunking: chunks.ChunkingMode = chunking
        self.progress = progress
        self.commit_lock = threading.Lock()
        self.last_upload: chunks.UploadStats | None = None
        self._prepare = prepare or self._claim_if_needed
        self._chunk_index: chunks.ChunkIndex | None = None
        self._fenced: FencedError | None = None
        self._unranked_warned: set[str] = set()  # best metrics warned about (once each)

    @property
    def writer_id(self) -> str:
        return self.committer.writer_id

    # -------------------------------------------------------------------- fencing, claim

    @property
    def fenced(self) -> FencedError | None:
        """The ``FencedError`` a commit of this writer raised, if one did: a newer writer
        owns the run and this one may never commit again."""
        return self._fenced

    def check_fenced(self) -> None:
        """Raises the ``FencedError`` a commit of this writer raised, if one did."""
        if self._fenced is not None:
            raise self._fenced

    def claim(self) -> Latest:
        """Claim the run (``Committer.claim``, under ``commit_lock``)."""
        with self.commit_lock:
            return self.committer.claim()

    def _claim_if_needed(self) -> None:
        with self.commit_lock:
            if self.committer.latest is None:
                self.committer.claim()

    # -------------------------------------------------------------------- the pipeline

    def save(
        self,
        step: int,
        files: Files,
        metadata: Mapping[str, Any],
        before_commit: Callable[[], object] | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
    ) -> tuple[BegunAttempt, Latest, Manifest]:
        """Begin an attempt, upload ``files`` into it, run ``before_commit`` and commit
        (``run`` with ``upload``).

        Raises: as ``run``.
        """
        return self.run(
            step,
            lambda begun, index: self.upload(begun, files, index),
            metadata,
            before_commit,
            metrics=metrics,
        )

    def run(
        self,
        step: int,
        upload: Upload,
        metadata: Mapping[str, Any],
        before_commit: Callable[[], object] | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
    ) -> tuple[BegunAttempt, Latest, Manifest]:
        """Begin an attempt, ``upload`` into it, run ``before_commit`` and commit. If a
        checkpoint whose chunks it reuses left retention meanwhile (an unpin, another
        tool), everything is uploaded again in full under a new attempt, once; if reused
        chunks are missing from the store, they are uploaded again (new attempt, once); if
        an interrupted attempt whose chunks it resumed grew too old, they are uploaded
        again (new attempt, once). ``last_upload`` holds what the upload did (after a
        retry: chunks and bytes sent by both tries, reused by the committed one).

        Raises: as ``begin`` and ``finish``; StagingError, StoreError (the upload).
        """
        index: chunks.ChunkIndex | None = None  # None: the writer's own index
        refused: chunks.UploadStats | None = None  # the try whose commit was refused
        for retry in (False, True):
            try:
                begun = self.begin(step)
                entries, stats = upload(begun, index)
                if refused is not None:  # what this save sent counts every try
                    stats.chunks_uploaded += refused.chunks_uploaded
                    stats.bytes_uploaded += refused.bytes_uploaded
                self.last_upload = refused = stats
                failpoint("save.after_upload")
                if before_commit is not None:
                    before_commit()
                latest, manifest = self.finish(
                    begun,
                    entries,
                    metadata,
                    requires=stats.requires,
                    resumed=stats.resumed_born,
                    metrics=metrics,
                )
                return begun, latest, manifest
            except ReusedChunkMissingError as exc:
                if retry:
                    raise
                log.error("step %d: %s; uploading them again", step, exc)
                index = self._load_chunk_index().without(exc.missing)
                self._chunk_index = index  # later saves must not name them either
            except ResumedChunksTooOldError as exc:
                if retry:
                    raise
                log.warning("step %d: %s; uploading them again", step, exc)
                index = self._load_chunk_index()  # without the interrupted attempts
            except ChunkSourceDroppedError as exc:
                if retry:
                    raise
                log.warning("step %d: %s; uploading it again in full", step, exc)
                index = chunks.ChunkIndex()
        raise AssertionError("unreachable")  # pragma: no cover

    def begin(self, step: int) -> BegunAttempt:
        """Claim the run if no one has yet (``prepare``), read the store's clock (the
        attempt's birth, which bounds its commit: ``committer``), choose a fresh attempt
        prefix and write its ``ATTEMPT.json``.

        Raises: FencedError, NeedsRepairError, CommitConflictError, ConfigurationError (a
        grace period the store's clock cannot resolve), StoreError.
        """
        self.check_fenced()
        self._prepare()
        epoch = self.committer.epoch
        assert epoch is not None  # claimed by prepare
        grace = self.committer.settings.gc_grace_s
        check_grace(grace, self.store)
        max_age = max_attempt_age(grace, self.store.clock_resolution)
        # Read before ATTEMPT.json is written: never later than the time GC dates it by.
        born = call_with_retries(self.store.now, what="read the store's clock")
        remote_id = attempt_layout.new_attempt_id(dt.datetime.now(dt.timezone.utc))
        prefix = attempt_layout.ckpt_prefix(step, epoch, remote_id)
        self._put_idempotent(
            prefix + attempt_layout.ATTEMPT_NAME,
            attempt_layout.attempt_body(
                ckpt=prefix,
                step=step,
                epoch=epoch,
                writer_id=self.writer_id,
                started_at=dt.datetime.now(dt.timezone.utc),
            ),
        )
        failpoint("save.after_marker")
        return BegunAttempt(
            step=step,
            epoch=epoch,
            commit_id=remote_id,
            prefix=prefix,
            age=AttemptAge(born, max_age),
        )

    def upload(
        self,
        begun: BegunAttempt,
        files: Files,
        index: chunks.ChunkIndex | None = None,
    ) -> tuple[list[FileEntry], chunks.UploadStats]:
        """Upload a save's files into its attempt: as chunks, skipping those ``index``
        holds (default: ``chunk_index``), or whole with chunking off. Returns the manifest
        entries (with each staged file's mode) and what was sent and reused.

        Raises: StagingError (a staged file changed), StoreError.
        """
        if self.chunking == "off":
            entries = self.upload_files(begun.prefix, files)
            return entries, chunks.UploadStats(bytes_uploaded=sum(e.size for e in entries))
        if index is None:
            index = self.chunk_index(begun)
        return self.upload_chunks(begun.prefix, files, index)

    def upload_chunks(
        self,
        prefix: str,
        files: Files,
        index: chunks.ChunkIndex,
        progress: ProgressCallback | None = None,
        *,
        elsewhere: Iterable[str] = (),
        owed: Iterable[str] = (),
    ) -> tuple[list[FileEntry], chunks.UploadStats]:
        """Upload ``files`` as chunks (the writer's ``chunking`` mode, not ``"off"``) into
        the attempt at ``prefix``, naming the chunks ``index`` holds instead of uploading
        them: ``upload``'s, and a multi-rank save's ranks' (which know only the prefix and
        the index of the checkpoint the save builds on; ``elsewhere`` and ``owed``: the
        chunks other ranks put, and those this rank puts for them, ``chunks.upload_chunked``).
        ``progress``: default, the writer's own. Returns the entries (with each staged file's mode) and what was sent
        and reused (``UploadStats.sources``: the checkpoints the commit must still retain).

        Raises: StagingError (a staged file changed), StoreError.
        """
        assert self.chunking != "off"
        entries, stats = chunks.upload_chunked(
            self.engine,
            self.store,
            prefix,
            files,
            index,
            self.chunking,
            progress or self.progress,
            elsewhere=elsewhere,
            owed=owed,
        )
        return with_modes(entries, files), stats

    def chunk_index(self, begun: BegunAttempt) -> chunks.ChunkIndex:
        """The chunks ``begun`` may name instead of uploading: those of the last
        checkpoint this writer committed (or the current one), and those interrupted
        attempts of the same step uploaded and GC cannot own before the commit (one
        listing; ``chunks.interrupted_chunks``).

        Raises: StoreError (the listing).
        """
        latest = self.committer.latest
        referenced = latest.referenced_prefixes() if latest is not None else set()
        resumable = chunks.interrupted_chunks(
            self.store, begun.step, referenced, begun.prefix, begun.age.born, begun.age.max_age_s
        )
        return self._load_chunk_index().plus(resumable)

    def upload_files(
        self,
        prefix: str,
        files: Files,
        progress: ProgressCallback | None = None,
        *,
        chunked: bool = False,
    ) -> list[FileEntry]:
        """Upload ``files`` whole into the attempt at ``prefix`` (a multi-rank save's ranks
        know only its prefix), with each staged file's mode. ``progress``: default, the
        writer's own. ``chunked`` (and chunking not ``"off"``): as content-addressed chunks
        on the 8 MiB grid instead, all of them (no index: the DCP writer), so a reader can
        verify any part of a file on its own (``cloudckpt.fetch``).

        Raises: StagingError, StoreError.
        """
        if chunked and self.chunking != "off":
            entries, _ = chunks.upload_chunked(
                self.engine,
                self.store,
                prefix,
                files,
                chunks.ChunkIndex(),
                "fixed",
                progress or self.progress,
            )
            return with_modes(entries, files)
        entries = self.engine.upload_files(
            self.store, prefix + attempt_layout.FILES_DIR, files, progress or self.progress
        )
        return with_modes(entries, files)

    def finish(
        self,
        begun: BegunAttempt,
        entries: Sequence[FileEntry],
        metadata: Mapping[str, Any],
        *,
        requires: Callable[[Latest], None] | None = None,
        resumed: dt.datetime | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> tuple[Latest, Manifest]:
        """Check that every file and chunk the manifest will name is stored whole (one
        listing per prefix), write the manifest (create-only) and commit it with the
        fenced compare-and-swap of LATEST. A ``FencedError`` is kept (``fenced``).
        ``requires``: the check every LATEST the commit replaces must pass;
        ``resumed``: the birth of the oldest interrupted attempt whose chunks the entries
        name (the commit is bounded by its age too: ``AttemptAge.resuming``);
        ``metrics``: numbers recorded with the checkpoint (``retention.clean_metrics``).

        Raises: StoreError, ReusedChunkMissingError, FencedError, CommitConflictError,
        CommitStateUnknownError, StaleAttemptError, ResumedChunksTooOldError,
        NeedsRepairError.
        """
        entries = list(entries)
        prefix = begun.prefix
        try:
            plain = [e for e in entries if e.chunks is None]
            self._check_uploaded(prefix + attempt_layout.FILES_DIR, plain)
            chunks.check_uploaded(self.store, prefix, entries)
        except StoreError:
            # Its own upload missing or short: if the attempt outlived the grace period, GC
            # may have collected it, and that is what to say (not "a proxy lost bytes").
            self._raise_if_stale(begun)
            raise
        now = dt.datetime.now(dt.timezone.utc)
        # One algorithm per manifest: the files' (a copy keeps its source's digests).
        algorithms = {e.algorithm for e in entries} or {digest.check(None)}
        if len(algorithms) != 1:
            raise ValueError(f"files digested with {sorted(algorithms)} in one checkpoint")
        manifest = Manifest(
            ckpt=prefix,
            step=begun.step,
            epoch=begun.epoch,
            commit_id=begun.commit_id,
            writer_id=self.writer_id,
            created_at=canonical.iso(now),
            files=tuple(entries),
            metadata=metadata,
            metrics=clean_metrics(metrics),
            algorithm=algorithms.pop(),
        )
        body = manifest.to_bytes()
        self._put_create(prefix + attempt_layout.MANIFEST_NAME, body)
        failpoint("save.after_manifest")
        age = self._dated_as_gc_dates(begun)
        try:
            with self.commit_lock:
                latest = self.committer.commit(
                    manifest.record(body, now),
                    age=age.resuming(resumed),
                    requires=requires,
                )
        except FencedError as exc:
            self._fenced = exc
            raise
        if manifest.chunked:
            self._chunk_index = chunks.ChunkIndex.of(manifest)
        self._warn_unranked(latest)
        return latest, manifest

    def _warn_unranked(self, latest: Latest) -> None:
        """Warn, at the first commit that shows it, that keep-best ranks by a metric this
        save's metrics lack (``retention.unranked``: a mistyped name throws the best
        checkpoint away). Judged on the settings the commit applied (the run's, when this
        writer set none), once per metric name."""
        settings, record = latest.settings, latest.current
        metric = settings.best_metric
        if record is None or metric is None or metric in self._unranked_warned:
            return
        warning = unranked(settings.retention, latest.retained(), saved=record)
        if warning is not None:
            self._unranked_warned.add(metric)
            log.warning("%s: %s", self.store.url, warning)

    # -------------------------------------------------------------------- internals

    def _load_chunk_index(self) -> chunks.ChunkIndex:
        """The chunks of the last checkpoint committed (after a restart: one GET of the
        current checkpoint's manifest; an unreadable one means an empty index)."""
        if self._chunk_index is None:
            latest = self.committer.latest
            self._chunk_index = chunks.ChunkIndex()
            if latest is not None and latest.current is not None:
                try:
                    self._chunk_index = chunks.ChunkIndex.of(
                        fetch_manifest(self.store, latest.current)
                    )
                except UnknownFormatError:
                    raise  # a newer version's checkpoint: no save over it
                except CloudCkptError as exc:
                    log.warning("cannot read the current manifest (%s); uploading in full", exc)
        return self._chunk_index

    def _dated_as_gc_dates(self, begun: BegunAttempt) -> AttemptAge:
        """``begun``'s age, its birth taken as GC takes it: the oldest ``last_modified``
        of its objects, listed once every one is written (the manifest last). The birth
        read before ``ATTEMPT.json`` is never later than that on a clock that only moves
        forward; a store clock that steps back between that read and a write dates the
        object earlier, and GC would own the attempt before the commit's bound said so
        (issue 28 item 4). Raises StoreError (the listing)."""
        listed = call_with_retries(
            lambda: list(self.store.list(begun.prefix)), what=f"list {begun.prefix}"
        )
        return begun.age.dated(o.last_modified for o in listed)

    def _raise_if_stale(self, begun: BegunAttempt) -> None:
        """Raise StaleAttemptError if ``begun`` is older than its commit may be (on the
        store's clock); a clock that cannot be read raises nothing."""
        with contextlib.suppress(StoreError):
            begun.age.check(self.store, begun.step)

    def _check_uploaded(self, files_prefix: str, entries: list[FileEntry]) -> None:
        """One listing: every file is stored with the size that was sent. A store or proxy
        that silently keeps fewer bytes would otherwise get a torn checkpoint committed."""
        if not entries:
            return
        listed = call_with_retries(
            lambda: list(self.store.list(files_prefix)), what="list the uploaded files"
        )
        sizes = {o.key[len(files_prefix) :]: o.size for o in listed}
        for entry in entries:
            stored = sizes.get(entry.path)
            if stored != entry.size:
                raise StoreError(
                    f"{self.store.url}{files_prefix}{entry.path} holds "
                    f"{'nothing' if stored is None else f'{stored} bytes'} after uploading "
                    f"{entry.size} bytes; the checkpoint was not committed",
                    key=files_prefix + entry.path,
                    hint="The store or a proxy lost part of the upload. Save again; "
                    "check any proxy between this host and the store",
                )

    def _put_idempotent(self, key: str, body: bytes) -> None:
        call_with_retries(
            lambda: self.store.put(key, body, mode=OVERWRITE),
            retry_on=IDEMPOTENT_RETRY,
            what=f"write {key}",
        )

    def _put_create(self, key: str, body: bytes) -> None:
        """Create-only put that treats finding its own bytes (an SDK retry) as success."""
        try:
            call_with_retries(
                lambda: self.store.put(key, body, mode=CREATE),
                retry_on=IDEMPOTENT_RETRY,
                what=f"write {key}",
            )
        except PreconditionFailedError:
            existing, _ = self.store.get(key)
            if existing != body:
                raise StoreError(f"{self.store.url}{key} was written by someone else") from None
