"""Any other fsspec URL (hdfs://, az://, sftp://, http://, ...): read-only by default.

Reading a checkpoint needs only get/list, which every fsspec filesystem offers. Writing
needs create-only and compare-and-swap puts, which generic fsspec cannot do atomically
(``mode="create"`` is check-then-write), so ``open_store`` refuses to write here unless the
user opts into ``unsafe_single_writer``: then conditional writes are emulated by
check-then-write, which is correct only while exactly one process writes the run.
"""

from __future__ import annotations

import base64
import datetime as dt
import http.client
import logging
import re
import socket
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from cloudckpt.errors import (
    ConfigurationError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientStoreError,
    UnsupportedBackendError,
    redact_url,
    scrub,
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


#: HTTP statuses (aiohttp's ``status``, requests' ``response.status_code``) by meaning.
_NOT_FOUND_STATUS = frozenset({404, 410})
_DENIED_STATUS = frozenset({401, 403})
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Secret-looking storage option names, scrubbed from messages (fsspec backends' spellings).
_SECRET_OPTION = re.compile(r"(?i)pass(word|wd)?$|secret|token|credential|(^|_)key$")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from, outermost first."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )


def _http_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError (http://)
    if status is None:  # requests.HTTPError (webdav and other requests-based backends)
        status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) and not isinstance(status, bool) else None


def _no_connection(exc: BaseException) -> bool:
    """Whether ``exc`` means the server could not be reached or stopped answering."""
    if isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror)):
        return True
    aiohttp = sys.modules.get("aiohttp")  # imported if it raised this; never import it here
    return aiohttp is not None and isinstance(exc, aiohttp.ClientConnectionError)


def _cut_short(exc: BaseException) -> bool:
    """Whether ``exc`` means an answer ended before the length it announced (the
    connection closed, cleanly or not, mid-body): a read to retry, never a short object."""
    if isinstance(exc, http.client.IncompleteRead):
        return True
    aiohttp = sys.modules.get("aiohttp")  # imported if it raised this; never import it here
    if aiohttp is not None and isinstance(exc, aiohttp.ClientPayloadError):
        return True
    requests = sys.modules.get("requests")
    return requests is not None and isinstance(exc, requests.exceptions.ChunkedEncodingError)


def _refused(exc: BaseException) -> bool:
    """Whether no connection was ever made (refused, DNS): a write cannot have landed."""
    aiohttp = sys.modules.get("aiohttp")
    for link in _chain(exc):
        if isinstance(link, (ConnectionRefusedError, socket.gaierror)):
            return True
        if aiohttp is not None and isinstance(link, aiohttp.ClientConnectorError):
            return True
    return False


def _kind(exc: BaseException) -> str:
    """What a failed fsspec call means: "missing", "denied", "unreachable", "transient"
    (a 5xx, a throttle, an answer cut short) or "other".

    fsspec reports more than absence as ``FileNotFoundError``: HTTPFileSystem.info wraps
    *any* failure of its last request, a refused connection included, in one (the real
    error is its ``__cause__``). So the chain decides; a bare FileNotFoundError is absence.
    """
    for link in _chain(exc):
        status = _http_status(link)
        if status in _NOT_FOUND_STATUS:
            return "missing"
        if status in _DENIED_STATUS or isinstance(link, PermissionError):
            return "denied"
        if status in _TRANSIENT_STATUS:
            return "transient"
        if status is not None:
            return "other"
        if _cut_short(link):
            return "transient"
        if _no_connection(link):
            return "unreachable"
    return "missing" if isinstance(exc, FileNotFoundError) else "other"


def _http_auth_out_of_url(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``http(s)://user:password@host/...``: send the credentials as an HTTP Basic
    ``Authorization`` header and drop them from the URL, which fsspec's HTTP backend logs
    (DEBUG) and puts into its errors. Other URLs are returned as they are."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or parts.username is None:
        return url, options
    credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    client_kwargs = dict(options.get("client_kwargs") or {})
    headers = dict(client_kwargs.get("headers") or {})
    headers.setdefault(
        "Authorization", "Basic " + base64.b64encode(credentials.encode()).decode("ascii")
    )
    client_kwargs["headers"] = headers
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    return bare, {**options, "client_kwargs": client_kwargs}


class FsspecStore(Store):
    """A generic fsspec filesystem as a (normally read-only) store."""

    def __init__(
        self, url: str, storage_options: dict[str, Any], *, unsafe_single_writer: bool = False
    ) -> None:
        import fsspec

        # Every credential in sight, to scrub from any message (URLs are redacted anyway).
        password = urlsplit(url).password
        self._secrets = [password] if password else []
        self._secrets += [
            v
            for k, v in storage_options.items()
            if isinstance(v, str) and len(v) >= 4 and _SECRET_OPTION.search(k)
        ]
        bare_url, storage_options = _http_auth_out_of_url(url, storage_options)
        try:
            self._fs, path = fsspec.core.url_to_fs(bare_url, **storage_options)
        except (ImportError, ValueError) as exc:
            raise ConfigurationError(
                f"cannot open {redact_url(url)}: {scrub(str(exc), self._secrets)}",
                hint="Install the fsspec implementation for this scheme, or check the URL",
            ) from None
        except OSError as exc:  # some filesystems connect when opened (ftp, sftp)
            detail = scrub(str(exc.strerror or exc), self._secrets)
            raise ConfigurationError(
                f"cannot open {redact_url(url)}: {type(exc).__name__}: {detail}",
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

    def _error(self, exc: Exception, key: str | None, *, write: bool = False) -> StoreError:
        """The ``StoreError`` for a failed fsspec call (see ``_kind``): absence, denial,
        an unreachable server (``TransientStoreError``, never "absent": a run read through
        a dead endpoint must not look empty), a transient failure; for a write that may
        have reached the server, ``OutcomeUnknownError``."""
        where = f"{self.url}{key or ''}"
        kind = _kind(exc)
        name = type(exc).__name__
        if kind == "missing":
            return ObjectNotFoundError(f"{where} does not exist", key=key)
        if kind == "denied":
            return PermissionDeniedError(f"permission denied on {where}", key=key)
        if kind in ("unreachable", "transient") and write and not _refused(exc):
            return OutcomeUnknownError(f"{where}: no complete answer ({name})", key=key)
        if kind == "unreachable":
            cause = next(c for c in _chain(exc) if _no_connection(c))
            return TransientStoreError(
                f"could not reach the server of {self.url} ({type(cause).__name__}"
                f"{': ' + scrub(str(cause), self._secrets) if str(cause) else ''})",
                key=key,
                hint="Check the host and port in the URL, the network, and that the server is "
                "running; nothing was read or changed, and the command can be retried",
            )
        if kind == "transient":
            return TransientStoreError(f"{where}: {scrub(str(exc), self._secrets)}", key=key)
        return StoreError(f"{where}: {name}: {scrub(str(exc), self._secrets)}", key=key)

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
        # fsspec's walk drops a directory whose listing fails ("omit"); collect those
        # errors instead: a server that is down must not read as an empty run.
        failures: list[Exception] = []
        try:
            found = self._fs.find(top, detail=True, on_error=failures.append)
        except Exception as exc:
            error = self._error(exc, prefix)
            if isinstance(error, ObjectNotFoundError):
                return
            raise error from None
        for failure in failures:
            error = self._error(failure, prefix)
            if not isinstance(error, ObjectNotFoundError):  # (absent: deleted meanwhile)
                raise error from None
        items = []
        for path, info in found.items():
            key = path[len(self._root) :].lstrip("/") if path.startswith(self._root) else path
            if key.startswith(prefix) and not key.startswith(".cloudckpt/"):
                if info.get("size") is None:  # http:// listings are links without sizes
                    info = self._fetch_info(path, key)
                if info is not None:
                    items.append(self._info(key, info))
        yield from sorted(items, key=lambda o: o.key)

    def _fetch_info(self, path: str, key: str) -> dict[str, Any] | None:
        """``info`` of a listed file; None if it is gone (deleted since the listing)."""
        try:
            return self._fs.info(path)
        except Exception as exc:
            error = self._error(exc, key)
            if isinstance(error, ObjectNotFoundError):
                return None
            raise error from None

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
            raise self._error(exc, key, write=True) from None
        return self.head(key)

    def delete(self, key: str) -> None:
        if not self._unsafe:
            raise UnsupportedBackendError(f"{self.url} is read-only", capability="delete")
        try:
            self._fs.rm_file(self._path(key))
        except Exception as exc:
            error = self._error(exc, key, write=True)
            if not isinstance(error, ObjectNotFoundError):
                raise error from None

    def now(self) -> dt.datetime:
        return utcnow()
