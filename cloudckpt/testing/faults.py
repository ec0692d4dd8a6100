"""A fault-injecting store wrapper, for cloudckpt's tests and for users testing their setup.

Wrap any store and add rules; each rule matches calls by operation and key and injects a
fault, a fixed number of times or with a probability drawn from a seeded RNG::

    from cloudckpt.testing.faults import FaultInjectingStore, Rule, LoseResponse
    store = FaultInjectingStore(open_store(url), seed=7)
    store.add(Rule(ops={"put"}, key="LATEST", fault=LoseResponse(), times=1))
    mgr = CheckpointManager(store, ...)

Faults (what real networks and stores do):

- ``FailBefore``: the request fails before it has any effect (a refused connection, a 503).
- ``LoseResponse``: the request is applied, then the answer is lost (a timeout).
- ``DeliverTwice``: the request is applied twice (an SDK retry after a lost answer); a
  conditional write then answers "precondition failed" about its own success.
- ``Conflict``: S3's 409 ConditionalRequestConflict (nothing applied).
- ``Latency``: the call sleeps first.
- ``Truncate``: the store keeps fewer bytes than were sent, and says nothing.

At-rest damage: ``flip_bit(store, key)`` and ``store.inner.delete("LATEST")``.
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
    OutcomeUnknownError,
    StoreConflictError,
    StoreError,
    TransientStoreError,
)
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
    """Apply, then lose the answer (a timeout after the store acted)."""

    name = "lose_response"

    def run(self, call, op, key, store):
        call()
        error = OutcomeUnknownError if op in WRITE_OPS else TransientStoreError
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
        store._truncate_next = self.keep
        try:
            return call()
        finally:
            store._truncate_next = None


@dataclasses.dataclass
class Rule:
    """Inject ``fault`` into calls of ``ops`` on keys matching ``key`` (an fnmatch pattern or
    a predicate), at most ``times`` times (None: unlimited), each with ``probability``.
    ``modes`` restricts puts to some write modes (e.g. ``{"update"}``)."""

    fault: Fault
    ops: frozenset[str] | set[str] = frozenset({"put"})
    key: str | Callable[[str], bool] = "*"
    times: int | None = 1
    probability: float = 1.0
    modes: frozenset[str] | set[str] | None = None

    def matches(self, op: str, key: str, mode: str | None, rng: random.Random) -> bool:
        if op not in self.ops or self.times == 0:
            return False
        if self.modes is not None and mode not in self.modes:
            return False
        ok = fnmatch.fnmatchcase(key, self.key) if isinstance(self.key, str) else self.key(key)
        return ok and (self.probability >= 1.0 or rng.random() < self.probability)


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
        self._truncate_next: int | None = None

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
                self.injected[rule.fault.name] += 1
        if rule is None:
            return call()
        return rule.fault.run(call, op, key, self)

    def _data(self, data: bytes | memoryview) -> bytes | memoryview:
        keep = self._truncate_next
        return data if keep is None else bytes(data)[:keep]

    # -- forwarded calls with injection points --

    def head(self, key: str) -> ObjectInfo:
        return self._call("head", key, lambda: self.inner.head(key))

    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        return self._call("get", key, lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._call("get_range", key, lambda: self.inner.get_range(key, start, length))

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


__all__ = [
    "Conflict",
    "DeliverTwice",
    "FailBefore",
    "Fault",
    "FaultInjectingStore",
    "Latency",
    "LoseResponse",
    "Rule",
    "Truncate",
    "flip_bit",
]
