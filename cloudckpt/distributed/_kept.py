"""Local copies at N ranks: each rank keeps its files of a committed checkpoint, and a
restart on the same host restores from them (docs/design.md §5.3, "Local copies at N
ranks"; the single-host tier is ``cloudckpt.localcopy``).

Saving (``keep``, every rank, after the commit every rank learned of): the rank's staged
files move, by one ``rename``, into its own staging directory's local tier
(``<staging_dir>/rank-<r>/committed/<step>-<commit id>/``), with the single-host retention
(``keep_local``, ``local_budget_bytes``). Each node's leader also keeps the committed
manifest beside its files: the bytes the coordinator wrote, sent with the commit's
outcome (``_save.Committed.manifest``, checked there against the SHA-256 and size LATEST
records), so no leader reads it back from the store; the other ranks keep none.

Restoring (``NodeCopies``, on the node's leader, which downloads for the node): the copies
of the node's ranks whose ``copy.json`` names the checkpoint to restore are candidates,
and nothing about them is trusted, as on one host:

1. the manifest used is a kept ``MANIFEST.json`` only if it has exactly the SHA-256 and
   size that LATEST (read fresh by the coordinator) records; else it is read from the
   store;
2. each file is placed from the copy of the rank that wrote it (reflinked or copied, so
   the restored file is independent of the copy; hard-linked only with ``link_local``),
   then every byte of what was placed is checked against that manifest (``verified``);
3. what is missing, or does not verify, is read from the store like any download.

So a rank whose copy is missing, of another step (another commit id: it is not looked
at), or damaged costs only the download of what it lacks.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from cloudckpt import fetch
from cloudckpt.attempts import CommitInfo
from cloudckpt.localcopy import LocalCopies, LocalCopy, place_file
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.staging import COMMITTED, Attempt
from cloudckpt.transfer import TransferEngine

log = logging.getLogger("cloudckpt.distributed")

#: A path inside a rank's directory of a checkpoint saved with per-rank directories.
RANK_DIR = re.compile(r"^rank-(\d{5,})/")


def keep(
    attempt: Attempt,
    info: CommitInfo,
    local: LocalCopies,
    manifest: bytes | None,
) -> None:
    """(Every rank, once ``info`` is committed.) Keep ``attempt``'s staged files as this
    rank's local copy; ``manifest``: the committed manifest's bytes, kept beside them on
    the node leader (None on the other ranks, or if the coordinator could not vouch for
    them: a restore then reads it from the store). A kept manifest is used only if it has
    the SHA-256 and size LATEST records (``LocalCopy.manifest``). Raises StagingError (the
    journal's write failed: the caller removes the attempt); nothing else."""
    attempt.set_state(COMMITTED)
    local.adopt(attempt, info.commit_id, manifest if local.keep > 0 else None)


class NodeCopies:
    """The kept copies of the ranks of one node, as its leader reads them (module
    docstring). ``tiers``: rank -> that rank's local tier (ranks that keep copies)."""

    def __init__(self, tiers: Mapping[int, LocalCopies], per_rank_dirs: bool) -> None:
        self.tiers = dict(tiers)
        self.per_rank_dirs = per_rank_dirs

    def find(self, record: CheckpointRecord) -> dict[int, LocalCopy]:
        """Each rank's copy kept under ``record``'s commit id (unproven)."""
        found = {}
        for rank, tier in sorted(self.tiers.items()):
            copy = tier.find(record)
            if copy is not None and copy.commit_id == record.commit_id:
                found[rank] = copy
        return found

    @staticmethod
    def manifest(copies: Mapping[int, LocalCopy], record: CheckpointRecord) -> Manifest | None:
        """A kept manifest that is exactly the one ``record`` names, or None."""
        for copy in copies.values():
            manifest = copy.manifest(record)
            if manifest is not None:
                return manifest
        return None

    def source(self, copies: Mapping[int, LocalCopy], path: str) -> Path | None:
        """Where the checkpoint file ``path`` (a validated manifest path) would be in
        the copy of the rank that wrote it, or None."""
        if self.per_rank_dirs:
            m = RANK_DIR.match(path)
            copy = None if m is None else copies.get(int(m.group(1)))
            return None if copy is None or m is None else copy.file(path[m.end() :])
        for copy in copies.values():  # user paths: no two ranks write one (checked at save)
            candidate = copy.file(path)
            if os.path.lexists(candidate):
                return candidate
        return None

    def place(
        self,
        engine: TransferEngine,
        copies: Mapping[int, LocalCopy],
        entries: Sequence[FileEntry],
        tmp: Path,
        chunk_size: int,
        link: bool = False,
    ) -> tuple[list[FileEntry], int]:
        """Place the kept files of ``entries`` that verify in the new directory ``tmp``.
        Returns the entries still to download and the bytes taken from the copies.
        Raises OSError writing into ``tmp``."""
        if not copies:
            return list(entries), 0
        placed: list[Path | None] = []
        for entry in entries:
            source = self.source(copies, entry.path)
            target = tmp.joinpath(*entry.path.split("/"))
            if source is not None:
                target.parent.mkdir(parents=True, exist_ok=True)
                # Place first, then verify what was placed: what is checked is exactly
                # what the restore keeps, whatever happens to the copy meanwhile.
                if place_file(source, target, link=link) is None:
                    source = None
            placed.append(None if source is None else target)
        jobs = [fetch.FileJob(e, local=t) for e, t in zip(entries, placed, strict=True)]
        rest, taken = [], 0
        oks = verified(engine, jobs, chunk_size)
        for entry, at, ok in zip(entries, placed, oks, strict=True):
            if ok:
                taken += entry.size
                continue
            rest.append(entry)
            if at is not None:
                at.unlink()  # downloaded in its place
        if rest:
            log.warning(
                "%d of %d file(s) of this node's kept copies are missing or do not verify; "
                "downloading them",
                len(rest),
                len(entries),
            )
        return rest, taken


def verified(engine: TransferEngine, jobs: Sequence[fetch.FileJob], chunk_size: int) -> list[bool]:
    """For each job, whether its placed file (``local``) is exactly its manifest entry."""
    return fetch.verify_local(engine, jobs, leaf_size=chunk_size)


def node_tiers(
    local_ranks: Sequence[int], roots: Sequence[tuple[str, int] | None], rank: int, own: LocalCopies
) -> dict[int, LocalCopies]:
    """The local tiers of this node's ranks that keep copies (``roots``: each rank's
    staging root and ``keep_local``, None where it keeps none); this rank's own is
    ``own``."""
    tiers: dict[int, LocalCopies] = {}
    for r in local_ranks:
        if r == rank:
            if own.keep > 0:
                tiers[r] = own
        elif roots[r] is not None:
            root, keep_local = roots[r]  # type: ignore[misc]
            tiers[r] = LocalCopies(Path(root), keep_local, None)
    return tiers
