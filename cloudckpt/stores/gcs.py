"""``gs://bucket/prefix``: Google Cloud Storage through gcsfs's session and credentials.

gcsfs supplies the aiohttp session, the credentials (``token``, ``project``, application
default credentials, ``STORAGE_EMULATOR_HOST``/``endpoint_url``) and its event loop; the
requests themselves are raw JSON-API calls made here, because gcsfs's own calls get in the
way of conditional writes (docs/design.md §4):

- ``GCSFileSystem._call`` retries writes blindly (a lost response then turns our own
  successful conditional write into a 412), reports every 412 as ``FileExistsError`` and
  every 404 as ``FileNotFoundError``, and exposes only create-only puts;
- its listing and ``info()`` caches would make a compare-and-swap act on stale versions.

Every write is one ``uploadType=multipart`` upload (the only upload type whose preconditions
fake-gcs-server enforces) carrying the CRC32C of the data so GCS verifies the bytes.
Versions are object generations, which change on every write. Multipart uploads are
parallel composite uploads: parts are objects under ``.cloudckpt/uploads/<id>/``, composed
(at most 32 sources per call, tree-wise) into the destination.

No retries happen here: a read that fails raises ``TransientStoreError`` and a write whose
outcome is unknown raises ``OutcomeUnknownError``; the caller decides.
"""

from __future__ import annotations

import asyncio
import builtins
import datetime as dt
import email.utils
import functools
import http.client
import inspect
import io
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

# gcsfs >= 2026 otherwise swaps in a filesystem that probes every bucket over gRPC with a
# 60 s timeout, which hangs against emulators. Must be set before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import aiohttp
import fsspec.asyn
import google.auth.exceptions
from gcsfs.core import GCSFileSystem  # the plain HTTP filesystem, always
from gcsfs.retry import HttpError, NonRetryableError

from cloudckpt.errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    ConfigurationError,
    CredentialsError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreConflictError,
    StoreError,
    TransientStoreError,
    redact_url,
)
from cloudckpt.stores.base import (
    CREATE,
    INTERNAL_PREFIX,
    OVERWRITE,
    Capabilities,
    Create,
    MultipartUpload,
    ObjectInfo,
    Overwrite,
    PartInfo,
    PendingUpload,
    PutMode,
    Store,
    Update,
    crc32c_b64,
    validate_key,
)

logger = logging.getLogger(__name__)

#: What to do about missing or rejected Google credentials.
_CREDENTIALS_HINT = (
    "Run `gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS="
    "/path/to/key.json, or run where a service account is attached (the metadata server); "
    "for an emulator add -o token=anon (Python: storage_options={'token': 'anon'})"
)

_UPLOADS = INTERNAL_PREFIX + "uploads/"
_MARKER = "target"  # .cloudckpt/uploads/<id>/target holds the destination key
_KEY_META = "cloudckpt-key"
_MAX_COMPOSE_SOURCES = 32  # GCS limit per compose call
_CONCURRENCY = 16  # parallel compose/delete calls inside one operation
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_GENERATION = re.compile(r"[1-9][0-9]*")
_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)")
# Without a total timeout large parts can take as long as they need; a silent server cannot.
_DEFAULT_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)


class _Response:
    """Status, headers and body of one finished HTTP exchange."""

    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> dict[str, Any]:
        return json.loads(self.body) if self.body else {}

    def message(self) -> str:
        """The server's error message (GCS JSON error body, or plain text), shortened."""
        try:
            return str(self.json()["error"]["message"])[:300]
        except (ValueError, KeyError, TypeError):
            return self.body.decode("utf-8", "replace").strip()[:300]


def _parse_time(value: str | None) -> dt.datetime | None:
    """RFC 3339 time from the JSON API (any number of fraction digits; 3.10-safe)."""
    m = _RFC3339.fullmatch(value or "")
    if m is None:
        return None
    frac = (m[2] or "0")[:6].ljust(6, "0")
    return dt.datetime.fromisoformat(f"{m[1]}.{frac}{'+00:00' if m[3] == 'Z' else m[3]}")


def _goog_hashes(headers: Any) -> dict[str, str]:
    """``x-goog-hash: crc32c=...,md5=...`` (one or several headers) as a dict."""
    pairs = (p.strip() for h in headers.getall("x-goog-hash", []) for p in h.split(","))
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def _parse_http_date(value: str | None) -> dt.datetime | None:
    try:
        return email.utils.parsedate_to_datetime(value) if value else None
    except (TypeError, ValueError):
        return None


# fsspec options every filesystem takes, and that gcsfs passes on to it.
_FSSPEC_OPTIONS = frozenset(
    {"use_listings_cache", "listings_expiry_time", "max_paths", "batch_size"}
)


@functools.cache
def _accepted_options() -> frozenset[str]:
    """Keyword arguments GCSFileSystem really uses (it accepts any, silently)."""
    params = inspect.signature(GCSFileSystem.__init__).parameters
    named = {
        n
        for n, p in params.items()
        if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
    }
    return frozenset(named - {"self", "asynchronous", "loop"}) | _FSSPEC_OPTIONS


def _read_into(resp: http.client.HTTPResponse, buf: memoryview, skip: int) -> int:
    """Read a response body into ``buf`` after discarding ``skip`` bytes; the number of
    body bytes that belong in ``buf`` (at most ``len(buf)``)."""
    while skip > 0:
        skipped = len(resp.read(min(skip, 1 << 20)))
        if not skipped:
            return 0
        skip -= skipped
    got = 0
    while got < len(buf):
        n = resp.readinto(buf[got:])
        if not n:
            break
        got += n
    return got


class GCSStore(Store):
    """A store on ``gs://bucket/prefix``. See the module docstring.

    ``storage_options`` go to ``gcsfs.GCSFileSystem`` unchanged (``token``, ``project``,
    ``endpoint_url``, ``requests_timeout``, ``session_kwargs``, ...). ``min_part_size`` is
    only advice for the transfer engine: GCS composition has no minimum part size.

    Raises:
        ConfigurationError: bad bucket name, storage option or token value.
        CredentialsError: gcsfs could not set up the requested credentials.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        min_part_size: int = 5 * 1024 * 1024,
        **storage_options: Any,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ConfigurationError(f"invalid GCS bucket name {bucket!r}")
        self._bucket = bucket
        self._root = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"gs://{bucket}/{self._root}"
        self.capabilities = Capabilities(min_part_size=min_part_size)
        unknown = set(storage_options) - _accepted_options()
        if unknown:
            # GCSFileSystem swallows unknown keyword arguments; a typo must not go unnoticed.
            raise ConfigurationError(
                f"unknown GCS storage option(s) {', '.join(sorted(map(repr, unknown)))} "
                f"for {self.url}",
                hint=f"Accepted options: {', '.join(sorted(_accepted_options()))}",
            )
        try:
            # A private instance: gcsfs shares instances (and their caches) by arguments.
            self._fs = GCSFileSystem(skip_instance_cache=True, **storage_options)
        except (TypeError, ValueError) as exc:  # gcsfs's own messages carry no secrets
            raise ConfigurationError(f"invalid GCS storage options for {self.url}: {exc}") from None
        except (google.auth.exceptions.GoogleAuthError, OSError) as exc:
            # Auth library messages may quote credential files; name the type only.
            raise CredentialsError(
                f"cannot set up GCS credentials for {self.url} ({type(exc).__name__})",
                hint=_CREDENTIALS_HINT,
            ) from None
        self._endpoint = redact_url(self._fs._location)
        self._objects_url = f"{self._fs._location}/storage/v1/b/{quote(bucket, safe='')}/o"
        self._upload_url = f"{self._fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o"
        # Real GCS composes like any other write; fake-gcs-server does not (probed once).
        self._compose_trusted: bool | None = True if self._fs.on_google else None
        self._local = threading.local()  # get_range_into's connection per thread
        self._closed = False

    # --- transport and error mapping ------------------------------------------------

    def _run(self, coro_fn: Any, *args: Any, write: bool, key: str | None = None) -> Any:
        """Run ``coro_fn(*args)`` on gcsfs's loop; map transport failures to store errors."""
        if self._closed:
            raise StoreError(f"{self.url}: the store is closed", key=key)
        where = f"{self.url}{key or ''} (endpoint {self._endpoint})"
        try:
            return fsspec.asyn.sync(self._fs.loop, coro_fn, *args)
        except aiohttp.ClientConnectorError as exc:
            # The connection was never made, so nothing was sent: safe for writes too.
            raise TransientStoreError(
                f"cannot connect to the GCS endpoint {self._endpoint} for {self.url}{key or ''}: "
                f"{exc.os_error.strerror or type(exc.os_error).__name__}",
                key=key,
            ) from None
        except (HttpError, NonRetryableError) as exc:  # gcsfs failed to refresh credentials
            raise CredentialsError(
                f"{where}: {type(exc).__name__}", key=key, hint=_CREDENTIALS_HINT
            ) from None
        except google.auth.exceptions.TransportError:
            raise TransientStoreError(
                f"{where}: could not reach the credentials service", key=key
            ) from None
        except google.auth.exceptions.GoogleAuthError as exc:
            raise CredentialsError(
                f"{where}: {type(exc).__name__}", key=key, hint=_CREDENTIALS_HINT
            ) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            what = type(exc).__name__
            if write:
                raise OutcomeUnknownError(
                    f"{where}: no answer to a write ({what})", key=key
                ) from None
            raise TransientStoreError(f"{where}: request failed ({what})", key=key) from None

    async def _send(
        self,
        method: str,
        url: str,
        *,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        data: io.BytesIO | None = None,
        json_body: Any = None,
    ) -> _Response:
        """One request through gcsfs's session with its credentials; no retries."""
        fs = self._fs
        await fs._set_session()
        query = {k: str(v) for k, v in fs._get_params(params or {}).items()}
        async with fs.session.request(
            method,
            url,
            params=query,
            headers=fs._get_headers(headers),  # adds (and refreshes) the credentials
            data=data,
            json=json_body,
            timeout=_DEFAULT_TIMEOUT
            if fs.requests_timeout is None
            else aiohttp.ClientTimeout(total=fs.requests_timeout),
        ) as response:
            body = await response.read()
        logger.debug("%s %s -> %d", method, redact_url(url), response.status)
        return _Response(response.status, response.headers, body)

    async def _error(self, r: _Response, key: str | None, *, write: bool) -> StoreError:
        """The cloudckpt error for a failed response (never contains credentials)."""
        where = f"{self.url}{key or ''}"
        msg = r.message()
        status = r.status
        if status == 404:
            if await self._bucket_missing(r):
                return BucketNotFoundError(f"GCS bucket {self._bucket!r} does not exist", key=key)
            return ObjectNotFoundError(f"{where} does not exist", key=key)
        if status == 412:
            return PreconditionFailedError(f"{where}: precondition failed ({msg})", key=key)
        if status == 400 and re.search(r"(?i)crc32c|md5", msg):
            return ChecksumMismatchError(f"{where}: the store rejected the bytes: {msg}", key=key)
        if status == 401:
            return CredentialsError(
                f"{where}: the store rejected the credentials ({msg})",
                key=key,
                hint=_CREDENTIALS_HINT,
            )
        if status == 403:
            return PermissionDeniedError(f"{where}: permission denied ({msg})", key=key)
        if status == 409:
            return StoreConflictError(f"{where}: conflicting concurrent request ({msg})", key=key)
        if status == 429:
            # Rate limiting rejects the request before it is applied: safe to retry.
            return TransientStoreError(f"{where}: rate limited (HTTP 429)", key=key)
        if status == 408 or status >= 500:
            if write:
                return OutcomeUnknownError(f"{where}: HTTP {status} on a write ({msg})", key=key)
            return TransientStoreError(f"{where}: HTTP {status} ({msg})", key=key)
        return StoreError(f"{where}: HTTP {status} ({msg})", key=key)

    async def _bucket_missing(self, r: _Response) -> bool:
        """Whether a 404 means "no bucket" (real GCS says so; the emulator needs a probe)."""
        msg = r.message()
        if msg.startswith("No such object"):
            return False
        if "bucket" in msg.lower():
            return True
        # Listing (objects.list permission, which we need anyway) 404s only without a bucket.
        probe = await self._send("GET", self._objects_url, params={"maxResults": "1"})
        return probe.status == 404

    # --- helpers --------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self._root + validate_key(key)

    def _object_url(self, name: str) -> str:
        return f"{self._objects_url}/{quote(name, safe='')}"

    def _info(self, key: str, obj: dict[str, Any]) -> ObjectInfo:
        return ObjectInfo(
            key, int(obj.get("size", 0)), str(obj["generation"]), _parse_time(obj.get("updated"))
        )

    def _upload_prefix(self, upload_id: str) -> str:
        if not _UPLOAD_ID.fullmatch(upload_id or ""):
            raise ConfigurationError(f"invalid GCS multipart upload id {upload_id!r}")
        return f"{self._root}{_UPLOADS}{upload_id}/"

    def _precondition(self, key: str, mode: PutMode) -> dict[str, str]:
        if isinstance(mode, Create):
            return {"ifGenerationMatch": "0"}
        if isinstance(mode, Update):
            if not _GENERATION.fullmatch(mode.version or ""):
                # Not a generation (e.g. "0" would mean create-only): it cannot be current.
                raise PreconditionFailedError(
                    f"{self.url}{key}: version {mode.version!r} is not a GCS generation", key=key
                )
            return {"ifGenerationMatch": mode.version}
        return {}

    async def _upload(
        self,
        name: str,
        data: bytes | memoryview,
        crc32c: str,
        params: dict[str, str],
        key: str,
        metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """One multipart upload of ``data`` to object ``name``; the new object resource."""
        meta: dict[str, Any] = {"name": name, "crc32c": crc32c}
        meta["contentType"] = "application/octet-stream"
        if metadata:
            meta["metadata"] = metadata
        boundary = f"cloudckpt-{uuid.uuid4().hex}"
        body = b"".join(
            [
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                json.dumps(meta).encode(),
                f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
                data,
                f"\r\n--{boundary}--\r\n".encode(),
            ]
        )
        r = await self._send(
            "POST",
            self._upload_url,
            params={"uploadType": "multipart", **params},
            headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
            data=io.BytesIO(body),  # streamed in chunks; raw bytes would block the loop
        )
        if r.status != 200:
            raise await self._error(r, key, write=True)
        return r.json()

    async def _list_raw(self, prefix: str, fields: str) -> list[dict[str, Any]]:
        """Every object resource under the full name ``prefix`` (internal ones included)."""
        params = {"prefix": prefix, "fields": f"items({fields}),nextPageToken"}
        return await self._list_pages(params, "items")

    async def _list_prefixes(self, prefix: str) -> list[str]:
        """The full names of the "directories" right below the full name ``prefix``
        (objects.list with a delimiter: its ``prefixes``)."""
        params = {"prefix": prefix, "delimiter": "/", "fields": "prefixes,nextPageToken"}
        return await self._list_pages(params, "prefixes")

    async def _list_pages(self, params: dict[str, str], field: str) -> list[Any]:
        """``field`` of every page of objects.list with ``params``. Raises
        BucketNotFoundError, StoreError."""
        found: list[Any] = []
        while True:
            r = await self._send("GET", self._objects_url, params=params)
            if r.status == 404:  # objects.list 404s only when the bucket is missing
                raise BucketNotFoundError(f"GCS bucket {self._bucket!r} does not exist")
            if r.status != 200:
                raise await self._error(r, None, write=False)
            page = r.json()
            found.extend(page.get(field, []))
            if not page.get("nextPageToken"):
                return found
            params["pageToken"] = page["nextPageToken"]

    async def _delete(self, name: str, key: str | None, generation: str | None = None) -> None:
        params = {"ifGenerationMatch": generation} if generation else {}
        r = await self._send("DELETE", self._object_url(name), params=params)
        if r.status not in (200, 204, 404, 412):
            raise await self._error(r, key, write=True)
        if r.status == 404 and await self._bucket_missing(r):
            raise BucketNotFoundError(f"GCS bucket {self._bucket!r} does not exist", key=key)

    async def _gather(self, coros: Sequence[Any]) -> list[Any]:
        """Run ``coros`` with bounded concurrency; the first failure propagates."""
        limit = asyncio.Semaphore(_CONCURRENCY)

        async def bounded(coro: Any) -> Any:
            async with limit:
                return await coro

        return await asyncio.gather(*(bounded(c) for c in coros))

    # --- single objects -------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        """Raises ObjectNotFoundError, BucketNotFoundError, TransientStoreError, ..."""
        name = self._name(key)

        async def go() -> ObjectInfo:
            r = await self._send(
                "GET", self._object_url(name), params={"fields": "size,generation,updated"}
            )
            if r.status != 200:
                raise await self._error(r, key, write=False)
            return self._info(key, r.json())

        return self._run(go, write=False, key=key)

    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        """The bytes and the generation they belong to, from one media download (the
        ``x-goog-generation`` header), so bytes and version always agree. ``last_modified``
        comes from ``Last-Modified`` (whole seconds; ``head`` has microseconds). A CRC32C
        mismatch with ``x-goog-hash`` raises TransientStoreError (damaged in transit);
        ObjectNotFoundError, BucketNotFoundError as usual."""
        name = self._name(key)

        async def go() -> tuple[bytes, ObjectInfo]:
            r = await self._send("GET", self._object_url(name), params={"alt": "media"})
            if r.status != 200:
                raise await self._error(r, key, write=False)
            generation = r.headers.get("x-goog-generation")
            if not generation:
                raise StoreError(f"{self.url}{key}: the store sent no x-goog-generation header")
            hashes = _goog_hashes(r.headers)
            encoding = r.headers.get("x-goog-stored-content-encoding", "identity")
            if "crc32c" in hashes and encoding == "identity":
                actual = crc32c_b64(r.body)
                if actual != hashes["crc32c"]:
                    raise TransientStoreError(
                        f"{self.url}{key}: downloaded bytes have CRC32C {actual}, the store "
                        f"says {hashes['crc32c']} (damaged in transit)",
                        key=key,
                    )
            modified = _parse_http_date(r.headers.get("Last-Modified"))
            return r.body, ObjectInfo(key, len(r.body), generation, modified)

        return self._run(go, write=False, key=key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Raises ObjectNotFoundError, BucketNotFoundError, TransientStoreError, ..."""
        name = self._name(key)
        if start < 0 or length < 0:
            raise ConfigurationError(f"invalid range start={start} length={length}")
        if length == 0:
            return b""

        async def go() -> bytes:
            r = await self._send(
                "GET",
                self._object_url(name),
                params={"alt": "media"},
                headers={"Range": f"bytes={start}-{start + length - 1}"},
            )
            if r.status == 416:  # start at or past the end
                return b""
            if r.status == 206:
                return r.body
            if r.status == 200:  # the server ignored the Range header
                return r.body[start : start + length]
            raise await self._error(r, key, write=False)

        return self._run(go, write=False, key=key)

    def get_range_into(self, key: str, start: int, buf: memoryview) -> int:
        """Read ``len(buf)`` bytes from offset ``start`` straight from the socket into
        ``buf``; return how many the store sent (fewer only at the end of the object).

        Not through gcsfs's event loop: that is one thread per process, which every range
        of a parallel download would queue behind, and aiohttp hands each body over as a
        new ``bytes``. This is a plain ``http.client`` request on the calling thread (one
        kept-alive connection per transfer thread) with gcsfs's credentials and request
        parameters. Raises like ``get_range``."""
        length = len(buf)
        if length <= 0:
            self.head(key)
            return 0
        name = self._name(key)
        headers = self._fs._get_headers({"Range": f"bytes={start}-{start + length - 1}"})
        query = urlencode({k: str(v) for k, v in self._fs._get_params({"alt": "media"}).items()})
        target = f"{self._object_url(name)}?{query}"
        where = f"{self.url}{key}"
        try:
            resp = self._request(target, headers)
            if resp.status in (200, 206):
                skip = start if resp.status == 200 else 0  # the Range header was ignored
                got = _read_into(resp, buf, skip)
                if not resp.isclosed():
                    resp.read()
                return got
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            raise TransientStoreError(
                f"{where}: request failed ({type(exc).__name__})", key=key
            ) from None
        if resp.status == 416:
            return 0
        r = _Response(resp.status, resp.headers, body)
        raise self._run(functools.partial(self._error, write=False), r, key, write=False, key=key)

    def _request(self, target: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """GET on this thread's kept-alive connection; once more on a fresh connection
        when the server had closed the idle one (nothing was answered: a safe retry)."""
        reused = getattr(self._local, "conn", None) is not None
        try:
            conn = self._connection()
            conn.request("GET", target, headers=headers)
            return conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self._drop_connection()
            if not reused:
                raise
        conn = self._connection()
        conn.request("GET", target, headers=headers)
        return conn.getresponse()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            url = urlsplit(self._fs._location)
            cls = (
                http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
            )
            timeout = self._fs.requests_timeout or _DEFAULT_TIMEOUT.sock_read
            conn = self._local.conn = cls(url.hostname, url.port, timeout=timeout)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        """One multipart upload; CREATE sends ``ifGenerationMatch=0``, ``Update(v)`` sends
        ``ifGenerationMatch=v``. Raises PreconditionFailedError (also for Update of a missing
        key), ChecksumMismatchError, OutcomeUnknownError, BucketNotFoundError, ..."""
        name = self._name(key)
        params = self._precondition(key, mode)
        crc = crc32c_b64(data)

        async def go() -> ObjectInfo:
            try:
                obj = await self._upload(name, data, crc, params, key)
            except ObjectNotFoundError:
                # GCS answers 412 for a generation match on a missing object; be sure.
                if isinstance(mode, Update):
                    raise PreconditionFailedError(
                        f"{self.url}{key} does not exist", key=key
                    ) from None
                raise
            if obj.get("crc32c") not in (None, crc):
                # Only a server that does not verify checksums (the emulator) gets here:
                # it stored damaged bytes, so what is under the key now is unknown.
                raise OutcomeUnknownError(
                    f"{self.url}{key}: the store kept bytes with CRC32C {obj['crc32c']}, "
                    f"sent {crc}",
                    key=key,
                )
            return self._info(key, obj)

        return self._run(go, write=True, key=key)

    def delete(self, key: str) -> None:
        """Deleting a missing key is fine; a missing bucket raises BucketNotFoundError."""
        name = self._name(key)
        self._run(self._delete, name, key, write=True, key=key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects under ``prefix`` in key order, without ``.cloudckpt/``. Uncached."""
        items = self._run(
            self._list_raw, self._root + prefix, "name,size,generation,updated", write=False
        )
        for obj in items:
            key = obj["name"][len(self._root) :]
            if not key.startswith(INTERNAL_PREFIX):
                yield self._info(key, obj)

    def list_dirs(self, prefix: str = "") -> Sequence[str]:
        """``Store.list_dirs`` by a delimiter listing. Uncached."""
        names = self._run(self._list_prefixes, self._root + prefix, write=False)
        rels = (n[len(self._root) :] for n in names)
        return sorted(r[len(prefix) :] for r in rels if r and not r.startswith(INTERNAL_PREFIX))

    # --- multipart (parallel composite upload) ---------------------------------------

    def create_multipart(self, key: str) -> MultipartUpload:
        """Writes the marker ``.cloudckpt/uploads/<id>/target`` naming ``key``."""
        validate_key(key)
        upload_id = uuid.uuid4().hex
        name = self._upload_prefix(upload_id) + _MARKER
        body = key.encode()
        self._run(
            self._upload,
            name,
            body,
            crc32c_b64(body),
            {"ifGenerationMatch": "0"},
            key,
            {_KEY_META: key},
            write=True,
            key=key,
        )
        return MultipartUpload(key, upload_id)

    def upload_part(
        self,
        upload: MultipartUpload,
        part_number: int,
        data: bytes | memoryview,
        *,
        crc32c: str | None = None,
    ) -> PartInfo:
        """Stores the part as an object (etag = its generation). Raises
        ChecksumMismatchError if the store received bytes that do not match ``crc32c``."""
        if not 1 <= part_number <= self.capabilities.max_parts:
            raise StoreError(f"part number {part_number} out of range", key=upload.key)
        name = f"{self._upload_prefix(upload.upload_id)}{part_number:05d}"
        crc = crc32c or crc32c_b64(data)

        async def go() -> PartInfo:
            obj = await self._upload(name, data, crc, {}, upload.key)
            if obj.get("crc32c") not in (None, crc):
                # Real GCS answers 400 itself; the emulator stores and reports what it got.
                await self._delete(name, upload.key, str(obj["generation"]))
                raise ChecksumMismatchError(
                    f"part {part_number} of {self.url}{upload.key}: CRC32C mismatch "
                    f"(sent {crc}, the store received bytes with {obj['crc32c']})",
                    key=upload.key,
                )
            return PartInfo(part_number, str(obj["generation"]), obj.get("crc32c"), len(data))

        return self._run(go, write=True, key=upload.key)

    def complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[PartInfo], *, mode: PutMode = CREATE
    ) -> ObjectInfo:
        """Compose the parts (tree-wise, 32 per call) into the key, then delete them.

        CREATE composes with ``ifGenerationMatch=0``. On a store whose compose ignores
        preconditions or keeps the old generation (fake-gcs-server) a CREATE composite is
        built in the scratch space and then written by one multipart upload (holds the
        object in memory: emulators only), as is an OVERWRITE onto an existing key; an
        OVERWRITE onto a missing key composes in place. Raises PreconditionFailedError, ObjectNotFoundError (no
        such upload), StoreError (bad part list), OutcomeUnknownError, ..."""
        if isinstance(mode, Update):
            raise StoreError("compare-and-swap completion of multipart uploads is not offered")
        numbers = [p.part_number for p in parts]
        if not parts or numbers != sorted(set(numbers)):
            raise StoreError(
                "parts must be non-empty, unique and in ascending order", key=upload.key
            )
        scratch = self._upload_prefix(upload.upload_id)
        name = self._name(upload.key)
        return self._run(
            self._complete, upload, parts, scratch, name, mode, write=True, key=upload.key
        )

    async def _complete(
        self,
        upload: MultipartUpload,
        parts: Sequence[PartInfo],
        scratch: str,
        name: str,
        mode: PutMode,
    ) -> ObjectInfo:
        key = upload.key
        sources = await self._part_sources(upload, parts, scratch)
        sources = await self._compose_down(sources, scratch, key)
        if not await self._compose_is_trustworthy() and not (
            isinstance(mode, Overwrite) and not await self._exists(name)
        ):
            # Composing onto the key could overwrite despite CREATE, or leave the old
            # generation in place (a later compare-and-swap would not see the change).
            # An OVERWRITE onto a key that does not exist (every checkpoint data file: a
            # fresh key under a unique attempt prefix) risks neither: it composes in place
            # (docs/performance.md: the read-back and re-upload were 2/3 of the bytes).
            final = await self._compose(f"{scratch}final", sources, {}, key)
            r = await self._send("GET", self._object_url(final["name"]), params={"alt": "media"})
            if r.status != 200:
                raise await self._error(r, key, write=True)
            obj = await self._upload(
                name, r.body, final["crc32c"], self._precondition(key, mode), key
            )
        else:
            obj = await self._compose(name, sources, self._precondition(key, mode), key)

        await self._cleanup(scratch, key)
        return self._info(key, obj)

    async def _part_sources(
        self, upload: MultipartUpload, parts: Sequence[PartInfo], scratch: str
    ) -> builtins.list[tuple[str, str]]:
        """(object name, generation) of each part, in order. Raises ObjectNotFoundError (no
        such upload) or StoreError (a part missing, or replaced since it was uploaded)."""
        key = upload.key
        stored = {
            o["name"][len(scratch) :]: o
            for o in await self._list_raw(scratch, "name,generation,metadata")
        }
        marker = stored.get(_MARKER)
        if marker is None or (marker.get("metadata") or {}).get(_KEY_META) != key:
            raise ObjectNotFoundError(
                f"multipart upload {upload.upload_id} of {self.url}{key} does not exist", key=key
            )
        sources = []
        for part in parts:
            obj = stored.get(f"{part.part_number:05d}")
            if obj is None or str(obj["generation"]) != part.etag:
                raise StoreError(
                    f"part {part.part_number} was not uploaded (or was replaced)", key=key
                )
            sources.append((obj["name"], part.etag))
        return sources

    async def _compose_down(
        self, sources: builtins.list[tuple[str, str]], scratch: str, key: str
    ) -> builtins.list[tuple[str, str]]:
        """Compose ``sources`` in groups, level by level under ``scratch``, until one
        compose can take them all (GCS composes at most ``_MAX_COMPOSE_SOURCES``)."""
        level = 0
        while len(sources) > _MAX_COMPOSE_SOURCES:
            groups = [
                sources[i : i + _MAX_COMPOSE_SOURCES]
                for i in range(0, len(sources), _MAX_COMPOSE_SOURCES)
            ]
            results = await self._gather(
                [
                    self._compose(f"{scratch}c{level}-{i:05d}", group, {}, key)
                    for i, group in enumerate(groups)
                ]
            )
            sources = [(o["name"], str(o["generation"])) for o in results]
            level += 1
        return sources

    async def _exists(self, name: str) -> bool:
        r = await self._send("GET", self._object_url(name), params={"fields": "generation"})
        if r.status == 404:
            return False
        if r.status != 200:
            raise await self._error(r, None, write=False)
        return True

    async def _compose(
        self, dest: str, sources: Sequence[tuple[str, str]], params: dict[str, str], key: str
    ) -> dict[str, Any]:
        body = {
            "sourceObjects": [{"name": n, "generation": g} for n, g in sources],
            "destination": {"contentType": "application/octet-stream"},
        }
        r = await self._send(
            "POST", f"{self._object_url(dest)}/compose", params=params, json_body=body
        )
        if r.status != 200:
            raise await self._error(r, key, write=True)
        return r.json()

    async def _compose_is_trustworthy(self) -> bool:
        """Whether composing onto an existing object behaves like GCS: it honours
        ``ifGenerationMatch=0`` and gives the object a new generation. Probed once by
        composing a scratch object onto itself (fake-gcs-server fails both)."""
        if self._compose_trusted is None:
            name = f"{self._root}{INTERNAL_PREFIX}probe/{uuid.uuid4().hex}"
            first = str((await self._upload(name, b"p", crc32c_b64(b"p"), {}, name))["generation"])
            try:
                try:
                    await self._compose(name, [(name, first)], {"ifGenerationMatch": "0"}, name)
                    trusted = False
                except PreconditionFailedError:
                    again = await self._compose(name, [(name, first)], {}, name)
                    trusted = str(again["generation"]) != first
            finally:
                await self._delete(name, None)
            if not trusted:
                logger.info(
                    "%s: compose ignores preconditions or keeps generations; multipart "
                    "completion re-uploads the composed object",
                    self._endpoint,
                )
            self._compose_trusted = trusted
        return self._compose_trusted

    async def _cleanup(self, scratch: str, key: str) -> None:
        """Delete an upload's scratch objects, the marker last (so leftovers stay listed)."""
        try:
            names = [o["name"] for o in await self._list_raw(scratch, "name")]
            await self._gather([self._delete(n, key) for n in names if n != scratch + _MARKER])
            await self._delete(scratch + _MARKER, key)
        except StoreError as exc:  # the upload is listed until GC aborts it
            logger.warning("could not clean up %s%s: %s", self.url, scratch, exc)

    def abort_multipart(self, upload: MultipartUpload) -> None:
        """Delete every object of the upload. An unknown upload is not an error."""
        scratch = self._upload_prefix(upload.upload_id)

        async def go() -> None:
            names = [o["name"] for o in await self._list_raw(scratch, "name")]
            marker = scratch + _MARKER
            await self._gather([self._delete(n, upload.key) for n in names if n != marker])
            await self._delete(marker, upload.key)

        self._run(go, write=True, key=upload.key)

    def list_multipart(self, prefix: str = "") -> builtins.list[PendingUpload]:
        """Uploads with a marker whose key starts with ``prefix``, started at the marker's
        creation time. Parts whose marker is gone (an abort raced an upload_part) are
        reported with key ``""`` when ``prefix`` is empty, so GC can abort them."""
        base = self._root + _UPLOADS
        items = self._run(self._list_raw, base, "name,timeCreated,metadata", write=False)
        uploads: dict[str, dict[str, Any]] = {}
        for obj in items:
            upload_id, _, leaf = obj["name"][len(base) :].partition("/")
            state = uploads.setdefault(upload_id, {"key": None, "initiated": None})
            created = _parse_time(obj.get("timeCreated"))
            if leaf == _MARKER:
                state["key"] = (obj.get("metadata") or {}).get(_KEY_META, "")
                state["initiated"] = created
            elif state["key"] is None and created is not None:
                state["initiated"] = min(filter(None, (state["initiated"], created)))
        pending = [
            PendingUpload(state["key"] or "", upload_id, state["initiated"])
            for upload_id, state in uploads.items()
            if _UPLOAD_ID.fullmatch(upload_id)
            and (state["key"] or "").startswith(prefix)
            and (state["key"] is not None or prefix == "")
        ]
        return sorted(pending, key=lambda p: (p.key, p.upload_id))

    # --- clock and lifecycle --------------------------------------------------------

    def now(self) -> dt.datetime:
        """The ``Date`` header of a cheap listing; else the time of a tiny write."""

        async def go() -> dt.datetime:
            r = await self._send(
                "GET",
                self._objects_url,
                params={"maxResults": "1", "prefix": f"{self._root}{INTERNAL_PREFIX}clock"},
            )
            if r.status != 200:
                raise await self._error(r, None, write=False)
            date = _parse_http_date(r.headers.get("Date"))
            if date is not None:
                return date.astimezone(dt.timezone.utc)
            name = f"{self._root}{INTERNAL_PREFIX}clock"
            obj = await self._upload(name, b"", crc32c_b64(b""), {}, name)
            written = _parse_time(obj.get("updated"))
            if written is None:
                raise StoreError(f"{self.url}: the store reports no time")
            return written

        return self._run(go, write=False)

    def close(self) -> None:
        """Close gcsfs's HTTP session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        session = self._fs._session
        if session is not None and not session.closed:
            try:
                fsspec.asyn.sync(self._fs.loop, session.close)
            except Exception:  # closing is best effort
                logger.debug("closing the GCS session failed", exc_info=True)
