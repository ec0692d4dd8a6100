"""``get_file`` and ``get_files``: one file, or the files some paths and globs name, of a
checkpoint, each verified before it appears, without restoring the rest
(``cloudckpt get``)."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cloudckpt import manifests, reader
from cloudckpt.catalog.opening import Where, opened, transfer_engine
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptionError,
    DestinationNotEmptyError,
    UnsafePathError,
)
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.reader import SkippedCheckpoint
from cloudckpt.restore import download_into
from cloudckpt.stores import Store
from cloudckpt.transfer import TransferConfig, TransferEngine


@dataclasses.dataclass(frozen=True)
class FileResult:
    """A file taken out of a checkpoint (``get_file``): where it was written (None: to the
    ``write`` callback), which checkpoint it came from, and those skipped first."""

    path: str
    dest: Path | None
    size: int
    digest: str
    mode: int | None
    step: int
    commit_id: str
    skipped: tuple[SkippedCheckpoint, ...] = ()
    from_commit_records: bool = False


def _find_entry(manifest: Manifest, path: str, step: int) -> FileEntry:
    for entry in manifest.files:
        if entry.path == path:
            return entry
    names = [f.path for f in manifest.files]
    shown = ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")
    raise CheckpointNotFoundError(
        f"step {step} has no file {path!r}",
        hint=f"Its files: {shown or 'none'} (`cloudckpt show URL --step {step}` lists them)",
    )


def _check_entry_objects(store: Store, record: CheckpointRecord, entry: FileEntry) -> None:
    """The objects of one file are there with their sizes (one listing). Raises
    CorruptionError (MissingChunkError)."""
    only = dataclasses.replace(_single_manifest(record), files=(entry,))
    reader.check_objects(store, record, only)


def _single_manifest(record: CheckpointRecord) -> Manifest:
    return Manifest(record.ckpt, record.step, record.epoch, record.commit_id, "", "", ())


def download_one(
    store: Store, engine: TransferEngine, record: CheckpointRecord, entry: FileEntry, into: Path
) -> Path:
    """``entry`` downloaded, verified, into the new directory ``into``; its mode applied.
    Raises CorruptionError, StoreError, OSError."""
    download_into(store, engine, record, [entry], into)
    return into.joinpath(*entry.path.split("/"))


# Long by its signature and its docstring (public API); the code is ~45 lines.
def get_file(
    where: Where,
    path: str,
    dest: str | os.PathLike[str] | None = None,
    *,
    step: int | None = None,
    overwrite: bool = False,
    write: Callable[[bytes], object] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    transfer: TransferConfig | None = None,
) -> FileResult:
    """Download one file (``path`` as the manifest names it) of the newest intact
    checkpoint (or of ``step``) and verify it (every chunk, and the file's digest) before
    it appears at ``dest``: a file path, or an existing directory (the file keeps its
    name), default the current directory. The file is written beside ``dest`` and renamed
    into place, with its recorded mode. With ``write`` (e.g. stdout's), its verified
    bytes are handed to it instead, in pieces. A checkpoint whose copy of the file is
    damaged is skipped for the next older one, as a restore does.

    Raises:
        CheckpointNotFoundError: nothing committed, no such step, or no such file.
        DestinationNotEmptyError: ``dest`` exists (a file) and not ``overwrite``.
        CorruptionError: every checkpoint tried was damaged; UnsafePathError: ``path``.
        StoreError: the store failed.
    """
    manifests.safe_relpath(path)
    with opened(where, storage_options) as store, transfer_engine(transfer) as engine:
        todo, from_records = reader.readable(store, step)
        target = None if write is not None else _file_destination(path, dest, overwrite)
        # Beside the destination (the final rename stays on one filesystem); for ``write``,
        # in the temporary directory: nothing reaches ``write`` before it verified.
        work = (target.parent if target is not None else Path(tempfile.gettempdir())) / (
            f".{Path(path).name}.cloudckpt-tmp-{secrets.token_hex(4)}"
        )

        def try_one(record: CheckpointRecord) -> FileEntry | reader.Damaged:
            try:
                entry = _find_entry(reader.fetch_manifest(store, record), path, record.step)
                _check_entry_objects(store, record, entry)
                work.parent.mkdir(parents=True, exist_ok=True)  # a DEST/ that was missing
                got = download_one(store, engine, record, entry, work)
            except (CorruptionError, UnsafePathError) as exc:
                shutil.rmtree(work, ignore_errors=True)
                return reader.Damaged.of(exc)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
            try:
                if target is not None:
                    os.replace(got, target)
                else:
                    _stream(got, write)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            return entry

        found = reader.first_intact(store, todo, step, try_one, from_records=from_records)
    entry = found.value
    return FileResult(
        entry.path,
        target,
        entry.size,
        entry.digest,
        entry.mode,
        found.record.step,
        found.record.commit_id,
        found.skipped,
        found.from_records,
    )


@dataclasses.dataclass(frozen=True)
class FilesResult:
    """Files taken out of a checkpoint (``get_files``): the directory they were written
    into, each file (``files``: its path in the checkpoint, where it was written, size,
    digest, mode), which checkpoint they came from, and those skipped first."""

    dest: Path
    files: tuple[FileResult, ...]
    step: int
    commit_id: str
    skipped: tuple[SkippedCheckpoint, ...] = ()
    from_commit_records: bool = False

    @property
    def num_files(self) -> int:
        return len(self.files)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _pick(manifest: Manifest, patterns: Sequence[str]) -> list[FileEntry]:
    """The files of ``manifest`` that ``patterns`` name (``reader.matches``), in manifest
    order. Raises CheckpointNotFoundError naming a pattern that matches no file: each one
    names files the caller wants, so a typo must not pass as "nothing to get"."""
    for pattern in patterns:
        if not any(reader.matches(f.path, pattern) for f in manifest.files):
            names = [f.path for f in manifest.files]
            shown = ", ".join(names[:8]) + (
                f" (and {len(names) - 8} more)" if len(names) > 8 else ""
            )
            raise CheckpointNotFoundError(
                f"step {manifest.step} has no file {pattern!r}",
                hint=f"Its files: {shown or 'none'} (`cloudckpt show URL --step "
                f"{manifest.step}` lists them)",
            )
    return [f for f in manifest.files if any(reader.matches(f.path, p) for p in patterns)]


def get_files(
    where: Where,
    paths: Sequence[str],
    dest: str | os.PathLike[str] | None = None,
    *,
    step: int | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    transfer: TransferConfig | None = None,
) -> FilesResult:
    """Download the files ``paths`` name, of the newest intact checkpoint (or of
    ``step``), into the directory ``dest`` (created if missing; default: the current
    directory), each under its path in the checkpoint (``tokenizer/vocab.txt`` ->
    ``dest/tokenizer/vocab.txt``), as a partial ``restore`` lays them out.

    Each of ``paths`` is a path as the manifest names it or a glob pattern
    (``reader.matches``: ``*.safetensors``, ``tokenizer/``), and must match at least one
    file. Only those files are read, each verified (every chunk, and the file's digest)
    into a temporary directory inside ``dest``; once all of them verified they are moved
    into place, with their recorded modes. A checkpoint whose copy of one of them is
    damaged is skipped for the next older one, as a restore does.

    Raises:
        CheckpointNotFoundError: nothing committed, no such step, or a path or pattern
            that matches no file.
        DestinationNotEmptyError: a file to write exists and not ``overwrite`` (nothing is
            written), or ``dest`` (or a directory on the way) is a file.
        ConfigurationError: an empty pattern; CorruptionError: every checkpoint tried was
            damaged; StoreError: the store failed.
    """
    patterns = reader.check_patterns(paths, "paths")
    if not patterns:
        raise ConfigurationError("get_files needs at least one path or pattern")
    root = Path(dest if dest is not None else ".").expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise DestinationNotEmptyError(f"{root} is not a directory", hint="Pass a directory")
    with opened(where, storage_options) as store, transfer_engine(transfer) as engine:
        todo, from_records = reader.readable(store, step)

        def try_one(record: CheckpointRecord) -> list[FileResult] | reader.Damaged:
            try:
                entries = _pick(reader.fetch_manifest(store, record), patterns)
                targets = _targets(root, entries, overwrite)
                reader.check_objects(store, record, _only(record, entries))
                return _download_into(store, engine, record, entries, root, targets)
            except (CorruptionError, UnsafePathError) as exc:
                return reader.Damaged.of(exc)

        found = reader.first_intact(store, todo, step, try_one, from_records=from_records)
    files = tuple(
        dataclasses.replace(f, skipped=found.skipped, from_commit_records=found.from_records)
        for f in found.value
    )
    return FilesResult(
        root, files, found.record.step, found.record.commit_id, found.skipped, found.from_records
    )


def _only(record: CheckpointRecord, entries: Sequence[FileEntry]) -> Manifest:
    """A manifest of ``record`` naming only ``entries`` (to list their objects alone)."""
    return dataclasses.replace(_single_manifest(record), files=tuple(entries))


def _targets(root: Path, entries: Sequence[FileEntry], overwrite: bool) -> list[Path]:
    """Where each of ``entries`` goes below ``root``. Raises DestinationNotEmptyError (one
    exists and not ``overwrite``, or is a directory; a directory on the way is a file)."""
    targets = [root.joinpath(*e.path.split("/")) for e in entries]
    for target in targets:
        if target.is_dir() or (target.exists() and not overwrite):
            raise DestinationNotEmptyError(
                f"{target} exists",
                hint="Pass another directory, or overwrite=True to replace the files it holds",
            ).with_cli_hint("Pass another directory, or --force to replace the files it holds")
        for parent in target.parents:
            if parent == root or root not in parent.parents:
                break
            if parent.exists() and not parent.is_dir():
                raise DestinationNotEmptyError(f"{parent} is a file, not a directory")
    return targets


def _download_into(
    store: Store,
    engine: TransferEngine,
    record: CheckpointRecord,
    entries: Sequence[FileEntry],
    root: Path,
    targets: Sequence[Path],
) -> list[FileResult]:
    """``entries`` of ``record``, downloaded and verified into a temporary directory in
    ``root``, then moved to ``targets``. Raises CorruptionError (nothing moved),
    StoreError, OSError."""
    root.mkdir(parents=True, exist_ok=True)
    work = root / f".cloudckpt-get-tmp-{secrets.token_hex(4)}"
    try:
        download_into(store, engine, record, entries, work)
        out = []
        for entry, target in zip(entries, targets, strict=True):
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(work.joinpath(*entry.path.split("/")), target)
            out.append(
                FileResult(
                    entry.path,
                    target,
                    entry.size,
                    entry.digest,
                    entry.mode,
                    record.step,
                    record.commit_id,
                )
            )
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _file_destination(path: str, dest: str | os.PathLike[str] | None, overwrite: bool) -> Path:
    """Where ``get_file`` writes: ``dest`` itself, or, when it is a directory (one that
    exists, or any ``dest`` ending in ``/``, created when the file is found), the file's
    name in it. Raises DestinationNotEmptyError."""
    text = os.fspath(dest) if dest is not None else "."
    target = Path(text).expanduser().absolute()
    directory = _names_directory(text)
    if directory and target.exists() and not target.is_dir():
        raise DestinationNotEmptyError(
            f"{target} is not a directory", hint="Pass a directory, or a file name without '/'"
        )
    if directory or target.is_dir():
        target = target / Path(path).name
    if target.exists() and (not overwrite or target.is_dir()):
        raise DestinationNotEmptyError(
            f"{target} exists",
            hint="Pass another destination, or overwrite=True to replace a file",
        ).with_cli_hint("Pass another destination, or --force to replace a file")
    if not directory and not target.parent.is_dir():
        raise DestinationNotEmptyError(
            f"{target.parent} is not a directory",
            hint=f"Create it first, or end the destination with '/' ({target.parent}/) to "
            "have it created",
        )
    return target


def _names_directory(text: str) -> bool:
    """Whether a destination names a directory by its spelling: a trailing ``/`` (or the
    platform's separator), as ``cp``, ``aws s3 cp`` and ``rsync`` read it."""
    return text.endswith("/") or text.endswith(os.sep)


def _stream(path: Path, write: Callable[[bytes], object] | None) -> None:
    assert write is not None
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            write(block)
