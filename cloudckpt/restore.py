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
    """A checkpoint a restore could not use, and why."""

    step: int
    commit_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What a restore produced.

    ``path``: the directory holding the checkpoint's files. ``skipped``: newer checkpoints
    that were damaged or missing, newest first. ``from_commit_records``: LATEST was missing
    or unreadable and the commit records were used instead.
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


def _prepare_destination(into: Path, overwrite: bool) -> None:
    if into.exists() and not into.is_dir():
        raise DestinationNotEmptyError(f"{into} exists and is not a directory")
    if into.is_dir() and any(into.iterdir()) and not overwrite:
        raise DestinationNotEmptyError(f"{into} is not empty")
    into.parent.mkdir(parents=True, exist_ok=True)
    # A restore into this destination that was killed (SIGKILL, power loss) leaves its
    # temporary directory beside it; nothing else writes these names.
    for leftover in into.parent.glob(f".{glob.escape(into.name)}.cloudckpt-*-*"):
        if leftover.is_dir() and leftover.name.split(".cloudckpt-")[-1][:4] in ("tmp-", "old-"):
            log.info("removing %s, left by an interrupted restore", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _place(tmp: Path, into: Path) -> None:
    """Move the verified ``tmp`` to ``into`` (rename(2) replaces an empty directory)."""
    aside = None
    if into.is_dir() and any(into.iterdir()):
        aside = into.with_name(f".{into.name}.cloudckpt-old-{secrets.token_hex(4)}")
        os.rename(into, aside)
    os.rename(tmp, into)
    fd = os.open(into.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def restore(
    store: Store,
    into: str | os.PathLike[str],
    engine: TransferEngine,
    *,
    step: int | None = None,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
) -> RestoreResult:
    """Restore the newest intact checkpoint (or ``step``) into the directory ``into``.

    Raises:
        CheckpointNotFoundError: nothing is committed (or no retained checkpoint has ``step``).
        CorruptionError: every candidate was damaged; ``exc.skipped`` says why each failed.
            The destination is untouched.
        DestinationNotEmptyError: ``into`` holds files and ``overwrite`` is False.
        StagingError: not enough local space.
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
    _prepare_destination(into, overwrite)

    skipped: list[SkippedCheckpoint] = []
    for record in todo:
        tmp = into.with_name(f".{into.name}.cloudckpt-tmp-{secrets.token_hex(4)}")
        try:
            manifest = fetch_manifest(store, record)
            check_objects(store, record, manifest)
            free = shutil.disk_usage(into.parent).free
            if manifest.total_bytes > free:
                raise StagingError(
                    f"restoring step {record.step} needs {manifest.total_bytes} bytes; "
                    f"{into.parent} has {free} free",
                    hint="Free space or restore somewhere larger",
                )
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
            failpoint("restore.after_download")
            _place(tmp, into)
        except (CorruptionError, UnsafePathError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("checkpoint of step %d is unusable: %s", record.step, exc.message)
            skipped.append(SkippedCheckpoint(record.step, record.commit_id, exc.message))
            continue
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if skipped:
            log.warning(
                "restored step %d after skipping %d damaged checkpoint(s)",
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
    raise CorruptionError(
        f"no intact checkpoint in {store.url}: "
        + "; ".join(f"step {s.step}: {s.reason}" for s in skipped),
        skipped=skipped,
    )
