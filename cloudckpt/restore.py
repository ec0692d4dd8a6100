"""Verified restore with fallback (docs/design.md §7).

A restore reads LATEST, picks the newest retained checkpoint (or the requested step),
checks its manifest against the digest LATEST recorded, checks every object's size with one
listing, downloads in parallel while hashing, and moves the result into place only after
every byte verified. A damaged or missing checkpoint is reported and the next older one is
tried. Network failures are not "damage": they raise, so a blip never silently restores an
older checkpoint. Which checkpoints are tried, in which order, and how a restore falls back
(or reads LATEST again when one was collected under it) is ``cloudckpt.reader``'s; this
module checks the destination, downloads a checkpoint and moves it into place.

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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cloudckpt import chunks, protocol, reader
from cloudckpt.errors import (
    CorruptionError,
    DestinationNotEmptyError,
    StagingError,
    UnsafePathError,
)
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.protocol import CheckpointRecord, FileEntry, Manifest

# What a restore reads and how it falls back live in ``cloudckpt.reader``; these names
# were defined here first and are still imported from here.
from cloudckpt.reader import (  # noqa: F401
    MAX_LATEST_REREADS,
    SkippedCheckpoint,
    candidates,
    check_objects,
    dropped_reason,
    fetch_manifest,
    load_latest_for_reading,
    nothing_restored,
    reread_if_dropped,
)
from cloudckpt.stores import Store
from cloudckpt.transfer import ProgressCallback, TransferEngine

log = logging.getLogger("cloudckpt.restore")


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


# --------------------------------------------------------------------------- destination


def prepare_destination(into: Path, overwrite: bool) -> Path:
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


def place(tmp: Path, dest: Path) -> None:
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


# --------------------------------------------------------------------------- file modes


def process_umask() -> int:
    """The process's umask (read from /proc where it can be, without changing it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and put back (a brief, harmless window)
    os.umask(mask)
    return mask


def safe_mode(mode: int, umask: int) -> int:
    """The permission bits a restore gives a file whose manifest records ``mode``: its
    read, write and execute bits (``protocol.MODE_BITS``) less the umask, as ``tar``
    does for a user. Never setuid, setgid or sticky: a manifest is data, and a hostile
    one must not plant a setuid program or a world-writable file."""
    return mode & protocol.MODE_BITS & ~umask


def apply_modes(root: Path, entries: Iterable[FileEntry]) -> None:
    """Give each restored file under ``root`` its recorded mode (``safe_mode``); files
    without one keep what they were created with. The files must be the ones this restore
    created (so no link can be followed: each is opened with ``O_NOFOLLOW``).

    Raises OSError.
    """
    umask = process_umask()
    for entry in entries:
        if entry.mode is None:
            continue
        fd = os.open(root.joinpath(*entry.path.split("/")), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, safe_mode(entry.mode, umask))
        finally:
            os.close(fd)


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
        apply_modes(tmp, manifest.files)  # after every file verified
    except OSError as exc:
        full = out_of_space(exc, record.step, manifest.total_bytes, tmp.parent)
        if full is None:
            raise
        raise full from exc
    return manifest


def _restore_one(
    store: Store,
    engine: TransferEngine,
    record: CheckpointRecord,
    dest: Path,
    progress: ProgressCallback | None,
) -> Manifest | reader.Damaged:
    """Download ``record``, verified, beside ``dest`` and move it into place; or, if it is
    damaged or missing, why (``dest`` untouched). Raises StagingError, StoreError."""
    tmp = dest.with_name(f".{dest.name}.cloudckpt-tmp-{secrets.token_hex(4)}")
    try:
        manifest = _download(store, engine, record, tmp, progress)
        failpoint("restore.after_download")
        place(tmp, dest)
    except (CorruptionError, UnsafePathError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return reader.Damaged.of(exc)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    todo, from_records = reader.readable(store, step)
    dest = prepare_destination(into, overwrite)

    found = reader.first_intact(
        store,
        todo,
        step,
        lambda record: _restore_one(store, engine, record, dest, progress),
        from_records=from_records,
    )
    record, manifest = found.record, found.value
    if found.skipped:
        # Each skip was warned about as it happened (reader.first_intact).
        log.info(
            "restored step %d after skipping %d checkpoint(s)", record.step, len(found.skipped)
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
        skipped=found.skipped,
        from_commit_records=found.from_records,
    )
