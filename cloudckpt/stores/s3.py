"""``s3://bucket/prefix``: Amazon S3 and S3-compatible stores through one botocore client.

The client (what ``boto3.client("s3")`` returns) is called directly rather than through
s3fs: s3fs drops ``IfMatch`` on its multipart path and reports lost races as
``FileExistsError`` / ``OSError`` (docs/design.md §4). Conditional
writes map to S3 headers:

- ``CREATE`` → ``If-None-Match: *`` (PutObject and CompleteMultipartUpload);
- ``Update(etag)`` → ``If-Match: <etag>`` (PutObject only; moto ignores it on
  CompleteMultipartUpload, so compare-and-swap completion is refused).

Versions are ETags exactly as S3 returns them (with their quotes). They are content
hashes, so identical bytes keep the version (``Capabilities.unique_versions=False``).

Every write carries a CRC32C we compute (``google-crc32c``; botocore can only compute CRC32C
with ``awscrt``), which S3 and SeaweedFS verify (moto stores it without checking).
Full-object CRC32Cs that come back on ``get`` are checked here, too.

Storage options follow s3fs: ``key``, ``secret``, ``token``, ``endpoint_url``, ``profile``,
``anon``, ``use_ssl``, ``client_kwargs``, ``config_kwargs``, ``s3_additional_kwargs``,
``requester_pays``. Anything not given comes from the usual AWS sources (``AWS_*``
environment variables including ``AWS_ENDPOINT_URL[_S3]``, config and credentials files);
the region falls back to ``AWS_REGION`` and then ``us-east-1``.

``cloudckpt.stores._s3_client`` sets up the client from these options;
``cloudckpt.stores._s3_errors`` maps botocore's failures into ``cloudckpt.errors``;
``cloudckpt.stores._s3_fast_get`` sends ``get_range_into``'s ranged GETs without botocore's
per-call machinery once botocore has shown one that succeeded (anything but an exact 206
goes back to botocore).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import datetime as dt
import email.utils
import http.client
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import botocore.exceptions as bce
import botocore.response

from cloudckpt.errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    ObjectNotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientStoreError,
    redact_url,
)
from cloudckpt.stores._s3_client import make_client, parse_options, request_body
from cloudckpt.stores._s3_errors import S3Errors, client_error_info
from cloudckpt.stores._s3_fast_get import FastGet
from cloudckpt.stores.base import (
    CREATE,
    INTERNAL_PREFIX,
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
    payload_crc32c,
    validate_key,
)


def _read_body_into(resp: Mapping[str, Any], buf: memoryview, paths: _ReadPaths) -> int:
    """Read a GetObject response body into ``buf``; return the body's length.

    When the body is botocore's plain ``StreamingBody`` over an ``http.client`` response of
    known length that fits, the bytes are read straight from the socket into ``buf`` and
    the connection goes back to the pool; otherwise (other botocore versions, checksum-
    validating bodies) through ``read()`` and one copy. A body longer than ``buf`` reports
    its full length (the caller treats that as damage) and only ``len(buf)`` bytes are kept.
    ``paths`` counts which way was taken ("direct" or "copy").
    Raises OSError / http.client.HTTPException / botocore errors from the transport.
    """
    body = resp["Body"]
    declared = resp.get("ContentLength")
    raw: Any = getattr(body, "_raw_stream", None)  # botocore/urllib3 internals, untyped
    fp = getattr(raw, "_fp", None)
    if not (
        type(body) is botocore.response.StreamingBody
        and isinstance(fp, http.client.HTTPResponse)
        and not fp.chunked
        and isinstance(declared, int)
        and fp.length == declared
        and declared <= len(buf)
        and hasattr(raw, "release_conn")
    ):
        paths.hit("copy")
        data = body.read()
        n = min(len(data), len(buf))
        buf[:n] = memoryview(data)[:n]
        return len(data)
    paths.hit("direct")
    got = 0
    try:
        while got < declared:
            n = fp.readinto(buf[got:declared])
            if not n:
                break
            got += n
    except BaseException:
        body.close()  # never hand a half-read connection back to the pool
        raise
    if got < declared:
        body.close()
        raise http.client.IncompleteRead(b"", declared - got)
    raw.release_conn()
    return got


def _came_over_the_network(resp: Mapping[str, Any]) -> bool:
    """Whether a GetObject's answer was read from a socket. Only such an answer may teach
    the lean path: a ``before-send`` handler (moto's ``mock_aws``, a user's stub) can answer
    in botocore's place a request that was never sent."""
    raw = getattr(resp["Body"], "_raw_stream", None)
    return isinstance(getattr(raw, "_fp", None), http.client.HTTPResponse)


class _ReadPaths(collections.Counter):
    """How ``get_range_into`` read its bodies: "direct" (socket straight into the buffer)
    or "copy" (botocore's ``read()``). Tests check it, so that a fault test meant for the
    direct path fails if a botocore change silently sends it the other way."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def hit(self, path: str) -> None:
        with self._lock:
            self[path] += 1


class S3Store(Store):
    """A store rooted at ``s3://bucket/prefix``. See the module docstring.

    Raises (constructor): ``ConfigurationError`` for unknown or inconsistent options,
    ``CredentialsError`` for a profile that does not exist.
    """

    capabilities = Capabilities(unique_versions=False)
    _delete_batch = 1000  # DeleteObjects' limit

    def __init__(self, bucket: str, prefix: str = "", **storage_options: Any) -> None:
        self.bucket = bucket
        self._prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = redact_url(f"s3://{bucket}/{self._prefix}")
        self._bucket_seen = False
        self.read_paths = _ReadPaths()
        self._extra = parse_options(storage_options, self.url)
        self._client, secrets = make_client(storage_options, self.url)
        self._endpoint = redact_url(self._client.meta.endpoint_url or "")
        self._errors = S3Errors(self.url, bucket, self._endpoint, secrets)
        self._op_members: dict[str, frozenset[str]] = {}
        self._fast = FastGet(self._client, bucket, self._with_extra("GetObject", {}))

    # --- helpers --------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self._prefix + validate_key(key)

    def _with_extra(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        """Add the ``s3_additional_kwargs`` this operation accepts (as s3fs does)."""
        if not self._extra:
            return params
        members = self._op_members.get(op)
        if members is None:
            model = self._client.meta.service_model.operation_model(op)
            members = self._op_members[op] = frozenset(model.input_shape.members)
        return {**{k: v for k, v in self._extra.items() if k in members}, **params}

    def _call(
        self,
        method: str,
        key: str | None = None,
        *,
        write: bool = False,
        missing: type[StoreError] = ObjectNotFoundError,
        **params: Any,
    ) -> dict[str, Any]:
        """``client.<method>(Bucket=..., **params)`` with errors mapped by ``_errors``."""
        op = "".join(w.capitalize() for w in method.split("_"))
        params = self._with_extra(op, {"Bucket": self.bucket, **params})
        with self._errors(method, key, write=write, missing=missing):
            return getattr(self._client, method)(**params)

    def _check_bucket(self) -> None:
        """Raise BucketNotFoundError if the bucket is missing (HEAD 404s cannot tell)."""
        if not self._bucket_seen:
            # 403 means the bucket exists and this role may not HEAD it.
            with contextlib.suppress(PermissionDeniedError):
                self._probe()
            self._bucket_seen = True

    @staticmethod
    def _info(key: str, resp: Mapping[str, Any], size: int | None = None) -> ObjectInfo:
        modified = resp.get("LastModified")
        if modified is None:
            header = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("last-modified")
            modified = email.utils.parsedate_to_datetime(header) if header else None
        if modified is not None:
            modified = modified.astimezone(dt.timezone.utc)
        length = resp.get("ContentLength", resp.get("Size")) if size is None else size
        return ObjectInfo(key, int(length or 0), resp["ETag"], modified)

    # --- single objects -------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        """Raises ObjectNotFoundError, BucketNotFoundError, TransientStoreError, ..."""
        try:
            resp = self._call("head_object", key, Key=self._full(key))
        except ObjectNotFoundError:
            self._check_bucket()  # a HEAD 404 is the same for a missing bucket
            raise
        except PermissionDeniedError:
            # A HEAD 403 has no body: bad credentials look like a denial. A one-byte GET
            # gets the real error code (InvalidAccessKeyId, SignatureDoesNotMatch, ...).
            with contextlib.suppress(ObjectNotFoundError):
                self.get_range(key, 0, 1)
            raise
        self._bucket_seen = True
        return self._info(key, resp)

    def stored_crc32c(self, key: str) -> str | None:
        """The full-object CRC32C S3 recorded (HEAD with ``ChecksumMode=ENABLED``: every
        put of this adapter sends one), or None (none recorded, or a composite one of a
        multipart upload). Raises as ``head``."""
        resp = self._call("head_object", key, Key=self._full(key), ChecksumMode="ENABLED")
        crc = resp.get("ChecksumCRC32C")
        if not crc or "-" in crc or resp.get("ChecksumType") == "COMPOSITE":
            return None
        return str(crc)

    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        """Raises ObjectNotFoundError, BucketNotFoundError, ChecksumMismatchError, ..."""
        params = self._with_extra(
            "GetObject", {"Bucket": self.bucket, "Key": self._full(key), "ChecksumMode": "ENABLED"}
        )
        with self._errors("get_object", key):
            resp = self._client.get_object(**params)
            data = resp["Body"].read()
        # botocore cannot check CRC32C without awscrt; a full-object one is cheap here.
        expected = resp.get("ChecksumCRC32C")
        full_object = expected and "-" not in expected and resp.get("ChecksumType") != "COMPOSITE"
        if full_object and crc32c_b64(data) != expected:
            raise ChecksumMismatchError(
                f"get_object {self._errors.where(key)}: bytes do not match the stored CRC32C",
                key=key,
                hint="The bytes were damaged in transit or at rest; read again",
            )
        return data, self._info(key, resp, size=len(data))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Raises ObjectNotFoundError, BucketNotFoundError, TransientStoreError, ..."""
        if length <= 0:
            self.head(key)
            return b""
        params = self._with_extra(
            "GetObject",
            {
                "Bucket": self.bucket,
                "Key": self._full(key),
                "Range": f"bytes={start}-{start + length - 1}",
            },
        )
        try:
            with self._errors("get_object", key):
                return self._client.get_object(**params)["Body"].read()
        except StoreError as exc:
            # 416 InvalidRange: the key exists and the range starts at or after its end.
            cause = exc.__cause__
            if isinstance(cause, bce.ClientError) and client_error_info(cause)[1] == 416:
                return b""
            raise

    def get_range_into(self, key: str, start: int, buf: memoryview) -> int:
        """Read ``len(buf)`` bytes from offset ``start`` into ``buf`` (through the lean
        path of ``_s3_fast_get`` once it is ready, else botocore's GetObject, from the
        socket straight into the buffer where botocore allows); return how many the store sent
        (fewer only at the end of the object). Raises like ``get_range``; a response cut
        short raises TransientStoreError."""
        length = len(buf)
        if length <= 0:
            self.head(key)
            return 0
        full = self._full(key)
        if self._fast.ready:
            got = self._fast.get_range_into(full, start, buf)
            if got is not None:
                self.read_paths.hit("lean")
                return got
            self.read_paths.hit("fallback")  # (the lean path refused the answer: botocore's turn)
        rng = f"bytes={start}-{start + length - 1}"
        params = self._with_extra("GetObject", {"Bucket": self.bucket, "Key": full, "Range": rng})
        self._fast.expect()
        try:
            with self._errors("get_object", key):
                resp = self._client.get_object(**params)
                sent = _came_over_the_network(resp)
                try:
                    got = _read_body_into(resp, buf, self.read_paths)
                    if sent:
                        self._fast.promote(full, rng)  # (only a GET that succeeded teaches it)
                    return got
                except (OSError, http.client.HTTPException) as exc:
                    raise TransientStoreError(
                        f"get_object {self._errors.where(key)}: the response broke off "
                        f"({type(exc).__name__})",
                        key=key,
                    ) from exc
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, bce.ClientError) and client_error_info(cause)[1] == 416:
                return 0
            raise

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        """Raises PreconditionFailedError (lost create/compare-and-swap, or Update of a
        missing key), StoreConflictError (409), OutcomeUnknownError, BucketNotFoundError, ..."""
        body = request_body(data)  # no copy: the caller keeps data unchanged until this returns
        params: dict[str, Any] = {
            "Key": self._full(key),
            "Body": body,
            # Our own CRC32C: botocore then computes none, and S3 verifies this one.
            "ChecksumAlgorithm": "CRC32C",
            "ChecksumCRC32C": payload_crc32c(data),
        }
        if isinstance(mode, Create):
            params["IfNoneMatch"] = "*"
        elif isinstance(mode, Update):
            params["IfMatch"] = mode.version
        # S3 answers If-Match on a missing key with 404 NoSuchKey (SeaweedFS: 412): for us
        # a lost CAS either way.
        missing = PreconditionFailedError if isinstance(mode, Update) else ObjectNotFoundError
        resp = self._call("put_object", key, write=True, missing=missing, **params)
        return self._info(key, resp, size=memoryview(data).nbytes)

    def delete(self, key: str) -> None:
        """Deleting a missing key is fine. Raises OutcomeUnknownError, BucketNotFoundError, ..."""
        self._call("delete_object", key, write=True, Key=self._full(key))

    def delete_many(self, keys: Sequence[str]) -> None:
        """DeleteObjects in batches of 1000. Raises like ``delete``, for the first failure."""
        keys = list(keys)
        for i in range(0, len(keys), self._delete_batch):
            batch = keys[i : i + self._delete_batch]
            objects = [{"Key": self._full(k)} for k in batch]
            resp = self._call(
                "delete_objects", batch[0], write=True, Delete={"Objects": objects, "Quiet": True}
            )
            for err in resp.get("Errors", []):
                if err.get("Code") == "NoSuchKey":
                    continue
                rel = str(err.get("Key", ""))[len(self._prefix) :]
                fake = bce.ClientError(
                    {"Error": {"Code": err.get("Code"), "Message": err.get("Message")}},
                    "DeleteObjects",
                )
                self._errors.raise_client_error(
                    fake, "delete_objects", rel, True, ObjectNotFoundError
                )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Keys relative to the root, in key order, without ``.cloudckpt/``.
        Raises BucketNotFoundError, TransientStoreError, ..."""
        paginator = self._client.get_paginator("list_objects_v2")
        params = self._with_extra(
            "ListObjectsV2", {"Bucket": self.bucket, "Prefix": self._prefix + prefix}
        )
        with self._errors("list_objects_v2", prefix):
            pages = iter(paginator.paginate(**params))
        while True:
            with self._errors("list_objects_v2", prefix):
                page = next(pages, None)
            if page is None:
                return
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(self._prefix) :]
                if rel and not rel.startswith(INTERNAL_PREFIX):
                    yield self._info(rel, obj)

    def list_dirs(self, prefix: str = "") -> Sequence[str]:
        """``Store.list_dirs`` by a delimiter listing (the common prefixes).
        Raises BucketNotFoundError, TransientStoreError, ..."""
        paginator = self._client.get_paginator("list_objects_v2")
        params = self._with_extra(
            "ListObjectsV2",
            {"Bucket": self.bucket, "Prefix": self._prefix + prefix, "Delimiter": "/"},
        )
        found = []
        with self._errors("list_objects_v2", prefix):
            for page in paginator.paginate(**params):
                for common in page.get("CommonPrefixes", []):
                    rel = common["Prefix"][len(self._prefix) :]
                    if rel and not rel.startswith(INTERNAL_PREFIX):
                        found.append(rel[len(prefix) :])
        return sorted(found)

    # --- multipart ------------------------------------------------------------------

    def create_multipart(self, key: str) -> MultipartUpload:
        """Raises BucketNotFoundError, TransientStoreError (safe to retry: at worst an
        orphan upload, which garbage collection aborts), ..."""
        resp = self._call(
            "create_multipart_upload", key, Key=self._full(key), ChecksumAlgorithm="CRC32C"
        )
        return MultipartUpload(key, resp["UploadId"])

    def upload_part(
        self,
        upload: MultipartUpload,
        part_number: int,
        data: bytes | memoryview,
        *,
        crc32c: str | None = None,
    ) -> PartInfo:
        """Raises ChecksumMismatchError (S3 BadDigest; moto never checks),
        ObjectNotFoundError (unknown upload), TransientStoreError (safe to retry), ..."""
        body = request_body(data)  # no copy: the caller keeps data unchanged until this returns
        crc = crc32c or crc32c_b64(data)
        resp = self._call(
            "upload_part",
            upload.key,
            Key=self._full(upload.key),
            UploadId=upload.upload_id,
            PartNumber=part_number,
            Body=body,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=crc,
        )
        return PartInfo(
            part_number, resp["ETag"], resp.get("ChecksumCRC32C") or crc, memoryview(data).nbytes
        )

    def complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[PartInfo], *, mode: PutMode = CREATE
    ) -> ObjectInfo:
        """Raises PreconditionFailedError (CREATE and the key exists), OutcomeUnknownError,
        StoreError (Update mode: moto ignores If-Match here, so it is not offered), ..."""
        if isinstance(mode, Update):
            raise StoreError("compare-and-swap completion of multipart uploads is not offered")
        entries = []
        for p in parts:
            entry: dict[str, Any] = {"PartNumber": p.part_number, "ETag": p.etag}
            if p.crc32c:
                entry["ChecksumCRC32C"] = p.crc32c
            entries.append(entry)
        params: dict[str, Any] = {
            "Key": self._full(upload.key),
            "UploadId": upload.upload_id,
            "MultipartUpload": {"Parts": entries},
        }
        if isinstance(mode, Create):
            params["IfNoneMatch"] = "*"
        resp = self._call("complete_multipart_upload", upload.key, write=True, **params)
        return self._info(upload.key, resp, size=sum(p.size for p in parts))

    def abort_multipart(self, upload: MultipartUpload) -> None:
        """Aborting an unknown upload is fine. Raises BucketNotFoundError, ..."""
        with contextlib.suppress(ObjectNotFoundError):  # NoSuchUpload
            self._call(
                "abort_multipart_upload",
                upload.key,
                Key=self._full(upload.key),
                UploadId=upload.upload_id,
            )

    def list_multipart(self, prefix: str = "") -> builtins.list[PendingUpload]:
        """Incomplete uploads under ``prefix``, sorted by (key, upload id).
        ``initiated`` is on the store's clock (moto reports 2010 for every upload)."""
        paginator = self._client.get_paginator("list_multipart_uploads")
        params = self._with_extra(
            "ListMultipartUploads", {"Bucket": self.bucket, "Prefix": self._prefix + prefix}
        )
        found = []
        with self._errors("list_multipart_uploads", prefix):
            for page in paginator.paginate(**params):
                for u in page.get("Uploads", []):
                    initiated = u.get("Initiated")
                    if initiated is not None:
                        initiated = initiated.astimezone(dt.timezone.utc)
                    rel = u["Key"][len(self._prefix) :]
                    found.append(PendingUpload(rel, u["UploadId"], initiated))
        return sorted(found, key=lambda p: (p.key, p.upload_id))

    # --- clock and lifecycle --------------------------------------------------------

    def _probe(self) -> dict[str, Any]:
        """A one-key listing of the run prefix: proves the bucket exists and carries the
        store's Date header. (Not HeadBucket: IAM checks that as s3:ListBucket without a
        prefix condition, so a policy scoped to the run prefix would have to allow listing
        the whole bucket.)"""
        return self._call(
            "list_objects_v2", missing=BucketNotFoundError, Prefix=self._prefix, MaxKeys=1
        )

    def now(self) -> dt.datetime:
        """The store's clock: the ``Date`` header of a one-key listing (1 s resolution).
        Raises BucketNotFoundError, TransientStoreError, ..."""
        resp = self._probe()
        self._bucket_seen = True
        header = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        if not header:
            raise StoreError(f"{self.url}: the store sent no Date header")
        return email.utils.parsedate_to_datetime(header).astimezone(dt.timezone.utc)

    def close(self) -> None:
        self._client.close()
