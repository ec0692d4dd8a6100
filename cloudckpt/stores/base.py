"""The narrow store interface every backend implements (docs/design.md §4).

Keys are relative to the store's root URL, ``/``-separated, with no leading slash and no
``.``/``..`` segments. Everything under ``.cloudckpt/`` is the backend's own scratch space
(locks, temporary files, composite-upload parts) and never appears in ``list()``.

Write modes follow obstore's vocabulary:

- ``OVERWRITE``: unconditional put.
- ``CREATE``: put only if the key does not exist (S3 ``If-None-Match: *``,
  GCS ``ifGenerationMatch=0``, file:// ``os.link``); a lost race raises
  ``PreconditionFailedError``.
- ``Update(version)``: compare-and-swap; put only if the current version is ``version``
  (S3 ``If-Match: <etag>``, GCS ``ifGenerationMatch=<generation>``, file:// ``flock`` +
  compare + ``os.replace``). A stale version or a missing key raises
  ``PreconditionFailedError``.

Every backend raises only the errors of ``cloudckpt.errors`` (StoreError subclasses,
ConfigurationError); no library-specific exception escapes an adapter.
"""

from __future__ import annotations

import abc
import base64
import builtins
import dataclasses
import datetime as dt
from collections.abc import Iterator, Sequence

from cloudckpt import _crc32c, digest
from cloudckpt.errors import ConfigurationError, UnsupportedBackendError

INTERNAL_PREFIX = ".cloudckpt/"


@dataclasses.dataclass(frozen=True)
class Overwrite:
    """Unconditional put."""


@dataclasses.dataclass(frozen=True)
class Create:
    """Put only if the key is absent."""


@dataclasses.dataclass(frozen=True)
class Update:
    """Put only if the key's current version equals ``version``."""

    version: str


OVERWRITE = Overwrite()
CREATE = Create()
PutMode = Overwrite | Create | Update


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What a store knows about one object.

    ``version`` changes on every write of the key (S3: the ETag, which repeats for identical
    bytes, see ``Capabilities.unique_versions``). ``last_modified`` is on the store's clock.
    """

    key: str
    size: int
    version: str
    last_modified: dt.datetime | None = None


@dataclasses.dataclass(frozen=True)
class MultipartUpload:
    """A started multipart upload."""

    key: str
    upload_id: str


@dataclasses.dataclass(frozen=True)
class PartInfo:
    """An uploaded part, as ``complete_multipart`` needs it."""

    part_number: int
    etag: str
    crc32c: str | None = None  # base64 of the big-endian CRC32C, as S3 and GCS spell it
    size: int = 0


@dataclasses.dataclass(frozen=True)
class PendingUpload:
    """An incomplete multipart upload, with its start time on the store's clock."""

    key: str
    upload_id: str
    initiated: dt.datetime | None


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can do. Writing checkpoints needs ``create`` and ``update``."""

    create: bool = True
    update: bool = True
    multipart: bool = True
    unique_versions: bool = True  # False on S3: identical bytes give identical ETags
    min_part_size: int = 5 * 1024 * 1024
    max_part_size: int = 5 * 1024 * 1024 * 1024
    max_parts: int = 10_000

    def missing_for_writing(self) -> list[str]:
        """Names of the capabilities that safe writing needs and this store lacks."""
        missing = []
        if not self.create:
            missing.append("create-only put (If-None-Match: * / ifGenerationMatch=0)")
        if not self.update:
            missing.append("compare-and-swap put (If-Match / ifGenerationMatch=<generation>)")
        return missing


def crc32c_b64(data: bytes | bytearray | memoryview) -> str:
    """CRC32C of ``data`` (any contiguous buffer, not copied: ``cloudckpt._crc32c``) as
    base64 of its 4 big-endian bytes (the S3/GCS header form)."""
    return crc32c_text(_crc32c.value(data))


def crc32c_text(value: int) -> str:
    """A CRC32C value as base64 of its 4 big-endian bytes (the S3/GCS header form)."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def payload_crc32c(data: bytes | bytearray | memoryview) -> str:
    """``crc32c_b64(data)`` for a payload being sent: the CRC the caller computed in the
    same pass as its digest (``digest.known_crc32c``) where it registered one, so the bytes
    are not read a second time; else computed here."""
    known = digest.crc32c_if_known(data)
    return crc32c_b64(data) if known is None else crc32c_text(known)


def validate_key(key: str) -> str:
    """Return ``key`` if it is a well-formed relative key; raise ConfigurationError if not."""
    if not isinstance(key, str) or not key:
        raise ConfigurationError(f"invalid object key {key!r}: must be a non-empty string")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ConfigurationError(f"invalid object key {key!r}: must be relative, '/'-separated")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        raise ConfigurationError(f"invalid object key {key!r}: empty, '.' or '..' segment")
    return key


class Store(abc.ABC):
    """One backend, rooted at a URL prefix. Thread-safe; all methods are blocking.

    Raises (every method): ``StoreError`` subclasses from ``cloudckpt.errors``:
    ``ObjectNotFoundError``, ``BucketNotFoundError``, ``PreconditionFailedError``,
    ``StoreConflictError``, ``PermissionDeniedError``, ``CredentialsError``,
    ``TransientStoreError`` (reads; safe to retry), ``OutcomeUnknownError`` (writes that may
    have been applied).
    """

    #: Redacted root URL, safe for messages and logs.
    url: str
    capabilities: Capabilities = Capabilities()
    #: Seconds: the step of ``now()`` and ``last_modified`` (HTTP ``Date`` headers and S3
    #: ``LastModified`` are whole seconds). Ages measured on the store's clock can be off
    #: by this much at each end; commits keep a margin of twice this (``committer``).
    clock_resolution: float = 1.0

    # --- single objects -------------------------------------------------------------

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size, version and modification time of ``key``."""

    @abc.abstractmethod
    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        """The whole object and the version those bytes belong to (a response cut short
        raises TransientStoreError)."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from offset ``start`` (fewer only at the end of the object; a
        response cut short raises TransientStoreError, see ``get_range_into``)."""

    def get_range_into(self, key: str, start: int, buf: memoryview) -> int:
        """Read ``len(buf)`` bytes from offset ``start`` into ``buf``; return how many the
        store sent (fewer only at the end of the object: the store's answer said so). A
        response cut short (the connection closed, cleanly or not, before the length the
        answer announced) raises TransientStoreError, never a short count: a cut answer is
        not a short object. Backends that can read from the socket straight into ``buf``
        override this; this default copies ``get_range``'s bytes. Raises like ``get_range``."""
        data = self.get_range(key, start, len(buf))
        n = min(len(data), len(buf))
        buf[:n] = memoryview(data)[:n]
        return n

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        """Write ``data`` under ``key`` according to ``mode``; return the new version."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``. Deleting a missing key is not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order."""

    def list_dirs(self, prefix: str = "") -> Sequence[str]:
        """The "directories" right below ``prefix`` (``""`` or ending in ``/``): each
        ``name/`` such that some key starts with ``prefix + name + "/"``, sorted; never
        ``.cloudckpt/`` at the root. Backends with a delimiter listing override this (one
        request per page); this default lists every key below ``prefix``."""
        found = set()
        for obj in self.list(prefix):
            head, sep, _ = obj.key[len(prefix) :].partition("/")
            if sep and head:
                found.add(head + "/")
        return sorted(found)

    def stored_crc32c(self, key: str) -> str | None:
        """The CRC32C (base64, as ``crc32c_b64``) of the whole object that the store
        recorded when it was written, or None where the store keeps none (this default;
        S3 returns one when the upload sent it; GCS keeps one for every object). Lets a caller check an object's content
        without reading it (``chunks.resumed_chunk_ok``).

        Raises ObjectNotFoundError and the other StoreErrors of ``head``."""
        self.head(key)
        return None

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists (a HEAD)."""
        from cloudckpt.errors import ObjectNotFoundError

        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete several keys; backends with a batch call override this."""
        for key in keys:
            self.delete(key)

    # --- multipart ------------------------------------------------------------------

    def create_multipart(self, key: str) -> MultipartUpload:
        """Start a multipart upload of ``key``."""
        raise UnsupportedBackendError(
            f"{self.url} has no multipart uploads", capability="multipart"
        )

    def upload_part(
        self,
        upload: MultipartUpload,
        part_number: int,
        data: bytes | memoryview,
        *,
        crc32c: str | None = None,
    ) -> PartInfo:
        """Upload part ``part_number`` (1-based). ``crc32c`` (base64, see ``crc32c_b64``) is
        sent to the store, which rejects the part if the bytes it received do not match."""
        raise UnsupportedBackendError(
            f"{self.url} has no multipart uploads", capability="multipart"
        )

    def complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[PartInfo], *, mode: PutMode = CREATE
    ) -> ObjectInfo:
        """Assemble ``parts`` (in part-number order) into the object. ``mode`` is CREATE or
        OVERWRITE; compare-and-swap completion is not offered (moto ignores it, docs/design.md §4)."""
        raise UnsupportedBackendError(
            f"{self.url} has no multipart uploads", capability="multipart"
        )

    def abort_multipart(self, upload: MultipartUpload) -> None:
        """Abandon an upload and free its parts. Aborting an unknown upload is not an error."""
        raise UnsupportedBackendError(
            f"{self.url} has no multipart uploads", capability="multipart"
        )

    def list_multipart(self, prefix: str = "") -> builtins.list[PendingUpload]:
        """Incomplete multipart uploads whose key starts with ``prefix``."""
        return []

    # --- clock and lifecycle --------------------------------------------------------

    @abc.abstractmethod
    def now(self) -> dt.datetime:
        """The store's current time (UTC), the clock ``last_modified`` is measured on."""

    def close(self) -> None:  # noqa: B027 - a no-op is right for stores without connections
        """Release connections. The store must not be used afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)
