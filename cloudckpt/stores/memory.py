"""``memory://bucket/prefix``: an in-process store with exact semantics.

This is the oracle for protocol tests: every write gets a new version (also for identical
bytes), preconditions are checked atomically, multipart uploads obey S3's part-size rules,
and the clock is injectable so garbage-collection ages can be driven by tests. Buckets are
process-global and created on first use, so two managers in one process see the same data.
"""

from __future__ import annotations

import builtins
import dataclasses
import datetime as dt
import itertools
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence

from cloudckpt.errors import (
    ChecksumMismatchError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
)
from cloudckpt.stores.base import (
    CREATE,
    OVERWRITE,
    Capabilities,
    Create,
    MultipartUpload,
    ObjectInfo,
    PartInfo,
    PendingUpload,
    PutMode,
    Store,
    Update,
    crc32c_b64,
    utcnow,
    validate_key,
)

Clock = Callable[[], dt.datetime]


class ManualClock:
    """A clock that only moves when told to; pass it as ``clock=`` to a memory store."""

    def __init__(self, start: dt.datetime | None = None) -> None:
        self._now = start or dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
        self._lock = threading.Lock()

    def __call__(self) -> dt.datetime:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> dt.datetime:
        with self._lock:
            self._now += dt.timedelta(seconds=seconds)
            return self._now


@dataclasses.dataclass
class _Object:
    data: bytes
    version: str
    last_modified: dt.datetime


@dataclasses.dataclass
class _Upload:
    key: str
    initiated: dt.datetime
    parts: dict[int, tuple[bytes, str]] = dataclasses.field(default_factory=dict)


class MemoryBucket:
    """The shared state behind every ``memory://<name>/...`` store of one name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.objects: dict[str, _Object] = {}
        self.uploads: dict[str, _Upload] = {}
        self._versions = itertools.count(1)
        self.clock: Clock = utcnow

    def next_version(self) -> str:
        return f"m{next(self._versions)}"


_BUCKETS: dict[str, MemoryBucket] = {}
_BUCKETS_LOCK = threading.Lock()


def memory_bucket(name: str) -> MemoryBucket:
    """The process-global bucket ``name``, created on first use."""
    with _BUCKETS_LOCK:
        bucket = _BUCKETS.get(name)
        if bucket is None:
            bucket = _BUCKETS[name] = MemoryBucket(name)
        return bucket


def drop_memory_bucket(name: str) -> None:
    """Forget bucket ``name`` and everything in it (tests use this between cases)."""
    with _BUCKETS_LOCK:
        _BUCKETS.pop(name, None)


class MemoryStore(Store):
    """A store over a process-global ``MemoryBucket``. See the module docstring."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        clock: Clock | None = None,
        min_part_size: int = 5 * 1024 * 1024,
    ) -> None:
        self._bucket = memory_bucket(bucket)
        if clock is not None:
            self._bucket.clock = clock
        self._prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"memory://{bucket}/{self._prefix}"
        self.capabilities = Capabilities(min_part_size=min_part_size)
        self.clock_resolution = 0.0  # exact: a datetime from the bucket's clock

    @property
    def bucket(self) -> MemoryBucket:
        return self._bucket

    def _full(self, key: str) -> str:
        return self._prefix + validate_key(key)

    def _info(self, key: str, obj: _Object) -> ObjectInfo:
        return ObjectInfo(key, len(obj.data), obj.version, obj.last_modified)

    def now(self) -> dt.datetime:
        return self._bucket.clock()

    def head(self, key: str) -> ObjectInfo:
        with self._bucket.lock:
            obj = self._bucket.objects.get(self._full(key))
            if obj is None:
                raise ObjectNotFoundError(f"{self.url}{key} does not exist", key=key)
            return self._info(key, obj)

    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        with self._bucket.lock:
            obj = self._bucket.objects.get(self._full(key))
            if obj is None:
                raise ObjectNotFoundError(f"{self.url}{key} does not exist", key=key)
            return obj.data, self._info(key, obj)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data, _ = self.get(key)
        return data[start : start + length]

    def _write_locked(self, key: str, full: str, data: bytes, mode: PutMode) -> ObjectInfo:
        current = self._bucket.objects.get(full)
        if isinstance(mode, Create) and current is not None:
            raise PreconditionFailedError(f"{self.url}{key} already exists", key=key)
        if isinstance(mode, Update):
            if current is None:
                raise PreconditionFailedError(
                    f"{self.url}{key} does not exist (compare-and-swap needs it)", key=key
                )
            if current.version != mode.version:
                raise PreconditionFailedError(
                    f"{self.url}{key} changed (version {current.version}, expected {mode.version})",
                    key=key,
                )
        obj = _Object(bytes(data), self._bucket.next_version(), self._bucket.clock())
        self._bucket.objects[full] = obj
        return self._info(key, obj)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        full = self._full(key)
        with self._bucket.lock:
            return self._write_locked(key, full, bytes(data), mode)

    def delete(self, key: str) -> None:
        full = self._full(key)
        with self._bucket.lock:
            self._bucket.objects.pop(full, None)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full_prefix = self._prefix + prefix
        with self._bucket.lock:
            items = sorted(
                (k, o) for k, o in self._bucket.objects.items() if k.startswith(full_prefix)
            )
        for full, obj in items:
            yield self._info(full[len(self._prefix) :], obj)

    # --- multipart ------------------------------------------------------------------

    def create_multipart(self, key: str) -> MultipartUpload:
        full = self._full(key)
        upload_id = uuid.uuid4().hex
        with self._bucket.lock:
            self._bucket.uploads[upload_id] = _Upload(full, self._bucket.clock())
        return MultipartUpload(key, upload_id)

    def _upload(self, upload: MultipartUpload) -> _Upload:
        state = self._bucket.uploads.get(upload.upload_id)
        if state is None or state.key != self._full(upload.key):
            raise ObjectNotFoundError(
                f"multipart upload {upload.upload_id} of {self.url}{upload.key} does not exist",
                key=upload.key,
            )
        return state

    def upload_part(
        self,
        upload: MultipartUpload,
        part_number: int,
        data: bytes | memoryview,
        *,
        crc32c: str | None = None,
    ) -> PartInfo:
        if not 1 <= part_number <= self.capabilities.max_parts:
            raise StoreError(f"part number {part_number} out of range", key=upload.key)
        data = bytes(data)
        actual = crc32c_b64(data)
        if crc32c is not None and crc32c != actual:
            # S3 answers 400 BadDigest; the part is not stored.
            raise ChecksumMismatchError(
                f"part {part_number} of {self.url}{upload.key}: CRC32C mismatch "
                f"(sent {crc32c}, received bytes have {actual})",
                key=upload.key,
            )
        etag = f"p{part_number}-{uuid.uuid4().hex[:12]}"
        with self._bucket.lock:
            self._upload(upload).parts[part_number] = (data, etag)
        return PartInfo(part_number, etag, actual, len(data))

    def complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[PartInfo], *, mode: PutMode = CREATE
    ) -> ObjectInfo:
        if isinstance(mode, Update):
            raise StoreError("compare-and-swap completion of multipart uploads is not offered")
        with self._bucket.lock:
            state = self._upload(upload)
            numbers = [p.part_number for p in parts]
            if not parts or numbers != sorted(set(numbers)):
                raise StoreError(
                    "parts must be non-empty, unique and in ascending order", key=upload.key
                )
            chunks = []
            for i, part in enumerate(parts):
                stored = state.parts.get(part.part_number)
                if stored is None or stored[1] != part.etag:
                    raise StoreError(
                        f"part {part.part_number} was not uploaded (or was replaced)",
                        key=upload.key,
                    )
                if i < len(parts) - 1 and len(stored[0]) < self.capabilities.min_part_size:
                    raise StoreError(
                        f"part {part.part_number} is smaller than the "
                        f"{self.capabilities.min_part_size}-byte minimum (EntityTooSmall)",
                        key=upload.key,
                    )
                chunks.append(stored[0])
            info = self._write_locked(upload.key, state.key, b"".join(chunks), mode)
            del self._bucket.uploads[upload.upload_id]
            return info

    def abort_multipart(self, upload: MultipartUpload) -> None:
        with self._bucket.lock:
            self._bucket.uploads.pop(upload.upload_id, None)

    def list_multipart(self, prefix: str = "") -> builtins.list[PendingUpload]:
        full_prefix = self._prefix + prefix
        with self._bucket.lock:
            return sorted(
                (
                    PendingUpload(u.key[len(self._prefix) :], upload_id, u.initiated)
                    for upload_id, u in self._bucket.uploads.items()
                    if u.key.startswith(full_prefix)
                ),
                key=lambda p: (p.key, p.upload_id),
            )
