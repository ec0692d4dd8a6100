"""Store wrappers for testing: a forwarding base and a deliberately broken store.

``ForwardingStore`` passes every call through to an inner store; subclasses override the
calls they want to disturb (see ``cloudckpt.testing.faults`` for the fault injector).
``DropPreconditions`` silently turns create-only and compare-and-swap writes into plain
overwrites, as s3fs's multipart path and fsspec's ``mode="create"`` effectively do; the
conformance suite must catch it.
"""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Iterator, Sequence

from cloudckpt.stores.base import (
    CREATE,
    OVERWRITE,
    MultipartUpload,
    ObjectInfo,
    PartInfo,
    PendingUpload,
    PutMode,
    Store,
)


class ForwardingStore(Store):
    """A store that forwards every call to ``inner``."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.capabilities = inner.capabilities
        self.clock_resolution = inner.clock_resolution

    def head(self, key: str) -> ObjectInfo:
        return self.inner.head(key)

    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.inner.get_range(key, start, length)

    def get_range_into(self, key: str, start: int, buf: memoryview) -> int:
        # Forwarded, not inherited: the inner store's zero-copy path must stay in use.
        return self.inner.get_range_into(key, start, buf)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        return self.inner.put(key, data, mode=mode)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.delete(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def create_multipart(self, key: str) -> MultipartUpload:
        return self.inner.create_multipart(key)

    def upload_part(
        self,
        upload: MultipartUpload,
        part_number: int,
        data: bytes | memoryview,
        *,
        crc32c: str | None = None,
    ) -> PartInfo:
        return self.inner.upload_part(upload, part_number, data, crc32c=crc32c)

    def complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[PartInfo], *, mode: PutMode = CREATE
    ) -> ObjectInfo:
        return self.inner.complete_multipart(upload, parts, mode=mode)

    def abort_multipart(self, upload: MultipartUpload) -> None:
        self.inner.abort_multipart(upload)

    def list_multipart(self, prefix: str = "") -> builtins.list[PendingUpload]:
        return self.inner.list_multipart(prefix)

    def now(self) -> dt.datetime:
        return self.inner.now()

    def close(self) -> None:
        self.inner.close()


class DropPreconditions(ForwardingStore):
    """A broken store that ignores preconditions: every conditional write overwrites."""

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        return self.inner.put(key, data, mode=OVERWRITE)

    def complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[PartInfo], *, mode: PutMode = CREATE
    ) -> ObjectInfo:
        return self.inner.complete_multipart(upload, parts, mode=OVERWRITE)
