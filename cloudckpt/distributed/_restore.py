"""The multi-rank restore: the coordinator picks, one rank per node downloads.

``NodeReader.restore`` is every rank's part of ``resume()``/``restore()``: the ranks send
the coordinator their destination (``RestoreStart``); it claims the run (``resume`` only)
and picks the checkpoints to try, newest first (``Candidates``); then, for each until one
is intact, each node's leader downloads what the node's ranks need into a temporary
directory beside the destination while the ranks exchange heartbeats, and moves it into
place. A damaged checkpoint on any node means the next older one, on every node. The
leader takes what the node's ranks kept of that checkpoint from their local copies, every
byte verified, and downloads only the rest (``_kept.NodeCopies``); with several nodes, a
chunk several of them still need is read by one and sent to the others first
(``_fanout``: checked, kept copies placed; chunks shared; the rest downloaded), and, with
peer copies, a chunk a node lacks and another holds (its kept files, its peer copies) is
sent by a holder (``_peers.Holdings``), verified on receipt.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from cloudckpt import attempt_layout
from cloudckpt.distributed import _fanout
from cloudckpt.distributed._comm import Comm, PhaseResult, RankError, Ranks
from cloudckpt.distributed._kept import RANK_DIR, NodeCopies
from cloudckpt.distributed._peers import Holdings, PeerStore, node_chunks
from cloudckpt.distributed._save import WORLD_SIZE_KEY
from cloudckpt.download import download
from cloudckpt.errors import ConfigurationError
from cloudckpt.manifests import ChunkRef, FileEntry
from cloudckpt.protocol import CheckpointRecord, Latest
from cloudckpt.reader import (
    Damaged,
    Intact,
    check_objects,
    fetch_manifest,
    first_intact,
    readable,
    reread_if_dropped,
    to_try,
)
from cloudckpt.restore import (
    RestoreResult,
    apply_modes,
    check_space,
    out_of_space,
    place,
    prepare_destination,
)
from cloudckpt.stores import Store
from cloudckpt.transfer import ProgressCallback, TransferEngine

log = logging.getLogger("cloudckpt.distributed")

#: ``select(path, rank)``: whether ``rank`` needs the checkpoint file ``path``.
Select = Callable[[str, int], bool]


def rank_dir(rank: int) -> str:
    """The directory a rank's files live under in a checkpoint saved with per-rank
    directories: ``rank-00003`` for rank 3."""
    return f"rank-{rank:05d}"


@dataclasses.dataclass(frozen=True)
class DistributedRestoreResult(RestoreResult):
    """A ``RestoreResult`` for one rank of a multi-rank restore.

    ``path``: the node-local directory holding what this node downloaded (the checkpoint's
    layout: ``rank-<r>/...`` and any shared files). ``rank_path``: this rank's own
    directory, ``path/rank-<rank>``. ``saved_world_size``: the world size that saved the
    checkpoint (None if it was not saved by a ``DistributedCheckpointManager``); when it
    differs from the current one, every node holds every file and reshards as it likes.
    ``bytes_downloaded`` / ``bytes_local``: on a node's leader, the bytes it read from the
    store (the chunks it read for other nodes included, those it received from them not)
    and took from the node's kept copies (0 on the node's other ranks).
    ``bytes_from_peers``: on a node's leader, the bytes of its restore that came from
    other nodes over the process group (chunks another node read once and fanned out, or
    sent from its kept files or peer copies) or from the peer copies it holds itself,
    each verified (0 on the other ranks, and without fan-out or peer copies).
    """

    rank_path: Path | None = None
    saved_world_size: int | None = None
    bytes_from_peers: int = 0


# ------------------------------------------------------------------------------ messages


@dataclasses.dataclass(frozen=True)
class RestoreStart:
    """What a rank sends the coordinator before a restore: its destination, or the error
    its node's leader met checking it."""

    into: str
    error: RankError | None


@dataclasses.dataclass(frozen=True)
class Candidates:
    """The checkpoints to try, newest first (records as ``CheckpointRecord.to_dict``),
    and whether they come from the commit records (LATEST was unreadable)."""

    records: tuple[dict[str, Any], ...]
    from_records: bool

    @classmethod
    def of(cls, records: Iterable[CheckpointRecord], from_records: bool) -> Candidates:
        return cls(tuple(r.to_dict() for r in records), from_records)

    def todo(self) -> list[CheckpointRecord]:
        return [CheckpointRecord.from_dict(r) for r in self.records]


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """(A node's leader.) ``record`` checked, its kept files placed: the entries its
    ranks want, those ``rest`` still to download, their bytes ``need``."""

    record: CheckpointRecord
    chunk_size: int
    entries: list[FileEntry]
    rest: list[FileEntry]
    need: int
    chunks: list[ChunkRef]  # the manifest's distinct chunks (``_fanout.catalog``)
    holdings: Holdings | None = None  # what it can send from local bytes (peer copies on)


# ------------------------------------------------------------------------------ the reader


class NodeReader:
    """Every rank's part of multi-rank restores (see the module docstring). Its methods
    are collectives: call them on every rank, in the same order."""

    def __init__(
        self,
        comm: Comm,
        ranks: Ranks,
        store: Store,
        engine: TransferEngine,
        progress: ProgressCallback | None,
        per_rank_dirs: bool,
        kept: NodeCopies | None = None,
        link_local: bool = False,
        fanout: bool = True,
        peers: PeerStore | None = None,
        peer_reads: bool = False,
    ) -> None:
        self.comm, self.ranks = comm, ranks
        self.fanout = fanout
        # ``peer_reads``: the same on every rank (peer copies on, several nodes);
        # ``peers``: this node leader's own peer copies.
        self.peers, self.peer_reads = peers, peer_reads
        self.store, self.engine, self.progress = store, engine, progress
        self.per_rank_dirs = per_rank_dirs
        self.kept = kept if kept is not None else NodeCopies({}, per_rank_dirs)
        self.link_local = link_local
        self.bytes_downloaded = self.bytes_local = 0  # this node's leader's, last restore
        self.bytes_from_peers = 0

    def restore(
        self,
        into: Path,
        step: int | None,
        overwrite: bool,
        select: Select | None,
        claim: Callable[[], Latest] | None,
        keep: Callable[[str], bool] | None = None,
    ) -> DistributedRestoreResult | None:
        """The newest intact checkpoint (or ``step``) into the node-local ``into``; None
        for a new run (``claim`` given: rank 0 claims first, ``resume``). ``keep(path)``:
        only the files it keeps are read at all (``include``/``exclude`` patterns), for
        the ranks ``select`` (or the default) says need them.

        Raises on every rank: as ``restore.restore``, CollectiveError.
        """
        what = "resuming" if claim is not None else "restoring"
        chosen, dest = self._start(into, step, overwrite, claim, what)
        if chosen is None:
            return None

        def try_one(record: CheckpointRecord) -> int | Damaged | None:
            saved_world = _saved_world(record)
            base = select or self._default_select(saved_world)
            wants = base if keep is None else (lambda p, r: keep(p) and base(p, r))
            reason = self._fetch(record, dest, wants, what)
            return saved_world if reason is None else Damaged(reason)

        def reread(
            record: CheckpointRecord, tried: set[str], rereads: int
        ) -> tuple[list[CheckpointRecord], bool] | None:
            fresh = self.comm.decide(
                lambda: self._reread_if_dropped(record, step, tried, rereads),
                f"{what}: reading LATEST again",
            )
            return None if fresh is None else (fresh.todo(), fresh.from_records)

        found = first_intact(
            self.store,
            chosen.todo(),
            step,
            try_one,
            from_records=chosen.from_records,
            reread=reread,
        )
        if found.skipped:
            log.info(  # each skip was warned about as it happened (first_intact)
                "restored step %d after skipping %d checkpoint(s)",
                found.record.step,
                len(found.skipped),
            )
        return self._result(found, into)

    def _start(
        self,
        into: Path,
        step: int | None,
        overwrite: bool,
        claim: Callable[[], Latest] | None,
        what: str,
    ) -> tuple[Candidates | None, Path]:
        """Check the destination (node leaders), agree on it, claim (``resume``) and
        pick the candidates on the coordinator. Returns them (None: a new run) and the
        real directory this node's leader writes (``into`` may be a link)."""
        local_exc: BaseException | None = None
        dest = into
        if self.ranks.is_node_leader:
            try:  # before claiming: a bad argument must not fence the writer
                dest = prepare_destination(into, overwrite)
            except Exception as exc:
                local_exc = exc
        error = None if local_exc is None else RankError.of(local_exc, self.comm.rank)
        starts = self.comm.gather(RestoreStart(str(into), error), what)
        try:
            chosen = self.comm.decide(lambda: self._choose(starts, step, claim), what)
        except Exception:
            if local_exc is not None:  # this rank's own error rather than its copy
                raise local_exc from None
            raise
        return chosen, dest

    def _choose(
        self,
        starts: list[RestoreStart] | None,
        step: int | None,
        claim: Callable[[], Latest] | None,
    ) -> Candidates | None:
        """(Coordinator.) The checkpoints to try, newest first; None for a new run."""
        assert starts is not None
        failed = [s.error for s in starts if s.error is not None]
        if failed:
            raise failed[0].rebuild()
        bad = self.ranks.inconsistent_into({r: s.into for r, s in enumerate(starts)})
        if bad:
            raise ConfigurationError(
                bad, hint="Pass the same node-local directory on every rank of a node"
            )
        if claim is None:
            return Candidates.of(*readable(self.store, step))
        latest = claim()
        if latest.current is None:
            return None  # a new run
        todo = to_try(self.store.url, latest, step)
        return Candidates.of(todo, False)

    def _fetch(self, record: CheckpointRecord, dest: Path, wants: Select, what: str) -> str | None:
        """Every node's leader downloads ``record`` (what its ranks want) and moves it
        into ``dest``. Returns None when every node has it, or why it is damaged or
        missing on some node. Raises the first rank's failure that is not damage."""
        tmp = dest.with_name(f".{dest.name}.cloudckpt-tmp-{secrets.token_hex(4)}")
        leader = self.ranks.is_node_leader
        label = f"{what} step {record.step}"
        if not self.fans_out:  # one phase: check, take the kept copies, download
            phase = self.comm.run_phase(
                (lambda: self._download(self._prepare(record, wants, tmp), tmp, _fanout.NONE))
                if leader
                else None,
                label,
            )
            reason = self._failed(phase, tmp)
            if reason is None:
                self._place(tmp, dest, what, record)
            return reason
        prepared = self.comm.run_phase(
            (lambda: self._prepare(record, wants, tmp)) if leader else None, label
        )
        reason = self._failed(prepared, tmp)
        if reason is not None:
            return reason
        prep = prepared.result
        spill = tmp.with_name(f"{tmp.name}.received")  # beside: never in the restore
        try:
            return self._share_and_download(record, prep, tmp, dest, spill, what, label)
        finally:
            shutil.rmtree(spill, ignore_errors=True)

    def _share_and_download(
        self,
        record: CheckpointRecord,
        prep: _Prepared | None,
        tmp: Path,
        dest: Path,
        spill: Path,
        what: str,
        label: str,
    ) -> str | None:
        """(Every rank.) The chunks shared between nodes (``_fanout``), then each node's
        download and placing, as ``_fetch``."""
        try:
            shared = _fanout.exchange(
                self.comm,
                None if prep is None else prep.chunks,
                [] if prep is None else prep.rest,
                self.engine,
                self.store,
                label,
                None if prep is None else prep.holdings,
                self.fanout,
                spill,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        phase = self.comm.run_phase(
            (lambda: self._download(prep, tmp, shared)) if prep is not None else None, label
        )
        reason = self._failed(phase, tmp)
        if reason is None:
            self._place(tmp, dest, what, record)
        return reason

    def _failed(self, phase: PhaseResult[Any], tmp: Path) -> str | None:
        """None if no rank failed ``phase``; why the checkpoint is damaged if that is all
        that failed. Raises the first failure that is not damage."""
        if not phase.failures:
            return None
        shutil.rmtree(tmp, ignore_errors=True)
        fatal = [f for f in phase.failures.values() if not f.damaged]
        if fatal:
            own = phase.own
            if own is not None and own.__class__.__name__ == fatal[0].cls:
                raise own
            raise fatal[0].rebuild()
        return "; ".join(f.summary for f in phase.failures.values())

    def _place(self, tmp: Path, dest: Path, what: str, record: CheckpointRecord) -> None:
        """Every node's leader moves ``tmp`` into ``dest``. Raises the first failure."""
        leader = self.ranks.is_node_leader
        phase = self.comm.run_phase(
            (lambda: place(tmp, dest)) if leader else None, f"{what}: placing step {record.step}"
        )
        if phase.failures:
            shutil.rmtree(tmp, ignore_errors=True)
            if phase.own is not None:
                raise phase.own
            raise next(iter(phase.failures.values())).rebuild()

    @property
    def fans_out(self) -> bool:
        """Whether chunks several nodes need are read once and shared, or sent from peer
        copies (``_fanout``, ``_peers``)."""
        return (self.fanout or self.peer_reads) and len(self.ranks.nodes) > 1

    def _prepare(self, record: CheckpointRecord, wants: Select, tmp: Path) -> _Prepared:
        """(Node leader.) Check ``record`` and put, verified, what the node's ranks want
        and kept into the new directory ``tmp``. Returns what is left to download.
        Raises CorruptionError, UnsafePathError, StagingError (no space), StoreError."""
        copies = self.kept.find(record)
        manifest = self.kept.manifest(copies, record) or fetch_manifest(self.store, record)
        local = self.ranks.local_ranks
        entries = [e for e in manifest.files if any(wants(e.path, r) for r in local)]
        need = sum(e.size for e in entries)
        check_space(record.step, need, tmp.parent)
        self.bytes_downloaded = self.bytes_local = self.bytes_from_peers = 0
        try:
            tmp.mkdir()
            rest, self.bytes_local = self.kept.place(
                self.engine, copies, entries, tmp, manifest.chunk_size, self.link_local
            )
            if rest:
                check_objects(self.store, record, manifest)
        except OSError as exc:
            full = out_of_space(exc, record.step, need, tmp.parent)
            if full is None:
                raise
            raise full from exc
        chunks = _fanout.catalog(manifest.files) if self.fans_out else []
        holdings = None
        if self.fans_out and self.peer_reads:
            skip = {e.path for e in rest}
            placed = {
                e.path: tmp.joinpath(*e.path.split("/")) for e in entries if e.path not in skip
            }
            holdings = Holdings(node_chunks(entries, placed), self.peers)
        return _Prepared(record, manifest.chunk_size, entries, rest, need, chunks, holdings)

    def _download(self, prep: _Prepared, tmp: Path, shared: _fanout.Shared) -> None:
        """(Node leader.) Download what ``prep`` left, verified, into ``tmp`` (the chunks
        in ``got`` from memory: read by this node or received, verified, from another)
        and apply the files' modes. Raises CorruptionError, StagingError, StoreError."""

        def landed(n: int) -> None:
            self.bytes_downloaded += n
            if self.progress is not None:
                self.progress(n)

        source = _fanout.WithReceived(self.store, shared.got)
        try:
            if prep.rest:
                files = prep.record.ckpt + attempt_layout.FILES_DIR
                store = cast(Store, source)
                download(self.engine, store, files, prep.rest, tmp, prep.chunk_size, landed)
            apply_modes(tmp, prep.entries)  # after every file verified
        except OSError as exc:
            full = out_of_space(exc, prep.record.step, prep.need, tmp.parent)
            if full is None:
                raise
            raise full from exc
        # Bytes read from the store: those landed less those served from memory, plus
        # the chunks this node read to share.
        self.bytes_downloaded += shared.read - source.served
        self.bytes_from_peers = source.from_peers

    def _result(self, found: Intact[int | None], into: Path) -> DistributedRestoreResult:
        record = found.record
        return DistributedRestoreResult(
            step=record.step,
            path=into,
            metadata=dict(record.metadata),
            commit_id=record.commit_id,
            ckpt=record.ckpt,
            epoch=record.epoch,
            num_files=record.num_files,
            total_bytes=record.total_bytes,
            skipped=found.skipped,
            from_commit_records=found.from_records,
            rank_path=into / rank_dir(self.comm.rank),
            saved_world_size=found.value,
            bytes_downloaded=self.bytes_downloaded,
            bytes_local=self.bytes_local,
            bytes_from_peers=self.bytes_from_peers,
        )

    def _reread_if_dropped(
        self, record: CheckpointRecord, step: int | None, tried: set[str], rereads: int
    ) -> Candidates | None:
        """(Coordinator.) ``reread_if_dropped``, in a form that travels to every rank."""
        fresh = reread_if_dropped(self.store, record, step, tried, rereads)
        return None if fresh is None else Candidates.of(*fresh)

    def _default_select(self, saved_world: int | None) -> Select:
        same_layout = self.per_rank_dirs and saved_world == self.ranks.world_size

        def wants(path: str, rank: int) -> bool:
            m = RANK_DIR.match(path)
            if m is None or not same_layout:
                return True  # a shared file, or another layout: every rank may need it
            return int(m.group(1)) == rank

        return wants


def _saved_world(record: CheckpointRecord) -> int | None:
    """The world size that saved ``record`` (None: not a multi-rank save)."""
    saved = record.metadata.get(WORLD_SIZE_KEY)
    return saved if isinstance(saved, int) else None
