"""Collectives and error shipping for the multi-rank manager: one wrapper, typed messages.

Every collective the manager issues goes through ``Comm`` (as torch.distributed.checkpoint
sends its own through ``_DistWrapper``). It runs on the manager's own gloo group (or
trivially, in a single process), and each call either returns or raises
``CollectiveError`` (a rank died, hung or became unreachable); ``guard`` marks the group
broken after one, and it stays unusable.

What travels between ranks is typed: an exception becomes a ``RankError`` (rank, class
name, message, hint) from which every other rank rebuilds the same ``cloudckpt.errors``
class (every error class is defined there); ``decide`` runs a function on the
coordinator and gives every rank its result, or its error; ``run_phase`` runs this rank's
work while the ranks exchange a small heartbeat, so that a rank that fails stops the
others early and every rank learns who failed and why.

No collective waits forever: each gives up after the group's ``timeout`` (a dead peer's
closed connection fails it at once), and the ``CollectiveError`` names the ranks that had
not reached it (``Whereabouts``: each rank notes, in the job's rendezvous store, the
number and name of the last collective it entered; the survivor reads them after the
failure).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from cloudckpt import errors
from cloudckpt.errors import CloudCkptError, CollectiveError, CorruptionError, UnsafePathError

log = logging.getLogger("cloudckpt.distributed")

T = TypeVar("T")

_HEARTBEAT = 1.0  # seconds between heartbeats while some rank is still working
_BUSY, _OK, _DAMAGED, _FAILED = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class RankError:
    """An exception of one rank, as it travels to the others.

    ``damaged``: a ``CorruptionError`` or ``UnsafePathError`` (a checkpoint that cannot be
    used, where a restore falls back), rather than a failure that stops it.
    """

    rank: int
    cls: str
    message: str
    hint: str | None
    damaged: bool = False

    @classmethod
    def of(cls, exc: BaseException, rank: int) -> RankError:
        if isinstance(exc, CloudCkptError):
            message, hint = exc.message, exc.hint
        else:
            message, hint = f"{exc}" or type(exc).__name__, None
        damaged = isinstance(exc, CorruptionError | UnsafePathError)
        return cls(rank, type(exc).__name__, message, hint, damaged)

    @property
    def summary(self) -> str:
        """``rank 2: StoreError: ...``"""
        return f"rank {self.rank}: {self.cls}: {self.message}"

    @property
    def described(self) -> str:
        """``StoreError: ...``"""
        return f"{self.cls}: {self.message}"

    def rebuild(self) -> CloudCkptError:
        """The same ``cloudckpt.errors`` class on this rank (a ``CloudCkptError`` naming
        the class for anything else, or a class that needs more than a message)."""
        cls = getattr(errors, self.cls, None)
        if isinstance(cls, type) and issubclass(cls, CloudCkptError):
            try:
                return cls(self.message, hint=self.hint)
            except TypeError:  # e.g. MissingDependencyError needs its ``extra``
                pass
        return CloudCkptError(f"{self.cls}: {self.message}", hint=self.hint)


@dataclasses.dataclass(frozen=True)
class Answer(Generic[T]):
    """The coordinator's answer in ``decide``: its result, or its error."""

    value: T | None = None
    error: RankError | None = None


@dataclasses.dataclass(frozen=True)
class PhaseResult(Generic[T]):
    """What ``run_phase`` returns on every rank: this rank's result (None if it had no
    work or failed), the failures of every rank by rank, and this rank's own exception."""

    result: T | None
    failures: dict[int, RankError]
    own: BaseException | None


class Cancelled(Exception):
    """Raised from a progress hook to stop work that another rank's failure made moot."""


class Comm:
    """The manager's collectives (see the module docstring). ``rank`` and ``world`` are
    positions in the manager's group; rank 0 is the coordinator."""

    def __init__(self, dist: Any, group: Any, rank: int, world: int, timeout: float) -> None:
        self.dist, self.group = dist, group
        self.rank, self.world, self.timeout = rank, world, timeout
        #: The first collective failure seen under ``guard``; the group is unusable after it.
        self.broken: CollectiveError | None = None
        self._helper = cf.ThreadPoolExecutor(1, thread_name_prefix="cloudckpt-rank-work")
        # The helper's latest work and its phase: one worker, so once it is done all are.
        # A phase that failed on a CollectiveError leaves it running (an upload into a
        # store that stopped answering): close() must not release what it uses meanwhile.
        self._work: cf.Future[Any] | None = None
        self._work_what = ""
        self._seq = 0  # collectives entered: the same count on every rank, in lockstep
        self.whereabouts = Whereabouts.of(dist, group, rank, world, timeout)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def still_working(self, timeout: float | None) -> str | None:
        """Waits up to ``timeout`` (None: for good) for this rank's work on the helper to
        end; returns the phase still running then, or None."""
        work = self._work
        if work is None or cf.wait([work], timeout=timeout).not_done == set():
            return None
        return self._work_what

    def close(self, wait: bool = True) -> None:
        self._helper.shutdown(wait=wait)
        if self.whereabouts is not None:
            self.whereabouts.close()

    def check_usable(self) -> None:
        """Raises the ``CollectiveError`` that broke the group, if one did."""
        if self.broken is not None:
            raise self.broken

    def guard(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (which issues collectives); a ``CollectiveError`` out of it breaks
        the group."""
        try:
            return fn()
        except CollectiveError as exc:
            self.broken = exc
            raise

    # ---------------------------------------------------------------- the collectives

    def _call(self, what: str, fn: Callable[[], Any], lockstep: bool = True) -> Any:
        """``fn`` (one collective, or with ``lockstep=False`` one point-to-point message,
        which only some ranks send: not counted, so the count stays the same on every
        rank). Raises CollectiveError naming the ranks behind."""
        if lockstep:
            self._seq += 1
            if self.whereabouts is not None:
                self.whereabouts.entered(self._seq, what)
        started = time.monotonic()
        try:
            return fn()
        except Exception as exc:
            detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            waited = time.monotonic() - started
            who = "a rank died, hung or became unreachable"
            if self.whereabouts is not None:
                who = self.whereabouts.culprits(self._seq)
            raise CollectiveError(
                f"rank {self.rank} lost contact with the other ranks while {what} "
                f"(after {waited:.1f}s; timeout={self.timeout:g}s): {who} "
                f"({type(exc).__name__}: {detail})"
            ) from exc

    def gather(self, obj: T, what: str) -> list[T] | None:
        """``obj`` of every rank, on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._call(
            what,
            lambda: self.dist.gather_object(obj, out, group=self.group, group_dst=0),
        )
        return out

    def broadcast(self, obj: T, what: str) -> T:
        """Rank 0's ``obj``, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        self._call(
            what,
            lambda: self.dist.broadcast_object_list(box, group=self.group, group_src=0),
        )
        return box[0]

    def all_gather(self, obj: T, what: str) -> list[T]:
        """``obj`` of every rank, on every rank."""
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

    def send(self, tensor: Any, dst: int, what: str) -> None:
        """``tensor`` to rank ``dst`` alone (point to point; bounded by the timeout)."""
        self._call(what, lambda: self.dist.send(tensor, group=self.group, group_dst=dst), False)

    def recv(self, tensor: Any, src: int, what: str) -> None:
        """Fill ``tensor`` from rank ``src`` (point to point; bounded by the timeout)."""
        self._call(what, lambda: self.dist.recv(tensor, group=self.group, group_src=src), False)

    # ---------------------------------------------------------------- patterns

    def decide(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` on the coordinator and hand its result to every rank; if it raises,
        every rank raises the same cloudckpt error (the coordinator its own exception)."""
        local_exc: BaseException | None = None
        answer: Answer[T] | None = None
        if self.is_coordinator:
            try:
                answer = Answer(value=fn())
            except Exception as exc:
                local_exc = exc
                answer = Answer(error=RankError.of(exc, self.rank))
        answer = self.broadcast(answer, what)
        assert answer is not None
        if answer.error is not None:
            if local_exc is not None:
                raise local_exc
            raise answer.error.rebuild()
        return answer.value  # type: ignore[return-value]  # None only when fn returned None

    def run_phase(
        self,
        work: Callable[[], T] | None,
        what: str,
        cancel: threading.Event | None = None,
    ) -> PhaseResult[T]:
        """Run ``work`` here (None: nothing) in a helper thread while exchanging heartbeats
        with every rank until no rank is busy. ``cancel`` is set once any rank has failed,
        to cut short work the failure made pointless."""
        fut = self._helper.submit(work) if work is not None else None
        if fut is not None:
            self._work, self._work_what = fut, what
        code = _OK
        try:
            while True:
                if fut is not None and not fut.done():
                    cf.wait([fut], timeout=_HEARTBEAT)
                code = _status(fut)
                codes = self.heartbeat(code, what)
                if _BUSY not in codes:
                    break
                if cancel is not None and (_FAILED in codes or _DAMAGED in codes):
                    cancel.set()
        except CollectiveError:
            if cancel is not None:
                cancel.set()
            raise
        own = None if fut is None or code == _OK else fut.exception()
        failures: dict[int, RankError] = {}
        if any(c != _OK for c in codes):
            mine = None if own is None else RankError.of(own, self.rank)
            gathered = self.all_gather(mine, f"{what} (reporting failures)")
            failures = {r: g for r, g in enumerate(gathered) if g is not None}
        result = fut.result() if fut is not None and own is None else None
        return PhaseResult(result, failures, own)


def _status(fut: cf.Future[Any] | None) -> int:
    """This rank's heartbeat code for its work ``fut`` (None: it has none)."""
    if fut is None:
        return _OK
    if not fut.done():  # one look: the work may finish meanwhile
        return _BUSY
    exc = fut.exception()
    if exc is None:
        return _OK
    return _DAMAGED if isinstance(exc, CorruptionError | UnsafePathError) else _FAILED


class Whereabouts:
    """Where each rank of a group is: the number and name of the last collective it
    entered, noted in the job's rendezvous store (the c10d store ``init_process_group``
    set up: torchrun's agent store, or the ``MASTER_ADDR`` TCPStore) under
    ``cloudckpt/<group>/<rank>``. A rank notes it from a thread of its own, so a slow or
    unreachable store never delays a collective; after a collective failed, the survivor
    reads every rank's note (bounded: ``_LOOKUP_S``) and names the ranks that had not
    reached it. One small write per rank and collective (heartbeats included: one a second
    while uploads and downloads run)."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self._latest: tuple[int, str] | None = None
        self._written: tuple[int, str] | None = None
        self._wake = threading.Condition()
        self._closed = False
        threading.Thread(target=self._write, name="cloudckpt-whereabouts", daemon=True).start()

    @classmethod
    def of(cls, dist: Any, group: Any, rank: int, world: int, timeout: float) -> Whereabouts | None:
        """The group's, or None (one rank, or no store to note it in: the errors then
        name no rank)."""
        if world == 1 or group is None:
            return None
        try:
            name = getattr(group, "group_name", None) or "default"
            store = dist.PrefixStore(
                f"cloudckpt/{name}/", dist.distributed_c10d._get_default_store()
            )
        except Exception as exc:  # private API moved, no default store: errors name no rank
            log.debug("no rendezvous store to note where ranks are: %s", exc)
            return None
        return cls(store, rank, world)

    def entered(self, seq: int, what: str) -> None:
        with self._wake:
            self._latest = (seq, what)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _write(self) -> None:
        while True:
            with self._wake:
                while not self._closed and self._latest == self._written:
                    self._wake.wait()
                if self._closed:
                    return
                latest = self._latest
            assert latest is not None
            try:
                self.store.set(str(self.rank), f"{latest[0]}\t{latest[1]}")
            except Exception as exc:  # the store is gone: stop noting (errors name no rank)
                log.debug("cannot note where rank %d is: %s", self.rank, exc)
                return
            self._written = latest

    def culprits(self, seq: int) -> str:
        """Which ranks had not reached collective ``seq`` (this rank's current one), in
        words. Waits ``_SETTLE_S`` for the others' notes to land, then at most
        ``_LOOKUP_S`` for the store."""
        time.sleep(_SETTLE_S)
        done: cf.Future[dict[int, tuple[int, str]]] = cf.Future()

        def read() -> None:
            try:
                done.set_result(self._read())
            except Exception as exc:
                done.set_exception(exc)

        threading.Thread(target=read, name="cloudckpt-whereabouts-read", daemon=True).start()
        try:
            notes = done.result(timeout=_LOOKUP_S)
        except Exception as exc:
            return f"a rank died, hung or became unreachable (which one is unknown: {exc!r})"
        behind = sorted((r, n) for r, n in notes.items() if n[0] < seq and r != self.rank)
        missing = [r for r in range(self.world) if r not in notes and r != self.rank]
        if not behind and not missing:
            return "every rank had entered it: a rank died or lost its connection inside it"
        parts = [f"rank {r} never reached it (its last: {w!r})" for r, (_, w) in behind]
        parts += [f"rank {r} never reached any" for r in missing]
        return "; ".join(parts) + ": it died, hangs or is slower than the timeout"

    def _read(self) -> dict[int, tuple[int, str]]:
        keys = [str(r) for r in range(self.world)]
        present = [k for k in keys if self.store.check([k])]
        notes: dict[int, tuple[int, str]] = {}
        for key, raw in zip(present, self.store.multi_get(present), strict=True):
            seq, _, what = bytes(raw).decode("utf-8", "replace").partition("\t")
            notes[int(key)] = (int(seq), what)
        return notes


_SETTLE_S = 1.0  # after a failure, for the other survivors' notes to land
_LOOKUP_S = 5.0  # the most the survivor waits for the rendezvous store


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where the manager's ranks are: this rank, the world, and the ranks of each node
    (ranks sharing a host, and so its local disks), in order of first appearance."""

    rank: int
    world_size: int
    nodes: tuple[tuple[int, ...], ...]

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks on this rank's node (itself included)."""
        return next(node for node in self.nodes if self.rank in node)

    @property
    def node_leader(self) -> int:
        """The rank that downloads for this node: its lowest."""
        return self.local_ranks[0]

    @property
    def is_node_leader(self) -> bool:
        return self.node_leader == self.rank

    def inconsistent_into(self, into_by_rank: Mapping[int, str]) -> str | None:
        """Ranks of one node must name the same directory: its leader downloads there."""
        for node in self.nodes:
            paths = {into_by_rank[r] for r in node}
            if len(paths) > 1:
                return (
                    f"ranks {list(node)} share a node but name different directories: "
                    f"{sorted(paths)}"
                )
        return None


def node_key() -> str:
    """Ranks with the same key share a host (and so its local disks)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def torch_dist() -> Any:
    """``torch.distributed``. Raises ImportError saying torch is needed."""
    try:
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError(
            "cloudckpt.distributed needs torch: install the torch build you need first"
        ) from exc
    return dist
