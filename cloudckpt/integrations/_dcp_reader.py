"""DCP's ``StorageReader`` for a cloudckpt run: the coordinator picks the newest intact
checkpoint (or a step), every rank streams what its plan reads, verified, in windows
(``cloudckpt.integrations.dcp`` describes the calls).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import secrets
from collections.abc import Mapping
from typing import Any

from cloudckpt import attempt_layout, digest, fetch, reader
from cloudckpt.distributed import DistributedCheckpointManager
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptionError,
    ObjectNotFoundError,
    UnsafePathError,
)
from cloudckpt.integrations._dcp_common import (
    METADATA_FILE,
    NEEDS_TORCH,
    done,
    open_manager,
    parse_step,
)
from cloudckpt.manager import ManagerBase
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import CheckpointRecord, Latest
from cloudckpt.reader import SkippedCheckpoint, check_objects, fetch_manifest
from cloudckpt.retry import call_with_retries
from cloudckpt.stores import Store

try:
    import torch
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
    from torch.distributed.checkpoint.storage import StorageReader
    from torch.futures import Future
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise ImportError(NEEDS_TORCH) from _exc


@dataclasses.dataclass(frozen=True)
class _Chosen:
    """The checkpoint the coordinator picked for a load, as every rank receives it: its
    record (``CheckpointRecord.to_dict``), verified manifest and DCP ``.metadata``, and the
    checkpoints skipped before it."""

    record: dict[str, Any]
    manifest: Manifest
    metadata: bytes
    skipped: tuple[SkippedCheckpoint, ...]


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
        source: str | Store | ManagerBase,
        *,
        step: int | None = None,
        claim: bool = False,
        read_window_bytes: int = 512 * 1024 * 1024,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        **manager_kwargs: Any,
    ) -> None:
        super().__init__()
        self.manager, self._owns_manager = open_manager(source, storage_options, manager_kwargs)
        self.cache_dir = cache_dir
        self.read_window_bytes = read_window_bytes
        #: What the last ``read_data`` read (``fetch.ReadStats``), on this rank.
        self.read_stats: fetch.ReadStats | None = None
        self.load_id = secrets.token_hex(16)
        self._metadata: Metadata | None = None
        self._is_coordinator = False
        try:
            chosen = self._choose(None if step is None else parse_step(step), claim)
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
        key = record.ckpt + attempt_layout.FILES_DIR + METADATA_FILE
        try:
            data = call_with_retries(
                lambda: mgr.store.get_range(key, 0, meta.size + 1), what=f"read {key}"
            )
        except ObjectNotFoundError:
            raise CorruptionError(f"{METADATA_FILE} of step {record.step} is missing") from None
        if len(data) != meta.size or (
            digest.tree_digest(data, manifest.chunk_size, meta.algorithm) != meta.digest
        ):
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
        if checkpoint_id is not None and parse_step(checkpoint_id) != self.step:
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
        batches = _batches(items, by_path, self.read_window_bytes)
        if len(batches) > 1:
            # Nothing is applied before every byte the plan reads verified: the later
            # windows are read once to check them (their chunks against their SHA-256,
            # whole files against their digests), keeping nothing, then again to load.
            self._verify_batches(batches[1:], by_path, stats)
        for batch in batches:
            self._read_batch(batch, by_path, planner, stats)
        self.read_stats = stats
        return done(None)

    def _jobs(
        self, batch: list[tuple[Any, list[ReadItem]]], by_path: Mapping[str, FileEntry]
    ) -> list[tuple[str, list[Any], fetch.FileJob]]:
        """(path, the batch's stored items in it, the read of their ranges) per file."""
        out = []
        for path in sorted({info.relative_path for info, _ in batch}):
            infos = [info for info, _ in batch if info.relative_path == path]
            ranges = tuple((i.offset, i.length) for i in infos)
            out.append((path, infos, fetch.FileJob(by_path[path], ranges=ranges)))
        return out

    def _verify_batches(
        self,
        batches: list[list[tuple[Any, list[ReadItem]]]],
        by_path: Mapping[str, FileEntry],
        stats: fetch.ReadStats,
    ) -> None:
        """Read what ``batches`` read, verified, keeping nothing. Raises CorruptionError
        (damaged or missing data: nothing was applied yet), StoreError."""
        assert self.record is not None and self.manifest is not None
        ranges: dict[str, list[tuple[int, int]]] = {}
        for batch in batches:  # one read per file: a chunk is checked once
            for path, _infos, job in self._jobs(batch, by_path):
                ranges.setdefault(path, []).extend(job.ranges or ())
        jobs = [fetch.FileJob(by_path[p], ranges=tuple(sorted(r))) for p, r in ranges.items()]
        fetch.verify_files(
            self.manager.engine,
            self.manager.store,
            self.record.ckpt + attempt_layout.FILES_DIR,
            jobs,
            leaf_size=self.manifest.chunk_size,
            stats=stats,
        )

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
        buffers = {id(info): bytearray(info.length) for info, _ in batch}
        sink = TensorSink(None)
        jobs = []
        for _path, infos, job in self._jobs(batch, by_path):
            sink.add_job(
                [(i.offset, i.offset + i.length, memoryview(buffers[id(i)])) for i in infos]
            )
            jobs.append(job)
        fetch.read_files(
            mgr.engine,
            mgr.store,
            record.ckpt + attempt_layout.FILES_DIR,
            jobs,
            sink,
            leaf_size=manifest.chunk_size,
            stats=stats,
        )
        transforms = _StorageReaderTransforms()
        for info, reqs in batch:
            for req in reqs:
                _load_item(req, info, buffers[id(info)], transforms, planner)


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
