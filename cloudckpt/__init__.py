"""cloudckpt: crash-safe ML training checkpoints on object storage.

Public API (everything else is private and may change):

- ``CheckpointManager``: stage, upload in the background, commit through ``LATEST``,
  resume and restore with verification and fallback.
- The error tree rooted at ``CloudCkptError`` (see ``cloudckpt.errors``).
- ``open_store``: the store layer, for tools that need raw access.
"""

from cloudckpt._version import __version__
from cloudckpt.attempts import CommitInfo
from cloudckpt.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CloudCkptError,
    CommitConflictError,
    CommitStateUnknownError,
    ConfigurationError,
    CorruptionError,
    CredentialsError,
    DestinationNotEmptyError,
    FencedError,
    MissingChunkError,
    MissingDependencyError,
    NeedsRepairError,
    NotARunError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PermissionDeniedError,
    PreconditionFailedError,
    SaveDroppedError,
    SaverStoppedError,
    StagingError,
    StaleAttemptError,
    StoreConflictError,
    StoreError,
    TransientStoreError,
    UnknownFormatError,
    UnsafePathError,
    UnsupportedBackendError,
)
from cloudckpt.manager import CheckpointManager
from cloudckpt.reader import SkippedCheckpoint
from cloudckpt.restore import RestoreResult
from cloudckpt.runview import CheckpointInfo
from cloudckpt.savequeue import SaveHandle
from cloudckpt.stores import open_store
from cloudckpt.transfer import TransferConfig

__all__ = [
    "BucketNotFoundError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CloudCkptError",
    "CommitConflictError",
    "CommitInfo",
    "CommitStateUnknownError",
    "ConfigurationError",
    "CorruptionError",
    "CredentialsError",
    "DestinationNotEmptyError",
    "FencedError",
    "MissingChunkError",
    "MissingDependencyError",
    "NeedsRepairError",
    "NotARunError",
    "ObjectNotFoundError",
    "OutcomeUnknownError",
    "PermissionDeniedError",
    "PreconditionFailedError",
    "RestoreResult",
    "SaveDroppedError",
    "SaveHandle",
    "SaverStoppedError",
    "SkippedCheckpoint",
    "StagingError",
    "StaleAttemptError",
    "StoreConflictError",
    "StoreError",
    "TransferConfig",
    "TransientStoreError",
    "UnknownFormatError",
    "UnsafePathError",
    "UnsupportedBackendError",
    "__version__",
    "open_store",
]
