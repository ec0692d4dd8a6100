"""``repair``: rebuild a missing or damaged LATEST from the commit records (DESIGN §7.5).

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
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import re
import secrets
from typing import Any

from cloudckpt import protocol
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
from cloudckpt.restore import fetch_manifest
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
    (``dry_run``).
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


def _check_record(store: Store, record: CheckpointRecord) -> str | None:
    """None if ``record``'s manifest is present and matches; else why not."""
    try:
        fetch_manifest(store, record)
    except (CorruptionError, UnsafePathError) as exc:
        return exc.message
    return None


def repair(
    store: Store,
    *,
    force: bool = False,
    dry_run: bool = False,
    writer_id: str | None = None,
    clock: Any = None,
) -> RepairReport:
    """Rebuild LATEST from the newest commit record that verifies (see the module doc).

    Raises:
        CorruptionError: LATEST needs repair but no commit record verifies (the message
            says what was found).
        CommitConflictError: LATEST changed while repairing (another writer or repair).
        StoreError: the store failed; re-running repair is safe.
    """
    now = (clock or (lambda: dt.datetime.now(dt.timezone.utc)))()
    report = RepairReport(url=store.url, action="", latest_state="ok")

    # 1. LATEST as it is.
    latest_bytes: bytes | None = None
    latest_version: str | None = None
    current: Latest | None = None
    try:
        latest_bytes, info = call_with_retries(
            lambda: store.get(protocol.LATEST_KEY), what="read LATEST"
        )
        latest_version = info.version
    except ObjectNotFoundError:
        report.latest_state = "missing"
        report.latest_problem = "LATEST does not exist"
    if latest_bytes is not None:
        try:
            current = protocol.parse_latest(latest_bytes)
        except CorruptRecordError as exc:
            report.latest_state = "damaged"
            report.latest_problem = exc.message
    if current is not None and not force:
        report.action = "healthy"
        report.seq, report.epoch = current.seq, current.writer.epoch
        report.current_step = current.current.step if current.current else None
        report.retained_steps = [r.step for r in current.retained()]
        return report

    # 2. Inventory: epochs and seqs seen anywhere, and the candidate bases.
    max_epoch, max_seq = 0, 0
    if latest_bytes is not None:
        max_epoch, max_seq = _loose_numbers(latest_bytes)
    candidates: list[tuple[str, Latest]] = []
    if current is not None:
        candidates.append((protocol.LATEST_KEY, current))
    record_keys = sorted(
        (o.key for o in store.list(protocol.COMMITS_PREFIX)), reverse=True
    )  # zero-padded: lexical order is seq order
    report.commit_records = len(record_keys)
    for key in record_keys:
        name = key[len(protocol.COMMITS_PREFIX) :].removesuffix(".json")
        if name.isdigit():
            max_seq = max(max_seq, int(name))
        try:
            data, _ = call_with_retries(lambda k=key: store.get(k), what=f"read {key}")
        except ObjectNotFoundError:
            continue  # GC removed an old record meanwhile
        e, s = _loose_numbers(data)
        max_epoch, max_seq = max(max_epoch, e), max(max_seq, s)
        try:
            candidates.append((key, protocol.parse_latest(data, what=key)))
        except CorruptRecordError as exc:
            report.passed_over.append({"record": key, "reason": exc.message})
    attempts: dict[str, bool] = {}  # attempt prefix -> has a manifest
    for obj in store.list(protocol.CKPT_PREFIX):
        parts = obj.key.split("/", 2)
        if len(parts) < 3:
            continue
        prefix = f"{parts[0]}/{parts[1]}/"
        parsed = protocol.parse_ckpt_prefix(prefix)
        if parsed is None:
            continue
        max_epoch = max(max_epoch, parsed[1])
        has = attempts.get(prefix, False) or parts[2] == protocol.MANIFEST_NAME
        attempts[prefix] = has
    report.attempts = len(attempts)
    for _, cand in candidates:
        max_epoch = max(max_epoch, cand.writer.epoch)
        max_seq = max(max_seq, cand.seq)
    report.highest_epoch_seen, report.highest_seq_seen = max_epoch, max_seq

    if latest_bytes is None and not candidates and not attempts:
        report.action = "empty"  # a new run: the first writer creates LATEST
        return report

    # 3. The base: the highest candidate whose current checkpoint verifies.
    candidates.sort(key=lambda c: c[1].seq, reverse=True)
    base_key, base = None, None
    for key, cand in candidates:
        if cand.current is not None:
            why = _check_record(store, cand.current)
            if why is not None:
                report.passed_over.append(
                    {"record": key, "reason": f"its current step {cand.current.step}: {why}"}
                )
                continue
        base_key, base = key, cand
        break
    if base is None:
        raise CorruptionError(
            f"cannot repair {store.url}: LATEST is {report.latest_state} and none of the "
            f"{len(record_keys)} commit record(s) verifies ("
            + (
                "; ".join(f"{p['record']}: {p['reason']}" for p in report.passed_over[:5])
                or "there are none"
            )
            + f"); ckpt/ holds {len(attempts)} attempt(s), "
            f"{sum(attempts.values())} with a manifest",
            hint="Nothing was changed. Attempts with a manifest hold complete files: copy "
            "one out with your store's tools and `cloudckpt push` it into a new run",
        )

    # 4. Drop retained checkpoints whose manifests are missing or damaged.
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
    new_seq = max_seq + 1
    new_epoch = max_epoch + 1
    writer = protocol.Writer(
        epoch=new_epoch,
        id=writer_id or f"repair:{protocol.new_writer_id()}",
        claimed_at=protocol.iso(now),
    )
    rebuilt = dataclasses.replace(
        base,
        seq=new_seq,
        parent_seq=new_seq - 1,
        writer=writer,
        history=tuple(keep),
        pins=tuple(p for p in base.pins if p.commit_id not in dropped_ids),
        tombstones=base.tombstones
        + tuple(Tombstone(r, new_seq, state="deleting") for r in dropped),
        op="repair",
        updated_at=protocol.iso(now),
        nonce=secrets.token_hex(8),
    )
    referenced = rebuilt.referenced_prefixes()
    report.unreferenced_manifests = sorted(
        p for p, has in attempts.items() if has and p not in referenced
    )
    report.base = base_key
    report.seq, report.epoch = new_seq, new_epoch
    report.current_step = rebuilt.current.step if rebuilt.current else None
    report.retained_steps = [r.step for r in rebuilt.retained()]
    if dry_run:
        report.action = "would-rebuild"
        return report

    # 5. Write it conditionally, never over something we did not read.
    body = rebuilt.to_bytes()
    mode = CREATE if latest_version is None else Update(latest_version)
    try:
        store.put(protocol.LATEST_KEY, body, mode=mode)
    except (PreconditionFailedError, StoreConflictError):
        raise CommitConflictError(
            f"LATEST of {store.url} changed while repair was running; nothing was overwritten",
            hint="Another writer or repair got there first. Run `cloudckpt repair URL` again: "
            "it reports 'healthy' if LATEST now verifies",
        ) from None
    write_commit_record(store, body, new_seq)
    report.action = "rebuilt"
    log.info(
        "rebuilt LATEST of %s from %s: seq %d, writer epoch %d (fences every earlier writer)",
        store.url,
        base_key,
        new_seq,
        new_epoch,
    )
    return report
