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
"""

from __future__ import annotations

import dataclasses
import logging

from cloudckpt.chunks import ChunkIndex
from cloudckpt.errors import CloudCkptError, UnknownFormatError
from cloudckpt.manifests import FileEntry
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.reader import fetch_manifest
from cloudckpt.stores import Store

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
