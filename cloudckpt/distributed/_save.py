"""The multi-rank save: every rank uploads into one attempt, the coordinator commits.

``save()`` is one rank's part of one save, run on its manager's background thread, in
three rounds of collectives (the package docstring tells them from the user's side):

1. every rank sends the coordinator a ``RankPlan`` (its step and paths, or its error, and
   the names of its chunks: ``_chunks.chunk_names``); the coordinator checks them, opens
   the attempt (``AttemptWriter.begin``), picks one owner for each chunk several ranks
   hold (``_chunks.owners``) and broadcasts its ``Decision``: ``Opened`` (the prefix and
   the owners) or why not;
2. every rank uploads into the prefix while the ranks exchange heartbeats
   (``Comm.run_phase``): a rank that fails stops the others' uploads early. Unless
   chunking is off, each rank uploads chunks, naming those of the checkpoint the save
   builds on (``Opened.base``) instead (``_chunks.RankChunks``), and those another rank
   owns without a put;
3. every rank sends its files' entries and the checkpoints whose chunks it named; the
   coordinator checks that replicas agree (``_replicas``), lists what is reused, writes
   the manifest and commits
   (``AttemptWriter.finish``, the single-host checks) and broadcasts the ``Committed``
   outcome (or its error), so every rank returns the same ``CommitInfo`` or raises the
   same error. If reused chunks are missing, or their checkpoint left retention, the
   outcome is ``Reupload`` and every rank runs the three rounds again, once, under a new
   attempt, uploading those chunks (or everything) again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from cloudckpt import chunks
from cloudckpt.attempts import AttemptWriter, BegunAttempt, CommitInfo
from cloudckpt.distributed import _chunks, _replicas
from cloudckpt.distributed._chunks import RankChunks, Reupload, Reusable
from cloudckpt.distributed._comm import Cancelled, Comm, RankError
from cloudckpt.errors import (
    ChunkSourceDroppedError,
    CollectiveError,
    ConfigurationError,
    RankFailedError,
    ReusedChunkMissingError,
)
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.savequeue import SaveHandle
from cloudckpt.transfer import ProgressCallback

log = logging.getLogger("cloudckpt.distributed")

_REPLICAS_NONE = _replicas.Replicas()

#: Recorded in every multi-rank commit's metadata: the world size that saved it.
WORLD_SIZE_KEY = "cloudckpt.world_size"


# ------------------------------------------------------------------------------ messages


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """What a rank sends the coordinator before a save: the step and the paths it will
    upload, or why it cannot take part; its chunks' names and which of them its kept index
    names (for the choice of owners; empty with dedup off)."""

    step: int
    paths: tuple[str, ...]
    error: RankError | None
    chunks: frozenset[str] = frozenset()
    reusable: Reusable = dataclasses.field(default_factory=lambda: Reusable(None, frozenset()))


@dataclasses.dataclass(frozen=True)
class Opened:
    """The coordinator opened the attempt every rank uploads into; ``base``: the committed
    checkpoint the save builds on (its chunks may be named instead of uploaded);
    ``owners``: the rank that puts each chunk several ranks hold (``_chunks.owners``)."""

    prefix: str
    epoch: int
    commit_id: str
    base: CheckpointRecord | None
    owners: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RanksFailed:
    """Ranks could not take part (their plans carried errors); nothing was uploaded."""

    failures: tuple[RankError, ...]

    def error(self, step: int, local_exc: BaseException | None) -> RankFailedError:
        err = RankFailedError(
            f"the checkpoint of step {step} was not committed: "
            + "; ".join(f.summary for f in self.failures),
            failures={f.rank: f.described for f in self.failures},
        )
        err.__cause__ = local_exc  # this rank's own failure, if it is one of them
        return err


@dataclasses.dataclass(frozen=True)
class Misconfigured:
    """The ranks' plans disagree (steps) or collide (paths); nothing was uploaded."""

    message: str
    hint: str


@dataclasses.dataclass(frozen=True)
class CoordinatorFailed:
    """The coordinator could not open the attempt (fenced, a store error...)."""

    error: RankError


#: The coordinator's answer to the ranks' plans.
Decision = Opened | RanksFailed | Misconfigured | CoordinatorFailed


@dataclasses.dataclass(frozen=True)
class Committed:
    """The coordinator's commit landed: what every rank's ``CommitInfo`` reports."""

    seq: int
    num_files: int
    total_bytes: int
    bytes_uploaded: int
    bytes_reused: int
    #: The committed manifest's bytes, exactly those LATEST records (checked: its SHA-256
    #: and size), for the node leaders' local copies: no leader reads it back from the
    #: store. None if the check failed (a leader then keeps no manifest).
    manifest: bytes | None = None


@dataclasses.dataclass(frozen=True)
class Uploaded:
    """What a rank sends the coordinator after its upload: its files' entries, the
    committed checkpoints whose chunks they name (the commit requires them retained), and
    the bytes it put and named where they lay (chunks other ranks put count in neither).
    ``bytes_uploaded`` counts every try of the save (a retry after reused chunks were
    refused puts again what the refused try had put); ``bytes_reused``, this try's."""

    entries: tuple[FileEntry, ...]
    sources: frozenset[str]
    bytes_uploaded: int = 0
    bytes_reused: int = 0


# ------------------------------------------------------------------------------ the save


def save(
    comm: Comm,
    attempts: AttemptWriter,
    rank_chunks: RankChunks,
    handle: SaveHandle,
    files: Sequence[tuple[str, Path]],
    local_exc: BaseException | None,
    progress: ProgressCallback | None,
    *,
    replicas: _replicas.Replicas = _REPLICAS_NONE,
    dedup: bool = True,
    send_manifest: bool = True,
) -> tuple[CommitInfo, bytes | None]:
    """This rank's part of the save of ``handle``: its ``files`` (paths in the
    checkpoint), or ``local_exc`` if it failed to stage them (it still takes part, so that
    every rank fails at once). ``rank_chunks``: this rank's chunk index; ``replicas``: the
    groups of ranks that must save the same files (checked before the commit); ``dedup``:
    one upload per chunk several ranks hold; ``send_manifest`` (the same on every rank):
    the node leaders keep local copies, so the outcome carries the manifest. Returns every
    rank's ``CommitInfo`` and the committed manifest's bytes (``Committed.manifest``, None
    without ``send_manifest``). Raises on every rank alike:
    RankFailedError, ConfigurationError, ReplicaDivergedError, the coordinator's error
    (FencedError, ReusedChunkMissingError and ChunkSourceDroppedError on the retry,
    StoreError...), CollectiveError."""
    step = handle.step
    again: Reupload | None = None
    names: frozenset[str] = frozenset()
    if dedup and comm.world > 1 and attempts.chunking != "off" and local_exc is None:
        try:
            names = _chunks.chunk_names(attempts.engine, files, attempts.chunking)
        except Exception as exc:
            local_exc = exc  # reported in the plan: every rank fails at once
    sent_before = 0  # what this rank put in a try whose commit was refused
    for retry in (False, True):
        plan = RankPlan(
            step,
            tuple(p for p, _ in files),
            None if local_exc is None else RankError.of(local_exc, comm.rank),
            names,
            rank_chunks.reusable(names, again),
        )
        decision, begun = _begin(comm, attempts, plan, local_exc, step)
        uploaded = _upload(comm, attempts, rank_chunks, decision, again, files, progress, step)
        uploaded = dataclasses.replace(
            uploaded, bytes_uploaded=uploaded.bytes_uploaded + sent_before
        )
        outcome = _commit(
            comm,
            attempts,
            begun,
            uploaded,
            handle,
            step,
            replicas,
            may_retry=not retry,
            send_manifest=send_manifest,
        )
        if isinstance(outcome, Reupload):
            if comm.is_coordinator:
                log.error("step %d: %s; every rank uploads them again", step, outcome.reason)
            again, sent_before = outcome, uploaded.bytes_uploaded
            continue
        rank_chunks.committed(decision.commit_id, uploaded.entries)
        return _info(comm, handle, decision, outcome), outcome.manifest
    raise AssertionError("unreachable")  # pragma: no cover


def _begin(
    comm: Comm,
    attempts: AttemptWriter,
    plan: RankPlan,
    local_exc: BaseException | None,
    step: int,
) -> tuple[Opened, BegunAttempt | None]:
    """Round 1: every rank sends its plan; the coordinator opens the attempt. Returns the
    decision and (on the coordinator) the attempt. Raises as ``save``."""
    what = f"starting the save of step {step}"
    plans = comm.gather(plan, what)
    decision: Decision | None = None
    begun: BegunAttempt | None = None
    begin_exc: BaseException | None = None
    if comm.is_coordinator:
        assert plans is not None
        decision, begun, begin_exc = _open(attempts, plans, step)
    decision = comm.broadcast(decision, what)
    if not isinstance(decision, Opened):
        raise _refusal(decision, step, local_exc, begin_exc)
    return decision, begun


def _info(comm: Comm, handle: SaveHandle, decision: Opened, committed: Committed) -> CommitInfo:
    """Every rank's ``CommitInfo`` of the committed save."""
    info = CommitInfo(
        step=handle.step,
        commit_id=decision.commit_id,
        ckpt=decision.prefix,
        epoch=decision.epoch,
        seq=committed.seq,
        num_files=committed.num_files,
        total_bytes=committed.total_bytes,
        bytes_uploaded=committed.bytes_uploaded,
        bytes_reused=committed.bytes_reused,
        blocking_seconds=handle.blocking_seconds,
        commit_seconds=time.perf_counter() - handle.handed_over_at,
        metadata=handle.metadata,
        metrics=handle.metrics,
    )
    if comm.is_coordinator:
        log.info(
            "committed step %d from %d ranks (%d files, %d bytes) in %.2fs",
            info.step,
            comm.world,
            info.num_files,
            info.total_bytes,
            info.commit_seconds,
        )
    return info


def _open(
    attempts: AttemptWriter, plans: Sequence[RankPlan], step: int
) -> tuple[Decision, BegunAttempt | None, BaseException | None]:
    """Coordinator: check every rank's plan, claim if needed, open the attempt. Returns
    the decision, the attempt, and the coordinator's own exception if opening failed."""
    failed = tuple(p.error for p in plans if p.error is not None)
    if failed:
        return RanksFailed(failed), None, None
    if len({p.step for p in plans}) > 1:
        by_rank = ", ".join(f"rank {r}: {p.step}" for r, p in enumerate(plans))
        return (
            Misconfigured(
                f"ranks are saving different steps ({by_rank})",
                "Call save() on every rank for the same steps, in the same order",
            ),
            None,
            None,
        )
    clash = find_collision([p.paths for p in plans])
    if clash is not None:
        return (
            Misconfigured(
                f"the ranks' files collide: {clash}; nothing was uploaded",
                "Give every rank distinct file names, or use per_rank_dirs=True",
            ),
            None,
            None,
        )
    try:
        begun = attempts.begin(step)
    except Exception as exc:
        return CoordinatorFailed(RankError.of(exc, 0)), None, exc  # the coordinator is rank 0
    latest = attempts.committer.latest  # claimed or last written by begin's commit lock
    base = None if latest is None else latest.current
    chosen = _chunks.owners(
        [p.chunks for p in plans],
        [p.reusable for p in plans],
        None if base is None else base.commit_id,
    )
    return Opened(begun.prefix, begun.epoch, begun.commit_id, base, chosen), begun, None


def _refusal(
    decision: Decision | None,
    step: int,
    local_exc: BaseException | None,
    begin_exc: BaseException | None,
) -> BaseException:
    """The error every rank raises when the coordinator did not open the attempt (the
    coordinator raises its own exception rather than a copy)."""
    if isinstance(decision, RanksFailed):
        return decision.error(step, local_exc)
    if isinstance(decision, Misconfigured):
        return ConfigurationError(decision.message, hint=decision.hint)
    if begin_exc is not None:
        return begin_exc
    assert isinstance(decision, CoordinatorFailed)
    return decision.error.rebuild()


def _upload(
    comm: Comm,
    attempts: AttemptWriter,
    rank_chunks: RankChunks,
    decision: Opened,
    again: Reupload | None,
    files: Sequence[tuple[str, Path]],
    progress: ProgressCallback | None,
    step: int,
) -> Uploaded:
    """Every rank uploads its files into the attempt ``decision`` opened: as chunks,
    naming those of ``decision.base`` (less what ``again`` refused), or whole with
    chunking off. One rank's failure cancels the others' uploads. Raises RankFailedError
    on every rank if any failed."""
    cancel = threading.Event()

    def report(n: int) -> None:
        if progress is not None:
            progress(n)
        if cancel.is_set():
            raise Cancelled("another rank failed")

    def upload() -> Uploaded:
        # Inside the phase: a rank that cannot read its index fails the save on every rank.
        if attempts.chunking == "off":
            whole = tuple(attempts.upload_files(decision.prefix, files, report))
            return Uploaded(whole, frozenset(), sum(e.size for e in whole))
        index = rank_chunks.index(decision.base, again)
        elsewhere, owed = _chunks.split_owned(decision.owners, comm.rank)
        entries, stats = attempts.upload_chunks(
            decision.prefix, files, index, report, elsewhere=elsewhere, owed=owed
        )
        return Uploaded(
            tuple(entries), _reuse_sources(stats), stats.bytes_uploaded, stats.bytes_reused
        )

    phase = comm.run_phase(upload, f"uploading step {step}", cancel)
    if phase.failures:
        real = {r: f for r, f in phase.failures.items() if f.cls != Cancelled.__name__}
        shown = real or phase.failures
        raise RankFailedError(
            f"the checkpoint of step {step} was not committed: "
            + "; ".join(f.summary for f in shown.values()),
            failures={r: f.described for r, f in shown.items()},
        ) from phase.own
    assert phase.result is not None
    return phase.result


def _reuse_sources(stats: chunks.UploadStats) -> frozenset[str]:
    """The committed checkpoints whose chunks a rank's upload named: the coordinator's
    commit requires every one of them still retained (``UploadStats.requires``)."""
    return frozenset(stats.sources)


def _commit(
    comm: Comm,
    attempts: AttemptWriter,
    begun: BegunAttempt | None,
    uploaded: Uploaded,
    handle: SaveHandle,
    step: int,
    replicas: _replicas.Replicas,
    *,
    may_retry: bool,
    send_manifest: bool = True,
) -> Committed | Reupload:
    """Every rank reports its upload; the coordinator checks that ``replicas`` agree
    (``_replicas.check_agreement``) and commits the manifest of all of them (``finish``:
    every named chunk listed, reused ones' sources retained). Returns
    ``Reupload`` on every rank if ``may_retry`` and reused chunks were refused. Raises on
    every rank: the coordinator's error, or CollectiveError (``outcome_unknown`` on the
    others if the coordinator went silent while committing)."""
    what = f"committing step {step}"
    reports = comm.gather(uploaded, what)
    outcome: Committed | Reupload | RankError | None = None
    commit_exc: BaseException | None = None
    if comm.is_coordinator:
        assert begun is not None and reports is not None
        try:
            _replicas.check_agreement(replicas, [r.entries for r in reports], step)
            outcome = _finish(attempts, begun, reports, handle, comm.world, send_manifest)
        except ReusedChunkMissingError as exc:
            commit_exc, outcome = exc, Reupload(exc.message, exc.missing)
        except ChunkSourceDroppedError as exc:
            commit_exc, outcome = exc, Reupload(exc.message, None)
        except Exception as exc:
            commit_exc, outcome = exc, RankError.of(exc, comm.rank)
        if isinstance(outcome, Reupload) and not may_retry:
            assert commit_exc is not None
            outcome = RankError.of(commit_exc, comm.rank)  # refused again: fail clearly
    try:
        outcome = comm.broadcast(outcome, what)
    except CollectiveError as exc:
        if comm.is_coordinator:
            raise
        raise CollectiveError(
            f"{exc.message}. The coordinator went silent while committing step {step}: "
            "the checkpoint may or may not be committed",
            outcome_unknown=True,
            hint="Run `cloudckpt ls URL` to see; restart the job and resume",
        ) from exc
    if isinstance(outcome, RankError):
        if commit_exc is not None:
            raise commit_exc
        raise outcome.rebuild()
    assert outcome is not None
    return outcome


def _finish(
    attempts: AttemptWriter,
    begun: BegunAttempt,
    reports: Sequence[Uploaded],
    handle: SaveHandle,
    world: int,
    send_manifest: bool = True,
) -> Committed:
    """Coordinator: the single-host commit of every rank's entries, requiring every
    rank's chunk sources retained; the outcome carries the manifest if ``send_manifest``.
    Raises as ``AttemptWriter.finish``."""
    every = [e for report in reports for e in report.entries]
    sources = set().union(*(report.sources for report in reports))
    metadata = {**handle.metadata, WORLD_SIZE_KEY: world}
    latest, manifest = attempts.finish(
        begun,
        every,
        metadata,
        requires=chunks.UploadStats(sources=sources).requires,
        metrics=handle.metrics,
    )
    return Committed(
        latest.seq,
        len(manifest.files),
        manifest.total_bytes,
        sum(r.bytes_uploaded for r in reports),
        sum(r.bytes_reused for r in reports),
        committed_body(manifest, latest.current) if send_manifest else None,
    )


def committed_body(manifest: Manifest, record: CheckpointRecord | None) -> bytes | None:
    """The bytes of ``manifest`` if they are exactly what ``record`` (the committed
    checkpoint) names, else None. ``to_bytes`` is the canonical form ``finish`` wrote,
    but only the digest LATEST records decides what a kept manifest may be."""
    body = manifest.to_bytes()
    if record is None or len(body) != record.manifest_size:
        return None
    return body if hashlib.sha256(body).hexdigest() == record.manifest_sha256 else None


def find_collision(paths_by_rank: Sequence[Sequence[str]]) -> str | None:
    """A clear message if two ranks write the same path, or one a file where another's
    path needs a directory; None if the ranks' files can share one checkpoint."""
    owner: dict[str, int] = {}
    for r, paths in enumerate(paths_by_rank):
        for p in paths:
            if p in owner and owner[p] != r:
                return f"ranks {owner[p]} and {r} both write {p!r}"
            owner[p] = r
    for p, r in owner.items():
        parts = p.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in owner:
                return (
                    f"rank {owner[parent]} writes the file {parent!r}, but rank {r} writes "
                    f"{p!r} inside a directory of that name"
                )
    return None
