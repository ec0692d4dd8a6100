"""One error tree for everything cloudckpt raises.

Every error says what happened and what the user should do next. Errors never carry
credentials: URLs are redacted before they reach a message (see ``redact_url``).

    CloudCkptError
    ├── ConfigurationError            bad URL, bad option
    │   ├── MissingDependencyError    the backend's library is not installed (names the extra)
    │   ├── UnsupportedBackendError   the store cannot do what writing needs
    │   └── NotARunError              the location holds other data; a run would mix with it
    ├── StoreError                    a store call failed (normalised across backends)
    │   ├── ObjectNotFoundError       the key does not exist
    │   ├── BucketNotFoundError       the bucket/container/root does not exist
    │   ├── PreconditionFailedError   a create-only or compare-and-swap write lost (HTTP 412)
    │   ├── StoreConflictError        concurrent conditional writes collided; retry (HTTP 409)
    │   ├── PermissionDeniedError     credentials are valid but not allowed (HTTP 403)
    │   ├── CredentialsError          no credentials, or the store rejected them
    │   ├── TransientStoreError       failed before any effect; safe to retry
    │   │   └── ChecksumMismatchError the store received bytes that do not match their CRC32C
    │   └── OutcomeUnknownError       a write may or may not have been applied
    ├── FencedError                   a newer writer claimed the run; this writer must stop
    ├── CommitConflictError           the commit kept losing to concurrent edits
    ├── CommitStateUnknownError       cannot tell whether the commit landed
    ├── StaleAttemptError             an attempt is too old to commit safely (GC may own it)
    ├── CorruptionError               data does not match its recorded digest; nothing usable
    │   ├── MissingChunkError         a chunk a manifest names is missing or damaged
    │   └── CorruptRecordError        a LATEST, commit record or manifest does not parse or verify
    ├── UnknownFormatError            a record or setting this version does not know (upgrade)
    ├── NeedsRepairError              checkpoints exist but LATEST is missing or unreadable
    ├── CheckpointNotFoundError       no committed checkpoint matches the request
    ├── DestinationNotEmptyError      a restore target holds files, or cannot be one
    ├── StagingError                  local staging failed (disk full, files changed under us)
    ├── SaveDroppedError              a queued save was replaced by a newer one (backpressure)
    ├── SaverStoppedError             the background saver stopped for good; restart, never retry
    ├── ChunkSourceDroppedError       chunks a save reuses lost their retained source (retried)
    │   ├── ReusedChunkMissingError   chunks a save reuses are not in the store (re-uploaded)
    │   └── ResumedChunksTooOldError  chunks resumed from an interrupted attempt grew too old
    ├── UnsafePathError               a manifest path would escape the destination
    ├── ActiveWriterError             taking over the run would fence a writer still running
    ├── RankFailedError               ranks of a multi-rank save failed; nothing was committed
    ├── ReplicaDivergedError          data-parallel replicas saved different bytes; no commit
    ├── CollectiveError               a multi-rank collective failed or timed out (a rank died)
    └── DemoError                     ``cloudckpt demo`` could not show what it set out to

Every class is defined here, so that one rank of a multi-rank job can rebuild by name the
error another rank raised (``cloudckpt.distributed``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "ActiveWriterError",
    "BucketNotFoundError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "ChunkSourceDroppedError",
    "CloudCkptError",
    "CollectiveError",
    "CommitConflictError",
    "CommitStateUnknownError",
    "ConfigurationError",
    "CorruptRecordError",
    "CorruptionError",
    "CredentialsError",
    "DemoError",
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
    "RankFailedError",
    "ReplicaDivergedError",
    "ResumedChunksTooOldError",
    "ReusedChunkMissingError",
    "SaveDroppedError",
    "SaverStoppedError",
    "StagingError",
    "StaleAttemptError",
    "StoreConflictError",
    "StoreError",
    "TransientStoreError",
    "UnknownFormatError",
    "UnsafePathError",
    "UnsupportedBackendError",
    "redact_url",
    "scrub",
]

_SECRET_QUERY = re.compile(
    r"(?i)(x-amz-(signature|credential|security-token)|signature|sig|token|key|secret"
    r"|password|passwd|pwd|access_token|credential|auth\w*|session\w*|private\w*|code)=[^&]*"
)


#: Schemes whose URLs write ``CONTAINER@ACCOUNT`` where others write ``USER@HOST``.
_CONTAINER_AT_ACCOUNT = frozenset({"abfs", "abfss", "az", "adl", "wasb", "wasbs"})


def redact_url(url: str) -> str:
    """Return ``url`` with any user-info, secret-looking query values and the fragment
    (``s3://b/run#TOKEN``: never sent to a server, so anything may hide there) masked."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        # abfs[s]://CONTAINER@ACCOUNT...: the part before "@" names the container, not a
        # user; only a password-like "CONTAINER:SECRET" there is masked.
        if parts.scheme.lower() in _CONTAINER_AT_ACCOUNT and ":" not in user:
            netloc = f"{user}@{host}"
        else:
            netloc = "***@" + host
    query = _SECRET_QUERY.sub(lambda m: m.group(1) + "=***", parts.query)
    fragment = "***" if parts.fragment else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` (a library's error message, say) with every URL in it redacted
    (``redact_url``) and every string of ``secrets`` replaced by ``***``."""
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group()), text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


_E = TypeVar("_E", bound="CloudCkptError")


class CloudCkptError(Exception):
    """Base class of every error cloudckpt raises on purpose.

    ``hint`` says what to do next; it is appended to the message. ``cli_hint``, where
    the hint names Python arguments (``overwrite=True``), says the same in the command
    line's words (``--force``): the CLI prints it instead of ``hint``.
    """

    default_hint: str = ""
    default_cli_hint: str = ""  # the default hint in the CLI's words, where they differ

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = self.default_hint if hint is None else hint
        self.cli_hint: str | None = (self.default_cli_hint or None) if hint is None else None
        super().__init__(f"{message}. {self.hint}" if self.hint else message)

    def with_cli_hint(self: _E, cli_hint: str) -> _E:
        """This error, whose hint in the CLI is ``cli_hint`` (returns ``self``, to raise)."""
        self.cli_hint = cli_hint
        return self


class ConfigurationError(CloudCkptError):
    """A URL, option or environment setting is wrong or incomplete."""


class MissingDependencyError(ConfigurationError):
    """A URL needs a backend library that is not installed; ``extra`` names the
    ``cloudckpt[extra]`` that brings it. The hint is a command that works as written (the
    extra's packages; cloudckpt itself is not on the package index)."""

    def __init__(self, message: str, *, extra: str, hint: str | None = None) -> None:
        from cloudckpt._install import install_hint

        self.extra = extra
        if hint is None:
            hint = install_hint(extra)
        super().__init__(message, hint=hint)


class UnsupportedBackendError(ConfigurationError):
    """The store behind a URL lacks a capability that safe writing needs."""

    default_hint = (
        "Use s3://, gs://, az://, file:// or memory:// for writing; any fsspec URL can still be read. "
        "If exactly one process ever writes this run, you may opt in with "
        "unsafe_single_writer=True"
    )
    default_cli_hint = (
        "Use s3://, gs://, az://, file:// or memory:// for writing; any fsspec URL can still be read. "
        "If exactly one process ever writes this run, you may opt in with "
        "--unsafe-single-writer"
    )

    def __init__(self, message: str, *, capability: str = "", hint: str | None = None) -> None:
        self.capability = capability
        super().__init__(message, hint=hint)


class NotARunError(ConfigurationError):
    """A writer was pointed at a location that holds data cloudckpt did not write (and no
    LATEST): a new run there would mix its files with someone else's."""

    default_hint = (
        "Nothing was written. Give the run a location of its own: a new or empty "
        "directory or prefix. (`cloudckpt push SRC_DIR URL` takes the local checkpoint "
        "directory first and the run second)"
    )


class StoreError(CloudCkptError):
    """A call to the object store failed. Subclasses say how."""

    def __init__(self, message: str, *, key: str | None = None, hint: str | None = None) -> None:
        self.key = key
        super().__init__(message, hint=hint)


class ObjectNotFoundError(StoreError):
    """The object does not exist."""


class BucketNotFoundError(StoreError):
    """The bucket (or root directory) does not exist.

    Deliberately not an ObjectNotFoundError: a missing bucket must never look like an
    empty run, or a writer would start a new history somewhere nobody can read.
    """

    default_hint = "Check the bucket name in the URL, or create the bucket first"


class PreconditionFailedError(StoreError):
    """A create-only write found the key present, or a compare-and-swap found a newer version."""


class StoreConflictError(StoreError):
    """Concurrent conditional requests collided (S3 409 ConditionalRequestConflict).

    Nothing was applied; the request can be retried."""


class PermissionDeniedError(StoreError):
    """The credentials are valid but lack permission for this call."""

    default_hint = (
        "Grant the training role the permissions listed in docs/infrastructure.md "
        "(terraform/aws creates least-privilege writer, restore and GC policies)"
    )


class CredentialsError(StoreError):
    """No credentials were found, or the store rejected them."""

    # Each store raises it with a hint of its own (the flags and variables it reads).
    default_hint = (
        "Provide credentials the usual way for this store (docs/cli.md, 'Storage options "
        "and environment', lists what each store reads)"
    )


class TransientStoreError(StoreError):
    """A request failed before it could have had any effect (timeout on a read, 5xx, reset).

    Safe to retry."""

    default_hint = "The store or network is having trouble; the operation can be retried"


class ChecksumMismatchError(TransientStoreError):
    """The store rejected an upload because the bytes it received do not match the checksum
    sent with them (S3 BadDigest, GCS 400). Nothing was stored; the upload can be retried."""

    default_hint = "The bytes were damaged in transit; retrying the upload re-sends them"


class OutcomeUnknownError(StoreError):
    """A write was sent but no answer came back: it may or may not have been applied."""

    default_hint = "Read the object back to learn whether the write landed before retrying"


class FencedError(CloudCkptError):
    """A newer writer claimed the run (higher epoch). This writer must stop committing.

    Raised when a preempted VM that kept running (a zombie) tries to commit after its
    replacement called ``resume()``.
    """

    default_hint = (
        "Another process now owns this run. Stop this training process; do not call "
        "resume() again from it unless you are sure the other writer is gone"
    )


class CommitConflictError(CloudCkptError):
    """The commit kept losing compare-and-swap races to concurrent edits of LATEST."""

    default_hint = (
        "Something is editing LATEST continuously (pins, GC, another tool). The checkpoint "
        "data is uploaded and intact; retry the save, and check for runaway tools"
    )


class CommitStateUnknownError(CloudCkptError):
    """The commit's outcome cannot be determined (the store stopped answering)."""

    default_hint = (
        "The uploaded data is kept. Run `cloudckpt ls URL` once the store answers to see "
        "whether this step is committed; do not delete anything by hand"
    )


class StaleAttemptError(CloudCkptError):
    """An attempt is older than the garbage-collection grace period allows to commit."""

    default_hint = (
        "Garbage collection may already own this attempt's files. Save again, or raise "
        "gc_grace if uploads legitimately take this long"
    )


class CorruptionError(CloudCkptError):
    """Stored data does not match its recorded size or digest, and nothing older verifies."""

    default_hint = (
        "Run `cloudckpt verify URL --all --read-data` to see which checkpoints are intact; "
        "restore a specific one with --step"
    )

    def __init__(
        self, message: str, *, skipped: list | None = None, hint: str | None = None
    ) -> None:
        self.skipped = list(skipped or [])
        super().__init__(message, hint=hint)


class UnknownFormatError(CloudCkptError):
    """A LATEST, commit record, manifest or setting is in a format this version does not know:
    a newer cloudckpt wrote it. Not damage: nothing falls back past it, repairs it, collects
    it or writes over it. ``what`` names the record, ``found`` its format (or setting),
    ``known`` the ones this version reads, ``written_by`` the writer's version where the
    record says."""

    default_hint = (
        "A newer cloudckpt wrote this run. Upgrade cloudckpt on this host "
        "(in an up-to-date clone of the repository: pip install .) and run the command "
        "again; nothing was changed"
    )

    def __init__(
        self,
        message: str,
        *,
        what: str = "",
        found: str = "",
        known: tuple[str, ...] = (),
        written_by: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.what = what
        self.found = found
        self.known = tuple(known)
        self.written_by = written_by
        super().__init__(message, hint=hint)


class NeedsRepairError(CloudCkptError):
    """Checkpoint data exists under the run but LATEST is missing or unreadable."""

    default_hint = (
        "Run `cloudckpt repair URL` to rebuild LATEST from the commit records (it fences any "
        "old writer); never start a new run over old data"
    )


class CheckpointNotFoundError(CloudCkptError):
    """No committed checkpoint matches the request (step, pin, or the run is empty)."""

    default_hint = "Run `cloudckpt ls URL` to list the committed checkpoints"


def step_not_retained(url: str, step: int, retained: Iterable[int]) -> CheckpointNotFoundError:
    """The one error every command and API raises for a step the run does not retain:
    it names the run, the step, and the steps it does retain (newest first)."""
    steps = ", ".join(str(s) for s in sorted(set(retained), reverse=True)) or "none"
    return CheckpointNotFoundError(
        f"{url} retains no checkpoint of step {step}",
        hint=f"Retained steps: {steps} (`cloudckpt ls URL` lists them)",
    )


class DestinationNotEmptyError(CloudCkptError):
    """A restore destination already contains files, or cannot be a restore's destination
    (a file, a symbolic link to a file or to nothing, a mount point)."""

    default_hint = "Restore into an empty or new directory, or pass overwrite=True"
    default_cli_hint = "Restore into an empty or new directory, or pass --force"


class StagingError(CloudCkptError):
    """Local staging failed: the staging disk is full or unwritable, or a staged file
    changed or vanished while it was being uploaded."""

    default_hint = (
        "Nothing was committed. Free space on (or point staging_dir at) a larger local "
        "volume, and do not modify files after handing them to save()"
    )


class SaveDroppedError(CloudCkptError):
    """A queued save was dropped in favour of a newer one (``backpressure="drop_oldest"``)."""

    default_hint = (
        "Saves arrive faster than uploads finish. Save less often, raise max_pending, or "
        "use backpressure='block' so no save is dropped"
    )


class SaverStoppedError(CloudCkptError):
    """This process's background saver stopped for good: an exception that ends a process
    (``KeyboardInterrupt`` or ``SystemExit`` raised on the save worker, a simulated crash
    there or on automatic GC's thread) ended it; that exception is the ``__cause__``.
    Every later save (``save()``, ``save_dir()``, ``save_state()``, a save waiting for a
    queue slot or handed over from its block) raises this at once, and none is stored.

    Not a failed save to retry: a training loop that retries failed saves (a
    ``StoreError``, ``CommitConflictError``...) must catch this class first and stop
    instead, since every retry raises it again. Restart the process; it resumes from the
    committed checkpoint."""

    default_hint = (
        "This save was not stored, and no save can run in this process any more: do not "
        "retry it. Restart the process: it resumes from the committed checkpoint (LATEST, "
        "resume()); the cause is chained (a traceback prints it first)"
    )


class UnsafePathError(CloudCkptError):
    """A path from a manifest would land outside the destination (absolute, '..', links)."""

    default_hint = (
        "The manifest is hostile or damaged; nothing was written outside the destination. "
        "Restore an older checkpoint with --step, and check who can write to the bucket"
    )


class CorruptRecordError(CorruptionError):
    """A LATEST, commit record or manifest does not parse or verify."""


class MissingChunkError(CorruptionError):
    """A chunk a checkpoint's manifest names is missing or does not match its digest.
    A restore skips the checkpoint and falls back to an older one."""


class ChunkSourceDroppedError(CloudCkptError):
    """A save meant to reuse chunks of a checkpoint that is no longer retained (an unpin or
    another tool dropped it while the save uploaded). The save is retried without them."""

    default_hint = "Nothing was committed by this attempt; the manager uploads again in full"


class ReusedChunkMissingError(ChunkSourceDroppedError):
    """Chunks a save meant to reuse from an earlier checkpoint are not in the store (a
    lifecycle rule, a manual deletion, or that checkpoint was committed damaged). The
    save is retried with those chunks uploaded again; ``missing`` holds their names
    (``ChunkRef.name``: the hex digest, "b3-" first for BLAKE3)."""

    default_hint = (
        "Nothing was committed by this attempt; the manager uploads the missing chunks "
        "again. Check lifecycle rules and who can delete from the bucket, and run "
        "'cloudckpt verify --all' on the run"
    )

    def __init__(
        self, message: str, *, missing: frozenset[str] = frozenset(), hint: str | None = None
    ) -> None:
        self.missing = missing
        super().__init__(message, hint=hint)


class ResumedChunksTooOldError(ChunkSourceDroppedError):
    """A save meant to reuse chunks that an interrupted attempt of the same step had
    uploaded (a push stopped with Ctrl-C, a crashed trainer), but that attempt grew older
    than the run's grace period allows before the save could commit: garbage collection
    may own its chunks. The save is retried with those chunks uploaded again."""

    default_hint = (
        "Nothing was committed by this attempt; the save uploads those chunks again. "
        "Raise gc_grace if uploads legitimately take this long"
    )


class ActiveWriterError(CloudCkptError):
    """Taking over the run would fence a writer that is probably still running."""

    default_hint = (
        "If that writer is gone, or you mean to take the run over from it, call again with "
        "force=True; otherwise stop it first"
    )
    default_cli_hint = (
        "If that writer is gone, or you mean to take the run over from it, re-run with "
        "--force; otherwise stop it first"
    )


class RankFailedError(CloudCkptError):
    """One or more ranks failed before the commit; nothing was committed.

    ``failures`` maps each failed rank to its error (type and message). Every rank raises
    this error for the same save; on a failed rank its own exception is the ``__cause__``.
    """

    default_hint = (
        "Nothing was committed; the previous checkpoint is still current. Fix the failed "
        "rank's problem and save again"
    )

    def __init__(
        self,
        message: str,
        *,
        failures: Mapping[int, str] | None = None,
        hint: str | None = None,
    ) -> None:
        self.failures = dict(failures or {})
        super().__init__(message, hint=hint)


class ReplicaDivergedError(CloudCkptError):
    """Data-parallel replicas (``replica_groups``) saved different bytes where they must
    hold the same: silent data corruption on one device, or replicas that drifted apart.
    Nothing was committed; the message names the ranks and files (and where they first
    differ)."""

    default_hint = (
        "Nothing was committed; the previous checkpoint is still current. Do not resume from "
        "the diverged ranks' state: find the faulty device (the rank that disagrees with the "
        "others of its group), restart the job from the last checkpoint; if these ranks are "
        "not replicas, fix replica_groups="
    )


class CollectiveError(CloudCkptError):
    """A collective of the manager's process group failed or timed out: a rank died, hung,
    or became unreachable. The group is unusable afterwards.

    ``outcome_unknown`` is True when the coordinator went silent while committing: the
    checkpoint may or may not be committed (``cloudckpt ls`` tells).
    """

    default_hint = (
        "Restart the job (torchrun --max-restarts does it for you) and resume; the last "
        "committed checkpoint is intact. Raise timeout= if ranks legitimately wait longer "
        "for each other (e.g. one rank stages much more data than the others)"
    )

    def __init__(
        self, message: str, *, outcome_unknown: bool = False, hint: str | None = None
    ) -> None:
        self.outcome_unknown = outcome_unknown
        super().__init__(message, hint=hint)


class DemoError(CloudCkptError):
    """The demo could not run (or could not show what it set out to show)."""

    default_hint = "Re-run with -v for details; `cloudckpt demo --json` shows the full report"
