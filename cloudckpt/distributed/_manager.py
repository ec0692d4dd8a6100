"""``DistributedCheckpointManager``: a ``CheckpointManager`` on every rank, one commit.

The manager is built from the single-host manager's parts (``cloudckpt.manager.ManagerBase``:
saves are staged locally and handed to the save queue's background thread) in the
collective mode (``SaveMode``), with its own pipeline: ``RankSave`` takes part in the
multi-rank save (``_save.save``) instead of one host's. Restores are
``_restore.NodeReader``'s; every collective goes through ``_comm.Comm``. After each commit
every rank keeps its files as its local copy (``_kept``), which restores on the same node
take, verified, instead of downloading them; with several nodes, each node's kept files are
then also sent to ``peer_copies`` other nodes, from which a replacement host restores
(``_peers``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from cloudckpt.attempts import AttemptWriter, CommitInfo
from cloudckpt.distributed import _kept, _peers, _replicas, _save
from cloudckpt.distributed._chunks import RankChunks
from cloudckpt.distributed._comm import Comm, RankError, Ranks, node_key, torch_dist
from cloudckpt.distributed._restore import (
    DistributedRestoreResult,
    NodeReader,
    Select,
    rank_dir,
)
from cloudckpt.errors import CollectiveError, ConfigurationError
from cloudckpt.localcopy import LocalCopies
from cloudckpt.localsave import after_commit, fail_attempt
from cloudckpt.manager import ManagerBase, SaveMode
from cloudckpt.reader import check_patterns, selected
from cloudckpt.savequeue import QueuedSave, SaveHandle
from cloudckpt.staging import DCP, DURABLE, remove_own
from cloudckpt.stores import Store
from cloudckpt.transfer import ProgressCallback

log = logging.getLogger("cloudckpt.distributed")

T = TypeVar("T")
DEFAULT_TIMEOUT = 600.0


def _rank_pipeline(manager: ManagerBase) -> RankSave:
    """The pipeline of a rank's saves (``SaveMode``)."""
    assert isinstance(manager, DistributedCheckpointManager)
    return RankSave(
        manager._comm,
        manager.attempts,
        RankChunks(manager.store),
        manager.progress,
        manager._stored_path,
        manager.local,
        lambda: manager.is_node_leader,
        manager.replicas,
        manager.dedup,
        manager._share_peers,
        lambda: manager._leaders_keep,
    )


class DistributedCheckpointManager(ManagerBase):
    """A ``CheckpointManager`` for every rank of a ``torch.distributed`` job: all ranks
    upload into one attempt, the coordinator (rank 0) alone claims and commits.

    Args:
        url, **kwargs: as ``CheckpointManager`` (``backpressure`` must stay ``"block"``).
            ``chunking`` (not ``"off"``, the default ``"tensor"``): each rank stores its
            files as chunks and uploads only those the checkpoint the save builds on lacks
            (``_chunks``; docs/integrations/distributed.md, "Incremental saves").
        process_group: the ranks that checkpoint together (default: the whole world). The
            manager builds its own gloo group over the same ranks; it never uses this one.
            Without an initialized process group the manager runs as a single rank.
        timeout: seconds any rank waits for the others at one collective (default 600).
            It bounds how long survivors wait for a dead or hung rank, so it must exceed
            the longest gap between ranks handing over the same save (how long the slowest
            rank stays inside ``save()``'s block after the fastest left it, plus the
            difference in the ranks' naming passes with ``dedup``). Long uploads and
            downloads are not bounded by it: ranks exchange heartbeats meanwhile.
            Every collective of saves, restores and the DCP reader's construction is
            bounded by it, and its ``CollectiveError`` names the ranks that never reached
            it (docs/integrations/distributed.md, "Failures and timeouts").
        per_rank_dirs: store rank ``r``'s files under ``rank-<r>/`` (default). With False,
            ranks write the checkpoint's paths directly (e.g. rank 0 ``config.json``, rank
            ``r`` ``model-0000r.safetensors``); two ranks writing one path is refused
            before anything is uploaded.
        node_id: ranks with equal ``node_id`` share one restore directory (default: the
            host name and boot id, so ranks on one machine share it).
        staging_dir: a local directory; each rank stages under ``<staging_dir>/rank-<r>``.
        replica_groups: ranks (in the group) that hold the same state, e.g. the
            data-parallel replicas ``[[0, 2], [1, 3]]`` of 2-way DP x 2-way tensor
            parallelism: each saves the same files under its own ``rank-<r>/`` (needs
            ``per_rank_dirs``). Before every commit the coordinator compares their digests;
            any difference is no commit and a ``ReplicaDivergedError`` naming the ranks and
            files (docs/integrations/distributed.md, "Replica agreement"). Default: none.
        replica_exclude: glob patterns of paths inside ``rank-<r>/`` that replicas may
            hold differently (per-rank RNG states, data-loader positions), e.g.
            ``["rng-*.pt"]``.
        dedup: a chunk that several ranks hold is uploaded once, by the lowest rank that
            must upload it (default True; costs each rank one hashing pass over its files
            before the save's first collective: docs/integrations/distributed.md).
        fanout: in a restore, a chunk that several nodes need (data-parallel replicas on
            different nodes) is read from the store by one node and sent, over the
            manager's gloo group, to the others, which verify every byte against the
            manifest (what fails is read from the store). Default True; it has no effect
            on one node (docs/integrations/distributed.md, "Restoring: once per node").
        keep_local, local_budget_bytes: as ``CheckpointManager``, per rank: after each
            commit every rank keeps its own files under its staging directory (default:
            the newest checkpoint with a ``staging_dir``, none without), and a restore on
            the same node takes them, verified, instead of downloading them.
        peer_copies: after each commit, each node's leader sends its node's kept files
            to this many other nodes (default 1; 0: off), which hold them under their
            leader's staging directory; a restore on a node that lacks its files (a
            replacement host) takes them from a peer, every chunk verified against the
            committed manifest, and reads from the store only the rest. Active only with
            2 or more nodes and local copies kept on every node (a ``staging_dir``,
            ``keep_local`` >= 1); costs: docs/integrations/distributed.md, "Peer copies".
        peer_budget_bytes: the most bytes each node's leader holds for its peers (default
            None: no cap but its free disk, of which 5% of the disk stays free); a copy
            that does not fit is not held (a warning in ``CommitInfo.warnings``), one that
            fits only without the older copy replaces it.

    Raises:
        ConfigurationError: bad arguments, or ranks that disagree about the URL or layout.
        CollectiveError: a rank did not join the construction in time.
    """

    save_mode = SaveMode(_rank_pipeline, collective=True)

    def __init__(
        self,
        url: str | Store,
        *,
        process_group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        per_rank_dirs: bool = True,
        node_id: str | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
        replica_groups: Sequence[Sequence[int]] | None = None,
        replica_exclude: Sequence[str] | None = None,
        dedup: bool = True,
        fanout: bool = True,
        peer_copies: int = 1,
        peer_budget_bytes: int | None = None,
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
        self.dedup = bool(dedup)
        self.fanout = bool(fanout)
        if isinstance(peer_copies, bool) or not isinstance(peer_copies, int) or peer_copies < 0:
            raise ConfigurationError("peer_copies must be a whole number >= 0")
        if peer_budget_bytes is not None and peer_budget_bytes < 0:
            raise ConfigurationError("peer_budget_bytes must be >= 0 (or None)")
        self.peer_copies = peer_copies
        if replica_groups is not None and not self.per_rank_dirs:
            raise ConfigurationError(
                "replica_groups needs per_rank_dirs=True",
                hint="Replicas save the same file names, each under its own rank-<r>/",
            )
        dist = torch_dist()
        global_rank, rank, world, group = _join(dist, process_group, self.timeout)
        self.replicas = _replicas.Replicas(
            _replicas.check_groups(replica_groups, world),
            check_patterns(replica_exclude, "replica_exclude"),
        )
        self.rank, self.world_size, self.global_rank = rank, world, global_rank
        self.is_coordinator = rank == 0
        self.process_group = group
        self._comm = Comm(dist, group, rank, world, self.timeout)
        if staging_dir is not None:
            staging_dir = Path(staging_dir).expanduser() / rank_dir(global_rank)
        if not self.is_coordinator:
            kwargs["auto_gc"] = False  # one GC per job is plenty
        failure: BaseException | None = None
        try:
            super().__init__(url, staging_dir=staging_dir, **kwargs)
        except Exception as exc:
            failure = exc
        self._ranks, kept = self._agree(failure, node_id)
        # Whether any node's leader keeps local copies (the same on every rank): only
        # then does the commit's outcome carry the manifest (``_save.Committed``).
        self._leaders_keep = any(kept[min(node)] is not None for node in self._ranks.nodes)
        self.local_ranks: tuple[int, ...] = self._ranks.local_ranks
        self.node_leader = self._ranks.node_leader
        self.is_node_leader = self._ranks.is_node_leader
        self.num_nodes = len(self._ranks.nodes)
        #: The kept copies of this node's ranks (``_kept``): what this node's restores use.
        self.node_copies = _kept.NodeCopies(
            _kept.node_tiers(self.local_ranks, kept, self.rank, self.local), self.per_rank_dirs
        )
        self._start_peers(kept, peer_budget_bytes)
        self.recovery.abandon_all()  # no recovery across ranks: see the package doc
        remove_own(self.staging.root, DCP)  # a crashed DCP writer's

    def _agree(
        self, failure: BaseException | None, node_id: str | None
    ) -> tuple[Ranks, list[tuple[str, int] | None]]:
        """Every rank: learn whether every rank started, with the same URL and layout, and
        where the ranks are and keep their local copies (staging root and ``keep_local``
        by rank). Raises this rank's own ``failure``, ConfigurationError or
        CollectiveError (after releasing what this rank holds)."""
        keeps = failure is None and self.local.keep > 0
        mine = _Hello(
            error=None if failure is None else RankError.of(failure, self.rank),
            node=node_id if node_id is not None else node_key(),
            url=None if failure is not None else self.url,
            per_rank_dirs=self.per_rank_dirs,
            replicas=self.replicas,
            dedup=self.dedup,
            kept=(str(self.staging.root), self.local.keep) if keeps else None,
            peer_copies=self.peer_copies,
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
        ranks = Ranks(self.rank, self.world_size, tuple(tuple(n) for n in nodes.values()))
        return ranks, [e.kept for e in everyone]

    def _start_peers(self, kept: list[tuple[str, int] | None], budget: int | None) -> None:
        """Whether peer copies are made and read (the same on every rank: 2 or more nodes,
        every node's leader keeping local copies), and this leader's ``PeerStore``."""
        leaders = {n[0] for n in self._ranks.nodes}
        #: Whether peer copies are made and read (``_peers``).
        self.peers_active = (
            self.peer_copies > 0 and self.num_nodes > 1 and all(kept[r] for r in leaders)
        )
        #: This node leader's peer copies (None elsewhere, or peer copies off).
        self.peer_store = (
            _peers.PeerStore(self.staging.root, budget)
            if self.peers_active and self.is_node_leader
            else None
        )

    def _abort_init(self, failure: BaseException | None) -> None:
        self._comm.close(wait=False)
        if failure is None:
            self.close()

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
        earlier save's failure (a save that failed is done on each rank at a slightly different
        moment: some ranks would raise, the others enter its collectives and time out):
        ``wait()`` and ``close()`` do, on every rank.
        """
        self._comm.check_usable()
        return super().save(step, metadata, metrics=metrics)

    def resume(
        self,
        into: str | os.PathLike[str],
        *,
        step: int | None = None,
        overwrite: bool = False,
        link_local: bool = False,
        select: Select | None = None,
    ) -> DistributedRestoreResult | None:
        """Every rank: rank 0 claims the run (fencing older writers) and picks the newest
        committed checkpoint (or ``step``); each node downloads what its ranks need into
        ``into`` (node-local; the same path on every rank of a node). Returns the same
        checkpoint on every rank, or None for a new, empty run.

        ``select(path, rank)``: whether ``rank`` needs the checkpoint file ``path`` (a pure
        function; evaluated by each node's downloading rank for every rank of the node).
        The files the node's ranks kept of that checkpoint (``keep_local``) are taken from
        their local copies where every byte verifies (reflinked or copied; hard-linked
        with ``link_local``, as ``CheckpointManager.resume``); the rest is downloaded.

        Raises: as ``CheckpointManager.resume`` (on every rank), ``CollectiveError``.
        """
        into = Path(into).expanduser().absolute()
        return self._collectively(
            lambda: self._reader(link_local).restore(
                into, step, overwrite, select, self.attempts.claim
            )
        )

    def restore(
        self,
        into: str | os.PathLike[str],
        *,
        step: int | None = None,
        overwrite: bool = False,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        link_local: bool = False,
        select: Select | None = None,
    ) -> DistributedRestoreResult:
        """As ``resume()`` without claiming the run (read-only). ``include`` /
        ``exclude``: glob patterns over the checkpoint's paths (``rank-00000/model.pt``
        with per-rank directories), as ``CheckpointManager.restore`` takes them: only the
        files they select are read (and those ``select`` gives each rank). ``link_local``:
        as for ``resume``.

        Raises: CheckpointNotFoundError, CorruptionError, DestinationNotEmptyError,
        StagingError, StoreError (on every rank), CollectiveError; ConfigurationError (a
        bad pattern).
        """
        into = Path(into).expanduser().absolute()
        inc, exc = check_patterns(include, "include"), check_patterns(exclude, "exclude")
        keep = (lambda path: selected(path, inc, exc)) if inc or exc else None
        result = self._collectively(
            lambda: self._reader(link_local).restore(into, step, overwrite, select, None, keep)
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
        self.queue.wait_idle()
        return self._comm.guard(fn)

    def _reader(self, link_local: bool = False) -> NodeReader:
        return NodeReader(
            self._comm,
            self._ranks,
            self.store,
            self.engine,
            self.progress,
            self.per_rank_dirs,
            self.node_copies,
            link_local,
            self.fanout,
            self.peer_store,
            self.peers_active,
        )

    def _share_peers(self, info: CommitInfo) -> list[str]:
        """(Every rank, on the save's thread, after the commit and the local copies.)
        Peer copies of this commit (``_peers.share``). Returns warnings; raises
        CollectiveError (the caller makes it a warning: the save is committed)."""
        if not self.peers_active:
            return []
        leader = self.is_node_leader
        return self._comm.guard(
            lambda: _peers.share(
                self._comm,
                self._ranks,
                info.step,
                info.commit_id,
                self.node_copies if leader else None,
                self.peer_store,
                self.peer_copies,
            )
        )

    def close(self, timeout: float | None = None) -> None:
        """As ``CheckpointManager.close``; then the collectives' helper thread ends too."""
        try:
            super().close(timeout)
        finally:
            # Not under saves still running after a timeout: they need the collectives.
            # Once closed, the helper is idle (RankSave.close waited for it): no wait here.
            if self.closed:
                self._comm.close(wait=False)

    def _stored_path(self, rel: str) -> str:
        return f"{rank_dir(self.rank)}/{rel}" if self.per_rank_dirs else rel


class RankSave:
    """This rank's part of each save (the queue's pipeline; see the package docstring):
    every rank runs it for the same saves in the same order. ``stored_path`` maps a
    staged file's path to its path in the checkpoint; ``local`` is the rank's local tier,
    where its files stay after the commit; ``is_node_leader()``: whether this rank also
    keeps the committed manifest there (``_kept.keep``)."""

    def __init__(
        self,
        comm: Comm,
        attempts: AttemptWriter,
        rank_chunks: RankChunks,
        progress: ProgressCallback | None,
        stored_path: Callable[[str], str],
        local: LocalCopies,
        is_node_leader: Callable[[], bool],
        replicas: _replicas.Replicas | None = None,
        dedup: bool = True,
        share: Callable[[CommitInfo], list[str]] | None = None,
        leaders_keep: Callable[[], bool] = lambda: True,
    ) -> None:
        self.share = share  # peer copies after each commit (None: off)
        self.leaders_keep = leaders_keep  # send the manifest with the commit's outcome
        self.comm = comm
        self.local = local
        self.is_node_leader = is_node_leader
        self.attempts = attempts
        self.rank_chunks = rank_chunks
        self.progress = progress
        self.stored_path = stored_path
        self.replicas = replicas or _replicas.Replicas()
        self.dedup = dedup

    def __call__(self, job: QueuedSave) -> CommitInfo:
        """Take part in the save of ``job`` (the queue's worker). Raises the save's
        failure, the same on every rank (RankFailedError, FencedError, CollectiveError)."""
        attempt = job.attempt
        try:
            self.comm.check_usable()
            info, manifest = self.comm.guard(lambda: self._save_collectively(job))
        except Exception:
            fail_attempt(attempt)
            raise
        # Committed: nothing failing now (a full disk) may fail the save (I6).
        warnings: list[str] = []
        manifest = manifest if self.is_node_leader() else None
        kept = lambda: _kept.keep(attempt, info, self.local, manifest)  # noqa: E731
        if not after_commit(info.step, "keep the local copy", kept, warnings):
            attempt.remove()
        self._peer_copies(info, warnings)
        return dataclasses.replace(info, warnings=(*info.warnings, *warnings))

    def _peer_copies(self, info: CommitInfo, warnings: list[str]) -> None:
        """Peer copies of the committed ``info`` (every rank): whatever fails, even a
        dead peer (CollectiveError), is a warning, never the save's failure (I6)."""
        share = self.share
        if share is not None:
            what = "make its peer copies"
            after_commit(info.step, what, lambda: warnings.extend(share(info)), warnings)

    def _save_collectively(self, job: QueuedSave) -> tuple[CommitInfo, bytes | None]:
        """Make this rank's staged files durable and take part in the save with them (or
        with the error that kept them from it: ``job.error``)."""
        attempt, handle = job.attempt, job.handle
        files: list[tuple[str, Path]] = []
        local_exc = job.error
        try:
            if local_exc is not None:
                raise local_exc
            attempt.fsync_files()
            attempt.set_state(DURABLE)
            files = [(self.stored_path(rel), path) for rel, path in attempt.list_files()]
        except Exception as exc:
            local_exc = exc
        return _save.save(
            self.comm,
            self.attempts,
            self.rank_chunks,
            handle,
            files,
            local_exc,
            self.progress,
            replicas=self.replicas,
            dedup=self.dedup,
            send_manifest=self.leaders_keep(),
        )

    def close(self, timeout: float | None = None) -> bool:
        """Waits (up to ``timeout``) for this rank's own work on the collectives' helper,
        which a phase that failed on a CollectiveError leaves running (an upload into a
        store that stopped answering): nothing (staging, engine, store) is released under
        it. Raises TimeoutError naming it if it still runs then."""
        what = self.comm.still_working(timeout)
        if what is not None:
            raise TimeoutError(
                "close() ran out of its timeout: this rank's work of a failed collective "
                f"phase ({what}) is still running (a store that does not answer?); nothing "
                "was released. Call close() again to keep waiting (it releases everything "
                "once that work ends)"
            )
        return True


@dataclasses.dataclass(frozen=True)
class _Hello:
    """What a rank tells the others when the manager starts."""

    error: RankError | None
    node: str
    url: str | None
    per_rank_dirs: bool
    replicas: _replicas.Replicas
    dedup: bool
    kept: tuple[str, int] | None  # (staging root, keep_local) where it keeps local copies
    peer_copies: int = 1


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
    if len({e.replicas for e in everyone}) > 1:
        return "ranks disagree about replica_groups or replica_exclude"
    if len({e.dedup for e in everyone}) > 1:
        return "ranks disagree about dedup"
    if len({e.peer_copies for e in everyone}) > 1:
        return "ranks disagree about peer_copies"
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
