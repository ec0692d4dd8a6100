"""``torch.distributed.checkpoint`` (DCP) on object storage, committed through LATEST.

::

    import torch.distributed.checkpoint as dcp
    from cloudckpt.distributed import DistributedCheckpointManager
    from cloudckpt.integrations.dcp import CloudStorageReader, CloudStorageWriter

    mgr = DistributedCheckpointManager("s3://bucket/runs/exp1", staging_dir="/nvme/ckpt")
    reader = CloudStorageReader(mgr, claim=True)     # every rank; rank 0 claims the run
    if reader.step is not None:                      # None for a new run
        dcp.load(state, storage_reader=reader)       # any world size DCP can reshard to
    ...
    dcp.save(state, storage_writer=CloudStorageWriter(mgr, step=step))
    # or, overlapping the upload with training (pass a gloo group, as DCP asks):
    fut = dcp.async_save(state, storage_writer=CloudStorageWriter(mgr, step=step),
                         process_group=ckpt_group)

How a save maps onto DCP's storage-writer calls (the checkpoint's files are exactly a DCP
``FileSystemWriter`` directory: ``__<rank>_<n>.distcp`` and ``.metadata``):

- ``set_up_storage_writer`` / ``prepare_local_plan`` (every rank): a fresh local staging
  directory under the manager's staging area; a DCP ``FileSystemWriter`` writes into it.
- ``prepare_global_plan`` (coordinator): checks every rank saves the same step, claims the
  run if needed, opens the attempt (``ckpt/<step>-e<epoch>-<id>/ATTEMPT.json``) and sends
  its prefix to every rank inside the plans DCP scatters.
- ``write_data`` (every rank): writes the rank's items locally, uploads its files into the
  attempt as content-addressed 8 MiB chunks (whole files, multipart, with
  ``chunking="off"``) and returns ``WriteResult``s whose ``storage_data`` carries, besides
  DCP's own storage info, each file's manifest entry (path, size, digest, chunks). The
  chunks are what lets a reader verify any part of a file on its own.
- ``finish`` (coordinator, only if every rank's ``write_data`` succeeded: DCP gathers their
  results and raises on every rank otherwise): writes ``.metadata`` (DCP's own format, with
  DCP's storage info only), uploads it, writes the manifest of every rank's files plus
  ``.metadata``, and commits with the fenced compare-and-swap of LATEST.

So a failed rank means no commit, and DCP raises ``CheckpointException`` on every rank. DCP's
collectives run on DCP's process group (``dcp.save(process_group=...)``; set its timeout
when you create it); cloudckpt adds none during a save. ``async_save`` works with the default
thread executor (DCP stages the state dict in CPU memory, then everything above runs in the
background); the process executor is not supported (the writer holds threads and clients).
Use one writer per save (``CloudStorageWriter(mgr, step=step)`` is cheap), or wait for one
save to finish before the next starts with the same writer.

Loading: the reader is built on every rank (collective): rank 0 picks the newest committed
checkpoint (or ``step``), checks its manifest and every object's size, falls back to an
older one if it is damaged, and hands every rank the verified ``.metadata``. In
``read_data`` every rank streams what its own plan reads, with no local file
(``cloudckpt.fetch``): the byte ranges of its items, grouped by file and read with parallel
ranged GETs into one buffer per stored item; of a chunked file only the chunks those ranges
touch, each fetched once and checked against its SHA-256 as it lands (the file's digest is
checked from the manifest's chunk list); a file stored whole (``chunking="off"``, or a
checkpoint from before chunked DCP saves) is read whole to check its digest, keeping only
the planned ranges. Items are then decoded and copied into the planned tensors as DCP's
``FileSystemReader`` does. Memory: the items of one window (``read_window_bytes``, 512 MiB
by default, or one item if larger; a whole-file checkpoint's items of one file at once)
plus the fetch engine's scratch buffers. Loading at another world size works as far as
DCP's planner reshards (DTensor and plain tensors).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloudckpt import digest, fetch, protocol, reader
from cloudckpt.attempts import BegunAttempt, CommitInfo
from cloudckpt.distributed import WORLD_SIZE_KEY, DistributedCheckpointManager
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptionError,
    ObjectNotFoundError,
    UnsafePathError,
)
from cloudckpt.manager import CheckpointManager
from cloudckpt.protocol import CheckpointRecord, FileEntry, Latest, Manifest
from cloudckpt.reader import SkippedCheckpoint, check_objects, fetch_manifest
from cloudckpt.retry import call_with_retries
from cloudckpt.stores import Store

try:
    import torch
    import torch.distributed as dist
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import (
        LoadItemType,
        LoadPlan,
        LoadPlanner,
        ReadItem,
        SavePlan,
        SavePlanner,
    )
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
    from torch.futures import Future
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "cloudckpt.integrations.dcp needs torch with torch.distributed: install the torch "
        "build you need first"
    ) from _exc

__all__ = ["DCP_KEY", "METADATA_FILE", "CloudStorageReader", "CloudStorageWriter"]

log = logging.getLogger("cloudckpt.dcp")

METADATA_FILE = ".metadata"  # DCP's name for the global metadata file
#: Recorded in the commit metadata of every DCP checkpoint: DCP's format version.
DCP_KEY = "cloudckpt.dcp"


# ------------------------------------------------------------------------------ helpers


def _parse_step(checkpoint_id: Any) -> int:
    """A DCP ``checkpoint_id`` as a step: ``100``, ``"100"`` or ``"step-100"``."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return checkpoint_id
    m = re.fullmatch(r"(?:step[-_]?)?(\d+)", os.fspath(checkpoint_id).strip())
    if m is None:
        raise ConfigurationError(
            f"checkpoint_id {checkpoint_id!r} is not a step",
            hint="With CloudStorageWriter/Reader, checkpoint_id is the training step "
            "(100 or 'step-100'); or pass step= to the constructor",
        )
    return int(m.group(1))


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _open_manager(
    source: str | Store | CheckpointManager,
    storage_options: Mapping[str, Any] | None,
    manager_kwargs: dict[str, Any],
) -> tuple[CheckpointManager, bool]:
    if isinstance(source, CheckpointManager):
        if manager_kwargs or storage_options:
            raise ConfigurationError(
                "storage_options and manager options apply only when a URL is given"
            )
        manager, owned = source, False
    else:
        manager = DistributedCheckpointManager(
            source, storage_options=storage_options, **manager_kwargs
        )
        owned = True
    if not isinstance(manager, DistributedCheckpointManager) and _world()[1] > 1:
        raise ConfigurationError(
            "a multi-process job needs a DistributedCheckpointManager (or a URL) here",
            hint="Build cloudckpt.distributed.DistributedCheckpointManager on every rank",
        )
    return manager, owned


# Objects that travel inside DCP's plans and write results (pickled by DCP's collectives;
# never stored: ``.metadata`` holds only DCP's own storage info).


@dataclasses.dataclass(frozen=True)
class _LocalInfo:
    """A rank's local plan: its save's token and the step it saves."""

    token: str
    step: int | None


@dataclasses.dataclass(frozen=True)
class _CloudPlan:
    """The coordinator's answer: the attempt prefix, and DCP's file-name prefix."""

    token: str
    prefix: str
    file_prefix: Any


@dataclasses.dataclass(frozen=True)
class _Uploaded:
    """One written item: DCP's storage info, and (on one item per file) the uploaded
    file's manifest entry."""

    info: Any
    entry: FileEntry | None


class _LocalWriter(FileSystemWriter):
    """DCP's own file writer, staging locally; ``.metadata`` names the cloud checkpoint."""

    def __init__(self, path: Path, meta: StorageMeta, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._meta = meta

    def storage_meta(self) -> StorageMeta | None:
        return self._meta


@dataclasses.dataclass(frozen=True)
class _Chosen:
    """The checkpoint the coordinator picked for a load, as every rank receives it: its
    record (``CheckpointRecord.to_dict``), verified manifest and DCP ``.metadata``, and the
    checkpoints skipped before it."""

    record: dict[str, Any]
    manifest: Manifest
    metadata: bytes
    skipped: tuple[SkippedCheckpoint, ...]


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


# ------------------------------------------------------------------------------ writer


class CloudStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that commits each save to a cloudckpt run.

    Args:
        target: a ``DistributedCheckpointManager`` (a plain ``CheckpointManager`` in a
            single process), or a URL (the writer then builds and owns a
            ``DistributedCheckpointManager``: construct it on every rank, ``close()`` it).
        step: the training step of this save (or pass ``checkpoint_id=step`` to DCP).
        metadata: JSON-able user metadata recorded with the commit (the coordinator's).
        thread_count, single_file_per_rank: as DCP's ``FileSystemWriter``.
        storage_options, **manager_kwargs: for the manager built from a URL.

    After ``dcp.save`` returns (or the ``async_save`` future resolves), the coordinator's
    ``commit_info`` holds the ``CommitInfo``; on other ranks it stays None.
    """

    def __init__(
        self,
        target: str | Store | CheckpointManager,
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        thread_count: int = 1,
        single_file_per_rank: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        **manager_kwargs: Any,
    ) -> None:
        super().__init__()
        self.manager, self._owns_manager = _open_manager(target, storage_options, manager_kwargs)
        self.step = None if step is None else _parse_step(step)
        self.metadata = dict(metadata or {})
        protocol.canonical_json(self.metadata)  # validates early
        self.thread_count = thread_count
        self.single_file_per_rank = single_file_per_rank
        self.commit_info: CommitInfo | None = None
        self._token = ""
        self._save_id = ""
        self._local: Path | None = None
        self._inner: _LocalWriter | None = None
        self._is_coordinator = False
        self._begun: BegunAttempt | None = None
        self._started = 0.0

    # -- lifecycle --

    def close(self) -> None:
        """Remove local leftovers; close the manager if this writer built it."""
        self._cleanup()
        if self._owns_manager:
            self.manager.close()

    def __enter__(self) -> CloudStorageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a CloudStorageWriter cannot be sent to another process; use dcp.async_save "
            "with the default thread executor (AsyncCheckpointerType.THREAD)"
        )

    def _cleanup(self) -> None:
        if self._local is not None:
            shutil.rmtree(self._local, ignore_errors=True)
            self._local = None

    def _set_up(self) -> tuple[_LocalWriter, Path]:
        """DCP's local writer and its directory, from ``set_up_storage_writer``. Raises
        RuntimeError when DCP calls out of its order (nothing set up, or already done)."""
        if self._inner is None or self._local is None:
            raise RuntimeError("CloudStorageWriter: set_up_storage_writer was not called first")
        return self._inner, self._local

    def _begun_attempt(self) -> BegunAttempt:
        """The attempt ``prepare_global_plan`` began (the coordinator's). Raises
        RuntimeError when DCP calls out of its order."""
        if self._begun is None:
            raise RuntimeError("CloudStorageWriter: prepare_global_plan was not called first")
        return self._begun

    # -- StorageWriter --

    @property
    def checkpoint_id(self) -> str:
        return f"{self.manager.url}#step={self.step}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked automatically: pass storage_writer= explicitly

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _parse_step(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        self._save_id = secrets.token_hex(16)
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ConfigurationError(
                "CloudStorageWriter needs DCP's collectives (use_collectives=True)",
                hint="The checkpoint commits once, on the coordinator, after every rank's "
                "upload; that needs the ranks to report to it",
            )
        self.manager.check_open()
        self._cleanup()
        self.commit_info = None
        self._begun = None
        self._is_coordinator = is_coordinator
        self._started = time.perf_counter()
        self._token = secrets.token_hex(8)
        self._local = self.manager.staging.root / "dcp" / self._token
        meta = StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._save_id or None)
        self._inner = _LocalWriter(
            self._local,
            meta,
            single_file_per_rank=self.single_file_per_rank,
            sync_files=False,  # uploaded at once; nothing recovers DCP staging after a crash
            thread_count=self.thread_count,
            overwrite=True,
        )
        self._inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = self._set_up()[0].prepare_local_plan(plan)
        return dataclasses.replace(plan, storage_data=_LocalInfo(self._token, self.step))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        infos = [p.storage_data for p in plans]
        if not all(
            isinstance(i, _LocalInfo) and p.usable for i, p in zip(infos, plans, strict=True)
        ):
            raise ConfigurationError(
                "the save planner dropped the plan data CloudStorageWriter needs",
                hint="Plan caching (enable_plan_caching=True) is not supported",
            )
        steps = sorted({i.step for i in infos}, key=str)
        if steps == [None]:
            raise ConfigurationError(
                "CloudStorageWriter needs the step of the save",
                hint="Pass step= to CloudStorageWriter, or checkpoint_id=step to dcp.save",
            )
        if len(steps) > 1:
            raise ConfigurationError(
                "ranks are saving different steps: "
                + ", ".join(f"rank {r}: {i.step}" for r, i in enumerate(infos)),
                hint="Every rank must save the same step",
            )
        mgr = self.manager
        if isinstance(mgr, DistributedCheckpointManager):
            if not mgr.is_coordinator:
                raise ConfigurationError(
                    "DCP's coordinator is not the manager's coordinator",
                    hint="Give dcp.save a process group over the manager's ranks, in the "
                    "same order (rank 0 commits)",
                )
            mgr.attempts.check_fenced()
        plans = self._set_up()[0].prepare_global_plan(
            [dataclasses.replace(p, storage_data=None) for p in plans]
        )
        self._begun = begun = mgr.attempts.begin(steps[0])
        return [
            dataclasses.replace(p, storage_data=_CloudPlan(i.token, begun.prefix, p.storage_data))
            for p, i in zip(plans, infos, strict=True)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        cloud = plan.storage_data
        if not isinstance(cloud, _CloudPlan) or cloud.token != self._token:
            raise ConfigurationError(
                "this save's plan does not come from this writer's coordinator",
                hint="Plan caching (enable_plan_caching=True) is not supported; use one "
                "writer per save",
            )
        mgr = self.manager
        try:
            inner, local = self._set_up()
            fut = inner.write_data(
                dataclasses.replace(plan, storage_data=cloud.file_prefix), planner
            )
            fut.wait()
            written: list[WriteResult] = fut.value()
            files = sorted({wr.storage_data.relative_path for wr in written})
            entries = mgr.attempts.upload_files(
                cloud.prefix, [(f, local / f) for f in files], chunked=True
            )
        finally:
            if not self._is_coordinator:
                self._cleanup()
        by_path = {e.path: e for e in entries}
        results = []
        for wr in written:
            entry = by_path.pop(wr.storage_data.relative_path, None)
            results.append(
                WriteResult(
                    index=wr.index,
                    size_in_bytes=wr.size_in_bytes,
                    storage_data=_Uploaded(wr.storage_data, entry),
                )
            )
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        mgr = self.manager
        try:
            (inner, local), begun = self._set_up(), self._begun_attempt()
            plain = [
                [WriteResult(wr.index, wr.size_in_bytes, wr.storage_data.info) for wr in rank]
                for rank in results
            ]
            entries = [
                wr.storage_data.entry
                for rank in results
                for wr in rank
                if wr.storage_data.entry is not None
            ]
            inner.finish(metadata, plain)  # writes .metadata locally, DCP's way
            entries += mgr.attempts.upload_files(
                begun.prefix, [(METADATA_FILE, local / METADATA_FILE)]
            )
            recorded = {
                **self.metadata,
                WORLD_SIZE_KEY: len(results),
                DCP_KEY: str(metadata.version),
            }
            latest, manifest = mgr.attempts.finish(begun, entries, recorded)
            elapsed = time.perf_counter() - self._started
            self.commit_info = CommitInfo.of(
                begun,
                latest,
                manifest,
                blocking_seconds=0.0,
                commit_seconds=elapsed,
                metadata=dict(self.metadata),
            )
            log.info(
                "committed DCP step %d from %d ranks (%d files, %d bytes) in %.2fs",
                begun.step,
                len(results),
                len(manifest.files),
                manifest.total_bytes,
                elapsed,
            )
            if isinstance(mgr, DistributedCheckpointManager):
                mgr.gc_if_due()  # on its own thread, as after the manager's own saves
        finally:
            self._cleanup()


# ------------------------------------------------------------------------------ reader


class CloudStorageReader(StorageReader):
    """A DCP ``StorageReader`` for a committed checkpoint of a cloudckpt run.

    Construct it on every rank (it picks the checkpoint collectively). ``step`` is the
    chosen checkpoint's step, or None when nothing is committed (``dcp.load`` would raise
    ``CheckpointNotFoundError``).

    Args:
        source: a ``DistributedCheckpointManager`` (a plain ``CheckpointManager`` in a
            single process), or a URL (the reader builds and owns a manager; ``close()``).
        step: load this step instead of the newest committed checkpoint.
        claim: claim the run on rank 0 first, fencing older writers; what resuming a
            training job should do (the manager then saves without claiming again).
        read_window_bytes: the most item bytes a rank holds in memory at once while it
            loads (one item if larger); see the module docstring.
        cache_dir: no longer used (the reader streams; nothing is written locally);
            accepted so existing code keeps working.
    """

    def __init__(
        self,
        source: str | Store | CheckpointManager,
        *,
        step: int | None = None,
        claim: bool = False,
        read_window_bytes: int = 512 * 1024 * 1024,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        **manager_kwargs: Any,
    ) -> None:
        super().__init__()
        self.manager, self._owns_manager = _open_manager(source, storage_options, manager_kwargs)
        self.cache_dir = cache_dir
        self.read_window_bytes = read_window_bytes
        #: What the last ``read_data`` read (``fetch.ReadStats``), on this rank.
        self.read_stats: fetch.ReadStats | None = None
        self.load_id = secrets.token_hex(16)
        self._metadata: Metadata | None = None
        self._is_coordinator = False
        try:
            chosen = self._choose(None if step is None else _parse_step(step), claim)
        except BaseException:
            if self._owns_manager:
                self.manager.close()
            raise
        self.record: CheckpointRecord | None = None
        self.manifest: Manifest | None = None
        self.skipped: tuple[SkippedCheckpoint, ...] = ()
        self._metadata_bytes = b""
        if chosen is not None:
            self.record = CheckpointRecord.from_dict(chosen.record)
            self.manifest = chosen.manifest
            self._metadata_bytes = chosen.metadata
            self.skipped = chosen.skipped

    @property
    def step(self) -> int | None:
        return None if self.record is None else self.record.step

    def close(self) -> None:
        if self._owns_manager:
            self.manager.close()

    def __enter__(self) -> CloudStorageReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a CloudStorageReader cannot be sent to another process")

    # -- choosing the checkpoint --

    def _choose(self, step: int | None, claim: bool) -> _Chosen | None:
        mgr = self.manager
        if isinstance(mgr, DistributedCheckpointManager):
            return mgr.run_on_coordinator(lambda: self._pick(step, claim), "choosing a checkpoint")
        mgr.check_open()
        return self._pick(step, claim)

    def _pick(self, step: int | None, claim: bool) -> _Chosen | None:
        """(Coordinator.) The newest intact DCP checkpoint (or ``step``), verified."""
        mgr = self.manager
        latest: Latest | None
        if claim:
            latest = mgr.attempts.claim()
        else:
            latest, _ = reader.load_latest_for_reading(mgr.store)
        if latest is None or latest.current is None:
            if step is not None:
                raise CheckpointNotFoundError(f"{mgr.url} has no committed checkpoint")
            return None

        def try_one(record: CheckpointRecord) -> tuple[Manifest, bytes] | reader.Damaged:
            try:
                return self._read_metadata(record)
            except (CorruptionError, UnsafePathError) as exc:
                return reader.Damaged.of(exc)

        todo = reader.to_try(mgr.url, latest, step)
        found = reader.first_intact(mgr.store, todo, step, try_one)
        manifest, data = found.value
        return _Chosen(found.record.to_dict(), manifest, bytes(data), found.skipped)

    def _read_metadata(self, record: CheckpointRecord) -> tuple[Manifest, bytes]:
        """(Coordinator.) ``record``'s manifest and DCP ``.metadata``, verified.
        Raises CorruptionError, UnsafePathError, ConfigurationError (not saved by DCP)."""
        mgr = self.manager
        manifest = fetch_manifest(mgr.store, record)
        check_objects(mgr.store, record, manifest)
        meta = next((e for e in manifest.files if e.path == METADATA_FILE), None)
        if meta is None:
            raise ConfigurationError(
                f"the checkpoint of step {record.step} was not saved by DCP "
                f"(it has no {METADATA_FILE})",
                hint="Pass step= of a checkpoint saved with CloudStorageWriter",
            )
        key = record.ckpt + protocol.FILES_DIR + METADATA_FILE
        try:
            data = call_with_retries(
                lambda: mgr.store.get_range(key, 0, meta.size + 1), what=f"read {key}"
            )
        except ObjectNotFoundError:
            raise CorruptionError(f"{METADATA_FILE} of step {record.step} is missing") from None
        if len(data) != meta.size or (digest.tree_digest(data, manifest.chunk_size) != meta.digest):
            raise CorruptionError(
                f"{METADATA_FILE} of step {record.step} does not match its digest"
            )
        return manifest, data

    # -- StorageReader --

    @property
    def checkpoint_id(self) -> str:
        return f"{self.manager.url}#step={self.step}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked automatically: pass storage_reader= explicitly

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and _parse_step(checkpoint_id) != self.step:
            raise ConfigurationError(
                f"this reader loads step {self.step}, not {checkpoint_id!r}",
                hint="Build a CloudStorageReader with step= for another checkpoint",
            )
        self.load_id = secrets.token_hex(16)

    def _chosen(self) -> tuple[CheckpointRecord, Manifest]:
        """The checkpoint this reader loads. Raises CheckpointNotFoundError if none is."""
        if self.record is None or self.manifest is None:
            raise CheckpointNotFoundError(f"{self.manager.url} has no committed checkpoint")
        return self.record, self.manifest

    def read_metadata(self) -> Metadata:
        self._chosen()  # raises if there is no checkpoint
        metadata = pickle.loads(self._metadata_bytes)  # verified against LATEST's digest chain
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._metadata = metadata
        self._is_coordinator = is_coordinator
        self._setup_args = (args, kwargs)
        if metadata.storage_data is None:
            raise CorruptionError("the checkpoint's .metadata has no storage data")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Stream what this rank's plan reads straight from the store, verified (module
        docstring), and load it into the planned tensors. No collective: each rank reads
        on its own, and DCP gathers every rank's outcome.

        Raises: CorruptionError (damaged or missing data: the load fails on every rank),
        StoreError.
        """
        assert self._metadata is not None and self.record is not None and self.manifest is not None
        self.manager.check_open()
        storage = self._metadata.storage_data
        by_path = {e.path: e for e in self.manifest.files}
        items: dict[Any, tuple[Any, list[ReadItem]]] = {}
        for req in plan.items:
            info = storage[req.storage_index]
            if info.relative_path not in by_path:
                raise CorruptionError(
                    f"step {self.record.step} has no file {info.relative_path!r} that its "
                    "metadata names"
                )
            items.setdefault(req.storage_index, (info, []))[1].append(req)
        stats = fetch.ReadStats()
        for batch in _batches(items, by_path, self.read_window_bytes):
            self._read_batch(batch, by_path, planner, stats)
        self.read_stats = stats
        return _done(None)

    def _read_batch(
        self,
        batch: list[tuple[Any, list[ReadItem]]],
        by_path: Mapping[str, FileEntry],
        planner: LoadPlanner,
        stats: fetch.ReadStats,
    ) -> None:
        """Fetch the items of ``batch`` (verified) into buffers, then load each of its
        read items as DCP's ``FileSystemReader`` does."""
        from cloudckpt.integrations._torch_restore import TensorSink

        mgr, record, manifest = self.manager, self.record, self.manifest
        assert record is not None and manifest is not None
        buffers = [bytearray(info.length) for info, _ in batch]
        sink = TensorSink(None)
        jobs = []
        for path in sorted({info.relative_path for info, _ in batch}):
            mine = [
                (info, buf)
                for (info, _), buf in zip(batch, buffers, strict=True)
                if info.relative_path == path
            ]
            sink.add_job([(i.offset, i.offset + i.length, memoryview(b)) for i, b in mine])
            ranges = tuple((i.offset, i.length) for i, _ in mine)
            jobs.append(fetch.FileJob(by_path[path], ranges=ranges))
        fetch.read_files(
            mgr.engine,
            mgr.store,
            record.ckpt + protocol.FILES_DIR,
            jobs,
            sink,
            leaf_size=manifest.chunk_size,
            stats=stats,
        )
        transforms = _StorageReaderTransforms()
        for (info, reqs), buf in zip(batch, buffers, strict=True):
            for req in reqs:
                _load_item(req, info, buf, transforms, planner)


def _batches(
    items: Mapping[Any, tuple[Any, list[ReadItem]]],
    by_path: Mapping[str, FileEntry],
    window: int,
) -> list[list[tuple[Any, list[ReadItem]]]]:
    """The stored items to read, in file order, cut into batches of at most ``window``
    bytes (or one item). A file whose digest needs every byte (stored whole) is not cut:
    its items are only usable once the whole file verified."""
    ordered = sorted(items.values(), key=lambda t: (t[0].relative_path, t[0].offset))
    batches: list[list[tuple[Any, list[ReadItem]]]] = []
    current: list[tuple[Any, list[ReadItem]]] = []
    size = 0
    for info, reqs in ordered:
        entry = by_path[info.relative_path]
        cuttable = entry.chunks is not None and fetch.manifest_root(entry) is not None
        same_file = bool(current) and current[-1][0].relative_path == info.relative_path
        if current and size + info.length > window and (cuttable or not same_file):
            batches.append(current)
            current, size = [], 0
        current.append((info, reqs))
        size += info.length
    if current:
        batches.append(current)
    return batches


def _load_item(
    req: ReadItem, info: Any, data: bytearray, transforms: Any, planner: LoadPlanner
) -> None:
    """One read item from its stored item's verified bytes (``FileSystemReader``'s way)."""
    stream = transforms.transform_load_stream(
        req, info.transform_descriptors or (), io.BytesIO(data)
    )
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(stream.read(-1)))
        return
    seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
    tensor = torch.load(seekable, map_location="cpu", weights_only=True)
    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise CorruptionError(
            f"item {req.storage_index} of {info.relative_path} has size {tuple(tensor.size())}, "
            f"the plan expects {tuple(target.size())}"
        )
    target.copy_(tensor)
    planner.commit_tensor(req, target)
