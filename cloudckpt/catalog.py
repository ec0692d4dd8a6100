"""The catalog: find runs, copy and compare checkpoints, take single files out of them.

What users of ``aws s3``, ``restic`` or the Hugging Face hub CLI expect beside save and
restore (``docs/cli.md`` has the commands, docs/design.md §11 the copy's and the resume's
rules):

- ``list_runs(url)``: the runs under a prefix, each with its current step, size and age
  (``cloudckpt runs``);
- ``copy_checkpoint(src, dst)``: a committed checkpoint into another run, on the same
  store or another one, verified and committed through the destination's own LATEST,
  naming the chunks the destination already holds (``cloudckpt cp``);
- ``get_file(url, path, dest)``: one file of a checkpoint, verified, without restoring the
  rest (``cloudckpt get``);
- ``export_checkpoint(url, dest)``: a checkpoint as plain files, in a local directory or
  under a bucket prefix, for tools that know nothing of cloudckpt (``cloudckpt export``);
- ``file_digest(path)``: the ``sha256-tree`` digest a manifest records, for a local file
  (``cloudckpt digest``);
- ``diff_checkpoints(url, a, b)``: which files and chunks changed between two checkpoints
  (``cloudckpt diff``).

Every function takes a run URL (with ``storage_options``) or an open ``Store``. Reads are
verified as restores are (docs/design.md §7): manifests against LATEST's record, chunks
against their SHA-256, files against their recorded digest. Writes to a run go through its
commit protocol (``cloudckpt.copying``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from cloudckpt import chunks, digest, protocol, reader
from cloudckpt.admin import WriterStatus, check_takeover
from cloudckpt.attempts import AttemptWriter
from cloudckpt.committer import Committer
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptionError,
    CorruptRecordError,
    DestinationNotEmptyError,
    ObjectNotFoundError,
    UnsafePathError,
)
from cloudckpt.protocol import CheckpointRecord, FileEntry, Latest, Manifest
from cloudckpt.reader import SkippedCheckpoint
from cloudckpt.restore import apply_modes, restore
from cloudckpt.stores import RunURL, Store, open_store, parse_url
from cloudckpt.stores.base import INTERNAL_PREFIX
from cloudckpt.transfer import ProgressCallback, TransferConfig, TransferEngine

__all__ = [
    "CheckpointDiff",
    "CopyResult",
    "ExportResult",
    "FileChange",
    "FileResult",
    "RunInfo",
    "copy_checkpoint",
    "diff_checkpoints",
    "export_checkpoint",
    "file_digest",
    "get_file",
    "list_runs",
]

Where = str | RunURL | Store


@contextlib.contextmanager
def _opened(
    where: Where, options: Mapping[str, Any] | None, *, writable: bool = False
) -> Iterator[Store]:
    """``where`` as a store: an open one as it is (the caller closes it), a URL opened for
    the block."""
    if isinstance(where, Store):
        yield where
        return
    store = open_store(where, options, writable=writable)
    try:
        yield store
    finally:
        store.close()


@contextlib.contextmanager
def _engine(transfer: TransferConfig | None) -> Iterator[TransferEngine]:
    with TransferEngine(transfer) as engine:
        yield engine


# --------------------------------------------------------------------------- digest


def file_digest(path: str | os.PathLike[str]) -> str:
    """The digest a manifest records for a file with the bytes of ``path`` (the
    ``sha256-tree`` algorithm: docs/cli.md, ``cloudckpt digest``, shows how to compute it
    by hand). Raises OSError."""
    return digest.tree_digest_of_file(path)


# --------------------------------------------------------------------------- runs


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """A run found under a prefix (``list_runs``).

    ``path``: where it lies below the prefix (``""``: the prefix itself is a run).
    ``status``: ``ok``; ``empty`` (claimed, nothing committed yet); ``needs-repair``
    (checkpoint data but LATEST missing or unreadable; ``problem`` says which).
    ``step``, ``commit_id``, ``committed_at``, ``total_bytes``, ``num_files``: its current
    checkpoint (None without one). ``retained``: how many checkpoints it keeps;
    ``stored_bytes``: what they hold in its own prefixes (each chunk counted once; a
    record written before chunks existed counts its whole size). ``updated_at``: when
    LATEST was last written, on the store's clock; ``age_seconds``: how long ago, on the
    same clock. ``writer_epoch``: its writer's fencing epoch.
    """

    url: str
    path: str
    status: str
    step: int | None = None
    commit_id: str | None = None
    committed_at: str | None = None
    total_bytes: int | None = None
    num_files: int | None = None
    retained: int = 0
    stored_bytes: int | None = None
    updated_at: str | None = None
    age_seconds: float | None = None
    writer_epoch: int | None = None
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Directories a run holds that are its own data, not runs below it.
_RUN_DIRS = {protocol.CKPT_PREFIX, protocol.COMMITS_PREFIX, INTERNAL_PREFIX}


def list_runs(
    where: Where, *, depth: int = 4, storage_options: Mapping[str, Any] | None = None
) -> list[RunInfo]:
    """The runs at and below the prefix ``where`` (at most ``depth`` directories down),
    sorted by path: one listing of each directory visited (a delimiter listing on S3, GCS
    and Azure), and for each run one read of LATEST. Read-only.

    Raises:
        ConfigurationError: ``depth`` is negative, or a bad URL.
        StoreError: the store failed (BucketNotFoundError: no such bucket).
    """
    if depth < 0:
        raise ConfigurationError(f"depth must be >= 0, got {depth}")
    with _opened(where, storage_options) as store:
        now = store.now()
        found: list[RunInfo] = []
        _visit(store, "", depth, now, found)
    return sorted(found, key=lambda r: r.path)


def _visit(store: Store, prefix: str, depth: int, now: dt.datetime, found: list[RunInfo]) -> None:
    subdirs = store.list_dirs(prefix)
    has_latest = store.exists(prefix + protocol.LATEST_KEY)
    is_run = (
        has_latest or protocol.COMMITS_PREFIX in subdirs or _holds_attempts(store, prefix, subdirs)
    )
    if is_run:
        found.append(_describe(store, prefix, has_latest, now))
    if depth == 0:
        return
    for sub in subdirs:
        if is_run and sub in _RUN_DIRS:
            continue
        _visit(store, prefix + sub, depth - 1, now, found)


def _holds_attempts(store: Store, prefix: str, subdirs: Sequence[str]) -> bool:
    """Whether ``prefix`` holds ``ckpt/<attempt>/`` directories (a run that lost its
    LATEST), as opposed to a directory of the user's that happens to be called ckpt."""
    if protocol.CKPT_PREFIX not in subdirs:
        return False
    inner = store.list_dirs(prefix + protocol.CKPT_PREFIX)
    return any(protocol.parse_ckpt_prefix(protocol.CKPT_PREFIX + d) for d in inner)


def _describe(store: Store, prefix: str, has_latest: bool, now: dt.datetime) -> RunInfo:
    """One run: its LATEST read once (or why it cannot be)."""
    url, path = store.url + prefix, prefix.rstrip("/")
    if not has_latest:
        return RunInfo(
            url,
            path,
            "needs-repair",
            problem="checkpoint data but no LATEST (run `cloudckpt repair` on it)",
        )
    try:
        data, info = store.get(prefix + protocol.LATEST_KEY)
        latest = protocol.parse_latest(data)
    except ObjectNotFoundError:
        return RunInfo(url, path, "needs-repair", problem="LATEST vanished while listing")
    except CorruptRecordError as exc:
        return RunInfo(url, path, "needs-repair", problem=f"LATEST is unreadable: {exc.message}")
    updated = info.last_modified
    retained = latest.retained()
    current = latest.current
    return RunInfo(
        url,
        path,
        "ok" if current is not None else "empty",
        step=current.step if current else None,
        commit_id=current.commit_id if current else None,
        committed_at=current.committed_at if current else None,
        total_bytes=current.total_bytes if current else None,
        num_files=current.num_files if current else None,
        retained=len(retained),
        stored_bytes=sum(
            r.owned_bytes if r.owned_bytes is not None else r.total_bytes for r in retained
        ),
        updated_at=protocol.iso(updated) if updated else None,
        age_seconds=max(0.0, (now - updated).total_seconds()) if updated else None,
        writer_epoch=latest.writer.epoch,
    )


# --------------------------------------------------------------------------- diff


@dataclasses.dataclass(frozen=True)
class FileChange:
    """One path of a ``CheckpointDiff``: ``change`` is ``added``, ``removed``,
    ``modified`` (other bytes), ``mode`` (same bytes, other permission bits) or
    ``unchanged``. ``new_chunks``/``new_bytes``: chunks of the file in ``b`` that ``a``
    holds nowhere (by content), what a copy or save of ``b`` after ``a`` sends for it; None
    when ``b`` stores the file whole."""

    path: str
    change: str
    size_a: int | None
    size_b: int | None
    digest_a: str | None
    digest_b: str | None
    mode_a: int | None = None
    mode_b: int | None = None
    new_chunks: int | None = None
    new_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointDiff:
    """How checkpoint ``b`` differs from ``a`` (``diff_checkpoints``). ``files``: every
    path of either, sorted. ``chunks_only_in_a``/``_b``, ``bytes_only_in_a``/``_b``,
    ``shared_chunks``/``shared_bytes``: distinct chunks by content (SHA-256), over the
    files each stores as chunks."""

    url: str
    a: CheckpointRecord
    b: CheckpointRecord
    files: tuple[FileChange, ...]
    chunks_only_in_a: int
    chunks_only_in_b: int
    bytes_only_in_a: int
    bytes_only_in_b: int
    shared_chunks: int
    shared_bytes: int

    def count(self, change: str) -> int:
        return sum(1 for f in self.files if f.change == change)


def diff_checkpoints(
    where: Where,
    step_a: int,
    step_b: int,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointDiff:
    """Compare the retained checkpoints of steps ``step_a`` and ``step_b`` (the newest of
    each): their manifests only, each checked against LATEST's record; no data is read.

    Raises:
        CheckpointNotFoundError: a step is not retained (the message lists those that are).
        CorruptionError: a manifest is missing or damaged (or LATEST, with no commit record
            that verifies); UnsafePathError: a hostile manifest.
        StoreError: the store failed.
    """
    with _opened(where, storage_options) as store:
        latest = _latest_for_reading(store)
        a, b = (_retained_step(store.url, latest, s) for s in (step_a, step_b))
        ma, mb = reader.fetch_manifest(store, a), reader.fetch_manifest(store, b)
        url = store.url
    return _diff(url, a, b, ma, mb)


def _latest_for_reading(store: Store) -> Latest:
    latest, from_records = reader.load_latest_for_reading(store)
    if latest is None:
        if from_records:
            raise CorruptionError(
                f"LATEST of {store.url} is unreadable and no commit record verifies"
            )
        raise CheckpointNotFoundError(f"{store.url} has no committed checkpoint")
    return latest


def _retained_step(url: str, latest: Latest, step: int) -> CheckpointRecord:
    for record in latest.retained():
        if record.step == step:
            return record
    steps = ", ".join(str(r.step) for r in latest.retained()) or "none"
    raise CheckpointNotFoundError(
        f"{url} retains no checkpoint of step {step}",
        hint=f"Retained steps: {steps} (`cloudckpt ls URL` lists them)",
    )


def _chunk_sizes(manifest: Manifest) -> dict[str, int]:
    return {c.sha256: c.size for f in manifest.files for c in f.chunks or ()}


def _file_change(
    path: str, fa: FileEntry | None, fb: FileEntry | None, in_a: set[str]
) -> FileChange:
    if fa is None:
        change = "added"
    elif fb is None:
        change = "removed"
    elif (fa.size, fa.digest) != (fb.size, fb.digest):
        change = "modified"
    elif fa.mode is not None and fb.mode is not None and fa.mode != fb.mode:
        change = "mode"
    else:
        change = "unchanged"
    new = None
    if fb is not None and fb.chunks is not None:
        fresh = {c.sha256: c.size for c in fb.chunks if c.sha256 not in in_a}
        new = (len(fresh), sum(fresh.values()))
    return FileChange(
        path,
        change,
        fa.size if fa else None,
        fb.size if fb else None,
        fa.digest if fa else None,
        fb.digest if fb else None,
        fa.mode if fa else None,
        fb.mode if fb else None,
        new[0] if new else None,
        new[1] if new else None,
    )


def _diff(
    url: str, a: CheckpointRecord, b: CheckpointRecord, ma: Manifest, mb: Manifest
) -> CheckpointDiff:
    files_a = {f.path: f for f in ma.files}
    files_b = {f.path: f for f in mb.files}
    ca, cb = _chunk_sizes(ma), _chunk_sizes(mb)
    changes = tuple(
        _file_change(p, files_a.get(p), files_b.get(p), set(ca))
        for p in sorted({*files_a, *files_b})
    )
    only_a = {s: n for s, n in ca.items() if s not in cb}
    only_b = {s: n for s, n in cb.items() if s not in ca}
    shared = {s: n for s, n in cb.items() if s in ca}
    return CheckpointDiff(
        url,
        a,
        b,
        changes,
        chunks_only_in_a=len(only_a),
        chunks_only_in_b=len(only_b),
        bytes_only_in_a=sum(only_a.values()),
        bytes_only_in_b=sum(only_b.values()),
        shared_chunks=len(shared),
        shared_bytes=sum(shared.values()),
    )


# --------------------------------------------------------------------------- one file


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


def _download_one(
    store: Store, engine: TransferEngine, record: CheckpointRecord, entry: FileEntry, into: Path
) -> Path:
    """``entry`` downloaded, verified, into the new directory ``into``; its mode applied.
    Raises CorruptionError, StoreError, OSError."""
    into.mkdir()
    chunks.download(engine, store, record.ckpt + protocol.FILES_DIR, [entry], into)
    apply_modes(into, [entry])
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
    protocol.safe_relpath(path)
    with _opened(where, storage_options) as store, _engine(transfer) as engine:
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
                got = _download_one(store, engine, record, entry, work)
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


def _file_destination(path: str, dest: str | os.PathLike[str] | None, overwrite: bool) -> Path:
    """Where ``get_file`` writes. Raises DestinationNotEmptyError."""
    target = Path(dest if dest is not None else ".").expanduser().absolute()
    if target.is_dir():
        target = target / Path(path).name
    if target.exists() and (not overwrite or target.is_dir()):
        raise DestinationNotEmptyError(
            f"{target} exists",
            hint="Pass another destination, or overwrite=True (CLI: --force) to replace a file",
        )
    if not target.parent.is_dir():
        raise DestinationNotEmptyError(
            f"{target.parent} is not a directory", hint="Create it first, or pass another one"
        )
    return target


def _stream(path: Path, write: Callable[[bytes], object] | None) -> None:
    assert write is not None
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            write(block)


# --------------------------------------------------------------------------- export


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """A checkpoint written as plain files (``export_checkpoint``): where, which one,
    what, and the checkpoints skipped first (a local export falls back as a restore
    does)."""

    dest: str
    step: int
    commit_id: str
    num_files: int
    total_bytes: int
    skipped: tuple[SkippedCheckpoint, ...] = ()
    from_commit_records: bool = False


def _local_path(dest: str | os.PathLike[str] | RunURL | Store) -> Path | None:
    """The local directory ``dest`` names (a path, or a ``file://`` URL), else None (a
    store). Raises ConfigurationError (a malformed URL)."""
    if isinstance(dest, Store):
        return None
    if isinstance(dest, os.PathLike):
        return Path(dest)
    url = parse_url(dest)
    return Path(url.prefix) if url.scheme == "file" else None


def export_checkpoint(
    where: Where,
    dest: str | os.PathLike[str] | RunURL | Store,
    *,
    step: int | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    dest_options: Mapping[str, Any] | None = None,
    transfer: TransferConfig | None = None,
    progress: ProgressCallback | None = None,
) -> ExportResult:
    """Write the newest intact checkpoint (or ``step``) as plain files: its paths as
    they were saved, nothing of cloudckpt's layout, for tools that read a directory
    (``from_pretrained``) or a bucket prefix (``aws s3 cp --recursive``).

    ``dest`` a local path (or ``file://`` URL): a verified restore into that directory,
    atomic, with fallback (``restore``). ``dest`` a store URL (or ``Store``): each file is
    downloaded, verified, to a temporary file and uploaded as one object under the prefix
    (complete only once whole); files appear one by one. A prefix that holds objects is
    refused unless ``overwrite`` (which replaces the keys it writes and deletes none), and a
    cloudckpt run always is (``copy_checkpoint`` copies into runs).

    Raises:
        CheckpointNotFoundError, CorruptionError (damage; on a store, found in the middle
            of the export, the files already written stay: the message says so),
        DestinationNotEmptyError, StoreError, StagingError (no local space).
    """
    local = _local_path(dest)
    with _opened(where, storage_options) as store, _engine(transfer) as engine:
        if local is not None:
            result = restore(
                store, local, engine, step=step, overwrite=overwrite, progress=progress
            )
            return ExportResult(
                str(result.path),
                result.step,
                result.commit_id,
                result.num_files,
                result.total_bytes,
                result.skipped,
                result.from_commit_records,
            )
        assert not isinstance(dest, os.PathLike)  # (a local path is handled above)
        with _opened(dest, dest_options, writable=True) as out:
            return _export_to_store(store, out, engine, step, overwrite, progress)


def _export_to_store(
    store: Store,
    out: Store,
    engine: TransferEngine,
    step: int | None,
    overwrite: bool,
    progress: ProgressCallback | None,
) -> ExportResult:
    _check_export_destination(out, overwrite)
    todo, from_records = reader.readable(store, step)

    def try_one(record: CheckpointRecord) -> Manifest | reader.Damaged:
        try:
            manifest = reader.fetch_manifest(store, record)
            reader.check_objects(store, record, manifest)
        except (CorruptionError, UnsafePathError) as exc:
            return reader.Damaged.of(exc)
        return manifest

    found = reader.first_intact(store, todo, step, try_one, from_records=from_records)
    record, manifest = found.record, found.value
    for written, entry in enumerate(manifest.files):
        try:
            _export_file(store, out, engine, record, entry, progress)
        except CorruptionError as exc:
            raise CorruptionError(
                f"{exc.message}; {written} of {len(manifest.files)} files of step "
                f"{record.step} were exported to {out.url} before it was found",
                hint="Export an older checkpoint (--step) with --force over them, and run "
                "`cloudckpt verify URL --all --read-data`",
            ) from None
    return ExportResult(
        out.url,
        record.step,
        record.commit_id,
        len(manifest.files),
        manifest.total_bytes,
        found.skipped,
        found.from_records,
    )


def _check_export_destination(out: Store, overwrite: bool) -> None:
    """Raises DestinationNotEmptyError: ``out`` is a cloudckpt run, or holds objects and
    not ``overwrite``."""
    if out.exists(protocol.LATEST_KEY):
        raise DestinationNotEmptyError(
            f"{out.url} is a cloudckpt run: export writes plain files",
            hint="Export to a prefix of its own; to copy a checkpoint into a run, use "
            "`cloudckpt cp`",
        )
    first = next(iter(out.list("")), None)
    if first is not None and not overwrite:
        raise DestinationNotEmptyError(
            f"{out.url} is not empty (it holds {first.key!r})",
            hint="Export to an empty prefix, or pass overwrite=True (CLI: --force) to "
            "replace the files it writes",
        )


def _export_file(
    store: Store,
    out: Store,
    engine: TransferEngine,
    record: CheckpointRecord,
    entry: FileEntry,
    progress: ProgressCallback | None,
) -> None:
    """One file: downloaded, verified, to a temporary directory; uploaded whole as the
    key ``entry.path``; the upload's own digest of what it sent checked again."""
    with tempfile.TemporaryDirectory(prefix="cloudckpt-export-") as tmp:
        local = _download_one(store, engine, record, entry, Path(tmp) / "f")
        sent = engine.upload_files(out, "", [(entry.path, local)], progress)
    if sent[0].digest != entry.digest:  # the local file changed under us
        raise CorruptionError(f"{entry.path} changed on the local disk during the export")


# --------------------------------------------------------------------------- copy


@dataclasses.dataclass(frozen=True)
class CopyResult:
    """A checkpoint copied into another run (``copy_checkpoint``).

    ``step``/``commit_id``: the source checkpoint; ``dest_step``, ``dest_commit_id``,
    ``dest_ckpt``, ``dest_epoch``, ``dest_seq``: what the destination committed.
    ``bytes_read``: read from the source; ``bytes_uploaded``: sent to the destination;
    ``bytes_reused``: named where the destination already held them (``bytes_resumed``
    of them: chunks an interrupted copy or save of the same step had uploaded).
    ``fenced_writer``: the destination's writer this copy fenced (None for a new run).
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


#: Writer ids of the copies this process ran (to the end, or to a failure): none of them
#: writes again, so a later copy into the same run need not be forced past them.
_FINISHED_COPIES: set[str] = set()


def copy_checkpoint(
    src: Where,
    dst: Where,
    *,
    step: int | None = None,
    dest_step: int | None = None,
    force: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    dest_options: Mapping[str, Any] | None = None,
    transfer: TransferConfig | None = None,
    progress: ProgressCallback | None = None,
) -> CopyResult:
    """Copy the newest intact checkpoint of ``src`` (or ``step``) into the run ``dst``
    (same store or another: s3 -> gs, a bucket -> a local directory) as ``dest_step``
    (default: the same step), where it becomes the current checkpoint.

    The destination is written only through its own commit protocol (docs/design.md §11,
    "Copying a checkpoint"): the copy claims the destination run, like ``push``, which
    fences the writer that owned it; if that writer wrote LATEST within the last hour it
    is probably still training, and the copy refuses unless ``force``. A new run is
    created (a location holding anything else is refused: ``NotARunError``). Chunks the
    destination already holds are named, not sent (and not read when whole leaves), as
    are those of an interrupted copy of the same step. Every byte read from the source is
    verified; a damaged source checkpoint is skipped for the next older one (with ``step``:
    none), and nothing of it is committed.

    Raises:
        ConfigurationError: ``src`` and ``dst`` are the same run; NotARunError.
        ActiveWriterError: the destination's writer is active and not ``force``.
        CheckpointNotFoundError, CorruptionError: nothing (intact) to copy.
        FencedError: another writer claimed the destination during the copy.
        StoreError, StaleAttemptError, NeedsRepairError (the destination's LATEST).
    """
    started = time.perf_counter()
    with (
        _opened(src, storage_options) as source,
        _opened(dst, dest_options, writable=True) as target,
        _engine(transfer) as engine,
    ):
        if source.url == target.url:
            raise ConfigurationError(
                f"{source.url} is both the source and the destination",
                hint="Copy into another run; to make an older step current again, restore "
                "it and push it",
            )
        todo, from_records = reader.readable(source, step)
        previous = check_takeover(target, force=force, finished=_FINISHED_COPIES)
        writer_id = protocol.new_writer_id()
        writer = _copy_writer(target, engine, writer_id, progress)
        try:
            done = _copy_first_intact(source, writer, todo, step, dest_step, from_records, progress)
        finally:
            _FINISHED_COPIES.add(writer_id)  # it never writes again
    return _copy_result(source, target, done, writer, previous, time.perf_counter() - started)


def _copy_writer(
    target: Store, engine: TransferEngine, writer_id: str, progress: ProgressCallback | None
) -> AttemptWriter:
    """The copy's writer into ``target``: a new writer id, the run's settings inherited
    (a new run gets the defaults), tensor-aware chunking."""
    return AttemptWriter(
        target,
        engine,
        Committer(
            target,
            writer_id,
            protocol.Settings(),
            inherit=("keep_last", "keep_every", "gc_grace_s"),
        ),
        chunking="tensor",
        progress=progress,
    )


def _copy_result(
    source: Store,
    target: Store,
    done: reader.Intact[Any],
    writer: AttemptWriter,
    previous: WriterStatus | None,
    seconds: float,
) -> CopyResult:
    """What ``copy_checkpoint`` returns for the copy ``done`` (``_copy_first_intact``'s)."""
    record, (begun, latest, manifest, read) = done.record, done.value
    stats = writer.last_upload or chunks.UploadStats()
    return CopyResult(
        source=source.url,
        dest=target.url,
        step=record.step,
        commit_id=record.commit_id,
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
        skipped=done.skipped,
        from_commit_records=done.from_records,
        fenced_writer=previous,
        seconds=round(seconds, 3),
    )


def _copy_first_intact(
    source: Store,
    writer: AttemptWriter,
    todo: list[CheckpointRecord],
    step: int | None,
    dest_step: int | None,
    from_records: bool,
    progress: ProgressCallback | None,
) -> reader.Intact[Any]:
    from cloudckpt.copying import copy_into

    def try_one(record: CheckpointRecord) -> Any:
        try:
            manifest = reader.fetch_manifest(source, record)
            reader.check_objects(source, record, manifest)
            return copy_into(
                writer,
                source,
                record,
                manifest,
                record.step if dest_step is None else dest_step,
                progress,
            )
        except (CorruptionError, UnsafePathError) as exc:
            return reader.Damaged.of(exc)

    return reader.first_intact(source, todo, step, try_one, from_records=from_records)
