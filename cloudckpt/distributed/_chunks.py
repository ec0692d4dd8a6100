"""One rank's chunk index across its multi-rank saves (docs/design.md §11, "Chunks at N
ranks").

Which chunks a rank may name instead of uploading: those of the committed checkpoint the
save builds on. The coordinator says which one in the broadcast that opens the attempt
(``_save.Opened.base``: the current checkpoint of the LATEST it claimed or last wrote), so
every rank builds on the same checkpoint, the one the commit's checks then cover. A rank
that took part in that checkpoint's commit kept its own files' chunks (``committed``: no
request); any other rank (a new job, a save after a failed one of another base) reads that
checkpoint's manifest itself, one GET per rank, rather than receiving the coordinator's
index through the process group (a 1,024-rank job would broadcast every rank's chunk list
to every rank; a GET of the manifest costs each rank one request, once per job).

The rules are the single-host ones (``cloudckpt.chunks``): each rank reports the
checkpoints whose chunks it named (``UploadStats.sources``) and the coordinator's commit
requires them retained and lists every reused chunk before the manifest is written
(``AttemptWriter.finish``). If reused chunks turn out missing, or a source left retention,
every rank saves again under a new attempt, once (``Reupload``): without those chunks, or
without any. Chunks interrupted attempts uploaded are not resumed by multi-rank saves (the
ranks' managers abandon what a crash left: see the package docstring).

Cross-rank dedup (docs/design.md §11, "One upload per chunk across ranks"). Every rank of
a save uploads into one attempt prefix, where a chunk's key is its name: ranks that hold
the same bytes (data-parallel replicas, replicated tensors) would put the same objects.
Before the save's first round each rank names its chunks (``chunk_names``: one read and
one hash of each byte, block by block while in cache) and sends them, with those its kept
index can name (``RankChunks.reusable``), in its plan; the coordinator picks one owner
for every chunk several ranks hold and some cannot reuse (``owners``: the lowest such
rank) and sends the choice in the broadcast that opens the attempt. An owner puts its
chunks even if its index holds them; the other holders name them under the attempt's
prefix without a put. Nothing else is trusted: the commit's listing
(``chunks.check_uploaded``) confirms every named chunk is stored whole, so an owner that
failed to put one means no commit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from cloudckpt import digest
from cloudckpt.chunks import LEAF, ChunkIndex, ChunkingMode, plan
from cloudckpt.errors import CloudCkptError, StagingError, UnknownFormatError
from cloudckpt.manifests import ChunkRef, FileEntry
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.reader import fetch_manifest
from cloudckpt.stores import Store
from cloudckpt.transfer import TransferEngine

log = logging.getLogger("cloudckpt.distributed")


@dataclasses.dataclass(frozen=True)
class Reupload:
    """The coordinator's commit refused reused chunks: ``missing`` (their names) are gone
    from the store, or (``missing`` None) a checkpoint they came from left retention.
    Every rank saves again, once, under a new attempt, without those chunks (or any)."""

    reason: str
    missing: frozenset[str] | None


class RankChunks:
    """The chunk index of one rank's saves (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._kept: tuple[str, ChunkIndex] | None = None  # (commit id, its chunks)

    def index(self, base: CheckpointRecord | None, again: Reupload | None) -> ChunkIndex:
        """The chunks a save building on ``base`` may name (none without a base); on the
        retry ``again`` asks for, less the missing ones (which later saves must not name
        either), or none.

        Raises: UnknownFormatError (``base`` was written by a newer cloudckpt).
        """
        if base is None or (again is not None and again.missing is None):
            return ChunkIndex()
        if self._kept is None or self._kept[0] != base.commit_id:
            self._kept = (base.commit_id, self._load(base))
        if again is not None:
            assert again.missing is not None
            self._kept = (base.commit_id, self._kept[1].without(again.missing))
        return self._kept[1]

    def reusable(self, names: frozenset[str], again: Reupload | None) -> Reusable:
        """Which of ``names`` (this rank's chunks) the index this rank keeps names
        (``index`` with the same ``again``), and the checkpoint it was kept from: they
        are reusable only if the save builds on that one (``owners`` checks)."""
        if self._kept is None or (again is not None and again.missing is None):
            return Reusable(None, frozenset())
        commit_id, kept = self._kept
        gone = again.missing if again is not None and again.missing is not None else frozenset()
        return Reusable(commit_id, frozenset(n for n in names - gone if kept.has(n)))

    def committed(self, commit_id: str, entries: tuple[FileEntry, ...]) -> None:
        """This rank's ``entries`` were committed as ``commit_id``: the next save builds on
        them."""
        self._kept = (commit_id, ChunkIndex.of_files(entries, commit_id))

    def _load(self, base: CheckpointRecord) -> ChunkIndex:
        """The chunks of ``base``'s manifest (one GET); an unreadable one means an empty
        index (everything is uploaded), as for one host."""
        try:
            return ChunkIndex.of(fetch_manifest(self.store, base))
        except UnknownFormatError:
            raise  # a newer version's checkpoint: no save over it
        except CloudCkptError as exc:
            log.warning("cannot read the manifest of %s (%s); uploading in full", base.ckpt, exc)
            return ChunkIndex()


# ------------------------------------------------------------------------------ dedup


@dataclasses.dataclass(frozen=True)
class Reusable:
    """What a rank's plan says its kept index names: ``names`` of its chunks, valid only
    for a save that builds on ``kept`` (a commit id; None: no index kept)."""

    kept: str | None
    names: frozenset[str]


def chunk_names(
    engine: TransferEngine, files: Sequence[tuple[str, Path]], mode: ChunkingMode
) -> frozenset[str]:
    """The names of every chunk of ``files`` (path in the checkpoint, staged file) as
    ``chunks.upload_chunked`` will cut and name them: the same spans (one per leaf), read
    the same way (``TransferEngine.reading_hashed``: into a reused page-aligned buffer 1 MiB
    at a time, each block hashed into the chunk it lies in while in cache), on the transfer
    workers. Only the chunks' digests, no leaf digest and no CRC32C
    (``digest.pieces_as_read``): each byte is read once and hashed once.

    Raises StagingError (a file unreadable).
    """
    algorithm = digest.check(None)

    def span(source: Path, offset: int, pieces: list[tuple[int, int]]) -> list[str]:
        sizes = [n for _, n in pieces]
        with engine.reading_hashed(
            source,
            offset,
            sum(sizes),
            lambda view, read: digest.pieces_as_read(view, read, sizes, algorithm),
        ) as (_, digests):
            names = zip(digests, sizes, strict=True)
            return [ChunkRef("", d.hex(), n, algorithm).name for d, n in names]

    futures = []
    for rel, source in files:
        try:
            size = source.stat().st_size
        except OSError as exc:
            raise StagingError(f"cannot read staged file {source}: {exc.strerror}") from None
        spans: dict[int, list[tuple[int, int]]] = {}
        for off, n in plan(source, size, mode, name=rel.rsplit("/", 1)[-1]):
            spans.setdefault(off // LEAF * LEAF, []).append((off, n))
        futures += [engine.submit(span, source, at, p) for at, p in sorted(spans.items())]
    return frozenset(n for names in engine.wait_all(futures) for n in names)


def owners(
    held: Sequence[frozenset[str]], reusable: Sequence[Reusable], base: str | None
) -> dict[str, int]:
    """Coordinator: chunk name -> the rank that puts it, for every chunk several ranks
    hold (``held[r]``: rank ``r``'s chunk names) and at least one of them cannot name
    from its index (``reusable``, valid where kept from ``base``, the commit id the save
    builds on): the lowest rank among those that cannot. Deterministic: the same plans
    give the same owners, whatever order they arrived in."""
    can = [r.names if base is not None and r.kept == base else frozenset() for r in reusable]
    holders: dict[str, list[int]] = {}
    for rank, names in enumerate(held):
        for name in names:
            holders.setdefault(name, []).append(rank)
    chosen: dict[str, int] = {}
    for name, ranks in holders.items():
        if len(ranks) < 2:
            continue
        uploading = [r for r in ranks if name not in can[r]]
        if uploading:
            chosen[name] = min(uploading)
    return chosen


def split_owned(chosen: Mapping[str, int], rank: int) -> tuple[frozenset[str], frozenset[str]]:
    """(the chunks other ranks put for ``rank``, the chunks ``rank`` puts for others)."""
    elsewhere = frozenset(n for n, o in chosen.items() if o != rank)
    owed = frozenset(n for n, o in chosen.items() if o == rank)
    return elsewhere, owed
