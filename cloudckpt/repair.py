"""``repair``: rebuild a missing or damaged LATEST from the commit records (docs/design.md §7, LATEST missing or damaged).

LATEST is the run's only commit point; every body written to it is also kept, create-only,
as ``commits/<seq>.json``. When LATEST is missing or fails its self-check, writers stop
with ``NeedsRepairError`` (they must never start a new history over old data) and readers
fall back to the commit records read-only. ``repair`` makes the run writable again:

1. Inventory: the damaged LATEST (if any bytes are there), every commit record, and every
   attempt prefix under ``ckpt/``.
2. Base: the highest-seq record that verifies: it passes its self-check and its current
   checkpoint's manifest is present and matches the digest the record holds. A record whose
   current checkpoint is damaged is passed over for the next lower one.
3. From the base, every retained checkpoint whose manifest is missing or damaged is dropped:
   it becomes a ``deleting`` tombstone (GC removes its remains after the grace period, and
   a pin can no longer bring it back), and its pins go with it.
4. The new LATEST gets a writer epoch above EVERY epoch seen anywhere (each commit record,
   the damaged LATEST as far as its bytes can be read, every ``-e<N>-`` attempt prefix), so
   a writer that was running before the damage (a zombie) is fenced: its next commit fails
   with ``FencedError``. Its seq is above every seq seen, so no commit record is reused.
5. It is written conditionally: create-only when LATEST is absent, compare-and-swap against
   the damaged object's version otherwise. If anything else wrote LATEST meanwhile, repair
   stops (``CommitConflictError``) rather than overwrite it. Then its commit record.

A LATEST that verifies is left alone ("healthy") unless ``force`` is given; with ``force``
LATEST itself is a candidate base, so the result drops checkpoints whose manifests are gone
and fences the current writer. Repair never deletes anything.

A manifest in a format this version does not know, in an attempt the rebuilt LATEST
would leave unreferenced, stops repair (``UnknownFormatError``): a newer version
committed it, and rebuilding from an older record would roll that back.

Plan, then execute (as ``cloudckpt.gc``): ``plan_repair`` does steps 1-4 and writes nothing;
its ``RepairPlan`` holds the LATEST it would write, the base it comes from, its seq and epoch,
and how it would be written (``RepairReport.writes``: create-only, or compare-and-swap
against the version of the damaged LATEST it read). A dry run stops there.
``execute_repair`` does step 5. It needs to judge nothing again: the conditional write IS
the check that LATEST is still what the plan read, and it refuses to write otherwise.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import logging
import re
import secrets
from typing import Any

from cloudckpt import attempt_layout, canonical, manifests, protocol
from cloudckpt.committer import write_commit_record
from cloudckpt.errors import (
    CommitConflictError,
    CorruptionError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreConflictError,
    UnsafePathError,
)
from cloudckpt.protocol import CheckpointRecord, CorruptRecordError, Latest, Tombstone
from cloudckpt.reader import fetch_manifest
from cloudckpt.retry import call_with_retries
from cloudckpt.stores import CREATE, Store, Update

log = logging.getLogger("cloudckpt.repair")

_EPOCH_RE = re.compile(rb'"epoch"\s*:\s*(\d{1,18})')
_SEQ_RE = re.compile(rb'"(?:seq|parent_seq|dropped_seq)"\s*:\s*(\d{1,18})')


@dataclasses.dataclass
class RepairReport:
    """What ``repair`` found and did.

    ``action``: ``healthy`` (LATEST verifies; nothing written), ``empty`` (nothing under
    the run; nothing written), ``rebuilt`` (LATEST rewritten), or ``would-rebuild``
    (``dry_run``, or a plan not yet executed).
    """

    url: str
    action: str
    latest_state: str  # "ok", "missing" or "damaged"
    latest_problem: str | None = None
    base: str | None = None  # the record the new LATEST was built from
    seq: int | None = None  # the new LATEST's seq
    epoch: int | None = None  # the new LATEST's writer epoch
    highest_epoch_seen: int = 0
    highest_seq_seen: int = 0
    current_step: int | None = None
    retained_steps: list[int] = dataclasses.field(default_factory=list)
    dropped: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    passed_over: list[dict[str, str]] = dataclasses.field(default_factory=list)
    commit_records: int = 0
    attempts: int = 0
    unreferenced_manifests: list[str] = dataclasses.field(default_factory=list)
    # The writes the plan calls for, in order: {"key", "mode"} ("create-only" or
    # "compare-and-swap") and, for a compare-and-swap, the "version" it must replace.
    writes: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _loose_numbers(data: bytes) -> tuple[int, int]:
    """(highest epoch, highest seq) readable from possibly damaged JSON bytes.

    A damaged body may not parse; its numbers still bound what was written. Taking every
    ``"epoch"``/``"seq"`` found errs high, which is the safe side for fencing."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        body = None
    epochs = [int(m) for m in _EPOCH_RE.findall(data)]
    seqs = [int(m) for m in _SEQ_RE.findall(data)]
    if isinstance(body, dict):
        w = body.get("writer")
        if isinstance(w, dict) and isinstance(w.get("epoch"), int):
            epochs.append(w["epoch"])
        if isinstance(body.get("seq"), int):
            seqs.append(body["seq"])
    return max(epochs, default=0), max(seqs, default=0)


@dataclasses.dataclass
class RepairPlan:
    """What ``repair`` would do: ``report`` says what was found and decided; ``rebuilt`` is
    the LATEST to write (None: nothing to write, the action is ``healthy`` or ``empty``),
    create-only when ``latest_version`` is None, else compare-and-swap against it."""

    store: Store
    report: RepairReport
    rebuilt: Latest | None = None
    latest_version: str | None = None


@dataclasses.dataclass
class _Seen:
    """Everything the inventory found: the candidate bases, the attempt prefixes, and the
    highest writer epoch and seq seen anywhere (damaged bytes included)."""

    candidates: list[tuple[str, Latest]] = dataclasses.field(default_factory=list)
    attempts: dict[str, bool] = dataclasses.field(default_factory=dict)  # -> has a manifest
    epoch: int = 0
    seq: int = 0

    def note(self, epoch: int = 0, seq: int = 0) -> None:
        self.epoch, self.seq = max(self.epoch, epoch), max(self.seq, seq)


def _check_record(store: Store, record: CheckpointRecord) -> str | None:
    """None if ``record``'s manifest is present and matches; else why not."""
    try:
        fetch_manifest(store, record)
    except (CorruptionError, UnsafePathError) as exc:
        return exc.message
    return None


def _read_latest_as_is(
    store: Store, report: RepairReport
) -> tuple[bytes | None, str | None, Latest | None]:
    """Step 1: LATEST's bytes, version and parsed body, as far as each exists; the report
    says whether it is ok, missing or damaged."""
    try:
        data, info = call_with_retries(lambda: store.get(protocol.LATEST_KEY), what="read LATEST")
    except ObjectNotFoundError:
        report.latest_state = "missing"
        report.latest_problem = "LATEST does not exist"
        return None, None, None
    try:
        return data, info.version, protocol.parse_latest(data)
    except CorruptRecordError as exc:
        report.latest_state = "damaged"
        report.latest_problem = exc.message
        return data, info.version, None


def _scan_records(store: Store, seen: _Seen, report: RepairReport) -> None:
    """Step 2a: every commit record is a candidate base if it parses; every number in it,
    and in its key, counts as seen."""
    record_keys = sorted(
        (o.key for o in store.list(protocol.COMMITS_PREFIX)), reverse=True
    )  # zero-padded: lexical order is seq order
    report.commit_records = len(record_keys)
    for key in record_keys:
        name = key[len(protocol.COMMITS_PREFIX) :].removesuffix(".json")
        if name.isdigit():
            seen.note(seq=int(name))
        try:
            data, _ = call_with_retries(functools.partial(store.get, key), what=f"read {key}")
        except ObjectNotFoundError:
            continue  # GC removed an old record meanwhile
        seen.note(*_loose_numbers(data))
        try:
            seen.candidates.append((key, protocol.parse_latest(data, what=key)))
        except CorruptRecordError as exc:
            report.passed_over.append({"record": key, "reason": exc.message})


def _scan_attempts(store: Store, seen: _Seen) -> None:
    """Step 2b: every attempt prefix under ckpt/ (its ``-e<N>-`` epoch counts as seen),
    and whether it holds a manifest."""
    for obj in store.list(attempt_layout.CKPT_PREFIX):
        parts = obj.key.split("/", 2)
        if len(parts) < 3:
            continue
        prefix = f"{parts[0]}/{parts[1]}/"
        parsed = attempt_layout.parse_ckpt_prefix(prefix)
        if parsed is None:
            continue
        seen.note(epoch=parsed[1])
        has = seen.attempts.get(prefix, False) or parts[2] == attempt_layout.MANIFEST_NAME
        seen.attempts[prefix] = has


def _choose_base(store: Store, seen: _Seen, report: RepairReport) -> tuple[str, Latest]:
    """Step 3: the highest-seq candidate whose current checkpoint verifies.

    Raises:
        CorruptionError: none does (nothing was changed).
    """
    for key, cand in sorted(seen.candidates, key=lambda c: c[1].seq, reverse=True):
        if cand.current is not None:
            why = _check_record(store, cand.current)
            if why is not None:
                report.passed_over.append(
                    {"record": key, "reason": f"its current step {cand.current.step}: {why}"}
                )
                continue
        return key, cand
    raise CorruptionError(
        f"cannot repair {store.url}: LATEST is {report.latest_state} and none of the "
        f"{report.commit_records} commit record(s) verifies ("
        + (
            "; ".join(f"{p['record']}: {p['reason']}" for p in report.passed_over[:5])
            or "there are none"
        )
        + f"); ckpt/ holds {len(seen.attempts)} attempt(s), "
        f"{sum(seen.attempts.values())} with a manifest",
        hint="Nothing was changed. Attempts with a manifest hold complete files: copy "
        "one out with your store's tools and `cloudckpt push` it into a new run",
    )


def _rebuild(
    store: Store, base: Latest, seen: _Seen, writer: protocol.Writer, report: RepairReport
) -> Latest:
    """Step 4: ``base`` without the retained checkpoints whose manifests are missing or
    damaged (they become ``deleting`` tombstones, their pins go), with a seq and writer
    epoch above every one seen."""
    keep: list[CheckpointRecord] = []
    dropped: list[CheckpointRecord] = []
    for record in base.history:
        why = _check_record(store, record)
        if why is None:
            keep.append(record)
        else:
            dropped.append(record)
            report.dropped.append(
                {"step": record.step, "commit_id": record.commit_id, "reason": why}
            )
    dropped_ids = {r.commit_id for r in dropped}
    new_seq = seen.seq + 1
    return dataclasses.replace(
        base,
        seq=new_seq,
        parent_seq=new_seq - 1,
        writer=writer,
        history=tuple(keep),
        pins=tuple(p for p in base.pins if p.commit_id not in dropped_ids),
        tombstones=base.tombstones
        + tuple(Tombstone(r, new_seq, state="deleting") for r in dropped),
        op="repair",
        updated_at=writer.claimed_at,
        nonce=secrets.token_hex(8),
    )


def _refuse_newer_manifests(store: Store, prefixes: list[str]) -> None:
    """Read the manifest of every attempt the rebuilt LATEST would not reference. One a
    newer cloudckpt wrote means a newer version committed (or was committing) in this run:
    its LATEST, damaged now, and records lost, rebuilding from an older record would roll
    those commits back (and GC would then delete them). Damaged or vanished ones pass.

    Raises:
        UnknownFormatError: such a manifest (nothing written).
        StoreError: the store failed.
    """
    for prefix in prefixes:
        key = prefix + attempt_layout.MANIFEST_NAME
        try:
            data, _ = call_with_retries(functools.partial(store.get, key), what=f"read {key}")
            manifests.parse_manifest(data)
        except (ObjectNotFoundError, CorruptRecordError, UnsafePathError):
            continue


def _describe(report: RepairReport, latest: Latest) -> None:
    report.seq, report.epoch = latest.seq, latest.writer.epoch
    report.current_step = latest.current.step if latest.current else None
    report.retained_steps = [r.step for r in latest.retained()]


def _writes(rebuilt: Latest, latest_version: str | None) -> list[dict[str, str]]:
    """Step 5 as the plan states it: LATEST conditionally, then its commit record."""
    if latest_version is None:
        first = {"key": protocol.LATEST_KEY, "mode": "create-only"}
    else:
        first = {"key": protocol.LATEST_KEY, "mode": "compare-and-swap", "version": latest_version}
    return [first, {"key": protocol.commit_record_key(rebuilt.seq), "mode": "create-only"}]


def plan_repair(
    store: Store,
    *,
    force: bool = False,
    writer_id: str | None = None,
    clock: Any = None,
) -> RepairPlan:
    """Steps 1-4 of the module doc: what LATEST would be rebuilt from, with which seq and
    epoch, and how it would be written. Reads only.

    Raises:
        CorruptionError: LATEST needs repair but no commit record verifies (the message
            says what was found).
        UnknownFormatError: LATEST, a commit record or a manifest a newer cloudckpt wrote
            (nothing written).
        StoreError: the store failed; re-running repair is safe.
    """
    now = (clock or (lambda: dt.datetime.now(dt.timezone.utc)))()
    report = RepairReport(url=store.url, action="", latest_state="ok")
    latest_bytes, latest_version, current = _read_latest_as_is(store, report)
    if current is not None and not force:
        report.action = "healthy"
        _describe(report, current)
        return RepairPlan(store, report)
    seen = _Seen()
    if latest_bytes is not None:
        seen.note(*_loose_numbers(latest_bytes))
    if current is not None:
        seen.candidates.append((protocol.LATEST_KEY, current))
    _scan_records(store, seen, report)
    _scan_attempts(store, seen)
    for _, cand in seen.candidates:
        seen.note(cand.writer.epoch, cand.seq)
    report.attempts = len(seen.attempts)
    report.highest_epoch_seen, report.highest_seq_seen = seen.epoch, seen.seq
    if latest_bytes is None and not seen.candidates and not seen.attempts:
        report.action = "empty"  # a new run: the first writer creates LATEST
        return RepairPlan(store, report)
    report.base, base = _choose_base(store, seen, report)
    writer = protocol.Writer(
        epoch=seen.epoch + 1,
        id=writer_id or f"repair:{protocol.new_writer_id()}",
        claimed_at=canonical.iso(now),
    )
    rebuilt = _rebuild(store, base, seen, writer, report)
    referenced = rebuilt.referenced_prefixes()
    report.unreferenced_manifests = sorted(
        p for p, has in seen.attempts.items() if has and p not in referenced
    )
    _refuse_newer_manifests(store, report.unreferenced_manifests)
    _describe(report, rebuilt)
    report.action = "would-rebuild"
    report.writes = _writes(rebuilt, latest_version)
    return RepairPlan(store, report, rebuilt, latest_version)


def execute_repair(plan: RepairPlan) -> RepairReport:
    """Step 5: write the planned LATEST conditionally (never over something the plan did
    not read), then its commit record. A plan with nothing to write returns its report.

    Raises:
        CommitConflictError: LATEST changed since the plan read it (another writer or
            repair); nothing was overwritten.
        StoreError: the store failed; re-running repair is safe.
    """
    store, rebuilt = plan.store, plan.rebuilt
    if rebuilt is None:
        return plan.report
    body = rebuilt.to_bytes()
    mode = CREATE if plan.latest_version is None else Update(plan.latest_version)
    try:
        store.put(protocol.LATEST_KEY, body, mode=mode)
    except (PreconditionFailedError, StoreConflictError):
        raise CommitConflictError(
            f"LATEST of {store.url} changed while repair was running; nothing was overwritten",
            hint="Another writer or repair got there first. Run `cloudckpt repair URL` again: "
            "it reports 'healthy' if LATEST now verifies",
        ) from None
    write_commit_record(store, body, rebuilt.seq)
    log.info(
        "rebuilt LATEST of %s from %s: seq %d, writer epoch %d (fences every earlier writer)",
        store.url,
        plan.report.base,
        rebuilt.seq,
        rebuilt.writer.epoch,
    )
    return dataclasses.replace(plan.report, action="rebuilt")


def repair(
    store: Store,
    *,
    force: bool = False,
    dry_run: bool = False,
    writer_id: str | None = None,
    clock: Any = None,
) -> RepairReport:
    """Rebuild LATEST from the newest commit record that verifies (see the module doc):
    ``plan_repair``, then, unless ``dry_run``, ``execute_repair``.

    Raises:
        CorruptionError: LATEST needs repair but no commit record verifies (the message
            says what was found).
        UnknownFormatError: LATEST, a commit record or a manifest a newer cloudckpt wrote
            (nothing written).
        CommitConflictError: LATEST changed while repairing (another writer or repair).
        StoreError: the store failed; re-running repair is safe.
    """
    plan = plan_repair(store, force=force, writer_id=writer_id, clock=clock)
    return plan.report if dry_run else execute_repair(plan)
