"""The public surface is written down (docs/api.md) and pinned here: each public module's
``__all__`` is exactly the list below, every name in it exists and is documented, and
docs/api.md names every one. Changing the surface means changing this file and that page."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import cloudckpt.errors as errors

ROOT = Path(__file__).resolve().parent.parent

ERRORS_EXPORTED_AT_TOP = [
    "BucketNotFoundError", "CheckpointNotFoundError", "ChecksumMismatchError", "CloudCkptError",
    "CommitConflictError", "CommitStateUnknownError", "ConfigurationError", "CorruptionError",
    "CredentialsError", "DestinationNotEmptyError", "FencedError", "MissingChunkError",
    "MissingDependencyError", "NeedsRepairError", "NotARunError", "ObjectNotFoundError",
    "OutcomeUnknownError", "PermissionDeniedError", "PreconditionFailedError",
    "SaveDroppedError", "SaverStoppedError", "StagingError", "StaleAttemptError",
    "StoreConflictError", "StoreError", "TransientStoreError", "UnknownFormatError",
    "UnsafePathError", "UnsupportedBackendError",
]  # fmt: skip

SURFACE = {
    "cloudckpt": [
        "CheckpointInfo", "CheckpointManager", "CommitInfo", "RestoreResult", "SaveHandle",
        "SkippedCheckpoint", "TransferConfig", "__version__", "open_store",
        *ERRORS_EXPORTED_AT_TOP,
    ],
    "cloudckpt.errors": [
        *ERRORS_EXPORTED_AT_TOP, "ActiveWriterError", "ChunkSourceDroppedError",
        "CollectiveError", "CorruptRecordError", "RankFailedError", "ResumedChunksTooOldError",
        "ReusedChunkMissingError", "ReplicaDivergedError",
        "DemoError", "redact_url", "scrub",
    ],
    "cloudckpt.stores": [
        "CREATE", "Capabilities", "Create", "MultipartUpload", "OVERWRITE", "ObjectInfo",
        "Overwrite", "PartInfo", "PendingUpload", "PutMode", "RunURL", "Store", "Update",
        "crc32c_b64", "open_store", "parse_url", "split_url",
    ],
    "cloudckpt.catalog": [
        "CheckpointDiff", "CopyResult", "ExportResult", "FileChange", "FileResult",
        "FilesResult", "RunInfo", "copy_checkpoint", "diff_checkpoints", "export_checkpoint",
        "file_digest", "get_file", "get_files", "list_runs",
    ],
    "cloudckpt.distributed": [
        "CollectiveError", "DistributedCheckpointManager", "DistributedRestoreResult",
        "RankFailedError", "ReplicaDivergedError", "WORLD_SIZE_KEY", "rank_dir",
    ],
    "cloudckpt.preemption": [
        "AWSSpotSource", "AzureScheduledEventsSource", "GCEPreemptedSource", "PreemptionNotice",
        "PreemptionSource", "PreemptionWatcher", "detect_clouds",
    ],
    "cloudckpt.integrations.torch": [
        "FORMAT", "HostMemoryStats", "LoadReport", "StateSaver", "host_memory_stats",
        "load_state", "reserve_host_memory", "resume_state", "save_state",
    ],
    "cloudckpt.integrations.hf": ["CheckpointCallback", "fix_trainer_state", "resume"],
    "cloudckpt.integrations.lightning": [
        "CloudCheckpointIO", "PreemptionCallback", "RNGStateCallback", "resume",
    ],
    "cloudckpt.integrations.dcp": [
        "CloudStorageReader", "CloudStorageWriter", "DCP_KEY", "METADATA_FILE",
    ],
    "cloudckpt.testing.faults": [
        "Callback", "Conflict", "Crash", "DeliverTwice", "FailBefore", "Fault",
        "FaultInjectingStore", "Latency", "LoseResponse", "Rule", "ShortRead", "Truncate", "delete_latest",
        "flip_bit", "truncate_object",
    ],
    "cloudckpt.testing.conformance": [
        "ALL_CHECKS", "StoreOpener", "check_cas_increments",
        "check_chunked_checkpoint_roundtrip", "check_clock", "check_create_refuses_existing",
        "check_cut_responses", "check_listing", "check_multipart_roundtrip", "check_racing_creates",
        "check_racing_creates_processes", "check_ranged_reads_into", "check_read_write_basics",
        "check_stale_version_fails", "check_update_missing_fails", "check_versions_change",
        "run_all",
    ],
    "cloudckpt.testing.simulation": [
        "SimResult", "Simulation", "replay_command", "run_seed", "run_seeds",
    ],
    "cloudckpt.failpoints": ["POINTS", "SimulatedCrash", "arm", "armed", "disarm", "hit"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SURFACE))
def test_each_public_module_exports_exactly_its_pinned_names(name):
    module = importlib.import_module(name)
    assert sorted(module.__all__) == sorted(SURFACE[name])
    for attr in module.__all__:
        value = getattr(module, attr)  # every exported name exists
        if inspect.isclass(value) or inspect.isfunction(value):
            assert (value.__doc__ or "").strip(), f"{name}.{attr} has no docstring"


def test_docs_api_names_every_public_module_and_name():
    page = (ROOT / "docs" / "api.md").read_text()
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `([a-z_.]+)` \| (.+?) \|", page, flags=re.MULTILINE)
    }
    assert set(rows) == set(SURFACE)
    for name, exported in SURFACE.items():
        named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", rows[name]))
        if name == "cloudckpt.errors":
            continue  # "every error class (the whole tree...)": checked against the tree below
        if name == "cloudckpt.testing.conformance":
            named |= {n for n in exported if n.startswith("check_")}
        missing = set(exported) - named
        assert not missing, f"docs/api.md does not name {sorted(missing)} of {name}"


def _drawn_tree() -> dict[str, str | None]:
    """Class name -> the parent it is drawn under in errors.py's docstring."""
    parent_of: dict[str, str | None] = {}
    stack: list[str] = []
    for line in errors.__doc__.splitlines():
        match = re.match(r"^( *[│ ]*(?:[├└]── )?)(\w+(?:Error|Exception))\b", line)
        if not match:
            continue
        depth = len(match.group(1)) // 4 - 1  # 4 spaces of indent, then 4 per level
        del stack[depth:]
        parent_of[match.group(2)] = stack[-1] if stack else None
        stack.append(match.group(2))
    return parent_of


def test_every_error_class_is_in_errors_and_drawn_in_its_tree():
    """Every CloudCkptError subclass in the package is defined in cloudckpt.errors (so a rank
    can rebuild it by name) and drawn in the tree of its docstring, under its parent."""
    import cloudckpt

    for info in pkgutil.walk_packages(cloudckpt.__path__, "cloudckpt."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    drawn = _drawn_tree()
    assert drawn["CloudCkptError"] is None and len(drawn) > 30
    found = {
        cls for cls in subclasses(errors.CloudCkptError) if cls.__module__.startswith("cloudckpt")
    }
    for cls in found:
        assert cls.__module__ == "cloudckpt.errors", f"{cls.__module__}.{cls.__name__}"
        assert drawn.get(cls.__name__) == cls.__mro__[1].__name__, (
            f"{cls.__name__} is not drawn under {cls.__mro__[1].__name__} in errors.py's tree"
        )
    assert set(drawn) == {c.__name__ for c in found} | {"CloudCkptError"}
