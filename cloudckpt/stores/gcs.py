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

``cloudckpt.stores._gcs_client`` sets up gcsfs and sends the requests;
``cloudckpt.stores._gcs_errors`` maps failures into ``cloudckpt.errors``. No retries
happen here: a read that fails raises ``TransientStoreError`` and a write whose
outcome is unknown raises ``OutcomeUnknownError``; the caller decides.
"""

from __future__ import annotations

import asyncio
import builtins
import datetime as dt
import functools
import http.client
import io
import json
import logging
import re
import uuid
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote, urlencode

import fsspec.asyn

from cloudckpt.errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    ConfigurationError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PreconditionFailedError,
    StoreError,
    TransientStoreError,
    redact_url,
)
from cloudckpt.stores._gcs_client import (
    Response,
    ThreadConnections,
    goog_hashes,
    make_filesystem,
    parse_http_date,
    parse_time,
    send,
)
from cloudckpt.stores._gcs_errors import response_error, run
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
    payload_crc32c,
    validate_key,
)

logger = logging.getLogger(__name__)

_UPLOADS = INTERNAL_PREFIX + "uploads/"
_MARKER = "target"  # .cloudckpt/uploads/<id>/target holds the destination key
_KEY_META = "cloudckpt-key"
_MAX_COMPOSE_SOURCES = 32  # GCS limit per compose call
_CONCURRENCY = 16  # parallel compose/delete calls inside one operation
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_GENERATION = re.compile(r"[1-9][0-9]*")


def _read_into(resp: http.client.HTTPResponse, buf: memoryview, skip: int) -> int:
    """Read a response body into ``buf`` after discarding ``skip`` bytes; the number of
    body bytes that belong in ``buf`` (at most ``len(buf)``).

    Raises http.client.IncompleteRead when the body ends before the length its headers
    announced: ``http.client`` reports a connection closed cleanly (FIN) mid-body as the
    end of the body, and a cut answer must not pass for a short object."""
    declared = resp.length  # None for a chunked body (http.client checks those itself)
    expected = len(buf) if declared is None else min(len(buf), max(0, declared - skip))
    while skip > 0:
        skipped = len(resp.read(min(skip, 1 << 20)))
        if not skipped:
            break
        skip -= skipped
    got = 0
    while got < len(buf) and not skip:
        n = resp.readinto(buf[got:])
        if not n:
            break
        got += n
    if declared is not None and got < expected:
        raise http.client.IncompleteRead(b"", expected - got)
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
        self._fs = make_filesystem(storage_options, self.url)
        self._endpoint = redact_url(self._fs._location)
        self._objects_url = f"{self._fs._location}/storage/v1/b/{quote(bucket, safe='')}/o"
        self._upload_url = f"{self._fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o"
        # Real GCS composes like any other write; fake-gcs-server does not (probed once).
        self._compose_trusted: bool | None = True if self._fs.on_google else None
        self._connections = ThreadConnections(self._fs)  # for get_range_into
        self._closed = False

    # --- transport and error mapping ------------------------------------------------

    def _run(self, coro_fn: Any, *args: Any, write: bool, key: str | None = None) -> Any:
        """Run ``coro_fn(*args)`` on gcsfs's loop; map transport failures to store errors
        (``_gcs_errors.run``). Raises StoreError once the store is closed."""
        if self._closed:
            raise StoreError(f"{self.url}: the store is closed", key=key)
        return run(
            self._fs.loop,
            coro_fn,
            *args,
            url=self.url,
            endpoint=self._endpoint,
            write=write,
            key=key,
        )

    async def _send(
        self,
        method: str,
        url: str,
        *,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        data: io.BytesIO | None = None,
        json_body: Any = None,
    ) -> Response:
        """One request through gcsfs's session with its credentials; no retries."""
        return await send(
            self._fs, method, url, params=params, headers=headers, data=data, json_body=json_body
        )

    async def _error(self, r: Response, key: str | None, *, write: bool) -> StoreError:
        """The cloudckpt error for a failed response (never contains credentials)."""
        missing = r.status == 404 and await self._bucket_missing(r)
        return response_error(r, self.url, self._bucket, key, write=write, bucket_missing=missing)

    async def _bucket_missing(self, r: Response) -> bool:
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
            key, int(obj.get("size", 0)), str(obj["generation"]), parse_time(obj.get("updated"))
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

    def stored_crc32c(self, key: str) -> str | None:
        """The CRC32C GCS keeps for every object, composed ones included (its metadata's
        ``crc32c``, base64 as ``crc32c_b64``): one metadata read, no download. Raises
        ObjectNotFoundError, BucketNotFoundError, TransientStoreError, ..."""
        name = self._name(key)

        async def go() -> str | None:
            r = await self._send("GET", self._object_url(name), params={"fields": "crc32c"})
            if r.status != 200:
                raise await self._error(r, key, write=False)
            crc = r.json().get("crc32c")
            return str(crc) if crc else None

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
            hashes = goog_hashes(r.headers)
            encoding = r.headers.get("x-goog-stored-content-encoding", "identity")
            if "crc32c" in hashes and encoding == "identity":
                actual = crc32c_b64(r.body)
                if actual != hashes["crc32c"]:
                    raise TransientStoreError(
                        f"{self.url}{key}: downloaded bytes have CRC32C {actual}, the store "
                        f"says {hashes['crc32c']} (damaged in transit)",
                        key=key,
                    )
            modified = parse_http_date(r.headers.get("Last-Modified"))
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
            resp = self._connections.get(target, headers)
            if resp.status in (200, 206):
                skip = start if resp.status == 200 else 0  # the Range header was ignored
                got = _read_into(resp, buf, skip)
                if not resp.isclosed():
                    resp.read()
                return got
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self._connections.drop()
            raise TransientStoreError(
                f"{where}: request failed ({type(exc).__name__})", key=key
            ) from None
        if resp.status == 416:
            return 0
        r = Response(resp.status, resp.headers, body)
        raise self._run(functools.partial(self._error, write=False), r, key, write=False, key=key)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        """One multipart upload; CREATE sends ``ifGenerationMatch=0``, ``Update(v)`` sends
        ``ifGenerationMatch=v``. Raises PreconditionFailedError (also for Update of a missing
        key), ChecksumMismatchError, OutcomeUnknownError, BucketNotFoundError, ..."""
        name = self._name(key)
        params = self._precondition(key, mode)
        crc = payload_crc32c(data)

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
            created = parse_time(obj.get("timeCreated"))
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
            date = parse_http_date(r.headers.get("Date"))
            if date is not None:
                return date.astimezone(dt.timezone.utc)
            name = f"{self._root}{INTERNAL_PREFIX}clock"
            obj = await self._upload(name, b"", crc32c_b64(b""), {}, name)
            written = parse_time(obj.get("updated"))
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
