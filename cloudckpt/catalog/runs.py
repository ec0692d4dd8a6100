"""``list_runs``: the runs under a prefix, each with its current step, what it stores and
what awaits GC (``cloudckpt runs``). Read-only."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from cloudckpt import attempt_layout, canonical, manifests, protocol
from cloudckpt.catalog.opening import Where, opened
from cloudckpt.errors import (
    ConfigurationError,
    CorruptionError,
    CorruptRecordError,
    ObjectNotFoundError,
    UnknownFormatError,
    UnsafePathError,
)
from cloudckpt.protocol import Latest
from cloudckpt.stores import ObjectInfo, Store
from cloudckpt.stores.base import INTERNAL_PREFIX


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """A run found under a prefix (``list_runs``).

    ``path``: where it lies below the prefix (``""``: the prefix itself is a run).
    ``status``: ``ok``; ``empty`` (claimed, nothing committed yet); ``needs-repair``
    (checkpoint data but LATEST missing or unreadable; ``problem`` says which);
    ``newer-format`` (a newer cloudckpt wrote its LATEST or a retained manifest: upgrade;
    ``problem`` says which version; only what it stores is known).
    ``step``, ``commit_id``, ``committed_at``, ``total_bytes``, ``num_files``: its current
    checkpoint (None without one). ``retained``: how many checkpoints it keeps.
    ``stored_bytes``/``stored_objects``: every object of the run (LATEST, ``ckpt/``,
    ``commits/``), whatever references it: what the store bills. ``unreferenced_bytes``:
    the part no retained checkpoint references, which GC deletes once it is older than
    the grace period (checkpoints retention dropped, orphan and interrupted attempts, and
    their chunks that no retained manifest names); ``unreferenced_attempts``: the attempt
    prefixes holding it. Both None when unknown (``needs-repair``, or a retained manifest
    could not be read). ``updated_at``: when LATEST was last written, on the store's
    clock; ``age_seconds``: how long ago, on the same clock. ``writer_epoch``: its
    writer's fencing epoch.
    """

    url: str
    path: str
    status: str
    step: int | None = None
    commit_id: str | None = None
    committed_at: str | None = None
    total_bytes: int | None = None
    num_files: int | None = None
    retained: int = 0
    stored_bytes: int | None = None
    stored_objects: int | None = None
    unreferenced_bytes: int | None = None
    unreferenced_attempts: int | None = None
    updated_at: str | None = None
    age_seconds: float | None = None
    writer_epoch: int | None = None
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: ``RunInfo.status`` of a run a newer cloudckpt wrote.
NEWER_FORMAT = "newer-format"

#: Directories a run holds that are its own data, not runs below it.
_RUN_DIRS = {attempt_layout.CKPT_PREFIX, protocol.COMMITS_PREFIX, INTERNAL_PREFIX}


def list_runs(
    where: Where, *, depth: int = 4, storage_options: Mapping[str, Any] | None = None
) -> list[RunInfo]:
    """The runs at and below the prefix ``where`` (at most ``depth`` directories down),
    sorted by path: one listing of each directory visited (a delimiter listing on S3, GCS
    and Azure); for each run one read of LATEST and one listing of its objects (what it
    stores), and, only where unreferenced attempts hold chunks, one read of each retained
    manifest (which of those chunks are still named). Read-only. A run a newer cloudckpt
    wrote is listed with status ``newer-format`` rather than failing the listing.

    Raises:
        ConfigurationError: ``depth`` is negative, or a bad URL.
        StoreError: the store failed (BucketNotFoundError: no such bucket).
    """
    if depth < 0:
        raise ConfigurationError(f"depth must be >= 0, got {depth}")
    with opened(where, storage_options) as store:
        now = store.now()
        found: list[RunInfo] = []
        _visit(store, "", depth, now, found)
    return sorted(found, key=lambda r: r.path)


def _visit(store: Store, prefix: str, depth: int, now: dt.datetime, found: list[RunInfo]) -> None:
    subdirs = store.list_dirs(prefix)
    has_latest = store.exists(prefix + protocol.LATEST_KEY)
    is_run = (
        has_latest or protocol.COMMITS_PREFIX in subdirs or _holds_attempts(store, prefix, subdirs)
    )
    if is_run:
        found.append(_describe(store, prefix, has_latest, now))
    if depth == 0:
        return
    for sub in subdirs:
        if is_run and sub in _RUN_DIRS:
            continue
        _visit(store, prefix + sub, depth - 1, now, found)


def _holds_attempts(store: Store, prefix: str, subdirs: Sequence[str]) -> bool:
    """Whether ``prefix`` holds ``ckpt/<attempt>/`` directories (a run that lost its
    LATEST), as opposed to a directory of the user's that happens to be called ckpt."""
    if attempt_layout.CKPT_PREFIX not in subdirs:
        return False
    inner = store.list_dirs(prefix + attempt_layout.CKPT_PREFIX)
    return any(attempt_layout.parse_ckpt_prefix(attempt_layout.CKPT_PREFIX + d) for d in inner)


def _describe(store: Store, prefix: str, has_latest: bool, now: dt.datetime) -> RunInfo:
    """One run: its LATEST read once (or why it cannot be), and what it stores."""
    url, path = store.url + prefix, prefix.rstrip("/")
    objects = _run_objects(store, prefix)
    stored: dict[str, Any] = {
        "stored_bytes": sum(o.size for o in objects),
        "stored_objects": len(objects),
    }
    if not has_latest:
        return RunInfo(
            url,
            path,
            "needs-repair",
            problem="checkpoint data but no LATEST (run `cloudckpt repair` on it)",
            **stored,
        )
    try:
        data, info = store.get(prefix + protocol.LATEST_KEY)
        latest = protocol.parse_latest(data)
    except ObjectNotFoundError:
        return RunInfo(url, path, "needs-repair", problem="LATEST vanished while listing", **stored)
    except CorruptRecordError as exc:
        problem = f"LATEST is unreadable: {exc.message}"
        return RunInfo(url, path, "needs-repair", problem=problem, **stored)
    except UnknownFormatError as exc:
        # Not damage and not this listing's failure: the other runs are still listed.
        return RunInfo(url, path, NEWER_FORMAT, problem=exc.message, **stored)
    updated = info.last_modified
    current = latest.current
    try:
        unreferenced = _unreferenced(store, prefix, latest, objects)
    except UnknownFormatError as exc:  # a retained manifest a newer version wrote
        return RunInfo(url, path, NEWER_FORMAT, problem=exc.message, **stored)
    return RunInfo(
        url,
        path,
        "ok" if current is not None else "empty",
        step=current.step if current else None,
        commit_id=current.commit_id if current else None,
        committed_at=current.committed_at if current else None,
        total_bytes=current.total_bytes if current else None,
        num_files=current.num_files if current else None,
        retained=len(latest.retained()),
        unreferenced_bytes=None if unreferenced is None else unreferenced[0],
        unreferenced_attempts=None if unreferenced is None else unreferenced[1],
        updated_at=canonical.iso(updated) if updated else None,
        age_seconds=max(0.0, (now - updated).total_seconds()) if updated else None,
        writer_epoch=latest.writer.epoch,
        **stored,
    )


def _run_objects(store: Store, prefix: str) -> list[ObjectInfo]:
    """Every object of the run at ``prefix``: LATEST, ``ckpt/``, ``commits/`` (keys
    relative to ``prefix``); not the runs or other objects that may lie below it."""
    found = [
        dataclasses.replace(o, key=o.key[len(prefix) :])
        for sub in (attempt_layout.CKPT_PREFIX, protocol.COMMITS_PREFIX)
        for o in store.list(prefix + sub)
    ]
    with contextlib.suppress(ObjectNotFoundError):
        found.append(dataclasses.replace(store.head(prefix + protocol.LATEST_KEY), key="LATEST"))
    return found


def _unreferenced(
    store: Store, prefix: str, latest: Latest, objects: Sequence[ObjectInfo]
) -> tuple[int, int] | None:
    """(bytes, attempt prefixes) of the run that no retained checkpoint references: every
    object of an attempt LATEST does not retain, except the chunks a retained manifest
    names (GC keeps those). The retained manifests are read only when such chunks exist;
    None if one cannot be read (what it names is unknown)."""
    retained = latest.retained()
    kept = {r.ckpt for r in retained}
    loose: dict[str, list[ObjectInfo]] = {}
    for o in objects:
        attempt = _attempt_prefix(o.key)
        if attempt is not None and attempt not in kept:
            loose.setdefault(attempt, []).append(o)
    named: set[str] = set()
    if any(attempt_layout.CHUNKS_DIR in o.key for group in loose.values() for o in group):
        for record in retained:
            try:
                data = store.get_range(prefix + record.manifest_key, 0, record.manifest_size + 1)
                manifest = manifests.parse_manifest(data, record)
            except (CorruptionError, UnsafePathError, ObjectNotFoundError):
                return None
            named.update(c.key for f in manifest.files for c in f.chunks or ())
    garbage = {a: [o for o in group if o.key not in named] for a, group in loose.items()}
    return (
        sum(o.size for group in garbage.values() for o in group),
        sum(1 for group in garbage.values() if group),
    )


def _attempt_prefix(key: str) -> str | None:
    """``ckpt/<attempt>/`` of a key below it, or None."""
    parts = key.split("/", 2)
    if len(parts) < 3 or parts[0] + "/" != attempt_layout.CKPT_PREFIX:
        return None
    attempt = f"{parts[0]}/{parts[1]}/"
    return attempt if attempt_layout.parse_ckpt_prefix(attempt) else None
