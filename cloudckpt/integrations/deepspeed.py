"""DeepSpeed checkpoints on object storage, committed through LATEST.

DeepSpeed's ``engine.save_checkpoint`` writes with ``torch.save`` to a local directory
(it cannot write to ``s3://``, ``gs://`` or ``az://``). These functions let it write into
cloudckpt's per-rank staging directory and commit through a ``DistributedCheckpointManager``::

    import deepspeed
    from cloudckpt.integrations import deepspeed as ds_ckpt

    engine, *_ = deepspeed.initialize(model=model, model_parameters=..., config=cfg)
    mgr = ds_ckpt.checkpoint_manager("s3://bucket/runs/exp1", staging_dir="/nvme/ckpt")
    resumed = ds_ckpt.load_checkpoint(engine, mgr, "/nvme/restore")  # every rank; None: new run
    ...
    ds_ckpt.save_checkpoint(engine, mgr, step)   # every rank; returns once staged
    ...
    mgr.close()                                   # every rank: waits for the last commit

What a checkpoint holds is exactly what ``engine.save_checkpoint(dir, tag)`` writes into
``dir``: ``global_step<N>/mp_rank_00_model_states.pt`` (data-parallel rank 0), one ZeRO
optimizer shard per data-parallel rank (``[bf16_]zero_pp_rank_<r>_mp_rank_<m>_optim_states.pt``;
with ZeRO-3 also ``zero_pp_rank_<r>_mp_rank_<m>_model_states.pt``), ``latest`` naming the
tag, and rank 0's ``zero_to_fp32.py``. Every rank stages what it writes in its own staging
directory (no shared filesystem needed) and uploads it; the manager commits once every
rank's files are in (``per_rank_dirs=False``: the ranks' paths merge into DeepSpeed's own
layout, and two ranks writing one path is refused before anything is uploaded). A restored
checkpoint is therefore a directory ``engine.load_checkpoint`` reads, and
``cloudckpt restore URL DIR`` gives one that DeepSpeed's ``zero_to_fp32.py`` converts.

Restoring, each node downloads the whole checkpoint once into the node-local ``into``
directory (DeepSpeed reads other ranks' files when it reshards ZeRO state); then every rank
calls ``engine.load_checkpoint`` on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloudckpt.distributed import DistributedCheckpointManager, DistributedRestoreResult
from cloudckpt.errors import CheckpointNotFoundError, ConfigurationError
from cloudckpt.savequeue import SaveHandle

LATEST_FILE = "latest"  # DeepSpeed's own pointer to the newest tag in a save directory
TAG_PREFIX = "global_step"  # DeepSpeed's default tag: f"global_step{engine.global_steps}"


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What ``load_checkpoint`` restored: the step, DeepSpeed's tag, the local directory
    DeepSpeed loaded from, its ``client_state``, and the restore's details."""

    step: int
    tag: str
    path: Path
    client_state: dict[str, Any]
    restore: DistributedRestoreResult


def tag_for(step: int) -> str:
    """DeepSpeed's default tag for ``step`` (``global_step<step>``)."""
    return f"{TAG_PREFIX}{step}"


def checkpoint_manager(url: str, **kwargs: Any) -> DistributedCheckpointManager:
    """A ``DistributedCheckpointManager`` for DeepSpeed checkpoints (every rank, same
    arguments; after ``deepspeed.initialize``, which sets up ``torch.distributed``).
    ``kwargs`` as ``DistributedCheckpointManager`` takes them; ``per_rank_dirs`` is False.

    Raises: as ``DistributedCheckpointManager``; ConfigurationError for ``per_rank_dirs=True``.
    """
    if kwargs.pop("per_rank_dirs", False):
        raise ConfigurationError(
            "DeepSpeed checkpoints need per_rank_dirs=False",
            hint="Leave per_rank_dirs out: DeepSpeed names each rank's files itself",
        )
    return DistributedCheckpointManager(url, per_rank_dirs=False, **kwargs)


def _check_manager(manager: DistributedCheckpointManager) -> None:
    if not isinstance(manager, DistributedCheckpointManager):
        raise ConfigurationError(
            f"expected a DistributedCheckpointManager, got {type(manager).__name__}",
            hint="Make one with cloudckpt.integrations.deepspeed.checkpoint_manager(url)",
        )
    if manager.per_rank_dirs:
        raise ConfigurationError(
            "this manager stores each rank's files under rank-<r>/, which DeepSpeed cannot "
            "load back",
            hint="Make it with checkpoint_manager(url) (per_rank_dirs=False)",
        )


def save_checkpoint(
    engine: Any,
    manager: DistributedCheckpointManager,
    step: int | None = None,
    *,
    client_state: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    exclude_frozen_parameters: bool = False,
) -> SaveHandle:
    """Every rank: ``engine.save_checkpoint`` into this rank's staging directory (tag
    ``global_step<step>``; ``step`` defaults to ``engine.global_steps``), then the upload
    and commit run in the background. ``handle.result()`` returns the same ``CommitInfo``
    on every rank, or raises the same error; ``manager.wait()`` / ``close()`` raise a
    failed save too. The metadata records the tag and ZeRO stage.

    Raises: ConfigurationError (a manager with per-rank directories), StagingError,
    whatever ``engine.save_checkpoint`` raises (nothing is committed then, on any rank).
    """
    _check_manager(manager)
    if step is None:
        step = int(engine.global_steps)
    tag = tag_for(step)
    meta = dict(metadata or {})
    meta["deepspeed"] = {
        "tag": tag,
        "zero_stage": int(engine.zero_optimization_stage()),
        "world_size": int(engine.world_size),
    }
    handle = manager.save(step, meta, metrics=metrics)
    with handle as staging:
        engine.save_checkpoint(
            str(staging),
            tag=tag,
            client_state=dict(client_state or {}),
            save_latest=True,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
    return handle


def load_checkpoint(
    engine: Any,
    manager: DistributedCheckpointManager,
    into: str | os.PathLike[str],
    *,
    step: int | None = None,
    claim: bool = True,
    overwrite: bool = False,
    **load_options: Any,
) -> Resumed | None:
    """Every rank: restore the newest committed checkpoint (or ``step``) into the
    node-local directory ``into`` (verified), then ``engine.load_checkpoint`` from it.
    With ``claim`` (the default, for a job that goes on saving) rank 0 first claims the
    run, fencing any older writer; ``claim=False`` only reads. ``load_options`` go to
    ``engine.load_checkpoint`` (``load_optimizer_states``, ``load_module_only``...).
    Returns None for a new, empty run.

    Raises: CheckpointNotFoundError (no such step, or a checkpoint DeepSpeed did not
    write), CorruptionError, DestinationNotEmptyError (``into`` holds files and not
    ``overwrite``), StoreError, CollectiveError; ConfigurationError (a manager with
    per-rank directories).
    """
    _check_manager(manager)
    if claim:
        result = manager.resume(into, step=step, overwrite=overwrite)
    else:
        result = manager.restore(into, step=step, overwrite=overwrite)
    if result is None:
        return None
    tag = _tag_of(result)
    load_path, client_state = engine.load_checkpoint(str(result.path), tag=tag, **load_options)
    if load_path is None:  # DeepSpeed logs a warning and returns (None, None)
        raise CheckpointNotFoundError(
            f"DeepSpeed found no checkpoint {tag} in step {result.step} restored to {result.path}",
            hint="Check the files listed by `cloudckpt show URL --step "
            f"{result.step}`: DeepSpeed needs {tag}/mp_rank_00_model_states.pt",
        )
    return Resumed(result.step, tag, result.path, dict(client_state or {}), result)


def _tag_of(result: DistributedRestoreResult) -> str:
    """The tag DeepSpeed saved: the restored ``latest`` file names it (the default tag if
    absent). Raises CheckpointNotFoundError for a checkpoint that holds no such directory."""
    tag = tag_for(result.step)
    with contextlib.suppress(FileNotFoundError):
        tag = (result.path / LATEST_FILE).read_text().strip() or tag
    if os.sep in tag or tag in ("", ".", "..") or not (result.path / tag).is_dir():
        raise CheckpointNotFoundError(
            f"step {result.step} is not a DeepSpeed checkpoint: {result.path} holds no "
            f"{tag}/ directory",
            hint="Restore it with `cloudckpt restore` and load it as it was saved, or pass "
            "step= a checkpoint that save_checkpoint() made",
        )
    return tag
