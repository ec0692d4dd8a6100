"""``az://container/prefix`` (also ``abfs://`` and ``abfss://``): Azure Blob Storage through
``azure-storage-blob`` (extra ``[azure]``).

URL forms (as adlfs writes them): ``az://container/prefix``, ``abfs[s]://container/prefix``
and ``abfs[s]://container@account.dfs.core.windows.net/prefix`` (the account comes from the
host; requests go to the account's blob endpoint).

Conditional writes map to Azure's headers (docs/design.md §4):

- ``CREATE`` → ``If-None-Match: *`` on Put Blob and on Put Block List; Azure answers 409
  ``BlobAlreadyExists``, mapped to ``PreconditionFailedError``;
- ``Update(etag)`` → ``If-Match: <etag>`` on Put Blob; a stale ETag answers 412
  ``ConditionNotMet``, a missing blob 412 or 404; both are ``PreconditionFailedError``.

Versions are ETags, which change on every write, identical bytes too (measured on Azurite;
Azure documents it). Every Put Blob and Put Block carries a transactional ``Content-MD5``
that the service checks (400 ``Md5Mismatch`` → ``ChecksumMismatchError``); a part's
CRC32C handed in by the caller is checked against the bytes here before they are sent (Azure
knows no CRC32C, and CRC64 needs the separate ``azure-storage-extensions`` package).

Multipart uploads are block blobs: parts are staged as uncommitted blocks of the destination
blob (block ids carry the upload id), and completion is one Put Block List, create-only with
``If-None-Match: *``. A marker blob ``.cloudckpt/uploads/<id>/target`` records the upload and
its start time (on the store's clock) so ``list_multipart`` can report it for GC. Azure has
no call that discards uncommitted blocks without touching the committed blob: ``abort``
deletes the marker, and the service garbage-collects uncommitted blocks after 7 days (or
when the blob's next block list is committed).

SDK retries are off (``retry_total=0``): a retried conditional write can trip over its own
first attempt. A read that fails raises ``TransientStoreError``; a write whose outcome is
unknown raises ``OutcomeUnknownError``; the caller decides.

Credentials, first match wins: storage options (adlfs names) ``connection_string``;
``account_key``, ``sas_token``, ``credential`` or ``anon=True`` with an account name (option
``account_name``, the URL, or ``AZURE_STORAGE_ACCOUNT_NAME``) or ``account_url``; then the
environment: ``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT_KEY``,
``AZURE_STORAGE_SAS_TOKEN``; then ``DefaultAzureCredential`` if ``azure-identity`` is
installed (imported lazily; it asks for a token on the first request). Nothing found raises
``CredentialsError`` saying what to set.

``cloudckpt.stores._azure_client`` sets up the SDK client and its credentials;
``cloudckpt.stores._azure_errors`` maps the SDK's failures into ``cloudckpt.errors``.
"""

from __future__ import annotations

import base64
import builtins
import datetime as dt
import email.utils
import hashlib
import logging
import re
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from azure.core.exceptions import AzureError, HttpResponseError
from azure.storage.blob import BlobBlock

from cloudckpt.errors import (
    ChecksumMismatchError,
    ConfigurationError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
)
from cloudckpt.stores._azure_client import (
    check_options,
    hide_sas_signatures_in_http_logs,
    make_client,
    parse_azure_netloc,
)
from cloudckpt.stores._azure_errors import error_code, raise_azure_error
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
    validate_key,
)

logger = logging.getLogger(__name__)

_UPLOADS = INTERNAL_PREFIX + "uploads/"
_MARKER = "target"
_KEY_META = "cloudckpt_key"  # base64url of the destination key (metadata is ASCII only)
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")


def _md5_b64(data: bytes | memoryview) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode("ascii")


def _block_id(upload_id: str, part_number: int) -> str:
    return base64.b64encode(f"{upload_id}-{part_number:05d}".encode()).decode("ascii")


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    if value is None:
        return None
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)


class AzureStore(Store):
    """A store on ``az://container/prefix``. See the module docstring.

    Raises:
        ConfigurationError: bad container name or storage option.
        CredentialsError: no credentials found (says what to set).
    """

    def __init__(
        self,
        container: str,
        prefix: str = "",
        *,
        scheme: str = "az",
        account_name: str | None = None,
        min_part_size: int = 5 * 1024 * 1024,
        **storage_options: Any,
    ) -> None:
        container, url_account = parse_azure_netloc(scheme, container)
        self._container_name = container
        self._root = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"{scheme}://{container}/{self._root}"
        self.capabilities = Capabilities(
            min_part_size=min_part_size, max_part_size=4000 * 1024 * 1024, max_parts=50_000
        )
        check_options(storage_options, self.url)
        hide_sas_signatures_in_http_logs()
        self._service = make_client(self.url, url_account, account_name, storage_options)
        self._container = self._service.get_container_client(container)
        self._closed = False

    # --- error mapping --------------------------------------------------------------

    def _raise(
        self, exc: AzureError, key: str | None, *, write: bool, update: bool = False
    ) -> NoReturn:
        """Map an Azure SDK failure into the ``cloudckpt.errors`` tree (``_azure_errors``).
        ``write`` marks calls whose effect is not idempotent (a lost answer is then
        OutcomeUnknownError); ``update``, a compare-and-swap (a missing object is then
        PreconditionFailedError)."""
        raise_azure_error(
            exc,
            url=self.url,
            container=self._container_name,
            endpoint=self._endpoint,
            key=key,
            write=write,
            update=update,
        )

    def _endpoint(self) -> str:
        return self._service.primary_endpoint.split("?", 1)[0]

    def _check_open(self, key: str | None) -> None:
        if self._closed:
            raise StoreError(f"{self.url}: the store is closed", key=key)

    def _blob(self, key: str) -> Any:
        self._check_open(key)
        return self._container.get_blob_client(self._root + validate_key(key))

    # --- single objects -------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        blob = self._blob(key)
        try:
            p = blob.get_blob_properties()
        except AzureError as exc:
            self._raise(exc, key, write=False)
        return ObjectInfo(key, p.size, p.etag, _utc(p.last_modified))

    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        blob = self._blob(key)
        try:
            downloader = blob.download_blob()
            data = downloader.readall()
        except AzureError as exc:
            self._raise(exc, key, write=False)
        p = downloader.properties
        return data, ObjectInfo(key, len(data), p.etag, _utc(p.last_modified))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ConfigurationError(f"invalid range start={start} length={length}")
        blob = self._blob(key)
        if length == 0:
            return b""
        try:
            return blob.download_blob(offset=start, length=length).readall()
        except HttpResponseError as exc:
            if exc.status_code == 416:  # start at or past the end
                return b""
            self._raise(exc, key, write=False)
        except AzureError as exc:
            self._raise(exc, key, write=False)

    def _conditions(self, key: str, mode: PutMode) -> dict[str, str]:
        if isinstance(mode, Create):
            return {"if_none_match": "*"}
        if isinstance(mode, Update):
            if not mode.version or mode.version == "*":
                # An empty If-Match is no condition at all, and "*" matches any blob.
                raise PreconditionFailedError(
                    f"{self.url}{key}: version {mode.version!r} is not an ETag", key=key
                )
            return {"if_match": mode.version}
        return {}

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        """One Put Blob with ``Content-MD5``; CREATE sends ``If-None-Match: *``, ``Update(v)``
        sends ``If-Match: v``. Raises PreconditionFailedError (also for Update of a missing
        blob), ChecksumMismatchError, OutcomeUnknownError, BucketNotFoundError, ..."""
        blob = self._blob(key)
        conditions = self._conditions(key, mode)
        payload = bytes(data)
        try:
            r = blob.upload_blob(
                payload,
                length=len(payload),
                overwrite=True,
                headers={"Content-MD5": _md5_b64(payload)},
                **conditions,
            )
        except AzureError as exc:
            self._raise(exc, key, write=True, update=isinstance(mode, Update))
        return ObjectInfo(key, len(payload), r["etag"], _utc(r.get("last_modified")))

    def delete(self, key: str) -> None:
        blob = self._blob(key)
        try:
            blob.delete_blob()
        except HttpResponseError as exc:
            if exc.status_code == 404 and error_code(exc) != "ContainerNotFound":
                return
            self._raise(exc, key, write=True)
        except AzureError as exc:
            self._raise(exc, key, write=True)

    def _list_raw(self, name_prefix: str, include: list[str] | None = None) -> Iterator[Any]:
        self._check_open(None)
        try:
            yield from self._container.list_blobs(name_starts_with=name_prefix, include=include)
        except AzureError as exc:
            self._raise(exc, None, write=False)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Blobs under ``prefix`` in key order, without ``.cloudckpt/``."""
        for b in self._list_raw(self._root + prefix):
            key = b.name[len(self._root) :]
            if not key.startswith(INTERNAL_PREFIX):
                yield ObjectInfo(key, b.size, b.etag, _utc(b.last_modified))

    def list_dirs(self, prefix: str = "") -> Sequence[str]:
        """``Store.list_dirs`` by a delimiter listing (``walk_blobs``' blob prefixes)."""
        from azure.storage.blob import BlobPrefix

        self._check_open(None)
        found = []
        try:
            for item in self._container.walk_blobs(name_starts_with=self._root + prefix):
                if isinstance(item, BlobPrefix):
                    rel = item.name[len(self._root) :]
                    if rel and not rel.startswith(INTERNAL_PREFIX):
                        found.append(rel[len(prefix) :])
        except AzureError as exc:
            self._raise(exc, None, write=False)
        return sorted(found)

    # --- multipart (staged blocks + Put Block List) ----------------------------------

    def _marker(self, upload_id: str) -> Any:
        if not _UPLOAD_ID.fullmatch(upload_id or ""):
            raise ConfigurationError(f"invalid Azure multipart upload id {upload_id!r}")
        self._check_open(None)
        return self._container.get_blob_client(f"{self._root}{_UPLOADS}{upload_id}/{_MARKER}")

    def create_multipart(self, key: str) -> MultipartUpload:
        """Writes the marker ``.cloudckpt/uploads/<id>/target`` naming ``key``."""
        validate_key(key)
        upload_id = uuid.uuid4().hex
        encoded = base64.urlsafe_b64encode(key.encode()).decode("ascii")
        try:
            self._marker(upload_id).upload_blob(b"", overwrite=False, metadata={_KEY_META: encoded})
        except AzureError as exc:
            self._raise(exc, key, write=True)
        return MultipartUpload(key, upload_id)

    def upload_part(
        self,
        upload: MultipartUpload,
        part_number: int,
        data: bytes | memoryview,
        *,
        crc32c: str | None = None,
    ) -> PartInfo:
        """Put Block with ``Content-MD5`` (the service verifies it). ``crc32c`` is checked
        against the bytes before they are sent: ChecksumMismatchError if they differ."""
        if not 1 <= part_number <= self.capabilities.max_parts:
            raise StoreError(f"part number {part_number} out of range", key=upload.key)
        self._marker(upload.upload_id)  # validates the id
        payload = bytes(data)
        crc = crc32c_b64(payload)
        if crc32c is not None and crc32c != crc:
            raise ChecksumMismatchError(
                f"part {part_number} of {self.url}{upload.key}: CRC32C mismatch (expected "
                f"{crc32c}, the bytes have {crc}); nothing was sent",
                key=upload.key,
            )
        block_id = _block_id(upload.upload_id, part_number)
        try:
            self._blob(upload.key).stage_block(
                block_id, payload, length=len(payload), headers={"Content-MD5": _md5_b64(payload)}
            )
        except AzureError as exc:
            self._raise(exc, upload.key, write=True)
        return PartInfo(part_number, block_id, crc, len(payload))

    def complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[PartInfo], *, mode: PutMode = CREATE
    ) -> ObjectInfo:
        """Put Block List of the parts' blocks; CREATE sends ``If-None-Match: *``. Raises
        PreconditionFailedError, ObjectNotFoundError (no such upload), StoreError (bad part
        list, or a block discarded by another commit of the blob), OutcomeUnknownError."""
        key = upload.key
        if isinstance(mode, Update):
            raise StoreError("compare-and-swap completion of multipart uploads is not offered")
        numbers = [p.part_number for p in parts]
        if not parts or numbers != sorted(set(numbers)):
            raise StoreError("parts must be non-empty, unique and in ascending order", key=key)
        for p in parts:
            if p.etag != _block_id(upload.upload_id, p.part_number):
                raise StoreError(f"part {p.part_number} is not of this upload", key=key)
        marker = self._marker(upload.upload_id)
        try:
            props = marker.get_blob_properties()
        except HttpResponseError as exc:
            if exc.status_code == 404 and error_code(exc) != "ContainerNotFound":
                raise ObjectNotFoundError(
                    f"multipart upload {upload.upload_id} of {self.url}{key} does not exist",
                    key=key,
                ) from None
            self._raise(exc, key, write=False)
        except AzureError as exc:
            self._raise(exc, key, write=False)
        recorded = (props.metadata or {}).get(_KEY_META, "")
        if recorded != base64.urlsafe_b64encode(key.encode()).decode("ascii"):
            raise ObjectNotFoundError(
                f"multipart upload {upload.upload_id} is not an upload of {self.url}{key}",
                key=key,
            )
        blocks = [BlobBlock(block_id=p.etag) for p in parts]
        try:
            r = self._blob(key).commit_block_list(blocks, **self._conditions(key, mode))
        except HttpResponseError as exc:
            if exc.status_code == 400 and error_code(exc) == "InvalidBlockList":
                raise StoreError(
                    f"{self.url}{key}: a part of upload {upload.upload_id} is not staged (not "
                    "uploaded, or discarded when another upload of the same blob committed)",
                    key=key,
                ) from None
            self._raise(exc, key, write=True)
        except AzureError as exc:
            self._raise(exc, key, write=True)
        self._delete_marker(marker, key)
        size = sum(p.size for p in parts)
        if any(p.size <= 0 for p in parts):
            size = self.head(key).size
        return ObjectInfo(key, size, r["etag"], _utc(r.get("last_modified")))

    def _delete_marker(self, marker: Any, key: str) -> None:
        try:
            marker.delete_blob()
        except HttpResponseError as exc:
            if exc.status_code != 404:
                logger.warning("could not delete the upload marker of %s%s: %s", self.url, key, exc)
        except AzureError as exc:  # the upload stays listed until GC aborts it
            logger.warning("could not delete the upload marker of %s%s: %s", self.url, key, exc)

    def abort_multipart(self, upload: MultipartUpload) -> None:
        """Delete the upload's marker. Its uncommitted blocks stay on the destination blob
        until Azure garbage-collects them (7 days) or the blob's next block list is
        committed: there is no call that drops only them. Unknown uploads are fine."""
        marker = self._marker(upload.upload_id)
        try:
            marker.delete_blob()
        except HttpResponseError as exc:
            if exc.status_code == 404 and error_code(exc) != "ContainerNotFound":
                return
            self._raise(exc, upload.key, write=True)
        except AzureError as exc:
            self._raise(exc, upload.key, write=True)

    def list_multipart(self, prefix: str = "") -> builtins.list[PendingUpload]:
        """Uploads whose marker names a key starting with ``prefix``, started when the
        marker was created (the store's clock)."""
        base = self._root + _UPLOADS
        pending = []
        for b in self._list_raw(base, include=["metadata"]):
            upload_id, _, leaf = b.name[len(base) :].partition("/")
            if leaf != _MARKER or not _UPLOAD_ID.fullmatch(upload_id):
                continue
            try:
                key = base64.urlsafe_b64decode((b.metadata or {}).get(_KEY_META, "")).decode()
            except (ValueError, UnicodeDecodeError):
                key = ""
            if key.startswith(prefix):
                started = _utc(getattr(b, "creation_time", None) or b.last_modified)
                pending.append(PendingUpload(key, upload_id, started))
        return sorted(pending, key=lambda p: (p.key, p.upload_id))

    def uncommitted_blocks(self, key: str) -> builtins.list[tuple[str, int]]:
        """(block id, size) of the uncommitted blocks staged on ``key``'s blob (for
        diagnostics: Azure discards them itself after 7 days)."""
        blob = self._blob(key)
        try:
            _, uncommitted = blob.get_block_list("uncommitted")
        except HttpResponseError as exc:
            if exc.status_code == 404 and error_code(exc) != "ContainerNotFound":
                return []
            self._raise(exc, key, write=False)
        except AzureError as exc:
            self._raise(exc, key, write=False)
        return [(b.id, b.size) for b in uncommitted]

    # --- clock and lifecycle --------------------------------------------------------

    def now(self) -> dt.datetime:
        """The ``Date`` header of a one-item listing."""
        self._check_open(None)
        seen: list[str] = []

        def hook(response: Any) -> None:
            date = response.http_response.headers.get("Date")
            if date:
                seen.append(date)

        try:
            pages = self._container.list_blobs(
                name_starts_with=f"{self._root}{INTERNAL_PREFIX}clock",
                results_per_page=1,
                raw_response_hook=hook,
            ).by_page()
            next(pages, None)
        except AzureError as exc:
            self._raise(exc, None, write=False)
        if not seen:
            raise StoreError(f"{self.url}: the store reports no time")
        return email.utils.parsedate_to_datetime(seen[-1]).astimezone(dt.timezone.utc)

    def close(self) -> None:
        """Close the HTTP session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._service.close()
        except Exception:  # closing is best effort
            logger.debug("closing the Azure client failed", exc_info=True)
