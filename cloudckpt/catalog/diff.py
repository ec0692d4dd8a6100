"""``diff_checkpoints``: which files and chunks changed between two retained checkpoints
of a run, from their manifests alone (``cloudckpt diff``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from cloudckpt import reader
from cloudckpt.catalog.opening import Where, opened
from cloudckpt.errors import CheckpointNotFoundError, CorruptionError, step_not_retained
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import CheckpointRecord, Latest
from cloudckpt.stores import Store


@dataclasses.dataclass(frozen=True)
class FileChange:
    """One path of a ``CheckpointDiff``: ``change`` is ``added``, ``removed``,
    ``modified`` (other bytes), ``mode`` (same bytes, other permission bits) or
    ``unchanged``. ``new_chunks``/``new_bytes``: chunks of the file in ``b`` that ``a``
    holds nowhere (by content), what a copy or save of ``b`` after ``a`` sends for it; None
    when ``b`` stores the file whole."""

    path: str
    change: str
    size_a: int | None
    size_b: int | None
    digest_a: str | None
    digest_b: str | None
    mode_a: int | None = None
    mode_b: int | None = None
    new_chunks: int | None = None
    new_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointDiff:
    """How checkpoint ``b`` differs from ``a`` (``diff_checkpoints``). ``files``: every
    path of either, sorted. ``chunks_only_in_a``/``_b``, ``bytes_only_in_a``/``_b``,
    ``shared_chunks``/``shared_bytes``: distinct chunks by content (SHA-256), over the
    files each stores as chunks."""

    url: str
    a: CheckpointRecord
    b: CheckpointRecord
    files: tuple[FileChange, ...]
    chunks_only_in_a: int
    chunks_only_in_b: int
    bytes_only_in_a: int
    bytes_only_in_b: int
    shared_chunks: int
    shared_bytes: int

    def count(self, change: str) -> int:
        return sum(1 for f in self.files if f.change == change)


def diff_checkpoints(
    where: Where,
    step_a: int | str,
    step_b: int | str,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointDiff:
    """Compare the retained checkpoints of steps ``step_a`` and ``step_b`` (the newest of
    each; a ``str`` is a commit id instead, for a step committed more than once): their
    manifests only, each checked against LATEST's record; no data is read.

    Raises:
        CheckpointNotFoundError: a step (or commit id) is not retained (the message lists
            those that are).
        CorruptionError: a manifest is missing or damaged (or LATEST, with no commit record
            that verifies); UnsafePathError: a hostile manifest.
        StoreError: the store failed.
    """
    with opened(where, storage_options) as store:
        latest = _latest_for_reading(store)
        a, b = (_retained_step(store.url, latest, s) for s in (step_a, step_b))
        ma, mb = reader.fetch_manifest(store, a), reader.fetch_manifest(store, b)
        url = store.url
    return _diff(url, a, b, ma, mb)


def _latest_for_reading(store: Store) -> Latest:
    latest, from_records = reader.load_latest_for_reading(store)
    if latest is None:
        if from_records:
            raise CorruptionError(
                f"LATEST of {store.url} is unreadable and no commit record verifies"
            )
        raise CheckpointNotFoundError(f"{store.url} has no committed checkpoint")
    return latest


def _retained_step(url: str, latest: Latest, step: int | str) -> CheckpointRecord:
    """The newest retained checkpoint of ``step``, or the one whose commit id it is (a
    ``str``). Raises CheckpointNotFoundError."""
    for record in latest.retained():
        if record.commit_id == step if isinstance(step, str) else record.step == step:
            return record
    if isinstance(step, str):
        ids = ", ".join(f"{r.step}: {r.commit_id}" for r in latest.retained()) or "none"
        raise CheckpointNotFoundError(
            f"{url} retains no checkpoint with commit id {step!r}",
            hint=f"Retained commits (step: commit id): {ids} (`cloudckpt ls URL --json`)",
        )
    raise step_not_retained(url, step, (r.step for r in latest.retained()))


def _chunk_sizes(manifest: Manifest) -> dict[str, int]:
    return {c.name: c.size for f in manifest.files for c in f.chunks or ()}


def _file_change(
    path: str, fa: FileEntry | None, fb: FileEntry | None, in_a: set[str]
) -> FileChange:
    if fa is None:
        change = "added"
    elif fb is None:
        change = "removed"
    elif (fa.size, fa.digest) != (fb.size, fb.digest):
        change = "modified"
    elif fa.mode is not None and fb.mode is not None and fa.mode != fb.mode:
        change = "mode"
    else:
        change = "unchanged"
    new = None
    if fb is not None and fb.chunks is not None:
        fresh = {c.name: c.size for c in fb.chunks if c.name not in in_a}
        new = (len(fresh), sum(fresh.values()))
    return FileChange(
        path,
        change,
        fa.size if fa else None,
        fb.size if fb else None,
        fa.digest if fa else None,
        fb.digest if fb else None,
        fa.mode if fa else None,
        fb.mode if fb else None,
        new[0] if new else None,
        new[1] if new else None,
    )


def _diff(
    url: str, a: CheckpointRecord, b: CheckpointRecord, ma: Manifest, mb: Manifest
) -> CheckpointDiff:
    files_a = {f.path: f for f in ma.files}
    files_b = {f.path: f for f in mb.files}
    ca, cb = _chunk_sizes(ma), _chunk_sizes(mb)
    changes = tuple(
        _file_change(p, files_a.get(p), files_b.get(p), set(ca))
        for p in sorted({*files_a, *files_b})
    )
    only_a = {s: n for s, n in ca.items() if s not in cb}
    only_b = {s: n for s, n in cb.items() if s not in ca}
    shared = {s: n for s, n in cb.items() if s in ca}
    return CheckpointDiff(
        url,
        a,
        b,
        changes,
        chunks_only_in_a=len(only_a),
        chunks_only_in_b=len(only_b),
        bytes_only_in_a=sum(only_a.values()),
        bytes_only_in_b=sum(only_b.values()),
        shared_chunks=len(shared),
        shared_bytes=sum(shared.values()),
    )
