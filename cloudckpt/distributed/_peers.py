"""Peer copies: after a commit, each node's kept files are also held by ``k`` other nodes,
so a replacement host restores from a peer instead of the bucket (docs/design.md §7, "Peer
copies"; docs/integrations/distributed.md, "Peer copies").

Saving (``share``, every rank, on the save's background thread after the commit and the
local copies): each node's leader tells the others (one ``all_gather`` of an ``Offer``)
which chunks of the committed manifest's ``catalog`` its node's kept files hold, which it
already holds as peer copies, and how many bytes it has room for. Node ``i`` sends its
chunks to the nodes ``i+1 .. i+k`` (mod N) that hold neither (``copy_plan``); each
receiver says whether that fits its room (``peer_budget_bytes``, free disk; a second
``all_gather``); then the chunks move in rounds over the manager's gloo group, as the
fan-out's (``_fanout``). Every chunk received is kept only if its size and digest are
exactly the committed manifest's (the receiver's own copy, read from the store by its
node); a copy is ``complete`` when every chunk it was to receive arrived, and only then
are the older copies dropped (unless the new one fits the budget only without them: then
they go first, ``PeerStore.reclaim``). A leader whose own part fails locally offers
nothing and still joins every collective, so the others go on. Nothing here can fail the committed save: a failure is a
warning in ``CommitInfo.warnings`` (issue 28's rule), a dead peer a ``CollectiveError``
within the manager's timeout (the group is then unusable, as after any such error).

Holding (``PeerStore``, a node leader's, under ``<its staging dir>/peers/``): the chunks,
content-addressed by name (``chunks/<name>``: the digest, so a chunk of an earlier step
that a later one reuses is held once), and an index per commit
(``<step>-<commit id>.json``) naming its chunks. The index only drives retention: a
restore never lists, restores or trusts a peer copy by name. It consults the peers only
for chunks of the manifest that LATEST names, and every byte is verified on receipt
(``_fanout.exchange``: ``Need.held``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from cloudckpt import attempt_layout
from cloudckpt.distributed import _fanout
from cloudckpt.distributed._comm import _OK, Comm, Ranks
from cloudckpt.distributed._fanout import Transfer
from cloudckpt.distributed._kept import NodeCopies
from cloudckpt.localcopy import LocalCopy
from cloudckpt.manifests import ChunkRef, FileEntry, Manifest, parse_manifest

log = logging.getLogger("cloudckpt.distributed")

PEERS_DIR = "peers"
FORMAT = "cloudckpt.peercopy/1"
INDEX_NAME = re.compile(r"^(\d{12})-([0-9A-Za-z_.-]+)\.json$")
#: Free space a receiver leaves on its disk: a peer copy never fills it.
RESERVE_FRACTION = 0.05


# ------------------------------------------------------------------------------ holding


class PeerStore:
    """A node leader's peer copies (module docstring). ``budget``: the most bytes its
    chunks may take (None: no cap but the free disk). Never raises on reads: a chunk
    that cannot be read is one a peer does not hold."""

    def __init__(self, staging_root: Path, budget: int | None) -> None:
        self.root = staging_root / PEERS_DIR
        self.chunks = self.root / "chunks"
        self.budget = budget

    def path(self, name: str) -> Path:
        if attempt_layout.parse_chunk_name(name) is None:  # a digest, never a path
            raise ValueError(f"not a chunk name: {name!r}")
        return self.chunks / name

    def holds(self) -> set[str]:
        """The names of the chunks held (unproven)."""
        try:
            return {p.name for p in self.chunks.iterdir() if not p.name.startswith(".")}
        except OSError:
            return set()

    def read(self, ref: ChunkRef) -> bytes | None:
        """The bytes held under ``ref``'s name, unverified (the receiver verifies)."""
        try:
            return self.path(ref.name).read_bytes()
        except (OSError, ValueError):
            return None

    def used(self, only: set[str] | None = None) -> int:
        """The bytes of the chunks held (of those named in ``only``, if given)."""
        total = 0
        with contextlib.suppress(OSError):
            for p in self.chunks.iterdir():
                if only is None or p.name in only:
                    with contextlib.suppress(OSError):
                        total += p.stat().st_size
        return total

    def room(self, keep: set[str] | None = None) -> int:
        """The bytes a new copy may take: the budget less what is held, and the free disk
        less ``RESERVE_FRACTION`` of it. Older copies stay until the new one is complete;
        with ``keep`` (the new commit's chunk names), counting the room ``reclaim`` would
        make by dropping them first."""
        self.root.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(self.root)
        freed = 0 if keep is None else self.used() - self.used(keep)
        room = usage.free + freed - int(usage.total * RESERVE_FRACTION)
        if self.budget is not None:
            room = min(room, self.budget - self.used() + freed)
        return max(0, room)

    def reclaim(self, keep: set[str]) -> None:
        """Drop every copy and chunk but the chunks named in ``keep``: a new copy that
        fits only without the older ones (``room(keep)``) goes in their place."""
        log.warning("dropping the older peer copies to make room for the new one")
        for path in self.root.iterdir():
            if INDEX_NAME.match(path.name) is not None:
                path.unlink(missing_ok=True)
        for name in self.holds() - keep:
            with contextlib.suppress(OSError):
                (self.chunks / name).unlink()

    def put(self, ref: ChunkRef, data: bytes) -> None:
        """Hold ``data`` (verified by the caller) under ``ref``'s name. Raises OSError."""
        self.chunks.mkdir(parents=True, exist_ok=True)
        target = self.path(ref.name)
        tmp = target.with_name(f".{ref.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def record(self, step: int, commit_id: str, names: Sequence[str], complete: bool) -> None:
        """Write the index of ``commit_id``'s copy; when ``complete``, drop every other
        copy and the chunks no remaining index names. Raises OSError."""
        self.root.mkdir(parents=True, exist_ok=True)
        body = {
            "format": FORMAT,
            "step": step,
            "commit_id": commit_id,
            "chunks": sorted(names),
            "complete": complete,
        }
        index = self.root / f"{step:012d}-{commit_id}.json"
        tmp = index.with_name(f".{index.name}.tmp")
        tmp.write_text(json.dumps(body, sort_keys=True))
        os.replace(tmp, index)
        if complete:
            self._drop_others(index)

    def _drop_others(self, keep: Path) -> None:
        named: set[str] = set()
        for path in self.root.iterdir():
            if INDEX_NAME.match(path.name) is None:
                continue
            if path != keep:
                log.info("dropping the peer copy %s (a newer one is complete)", path.name)
                path.unlink(missing_ok=True)
                continue
            with contextlib.suppress(OSError, ValueError, TypeError):
                named |= set(json.loads(path.read_text())["chunks"])
        for name in self.holds() - named:
            with contextlib.suppress(OSError):
                (self.chunks / name).unlink()


# ------------------------------------------------------------------------------ saving


@dataclasses.dataclass(frozen=True)
class Offer:
    """A node leader's part of a peer copy: bits over the committed manifest's catalog
    of the chunks its node's kept files hold (``own``: what it sends) and of those it
    holds at all (``has``: own and peer copies); ``room``: the bytes it can take."""

    own: bytes
    has: bytes
    room: int


def _bits(mask: bytes) -> int:
    return int.from_bytes(mask, "little")


def _mask(indices: Sequence[int] | set[int], n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in indices:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def targets(leaders: Sequence[int], sender: int, k: int) -> list[int]:
    """The leaders that hold ``sender``'s copy: the next ``k`` nodes on the ring."""
    n = len(leaders)
    at = leaders.index(sender)
    return [leaders[(at + j) % n] for j in range(1, min(k, n - 1) + 1)]


def copy_plan(
    offers: Sequence[Offer | None],
    leaders: Sequence[int],
    k: int,
    accepts: Sequence[bool | None] | None = None,
) -> list[Transfer]:
    """(Every rank, the same.) Each chunk a node's kept files hold, sent to each of its
    ``targets`` that holds it neither as its own nor as a peer copy (one sender per
    chunk and target: the first on the ring), in catalog order. With ``accepts``, only
    to targets that accepted."""
    wanted: dict[tuple[int, int], list[int]] = {}  # (chunk, sender) -> receivers
    taken: set[tuple[int, int]] = set()  # (chunk, receiver)
    for sender in leaders:
        offer = offers[sender]
        if offer is None:
            continue
        own = _bits(offer.own)
        for t in targets(leaders, sender, k):
            theirs = offers[t]
            if theirs is None or (accepts is not None and not accepts[t]):
                continue
            for i in _fanout.indices(own & ~_bits(theirs.has)):
                if (i, t) not in taken:
                    taken.add((i, t))
                    wanted.setdefault((i, sender), []).append(t)
    return [Transfer(i, s, tuple(r)) for (i, s), r in sorted(wanted.items())]


@dataclasses.dataclass
class _Node:
    """(A leader.) The committed checkpoint as its node holds it."""

    chunks: list[ChunkRef]
    local: dict[str, tuple[Path, int]]  # chunk key -> (kept file, offset)


def node_chunks(
    files: Sequence[FileEntry], source: Mapping[str, Path]
) -> dict[str, tuple[Path, int]]:
    """Where each chunk of the ``files`` with a local ``source`` (by path) lies."""
    out: dict[str, tuple[Path, int]] = {}
    for entry in files:
        path = source.get(entry.path)
        if path is None:
            continue
        offset = 0
        for ref in entry.chunks or ():
            out.setdefault(ref.key, (path, offset))
            offset += ref.size
    return out


def read_at(where: tuple[Path, int], size: int) -> bytes | None:
    """``size`` bytes of a local file at an offset (None if it cannot be read)."""
    path, offset = where
    return _fanout.read_local(path, offset, lambda f: f.read(size))


def _load(copies: NodeCopies, commit_id: str) -> _Node | None:
    """(A leader.) The node's kept files of ``commit_id`` and the manifest kept with them
    (read from the store right after the commit), or None."""
    found: dict[int, LocalCopy] = {}
    for rank, tier in copies.tiers.items():
        for copy in tier.copies():
            if copy.commit_id == commit_id:
                found[rank] = copy
                break
    manifest: Manifest | None = None
    for copy in found.values():
        with contextlib.suppress(Exception):
            manifest = parse_manifest((copy.dir / "MANIFEST.json").read_bytes())
            break
    if manifest is None:
        return None
    source = {}
    for entry in manifest.files:
        path = copies.source(found, entry.path)
        if path is not None and path.is_file():
            source[entry.path] = path
    return _Node(_fanout.catalog(manifest.files), node_chunks(manifest.files, source))


def _offer(
    copies: NodeCopies | None, store: PeerStore | None, commit_id: str, what: str
) -> tuple[_Node | None, Offer | None]:
    """(A leader.) Its node's copy of the commit and its ``Offer``; (None, None) when it
    has none, or anything local fails (it then takes no part, and the others go on)."""
    if copies is None or store is None:
        return None, None
    try:
        node = _load(copies, commit_id)
        if node is None:
            return None, None
        n = len(node.chunks)
        own = [i for i, ref in enumerate(node.chunks) if ref.key in node.local]
        held = store.holds()
        has = set(own) | {i for i, ref in enumerate(node.chunks) if ref.name in held}
        room = 0
        with contextlib.suppress(OSError):
            room = store.room({ref.name for ref in node.chunks})
        return node, Offer(_mask(own, n), _mask(has, n), room)
    except Exception as exc:  # a local failure must not leave the others waiting
        log.warning("%s: this node takes no part: %s", what, exc)
        return None, None


def share(
    comm: Comm,
    ranks: Ranks,
    step: int,
    commit_id: str,
    copies: NodeCopies | None,
    store: PeerStore | None,
    k: int,
) -> list[str]:
    """(Every rank; collective.) Send this node's kept files of the commit to ``k`` peer
    nodes, and hold what the others send (module docstring). ``copies`` and ``store``:
    on a node's leader (None elsewhere). Returns warnings (copies not held). Raises
    CollectiveError (a peer died, hung past the timeout or became unreachable)."""
    what = f"step {step}: peer copies"
    # Every rank of a node has kept its files before its leader reads them.
    comm.heartbeat(_OK, f"{what}: local copies kept")
    node, offer = _offer(copies, store, commit_id, what)
    if offer is None and ranks.is_node_leader:
        log.warning("%s: this node keeps no copy of the commit to send to its peers", what)
    offers = comm.all_gather(offer, f"{what}: listing what each node holds")
    leaders = [r for r in range(comm.world) if offers[r] is not None]
    warnings: list[str] = []
    accept: bool | None = None
    if node is not None and offer is not None:
        incoming = {t.index for t in copy_plan(offers, leaders, k) if comm.rank in t.receivers}
        need = sum(node.chunks[i].size for i in incoming)
        accept = fits(need, offer.room)
        if not accept:
            warnings.append(
                f"{what}: rank {comm.rank} holds no peer copy of this step: it needs "
                f"{need} bytes, it has room for {offer.room} (peer_budget_bytes, free disk)"
            )
            log.warning("%s", warnings[-1])
    accepts = comm.all_gather(accept, f"{what}: agreeing on the room each node has")
    if accept and node is not None and store is not None:
        _make_room(store, node, need, what)
    transfers = copy_plan(offers, leaders, k, accepts)
    mine = [t for t in transfers if comm.rank in t.receivers]
    failed = 0
    for batch in _fanout.rounds(transfers):
        if node is not None and store is not None:
            failed += _round(comm, batch, node, store, what)
        comm.heartbeat(_OK, f"{what}: sending chunks to peers")
    if node is not None and store is not None and accept:
        held = store.holds()  # this commit's chunks it holds, received now or before
        names = [ref.name for ref in node.chunks if ref.name in held]
        try:
            store.record(step, commit_id, sorted(set(names)), failed == 0)
        except OSError as exc:
            failed += 1
            log.warning("%s: cannot record the peer copy: %s", what, exc)
        if failed:
            warnings.append(f"{what}: {failed} chunk(s) of the peer copy were not held")
        elif mine:
            log.info("%s: holding %d chunk(s) of peer nodes", what, len(mine))
    return warnings


def _make_room(store: PeerStore, node: _Node, need: int, what: str) -> None:
    """(A receiver that accepted.) Drop the older copies first if the new one fits only
    without them (a budget of one copy). Never raises."""
    try:
        if not fits(need, store.room()):
            store.reclaim({ref.name for ref in node.chunks})
    except OSError as exc:
        log.warning("%s: cannot make room: %s", what, exc)


def holdable(ref: ChunkRef, data: bytes) -> bool:
    """Whether received ``data`` may be held as ``ref``: exactly its size and digest."""
    return _fanout.accept(ref, data)


def fits(need: int, room: int) -> bool:
    """Whether a copy of ``need`` bytes fits a receiver's ``room`` (``PeerStore.room``)."""
    return need <= room


def _round(comm: Comm, batch: Sequence[Transfer], node: _Node, store: PeerStore, what: str) -> int:
    """(A leader.) Its part of one round of a peer copy. Returns the chunks it was to
    hold and does not (wrong bytes, not sent, not written)."""
    failed = 0
    for t in batch:
        ref = node.chunks[t.index] if t.index < len(node.chunks) else None
        if t.sender == comm.rank:
            where = None if ref is None else node.local.get(ref.key)
            data = None if where is None or ref is None else read_at(where, ref.size)
            for r in t.receivers:
                _fanout.send_chunk(comm, None if data is None else _fanout.outgoing(data), r, what)
        elif comm.rank in t.receivers:
            data = _fanout.recv_chunk(comm, t.sender, what)
            if ref is None or data is None or not holdable(ref, data):
                failed += 1
                if data is not None:
                    log.warning(
                        "%s: chunk %d from rank %d does not match the manifest; not held",
                        what,
                        t.index,
                        t.sender,
                    )
                continue
            try:
                store.put(ref, data)
            except OSError as exc:
                failed += 1
                log.warning("%s: cannot hold chunk %d: %s", what, t.index, exc)
    return failed


# ------------------------------------------------------------------------------ restoring


class Holdings:
    """(A node's leader, in a restore.) The chunks it can send from local bytes: those of
    the files placed, verified, from its node's kept copies (``placed``: chunk key ->
    file and offset) and its peer copies (``store``). Unverified here: receivers verify."""

    def __init__(self, placed: Mapping[str, tuple[Path, int]], store: PeerStore | None) -> None:
        self.placed = dict(placed)
        self.store = store
        self._names = store.holds() if store is not None else set()

    def mask(self, chunks: Sequence[ChunkRef]) -> bytes:
        held = [
            i for i, ref in enumerate(chunks) if ref.key in self.placed or ref.name in self._names
        ]
        return _mask(held, len(chunks))

    def read(self, ref: ChunkRef) -> bytes | None:
        where = self.placed.get(ref.key)
        if where is not None:
            data = read_at(where, ref.size)
            if data is not None:
                return data
        return None if self.store is None else self.store.read(ref)
