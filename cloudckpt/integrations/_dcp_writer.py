"""DCP's ``StorageWriter`` for a cloudckpt run: each save staged locally by DCP's own file
writer, uploaded by every rank into one attempt, committed by the coordinator
(``cloudckpt.integrations.dcp`` describes the calls).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloudckpt import canonical
from cloudckpt.attempts import BegunAttempt, CommitInfo
from cloudckpt.distributed import WORLD_SIZE_KEY, DistributedCheckpointManager
from cloudckpt.errors import ConfigurationError
from cloudckpt.integrations._dcp_common import (
    DCP_KEY,
    METADATA_FILE,
    NEEDS_TORCH,
    done,
    log,
    open_manager,
    parse_step,
)
from cloudckpt.manager import ManagerBase
from cloudckpt.manifests import FileEntry
from cloudckpt.staging import DCP_DIR
from cloudckpt.stores import Store

try:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
    from torch.futures import Future
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise ImportError(NEEDS_TORCH) from _exc


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
        target: str | Store | ManagerBase,
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        thread_count: int = 1,
        single_file_per_rank: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        **manager_kwargs: Any,
    ) -> None:
        super().__init__()
        self.manager, self._owns_manager = open_manager(target, storage_options, manager_kwargs)
        self.step = None if step is None else parse_step(step)
        self.metadata = dict(metadata or {})
        canonical.canonical_json(self.metadata)  # validates early
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
            self.step = parse_step(checkpoint_id)

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
        self._local = self.manager.staging.root / DCP_DIR / self._token
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
        return done(results)

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
