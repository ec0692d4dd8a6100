"""What the DCP writer and reader share (``cloudckpt.integrations.dcp``): the step a
``checkpoint_id`` names, the manager they work through, DCP's file names, a finished future.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from cloudckpt.distributed import DistributedCheckpointManager
from cloudckpt.errors import ConfigurationError
from cloudckpt.manager import ManagerBase
from cloudckpt.stores import Store

NEEDS_TORCH = (
    "cloudckpt.integrations.dcp needs torch with torch.distributed: install the torch "
    "build you need first"
)

try:
    import torch.distributed as dist
    from torch.futures import Future
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise ImportError(NEEDS_TORCH) from _exc

log = logging.getLogger("cloudckpt.dcp")

METADATA_FILE = ".metadata"  # DCP's name for the global metadata file
#: Recorded in the commit metadata of every DCP checkpoint: DCP's format version.
DCP_KEY = "cloudckpt.dcp"


def parse_step(checkpoint_id: Any) -> int:
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


def world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def open_manager(
    source: str | Store | ManagerBase,
    storage_options: Mapping[str, Any] | None,
    manager_kwargs: dict[str, Any],
) -> tuple[ManagerBase, bool]:
    """The manager a writer or reader works through, and whether it built (owns) it.
    Raises ConfigurationError (options with a manager given; a plain manager in a
    multi-process job)."""
    if isinstance(source, ManagerBase):
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
    if not isinstance(manager, DistributedCheckpointManager) and world()[1] > 1:
        raise ConfigurationError(
            "a multi-process job needs a DistributedCheckpointManager (or a URL) here",
            hint="Build cloudckpt.distributed.DistributedCheckpointManager on every rank",
        )
    return manager, owned


def done(value: Any) -> Future:
    """A future that has already finished with ``value`` (what DCP's calls return)."""
    fut: Future = Future()
    fut.set_result(value)
    return fut
