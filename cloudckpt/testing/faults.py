"""A fault-injecting store wrapper, for cloudckpt's tests and for users testing their setup.

Wrap any store and add rules; each rule matches calls by operation, key (an fnmatch pattern
or a predicate) and write mode, and injects a fault a fixed number of times, or with a
probability drawn from the store's seeded RNG (so a seed replays)::

    from cloudckpt import CheckpointManager, open_store
    from cloudckpt.testing.faults import FaultInjectingStore, LoseResponse, Rule

    store = FaultInjectingStore(open_store("s3://bucket/run", options), seed=7)
    # The first compare-and-swap of LATEST lands, but its answer is lost:
    store.add(Rule(LoseResponse(), ops={"put"}, key="LATEST", modes={"update"}))
    # One in twenty data uploads fails before it reaches the store:
    store.add(Rule(FailBefore(), ops={"put", "upload_part"}, key="ckpt/*/files/*",
                   times=None, probability=0.05))
    with CheckpointManager(store) as mgr:
        ...
    print(store.injected)          # Counter({'lose_response': 1, 'fail_before': 3})

Faults (what real networks and stores do):

- ``FailBefore(error)``: the request fails before it has any effect (a refused connection,
  a 503, a 403 with ``PermissionDeniedError``...).
- ``LoseResponse(error, meanwhile)``: the request is applied, then the answer is lost (a
  timeout, or a 500 after the write). ``meanwhile`` runs in the gap: another client acting
  between the write landing and the caller learning of it.
- ``DeliverTwice``: the request is applied twice (an SDK retry after a lost answer); a
  conditional write then answers "precondition failed" about its own success.
- ``Conflict``: S3's 409 ConditionalRequestConflict (nothing applied).
- ``Latency(seconds)``: the call sleeps first.
- ``Truncate(keep)``: the store keeps only the first ``keep`` bytes, and says nothing.
- ``ShortRead(keep)``: a ranged read returns only its first ``keep`` bytes (default half),
  and says nothing (a cut response the transport missed).
- ``Callback(before, after)``: run code of yours just before or after the call (to
  interleave another writer's action at an exact point).
- ``Crash(after)``: the calling process dies (``SimulatedCrash``) before the request is
  sent, or after it was applied.

Rules: ``times`` (None: unlimited), ``probability``, ``skip`` (let the first N matches
through: "fail the third part"), ``modes`` ({"create", "update", "overwrite"}); ``fired``
counts the faults a rule injected.

At-rest damage (directly on the store, no rule needed): ``flip_bit(store, key)``,
``truncate_object(store, key, keep)`` and ``delete_latest(store)``.

Named crash points inside save, commit, restore and GC are in ``cloudckpt.failpoints``.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cloudckpt.errors import (
    ObjectNotFoundError,
    OutcomeUnknownError,
    StoreConflictError,
    StoreError,
    TransientStoreError,
)
from cloudckpt.failpoints import SimulatedCrash
from cloudckpt.stores.base import (
    CREATE,
    OVERWRITE,
    Create,
    MultipartUpload,
    ObjectInfo,
    PartInfo,
    PutMode,
    Store,
    Update,
    crc32c_b64,
)
from cloudckpt.testing.wrappers import ForwardingStore

WRITE_OPS = frozenset(
    {"put", "delete", "upload_part", "complete_multipart", "abort_multipart", "create_multipart"}
)
READ_OPS = frozenset({"get", "get_range", "head", "list", "list_multipart"})


class Fault:
    """Base class: ``run(call)`` performs (or not) the call and returns or raises."""

    name = "fault"

    def run(self, call: Callable[[], Any], op: str, key: str, store: FaultInjectingStore) -> Any:
        raise NotImplementedError


@dataclasses.dataclass
class FailBefore(Fault):
    """Fail without applying (connection refused, 503 before processing)."""

    error: type[StoreError] = TransientStoreError
    name = "fail_before"

    def run(self, call, op, key, store):
        raise self.error(f"injected failure before {op} {key}", key=key)


@dataclasses.dataclass
class LoseResponse(Fault):
    """Apply, then lose the answer (a timeout after the store acted).

    ``error``: what the caller sees (default: ``OutcomeUnknownError`` for writes,
    ``TransientStoreError`` for reads). ``meanwhile``: called after the request was
    applied and before the caller hears anything (another client acting in the gap).
    """

    error: type[StoreError] | None = None
    meanwhile: Callable[[], Any] | None = None
    name = "lose_response"

    def run(self, call, op, key, store):
        call()
        if self.meanwhile is not None:
            self.meanwhile()
        error = self.error or (OutcomeUnknownError if op in WRITE_OPS else TransientStoreError)
        raise error(f"injected timeout after {op} {key} was applied", key=key)


@dataclasses.dataclass
class DeliverTwice(Fault):
    """Apply twice, as an SDK retry after a lost answer does; the caller sees the second
    answer (for a conditional write: precondition failed, about its own write)."""

    name = "deliver_twice"

    def run(self, call, op, key, store):
        call()
        return call()


@dataclasses.dataclass
class Conflict(Fault):
    """S3's 409 ConditionalRequestConflict: nothing applied, retry."""

    name = "conflict"

    def run(self, call, op, key, store):
        raise StoreConflictError(f"injected 409 conflict on {op} {key}", key=key)


@dataclasses.dataclass
class Latency(Fault):
    """Sleep ``seconds`` before the call (a slow network or an overloaded store)."""

    seconds: float = 0.05
    name = "latency"

    def run(self, call, op, key, store):
        time.sleep(self.seconds)
        return call()


@dataclasses.dataclass
class Truncate(Fault):
    """The store keeps only the first ``keep`` bytes of a put or part, silently."""

    keep: int = 1
    name = "truncate"

    def run(self, call, op, key, store):
        store._local.truncate = self.keep
        try:
            return call()
        finally:
            store._local.truncate = None


@dataclasses.dataclass
class ShortRead(Fault):
    """A ranged read (``get_range`` or ``get_range_into``) comes back with fewer bytes
    than the store sent, and no error: a response cut short that the transport did not
    notice. ``keep``: at most this many bytes (None: half of what was sent)."""

    keep: int | None = None
    name = "short_read"

    def run(self, call, op, key, store):
        if op != "get_range":
            raise ValueError(f"ShortRead applies to ranged reads (get_range), not {op}")
        data = call()
        return data[: len(data) // 2 if self.keep is None else self.keep]


@dataclasses.dataclass
class Callback(Fault):
    """Run ``before()`` just before the call and ``after(result)`` just after it (the
    call itself is unchanged). Use it to make another writer act at an exact point."""

    before: Callable[[], Any] | None = None
    after: Callable[[Any], Any] | None = None
    name = "callback"

    def run(self, call, op, key, store):
        if self.before is not None:
            self.before()
        result = call()
        if self.after is not None:
            self.after(result)
        return result


@dataclasses.dataclass
class Crash(Fault):
    """The calling process dies: ``SimulatedCrash`` (a ``BaseException``) before the
    request is sent, or (``after=True``) once it was applied."""

    after: bool = False
    name = "crash"

    def run(self, call, op, key, store):
        if self.after:
            call()
        raise SimulatedCrash(f"{op} {key} ({'after' if self.after else 'before'})")


@dataclasses.dataclass
class Rule:
    """Inject ``fault`` into calls of ``ops`` on keys matching ``key`` (an fnmatch pattern or
    a predicate), at most ``times`` times (None: unlimited), each with ``probability``.
    ``modes`` restricts puts to some write modes (e.g. ``{"update"}``); ``skip`` lets the
    first N matching calls through. ``fired`` counts the faults injected.

    Operations: get, get_range (also ``get_range_into``: the same ranged GET), head, list,
    list_multipart (reads); put, delete,
    create_multipart, upload_part, complete_multipart, abort_multipart (writes). For
    multipart calls ``key`` is the object's key; for list calls it is the prefix.
    """

    fault: Fault
    ops: frozenset[str] | set[str] = frozenset({"put"})
    key: str | Callable[[str], bool] = "*"
    times: int | None = 1
    probability: float = 1.0
    modes: frozenset[str] | set[str] | None = None
    skip: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.ops) - WRITE_OPS - READ_OPS
        if unknown:
            raise ValueError(f"unknown store operation(s) {sorted(unknown)}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be within [0, 1], got {self.probability}")

    def matches(self, op: str, key: str, mode: str | None, rng: random.Random) -> bool:
        if op not in self.ops or self.times == 0:
            return False
        if self.modes is not None and mode not in self.modes:
            return False
        ok = fnmatch.fnmatchcase(key, self.key) if isinstance(self.key, str) else self.key(key)
        if not ok or (self.probability < 1.0 and rng.random() >= self.probability):
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        return True


def _mode_name(mode: PutMode) -> str:
    if isinstance(mode, Create):
        return "create"
    return "update" if isinstance(mode, Update) else "overwrite"


class FaultInjectingStore(ForwardingStore):
    """Forwards to ``inner``, injecting the faults of its rules. Thread-safe.

    ``injected`` counts the faults injected, by fault name.
    """

    def __init__(self, inner: Store, rules: Sequence[Rule] = (), *, seed: int = 0) -> None:
        super().__init__(inner)
        self.rules: list[Rule] = list(rules)
        self.rng = random.Random(seed)
        self.injected: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._local = threading.local()  # per-thread state of a running Truncate

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def _call(self, op: str, key: str, call: Callable[[], Any], mode: str | None = None) -> Any:
        with self._lock:
            self.calls[op] += 1
            rule = next((r for r in self.rules if r.matches(op, key, mode, self.rng)), None)
            if rule is not None:
                if rule.times is not None:
                    rule.times -= 1
                rule.fired += 1
                self.injected[rule.fault.name] += 1
        if rule is None:
            return call()
        return rule.fault.run(call, op, key, self)

    def _data(self, data: bytes | memoryview) -> bytes | memoryview:
        keep = getattr(self._local, "truncate", None)
        return data if keep is None else bytes(data)[:keep]

    # -- forwarded calls with injection points --

    def head(self, key: str) -> ObjectInfo:
        return self._call("head", key, lambda: self.inner.head(key))

    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        return self._call("get", key, lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._call("get_range", key, lambda: self.inner.get_range(key, start, length))

    def get_range_into(self, key: str, start: int, buf: memoryview) -> int:
        """The same operation as ``get_range`` (a ranged GET), so its rules reach the
        zero-copy path. A fault sees the bytes that arrived (a view of ``buf``); what it
        returns instead is copied into ``buf``, its length the answer."""
        sent: list[Any] = [None, 0]

        def call() -> memoryview:
            n = self.inner.get_range_into(key, start, buf)
            sent[:] = [buf[: min(n, len(buf))], n]
            return sent[0]

        out = self._call("get_range", key, call)
        if out is sent[0]:
            return int(sent[1])
        n = min(len(out), len(buf))
        buf[:n] = memoryview(out)[:n]
        return len(out)

    def list(self, prefix: str = ""):
        return iter(self._call("list", prefix, lambda: list(self.inner.list(prefix))))

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        return self._call(
            "put", key, lambda: self.inner.put(key, self._data(data), mode=mode), _mode_name(mode)
        )

    def delete(self, key: str) -> None:
        return self._call("delete", key, lambda: self.inner.delete(key))

    def create_multipart(self, key: str) -> MultipartUpload:
        return self._call("create_multipart", key, lambda: self.inner.create_multipart(key))

    def upload_part(
        self,
        upload: MultipartUpload,
        part_number: int,
        data: bytes | memoryview,
        *,
        crc32c: str | None = None,
    ) -> PartInfo:
        def call() -> PartInfo:
            body = self._data(data)
            # A truncating store also "recomputes" the checksum it was sent, as a broken
            # proxy that re-frames the body would; otherwise the store would catch it.
            crc = crc32c if body is data else crc32c_b64(body)
            return self.inner.upload_part(upload, part_number, body, crc32c=crc)

        return self._call("upload_part", upload.key, call)

    def complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[PartInfo], *, mode: PutMode = CREATE
    ) -> ObjectInfo:
        return self._call(
            "complete_multipart",
            upload.key,
            lambda: self.inner.complete_multipart(upload, parts, mode=mode),
            _mode_name(mode),
        )

    def abort_multipart(self, upload: MultipartUpload) -> None:
        return self._call("abort_multipart", upload.key, lambda: self.inner.abort_multipart(upload))

    def list_multipart(self, prefix: str = ""):
        return self._call("list_multipart", prefix, lambda: self.inner.list_multipart(prefix))


def flip_bit(store: Store, key: str, *, bit: int | None = None, seed: int = 0) -> int:
    """Flip one bit of the stored object ``key`` in place (same size); return its index."""
    data, _ = store.get(key)
    if not data:
        raise ValueError(f"{key} is empty; no bit to flip")
    index = random.Random(seed).randrange(len(data) * 8) if bit is None else bit
    damaged = bytearray(data)
    damaged[index // 8] ^= 1 << (index % 8)
    store.put(key, bytes(damaged), mode=OVERWRITE)
    return index


def truncate_object(store: Store, key: str, keep: int) -> None:
    """Cut the stored object ``key`` to its first ``keep`` bytes (damage at rest)."""
    data, _ = store.get(key)
    store.put(key, data[:keep], mode=OVERWRITE)


def delete_latest(store: Store) -> bytes:
    """Delete LATEST (as an operator's mistake or a lifecycle rule would); return its bytes
    so a test can put them back."""
    from cloudckpt.protocol import LATEST_KEY

    try:
        data, _ = store.get(LATEST_KEY)
    except ObjectNotFoundError:
        return b""
    store.delete(LATEST_KEY)
    return data


__all__ = [
    "Callback",
    "Conflict",
    "Crash",
    "DeliverTwice",
    "FailBefore",
    "Fault",
    "FaultInjectingStore",
    "Latency",
    "LoseResponse",
    "Rule",
    "ShortRead",
    "Truncate",
    "delete_latest",
    "flip_bit",
    "truncate_object",
]
