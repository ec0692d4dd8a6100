"""``DistributedCheckpointManager``: a ``CheckpointManager`` on every rank, one commit.

The manager keeps the single-host manager's queue (saves are staged locally and handed to
its background thread) and replaces what each queued save does: ``_save`` takes part in the
multi-rank save (``_save.save``) instead of the single-host pipeline. Restores are
``_restore.NodeReader``'s; every collective goes through ``_comm.Comm``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from cloudckpt.attempts import CommitInfo
from cloudckpt.distributed import _save
from cloudckpt.distributed._comm import Comm, RankError, Ranks, node_key, torch_dist
from cloudckpt.distributed._restore import (
    DistributedRestoreResult,
    NodeReader,
    Select,
    rank_dir,
)
from cloudckpt.errors import CloudCkptError, CollectiveError, ConfigurationError
from cloudckpt.gc import collect_garbage
from cloudckpt.manager import CheckpointManager, QueuedSave, SaveHandle
from cloudckpt.staging import COMMITTED, DURABLE, STAGED
from cloudckpt.stores import Store

log = logging.getLogger("cloudckpt.distributed")

T = TypeVar("T")
DEFAULT_TIMEOUT = 600.0


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
        self.timeout = float(timeout)
        self.per_rank_dirs = bool(per_rank_dirs)
        dist = torch_dist()
        global_rank, rank, world, group = _join(dist, process_group, self.timeout)
        self.rank, self.world_size, self.global_rank = rank, world, global_rank
        self.is_coordinator = rank == 0
        self.process_group = group
        self._comm = Comm(dist, group, rank, world, self.timeout)
        self._gc_thread: threading.Thread | None = None
        self._abandoned: dict[SaveHandle, BaseException] = {}
        if staging_dir is not None:
            staging_dir = Path(staging_dir).expanduser() / rank_dir(global_rank)
        failure: BaseException | None = None
        try:
            super().__init__(url, staging_dir=staging_dir, **kwargs)
        except Exception as exc:
            failure = exc
        self._ranks = self._agree(failure, node_id)
        self.local_ranks: tuple[int, ...] = self._ranks.local_ranks
        self.node_leader = self._ranks.node_leader
        self.is_node_leader = self._ranks.is_node_leader
        self.num_nodes = len(self._ranks.nodes)
        if not self.is_coordinator:
            self._auto_gc = False  # one GC per job is plenty
        for attempt in self._leftovers:  # no recovery across ranks: see the package doc
            log.info("abandoning step %d left in staging (%s)", attempt.step, attempt.state)
            attempt.remove()
        self._leftovers = []
        shutil.rmtree(self.staging.root / "dcp", ignore_errors=True)  # a crashed DCP writer's

    def _agree(self, failure: BaseException | None, node_id: str | None) -> Ranks:
        """Every rank: learn whether every rank started, with the same URL and layout, and
        where the ranks are. Raises this rank's own ``failure``, ConfigurationError or
        CollectiveError (after releasing what this rank holds)."""
        mine = _Hello(
            error=None if failure is None else RankError.of(failure, self.rank),
            node=node_id if node_id is not None else node_key(),
            url=None if failure is not None else self.url,
            per_rank_dirs=self.per_rank_dirs,
        )
        try:
            everyone = self._comm.all_gather(mine, "starting the manager")
        except CollectiveError:
            self._abort_init(failure)
            raise
        message = _disagreement(everyone)
        if message is not None:
            self._abort_init(failure)
            if failure is not None:
                raise failure
            raise ConfigurationError(message)
        nodes: dict[str, list[int]] = {}
        for r, e in enumerate(everyone):
            nodes.setdefault(e.node, []).append(r)
        return Ranks(self.rank, self.world_size, tuple(tuple(n) for n in nodes.values()))

    def _abort_init(self, failure: BaseException | None) -> None:
        self._comm.close(wait=False)
        if failure is None:
            self._shutdown()

    # ---------------------------------------------------------------- public API

    def save(
        self,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Start this rank's part of a save (every rank calls it, for the same steps in the
        same order). Files written into the yielded directory are stored under
        ``rank-<rank>/`` (or as written, with ``per_rank_dirs=False``). The coordinator's
        ``metadata`` and ``metrics`` are recorded. ``handle.result()`` returns the same ``CommitInfo`` on
        every rank, or raises the same error (``RankFailedError``, ``FencedError``,
        ``CollectiveError``...). Unlike ``CheckpointManager.save()``, it does not raise an
        earlier save's failure (see ``_raise_earlier_failure``): ``wait()`` and ``close()``
        do, on every rank.
        """
        self._comm.check_usable()
        return super().save(step, metadata, metrics=metrics)

    def resume(
        self,
        into: str | os.PathLike[str],
        *,
        step: int | None = None,
        overwrite: bool = False,
        select: Select | None = None,
    ) -> DistributedRestoreResult | None:
        """Every rank: rank 0 claims the run (fencing older writers) and picks the newest
        committed checkpoint (or ``step``); each node downloads what its ranks need into
        ``into`` (node-local; the same path on every rank of a node). Returns the same
        checkpoint on every rank, or None for a new, empty run.

        ``select(path, rank)``: whether ``rank`` needs the checkpoint file ``path`` (a pure
        function; evaluated by each node's downloading rank for every rank of the node).

        Raises: as ``CheckpointManager.resume`` (on every rank), ``CollectiveError``.
        """
        into = Path(into).expanduser().absolute()
        return self._collectively(
            lambda: self._reader().restore(into, step, overwrite, select, self.attempts.claim)
        )

    def restore(
        self,
        into: str | os.PathLike[str],
        *,
        step: int | None = None,
        overwrite: bool = False,
        select: Select | None = None,
    ) -> DistributedRestoreResult:
        """As ``resume()`` without claiming the run (read-only).

        Raises: CheckpointNotFoundError, CorruptionError, DestinationNotEmptyError,
        StagingError, StoreError (on every rank), CollectiveError.
        """
        into = Path(into).expanduser().absolute()
        result = self._collectively(
            lambda: self._reader().restore(into, step, overwrite, select, None)
        )
        assert result is not None
        return result

    # ---------------------------------------------------------------- for integrations

    def run_on_coordinator(self, fn: Callable[[], T], what: str) -> T:
        """Collective (every rank, after this manager's queued saves): run ``fn`` on the
        coordinator alone; every rank returns its result, or raises its error (the
        coordinator its own exception, the others the same ``cloudckpt.errors`` class).
        Used by the DCP reader to pick the checkpoint.

        Raises: ``fn``'s error, CollectiveError (the manager is unusable afterwards).
        """
        return self._collectively(lambda: self._comm.decide(fn, what))

    # ---------------------------------------------------------------- internals: helpers

    def _collectively(self, fn: Callable[[], T]) -> T:
        """Run ``fn``'s collectives once the queued saves (which use the same group) are
        done; a collective failure breaks the manager."""
        self.check_open()
        self._comm.check_usable()
        self._wait_idle()
        return self._comm.guard(fn)

    def _reader(self) -> NodeReader:
        return NodeReader(
            self._comm, self._ranks, self.store, self.engine, self.progress, self.per_rank_dirs
        )

    def _raise_earlier_failure(self) -> None:
        """Not here: a save that failed is done on each rank at a slightly different
        moment, so the next ``save()`` would raise on some ranks and enter the collectives
        on others, which would then time out. ``wait()`` and ``close()`` (every rank waits
        for the same saves) and each handle report it."""

    def _check_not_fenced(self) -> None:
        """Not here: a fenced coordinator refusing to enter a save would leave the other
        ranks waiting in its collectives. The coordinator's ``attempts.begin()`` raises
        the ``FencedError`` inside the save, and every rank raises it."""

    def _shutdown(self) -> None:
        try:
            if self._gc_thread is not None:
                self._gc_thread.join()
            super()._shutdown()
        finally:
            self._comm.close(wait=True)

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

    def _hand_over(self, handle: SaveHandle) -> None:
        try:
            handle._staged_attempt().set_state(STAGED, sync=False)
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

    # ---------------------------------------------------------------- internals: save

    def _save(self, job: QueuedSave) -> CommitInfo:
        """This rank's part of one save (worker thread); see the package docstring."""
        attempt = job.attempt
        try:
            if self._comm.broken is not None:
                self._abandoned.pop(job.handle, None)
                raise self._comm.broken
            info = self._comm.guard(lambda: self._save_collectively(job))
        except Exception:
            self._fail(attempt)
            raise
        attempt.set_state(COMMITTED)
        attempt.remove()
        return info

    def _save_collectively(self, job: QueuedSave) -> CommitInfo:
        """Make this rank's staged files durable and take part in the save with them (or
        with the error that kept them from it)."""
        attempt, handle = job.attempt, job.handle
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
        return _save.save(self._comm, self.attempts, handle, files, local_exc, self.progress)

    def _stored_path(self, rel: str) -> str:
        return f"{rank_dir(self.rank)}/{rel}" if self.per_rank_dirs else rel


@dataclasses.dataclass(frozen=True)
class _Hello:
    """What a rank tells the others when the manager starts."""

    error: RankError | None
    node: str
    url: str | None
    per_rank_dirs: bool


def _disagreement(everyone: list[_Hello]) -> str | None:
    """Why the ranks cannot work together (a rank failed to start, different URLs or
    layouts), or None."""
    problems = [e.error for e in everyone if e.error is not None]
    if problems:
        return "could not start on every rank: " + "; ".join(p.summary for p in problems)
    urls = {e.url for e in everyone}
    if len(urls) > 1:
        return "ranks were given different URLs: " + ", ".join(sorted(str(u) for u in urls))
    if len({e.per_rank_dirs for e in everyone}) > 1:
        return "ranks disagree about per_rank_dirs"
    return None


def _join(dist: Any, process_group: Any, timeout: float) -> tuple[int, int, int, Any]:
    """(global rank, rank in the group, group size, the manager's own gloo group or None
    for a single rank). Raises ConfigurationError."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ConfigurationError("process_group given but torch.distributed is not initialized")
        return 0, 0, 1, None
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    global_rank = dist.get_rank()
    if global_rank not in ranks:
        raise ConfigurationError("this process is not a member of process_group")
    rank, world = ranks.index(global_rank), len(ranks)
    group = None
    if world > 1:
        # Collective over the default group (or the members alone): first, before
        # anything local can fail and leave the other ranks waiting.
        group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=dt.timedelta(seconds=timeout),
            use_local_synchronization=process_group is not None,
        )
    return global_rank, rank, world, group
