"""cloudckpt: crash-safe ML training checkpoints on object storage.

Public API (everything else is private and may change):

- ``CheckpointManager``: stage, upload in the background, commit through ``LATEST``,
  resume and restore with verification and fallback.
- The error tree rooted at ``CloudCkptError`` (see ``cloudckpt.errors``).
- ``open_store``: the store layer, for tools that need raw access.
"""

from cloudckpt._version import __version__
from cloudckpt.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    CloudCkptError,
    CommitConflictError,
    CommitStateUnknownError,
    ConfigurationError,
    CorruptionError,
    CredentialsError,
    DestinationNotEmptyError,
    FencedError,
    NeedsRepairError,
    PermissionDeniedError,
    StaleAttemptError,
    StoreError,
    UnsafePathError,
    UnsupportedBackendError,
)
from cloudckpt.manager import CheckpointInfo, CheckpointManager, CommitInfo, SaveHandle
from cloudckpt.restore import RestoreResult, SkippedCheckpoint
from cloudckpt.stores import open_store
from cloudckpt.transfer import TransferConfig

__all__ = [
    "BucketNotFoundError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CloudCkptError",
    "CommitConflictError",
    "CommitInfo",
    "CommitStateUnknownError",
    "ConfigurationError",
    "CorruptionError",
    "CredentialsError",
    "DestinationNotEmptyError",
    "FencedError",
    "NeedsRepairError",
    "PermissionDeniedError",
    "RestoreResult",
    "SaveHandle",
    "SkippedCheckpoint",
    "StaleAttemptError",
    "StoreError",
    "TransferConfig",
    "UnsafePathError",
    "UnsupportedBackendError",
    "__version__",
    "open_store",
]
