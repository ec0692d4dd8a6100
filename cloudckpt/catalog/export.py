"""``export_checkpoint``: a checkpoint as plain files, in a local directory or under a
bucket prefix, for tools that know nothing of cloudckpt (``cloudckpt export``); never
into, over or inside a run."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloudckpt import protocol, reader
from cloudckpt.catalog.get import download_one
from cloudckpt.catalog.opening import Where, opened, transfer_engine
from cloudckpt.errors import (
    CorruptionError,
    DestinationNotEmptyError,
    PermissionDeniedError,
    UnsafePathError,
)
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.reader import SkippedCheckpoint
from cloudckpt.restore import refuse_run_directories, restore
from cloudckpt.stores import RunURL, Store, parse_url
from cloudckpt.transfer import ProgressCallback, TransferConfig, TransferEngine


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
    refused unless ``overwrite`` (which replaces the keys it writes and deletes none).
    A destination that is a cloudckpt run, lies inside one (a LATEST at a prefix or
    directory above it) or holds one (a LATEST anywhere below) is always refused,
    ``overwrite`` or not (``copy_checkpoint`` copies into runs). (A ``Store`` given as
    ``dest`` is checked at and below its prefix only: pass its URL to have the prefixes
    above checked too.)

    Raises:
        CheckpointNotFoundError, CorruptionError (damage; on a store, found in the middle
            of the export, the files already written stay: the message says so),
        DestinationNotEmptyError, StoreError, StagingError (no local space).
    """
    local = _local_path(dest)
    if local is not None:
        refuse_run_directories(local, overwrite, "export", _RUN_HINT, _RUN_CLI_HINT)
    with opened(where, storage_options) as store, transfer_engine(transfer) as engine:
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
        with opened(dest, dest_options, writable=True) as out:
            if not isinstance(dest, Store):
                _refuse_runs_above(parse_url(dest), out, dest_options)
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
    """Raises DestinationNotEmptyError: ``out`` is a cloudckpt run or holds one (a LATEST
    anywhere below), whatever ``overwrite`` says; or it holds objects and not
    ``overwrite``."""
    if out.exists(protocol.LATEST_KEY):
        raise DestinationNotEmptyError(
            f"{out.url} is a cloudckpt run: export writes plain files", hint=_RUN_HINT
        ).with_cli_hint(_RUN_CLI_HINT)
    first = next(iter(out.list("")), None)
    if first is not None and not overwrite:
        raise DestinationNotEmptyError(
            f"{out.url} is not empty (it holds {first.key!r})",
            hint="Export to an empty prefix, or pass overwrite=True to replace the files it writes",
        ).with_cli_hint("Export to an empty prefix, or pass --force to replace the files it writes")
    if first is not None:  # overwrite: plain files only, never a run's objects
        for obj in out.list(""):
            if obj.key.rsplit("/", 1)[-1] == protocol.LATEST_KEY:
                run = out.url + obj.key[: -len(protocol.LATEST_KEY)]
                raise DestinationNotEmptyError(
                    f"{out.url} holds the cloudckpt run {run}: export would overwrite its objects",
                    hint=_RUN_HINT,
                ).with_cli_hint(_RUN_CLI_HINT)


#: What to do instead of exporting into (or over) a run.
_RUN_HINT = (
    "Export to a prefix outside every run and holding none (overwrite=True replaces plain "
    "files only); to copy a checkpoint into a run, use copy_checkpoint"
)
_RUN_CLI_HINT = (
    "Export to a prefix outside every run and holding none (--force replaces plain files "
    "only); to copy a checkpoint into a run, use `cloudckpt cp`"
)


def _refuse_runs_above(dest: RunURL, out: Store, options: Mapping[str, Any] | None) -> None:
    """Raises DestinationNotEmptyError if the prefix ``dest`` (opened as ``out``) lies
    inside a run: a LATEST at a prefix above it, in the same bucket. One HEAD per level,
    through a store opened at the bucket's root with the same options; a level this
    host may not read (permission denied) is not judged."""
    parts = dest.prefix.strip("/").split("/") if dest.prefix.strip("/") else []
    if not parts:
        return
    with opened(f"{dest.scheme}://{dest.netloc}/", options) as root:
        for depth in range(len(parts)):
            above = "".join(p + "/" for p in parts[:depth])
            try:
                found = root.exists(above + protocol.LATEST_KEY)
            except PermissionDeniedError:
                continue
            if found:
                raise DestinationNotEmptyError(
                    f"{out.url} is inside the cloudckpt run {root.url}{above}: export "
                    "would write into that run",
                    hint=_RUN_HINT,
                ).with_cli_hint(_RUN_CLI_HINT)


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
        local = download_one(store, engine, record, entry, Path(tmp) / "f")
        sent = engine.upload_files(out, "", [(entry.path, local)], progress)
    if sent[0].digest != entry.digest:  # the local file changed under us
        raise CorruptionError(f"{entry.path} changed on the local disk during the export")
