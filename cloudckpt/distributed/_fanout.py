"""Read once, fan out: a chunk that several nodes need is read from the store by one of
them and sent to the others over the manager's gloo group (docs/design.md §6, "Read once,
fan out"; docs/integrations/distributed.md, "Restores across nodes").

Between checking a checkpoint (kept copies placed) and downloading the rest, every node's
leader tells the others which chunks it still needs (``Need``: one ``all_gather``). Every
rank then derives the same ``Plan``: each chunk needed by two or more nodes gets ONE
sender, the needing leader with the fewest bytes assigned so far (ties: the lowest rank),
so the reads spread over the nodes. The transfers run in rounds of at most
``ROUND_BYTES``, in the plan's order on every leader (each transfer waits only for earlier
ones: no cycle, no deadlock); after each round every rank exchanges one heartbeat, so
ranks that send nothing wait at most one round.

Nothing received is trusted: a receiver keeps a chunk only if its bytes have exactly the
digest its name (the committed manifest's) records; what fails, or what the sender could
not read (it sends a size of -1), is read from the store by the normal download. A
sender that dies or hangs fails the receiver's ``recv`` within the group's timeout: a
``CollectiveError``, never a wrong tensor, never a hang.

Cost: the received chunks are held in memory until the node's download ends (at most
the bytes of the chunks several nodes share); per transfer two point-to-point messages.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from cloudckpt import digest
from cloudckpt.chunks import fetch_chunk
from cloudckpt.distributed._comm import _OK, Comm
from cloudckpt.manifests import ChunkRef, FileEntry
from cloudckpt.stores import Store
from cloudckpt.transfer import TransferEngine

log = logging.getLogger("cloudckpt.distributed")

#: The most bytes one round of transfers moves (all senders together).
ROUND_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Need:
    """What one node's leader still needs from the store: chunk key -> size."""

    chunks: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One chunk, read by ``sender`` (a node leader) and sent to ``receivers``."""

    key: str
    size: int
    sender: int
    receivers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Shared:
    """On a node's leader: the verified chunks it read or received, by key, and the
    bytes it read from the store to share."""

    got: dict[str, bytes]
    read: int


NONE = Shared({}, 0)


def needed(entries: Sequence[FileEntry]) -> dict[str, ChunkRef]:
    """The chunks of ``entries`` (those stored as chunks), by key."""
    return {ref.key: ref for e in entries for ref in (e.chunks or ())}


def plan(needs: Sequence[Need | None]) -> list[Transfer]:
    """(Every rank, the same.) The transfers: each chunk that two or more leaders need,
    by key, with one sender among them (the fewest bytes assigned so far, then the
    lowest rank)."""
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for rank, need in enumerate(needs):
        for key, size in (need.chunks if need is not None else {}).items():
            holders.setdefault(key, []).append(rank)
            sizes[key] = size
    load: dict[int, int] = {}
    out = []
    for key in sorted(holders):
        ranks = holders[key]
        if len(ranks) < 2:
            continue
        sender = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[sender] = load.get(sender, 0) + sizes[key]
        out.append(Transfer(key, sizes[key], sender, tuple(r for r in ranks if r != sender)))
    return out


def rounds(transfers: Sequence[Transfer]) -> list[list[Transfer]]:
    """``transfers`` cut into rounds of at most ``ROUND_BYTES`` (one at least)."""
    out: list[list[Transfer]] = []
    size = ROUND_BYTES
    for t in transfers:
        if size + t.size > ROUND_BYTES and (not out or out[-1]):
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.size
    return out


def outgoing(data: bytes | memoryview) -> bytes:
    """The bytes a sender sends for a chunk it read (a seam for fault tests)."""
    return bytes(data)


def accept(ref: ChunkRef, data: bytes) -> bool:
    """Whether received ``data`` is exactly the chunk ``ref`` names (size and digest)."""
    return len(data) == ref.size and digest.hexleaf(data, ref.algorithm) == ref.sha256


def exchange(
    comm: Comm,
    refs: Mapping[str, ChunkRef] | None,
    engine: TransferEngine,
    store: Store,
    what: str,
) -> Shared:
    """(Every rank; collective.) Fan out the chunks several nodes need. ``refs``: on a
    node's leader, the chunks its node still needs by key (None elsewhere). Returns, on a
    leader, the verified bytes of the chunks it read or received (empty elsewhere).

    Raises CollectiveError (a peer died, hung past the timeout or became unreachable)."""
    mine = None if refs is None else Need({k: r.size for k, r in refs.items()})
    needs = comm.all_gather(mine, f"{what}: listing the chunks each node needs")
    transfers = plan(needs)
    got: dict[str, bytes] = {}
    read = 0
    for batch in rounds(transfers):
        if refs is not None:
            read += _round(comm, batch, refs, engine, store, got, what)
        comm.heartbeat(_OK, f"{what}: sharing chunks between nodes")
    if transfers and refs is not None:
        log.info("%s: %d chunk(s) read once and shared between nodes", what, len(transfers))
    return Shared(got, read)


def _round(
    comm: Comm,
    batch: Sequence[Transfer],
    refs: Mapping[str, ChunkRef],
    engine: TransferEngine,
    store: Store,
    got: dict[str, bytes],
    what: str,
) -> int:
    """(A leader.) This leader's part of one round: read what it sends (in parallel on
    the engine's workers), then send and receive in the plan's order. Returns the bytes
    it read."""
    read = 0
    reads = {
        t.key: engine.submit(fetch_chunk, engine, store, refs[t.key])
        for t in batch
        if t.sender == comm.rank
    }
    try:
        for t in batch:
            if t.sender == comm.rank:
                data = _read(reads[t.key], t.key)
                if data is not None:
                    got[t.key] = data
                    read += len(data)
                for r in t.receivers:
                    _send(comm, None if data is None else outgoing(data), r, what)
            elif comm.rank in t.receivers:
                data = _recv(comm, t.sender, what)
                if data is not None and accept(refs[t.key], data):
                    got[t.key] = data
                elif data is not None:
                    log.warning(
                        "%s: chunk %s from rank %d does not match its digest; reading it "
                        "from the store",
                        what,
                        t.key,
                        t.sender,
                    )
    finally:
        for f in reads.values():
            f.cancel()
    return read


def _read(fut: cf.Future[Any], key: str) -> bytes | None:
    """The verified chunk the sender read, or None (it reads it again in its download;
    its receivers read it themselves)."""
    try:
        return bytes(fut.result())
    except Exception as exc:
        log.warning("cannot read chunk %s to share it: %s; each node reads it itself", key, exc)
        return None


def _send(comm: Comm, data: bytes | None, dst: int, what: str) -> None:
    import torch

    header = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64)
    comm.send(header, dst, f"{what}: sending a chunk to rank {dst}")
    if data:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        comm.send(payload, dst, f"{what}: sending a chunk to rank {dst}")


def _recv(comm: Comm, src: int, what: str) -> bytes | None:
    import torch

    header = torch.zeros(1, dtype=torch.int64)
    comm.recv(header, src, f"{what}: receiving a chunk from rank {src}")
    n = int(header.item())
    if n < 0:
        return None
    payload = torch.empty(n, dtype=torch.uint8)
    if n:
        comm.recv(payload, src, f"{what}: receiving a chunk from rank {src}")
    return payload.numpy().tobytes()


class WithReceived:
    """``store`` for a download, but the chunks in ``got`` (verified bytes, by key) come
    from memory. ``served``: the bytes it served from memory."""

    def __init__(self, store: Store, got: Mapping[str, bytes]) -> None:
        self.inner, self.got = store, got
        self.url = store.url
        self.served = 0
        self._lock = threading.Lock()

    def get_range_into(self, key: str, start: int, buf: Any) -> int:
        data = self.got.get(key)
        if data is None:
            return int(self.inner.get_range_into(key, start, buf))
        piece = data[start : start + len(buf)]
        memoryview(buf)[: len(piece)] = piece
        with self._lock:
            self.served += len(piece)
        return len(piece)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
