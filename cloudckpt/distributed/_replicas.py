"""Replica agreement: data-parallel replicas must save the same bytes (docs/design.md §11,
"Replica agreement").

The manager learns which ranks are replicas from ``replica_groups`` (a file name cannot
tell: FSDP shards and DP replicas both save ``rank-<r>/model.pt``). Ranks of one group
save the same files under their own ``rank-<r>/`` directories. Before the commit the
coordinator compares the entries every rank reported (size and digest tree root, which
each rank computed while uploading: the comparison costs no hashing and no extra
collective); any difference, or a file one replica saved and another did not, is no
commit and a ``ReplicaDivergedError`` naming the ranks, the files and where they first
differ. Silent data corruption on one device (a bit flip in a weight or in the
optimizer state) otherwise reaches the checkpoint unnoticed, and every later run resumes
from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from cloudckpt.errors import ConfigurationError, ReplicaDivergedError
from cloudckpt.manifests import FileEntry
from cloudckpt.reader import matches

#: At most this many differences are listed in the error (the count is always given).
SHOWN = 5

Groups = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class Replicas:
    """Which ranks are replicas (``groups``), and the files (glob patterns of paths inside
    ``rank-<r>/``, ``exclude``) they may hold differently: per-rank RNG states, data-loader
    positions."""

    groups: Groups = ()
    exclude: tuple[str, ...] = ()


def check_groups(groups: Iterable[Iterable[int]] | None, world: int) -> Groups:
    """``groups`` as sorted tuples of ranks (in the manager's group), each of at least two
    ranks, none in two groups. Raises ConfigurationError."""
    if groups is None:
        return ()
    try:
        out = tuple(tuple(sorted(int(r) for r in g)) for g in groups)
    except (TypeError, ValueError):
        raise ConfigurationError(
            "replica_groups must be lists of ranks, e.g. [[0, 2], [1, 3]]"
        ) from None
    seen: set[int] = set()
    for group in out:
        if len(group) < 2 or len(set(group)) != len(group):
            raise ConfigurationError(f"replica group {list(group)} needs two or more ranks")
        bad = [r for r in group if not 0 <= r < world]
        if bad:
            raise ConfigurationError(f"replica_groups name ranks {bad} outside 0..{world - 1}")
        if seen & set(group):
            raise ConfigurationError(f"ranks {sorted(seen & set(group))} are in two replica groups")
        seen |= set(group)
    return tuple(sorted(out))


def _relative(path: str) -> str:
    """A path inside its rank's ``rank-<r>/`` directory."""
    return path.split("/", 1)[1] if "/" in path else path


def _first_difference(a: FileEntry, b: FileEntry) -> str:
    """Where two entries of one file first differ, in words."""
    if a.size != b.size:
        return f"{a.size} vs {b.size} bytes"
    offset = 0
    for ca, cb in zip(a.chunks or (), b.chunks or (), strict=False):
        if ca.name != cb.name or ca.size != cb.size:
            return f"first differing chunk at byte {offset} ({ca.size} bytes)"
        offset += ca.size
    return "same size, different digest"


def divergence(
    groups: Groups, entries: Sequence[Sequence[FileEntry]], exclude: Sequence[str] = ()
) -> list[str]:
    """Coordinator: every difference between the files the ranks of each group saved
    (``entries[r]``: rank ``r``'s, paths under its ``rank-<r>/``; those matching an
    ``exclude`` pattern left out), compared with the group's lowest rank; [] when the
    replicas agree."""

    def compared(rank: int) -> dict[str, FileEntry]:
        out = {_relative(e.path): e for e in entries[rank]}
        return {p: e for p, e in out.items() if not any(matches(p, x) for x in exclude)}

    problems: list[str] = []
    for group in groups:
        lead = group[0]
        want = compared(lead)
        for rank in group[1:]:
            got = compared(rank)
            for rel in sorted(want.keys() | got.keys()):
                a, b = want.get(rel), got.get(rel)
                if a is None or b is None:
                    has, lacks = (lead, rank) if b is None else (rank, lead)
                    problems.append(f"rank {has} saved {rel!r}, its replica rank {lacks} did not")
                elif (a.size, a.digest, a.algorithm) != (b.size, b.digest, b.algorithm):
                    problems.append(
                        f"ranks {lead} and {rank} differ in {rel!r}: {_first_difference(a, b)}"
                    )
    return problems


def check_agreement(replicas: Replicas, entries: Sequence[Sequence[FileEntry]], step: int) -> None:
    """Coordinator, before the commit. Raises ReplicaDivergedError listing the
    differences (``divergence``)."""
    problems = divergence(replicas.groups, entries, replicas.exclude)
    if problems:
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise ReplicaDivergedError(
            f"the checkpoint of step {step} was not committed: data-parallel replicas "
            f"disagree in {len(problems)} place(s): " + "; ".join(problems[:SHOWN]) + more
        )
