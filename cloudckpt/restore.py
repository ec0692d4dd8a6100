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

A partial restore (``include`` / ``exclude`` glob patterns, ``reader.select_files``) reads
only the files it selects, after the manifest verified against LATEST's record, and checks
each of them exactly as a whole restore does (its objects listed, every chunk and the
file's digest); the rest are reported (``RestoreResult.excluded``), never read.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cloudckpt import attempt_layout, digest, fetch, manifests, protocol, reader
from cloudckpt.download import download
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CorruptionError,
    DestinationNotEmptyError,
    StagingError,
    UnsafePathError,
)
from cloudckpt.failpoints import hit as failpoint
from cloudckpt.localcopy import LocalCopies, LocalCopy, place_file
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.reader import SkippedCheckpoint, check_objects, fetch_manifest
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
    commit records were used instead. ``bytes_downloaded`` / ``bytes_local``: bytes read
    from the store, and taken from a local copy in ``staging_dir`` that verified (the local
    tier, ``cloudckpt.localcopy``). ``timings`` (seconds): ``listing_s`` (LATEST, manifest,
    listing), ``transfer_s`` (to the last byte landed; hashing overlaps it),
    ``verify_s`` (checking local copies, and the digests and fsyncs after the last byte
    landed), ``place_s`` (moving into place), ``total_s``. ``excluded``: the paths of the
    checkpoint a partial restore (``include``/``exclude``) left out, never read;
    ``num_files`` and ``total_bytes`` count the files restored.
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
    bytes_downloaded: int = 0
    bytes_local: int = 0
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    excluded: tuple[str, ...] = ()


# --------------------------------------------------------------------------- destination


def prepare_destination(into: Path, overwrite: bool) -> Path:
    """Check the destination and return the directory a restore writes: ``into``, or
    the directory it is a symbolic link to (the link is kept; a restore replaces what it
    points to, with its temporary directory beside that, on the same filesystem).

    Raises DestinationNotEmptyError: ``into`` holds files (without ``overwrite``), is a
    file, a link to a file or to nothing, or is a mount point, or is, lies inside or
    (with ``overwrite``) holds a cloudckpt run on the local disk.
    """
    dest = _real_destination(into)
    refuse_run_directories(into, overwrite, "a restore")
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


def refuse_run_directories(
    dest: Path,
    overwrite: bool,
    action: str,
    hint: str | None = None,
    cli_hint: str | None = None,
) -> None:
    """Raises DestinationNotEmptyError: the local directory ``dest`` is a cloudckpt run
    (file://), lies inside one (a LATEST in a directory above it) or, with ``overwrite``
    (which replaces the directory; without it one holding files is refused anyway), holds
    one (a LATEST anywhere below). Writing there would add files to, or replace, a run's
    committed objects. ``action`` names the writer in the message ("a restore")."""
    hint, cli_hint = hint or RUN_DESTINATION_HINT, cli_hint or RUN_DESTINATION_CLI_HINT
    real = Path(os.path.realpath(dest))
    for above in (real, *real.parents):
        if os.path.lexists(above / protocol.LATEST_KEY):
            what = "is" if above == real else "is inside"
            raise DestinationNotEmptyError(
                f"{dest} {what} the cloudckpt run file://{above}: {action} would write "
                "into that run",
                hint=hint,
            ).with_cli_hint(cli_hint)
    for dirpath, _dirs, names in os.walk(real) if overwrite else ():
        if protocol.LATEST_KEY in names:
            raise DestinationNotEmptyError(
                f"{dest} holds the cloudckpt run file://{dirpath}: {action} would replace it",
                hint=hint,
            ).with_cli_hint(cli_hint)


RUN_DESTINATION_HINT = (
    "Choose a directory outside every cloudckpt run and holding none (overwrite=True, "
    "CLI: --force, replaces plain files only); to copy a checkpoint into a run, use "
    "`cloudckpt cp` (copy_checkpoint)"
)


RUN_DESTINATION_CLI_HINT = (
    "Choose a directory outside every cloudckpt run and holding none (--force replaces "
    "plain files only); to copy a checkpoint into a run, use `cloudckpt cp`"
)


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
            hint="Restore into a directory (new or empty; or pass overwrite=True to replace "
            "a directory's contents)",
        ).with_cli_hint(
            "Restore into a directory (new or empty; or pass --force to replace a "
            "directory's contents)"
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


_NO_SPACE: dict[int | None, str] = {
    errno.ENOSPC: "the disk filled up",
    errno.EDQUOT: "the disk quota ran out",
}


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
    read, write and execute bits (``manifests.MODE_BITS``) less the umask, as ``tar``
    does for a user. Never setuid, setgid or sticky: a manifest is data, and a hostile
    one must not plant a setuid program or a world-writable file."""
    return mode & manifests.MODE_BITS & ~umask


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


@dataclasses.dataclass
class _Clock:
    """Where one restore's time and bytes went (``RestoreResult.timings``)."""

    started: float = dataclasses.field(default_factory=time.perf_counter)
    listing_s: float = 0.0
    transfer_s: float = 0.0
    verify_s: float = 0.0
    place_s: float = 0.0
    downloaded: int = 0
    local: int = 0
    last_byte: float = 0.0

    def timings(self) -> dict[str, float]:
        return {
            "listing_s": self.listing_s,
            "transfer_s": self.transfer_s,
            "verify_s": self.verify_s,
            "place_s": self.place_s,
            "total_s": time.perf_counter() - self.started,
        }


def _link_local(copy: LocalCopy, entry: FileEntry, tmp: Path, link: bool = False) -> Path | None:
    """Place ``entry``'s file of ``copy`` in ``tmp``: a reflink or a copy, so the restored
    file is independent of the kept copy (a hard link only with ``link``;
    ``localcopy.place_file``). None when the local file is gone, unreadable or not a
    regular file (it is downloaded instead). Raises OSError only for failures writing
    into ``tmp``."""
    target = tmp.joinpath(*entry.path.split("/"))
    target.parent.mkdir(parents=True, exist_ok=True)
    if place_file(copy.file(entry.path), target, link=link) is None:
        return None
    return target


def _from_local(
    engine: TransferEngine,
    copy: LocalCopy | None,
    manifest: Manifest,
    tmp: Path,
    clock: _Clock,
    link: bool = False,
) -> list[FileEntry]:
    """Place the files of ``copy`` that verify against ``manifest`` in ``tmp`` (reflinked
    or copied; hard-linked with ``link``); return the entries still to download."""
    if copy is None:
        return list(manifest.files)
    started = time.perf_counter()
    # Place first, then verify what was placed: the restore's own file holds the content
    # however the local tier's retention deletes the copy meanwhile (a newer commit of this
    # manager), so what is verified is exactly what the restore keeps.
    linked = [_link_local(copy, entry, tmp, link) for entry in manifest.files]
    jobs = [fetch.FileJob(e, local=t) for e, t in zip(manifest.files, linked, strict=True)]
    verified = fetch.verify_local(engine, jobs, leaf_size=manifest.chunk_size)
    rest = []
    for entry, target, ok in zip(manifest.files, linked, verified, strict=True):
        if ok:
            clock.local += entry.size
            continue
        rest.append(entry)
        if target is not None:
            target.unlink()  # downloaded again in its place
    if rest:
        log.warning(
            "step %d: %d of %d file(s) of the local copy in %s are gone or do not verify; "
            "downloading them",
            manifest.step,
            len(rest),
            len(manifest.files),
            copy.dir,
        )
    clock.verify_s += time.perf_counter() - started
    return rest


def _download_rest(
    store: Store,
    engine: TransferEngine,
    record: CheckpointRecord,
    manifest: Manifest,
    rest: list[FileEntry],
    tmp: Path,
    progress: ProgressCallback | None,
    clock: _Clock,
) -> None:
    """Download the files ``rest`` of ``record`` (those no local copy supplied), verified,
    into ``tmp``. Raises CorruptionError, StagingError (no space), StoreError, OSError."""
    started = time.perf_counter()
    check_objects(store, record, manifest)
    need = sum(e.size for e in rest)
    check_space(record.step, need, tmp.parent)
    clock.listing_s += time.perf_counter() - started

    def landed(n: int) -> None:
        clock.downloaded += n
        clock.last_byte = time.perf_counter()
        if progress is not None:
            progress(n)

    started = time.perf_counter()
    download(
        engine,
        store,
        record.ckpt + attempt_layout.FILES_DIR,
        rest,
        tmp,
        manifest.chunk_size,
        landed,
    )
    done = time.perf_counter()
    last = max(clock.last_byte, started)
    clock.transfer_s += last - started
    clock.verify_s += done - last


def download_into(
    store: Store,
    engine: TransferEngine,
    record: CheckpointRecord,
    entries: Sequence[FileEntry],
    into: Path,
    chunk_size: int = digest.CHUNK_SIZE,
    progress: ProgressCallback | None = None,
) -> None:
    """``entries`` of ``record`` downloaded, verified, into the new directory ``into``
    (``cloudckpt.download``), their recorded modes applied once every file verified: the
    one "download a checkpoint into a directory" of distributed restores, ``get`` and
    ``export`` (``restore`` takes its local copies first, then downloads the rest the
    same way). Raises CorruptionError, StoreError, OSError (FileExistsError: ``into``
    exists)."""
    into.mkdir()
    download(
        engine, store, record.ckpt + attempt_layout.FILES_DIR, entries, into, chunk_size, progress
    )
    apply_modes(into, entries)  # after every file verified


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which files of a checkpoint a restore writes: those matching an ``include``
    pattern (all without one) and no ``exclude`` pattern (``reader.select_files``)."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @property
    def partial(self) -> bool:
        return bool(self.include or self.exclude)

    def split(self, manifest: Manifest) -> tuple[Manifest, tuple[str, ...]]:
        """(the manifest of the selected files, the paths left out); ``manifest`` itself
        when nothing is left out.

        Raises: CheckpointNotFoundError (patterns that select no file).
        """
        if not self.partial:
            return manifest, ()
        chosen, left = reader.select_files(manifest.files, self.include, self.exclude)
        if not chosen and manifest.files:
            names = [f.path for f in manifest.files]
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise CheckpointNotFoundError(
                f"no file of step {manifest.step} is selected (include: "
                f"{' '.join(self.include) or 'everything'}; exclude: "
                f"{' '.join(self.exclude) or 'nothing'})",
                hint=f"Its files: {shown}",
            )
        if not left:
            return manifest, ()
        return dataclasses.replace(manifest, files=tuple(chosen)), tuple(f.path for f in left)


def _download(
    store: Store,
    engine: TransferEngine,
    record: CheckpointRecord,
    tmp: Path,
    progress: ProgressCallback | None,
    local: LocalCopies | None,
    clock: _Clock,
    selection: Selection = Selection(),
    link_local: bool = False,
) -> Manifest:
    """Check ``record`` and download it (the files ``selection`` selects), verified, into
    the new directory ``tmp`` (taking the files of a local copy that verify from there).
    Returns the whole manifest. Raises CorruptionError, UnsafePathError, StagingError (no
    space), StoreError; CheckpointNotFoundError (a selection of nothing)."""
    started = time.perf_counter()
    copy = local.find(record) if local is not None else None
    whole = copy.manifest(record) if copy is not None else None
    if whole is None:
        whole = fetch_manifest(store, record)
    manifest, _ = selection.split(whole)  # only these are listed, read and checked
    clock.listing_s += time.perf_counter() - started
    try:
        tmp.mkdir()
        rest = _from_local(engine, copy, manifest, tmp, clock, link_local)
        if rest:
            _download_rest(store, engine, record, manifest, rest, tmp, progress, clock)
        apply_modes(tmp, manifest.files)  # after every file verified
    except OSError as exc:
        full = out_of_space(exc, record.step, manifest.total_bytes, tmp.parent)
        if full is None:
            raise
        raise full from exc
    return whole


def _restore_one(
    store: Store,
    engine: TransferEngine,
    record: CheckpointRecord,
    dest: Path,
    progress: ProgressCallback | None,
    local: LocalCopies | None = None,
    clock: _Clock | None = None,
    selection: Selection = Selection(),
    link_local: bool = False,
) -> Manifest | reader.Damaged:
    """Download ``record`` (the files ``selection`` selects), verified, beside ``dest``
    and move it into place; or, if it is damaged or missing, why (``dest`` untouched).
    Returns its whole manifest. Raises StagingError, StoreError, CheckpointNotFoundError
    (a selection of nothing)."""
    clock = clock if clock is not None else _Clock()
    tmp = dest.with_name(f".{dest.name}.cloudckpt-tmp-{secrets.token_hex(4)}")
    try:
        manifest = _download(
            store, engine, record, tmp, progress, local, clock, selection, link_local
        )
        failpoint("restore.after_download")
        started = time.perf_counter()
        place(tmp, dest)
        clock.place_s += time.perf_counter() - started
    except (CorruptionError, UnsafePathError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return reader.Damaged.of(exc)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


# Long by its signature and its docstring (public API); the code is ~35 lines.
def restore(
    store: Store,
    into: str | os.PathLike[str],
    engine: TransferEngine,
    *,
    step: int | None = None,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
    local: LocalCopies | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    link_local: bool = False,
) -> RestoreResult:
    """Restore the newest intact checkpoint (or ``step``) into the directory ``into`` (a
    symbolic link to a directory restores into that directory and stays a link).

    ``local``: the local tier of the manager's staging directory; the files of a kept
    copy of the chosen checkpoint that verify are taken from there, not downloaded: each
    reflinked where the filesystem can (sharing blocks, copy-on-write), else copied, so
    the restored files are independent of the kept copy and of other restores.
    ``link_local``: hard-link them instead (no bytes written; but then a restored file IS
    the kept copy: editing it in place changes the copy and every restore linked from it,
    and a later restore from that copy finds it changed, downloads it and warns).

    ``include`` / ``exclude``: glob patterns (``reader.matches``: a path, ``*.safetensors``,
    ``tokenizer/``) for a partial restore: only the files that match an ``include`` (all
    without one) and no ``exclude`` are read, each verified as in a whole restore; the
    others are listed in ``RestoreResult.excluded``. A damaged selected file falls back
    to the next older checkpoint; damage in a file left out is not looked for.

    A checkpoint that turns out missing because retention dropped it and GC collected it
    while this restore read it is not damage: LATEST is read again and its checkpoints
    tried (see ``reread_if_dropped``).

    Raises:
        CheckpointNotFoundError: nothing is committed (or no retained checkpoint has
            ``step``, or it was dropped and collected while it was being read, or the
            patterns select no file of it).
        ConfigurationError: a pattern that is empty or not a string.
        CorruptionError: every candidate was damaged; ``exc.skipped`` says why each failed.
            The destination is untouched.
        DestinationNotEmptyError: ``into`` holds files and ``overwrite`` is False, or it is
            not a directory (a file, a link to a file or to nothing, a mount point).
        StagingError: not enough local space (checked first; or the disk filled during the
            download). The destination is untouched.
        StoreError: the store failed (after retries); the destination is untouched.
    """
    clock = _Clock()
    selection = Selection(
        reader.check_patterns(include, "include"), reader.check_patterns(exclude, "exclude")
    )
    into = Path(into).expanduser().absolute()
    todo, from_records = reader.readable(store, step)
    dest = prepare_destination(into, overwrite)
    clock.listing_s = time.perf_counter() - clock.started

    found = reader.first_intact(
        store,
        todo,
        step,
        lambda record: _restore_one(
            store, engine, record, dest, progress, local, clock, selection, link_local
        ),
        from_records=from_records,
    )
    record, (manifest, excluded) = found.record, selection.split(found.value)
    if found.skipped:
        # Each skip was warned about as it happened (reader.first_intact).
        log.info(
            "restored step %d after skipping %d checkpoint(s)", record.step, len(found.skipped)
        )
    return _result(into, found, manifest, excluded, clock)


def _result(
    into: Path,
    found: reader.Intact[Any],
    manifest: Manifest,
    excluded: tuple[str, ...],
    clock: _Clock,
) -> RestoreResult:
    """What ``restore`` reports of the checkpoint it placed at ``into``."""
    record = found.record
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
        bytes_downloaded=clock.downloaded,
        bytes_local=clock.local,
        timings=clock.timings(),
        excluded=excluded,
    )
