"""Verified restore with fallback (DESIGN §7).

A restore reads LATEST, picks the newest retained checkpoint (or the requested step),
checks its manifest against the digest LATEST recorded, checks every object's size with one
listing, downloads in parallel while hashing, and moves the result into place only after
every byte verified. A damaged or missing checkpoint is reported and the next older one is
tried. Network failures are not "damage": they raise, so a blip never silently restores an
older checkpoint.

Paths in a manifest are untrusted: anything absolute, with ``..``, or naming both a file and
a directory is refused before a byte is written, and files are created with ``O_EXCL`` in a
fresh temporary directory beside the destination, so nothing lands outside it.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import logging
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloudckpt import chunks, protocol
from cloudckpt.committer import read_latest
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    CorruptionError,
    DestinationNotEmptyError,
    ObjectNotFoundError,
    StagingError,
    UnsafePathError,
)
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.protocol import CheckpointRecord, CorruptRecordError, Latest, Manifest
from cloudckpt.retry import call_with_retries
from cloudckpt.stores import Store
from cloudckpt.transfer import ProgressCallback, TransferEngine

log = logging.getLogger("cloudckpt.restore")


@dataclasses.dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint a restore could not use, and why. ``dropped``: not damage: retention
    dropped it (and GC collected its data) while the restore read it, so the restore read
    LATEST again and went on with the checkpoints retained now."""

    step: int
    commit_id: str
    reason: str
    dropped: bool = False


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What a restore produced.

    ``path``: the directory holding the checkpoint's files. ``skipped``: checkpoints tried
    first that were damaged or missing, in the order tried (``dropped`` ones were collected
    while being read; the restore then read LATEST again, so the checkpoint restored may be
    newer than them). ``from_commit_records``: LATEST was missing or unreadable and the
    commit records were used instead.
    """

    step: int
    path: Path
    metadata: Mapping[str, Any]
    commit_id: str
    ckpt: str
    epoch: int
    num_files: int
    total_bytes: int
    skipped: tuple[SkippedCheckpoint, ...] = ()
    from_commit_records: bool = False


def load_latest_for_reading(store: Store) -> tuple[Latest | None, bool]:
    """LATEST for a reader, or, when it is missing or corrupt, the newest commit record
    that verifies (loudly). Returns (latest or None, whether commit records were used)."""
    try:
        current = read_latest(store)
    except CorruptRecordError as exc:
        log.warning("LATEST of %s is unreadable (%s); using the commit records", store.url, exc)
        current = None
        damaged = True
    else:
        damaged = False
    if current is not None:
        return current.latest, False
    records = sorted(store.list(protocol.COMMITS_PREFIX), key=lambda o: o.key, reverse=True)
    for obj in records:
        try:
            data, _ = store.get(obj.key)
            latest = protocol.parse_latest(data, what=obj.key)
        except (CorruptRecordError, ObjectNotFoundError) as exc:
            log.warning("skipping commit record %s: %s", obj.key, exc)
            continue
        if not damaged:
            log.warning("%s has no LATEST; using commit record %s", store.url, obj.key)
        return latest, True
    return None, bool(records) or damaged


def fetch_manifest(store: Store, record: CheckpointRecord) -> Manifest:
    """The manifest ``record`` names, verified against the recorded size and digest.

    Raises CorruptionError (missing, damaged) or UnsafePathError (hostile paths).
    """
    try:
        # Ask for one byte more than recorded: a longer object is damage, and a hostile
        # multi-gigabyte "manifest" is never read whole.
        data = call_with_retries(
            lambda: store.get_range(record.manifest_key, 0, record.manifest_size + 1),
            what="read manifest",
        )
    except ObjectNotFoundError:
        raise CorruptionError(f"the manifest of step {record.step} is missing") from None
    return protocol.parse_manifest(data, record)


def check_objects(store: Store, record: CheckpointRecord, manifest: Manifest) -> None:
    """Every file of ``manifest`` exists with its recorded size (one listing, no data).

    Raises CorruptionError naming the first missing or resized file.
    """
    if manifest.chunked:
        chunks.check_chunk_objects(store, manifest, record.step)
    plain = [e for e in manifest.files if e.chunks is None]
    if not plain:
        return
    prefix = record.ckpt + protocol.FILES_DIR
    sizes = {o.key[len(prefix) :]: o.size for o in store.list(prefix)}
    for entry in plain:
        size = sizes.get(entry.path)
        if size is None:
            raise CorruptionError(f"{entry.path} of step {record.step} is missing")
        if size != entry.size:
            raise CorruptionError(
                f"{entry.path} of step {record.step} is {size} bytes, manifest says {entry.size}"
            )


def candidates(latest: Latest, step: int | None) -> list[CheckpointRecord]:
    """Checkpoints to try, newest first (only those of ``step`` when it is given)."""
    retained = latest.retained()
    if step is None:
        return retained
    return [r for r in retained if r.step == step]


#: How many times one restore reads LATEST again after the checkpoint it was reading was
#: dropped and collected under it; each time needs a whole grace period to pass meanwhile.
MAX_LATEST_REREADS = 3


def reread_if_dropped(
    store: Store,
    record: CheckpointRecord,
    step: int | None,
    tried: set[str],
    rereads: int,
) -> tuple[list[CheckpointRecord], bool] | None:
    """After ``record`` turned out damaged or missing: read LATEST again. If it still
    retains ``record``, the failure is damage: None (fall back as usual). If not,
    retention dropped it while the restore read it, and GC collected it after the grace
    period: the checkpoints to try now (the fresh LATEST's, minus those in ``tried``) and
    whether they come from the commit records. ``rereads``: how many times this restore
    already did this.

    Raises:
        CheckpointNotFoundError: this happened ``MAX_LATEST_REREADS`` times already (the
            restore is slower than the run's grace period).
        StoreError: LATEST could not be read.
    """
    latest, from_records = load_latest_for_reading(store)
    if latest is None or any(r.commit_id == record.commit_id for r in latest.retained()):
        return None
    if rereads >= MAX_LATEST_REREADS:
        raise CheckpointNotFoundError(
            f"the checkpoint this restore was reading from {store.url} was dropped by "
            f"retention and collected by GC under it {rereads + 1} times (last: step "
            f"{record.step}); the restore takes longer than the run's grace period "
            f"({latest.settings.gc_grace_s}s)",
            hint="Restore where the store is faster, or raise the run's gc_grace "
            "(CheckpointManager(gc_grace=...)) so readers get longer before GC deletes",
        )
    todo = [r for r in candidates(latest, step) if r.commit_id not in tried]
    log.warning(
        "step %d (%s) was dropped by retention and collected while this restore read it; "
        "read LATEST again: %s",
        record.step,
        record.commit_id,
        f"restoring step {todo[0].step}" if todo else "nothing else to try",
    )
    return todo, from_records


def dropped_reason(failure: str) -> str:
    """``SkippedCheckpoint.reason`` of a checkpoint collected while it was read."""
    return (
        f"dropped by retention and collected while this restore read it ({failure}); "
        "LATEST was read again"
    )


def nothing_restored(
    url: str, skipped: list[SkippedCheckpoint], step: int | None
) -> CloudCkptError:
    """The error of a restore that ran out of checkpoints: CheckpointNotFoundError if every
    one it tried was dropped meanwhile (``step`` is no longer retained), else
    CorruptionError naming every reason."""
    if skipped and all(s.dropped for s in skipped):
        what = "the checkpoints" if step is None else f"step {step}"
        return CheckpointNotFoundError(
            f"{url} no longer retains {what} this restore was asked for: retention dropped "
            "it and GC collected it while the restore read it"
        )
    return CorruptionError(
        f"no intact checkpoint in {url}: "
        + "; ".join(f"step {s.step}: {s.reason}" for s in skipped),
        skipped=skipped,
    )


# --------------------------------------------------------------------------- destination


def _prepare_destination(into: Path, overwrite: bool) -> Path:
    """Check the destination and return the directory a restore writes: ``into``, or
    the directory it is a symbolic link to (the link is kept; a restore replaces what it
    points to, with its temporary directory beside that, on the same filesystem).

    Raises DestinationNotEmptyError: ``into`` holds files (without ``overwrite``), is a
    file, a link to a file or to nothing, or is a mount point.
    """
    dest = _real_destination(into)
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise DestinationNotEmptyError(f"{into} is not empty")
    if dest.is_dir() and os.path.ismount(dest):
        raise DestinationNotEmptyError(
            f"{into} is a mount point: a restore moves a finished directory into place "
            "with rename(2), which cannot replace a mount point",
            hint=f"Restore into a directory inside it, e.g. {into / 'checkpoint'}",
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A restore into this destination that was killed (SIGKILL, power loss) leaves its
    # temporary directory beside it; nothing else writes these names.
    for leftover in dest.parent.glob(f".{glob.escape(dest.name)}.cloudckpt-*-*"):
        if leftover.is_dir() and leftover.name.split(".cloudckpt-")[-1][:4] in ("tmp-", "old-"):
            log.info("removing %s, left by an interrupted restore", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
    return dest


def _real_destination(into: Path) -> Path:
    """``into`` with every symbolic link resolved. Raises DestinationNotEmptyError."""
    for link in (into, *into.parents):
        if link.is_symlink() and not link.exists():
            raise DestinationNotEmptyError(
                f"{link} is a symbolic link to {os.readlink(link)}, which does not exist",
                hint="Create the directory it points to (is its volume mounted?), or restore "
                "somewhere else",
            )
    dest = Path(os.path.realpath(into))
    if dest.exists() and not dest.is_dir():
        target = f" (a symbolic link to {dest})" if into.is_symlink() else ""
        raise DestinationNotEmptyError(
            f"{into}{target} exists and is not a directory",
            hint="Restore into a directory (new or empty; or pass overwrite=True, CLI: "
            "--force, to replace a directory's contents)",
        )
    return dest


def _place(tmp: Path, dest: Path) -> None:
    """Move the verified ``tmp`` to ``dest`` (rename(2) replaces an empty directory); a
    ``dest`` that holds files is moved aside first, and back if the move fails."""
    aside = None
    if dest.is_dir() and any(dest.iterdir()):
        aside = dest.with_name(f".{dest.name}.cloudckpt-old-{secrets.token_hex(4)}")
        os.rename(dest, aside)
    try:
        os.rename(tmp, dest)
    except BaseException:
        if aside is not None:
            os.rename(aside, dest)
        raise
    fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


_NO_SPACE = {errno.ENOSPC: "the disk filled up", errno.EDQUOT: "the disk quota ran out"}


def check_space(step: int, need: int, where: Path) -> None:
    """Raises StagingError if ``where`` has less than ``need`` bytes free."""
    free = shutil.disk_usage(where).free
    if need > free:
        raise StagingError(
            f"restoring step {step} needs {need} bytes; {where} has {free} free",
            hint="Free space or restore somewhere larger",
        )


def out_of_space(exc: OSError, step: int, need: int, where: Path) -> StagingError | None:
    """The StagingError for a local write that failed with ENOSPC/EDQUOT (the disk filled
    after the free-space check), or None for any other OSError."""
    what = _NO_SPACE.get(exc.errno)
    if what is None:
        return None
    try:
        free = f"{shutil.disk_usage(where).free} bytes free now"
    except OSError:
        free = "free space unknown"
    return StagingError(
        f"restoring step {step} needs {need} bytes in {where}; {what} while it was written "
        f"({free})",
        hint="Nothing was restored: the destination is as it was and the partial download "
        "was removed. Free space on that volume, or restore somewhere larger",
    )


# --------------------------------------------------------------------------- restore


def _download(
    store: Store,
    engine: TransferEngine,
    record: CheckpointRecord,
    tmp: Path,
    progress: ProgressCallback | None,
) -> Manifest:
    """Check ``record`` and download it, verified, into the new directory ``tmp``.
    Raises CorruptionError, UnsafePathError, StagingError (no space), StoreError."""
    manifest = fetch_manifest(store, record)
    check_objects(store, record, manifest)
    check_space(record.step, manifest.total_bytes, tmp.parent)
    try:
        tmp.mkdir()
        chunks.download(
            engine,
            store,
            record.ckpt + protocol.FILES_DIR,
            manifest.files,
            tmp,
            manifest.chunk_size,
            progress,
        )
    except OSError as exc:
        full = out_of_space(exc, record.step, manifest.total_bytes, tmp.parent)
        if full is None:
            raise
        raise full from exc
    return manifest


def restore(
    store: Store,
    into: str | os.PathLike[str],
    engine: TransferEngine,
    *,
    step: int | None = None,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
) -> RestoreResult:
    """Restore the newest intact checkpoint (or ``step``) into the directory ``into`` (a
    symbolic link to a directory restores into that directory and stays a link).

    A checkpoint that turns out missing because retention dropped it and GC collected it
    while this restore read it is not damage: LATEST is read again and its checkpoints
    tried (see ``reread_if_dropped``).

    Raises:
        CheckpointNotFoundError: nothing is committed (or no retained checkpoint has
            ``step``, or it was dropped and collected while it was being read).
        CorruptionError: every candidate was damaged; ``exc.skipped`` says why each failed.
            The destination is untouched.
        DestinationNotEmptyError: ``into`` holds files and ``overwrite`` is False, or it is
            not a directory (a file, a link to a file or to nothing, a mount point).
        StagingError: not enough local space (checked first; or the disk filled during the
            download). The destination is untouched.
        StoreError: the store failed (after retries); the destination is untouched.
    """
    into = Path(into).expanduser().absolute()
    latest, from_records = load_latest_for_reading(store)
    if latest is None:
        if from_records:
            raise CorruptionError(
                f"LATEST of {store.url} is unreadable and no commit record verifies"
            )
        raise CheckpointNotFoundError(f"{store.url} has no committed checkpoint")
    todo = candidates(latest, step)
    if not todo:
        what = (
            "no committed checkpoint" if step is None else f"no retained checkpoint of step {step}"
        )
        raise CheckpointNotFoundError(f"{store.url} has {what}")
    dest = _prepare_destination(into, overwrite)

    skipped: list[SkippedCheckpoint] = []
    tried: set[str] = set()
    rereads = 0
    while todo:
        record = todo.pop(0)
        tried.add(record.commit_id)
        tmp = dest.with_name(f".{dest.name}.cloudckpt-tmp-{secrets.token_hex(4)}")
        try:
            manifest = _download(store, engine, record, tmp, progress)
            failpoint("restore.after_download")
            _place(tmp, dest)
        except (CorruptionError, UnsafePathError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            fresh = None
            if isinstance(exc, CorruptionError):
                fresh = reread_if_dropped(store, record, step, tried, rereads)
            if fresh is None:
                log.warning("checkpoint of step %d is unusable: %s", record.step, exc.message)
                skipped.append(SkippedCheckpoint(record.step, record.commit_id, exc.message))
                continue
            (todo, from_records), rereads = fresh, rereads + 1
            skipped.append(
                SkippedCheckpoint(record.step, record.commit_id, dropped_reason(exc.message), True)
            )
            continue
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if skipped:
            log.warning(
                "restored step %d after skipping %d checkpoint(s)",
                record.step,
                len(skipped),
            )
        return RestoreResult(
            step=record.step,
            path=into,
            metadata=dict(record.metadata),
            commit_id=record.commit_id,
            ckpt=record.ckpt,
            epoch=record.epoch,
            num_files=len(manifest.files),
            total_bytes=manifest.total_bytes,
            skipped=tuple(skipped),
            from_commit_records=from_records,
        )
    raise nothing_restored(store.url, skipped, step)
