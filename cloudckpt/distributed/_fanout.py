"""Read once, fan out: a chunk that several nodes need is read from the store by one of
them and sent to the others over the manager's gloo group (docs/design.md §7, "Read once,
fan out"; docs/integrations/distributed.md, "Restoring: once per node").

Between checking a checkpoint (kept copies placed) and downloading the rest, every node's
leader tells the others which chunks it still needs (``Need``: a bit per chunk of the
manifest's ``catalog``; one ``all_gather``). Every rank then derives the same ``plan``:
each chunk needed by two or more nodes gets ONE sender, the needing leader with the fewest
chunks assigned so far (ties: the lowest rank), so the reads spread over the nodes. The
transfers run in rounds of ``ROUND_CHUNKS``, in the plan's order on every leader (each
transfer waits only for earlier ones: no cycle, no deadlock); after each round every rank
exchanges one heartbeat, so ranks that send nothing wait at most one round.

With peer copies (``_peers``), each leader's ``Need`` also says which chunks it holds
(``Need.held``: its kept files placed, its peer copies): a chunk a leader needs and
another holds is sent by a holder from its local bytes, whoever else needs it, and is
never read from the store.

Nothing received is trusted: a receiver keeps a chunk only if its bytes have exactly the
digest its name (the committed manifest's) records; what fails, or what the sender could
not read (it sends a size of -1), is read from the store by the normal download. A
sender that dies or hangs fails the receiver's ``recv`` within the group's timeout: a
``CollectiveError``, never a wrong tensor, never a hang.

Cost: the received chunks wait on disk beside the restore (``Received``: one file per
chunk) until the node's download ends; memory holds at most a round of them; per transfer
two point-to-point messages.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import io
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cloudckpt import digest
from cloudckpt.distributed._comm import _OK, Comm
from cloudckpt.fetch import fetch_chunk
from cloudckpt.manifests import ChunkRef, FileEntry
from cloudckpt.stores import Store
from cloudckpt.transfer import TransferEngine

_T = TypeVar("_T")

log = logging.getLogger("cloudckpt.distributed")

#: The chunks one round of transfers moves (all senders together; at most 256 MiB).
ROUND_CHUNKS = 32


@dataclasses.dataclass(frozen=True)
class Need:
    """What one node's leader still needs from the store: bit ``i`` of ``mask`` (little
    bit order) set for chunk ``i`` of the manifest's ``catalog``. A bit per chunk of the
    checkpoint: 16 KB per node for 125,000 chunks, whatever each node needs. ``held``:
    the same bits for the chunks it can send from local bytes (kept files placed, peer
    copies: ``_peers.Holdings``); empty without peer copies."""

    mask: bytes
    held: bytes = b""


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Chunk ``index`` of the catalog, read by ``sender`` (a node leader) and sent to
    ``receivers``."""

    index: int
    sender: int
    receivers: tuple[int, ...]
    held: bool = False  # sent from the sender's local bytes, not read from the store


class Received:
    """On a node's leader: the verified chunks it read, received or held itself for its
    download, by key; each in a file of its own under ``spill`` (so a node that receives
    most of its checkpoint holds at most a round of it in memory), or in memory (None).
    A chunk that cannot be written there is dropped: the download reads it."""

    def __init__(self, spill: Path | None = None) -> None:
        self.spill = spill
        self.items: dict[str, bytes | Path] = {}
        self.from_peers: set[str] = set()  # keys another node sent or a peer copy held

    def add(self, ref: ChunkRef, data: bytes, peer: bool = False) -> None:
        """Keep ``ref``'s verified ``data``; ``peer``: it came from another node or from
        a peer copy this node holds (``bytes_from_peers``), not from this node's read."""
        if peer:
            self.from_peers.add(ref.key)
        if self.spill is None:
            self.items[ref.key] = bytes(data)
            return
        path = self.spill / ref.name  # a digest: never a path
        try:
            self.spill.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        except OSError as exc:
            log.warning("cannot keep chunk %s for the download (%s): reading it", ref.key, exc)
            return
        self.items[ref.key] = path

    def __contains__(self, key: object) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)

    def read_into(self, key: str, start: int, buf: Any) -> int | None:
        """Bytes of chunk ``key`` from ``start`` into ``buf``; None if it is not here."""
        item = self.items.get(key)
        if item is None:
            return None
        view = memoryview(buf).cast("B")
        if isinstance(item, bytes):
            piece = item[start : start + len(view)]
            view[: len(piece)] = piece
            return len(piece)
        return read_local(item, start, lambda f: f.readinto(view))


def read_local(path: Path, offset: int, read: Callable[[io.BufferedReader], _T]) -> _T | None:
    """``read(f)`` of a local file opened at ``offset``; None if it cannot be read (a
    chunk a leader holds locally is then taken from elsewhere)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return read(f)
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class Shared:
    """On a node's leader: the verified chunks it read or received (``Received``) and
    the bytes it read from the store to share."""

    got: Received
    read: int


NONE = Shared(Received(), 0)


def catalog(files: Sequence[FileEntry]) -> list[ChunkRef]:
    """The distinct chunks of a manifest's ``files``, in order of first appearance: the
    same list on every node (every leader uses the manifest LATEST names)."""
    seen: dict[str, ChunkRef] = {}
    for entry in files:
        for ref in entry.chunks or ():
            seen.setdefault(ref.key, ref)
    return list(seen.values())


def need_of(
    chunks: Sequence[ChunkRef], rest: Sequence[FileEntry], held: bytes = b"", have: Any = ()
) -> Need:
    """The ``Need`` of a leader that still has ``rest`` to download (less the chunks
    whose keys are in ``have``: it holds them already) and can send ``held``."""
    wanted = {ref.key for e in rest for ref in (e.chunks or ())}
    wanted.difference_update(have)
    mask = bytearray((len(chunks) + 7) // 8)
    for i, ref in enumerate(chunks):
        if ref.key in wanted:
            mask[i >> 3] |= 1 << (i & 7)
    return Need(bytes(mask), held)


def plan(
    needs: Sequence[Need | None],
    *,
    sizes: Sequence[int] | None = None,
    fanout: bool = True,
) -> list[Transfer]:
    """(Every rank, the same transfers.) Each chunk a leader needs that another holds
    (``Need.held``) is sent by a holder from its local bytes; each other chunk that two
    or more leaders need (with ``fanout``) is read by one of them and sent to the
    others. In catalog order; the sender is the one with the fewest bytes assigned so
    far (``sizes``: the catalog's chunk sizes, on leaders; chunks elsewhere, where only
    the number of transfers matters), then the lowest rank."""
    masks = {r: n.mask for r, n in enumerate(needs) if n is not None}
    helds = {r: n.held for r, n in enumerate(needs) if n is not None and n.held}
    once = twice = held_any = 0  # bit sets: chunks one leader needs, two or more do
    for mask in masks.values():
        bits = _int(mask)
        twice |= once & bits
        once |= bits
    for held in helds.values():
        held_any |= _int(held)
    todo = (once & held_any) | (twice if fanout else 0)
    load = dict.fromkeys(masks, 0)
    out = []
    width = max((len(m) for m in masks.values()), default=0)
    for byte, value in enumerate(todo.to_bytes(width, "little")):
        for offset in range(8) if value else ():
            bit = 1 << offset
            if not value & bit:
                continue
            index = byte * 8 + offset
            needers = [r for r, m in masks.items() if byte < len(m) and m[byte] & bit]
            holders = [
                r for r, h in helds.items() if byte < len(h) and h[byte] & bit and r not in needers
            ]
            if not holders and not (fanout and len(needers) > 1):
                continue  # held only by the one node that needs it: its own download
            pick = holders or needers
            sender = min(pick, key=lambda r: (load[r], r))
            load[sender] += sizes[index] if sizes is not None and index < len(sizes) else 1
            others = tuple(r for r in needers if r != sender)
            out.append(Transfer(index, sender, others, bool(holders)))
    return out


def _int(mask: bytes) -> int:
    return int.from_bytes(mask, "little")


def indices(bits: int) -> list[int]:
    """The positions of the set bits of ``bits``, ascending (a byte at a time: linear in
    the mask's length, where shifting a 125,000-bit integer bit by bit is quadratic)."""
    out: list[int] = []
    for byte, value in enumerate(bits.to_bytes((bits.bit_length() + 7) // 8, "little")):
        if value:
            out.extend(byte * 8 + offset for offset in range(8) if value >> offset & 1)
    return out


def rounds(transfers: Sequence[Transfer]) -> list[list[Transfer]]:
    """``transfers`` cut into rounds of ``ROUND_CHUNKS`` (chunks are at most 8 MiB)."""
    return [list(transfers[i : i + ROUND_CHUNKS]) for i in range(0, len(transfers), ROUND_CHUNKS)]


def outgoing(data: bytes | memoryview) -> bytes:
    """The bytes a sender sends for a chunk it read (a seam for fault tests)."""
    return bytes(data)


def accept(ref: ChunkRef, data: bytes) -> bool:
    """Whether received ``data`` is exactly the chunk ``ref`` names (size and digest)."""
    return len(data) == ref.size and digest.hexleaf(data, ref.algorithm) == ref.sha256


class Local(Protocol):
    """What a leader can send from local bytes (``_peers.Holdings``)."""

    def mask(self, chunks: Sequence[ChunkRef]) -> bytes: ...

    def read(self, ref: ChunkRef) -> bytes | None: ...


def exchange(
    comm: Comm,
    chunks: Sequence[ChunkRef] | None,
    rest: Sequence[FileEntry],
    engine: TransferEngine,
    store: Store,
    what: str,
    local: Local | None = None,
    fanout: bool = True,
    spill: Path | None = None,
) -> Shared:
    """(Every rank; collective.) Fan out the chunks several nodes need, and send those
    a node needs and another holds (``local``: a leader's local bytes, with peer
    copies). ``chunks``: on a node's leader, the manifest's ``catalog`` (None
    elsewhere); ``rest``: the entries it still has to download. Returns, on a leader,
    the verified chunks it read, received or held itself and the bytes it read from the
    store (nothing elsewhere); ``spill``: a new directory for them (None: in memory).

    Raises CollectiveError (a peer died, hung past the timeout or became unreachable)."""
    got = Received(spill)
    mine = None
    if chunks is not None:
        held = b"" if local is None else local.mask(chunks)
        if local is not None:
            _own(chunks, rest, local, held, got)
        mine = need_of(chunks, rest, held, got.items)
    needs = comm.all_gather(mine, f"{what}: listing the chunks each node needs and holds")
    sizes = None if chunks is None else [ref.size for ref in chunks]
    transfers = plan(needs, sizes=sizes, fanout=fanout)
    read = 0
    for batch in rounds(transfers):
        if chunks is not None:
            read += _round(comm, batch, chunks, engine, store, got, what, local)
        comm.heartbeat(_OK, f"{what}: sharing chunks between nodes")
    if transfers and chunks is not None:
        n = sum(t.held for t in transfers)
        log.info(
            "%s: %d chunk(s) sent between nodes (%d from peer copies or kept files)",
            what,
            len(transfers),
            n,
        )
    return Shared(got, read)


def _own(
    chunks: Sequence[ChunkRef],
    rest: Sequence[FileEntry],
    local: Local,
    held: bytes,
    got: Received,
) -> None:
    """(A leader.) Add to ``got`` the chunks of ``rest`` it holds itself (a peer copy of
    another node's replica), verified."""
    wanted = {ref.key for e in rest for ref in (e.chunks or ())}
    for i, ref in enumerate(chunks):
        if ref.key in wanted and i >> 3 < len(held) and held[i >> 3] >> (i & 7) & 1:
            data = local.read(ref)
            if data is not None and accept(ref, data):
                got.add(ref, data, peer=True)


def _round(
    comm: Comm,
    batch: Sequence[Transfer],
    chunks: Sequence[ChunkRef],
    engine: TransferEngine,
    store: Store,
    got: Received,
    what: str,
    local: Local | None = None,
) -> int:
    """(A leader.) This leader's part of one round: read what it sends from the store
    (in parallel on the engine's workers) or from its local bytes, then send and
    receive in the plan's order. Returns the bytes it read from the store."""
    read = 0
    reads = {
        t.index: engine.submit(fetch_chunk, engine, store, chunks[t.index])
        for t in batch
        if t.sender == comm.rank and not t.held and t.index < len(chunks)
    }
    try:
        for t in batch:
            ref = chunks[t.index] if t.index < len(chunks) else None
            if t.sender == comm.rank:
                data = None
                if ref is not None and t.held:
                    data = None if local is None else local.read(ref)
                elif ref is not None:
                    data = _read(reads[t.index], ref.key)
                    if data is not None:
                        got.add(ref, data)
                        read += len(data)
                for r in t.receivers:
                    send_chunk(comm, None if data is None else outgoing(data), r, what)
            elif comm.rank in t.receivers:
                data = recv_chunk(comm, t.sender, what)
                if ref is not None and data is not None and accept(ref, data):
                    got.add(ref, data, peer=True)
                elif data is not None:
                    log.warning(
                        "%s: chunk %d from rank %d does not match its digest; reading it "
                        "from the store",
                        what,
                        t.index,
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


def send_chunk(comm: Comm, data: bytes | None, dst: int, what: str) -> None:
    """Send a chunk (None: the sender has none: the receiver reads it itself)."""
    import torch

    header = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64)
    comm.send(header, dst, f"{what}: sending a chunk to rank {dst}")
    if data:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        comm.send(payload, dst, f"{what}: sending a chunk to rank {dst}")


def recv_chunk(comm: Comm, src: int, what: str) -> bytes | None:
    """Receive a chunk (None: the sender had none), unverified."""
    import torch

    header = torch.zeros(1, dtype=torch.int64)
    comm.recv(header, src, f"{what}: receiving a chunk from rank {src}")
    n = int(header.item())
    if n < 0:
        return None
    if n == 0:
        return b""
    buf = bytearray(n)
    comm.recv(
        torch.frombuffer(buf, dtype=torch.uint8), src, f"{what}: receiving a chunk from rank {src}"
    )
    return bytes(buf)


class WithReceived:
    """``store`` for a download, but the chunks in ``got`` (verified, by key) come from
    there. ``served``: the bytes it served from them; ``from_peers``: those of them that
    came from peers (``Received.from_peers``)."""

    def __init__(self, store: Store, got: Received) -> None:
        self.inner, self.got = store, got
        self.url = store.url
        self.served = self.from_peers = 0
        self._lock = threading.Lock()

    def get_range_into(self, key: str, start: int, buf: Any) -> int:
        n = self.got.read_into(key, start, buf)
        if n is None:
            return int(self.inner.get_range_into(key, start, buf))
        with self._lock:
            self.served += n
            if key in self.got.from_peers:
                self.from_peers += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
