"""LATEST, the commit protocol's one mutable object: its records (checkpoints, the writer,
pins, tombstones, run settings), how it is parsed, its commit records, and every
transition from one LATEST to the next. Pure: no I/O, no clocks read here.

Object layout under a run URL (docs/design.md §2; ``files/`` is our addition, see below)::

    LATEST                                   the only mutable object (conditional puts only)
    ckpt/<step:012d>-e<epoch>-<attempt>/     one prefix per save attempt, never reused
        ATTEMPT.json                         written first: who started it, when (store clock)
        files/<relative/path>                whole files (chunking off), each written once
        chunks/<name>                        content-addressed chunks this attempt stored
                                             first; later manifests name them here
                                             (``cloudckpt.chunks``): ``<sha256>`` or
                                             ``b3-<blake3>`` (``chunk_name``)
        MANIFEST.json                        written after all files, create-only
    commits/<seq:020d>.json                  create-only copy of every LATEST body written

User files live under ``files/`` so that no file a framework writes (a ``MANIFEST.json`` of
its own, say) can collide with ours.

``LATEST`` is canonical JSON (sorted keys, no NaN/inf) carrying ``seq`` (+1 on every
write), the writer's fencing ``epoch``, the ``current`` checkpoint, its ``history``
(newest first; retention decides its length), ``pins``, ``tombstones`` (dropped
checkpoints waiting out the GC grace period) and ``self_sha256``. ``seq`` makes every body
unique, which S3 needs: its ETag is the MD5 of the body, so two identical bodies would make
``If-Match`` blind to a write in between.

Around it: the names under an attempt's prefix are ``cloudckpt.attempt_layout``'s, the
manifest is ``cloudckpt.manifests``', the encoding of every record (canonical JSON, the
self-check) ``cloudckpt.canonical``'s and the format names ``cloudckpt.formats``'.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import re
import secrets
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cloudckpt import digest as _digest
from cloudckpt.attempt_layout import MANIFEST_NAME, is_sha256, parse_ckpt_prefix
from cloudckpt.canonical import get_field as _get  # the parsers read dozens of fields
from cloudckpt.canonical import iso, seal, unseal
from cloudckpt.digest import SHA256_TREE
from cloudckpt.errors import ConfigurationError, CorruptRecordError
from cloudckpt.formats import (
    LATEST_FORMAT,
    LATEST_FORMAT_DIGEST,
    LATEST_FORMAT_RETENTION,
    LATEST_FORMATS_READ,
    MAX_LATEST_BYTES,
    MAX_MANIFEST_BYTES,
    WRITTEN_BY,
    check_format,
    unknown_format,
)
from cloudckpt.retention import RetentionPolicy

LATEST_KEY = "LATEST"
COMMITS_PREFIX = "commits/"


# --- identifiers ------------------------------------------------------------------------


def new_writer_id() -> str:
    """Identifies one writer process: host, pid and a random part."""
    host = re.sub(r"[^0-9A-Za-z.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}:{os.getpid()}:{secrets.token_hex(4)}"


def commit_record_key(seq: int) -> str:
    return f"{COMMITS_PREFIX}{seq:020d}.json"


# --- records -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """One committed checkpoint, as LATEST references it."""

    ckpt: str
    step: int
    epoch: int
    commit_id: str
    manifest_sha256: str
    manifest_size: int
    committed_at: str
    total_bytes: int
    num_files: int
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Bytes stored under this checkpoint's own prefix (plain files and the chunks it wrote
    # first); the rest of ``total_bytes`` is shared with older checkpoints. None: unknown
    # (a record written before chunking existed).
    owned_bytes: int | None = None
    # Numbers recorded with the checkpoint (``retention.clean_metrics``): what keep-best
    # retention ranks by. Only in /3 LATESTs (absent: none).
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The manifest's digest algorithm when it is not SHA-256 (None: "sha256-tree"). Only
    # in /4 LATESTs: an older reader refuses the pointer rather than meet its manifest.
    digest: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["metadata"] = dict(self.metadata)
        d["metrics"] = dict(self.metrics)
        if self.owned_bytes is None:
            del d["owned_bytes"]
        if not self.metrics:
            del d["metrics"]
        if self.digest is None:
            del d["digest"]
        return d

    @classmethod
    def from_dict(cls, d: Any, what: str = "checkpoint record") -> CheckpointRecord:
        if not isinstance(d, dict):
            raise CorruptRecordError(f"{what} is not an object")
        rec = cls(
            ckpt=_get(d, "ckpt", str, what),
            step=_get(d, "step", int, what),
            epoch=_get(d, "epoch", int, what),
            commit_id=_get(d, "commit_id", str, what),
            manifest_sha256=_get(d, "manifest_sha256", str, what),
            manifest_size=_get(d, "manifest_size", int, what),
            committed_at=_get(d, "committed_at", str, what),
            total_bytes=_get(d, "total_bytes", int, what),
            num_files=_get(d, "num_files", int, what),
            metadata=_get(d, "metadata", dict, what),
            owned_bytes=None if d.get("owned_bytes") is None else _get(d, "owned_bytes", int, what),
            metrics=_get(d, "metrics", dict, what) if "metrics" in d else {},
            digest=None if d.get("digest") is None else _get(d, "digest", str, what),
        )
        if rec.digest is not None and _digest.check(rec.digest, what) == SHA256_TREE:
            raise CorruptRecordError(f"{what}: digest 'sha256-tree' is recorded as absent")
        if parse_ckpt_prefix(rec.ckpt) is None:
            raise CorruptRecordError(f"{what}: {rec.ckpt!r} is not a checkpoint prefix")
        if not is_sha256(rec.manifest_sha256):
            raise CorruptRecordError(f"{what}: manifest_sha256 is not a SHA-256 hex digest")
        if not 0 < rec.manifest_size <= MAX_MANIFEST_BYTES:
            raise CorruptRecordError(f"{what}: manifest_size {rec.manifest_size} out of range")
        return rec

    @property
    def manifest_key(self) -> str:
        return self.ckpt + MANIFEST_NAME


@dataclasses.dataclass(frozen=True)
class Writer:
    """Who owns the run: the fencing epoch and the writer's id."""

    epoch: int
    id: str
    claimed_at: str


@dataclasses.dataclass(frozen=True)
class Pin:
    commit_id: str
    step: int
    label: str
    pinned_at: str


@dataclasses.dataclass(frozen=True)
class Tombstone:
    """A checkpoint dropped by retention. ``dropped_seq`` is the LATEST seq that dropped it:
    GC measures its age from when ``commits/<dropped_seq>.json`` landed (store clock)."""

    record: CheckpointRecord
    dropped_seq: int
    state: str = "pending"  # "pending" -> "deleting" (GC started removing its objects)

    def to_dict(self) -> dict[str, Any]:
        return {
            "record": self.record.to_dict(),
            "dropped_seq": self.dropped_seq,
            "state": self.state,
        }


@dataclasses.dataclass(frozen=True)
class Settings(RetentionPolicy):
    """Run-wide settings every writer and GC honour, carried in LATEST: the retention
    rules (``retention.RetentionPolicy``, which declares and checks them) and the GC grace
    period.

    Raises (constructor): ConfigurationError for an invalid retention policy.
    """

    gc_grace_s: int = 2 * 3600

    @property
    def retention(self) -> RetentionPolicy:
        """The retention rules (these settings, less the grace period)."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """As LATEST holds them: the /3 rules only where they are used, so that a LATEST
        without them stays a /2 body an older cloudckpt reads."""
        d: dict[str, Any] = {
            "keep_last": self.keep_last,
            "keep_every": self.keep_every,
            "gc_grace_s": self.gc_grace_s,
        }
        if self.keep_best is not None:
            d.update(
                keep_best=self.keep_best, best_metric=self.best_metric, best_mode=self.best_mode
            )
        if self.keep_periods:
            d["keep_periods"] = [list(p) for p in self.keep_periods]
        return d

    @classmethod
    def from_dict(
        cls, s: Mapping[str, Any], what: str, body: Mapping[str, Any] | None = None
    ) -> Settings:
        """Raises UnknownFormatError (a setting this version does not know: a rule it
        would ignore, dropping what the rule keeps; ``body``, the record holding the
        settings, says which version wrote it), CorruptRecordError (a wrong type) or
        ConfigurationError (a bad policy)."""
        unknown = sorted(set(s) - _SETTINGS_KEYS)
        if unknown:
            raise unknown_format(
                f"{what} setting {unknown[0]!r}",
                unknown[0],
                sorted(_SETTINGS_KEYS),
                body if body is not None else {},
            )
        keep_periods = s.get("keep_periods") or []
        if not isinstance(keep_periods, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p)
            for p in keep_periods
        ):
            raise CorruptRecordError(f"{what}: settings.keep_periods is malformed")
        return cls(
            keep_last=s.get("keep_last"),
            keep_every=s.get("keep_every"),
            gc_grace_s=_get(s, "gc_grace_s", int, what),
            keep_best=s.get("keep_best"),
            best_metric=s.get("best_metric"),
            best_mode=s.get("best_mode", "min"),
            keep_periods=tuple((p[0], p[1]) for p in keep_periods),
        )


_SETTINGS_KEYS = frozenset(f.name for f in dataclasses.fields(Settings))
#: The names of every run setting (``Committer(inherit=...)`` takes them).
SETTING_FIELDS = _SETTINGS_KEYS


@dataclasses.dataclass(frozen=True)
class Latest:
    """The parsed LATEST object."""

    seq: int
    parent_seq: int
    writer: Writer
    current: CheckpointRecord | None
    history: tuple[CheckpointRecord, ...] = ()
    pins: tuple[Pin, ...] = ()
    tombstones: tuple[Tombstone, ...] = ()
    settings: Settings = Settings()
    op: str = "init"
    updated_at: str = ""
    nonce: str = ""  # random per write: no two LATEST bodies are ever identical

    # -- serialisation --

    @property
    def format(self) -> str:
        """The oldest LATEST format that carries everything in this one (module constants)."""
        records = [*self.retained(), *(t.record for t in self.tombstones)]
        if any(r.digest is not None for r in records):
            return LATEST_FORMAT_DIGEST
        if self.settings.retention.extended or any(r.metrics for r in records):
            return LATEST_FORMAT_RETENTION
        return LATEST_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "written_by": WRITTEN_BY,
            "seq": self.seq,
            "parent_seq": self.parent_seq,
            "writer": dataclasses.asdict(self.writer),
            "current": self.current.to_dict() if self.current else None,
            "history": [r.to_dict() for r in self.history],
            "pins": [dataclasses.asdict(p) for p in self.pins],
            "tombstones": [t.to_dict() for t in self.tombstones],
            "settings": self.settings.to_dict(),
            "op": self.op,
            "updated_at": self.updated_at,
            "nonce": self.nonce,
        }

    def to_bytes(self) -> bytes:
        return seal(self.to_dict())

    # -- queries --

    def retained(self) -> list[CheckpointRecord]:
        """current, then history, newest first: every checkpoint a restore may use."""
        return ([self.current] if self.current else []) + list(self.history)

    def find(self, commit_id: str) -> str | None:
        """Where ``commit_id`` appears: 'current', 'history', 'tombstone' or None."""
        if self.current and self.current.commit_id == commit_id:
            return "current"
        if any(r.commit_id == commit_id for r in self.history):
            return "history"
        if any(t.record.commit_id == commit_id for t in self.tombstones):
            return "tombstone"
        return None

    def referenced_prefixes(self) -> set[str]:
        """Every checkpoint prefix LATEST points at, tombstones included."""
        refs = {r.ckpt for r in self.retained()}
        refs.update(t.record.ckpt for t in self.tombstones)
        return refs

    def pinned_ids(self) -> set[str]:
        return {p.commit_id for p in self.pins}


def parse_latest(data: bytes, what: str = "LATEST") -> Latest:
    """Parse and verify LATEST (or a commit record).

    Raises:
        CorruptRecordError: damaged (fails its self-check, malformed).
        UnknownFormatError: sealed, in a format (or with a setting) this version does not
            know: a newer cloudckpt wrote it. Never damage: callers must not fall back
            past it, repair it, collect by it or write over it.
    """
    body = unseal(data, what, MAX_LATEST_BYTES)
    check_format(body, "cloudckpt.latest/", LATEST_FORMATS_READ, what, "LATEST")
    try:
        w = _get(body, "writer", dict, what)
        writer = Writer(
            _get(w, "epoch", int, what), _get(w, "id", str, what), _get(w, "claimed_at", str, what)
        )
        cur = body.get("current")
        settings = Settings.from_dict(_get(body, "settings", dict, what), what, body)
        latest = Latest(
            seq=_get(body, "seq", int, what),
            parent_seq=_get(body, "parent_seq", int, what),
            writer=writer,
            current=None if cur is None else CheckpointRecord.from_dict(cur, f"{what} current"),
            history=tuple(
                CheckpointRecord.from_dict(r, f"{what} history")
                for r in _get(body, "history", list, what)
            ),
            pins=tuple(
                Pin(
                    _get(p, "commit_id", str, what),
                    _get(p, "step", int, what),
                    _get(p, "label", str, what),
                    _get(p, "pinned_at", str, what),
                )
                for p in _get(body, "pins", list, what)
            ),
            tombstones=tuple(
                Tombstone(
                    CheckpointRecord.from_dict(_get(t, "record", dict, what)),
                    _get(t, "dropped_seq", int, what),
                    _get(t, "state", str, what),
                )
                for t in _get(body, "tombstones", list, what)
            ),
            settings=settings,
            op=_get(body, "op", str, what),
            updated_at=_get(body, "updated_at", str, what),
            nonce=_get(body, "nonce", str, what),
        )
    except (AttributeError, TypeError, ConfigurationError) as exc:
        raise CorruptRecordError(f"{what} is malformed ({exc})") from None
    if latest.seq < 1 or latest.parent_seq != latest.seq - 1:
        raise CorruptRecordError(f"{what}: seq {latest.seq} / parent {latest.parent_seq} broken")
    return latest


# --- transitions (each returns the next LATEST; seq +1, parent_seq = base.seq) ------------


def initial(writer: Writer, settings: Settings, now: dt.datetime) -> Latest:
    """The first LATEST of a new run (epoch 1, nothing committed)."""
    return Latest(
        seq=1,
        parent_seq=0,
        writer=writer,
        current=None,
        settings=settings,
        op="claim",
        updated_at=iso(now),
        nonce=secrets.token_hex(8),
    )


def _next(base: Latest, now: dt.datetime, op: str, **changes: Any) -> Latest:
    return dataclasses.replace(
        base,
        seq=base.seq + 1,
        parent_seq=base.seq,
        op=op,
        updated_at=iso(now),
        nonce=secrets.token_hex(8),
        **changes,
    )


def claim(base: Latest, writer_id: str, settings: Settings, now: dt.datetime) -> Latest:
    """A new writer takes over: epoch +1 fences every older writer."""
    writer = Writer(epoch=base.writer.epoch + 1, id=writer_id, claimed_at=iso(now))
    return _next(base, now, "claim", writer=writer, settings=settings)


def _apply_retention(
    base: Latest,
    current: CheckpointRecord | None,
    history: Sequence[CheckpointRecord],
    settings: Settings,
    dropped_seq: int,
) -> tuple[tuple[CheckpointRecord, ...], tuple[Tombstone, ...]]:
    """Split ``history`` into what ``settings``' retention keeps (with ``current`` and the
    pins) and new tombstones, dated by ``dropped_seq`` (``cloudckpt.retention``)."""
    kept = settings.retention.kept(current, history, base.pinned_ids())
    keep = [r for r in history if r.commit_id in kept]
    drop = [r for r in history if r.commit_id not in kept]
    tombstones = base.tombstones + tuple(Tombstone(r, dropped_seq) for r in drop)
    return tuple(keep), tombstones


def commit(base: Latest, record: CheckpointRecord, settings: Settings, now: dt.datetime) -> Latest:
    """``record`` becomes current; the old current moves to history; retention drops the
    rest to tombstones (nothing is deleted here: GC does that after the grace period)."""
    history = ((base.current,) if base.current else ()) + base.history
    history, tombstones = _apply_retention(base, record, history, settings, base.seq + 1)
    return _next(
        base,
        now,
        "commit",
        current=record,
        history=history,
        tombstones=tombstones,
        settings=settings,
    )


def pin(base: Latest, commit_id: str, label: str, now: dt.datetime) -> Latest:
    """Keep checkpoint ``commit_id`` regardless of retention. A checkpoint that retention
    dropped but GC has not started deleting (a ``pending`` tombstone) is brought back."""
    rec = next((r for r in base.retained() if r.commit_id == commit_id), None)
    history, tombstones = base.history, base.tombstones
    if rec is None:
        dropped = next((t for t in base.tombstones if t.record.commit_id == commit_id), None)
        if dropped is None or dropped.state != "pending":
            raise ConfigurationError(f"checkpoint {commit_id} is not retained; cannot pin it")
        rec = dropped.record
        tombstones = tuple(t for t in tombstones if t is not dropped)
        history = tuple(sorted((*history, rec), key=lambda r: r.committed_at, reverse=True))
    pins = tuple(p for p in base.pins if p.commit_id != commit_id)
    pins += (Pin(commit_id, rec.step, label, iso(now)),)
    return _next(base, now, "pin", pins=pins, history=history, tombstones=tombstones)


def unpin(base: Latest, commit_id: str | Iterable[str], now: dt.datetime) -> Latest:
    """Remove the pins of one checkpoint (or several, in one write); retention then
    decides whether they stay."""
    ids = {commit_id} if isinstance(commit_id, str) else set(commit_id)
    pins = tuple(p for p in base.pins if p.commit_id not in ids)
    unpinned = dataclasses.replace(base, pins=pins)
    history, tombstones = _apply_retention(
        unpinned, base.current, base.history, base.settings, base.seq + 1
    )
    return _next(unpinned, now, "unpin", history=history, tombstones=tombstones)


def mark_deleting(base: Latest, commit_ids: Iterable[str], now: dt.datetime) -> Latest:
    """GC step 1: tombstones about to be deleted are marked so no one resurrects them."""
    ids = set(commit_ids)
    tombstones = tuple(
        dataclasses.replace(t, state="deleting") if t.record.commit_id in ids else t
        for t in base.tombstones
    )
    return _next(base, now, "gc-mark", tombstones=tombstones)


def forget_tombstones(base: Latest, commit_ids: Iterable[str], now: dt.datetime) -> Latest:
    """GC last step: the deleted tombstones leave LATEST."""
    ids = set(commit_ids)
    tombstones = tuple(t for t in base.tombstones if t.record.commit_id not in ids)
    return _next(base, now, "gc-forget", tombstones=tombstones)


def sweep(base: Latest, now: dt.datetime) -> Latest:
    """GC, before deleting unreferenced attempts: a write that changes nothing but ``seq``.
    A commit that was decided before it and delayed in flight then fails its
    compare-and-swap, re-reads and re-checks its deadline (StaleAttemptError), so it
    cannot land after GC judged its attempt old enough to delete."""
    return _next(base, now, "gc-sweep")
