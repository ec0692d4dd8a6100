"""``copy_checkpoint``: a committed checkpoint into another run, on the same store or
another, verified and committed through the destination's own LATEST (``cloudckpt cp``;
the copy itself is ``cloudckpt.copying``, docs/design.md §11)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from cloudckpt import chunks, protocol, reader
from cloudckpt.admin import WriterStatus, check_takeover
from cloudckpt.attempts import AttemptWriter
from cloudckpt.catalog.opening import Where, opened, transfer_engine
from cloudckpt.committer import Committer
from cloudckpt.errors import (
    ConfigurationError,
    CorruptionError,
    CorruptRecordError,
    UnsafePathError,
)
from cloudckpt.manifests import Manifest
from cloudckpt.protocol import CheckpointRecord, Latest
from cloudckpt.reader import SkippedCheckpoint
from cloudckpt.retention import POLICY_FIELDS
from cloudckpt.stores import Store
from cloudckpt.transfer import ProgressCallback, TransferConfig, TransferEngine


@dataclasses.dataclass(frozen=True)
class CopyResult:
    """A checkpoint copied into another run (``copy_checkpoint``).

    ``step``/``commit_id``: the source checkpoint; ``dest_step``, ``dest_commit_id``,
    ``dest_ckpt``, ``dest_epoch``, ``dest_seq``: what the destination committed.
    ``bytes_read``: read from the source; ``bytes_uploaded``: sent to the destination;
    ``bytes_reused``: named where the destination already held them (``bytes_resumed``
    of them: chunks an interrupted copy or save of the same step had uploaded).
    ``fenced_writer``: the destination's writer this copy fenced (None for a new run).
    ``noop``: the destination already retained this content as ``dest_step``
    (``copying.already_held``): no data was read, nothing written or committed; the ``dest_*``
    fields name the checkpoint it holds (``dest_seq``: its LATEST's seq; every byte count
    0). ``settings_copied``: the source run's retention settings were carried over.
    """

    source: str
    dest: str
    step: int
    commit_id: str
    dest_step: int
    dest_commit_id: str
    dest_ckpt: str
    dest_epoch: int
    dest_seq: int
    num_files: int
    total_bytes: int
    bytes_read: int
    bytes_uploaded: int
    bytes_reused: int
    bytes_resumed: int
    skipped: tuple[SkippedCheckpoint, ...] = ()
    from_commit_records: bool = False
    fenced_writer: WriterStatus | None = None
    seconds: float = 0.0
    noop: bool = False
    settings_copied: bool = False


#: Writer ids of the copies this process ran (to the end, or to a failure): none of them
#: writes again, so a later copy into the same run need not be forced past them.
_FINISHED_COPIES: set[str] = set()


# Long by its signature and its docstring (public API); the code is ~30 lines.
def copy_checkpoint(
    src: Where,
    dst: Where,
    *,
    step: int | None = None,
    dest_step: int | None = None,
    force: bool = False,
    keep_settings: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    dest_options: Mapping[str, Any] | None = None,
    transfer: TransferConfig | None = None,
    progress: ProgressCallback | None = None,
) -> CopyResult:
    """Copy the newest intact checkpoint of ``src`` (or ``step``) into the run ``dst``
    (same store or another: s3 -> gs, a bucket -> a local directory) as ``dest_step``
    (default: the same step), where it becomes the current checkpoint, with its metadata
    and metrics.

    The destination is written only through its own commit protocol (docs/design.md §11,
    "Copying a checkpoint"): the copy claims the destination run, like ``push``, which
    fences the writer that owned it; if that writer wrote LATEST within the last hour it
    is probably still training, and the copy refuses unless ``force``. A new run is
    created (a location holding anything else is refused: ``NotARunError``). Chunks the
    destination already holds are named, not sent (and not read when whole leaves), as
    are those of an interrupted copy of the same step. Every byte read from the source is
    verified; a damaged source checkpoint is skipped for the next older one (with ``step``:
    none), and nothing of it is committed.

    If the destination already retains a checkpoint of ``dest_step`` with this content
    (the same files, metadata and metrics), nothing is copied (``CopyResult.noop``): a
    copy run twice commits once. The destination keeps its retention settings (a new run
    gets the defaults); ``keep_settings`` gives it the source run's instead (keep_last,
    keep_every, keep-best, periods; not the grace period), so an archive keeps what the
    source keeps (its best checkpoint by a metric, say).

    Raises:
        ConfigurationError: ``src`` and ``dst`` are the same run; NotARunError.
        ActiveWriterError: the destination's writer is active and not ``force``.
        CheckpointNotFoundError, CorruptionError: nothing (intact) to copy.
        FencedError: another writer claimed the destination during the copy.
        StoreError, StaleAttemptError, NeedsRepairError (the destination's LATEST).
    """
    started = time.perf_counter()
    with (
        opened(src, storage_options) as source,
        opened(dst, dest_options, writable=True) as target,
        transfer_engine(transfer) as engine,
    ):
        if source.url == target.url:
            raise ConfigurationError(
                f"{source.url} is both the source and the destination",
                hint="Copy into another run; to make an older step current again, restore "
                "it and push it",
            )
        latest, todo, from_records = reader.readable_latest(source, step)
        writer_id = protocol.new_writer_id()
        settings = latest.settings if keep_settings else None
        writer = _copy_writer(target, engine, writer_id, progress, settings)
        copy = _Copy(source, writer, dest_step, force, progress)
        try:
            done = reader.first_intact(source, todo, step, copy.try_one, from_records=from_records)
        finally:
            _FINISHED_COPIES.add(writer_id)  # it never writes again
    return _copy_result(
        source, target, done, writer, copy.previous, time.perf_counter() - started, keep_settings
    )


def _copy_writer(
    target: Store,
    engine: TransferEngine,
    writer_id: str,
    progress: ProgressCallback | None,
    settings: protocol.Settings | None,
) -> AttemptWriter:
    """The copy's writer into ``target``: a new writer id, tensor-aware chunking, and the
    run's settings kept (a new run gets the defaults), or, with ``settings`` (the source
    run's), their retention rules instead."""
    if settings is None:
        run_settings, inherit = protocol.Settings(), protocol.SETTING_FIELDS
    else:
        # Its retention rules; the grace period stays the destination's (its writers and
        # GC already honour that one).
        run_settings = dataclasses.replace(
            protocol.Settings(), **{f: getattr(settings, f) for f in POLICY_FIELDS}
        )
        inherit = protocol.SETTING_FIELDS - POLICY_FIELDS
    return AttemptWriter(
        target,
        engine,
        Committer(target, writer_id, run_settings, inherit=inherit),
        chunking="tensor",
        progress=progress,
    )


@dataclasses.dataclass(frozen=True)
class _Held:
    """``_Copy.try_one``'s answer when the destination already holds the content: its
    record there, its LATEST's seq, and the source manifest."""

    record: CheckpointRecord
    seq: int
    manifest: Manifest


class _Copy:
    """One ``copy_checkpoint``: ``try_one`` copies a source checkpoint (or finds it already
    at the destination) for ``reader.first_intact``. ``previous``: the destination's
    writer that the copy fences (checked before the first write, not for a no-op)."""

    def __init__(
        self,
        source: Store,
        writer: AttemptWriter,
        dest_step: int | None,
        force: bool,
        progress: ProgressCallback | None,
    ) -> None:
        self.source, self.writer, self.dest_step = source, writer, dest_step
        self.force, self.progress = force, progress
        self.previous: WriterStatus | None = None
        self._checked = False

    def try_one(self, record: CheckpointRecord) -> Any:
        """Raises: ActiveWriterError, and what ``copying.copy_into`` raises but damage."""
        from cloudckpt.copying import already_held, copy_into

        target = self.writer.store
        step = record.step if self.dest_step is None else self.dest_step
        try:
            manifest = reader.fetch_manifest(self.source, record)
            reader.check_objects(self.source, record, manifest)
            head = _dest_latest(target)
            held = already_held(target, head, manifest, step)
            if held is not None and head is not None:
                return _Held(held, head.seq, manifest)
            if not self._checked:  # before the first write (the claim)
                self.previous = check_takeover(target, force=self.force, finished=_FINISHED_COPIES)
                self._checked = True
            return copy_into(self.writer, self.source, record, manifest, step, self.progress)
        except (CorruptionError, UnsafePathError) as exc:
            return reader.Damaged.of(exc)


def _dest_latest(target: Store) -> Latest | None:
    """The destination's LATEST, or None (a new run; one that needs repair: the copy's
    claim says so). Raises StoreError."""
    from cloudckpt.committer import read_latest

    try:
        head = read_latest(target)
    except CorruptRecordError:
        return None
    return head.latest if head is not None else None


def _copy_result(
    source: Store,
    target: Store,
    done: reader.Intact[Any],
    writer: AttemptWriter,
    previous: WriterStatus | None,
    seconds: float,
    keep_settings: bool,
) -> CopyResult:
    """What ``copy_checkpoint`` returns for the copy ``done`` (``_Copy.try_one``'s)."""
    record = done.record
    common: dict[str, Any] = {
        "source": source.url,
        "dest": target.url,
        "step": record.step,
        "commit_id": record.commit_id,
        "skipped": done.skipped,
        "from_commit_records": done.from_records,
        "seconds": round(seconds, 3),
    }
    if isinstance(done.value, _Held):
        held = done.value
        return CopyResult(
            **common,
            dest_step=held.record.step,
            dest_commit_id=held.record.commit_id,
            dest_ckpt=held.record.ckpt,
            dest_epoch=held.record.epoch,
            dest_seq=held.seq,
            num_files=len(held.manifest.files),
            total_bytes=held.manifest.total_bytes,
            bytes_read=0,
            bytes_uploaded=0,
            bytes_reused=0,
            bytes_resumed=0,
            noop=True,
        )
    begun, latest, manifest, read = done.value
    stats = writer.last_upload or chunks.UploadStats()
    return CopyResult(
        **common,
        dest_step=begun.step,
        dest_commit_id=begun.commit_id,
        dest_ckpt=begun.prefix,
        dest_epoch=begun.epoch,
        dest_seq=latest.seq,
        num_files=len(manifest.files),
        total_bytes=manifest.total_bytes,
        bytes_read=read.bytes_read,
        bytes_uploaded=stats.bytes_uploaded,
        bytes_reused=stats.bytes_reused,
        bytes_resumed=stats.bytes_resumed,
        fenced_writer=previous,
        settings_copied=keep_settings,
    )
