"""``verify``: check that a run's committed checkpoints are intact, without restoring them.

What is checked, in order (docs/design.md §9: I1, I2 and I9):

1. LATEST parses and passes its self-check (``self_sha256``). A missing or damaged LATEST
   is reported (the run needs ``repair``); the checkpoints are then checked as the newest
   verifying commit record describes them, exactly as a restore would find them.
2. For each checkpoint checked (the current one; every retained one with ``all``): the
   manifest exists and matches the size and SHA-256 that LATEST recorded, and its paths
   are safe.
3. One listing per checkpoint: every file of the manifest exists with its recorded size.
4. With ``read_data``: every byte of every file is read back (parallel ranged GETs, nothing
   written to disk) and hashed into the file's digest tree, which must equal the manifest's.
5. With ``all``: every ``commits/`` record passes its self-check, and every pin names a
   retained checkpoint.

Besides damage, it warns (``warnings``: not damage, the exit status is unchanged) about
retained checkpoints that record metrics but not the one keep-best ranks by
(``retention.unranked``: a mistyped metric name makes GC delete the best checkpoint).

Network failures are not damage: they raise (``StoreError``) rather than mark a checkpoint
damaged, so a blip never makes a good checkpoint look bad.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from cloudckpt import attempt_layout, fetch, protocol
from cloudckpt.committer import read_latest, run_has_data
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CorruptionError,
    ObjectNotFoundError,
    UnsafePathError,
)
from cloudckpt.manifests import Manifest
from cloudckpt.protocol import CheckpointRecord, CorruptRecordError, Latest
from cloudckpt.reader import check_chunk_objects, fetch_manifest, load_latest_for_reading
from cloudckpt.retention import unranked
from cloudckpt.stores import Store
from cloudckpt.transfer import TransferConfig, TransferEngine

log = logging.getLogger("cloudckpt.verify")

MiB = 1024 * 1024
#: Problems listed per checkpoint before the rest are summarised as a count.
MAX_REASONS = 20


@dataclasses.dataclass
class CheckpointCheck:
    """The verdict on one committed checkpoint."""

    step: int
    commit_id: str
    ckpt: str
    role: str  # "current" or "history"
    pins: list[str]
    num_files: int
    total_bytes: int
    ok: bool = True
    reasons: list[str] = dataclasses.field(default_factory=list)
    bytes_read: int = 0

    def damaged(self, reason: str) -> None:
        self.ok = False
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(reason)
        elif len(self.reasons) == MAX_REASONS:
            self.reasons.append("... more problems not listed")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = "ok" if self.ok else "damaged"
        return d


@dataclasses.dataclass
class VerifyReport:
    """What ``verify_run`` found. ``ok`` is True only if nothing is damaged."""

    url: str
    read_data: bool
    all: bool
    latest_ok: bool
    latest_source: str  # "LATEST" or the commits/ record used instead
    latest_problem: str | None
    seq: int | None
    writer_epoch: int | None
    checkpoints: list[CheckpointCheck] = dataclasses.field(default_factory=list)
    commit_records_checked: int = 0
    commit_records_damaged: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)  # run-level, besides LATEST
    warnings: list[str] = dataclasses.field(default_factory=list)  # not damage (module doc)

    @property
    def ok(self) -> bool:
        return (
            self.latest_ok
            and not self.problems
            and not self.commit_records_damaged
            and all(c.ok for c in self.checkpoints)
        )

    @property
    def needs_repair(self) -> bool:
        return not self.latest_ok

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "ok": self.ok,
            "needs_repair": self.needs_repair,
            "read_data": self.read_data,
            "all": self.all,
            "latest": {
                "ok": self.latest_ok,
                "source": self.latest_source,
                "problem": self.latest_problem,
                "seq": self.seq,
                "writer_epoch": self.writer_epoch,
            },
            "checkpoints": [c.to_dict() for c in self.checkpoints],
            "commit_records": {
                "checked": self.commit_records_checked,
                "damaged": list(self.commit_records_damaged),
            },
            "problems": list(self.problems),
            "warnings": list(self.warnings),
        }


def _load(store: Store) -> tuple[Latest, bool, str, str | None]:
    """(latest, latest_ok, source, problem), falling back to the commit records."""
    problem = None
    try:
        head = read_latest(store)
    except CorruptRecordError as exc:
        head, problem = None, f"LATEST is damaged: {exc.message}"
    if head is not None:
        return head.latest, True, protocol.LATEST_KEY, None
    if problem is None:
        if not run_has_data(store):
            raise CheckpointNotFoundError(f"{store.url} has no LATEST and no checkpoints")
        problem = "LATEST is missing but checkpoint data exists"
    latest, _ = load_latest_for_reading(store)
    if latest is None:
        raise CorruptionError(
            f"{problem}, and no commit record under {store.url} verifies",
            hint="Nothing can be restored from this run as it stands; `cloudckpt repair URL` "
            "says what it finds",
        )
    return latest, False, protocol.commit_record_key(latest.seq), problem


def _check_listing(
    store: Store, record: CheckpointRecord, manifest: Manifest, check: CheckpointCheck
) -> None:
    if manifest.chunked:
        try:
            check_chunk_objects(store, manifest, record.step)
        except CorruptionError as exc:
            check.damaged(exc.message)
    prefix = record.ckpt + attempt_layout.FILES_DIR
    plain = [e for e in manifest.files if e.chunks is None]
    sizes = {o.key[len(prefix) :]: o.size for o in store.list(prefix)} if plain else {}
    for entry in plain:
        size = sizes.get(entry.path)
        if size is None:
            check.damaged(f"{entry.path} is missing")
        elif size != entry.size:
            check.damaged(f"{entry.path} is {size} bytes, the manifest says {entry.size}")


class _Hasher:
    """Reads files back through the one verified-read engine (``fetch.verify_files``),
    keeping nothing, on a transfer engine of its own: the workers, retries, short-read
    rule (``transfer.read_exact``) and reused buffers every verified read uses."""

    def __init__(self, concurrency: int, range_size: int, progress: Callable[[int], None] | None):
        config = TransferConfig(concurrency=concurrency, range_size=range_size)
        self._engine = TransferEngine(config)
        self._progress = progress

    def close(self) -> None:
        self._engine.close()

    def check(
        self, store: Store, record: CheckpointRecord, manifest: Manifest, check: CheckpointCheck
    ) -> None:
        """Every byte of ``manifest``'s files read back and checked; each damaged file
        recorded in ``check``. Raises StoreError."""
        files = manifest.files
        damaged: dict[int, tuple[CorruptionError, bool]] = {}
        fetch.verify_files(
            self._engine,
            store,
            record.ckpt + attempt_layout.FILES_DIR,
            [fetch.FileJob(e) for e in files],
            leaf_size=manifest.chunk_size,
            progress=self._progress,
            damaged=lambda i, exc, whole: damaged.__setitem__(i, (exc, whole)),
        )
        for i, entry in enumerate(files):
            if i not in damaged:
                check.bytes_read += entry.size
            elif damaged[i][1]:  # every piece intact, the file's digest not the recorded one
                check.damaged(f"{entry.path}: content does not match its digest")
            else:
                check.damaged(f"{entry.path}: {damaged[i][0].message}")


def verify_run(
    store: Store,
    *,
    all: bool = False,
    read_data: bool = False,
    concurrency: int = 8,
    range_size: int = 16 * MiB,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check LATEST and the current checkpoint (every retained one with ``all``); with
    ``read_data`` also every byte. See the module docstring.

    ``progress`` is called with byte counts as data is read back.

    Raises:
        CheckpointNotFoundError: the run holds nothing at all.
        CorruptionError: LATEST is missing or damaged and no commit record verifies.
        StoreError: the store failed (after retries); nothing is concluded about the data.
    """
    latest, latest_ok, source, problem = _load(store)
    report = VerifyReport(
        url=store.url,
        read_data=read_data,
        all=all,
        latest_ok=latest_ok,
        latest_source=source,
        latest_problem=problem,
        seq=latest.seq,
        writer_epoch=latest.writer.epoch,
    )
    warning = unranked(latest.settings.retention, latest.retained())
    report.warnings += [warning] if warning is not None else []
    records = latest.retained() if all else latest.retained()[:1]
    hasher = _Hasher(concurrency, range_size, progress) if read_data else None
    try:
        for record in records:
            check = CheckpointCheck(
                step=record.step,
                commit_id=record.commit_id,
                ckpt=record.ckpt,
                role="current" if record is latest.current else "history",
                pins=[p.label for p in latest.pins if p.commit_id == record.commit_id],
                num_files=record.num_files,
                total_bytes=record.total_bytes,
            )
            report.checkpoints.append(check)
            _check_checkpoint(store, record, check, hasher)
    finally:
        if hasher is not None:
            hasher.close()
    if all:
        _check_pins_and_records(store, latest, report)
    return report


def _check_checkpoint(
    store: Store, record: CheckpointRecord, check: CheckpointCheck, hasher: _Hasher | None
) -> None:
    """Record in ``check`` what is wrong with ``record``'s manifest and objects (and, with
    a ``hasher``, its bytes). Raises StoreError (the store failed)."""
    try:
        manifest = fetch_manifest(store, record)
    except (CorruptionError, UnsafePathError) as exc:
        check.damaged(f"manifest: {exc.message}")
        return
    if len(manifest.files) != record.num_files or manifest.total_bytes != record.total_bytes:
        check.damaged("the manifest's file count or size differs from LATEST's record")
    _check_listing(store, record, manifest, check)
    if hasher is not None and check.ok:
        hasher.check(store, record, manifest, check)
    log.info("step %d: %s", record.step, "ok" if check.ok else "; ".join(check.reasons))


def _check_pins_and_records(store: Store, latest: Latest, report: VerifyReport) -> None:
    """``verify --all``'s run-wide checks: every pin names a retained checkpoint, and every
    commit record parses. Raises StoreError (the store failed)."""
    retained = {r.commit_id for r in latest.retained()}
    for pin in latest.pins:
        if pin.commit_id not in retained:
            report.problems.append(
                f"pin {pin.label!r} of step {pin.step} names a checkpoint LATEST no longer retains"
            )
    for obj in store.list(protocol.COMMITS_PREFIX):
        report.commit_records_checked += 1
        try:
            data, _ = store.get(obj.key)
            protocol.parse_latest(data, what=obj.key)
        except ObjectNotFoundError:
            report.commit_records_checked -= 1  # removed by GC meanwhile
        except CorruptRecordError as exc:
            report.commit_records_damaged.append(f"{obj.key}: {exc.message}")
