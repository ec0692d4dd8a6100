"""Which checkpoints of a run may be read, newest first, and the first intact one.

Every reader of a run starts here: ``restore``, ``verify``, the multi-rank restore
(``cloudckpt.distributed``), the DCP reader, and GC's protection of chunks
(``chunks.protected_chunk_keys``).

- ``load_latest_for_reading``: LATEST, or, when it is missing or damaged, the newest commit
  record that verifies (loudly);
- ``readable`` / ``to_try`` / ``candidates``: the retained checkpoints to try, newest first
  (only those of ``step`` when one is asked for);
- ``fetch_manifest``: a checkpoint's manifest, checked against the size and SHA-256 that
  LATEST recorded; ``check_objects``: every object it names exists with its recorded size
  (one listing per prefix, no data read);
- ``select_files``: which files of a checkpoint a partial read takes (``include`` /
  ``exclude`` glob patterns: ``restore --include``, ``get`` with several files);
- ``first_intact``: try each checkpoint in turn until one is intact, reporting every one
  skipped (``SkippedCheckpoint``). A checkpoint found missing may not be damaged at all:
  retention may have dropped it, and GC collected it, while a slow restore read it.
  ``reread_if_dropped`` reads LATEST again; if it no longer retains the checkpoint, the
  restore goes on with the checkpoints retained now (at most ``MAX_LATEST_REREADS``
  times), and the checkpoint is reported ``dropped``, not damaged.

Network failures are not damage: they raise, so a blip never makes a reader fall back to
an older checkpoint.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from cloudckpt import attempt_layout, manifests, protocol
from cloudckpt.committer import read_latest
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    ConfigurationError,
    CorruptionError,
    CorruptRecordError,
    MissingChunkError,
    ObjectNotFoundError,
    UnsafePathError,
    step_not_retained,
)
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import CheckpointRecord, Latest
from cloudckpt.retry import call_with_retries
from cloudckpt.stores import Store

log = logging.getLogger("cloudckpt.restore")

T = TypeVar("T")

#: How many times one restore reads LATEST again after the checkpoint it was reading was
#: dropped and collected under it; each time needs a whole grace period to pass meanwhile.
MAX_LATEST_REREADS = 3


@dataclasses.dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint a restore could not use, and why. ``dropped``: not damage: retention
    dropped it (and GC collected its data) while the restore read it, so the restore read
    LATEST again and went on with the checkpoints retained now."""

    step: int
    commit_id: str
    reason: str
    dropped: bool = False


# --------------------------------------------------------------------------- LATEST


def load_latest_for_reading(store: Store) -> tuple[Latest | None, bool]:
    """LATEST for a reader, or, when it is missing or corrupt, the newest commit record
    that verifies (loudly). Returns (latest or None, whether commit records were used)."""
    try:
        current = read_latest(store)
    except CorruptRecordError as exc:
        current = None
        problem: str | None = f"LATEST of {store.url} is unreadable ({exc})"
    else:
        problem = None
    if current is not None:
        return current.latest, False
    records = sorted(store.list(protocol.COMMITS_PREFIX), key=lambda o: o.key, reverse=True)
    for obj in records:
        try:
            data, _ = store.get(obj.key)
            latest = protocol.parse_latest(data, what=obj.key)
        except (CorruptRecordError, ObjectNotFoundError) as exc:
            log.warning("skipping commit record %s: %s", obj.key, exc)
            continue
        # One warning for the one event, whoever reads (a CLI command adds none of its own).
        log.warning(
            "%s; reading the newest commit record that verifies instead (%s, seq %d). Run "
            "`cloudckpt repair URL` before writing to this run",
            problem or f"{store.url} has no LATEST",
            obj.key,
            latest.seq,
        )
        return latest, True
    if problem is not None:
        log.warning("%s, and no commit record verifies", problem)
    return None, bool(records) or problem is not None


def candidates(latest: Latest, step: int | None) -> list[CheckpointRecord]:
    """Checkpoints to try, newest first (only those of ``step`` when it is given)."""
    retained = latest.retained()
    if step is None:
        return retained
    return [r for r in retained if r.step == step]


def to_try(url: str, latest: Latest, step: int | None) -> list[CheckpointRecord]:
    """``candidates``, which must not be empty. Raises CheckpointNotFoundError."""
    todo = candidates(latest, step)
    if not todo and step is not None:
        raise step_not_retained(url, step, (r.step for r in latest.retained()))
    if not todo:
        raise CheckpointNotFoundError(f"{url} has no committed checkpoint")
    return todo


def readable(store: Store, step: int | None) -> tuple[list[CheckpointRecord], bool]:
    """The checkpoints a restore tries, newest first (only those of ``step`` when it is
    given), and whether they come from the commit records (LATEST missing or unreadable).

    Raises:
        CorruptionError: LATEST is unreadable and no commit record verifies.
        CheckpointNotFoundError: nothing is committed, or no retained checkpoint has
            ``step``.
        StoreError: the store failed.
    """
    _, todo, from_records = readable_latest(store, step)
    return todo, from_records


def readable_latest(store: Store, step: int | None) -> tuple[Latest, list[CheckpointRecord], bool]:
    """``readable``, with the LATEST (or commit record) its checkpoints come from.

    Raises: as ``readable``.
    """
    latest, from_records = load_latest_for_reading(store)
    if latest is None:
        if from_records:
            raise CorruptionError(
                f"LATEST of {store.url} is unreadable and no commit record verifies"
            )
        raise CheckpointNotFoundError(f"{store.url} has no committed checkpoint")
    return latest, to_try(store.url, latest, step), from_records


# --------------------------------------------------------------------------- which files


def check_patterns(patterns: Sequence[str] | None, what: str) -> tuple[str, ...]:
    """``patterns`` (None: none) as a tuple. Raises ConfigurationError (an empty one, or
    a lone string where a list belongs: ``include="*.json"`` would be one pattern per
    character)."""
    if patterns is None:
        return ()
    if isinstance(patterns, (str, bytes)):
        raise ConfigurationError(
            f"{what} must be a list of patterns, not the string {patterns!r}",
            hint=f"{what}=[{patterns!r}]",
        )
    out = tuple(patterns)
    for p in out:
        if not isinstance(p, str) or not p:
            raise ConfigurationError(f"{what}: {p!r} is not a path or glob pattern")
    return out


def matches(path: str, pattern: str) -> bool:
    """Whether a checkpoint file's ``path`` matches ``pattern``: the path itself, a glob
    (``fnmatch``, case-sensitive: ``*`` and ``?`` match ``/`` too, so ``*.safetensors``
    matches in every directory, as ``hf download --include`` and ``aws s3 --include``
    do), or, ending in ``/``, a directory (everything below it; ``*/tokenizer/`` too)."""
    if pattern.endswith("/"):
        return path.startswith(pattern) or fnmatch.fnmatchcase(path, pattern + "*")
    return path == pattern or fnmatch.fnmatchcase(path, pattern)


def selected(path: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """Whether ``path`` matches an ``include`` pattern (any path, when there is none) and
    no ``exclude`` pattern (``matches``)."""
    if include and not any(matches(path, p) for p in include):
        return False
    return not any(matches(path, p) for p in exclude)


def select_files(
    files: Sequence[FileEntry], include: Sequence[str], exclude: Sequence[str]
) -> tuple[list[FileEntry], list[FileEntry]]:
    """(selected, left out): the files ``selected`` keeps, and the others, in manifest
    order."""
    chosen: list[FileEntry] = []
    left: list[FileEntry] = []
    for entry in files:
        (chosen if selected(entry.path, include, exclude) else left).append(entry)
    return chosen, left


# --------------------------------------------------------------------------- one checkpoint


def fetch_manifest(store: Store, record: CheckpointRecord) -> Manifest:
    """The manifest ``record`` names, verified against the recorded size and digest.

    Raises CorruptionError (missing, damaged) or UnsafePathError (hostile paths).
    """
    try:
        # Ask for one byte more than recorded: a longer object is damage, and a hostile
        # multi-gigabyte "manifest" is never read whole.
        data = call_with_retries(
            lambda: store.get_range(record.manifest_key, 0, record.manifest_size + 1),
            what="read manifest",
        )
    except ObjectNotFoundError:
        raise CorruptionError(f"the manifest of step {record.step} is missing") from None
    return manifests.parse_manifest(data, record)


def check_objects(store: Store, record: CheckpointRecord, manifest: Manifest) -> None:
    """Every file of ``manifest`` exists with its recorded size (one listing, no data).

    Raises CorruptionError naming the first missing or resized file (MissingChunkError
    for a chunk).
    """
    if manifest.chunked:
        check_chunk_objects(store, manifest, record.step)
    plain = [e for e in manifest.files if e.chunks is None]
    if not plain:
        return
    prefix = record.ckpt + attempt_layout.FILES_DIR
    sizes = {o.key[len(prefix) :]: o.size for o in store.list(prefix)}
    for entry in plain:
        size = sizes.get(entry.path)
        if size is None:
            raise CorruptionError(f"{entry.path} of step {record.step} is missing")
        if size != entry.size:
            raise CorruptionError(
                f"{entry.path} of step {record.step} is {size} bytes, manifest says {entry.size}"
            )


def check_chunk_objects(store: Store, manifest: Manifest, step: int) -> None:
    """One listing per owner prefix: every chunk exists with its size.
    Raises MissingChunkError."""
    sizes: dict[str, int] = {}
    owners = {c.owner for f in manifest.files for c in f.chunks or ()}
    for owner in sorted(owners):
        where = owner + attempt_layout.CHUNKS_DIR
        for o in store.list(where):
            sizes[o.key] = o.size
    for f in manifest.files:
        for c in f.chunks or ():
            got = sizes.get(c.key)
            if got is None:
                raise MissingChunkError(f"chunk {c.key} of {f.path} (step {step}) is missing")
            if got != c.size:
                raise MissingChunkError(
                    f"chunk {c.key} of {f.path} (step {step}) is {got} bytes, expected {c.size}"
                )


# --------------------------------------------------------------------------- the fallback


@dataclasses.dataclass(frozen=True)
class Damaged:
    """What ``first_intact``'s ``try_one`` returns for a checkpoint it cannot use: why.
    ``may_be_dropped``: it may be missing because GC collected it under the reader, so
    LATEST is read again (not so for hostile paths, which no collection explains)."""

    reason: str
    may_be_dropped: bool = True

    @classmethod
    def of(cls, exc: CorruptionError | UnsafePathError) -> Damaged:
        return cls(exc.message, isinstance(exc, CorruptionError))


@dataclasses.dataclass(frozen=True)
class Intact(Generic[T]):
    """The checkpoint ``first_intact`` settled on: its record, what ``try_one`` returned,
    the checkpoints skipped before it, and whether the records came from the commit
    records."""

    record: CheckpointRecord
    value: T
    skipped: tuple[SkippedCheckpoint, ...]
    from_records: bool


#: ``reread(record, tried, rereads)``: the checkpoints to try after ``record`` turned out
#: damaged or missing, if it was dropped meanwhile (see ``reread_if_dropped``), else None.
Reread = Callable[[CheckpointRecord, set[str], int], tuple[list[CheckpointRecord], bool] | None]


def first_intact(
    store: Store,
    todo: Sequence[CheckpointRecord],
    step: int | None,
    try_one: Callable[[CheckpointRecord], T | Damaged],
    *,
    from_records: bool = False,
    reread: Reread | None = None,
) -> Intact[T]:
    """Try ``todo`` in order with ``try_one`` (which returns its value, or ``Damaged``)
    until one is intact. After a damaged one, ``reread`` (default: ``reread_if_dropped``
    on ``store``) decides whether it was dropped meanwhile, and what to try then.

    Raises:
        CheckpointNotFoundError: every checkpoint tried was dropped meanwhile, or it
            happened too often (``reread_if_dropped``).
        CorruptionError: every one was damaged (``exc.skipped`` says why).
        Whatever ``try_one`` and ``reread`` raise.
    """
    if reread is None:
        reread = lambda r, tried, n: reread_if_dropped(store, r, step, tried, n)  # noqa: E731

    todo = list(todo)
    skipped: list[SkippedCheckpoint] = []
    tried: set[str] = set()
    rereads = 0
    while todo:
        record = todo.pop(0)
        tried.add(record.commit_id)
        outcome = try_one(record)
        if not isinstance(outcome, Damaged):
            return Intact(record, outcome, tuple(skipped), from_records)
        fresh = reread(record, tried, rereads) if outcome.may_be_dropped else None
        if fresh is None:
            # The one warning for this fallback: restore, resume and the CLI only report
            # ``Intact.skipped`` (JSON, info logs), never warn again.
            log.warning(
                "skipping the checkpoint of step %d (%s): %s; %s",
                record.step,
                record.commit_id,
                outcome.reason,
                f"trying step {todo[0].step}" if todo else "no older checkpoint to try",
            )
            skipped.append(SkippedCheckpoint(record.step, record.commit_id, outcome.reason))
            continue
        (todo, from_records), rereads = fresh, rereads + 1
        reason = dropped_reason(outcome.reason)
        skipped.append(SkippedCheckpoint(record.step, record.commit_id, reason, True))
    raise nothing_restored(store.url, skipped, step)


def reread_if_dropped(
    store: Store,
    record: CheckpointRecord,
    step: int | None,
    tried: set[str],
    rereads: int,
) -> tuple[list[CheckpointRecord], bool] | None:
    """After ``record`` turned out damaged or missing: read LATEST again. If it still
    retains ``record``, the failure is damage: None (fall back as usual). If not,
    retention dropped it while the restore read it, and GC collected it after the grace
    period: the checkpoints to try now (the fresh LATEST's, minus those in ``tried``) and
    whether they come from the commit records. ``rereads``: how many times this restore
    already did this.

    Raises:
        CheckpointNotFoundError: this happened ``MAX_LATEST_REREADS`` times already (the
            restore is slower than the run's grace period).
        StoreError: LATEST could not be read.
    """
    latest, from_records = load_latest_for_reading(store)
    if latest is None or any(r.commit_id == record.commit_id for r in latest.retained()):
        return None
    if rereads >= MAX_LATEST_REREADS:
        raise CheckpointNotFoundError(
            f"the checkpoint this restore was reading from {store.url} was dropped by "
            f"retention and collected by GC under it {rereads + 1} times (last: step "
            f"{record.step}); the restore takes longer than the run's grace period "
            f"({latest.settings.gc_grace_s}s)",
            hint="Restore where the store is faster, or raise the run's gc_grace "
            "(CheckpointManager(gc_grace=...)) so readers get longer before GC deletes",
        )
    todo = [r for r in candidates(latest, step) if r.commit_id not in tried]
    log.warning(
        "step %d (%s) was dropped by retention and collected while this restore read it; "
        "read LATEST again: %s",
        record.step,
        record.commit_id,
        f"restoring step {todo[0].step}" if todo else "nothing else to try",
    )
    return todo, from_records


def dropped_reason(failure: str) -> str:
    """``SkippedCheckpoint.reason`` of a checkpoint collected while it was read."""
    return (
        f"dropped by retention and collected while this restore read it ({failure}); "
        "LATEST was read again"
    )


def nothing_restored(
    url: str, skipped: list[SkippedCheckpoint], step: int | None
) -> CloudCkptError:
    """The error of a restore that ran out of checkpoints: CheckpointNotFoundError if every
    one it tried was dropped meanwhile (``step`` is no longer retained), else
    CorruptionError naming every reason."""
    if skipped and all(s.dropped for s in skipped):
        what = "the checkpoints" if step is None else f"step {step}"
        return CheckpointNotFoundError(
            f"{url} no longer retains {what} this restore was asked for: retention dropped "
            "it and GC collected it while the restore read it"
        )
    return CorruptionError(
        f"no intact checkpoint in {url}: "
        + "; ".join(f"step {s.step}: {s.reason}" for s in skipped),
        skipped=skipped,
    )
