"""The commit protocol's records and transitions. Pure: no I/O, no clocks read here.

Object layout under a run URL (docs/design.md §2; ``files/`` is our addition, see below)::

    LATEST                                   the only mutable object (conditional puts only)
    ckpt/<step:012d>-e<epoch>-<attempt>/     one prefix per save attempt, never reused
        ATTEMPT.json                         written first: who started it, when (store clock)
        files/<relative/path>                whole files (chunking off), each written once
        chunks/<sha256>                      content-addressed chunks this attempt stored
                                             first; later manifests name them here
                                             (``cloudckpt.chunks``)
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
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import posixpath
import re
import secrets
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cloudckpt.digest import ALGORITHM, CHUNK_SIZE
from cloudckpt.errors import ConfigurationError, CorruptRecordError, UnsafePathError
from cloudckpt.retention import RetentionPolicy

# LATEST /2: records may carry ``owned_bytes`` and manifests may be chunked (/2). An older
# cloudckpt must not read (and above all not garbage-collect) a run whose checkpoints share
# chunks, so every LATEST this version writes is /2 at least; /1 is still read.
LATEST_FORMAT = "cloudckpt.latest/2"
# LATEST /3: settings may keep the best checkpoints by a metric or one per period of time,
# and records may carry ``metrics``. A /2 writer would ignore those rules (and drop the
# metrics when it rewrites LATEST), then apply plain keep_last and drop the best checkpoint:
# a LATEST that uses any of it is written as /3, which /2 versions refuse to read.
LATEST_FORMAT_RETENTION = "cloudckpt.latest/3"
LATEST_FORMATS_READ = ("cloudckpt.latest/1", LATEST_FORMAT, LATEST_FORMAT_RETENTION)
# Manifest formats. A new field that an older reader may safely ignore (a file's ``mode``:
# an older cloudckpt restores the file with its default permissions) is added without a
# new format; one an older reader must not ignore (chunks: it would restore nothing of a
# chunked file) gets a new format, which older readers refuse by name.
MANIFEST_FORMAT = "cloudckpt.manifest/1"
# A manifest whose files are lists of content-addressed chunks (``cloudckpt.chunks``).
MANIFEST_FORMAT_CHUNKED = "cloudckpt.manifest/2"
ATTEMPT_FORMAT = "cloudckpt.attempt/1"

LATEST_KEY = "LATEST"
CKPT_PREFIX = "ckpt/"
COMMITS_PREFIX = "commits/"
MANIFEST_NAME = "MANIFEST.json"
ATTEMPT_NAME = "ATTEMPT.json"
FILES_DIR = "files/"
CHUNKS_DIR = "chunks/"

# Bounds on what a reader accepts from the store (hostile or damaged records).
MAX_LATEST_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_FILE_SIZE = 1 << 50  # 1 PiB: S3's object limit is 5 TiB
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CKPT_RE = re.compile(r"^ckpt/(\d{12})-e(\d+)-([0-9A-Za-z]+-[0-9a-f]+)/$")


# --- canonical JSON ----------------------------------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no whitespace, no NaN/inf, UTF-8."""
    try:
        return json.dumps(
            obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"value cannot be stored as checkpoint metadata: {exc}",
            hint="Metadata must be JSON: dicts, lists, str, int, finite float, bool, None",
        ) from None


def _sealed(body: dict[str, Any]) -> bytes:
    """``body`` plus ``self_sha256`` (the digest of the canonical body without it)."""
    body = {k: v for k, v in body.items() if k != "self_sha256"}
    body["self_sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    return canonical_json(body)


def _unseal(data: bytes, what: str, limit: int) -> dict[str, Any]:
    if len(data) > limit:
        raise CorruptRecordError(f"{what} is {len(data)} bytes, over the {limit}-byte limit")
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptRecordError(f"{what} is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise CorruptRecordError(f"{what} is not a JSON object")
    claimed = body.pop("self_sha256", None)
    actual = hashlib.sha256(canonical_json(body)).hexdigest()
    if claimed != actual:
        raise CorruptRecordError(f"{what} fails its self-check (self_sha256 mismatch)")
    return body


def _get(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = d.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptRecordError(f"{what}: field {key!r} is missing or has the wrong type")
    return value


# --- identifiers ------------------------------------------------------------------------


def new_attempt_id(now: dt.datetime) -> str:
    """A unique, time-ordered attempt id such as ``20261202T120000123Z-9f3a0c1e``."""
    stamp = now.astimezone(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}{now.microsecond // 1000:03d}Z-{secrets.token_hex(4)}"


def new_writer_id() -> str:
    """Identifies one writer process: host, pid and a random part."""
    host = re.sub(r"[^0-9A-Za-z.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}:{os.getpid()}:{secrets.token_hex(4)}"


def ckpt_prefix(step: int, epoch: int, attempt_id: str) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or step >= 10**12:
        raise ConfigurationError(
            f"step must be an int in [0, 10**12), got {step!r}",
            hint="Pass the training step (global step) as a non-negative int",
        )
    return f"{CKPT_PREFIX}{step:012d}-e{epoch}-{attempt_id}/"


def parse_ckpt_prefix(prefix: str) -> tuple[int, int, str] | None:
    """(step, epoch, attempt id) of an attempt prefix, or None if it is not one."""
    m = _CKPT_RE.match(prefix)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def is_sha256(text: str) -> bool:
    """Whether ``text`` is a lowercase hex SHA-256 (a chunk's name)."""
    return bool(_HEX64.match(text))


def commit_record_key(seq: int) -> str:
    return f"{COMMITS_PREFIX}{seq:020d}.json"


def iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_iso(s: str) -> dt.datetime:
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00"))


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

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["metadata"] = dict(self.metadata)
        d["metrics"] = dict(self.metrics)
        if self.owned_bytes is None:
            del d["owned_bytes"]
        if not self.metrics:
            del d["metrics"]
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
        )
        if parse_ckpt_prefix(rec.ckpt) is None:
            raise CorruptRecordError(f"{what}: {rec.ckpt!r} is not a checkpoint prefix")
        if not _HEX64.match(rec.manifest_sha256):
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


class _Inherit:
    """Default of a run setting: keep what the run's LATEST says (or the default for a new
    run), so a writer that does not say otherwise never silently changes retention."""

    def __repr__(self) -> str:
        return "INHERIT"


INHERIT: Any = _Inherit()


@dataclasses.dataclass(frozen=True)
class Settings:
    """Run-wide settings every writer and GC honour, carried in LATEST. The retention
    fields are those of ``retention.RetentionPolicy``.

    Raises (constructor): ConfigurationError for an invalid retention policy.
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    gc_grace_s: int = 2 * 3600
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    keep_periods: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        self.retention  # noqa: B018 - validates

    @property
    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            keep_best=self.keep_best,
            best_metric=self.best_metric,
            best_mode=self.best_mode,
            keep_periods=self.keep_periods,
        )

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
    def from_dict(cls, s: Mapping[str, Any], what: str) -> Settings:
        """Raises CorruptRecordError (a wrong type, or a setting this version does not
        know: a rule it would ignore, dropping what the rule keeps) or ConfigurationError
        (a bad policy)."""
        unknown = sorted(set(s) - _SETTINGS_KEYS)
        if unknown:
            raise CorruptRecordError(
                f"{what}: settings has {unknown[0]!r}, which this cloudckpt does not know "
                "(written by a newer version? upgrade cloudckpt to use this run)"
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
        if self.settings.retention.extended or any(r.metrics for r in records):
            return LATEST_FORMAT_RETENTION
        return LATEST_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
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
        return _sealed(self.to_dict())

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
    """Parse and verify LATEST (or a commit record). Raises CorruptRecordError."""
    body = _unseal(data, what, MAX_LATEST_BYTES)
    if body.get("format") not in LATEST_FORMATS_READ:
        raise CorruptRecordError(
            f"{what} has format {body.get('format')!r}; this cloudckpt reads "
            f"{' and '.join(map(repr, LATEST_FORMATS_READ))}"
        )
    try:
        w = _get(body, "writer", dict, what)
        writer = Writer(
            _get(w, "epoch", int, what), _get(w, "id", str, what), _get(w, "claimed_at", str, what)
        )
        cur = body.get("current")
        settings = Settings.from_dict(_get(body, "settings", dict, what), what)
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


# --- manifests ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChunkRef:
    """One content-addressed chunk of a file: stored at ``<owner>chunks/<sha256>``, where
    ``owner`` is the prefix of the attempt that uploaded it first (``cloudckpt.chunks``)."""

    owner: str
    sha256: str
    size: int

    @property
    def key(self) -> str:
        return f"{self.owner}{CHUNKS_DIR}{self.sha256}"


#: The permission bits a manifest may record for a file (``FileEntry.mode``). Restores
#: apply at most these, less the process umask: never setuid, setgid or sticky.
MODE_BITS = 0o777


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A file of a checkpoint. ``chunks`` is None for a file stored whole under the
    attempt's ``files/``; otherwise the file is the concatenation of these chunks.
    ``mode``: the file's permission bits when it was saved (``MODE_BITS`` at most), None
    when unknown (saved from memory, or by a cloudckpt that did not record modes)."""

    path: str
    size: int
    digest: str
    chunks: tuple[ChunkRef, ...] | None = None
    mode: int | None = None

    def to_json(self, owners: dict[str, int]) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "size": self.size, "digest": self.digest}
        if self.chunks is not None:
            d["chunks"] = [
                [owners.setdefault(c.owner, len(owners)), c.sha256, c.size] for c in self.chunks
            ]
        if self.mode is not None:
            # An optional field: readers that predate it ignore it (and restore 0644), so
            # recording it needs no new manifest format (see MANIFEST_FORMAT).
            d["mode"] = self.mode
        return d


@dataclasses.dataclass(frozen=True)
class Manifest:
    ckpt: str
    step: int
    epoch: int
    commit_id: str
    writer_id: str
    created_at: str
    files: tuple[FileEntry, ...]
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    algorithm: str = ALGORITHM
    chunk_size: int = CHUNK_SIZE
    # ``retention.clean_metrics``; absent from the body when empty (then byte-identical
    # to a manifest written before metrics existed, which an older cloudckpt reads).
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def chunked(self) -> bool:
        return any(f.chunks is not None for f in self.files)

    @property
    def owned_bytes(self) -> int:
        """Bytes stored under this checkpoint's own prefix: plain files, plus each distinct
        chunk it uploaded first."""
        own = {c.sha256: c.size for f in self.files for c in f.chunks or () if c.owner == self.ckpt}
        return sum(f.size for f in self.files if f.chunks is None) + sum(own.values())

    def to_bytes(self) -> bytes:
        owners: dict[str, int] = {}
        files = [f.to_json(owners) for f in self.files]
        extra: dict[str, Any] = {}
        if self.chunked:
            extra["chunk_owners"] = sorted(owners, key=owners.__getitem__)
        if self.metrics:
            extra["metrics"] = dict(self.metrics)
        return _sealed(
            {
                **extra,
                "format": MANIFEST_FORMAT_CHUNKED if self.chunked else MANIFEST_FORMAT,
                "ckpt": self.ckpt,
                "step": self.step,
                "epoch": self.epoch,
                "commit_id": self.commit_id,
                "writer_id": self.writer_id,
                "created_at": self.created_at,
                "metadata": dict(self.metadata),
                "digest": {"algorithm": self.algorithm, "chunk_size": self.chunk_size},
                "files": files,
                "total_bytes": self.total_bytes,
            }
        )

    def record(self, data: bytes, committed_at: dt.datetime) -> CheckpointRecord:
        """The LATEST record of this manifest, whose serialised bytes are ``data``."""
        return CheckpointRecord(
            ckpt=self.ckpt,
            step=self.step,
            epoch=self.epoch,
            commit_id=self.commit_id,
            manifest_sha256=hashlib.sha256(data).hexdigest(),
            manifest_size=len(data),
            committed_at=iso(committed_at),
            total_bytes=self.total_bytes,
            num_files=len(self.files),
            metadata=dict(self.metadata),
            owned_bytes=self.owned_bytes,
            metrics=dict(self.metrics),
        )


def safe_relpath(path: str) -> str:
    """Return ``path`` if it is a safe relative file path; raise UnsafePathError if not.

    Refused: absolute paths, drive letters, backslashes, ``..``/``.``/empty segments,
    control characters. What passes can only name a file below the destination.
    """
    if not isinstance(path, str) or not path or len(path) > 4096:
        raise UnsafePathError(f"manifest path {path!r} is empty or too long")
    if (
        path.startswith("/")
        or "\\" in path
        or re.match(r"^[A-Za-z]:", path)
        or any(ord(c) < 32 or ord(c) == 127 for c in path)
    ):
        raise UnsafePathError(f"manifest path {path!r} is absolute or has illegal characters")
    segments = path.split("/")
    if any(s in ("", ".", "..") for s in segments) or posixpath.normpath(path) != path:
        raise UnsafePathError(f"manifest path {path!r} has '..', '.' or empty segments")
    return path


def validate_file_entries(entries: Sequence[FileEntry]) -> None:
    """Paths safe and unique, no file that is also a directory of another, sane sizes."""
    seen: set[str] = set()
    dirs: set[str] = set()
    for e in entries:
        safe_relpath(e.path)
        if e.path in seen:
            raise UnsafePathError(f"manifest lists {e.path!r} twice")
        seen.add(e.path)
        parts = e.path.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        if not 0 <= e.size <= MAX_FILE_SIZE:
            raise CorruptRecordError(f"manifest: size {e.size} of {e.path!r} out of range")
        if not _HEX64.match(e.digest):
            raise CorruptRecordError(f"manifest: digest of {e.path!r} is not a hex SHA-256")
        if e.mode is not None and (
            not isinstance(e.mode, int) or isinstance(e.mode, bool) or not 0 <= e.mode <= 0o7777
        ):
            raise CorruptRecordError(f"manifest: mode of {e.path!r} is not a file mode")
        if e.chunks is not None:
            _check_chunks(e)
    clash = seen & dirs
    if clash:
        raise UnsafePathError(f"manifest path {sorted(clash)[0]!r} is both a file and a directory")


def _chunk_ref(c: Any, owners: Sequence[str], what: str) -> ChunkRef:
    if (
        not isinstance(c, list)
        or len(c) != 3
        or not isinstance(c[0], int)
        or isinstance(c[0], bool)
        or not 0 <= c[0] < len(owners)
        or not isinstance(c[1], str)
        or not isinstance(c[2], int)
        or isinstance(c[2], bool)
    ):
        raise CorruptRecordError(f"{what}: malformed chunk reference {c!r:.80}")
    return ChunkRef(owners[c[0]], c[1], c[2])


def _check_chunks(e: FileEntry) -> None:
    """Chunks: hex SHA-256 names, positive sizes within one digest leaf, adding up to the
    file's size."""
    offset = 0
    for c in e.chunks or ():
        if not _HEX64.match(c.sha256):
            raise CorruptRecordError(f"manifest: a chunk of {e.path!r} is not a hex SHA-256")
        if c.size <= 0 or offset // CHUNK_SIZE != (offset + c.size - 1) // CHUNK_SIZE:
            raise CorruptRecordError(f"manifest: a chunk of {e.path!r} crosses a digest leaf")
        offset += c.size
    if offset != e.size:
        raise CorruptRecordError(f"manifest: the chunks of {e.path!r} do not add up to its size")


def parse_manifest(data: bytes, record: CheckpointRecord | None = None) -> Manifest:
    """Parse and verify a manifest (against its LATEST record when given).

    Raises CorruptRecordError (damaged, or not the manifest ``record`` names) or
    UnsafePathError (a path that would escape the destination).
    """
    what = f"manifest of {record.ckpt}" if record else "manifest"
    if record is not None:
        if len(data) != record.manifest_size:
            raise CorruptRecordError(
                f"{what} is {len(data)} bytes, LATEST recorded {record.manifest_size}"
            )
        if hashlib.sha256(data).hexdigest() != record.manifest_sha256:
            raise CorruptRecordError(f"{what} does not match the digest LATEST recorded")
    body = _unseal(data, what, MAX_MANIFEST_BYTES)
    fmt = body.get("format")
    if fmt not in (MANIFEST_FORMAT, MANIFEST_FORMAT_CHUNKED):
        raise CorruptRecordError(f"{what} has unknown format {fmt!r}")
    digest = _get(body, "digest", dict, what)
    owners: list[str] = []
    if fmt == MANIFEST_FORMAT_CHUNKED:
        owners = _get(body, "chunk_owners", list, what)
        if not all(isinstance(o, str) and parse_ckpt_prefix(o) for o in owners):
            raise CorruptRecordError(f"{what}: a chunk owner is not a checkpoint prefix")
    chunked = fmt == MANIFEST_FORMAT_CHUNKED
    files = [_file_entry(f, chunked, owners, what) for f in _get(body, "files", list, what)]
    manifest = Manifest(
        ckpt=_get(body, "ckpt", str, what),
        step=_get(body, "step", int, what),
        epoch=_get(body, "epoch", int, what),
        commit_id=_get(body, "commit_id", str, what),
        writer_id=_get(body, "writer_id", str, what),
        created_at=_get(body, "created_at", str, what),
        files=tuple(files),
        metadata=_get(body, "metadata", dict, what),
        algorithm=_get(digest, "algorithm", str, what),
        chunk_size=_get(digest, "chunk_size", int, what),
        metrics=_get(body, "metrics", dict, what) if "metrics" in body else {},
    )
    if manifest.algorithm != ALGORITHM or not 0 < manifest.chunk_size <= 1 << 30:
        raise CorruptRecordError(f"{what}: unsupported digest {manifest.algorithm!r}")
    validate_file_entries(manifest.files)
    if record is not None and (manifest.ckpt, manifest.commit_id) != (
        record.ckpt,
        record.commit_id,
    ):
        raise CorruptRecordError(f"{what} belongs to another checkpoint")
    return manifest


def _file_entry(f: Any, chunked: bool, owners: list[str], what: str) -> FileEntry:
    """One of a manifest's file entries (``chunked``: the format that may name chunks of
    ``owners``). Raises CorruptRecordError (``what`` says whose manifest)."""
    if not isinstance(f, dict):
        raise CorruptRecordError(f"{what}: file entry is not an object")
    chunks = None
    if chunked and "chunks" in f:
        chunks = tuple(_chunk_ref(c, owners, what) for c in _get(f, "chunks", list, what))
    return FileEntry(
        _get(f, "path", str, what),
        _get(f, "size", int, what),
        _get(f, "digest", str, what),
        chunks,
        None if f.get("mode") is None else _get(f, "mode", int, what),
    )


def attempt_body(
    *, ckpt: str, step: int, epoch: int, writer_id: str, started_at: dt.datetime
) -> bytes:
    """The small ATTEMPT.json written first into every attempt prefix."""
    return canonical_json(
        {
            "format": ATTEMPT_FORMAT,
            "ckpt": ckpt,
            "step": step,
            "epoch": epoch,
            "writer_id": writer_id,
            "started_at": iso(started_at),
        }
    )
