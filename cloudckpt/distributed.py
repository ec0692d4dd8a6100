"""Multi-rank checkpoints on ``torch.distributed``: every rank uploads, one commit.

::

    import torch.distributed as dist
    from cloudckpt.distributed import DistributedCheckpointManager

    dist.init_process_group("nccl")          # or "gloo"; torchrun sets the environment
    mgr = DistributedCheckpointManager("s3://bucket/runs/exp1", staging_dir="/nvme/ckpt")
    restored = mgr.resume(into="/nvme/restore")           # every rank; None for a new run
    if restored is not None:
        shard = torch.load(restored.rank_path / "shard.pt")
    ...
    with mgr.save(step) as d:                             # every rank, same steps, same order
        torch.save(my_shard, d / "shard.pt")              # stored as rank-<rank>/shard.pt
    ...
    mgr.close()                                           # every rank

How a save runs (DESIGN §5.3). Each rank stages its files locally and returns to training;
its background thread then takes part in a fixed sequence of collectives on a **dedicated
gloo group** that the manager creates at construction, so they never interleave with the
training loop's own collectives (NCCL or gloo), and never with another manager's:

1. every rank fsyncs its staged files and sends the coordinator (rank 0 of the group) its
   step and file paths; the coordinator checks that every rank saves the same step, that no
   two ranks write the same path (nor a file where another writes a directory), claims the
   run if it has not yet (fencing zombies), picks the attempt prefix and writes
   ``ATTEMPT.json``; it broadcasts the prefix (or the error, which every rank raises);
2. every rank uploads its own files into that one prefix, in parallel with the others,
   while the ranks exchange a small heartbeat every second: a rank that fails stops the
   others' uploads early and every rank learns who failed and why;
3. every rank sends the coordinator its files' (path, size, digest); only when every rank
   succeeded does the coordinator write the manifest and commit it with the fenced
   compare-and-swap of LATEST; it broadcasts the outcome, so every rank's handle returns
   the same ``CommitInfo`` or raises the same error.

A rank that fails before the commit means no commit: every rank's handle raises
``RankFailedError`` naming the failed ranks. A rank that dies or hangs cannot make the others
wait forever: every collective of the group gives up after ``timeout`` seconds (gloo notices a
dead peer's closed connection at once; ``timeout`` covers a hung process or a lost node), and
the surviving ranks raise ``CollectiveError``. After that the group is unusable and the
manager refuses further saves: restart the job (its last committed checkpoint is intact).

Restores (``resume()`` and ``restore()``, collective): rank 0 claims (``resume`` only) and
picks the checkpoint; one rank per node (the lowest rank among those sharing a host and
boot, or the same ``node_id``) downloads what the node's ranks need, once, verified, into
the node-local ``into`` directory; the other ranks of the node wait and then read from it.
With per-rank directories and the same world size, a node fetches only its ranks'
``rank-<r>/`` directories plus the shared files; otherwise (different world size, or user
paths) every node fetches everything, unless ``select`` says otherwise.

Rules: construct, save, resume, restore and close the manager on every rank of the group, in
the same order (saves are sequential, so the collectives line up). ``backpressure`` must be
``"block"``: dropping a save on one rank but not another would misalign them. Staged saves
of a crashed job are abandoned, not recovered (each rank would have to agree on them).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import datetime as dt
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cloudckpt import chunks, errors, protocol
from cloudckpt.attempts import BegunAttempt, CommitInfo
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    ConfigurationError,
    CorruptionError,
    UnsafePathError,
)
from cloudckpt.gc import collect_garbage
from cloudckpt.manager import CheckpointManager, SaveHandle, _Job
from cloudckpt.protocol import CheckpointRecord, FileEntry, Latest, Manifest
from cloudckpt.restore import (
    RestoreResult,
    SkippedCheckpoint,
    _place,
    candidates,
    check_objects,
    check_space,
    dropped_reason,
    fetch_manifest,
    load_latest_for_reading,
    nothing_restored,
    out_of_space,
    reread_if_dropped,
)
from cloudckpt.restore import _prepare_destination as check_destination
from cloudckpt.staging import COMMITTED, DURABLE, STAGED
from cloudckpt.stores import Store

__all__ = [
    "WORLD_SIZE_KEY",
    "CollectiveError",
    "DistributedCheckpointManager",
    "DistributedRestoreResult",
    "RankFailedError",
    "rank_dir",
]

log = logging.getLogger("cloudckpt.distributed")

#: Recorded in every multi-rank commit's metadata: the world size that saved it.
WORLD_SIZE_KEY = "cloudckpt.world_size"
DEFAULT_TIMEOUT = 600.0
_HEARTBEAT = 1.0  # seconds between heartbeats while some rank is still working
_BUSY, _OK, _DAMAGED, _FAILED = 1, 2, 3, 4
_RANK_DIR = re.compile(r"^rank-(\d{5,})/")


def rank_dir(rank: int) -> str:
    """The directory a rank's files live under in a checkpoint saved with per-rank
    directories: ``rank-00003`` for rank 3."""
    return f"rank-{rank:05d}"


# ------------------------------------------------------------------------------ errors


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


def _error_info(exc: BaseException, rank: int) -> dict[str, Any]:
    """What travels to the other ranks about ``exc``."""
    if isinstance(exc, CloudCkptError):
        message, hint = exc.message, exc.hint
    else:
        message, hint = f"{exc}" or type(exc).__name__, None
    return {"rank": rank, "cls": type(exc).__name__, "message": message, "hint": hint}


def _summary(info: Mapping[str, Any]) -> str:
    return f"rank {info['rank']}: {info['cls']}: {info['message']}"


def _rebuild(info: Mapping[str, Any]) -> CloudCkptError:
    """The same cloudckpt error on every rank (a generic one for foreign exceptions)."""
    cls = getattr(errors, str(info["cls"]), None)
    if isinstance(cls, type) and issubclass(cls, CloudCkptError):
        return cls(info["message"], hint=info["hint"])
    return CloudCkptError(f"{info['cls']}: {info['message']}", hint=info["hint"])


class _Cancelled(Exception):
    """Raised from the progress hook to stop an upload another rank's failure made moot."""


# ------------------------------------------------------------------------------ results


@dataclasses.dataclass(frozen=True)
class DistributedRestoreResult(RestoreResult):
    """A ``RestoreResult`` for one rank of a multi-rank restore.

    ``path``: the node-local directory holding what this node downloaded (the checkpoint's
    layout: ``rank-<r>/...`` and any shared files). ``rank_path``: this rank's own
    directory, ``path/rank-<rank>``. ``saved_world_size``: the world size that saved the
    checkpoint (None if it was not saved by a ``DistributedCheckpointManager``); when it
    differs from the current one, every node holds every file and reshards as it likes.
    """

    rank_path: Path | None = None
    saved_world_size: int | None = None


# ------------------------------------------------------------------------------ collectives


class _Comm:
    """The manager's collectives: object gather/broadcast/all-gather and a heartbeat, on its
    own gloo group (or trivially, in a single process). Every failure or timeout becomes
    ``CollectiveError``."""

    def __init__(self, dist: Any, group: Any, rank: int, world: int, timeout: float) -> None:
        self.dist, self.group, self.rank, self.world, self.timeout = (
            dist,
            group,
            rank,
            world,
            timeout,
        )

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            return fn()
        except Exception as exc:
            detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            raise CollectiveError(
                f"rank {self.rank} lost contact with the other ranks while {what} "
                f"(after {time.monotonic() - started:.1f}s; timeout={self.timeout:g}s): a rank "
                f"died, hung or became unreachable ({type(exc).__name__}: {detail})"
            ) from exc

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        """``obj`` of every rank, on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        self._call(
            what,
            lambda: self.dist.gather_object(obj, out, group=self.group, group_dst=0),
        )
        return out

    def broadcast(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj``, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        self._call(
            what,
            lambda: self.dist.broadcast_object_list(box, group=self.group, group_src=0),
        )
        return box[0]

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self._call(what, lambda: self.dist.all_gather_object(out, obj, group=self.group))
        return out

    def heartbeat(self, code: int, what: str) -> list[int]:
        """Every rank's status code (one small all-reduce)."""
        if self.world == 1:
            return [code]
        import torch

        t = torch.zeros(self.world, dtype=torch.int64)
        t[self.rank] = code
        self._call(what, lambda: self.dist.all_reduce(t, group=self.group))
        return [int(c) for c in t.tolist()]


def _node_key() -> str:
    """Ranks with the same key share a host (and so its local disks)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _torch_dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError(
            "cloudckpt.distributed needs torch: install the torch build you need first"
        ) from exc
    return dist


def _find_collision(paths_by_rank: Sequence[Sequence[str]]) -> str | None:
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


# ------------------------------------------------------------------------------ manager


class DistributedCheckpointManager(CheckpointManager):
    """A ``CheckpointManager`` for every rank of a ``torch.distributed`` job: all ranks
    upload into one attempt, the coordinator (rank 0) alone claims and commits.

    Args:
        url, **kwargs: as ``CheckpointManager`` (``backpressure`` must stay ``"block"``).
        process_group: the ranks that checkpoint together (default: the whole world). The
            manager builds its own gloo group over the same ranks; it never uses this one.
            Without an initialized process group the manager runs as a single rank.
        timeout: seconds any rank waits for the others at one collective (default 600).
            It bounds how long survivors wait for a dead or hung rank, so it must exceed
            the longest gap between ranks handing over the same save (how long the slowest
            rank stays inside ``save()``'s block after the fastest left it). Long uploads
            and downloads are not bounded by it: ranks exchange heartbeats meanwhile.
        per_rank_dirs: store rank ``r``'s files under ``rank-<r>/`` (default). With False,
            ranks write the checkpoint's paths directly (e.g. rank 0 ``config.json``, rank
            ``r`` ``model-0000r.safetensors``); two ranks writing one path is refused
            before anything is uploaded.
        node_id: ranks with equal ``node_id`` share one restore directory (default: the
            host name and boot id, so ranks on one machine share it).
        staging_dir: a local directory; each rank stages under ``<staging_dir>/rank-<r>``.

    Raises:
        ConfigurationError: bad arguments, or ranks that disagree about the URL or layout.
        CollectiveError: a rank did not join the construction in time.
    """

    def __init__(
        self,
        url: str | Store,
        *,
        process_group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        per_rank_dirs: bool = True,
        node_id: str | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("backpressure", "block") != "block":
            raise ConfigurationError(
                "a DistributedCheckpointManager needs backpressure='block'",
                hint="Dropping a save on one rank but not on another would misalign the "
                "ranks' saves",
            )
        if not timeout or timeout <= 0:
            raise ConfigurationError("timeout must be a positive number of seconds")
        dist = _torch_dist()
        self.timeout = float(timeout)
        self.per_rank_dirs = bool(per_rank_dirs)
        group = None
        if dist.is_available() and dist.is_initialized():
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            global_rank = dist.get_rank()
            if global_rank not in ranks:
                raise ConfigurationError("this process is not a member of process_group")
            rank, world = ranks.index(global_rank), len(ranks)
            if world > 1:
                # Collective over the default group (or the members alone): first, before
                # anything local can fail and leave the other ranks waiting.
                group = dist.new_group(
                    ranks=ranks,
                    backend="gloo",
                    timeout=dt.timedelta(seconds=self.timeout),
                    use_local_synchronization=process_group is not None,
                )
        else:
            if process_group is not None:
                raise ConfigurationError(
                    "process_group given but torch.distributed is not initialized"
                )
            global_rank, rank, world = 0, 0, 1
        self.rank, self.world_size, self.global_rank = rank, world, global_rank
        self.is_coordinator = rank == 0
        self.process_group = group
        self._comm = _Comm(dist, group, rank, world, self.timeout)
        self._broken: CollectiveError | None = None
        self._begin_exc: BaseException | None = None
        self._gc_thread: threading.Thread | None = None
        self._abandoned: dict[SaveHandle, BaseException] = {}
        self._helper = cf.ThreadPoolExecutor(1, thread_name_prefix="cloudckpt-rank-work")
        if staging_dir is not None:
            staging_dir = Path(staging_dir).expanduser() / rank_dir(global_rank)
        failure: BaseException | None = None
        try:
            super().__init__(url, staging_dir=staging_dir, **kwargs)
        except Exception as exc:
            failure = exc
        me = {
            "error": None if failure is None else _error_info(failure, rank),
            "node": node_id if node_id is not None else _node_key(),
            "url": None if failure is not None else self.url,
            "per_rank_dirs": self.per_rank_dirs,
        }
        try:
            everyone = self._comm.all_gather(me, "starting the manager")
        except CollectiveError:
            self._abort_init(failure)
            raise
        problems = [e["error"] for e in everyone if e["error"] is not None]
        message = None
        if problems:
            message = "could not start on every rank: " + "; ".join(map(_summary, problems))
        elif len({e["url"] for e in everyone}) > 1:
            message = "ranks were given different URLs: " + ", ".join(
                sorted({e["url"] for e in everyone})
            )
        elif len({e["per_rank_dirs"] for e in everyone}) > 1:
            message = "ranks disagree about per_rank_dirs"
        if message is not None:
            self._abort_init(failure)
            if failure is not None:
                raise failure
            raise ConfigurationError(message)
        nodes: dict[str, list[int]] = {}
        for r, e in enumerate(everyone):
            nodes.setdefault(e["node"], []).append(r)
        self._nodes = [tuple(ranks) for ranks in nodes.values()]
        self.local_ranks: tuple[int, ...] = tuple(nodes[me["node"]])
        self.node_leader = self.local_ranks[0]
        self.is_node_leader = self.node_leader == rank
        self.num_nodes = len(nodes)
        if not self.is_coordinator:
            self._auto_gc = False  # one GC per job is plenty
        for attempt in self._leftovers:  # no recovery across ranks: see the module doc
            log.info("abandoning step %d left in staging (%s)", attempt.step, attempt.state)
            attempt.remove()
        self._leftovers = []
        shutil.rmtree(self.staging.root / "dcp", ignore_errors=True)  # a crashed DCP writer's

    def _raise_earlier_failure(self) -> None:
        """Not here: a save that failed is done on each rank at a slightly different
        moment, so the next ``save()`` would raise on some ranks and enter the collectives
        on others, which would then time out. ``wait()`` and ``close()`` (every rank waits
        for the same saves) and each handle report it."""

    def _check_not_fenced(self) -> None:
        """Not here: a fenced coordinator refusing to enter a save would leave the other
        ranks waiting in its collectives. The coordinator's ``attempts.begin()`` raises
        the ``FencedError`` inside the save, and every rank raises it."""

    def _abort_init(self, failure: BaseException | None) -> None:
        self._helper.shutdown(wait=False)
        if failure is None:
            self._shutdown()

    # ---------------------------------------------------------------- public API

    def save(self, step: int, metadata: Mapping[str, Any] | None = None) -> SaveHandle:
        """Start this rank's part of a save (every rank calls it, for the same steps in the
        same order). Files written into the yielded directory are stored under
        ``rank-<rank>/`` (or as written, with ``per_rank_dirs=False``). The coordinator's
        ``metadata`` is recorded. ``handle.result()`` returns the same ``CommitInfo`` on
        every rank, or raises the same error (``RankFailedError``, ``FencedError``,
        ``CollectiveError``...). Unlike ``CheckpointManager.save()``, it does not raise an
        earlier save's failure (see ``_raise_earlier_failure``): ``wait()`` and ``close()``
        do, on every rank.
        """
        if self._broken is not None:
            raise self._broken
        return super().save(step, metadata)

    def resume(
        self,
        into: str | os.PathLike[str],
        *,
        step: int | None = None,
        overwrite: bool = False,
        select: Callable[[str, int], bool] | None = None,
    ) -> DistributedRestoreResult | None:
        """Every rank: rank 0 claims the run (fencing older writers) and picks the newest
        committed checkpoint (or ``step``); each node downloads what its ranks need into
        ``into`` (node-local; the same path on every rank of a node). Returns the same
        checkpoint on every rank, or None for a new, empty run.

        ``select(path, rank)``: whether ``rank`` needs the checkpoint file ``path`` (a pure
        function; evaluated by each node's downloading rank for every rank of the node).

        Raises: as ``CheckpointManager.resume`` (on every rank), ``CollectiveError``.
        """
        return self._restore_collectively(into, step, overwrite, select, claim=True)

    def restore(
        self,
        into: str | os.PathLike[str],
        *,
        step: int | None = None,
        overwrite: bool = False,
        select: Callable[[str, int], bool] | None = None,
    ) -> DistributedRestoreResult:
        """As ``resume()`` without claiming the run (read-only).

        Raises: CheckpointNotFoundError, CorruptionError, DestinationNotEmptyError,
        StagingError, StoreError (on every rank), CollectiveError.
        """
        result = self._restore_collectively(into, step, overwrite, select, claim=False)
        assert result is not None
        return result

    # ---------------------------------------------------------------- internals: helpers

    def _shutdown(self) -> None:
        try:
            if self._gc_thread is not None:
                self._gc_thread.join()
            super()._shutdown()
        finally:
            self._helper.shutdown(wait=True)

    def gc_if_due(self) -> None:
        """Auto-GC on its own thread: run on the worker, a long collection would hold the
        coordinator back from the next save's collectives while the others time out."""
        if not self._auto_gc or time.monotonic() - self._last_gc < self._gc_interval:
            return
        if self._gc_thread is not None and self._gc_thread.is_alive():
            return
        self._last_gc = time.monotonic()

        def collect() -> None:
            try:
                collect_garbage(self.store)
            except CloudCkptError as exc:
                log.warning("background garbage collection failed: %s", exc)

        self._gc_thread = threading.Thread(target=collect, name="cloudckpt-gc", daemon=True)
        self._gc_thread.start()

    def _check_usable(self) -> None:
        self.check_open()
        if self._broken is not None:
            raise self._broken

    def _collective(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (which issues collectives); a collective failure breaks the manager."""
        try:
            return fn()
        except CollectiveError as exc:
            self._broken = exc
            raise

    def _decide(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on the coordinator and hand its result to every rank; if it raises,
        every rank raises the same cloudckpt error (the coordinator its own exception)."""
        local_exc: BaseException | None = None
        answer: Any = None
        if self.is_coordinator:
            try:
                answer = {"ok": fn()}
            except Exception as exc:
                local_exc = exc
                answer = {"error": _error_info(exc, self.rank)}
        answer = self._comm.broadcast(answer, what)
        if "error" in answer:
            if local_exc is not None:
                raise local_exc
            raise _rebuild(answer["error"])
        return answer["ok"]

    def _run_phase(
        self,
        work: Callable[[], Any] | None,
        what: str,
        cancel: threading.Event | None = None,
    ) -> tuple[Any, dict[int, dict[str, Any]], BaseException | None]:
        """Run ``work`` here (None: nothing) in a helper thread while exchanging heartbeats
        with every rank until no rank is busy. Returns (this rank's result, the failures of
        every rank by rank, this rank's own exception). ``cancel`` is set once any rank
        has failed, to cut short work the failure made pointless."""
        fut = self._helper.submit(work) if work is not None else None
        code = _OK
        try:
            while True:
                if fut is not None and not fut.done():
                    cf.wait([fut], timeout=_HEARTBEAT)
                if fut is None:
                    code = _OK
                elif not fut.done():  # one look: the work may finish meanwhile
                    code = _BUSY
                elif fut.exception() is None:
                    code = _OK
                elif isinstance(fut.exception(), CorruptionError | UnsafePathError):
                    code = _DAMAGED
                else:
                    code = _FAILED
                codes = self._comm.heartbeat(code, what)
                if _BUSY not in codes:
                    break
                if cancel is not None and (_FAILED in codes or _DAMAGED in codes):
                    cancel.set()
        except CollectiveError:
            if cancel is not None:
                cancel.set()
            raise
        own = None if fut is None or code == _OK else fut.exception()
        failures: dict[int, dict[str, Any]] = {}
        if any(c != _OK for c in codes):
            mine = None if own is None else {**_error_info(own, self.rank), "code": code}
            gathered = self._comm.all_gather(mine, f"{what} (reporting failures)")
            failures = {r: g for r, g in enumerate(gathered) if g is not None}
        result = fut.result() if fut is not None and own is None else None
        return result, failures, own

    def _hand_over(self, handle: SaveHandle) -> None:
        try:
            handle._attempt.set_state(STAGED, sync=False)
        except Exception as exc:  # still take part in the save, reporting the failure
            self._abandoned[handle] = exc
        self._enqueue(handle)

    def _abandon(self, handle: SaveHandle, exc: BaseException) -> None:
        """The block raised on this rank. The other ranks are saving the same step: take
        part in its collectives anyway, reporting the failure, so that every rank fails
        the save at once instead of waiting for this one until the timeout."""
        if handle._attempt is None:
            super()._abandon(handle, exc)
            return
        handle._reported = not handle._background  # ``exc`` reaches the block's caller
        self._abandoned[handle] = CloudCkptError(
            f"its save() block raised {type(exc).__name__}: {exc}"
        )
        self._enqueue(handle)

    def _stored_path(self, rel: str) -> str:
        return f"{rank_dir(self.rank)}/{rel}" if self.per_rank_dirs else rel

    # ---------------------------------------------------------------- internals: save

    def _save(self, job: _Job) -> CommitInfo:
        """This rank's part of one save (worker thread); see the module docstring."""
        attempt = job.attempt
        try:
            if self._broken is not None:
                self._abandoned.pop(job.handle, None)
                raise self._broken
            info = self._collective(lambda: self._save_collectively(job))
        except Exception:
            self._fail(attempt)
            raise
        attempt.set_state(COMMITTED)
        attempt.remove()
        return info

    def _save_collectively(self, job: _Job) -> CommitInfo:
        attempt, handle, step = job.attempt, job.handle, job.handle.step
        files: list[tuple[str, Path]] = []
        local_exc: BaseException | None = self._abandoned.pop(handle, None)
        try:
            if local_exc is not None:
                raise local_exc
            attempt.fsync_files()
            attempt.set_state(DURABLE)
            files = [(self._stored_path(rel), path) for rel, path in attempt.list_files()]
        except Exception as exc:
            local_exc = exc
        plan = {
            "step": step,
            "paths": [p for p, _ in files],
            "error": None if local_exc is None else _error_info(local_exc, self.rank),
        }
        plans = self._comm.gather(plan, f"starting the save of step {step}")
        decision = None
        begun: BegunAttempt | None = None
        if self.is_coordinator:
            decision, begun = self._coordinate_begin(plans, step)
        decision = self._comm.broadcast(decision, f"starting the save of step {step}")
        if "error" in decision:
            raise self._save_error(decision, step, local_exc)
        prefix = decision["prefix"]

        cancel = threading.Event()

        def upload() -> list[FileEntry]:
            def progress(n: int) -> None:
                if self.progress is not None:
                    self.progress(n)
                if cancel.is_set():
                    raise _Cancelled("another rank failed")

            return self.attempts.upload_files(prefix, files, progress)

        entries, failures, own = self._run_phase(upload, f"uploading step {step}", cancel)
        if failures:
            real = {r: f for r, f in failures.items() if f["cls"] != _Cancelled.__name__}
            raise RankFailedError(
                f"the checkpoint of step {step} was not committed: "
                + "; ".join(_summary(f) for f in (real or failures).values()),
                failures={r: f"{f['cls']}: {f['message']}" for r, f in (real or failures).items()},
            ) from own

        reports = self._comm.gather(
            [(e.path, e.size, e.digest) for e in entries], f"committing step {step}"
        )
        outcome = None
        commit_exc: BaseException | None = None
        if self.is_coordinator:
            assert begun is not None and reports is not None
            try:
                all_entries = [FileEntry(*e) for report in reports for e in report]
                metadata = {**handle.metadata, WORLD_SIZE_KEY: self.world_size}
                latest, manifest = self.attempts.finish(begun, all_entries, metadata)
                outcome = {
                    "seq": latest.seq,
                    "num_files": len(manifest.files),
                    "total_bytes": manifest.total_bytes,
                }
            except Exception as exc:
                commit_exc = exc
                outcome = {"error": _error_info(exc, self.rank)}
        try:
            outcome = self._comm.broadcast(outcome, f"committing step {step}")
        except CollectiveError as exc:
            if self.is_coordinator:
                raise
            raise CollectiveError(
                f"{exc.message}. The coordinator went silent while committing step {step}: "
                "the checkpoint may or may not be committed",
                outcome_unknown=True,
                hint="Run `cloudckpt ls URL` to see; restart the job and resume",
            ) from exc
        if "error" in outcome:
            if commit_exc is not None:
                raise commit_exc
            raise _rebuild(outcome["error"])
        info = CommitInfo(
            step=step,
            commit_id=decision["commit_id"],
            ckpt=prefix,
            epoch=decision["epoch"],
            seq=outcome["seq"],
            num_files=outcome["num_files"],
            total_bytes=outcome["total_bytes"],
            blocking_seconds=handle.blocking_seconds,
            commit_seconds=time.perf_counter() - handle.handed_over_at,
            metadata=handle.metadata,
        )
        if self.is_coordinator:
            log.info(
                "committed step %d from %d ranks (%d files, %d bytes) in %.2fs",
                step,
                self.world_size,
                info.num_files,
                info.total_bytes,
                info.commit_seconds,
            )
        return info

    def _coordinate_begin(
        self, plans: list[dict[str, Any]] | None, step: int
    ) -> tuple[dict[str, Any], BegunAttempt | None]:
        """Coordinator: check every rank's plan, claim if needed, open the attempt."""
        assert plans is not None
        failed = [p["error"] for p in plans if p["error"] is not None]
        if failed:
            return {"error": "ranks", "failures": failed}, None
        steps = sorted({p["step"] for p in plans})
        if len(steps) > 1:
            by_rank = ", ".join(f"rank {r}: {p['step']}" for r, p in enumerate(plans))
            return {
                "error": "config",
                "message": f"ranks are saving different steps ({by_rank})",
                "hint": "Call save() on every rank for the same steps, in the same order",
            }, None
        clash = _find_collision([p["paths"] for p in plans])
        if clash is not None:
            return {
                "error": "config",
                "message": f"the ranks' files collide: {clash}; nothing was uploaded",
                "hint": "Give every rank distinct file names, or use per_rank_dirs=True",
            }, None
        try:
            begun = self.attempts.begin(step)
        except Exception as exc:
            self._begin_exc = exc
            return {"error": "coordinator", "info": _error_info(exc, self.rank)}, None
        return {"prefix": begun.prefix, "epoch": begun.epoch, "commit_id": begun.commit_id}, begun

    def _save_error(
        self, decision: Mapping[str, Any], step: int, local_exc: BaseException | None
    ) -> BaseException:
        kind = decision["error"]
        if kind == "ranks":
            failures = decision["failures"]
            err: BaseException = RankFailedError(
                f"the checkpoint of step {step} was not committed: "
                + "; ".join(map(_summary, failures)),
                failures={f["rank"]: f"{f['cls']}: {f['message']}" for f in failures},
            )
            err.__cause__ = local_exc
            return err
        if kind == "config":
            return ConfigurationError(decision["message"], hint=decision["hint"])
        exc = self._begin_exc
        if exc is not None:
            self._begin_exc = None
            return exc
        return _rebuild(decision["info"])

    # ---------------------------------------------------------------- internals: restore

    def _wait_idle(self) -> None:
        """Let queued saves finish first: they issue collectives on the same group."""
        with self._cv:
            while self._queue or self._inflight is not None:
                self._cv.wait(0.2)

    def _restore_collectively(
        self,
        into: str | os.PathLike[str],
        step: int | None,
        overwrite: bool,
        select: Callable[[str, int], bool] | None,
        *,
        claim: bool,
    ) -> DistributedRestoreResult | None:
        self._check_usable()
        self._wait_idle()
        return self._collective(
            lambda: self._restore_steps(
                Path(into).expanduser().absolute(), step, overwrite, select, claim
            )
        )

    def _restore_steps(
        self,
        into: Path,
        step: int | None,
        overwrite: bool,
        select: Callable[[str, int], bool] | None,
        claim: bool,
    ) -> DistributedRestoreResult | None:
        what = "resuming" if claim else "restoring"
        local_exc: BaseException | None = None
        dest = into  # the real directory the node leader writes (``into`` may be a link)
        if self.is_node_leader:
            try:  # before claiming: a bad argument must not fence the writer
                dest = check_destination(into, overwrite)
            except Exception as exc:
                local_exc = exc
        me = {
            "into": str(into),
            "error": None if local_exc is None else _error_info(local_exc, self.rank),
        }
        infos = self._comm.gather(me, what)

        def choose() -> dict[str, Any] | None:
            assert infos is not None
            failed = [i["error"] for i in infos if i["error"] is not None]
            if failed:
                raise _rebuild(failed[0])
            mine = {r: infos[r]["into"] for r in range(self.world_size)}
            bad = self._inconsistent_into(mine)
            if bad:
                raise ConfigurationError(
                    bad, hint="Pass the same node-local directory on every rank of a node"
                )
            if claim:
                latest: Latest | None = self.attempts.claim()
                from_records = False
                if latest is None or latest.current is None:
                    return None
            else:
                latest, from_records = load_latest_for_reading(self.store)
                if latest is None:
                    if from_records:
                        raise CorruptionError(
                            f"LATEST of {self.url} is unreadable and no commit record verifies"
                        )
                    raise CheckpointNotFoundError(f"{self.url} has no committed checkpoint")
            todo = candidates(latest, step)
            if not todo:
                missing = (
                    "no committed checkpoint"
                    if step is None
                    else f"no retained checkpoint of step {step}"
                )
                raise CheckpointNotFoundError(f"{self.url} has {missing}")
            return {"records": [r.to_dict() for r in todo], "from_records": from_records}

        try:
            chosen = self._decide(choose, what)
        except Exception:
            if local_exc is not None:  # this rank's own error rather than its copy
                raise local_exc from None
            raise
        if chosen is None:
            return None
        todo = [CheckpointRecord.from_dict(r) for r in chosen["records"]]
        from_records = chosen["from_records"]
        skipped: list[SkippedCheckpoint] = []
        tried: set[str] = set()
        rereads = 0
        while todo:
            record = todo.pop(0)
            tried.add(record.commit_id)
            saved_world = record.metadata.get(WORLD_SIZE_KEY)
            saved_world = saved_world if isinstance(saved_world, int) else None
            wants = select or self._default_select(saved_world)
            tmp = dest.with_name(f".{dest.name}.cloudckpt-tmp-{secrets.token_hex(4)}")

            def download(record: CheckpointRecord = record, wants=wants, tmp: Path = tmp) -> None:
                manifest = fetch_manifest(self.store, record)
                check_objects(self.store, record, manifest)
                entries = [
                    e for e in manifest.files if any(wants(e.path, r) for r in self.local_ranks)
                ]
                need = sum(e.size for e in entries)
                check_space(record.step, need, tmp.parent)
                try:
                    tmp.mkdir()
                    chunks.download(
                        self.engine,
                        self.store,
                        record.ckpt + protocol.FILES_DIR,
                        entries,
                        tmp,
                        manifest.chunk_size,
                        self.progress,
                    )
                except OSError as exc:
                    full = out_of_space(exc, record.step, need, tmp.parent)
                    if full is None:
                        raise
                    raise full from exc

            _, failures, own = self._run_phase(
                download if self.is_node_leader else None, f"{what} step {record.step}"
            )
            if failures:
                shutil.rmtree(tmp, ignore_errors=True)
                fatal = [f for f in failures.values() if f["code"] == _FAILED]
                if fatal:
                    if own is not None and own.__class__.__name__ == fatal[0]["cls"]:
                        raise own
                    raise _rebuild(fatal[0])
                reason = "; ".join(_summary(f) for f in failures.values())
                fresh = self._decide(
                    lambda r=record, n=rereads: self._reread_if_dropped(r, step, tried, n),
                    f"{what}: reading LATEST again",
                )
                if fresh is None:
                    log.warning("checkpoint of step %d is unusable: %s", record.step, reason)
                    skipped.append(SkippedCheckpoint(record.step, record.commit_id, reason))
                    continue
                todo = [CheckpointRecord.from_dict(r) for r in fresh["records"]]
                from_records, rereads = fresh["from_records"], rereads + 1
                skipped.append(
                    SkippedCheckpoint(record.step, record.commit_id, dropped_reason(reason), True)
                )
                continue
            _, failures, own = self._run_phase(
                (lambda tmp=tmp: _place(tmp, dest)) if self.is_node_leader else None,
                f"{what}: placing step {record.step}",
            )
            if failures:
                shutil.rmtree(tmp, ignore_errors=True)
                if own is not None:
                    raise own
                raise _rebuild(next(iter(failures.values())))
            if skipped:
                log.warning(
                    "restored step %d after skipping %d checkpoint(s)",
                    record.step,
                    len(skipped),
                )
            return DistributedRestoreResult(
                step=record.step,
                path=into,
                metadata=dict(record.metadata),
                commit_id=record.commit_id,
                ckpt=record.ckpt,
                epoch=record.epoch,
                num_files=record.num_files,
                total_bytes=record.total_bytes,
                skipped=tuple(skipped),
                from_commit_records=from_records,
                rank_path=into / rank_dir(self.rank),
                saved_world_size=saved_world,
            )
        raise nothing_restored(self.url, skipped, step)

    def _reread_if_dropped(
        self, record: CheckpointRecord, step: int | None, tried: set[str], rereads: int
    ) -> dict[str, Any] | None:
        """(Coordinator.) ``reread_if_dropped``, in a form that travels to every rank."""
        fresh = reread_if_dropped(self.store, record, step, tried, rereads)
        if fresh is None:
            return None
        return {"records": [r.to_dict() for r in fresh[0]], "from_records": fresh[1]}

    def _inconsistent_into(self, into_by_rank: Mapping[int, str]) -> str | None:
        """Ranks of one node must name the same directory: its leader downloads there."""
        for node in self._nodes:
            paths = {into_by_rank[r] for r in node}
            if len(paths) > 1:
                return (
                    f"ranks {list(node)} share a node but name different directories: "
                    f"{sorted(paths)}"
                )
        return None

    def _default_select(self, saved_world: int | None) -> Callable[[str, int], bool]:
        same_layout = self.per_rank_dirs and saved_world == self.world_size

        def wants(path: str, rank: int) -> bool:
            m = _RANK_DIR.match(path)
            if m is None or not same_layout:
                return True  # a shared file, or another layout: every rank may need it
            return int(m.group(1)) == rank

        return wants

    # ---------------------------------------------------------------- for integrations

    def _fetch_for_node(
        self,
        record: CheckpointRecord,
        manifest: Manifest,
        needed: Iterable[str],
        cache_dir: str | os.PathLike[str] | None,
        what: str,
    ) -> Path:
        """Collective: every rank names the checkpoint files it needs; each node's leader
        downloads the node's union once (verified) into a fresh directory; returns that
        directory (the leader's) on every rank of the node. Used by the DCP reader."""
        self._check_usable()
        self._wait_idle()

        def steps() -> Path:
            local: Path | None = None
            if self.is_node_leader:
                base = Path(cache_dir).expanduser() if cache_dir else None
                if base is not None:
                    base.mkdir(parents=True, exist_ok=True)
                    local = base / f"{record.commit_id}-{secrets.token_hex(4)}"
                else:
                    import tempfile

                    local = Path(tempfile.mkdtemp(prefix="cloudckpt-read-"))
            everyone = self._comm.all_gather(
                {"needs": sorted(set(needed)), "dir": None if local is None else str(local)},
                what,
            )
            node_dir = Path(everyone[self.node_leader]["dir"])

            def download() -> None:
                wanted = set()
                for r in self.local_ranks:
                    wanted.update(everyone[r]["needs"])
                by_path = {e.path: e for e in manifest.files}
                missing = sorted(wanted - set(by_path))
                if missing:
                    raise CorruptionError(
                        f"step {record.step} has no file {missing[0]!r} that its metadata names"
                    )
                node_dir.mkdir(parents=True, exist_ok=True)
                chunks.download(
                    self.engine,
                    self.store,
                    record.ckpt + protocol.FILES_DIR,
                    [by_path[p] for p in sorted(wanted)],
                    node_dir,
                    manifest.chunk_size,
                    self.progress,
                )

            _, failures, own = self._run_phase(download if self.is_node_leader else None, what)
            if failures:
                if self.is_node_leader:
                    shutil.rmtree(node_dir, ignore_errors=True)
                if own is not None:
                    raise own
                raise _rebuild(next(iter(failures.values())))
            return node_dir

        return self._collective(steps)

    def _node_done(self, node_dir: Path, what: str) -> None:
        """Collective: every rank has finished reading ``node_dir``; the leader removes it."""
        self._wait_idle()
        self._collective(lambda: self._run_phase(None, what))
        if self.is_node_leader:
            shutil.rmtree(node_dir, ignore_errors=True)
