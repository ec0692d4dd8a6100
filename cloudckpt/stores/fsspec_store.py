"""Any other fsspec URL (hdfs://, az://, sftp://, http://, ...): read-only by default.

Reading a checkpoint needs only get/list, which every fsspec filesystem offers. Writing
needs create-only and compare-and-swap puts, which generic fsspec cannot do atomically
(``mode="create"`` is check-then-write), so ``open_store`` refuses to write here unless the
user opts into ``unsafe_single_writer``: then conditional writes are emulated by
check-then-write, which is correct only while exactly one process writes the run.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator
from typing import Any

from cloudckpt.errors import (
    ConfigurationError,
    ObjectNotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientStoreError,
    UnsupportedBackendError,
    redact_url,
)
from cloudckpt.stores.base import (
    OVERWRITE,
    Capabilities,
    Create,
    ObjectInfo,
    PutMode,
    Store,
    Update,
    utcnow,
    validate_key,
)

log = logging.getLogger(__name__)


def _to_datetime(value: Any) -> dt.datetime | None:
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    if isinstance(value, (int, float)):
        return dt.datetime.fromtimestamp(value, tz=dt.timezone.utc)
    if isinstance(value, str):
        try:
            return _to_datetime(dt.datetime.fromisoformat(value.replace("Z", "+00:00")))
        except ValueError:
            return None
    return None


class FsspecStore(Store):
    """A generic fsspec filesystem as a (normally read-only) store."""

    def __init__(
        self, url: str, storage_options: dict[str, Any], *, unsafe_single_writer: bool = False
    ) -> None:
        import fsspec

        try:
            self._fs, path = fsspec.core.url_to_fs(url, **storage_options)
        except (ImportError, ValueError) as exc:
            raise ConfigurationError(
                f"cannot open {redact_url(url)}: {exc}",
                hint="Install the fsspec implementation for this scheme, or check the URL",
            ) from None
        except OSError as exc:  # some filesystems connect when opened (ftp, sftp)
            raise ConfigurationError(
                f"cannot open {redact_url(url)}: {type(exc).__name__}: {exc.strerror or exc}",
                hint="Check the host, the path and the storage options in the URL",
            ) from None
        self._root = path.rstrip("/")
        self.url = redact_url(url).rstrip("/") + "/"
        self._unsafe = unsafe_single_writer
        self.capabilities = Capabilities(
            create=unsafe_single_writer, update=unsafe_single_writer, multipart=False
        )
        if unsafe_single_writer:
            log.warning(
                "%s: unsafe single-writer mode: conditional writes are emulated by "
                "check-then-write; a second writer can corrupt this run",
                self.url,
            )

    def _path(self, key: str) -> str:
        return f"{self._root}/{validate_key(key)}"

    def _error(self, exc: Exception, key: str | None) -> StoreError:
        where = f"{self.url}{key or ''}"
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFoundError(f"{where} does not exist", key=key)
        if isinstance(exc, PermissionError):
            return PermissionDeniedError(f"permission denied on {where}", key=key)
        if isinstance(exc, (TimeoutError, ConnectionError)):
            return TransientStoreError(f"{where}: {type(exc).__name__}", key=key)
        return StoreError(f"{where}: {type(exc).__name__}: {exc}", key=key)

    def _info(self, key: str, info: dict[str, Any]) -> ObjectInfo:
        modified = None
        for field in ("LastModified", "mtime", "updated", "last_modified", "created"):
            modified = _to_datetime(info.get(field))
            if modified is not None:
                break
        version = info.get("ETag") or info.get("etag") or info.get("generation")
        if version is None:
            version = f"{info.get('size')}-{modified.timestamp() if modified else ''}"
        return ObjectInfo(key, int(info.get("size") or 0), str(version), modified)

    def head(self, key: str) -> ObjectInfo:
        try:
            info = self._fs.info(self._path(key))
        except Exception as exc:
            raise self._error(exc, key) from None
        if info.get("type") == "directory":
            raise ObjectNotFoundError(f"{self.url}{key} does not exist", key=key)
        return self._info(key, info)

    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        info = self.head(key)
        try:
            return self._fs.cat_file(self._path(key)), info
        except Exception as exc:
            raise self._error(exc, key) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            return self._fs.cat_file(self._path(key), start=start, end=start + length)
        except Exception as exc:
            raise self._error(exc, key) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = f"{self._root}/{base}" if base else self._root
        try:
            found = self._fs.find(top, detail=True)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._error(exc, prefix) from None
        items = []
        for path, info in found.items():
            key = path[len(self._root) :].lstrip("/") if path.startswith(self._root) else path
            if key.startswith(prefix) and not key.startswith(".cloudckpt/"):
                items.append(self._info(key, info))
        yield from sorted(items, key=lambda o: o.key)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        if not self._unsafe:
            raise UnsupportedBackendError(
                f"{self.url} is read-only: its backend has no create-only or "
                "compare-and-swap writes",
                capability="create-only and compare-and-swap put",
            )
        # Check-then-write: correct only with a single writer (the user opted in).
        if isinstance(mode, Create) and self.exists(key):
            raise PreconditionFailedError(f"{self.url}{key} already exists", key=key)
        if isinstance(mode, Update):
            try:
                current = self.head(key)
            except ObjectNotFoundError:
                raise PreconditionFailedError(f"{self.url}{key} does not exist", key=key) from None
            if current.version != mode.version:
                raise PreconditionFailedError(f"{self.url}{key} changed", key=key)
        try:
            self._fs.pipe_file(self._path(key), bytes(data))
            self._fs.invalidate_cache()
        except Exception as exc:
            raise self._error(exc, key) from None
        return self.head(key)

    def delete(self, key: str) -> None:
        if not self._unsafe:
            raise UnsupportedBackendError(f"{self.url} is read-only", capability="delete")
        try:
            self._fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error(exc, key) from None

    def now(self) -> dt.datetime:
        return utcnow()
