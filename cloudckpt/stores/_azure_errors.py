"""How an Azure store's SDK failures become ``cloudckpt.errors`` errors: HTTP error answers
by status and Azure error code, credentials that could not get a token, transport failures,
and answers cut short mid-body.

``write`` marks requests whose effect is not idempotent: a lost answer to one is
``OutcomeUnknownError`` (unless the connection was never made); to a read,
``TransientStoreError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    DecodeError,
    HttpResponseError,
    IncompleteReadError,
    ServiceRequestError,
    ServiceResponseError,
)

from cloudckpt.errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    CredentialsError,
    ObjectNotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreConflictError,
    StoreError,
    TransientStoreError,
)
from cloudckpt.stores._lost_answers import lost_answer

_AUTH_CODES = frozenset(
    {"AuthenticationFailed", "InvalidAuthenticationInfo", "NoAuthenticationInformation"}
)
_CHECKSUM_CODES = frozenset({"Md5Mismatch", "Crc64Mismatch", "InvalidMd5"})

#: What to set when no Azure credentials were found or they were rejected.
WHAT_TO_SET = (
    "Set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
    "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, or pass storage_options "
    "(connection_string, or account_name with account_key / sas_token / credential); or "
    "pip install azure-identity to use DefaultAzureCredential (managed identity, az login, "
    "AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET)"
)


def error_code(exc: BaseException) -> str:
    """Azure's error code (``BlobNotFound``, ...) as a plain string ("" if none)."""
    code = getattr(exc, "error_code", None)
    return str(getattr(code, "value", code) or "")


def _never_connected(exc: BaseException) -> bool:
    """Whether a transport error happened before any byte of the request was sent."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = type(current).__name__
        if name in ("NewConnectionError", "ConnectTimeoutError", "NameResolutionError"):
            return True
        text = str(current)
        if "Failed to establish a new connection" in text or "ConnectTimeoutError(" in text:
            return True
        current = (
            getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
        )
    return False


def _cut_short(exc: AzureError) -> bool:
    """Whether ``exc`` is an answer whose body ended early (the connection closed, cleanly
    or not, mid-body): ``IncompleteReadError``, or what the blob downloader raises once its
    own three tries met such answers (an ``HttpResponseError`` with no status, raised from one)."""
    if isinstance(exc, IncompleteReadError):
        return True
    inner = exc.__cause__  # the downloader raises ``from`` what its last try met
    # A body read that broke (a reset mid-body) is an HttpResponseError without a status.
    broken = isinstance(inner, HttpResponseError) and inner.status_code is None
    return (
        isinstance(exc, HttpResponseError)
        and exc.status_code is None
        and (broken or isinstance(inner, (DecodeError, ServiceResponseError)))
    )


def raise_azure_error(
    exc: AzureError,
    *,
    url: str,
    container: str,
    endpoint: Callable[[], str],
    key: str | None,
    write: bool,
    update: bool = False,
) -> NoReturn:
    """Map an Azure SDK failure about ``key`` of the store at ``url`` (container
    ``container``; ``endpoint()``: its blob endpoint, for messages) into the
    ``cloudckpt.errors`` tree. ``write`` marks calls whose effect is not idempotent (a lost
    answer is then OutcomeUnknownError); ``update``, a compare-and-swap (a missing object is
    then PreconditionFailedError)."""
    where = f"{url}{key or ''}"
    if not write and _cut_short(exc):  # a cut answer is not a short object: read again
        raise TransientStoreError(
            f"{where}: the answer broke off ({type(exc).__name__})", key=key
        ) from None
    if isinstance(exc, HttpResponseError) and exc.status_code is not None:
        _raise_http(exc.status_code, error_code(exc), container, where, key, write, update)
    if isinstance(exc, ClientAuthenticationError):  # a credential could not get a token
        raise CredentialsError(
            f"{where}: cannot get Azure credentials ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''})",
            key=key,
            hint=WHAT_TO_SET,
        ) from None
    if isinstance(exc, ServiceRequestError):
        # A connection never made sent nothing: safe to retry, writes too.
        raise lost_answer(
            f"{where}: cannot reach {endpoint()} ({type(exc).__name__})",
            key,
            write=write and not _never_connected(exc),
            on_write=f"{where}: the connection failed during a write",
        ) from None
    if isinstance(exc, ServiceResponseError):
        raise lost_answer(
            f"{where}: no answer ({type(exc).__name__})",
            key,
            write=write,
            on_write=f"{where}: no answer to a write",
        ) from None
    raise StoreError(f"{where}: {type(exc).__name__}", key=key) from None


def _raise_http(
    status: int,
    code: str,
    container: str,
    where: str,
    key: str | None,
    write: bool,
    update: bool,
) -> NoReturn:
    """``raise_azure_error`` for an HTTP error answer: its status and Azure error code."""
    text = f"{status} {code}".strip()
    if status == 404:
        if code == "ContainerNotFound":
            raise BucketNotFoundError(
                f"Azure container {container!r} does not exist",
                key=key,
                hint="Check the container name in the URL, or create the container",
            ) from None
        if update:
            raise PreconditionFailedError(f"{where} does not exist", key=key) from None
        raise ObjectNotFoundError(f"{where} does not exist", key=key) from None
    if status == 412:
        raise PreconditionFailedError(f"{where}: precondition failed ({text})", key=key) from None
    if status == 409:
        if code == "BlobAlreadyExists":
            raise PreconditionFailedError(f"{where} already exists ({text})", key=key) from None
        raise StoreConflictError(f"{where}: conflict ({text})", key=key) from None
    if status == 400 and code in _CHECKSUM_CODES:
        raise ChecksumMismatchError(
            f"{where}: the store rejected the bytes ({text})", key=key
        ) from None
    if status == 401 or (status == 403 and code in _AUTH_CODES):
        raise CredentialsError(
            f"{where}: the store rejected the credentials ({text})",
            key=key,
            hint=WHAT_TO_SET,
        ) from None
    if status == 403:
        raise PermissionDeniedError(
            f"{where}: permission denied ({text})",
            key=key,
            hint="Grant the identity Storage Blob Data Contributor (writers) or "
            "Reader (restore) on the container (terraform/azure), or check the SAS "
            "token's permissions and the account's network rules",
        ) from None
    if status == 429:
        raise TransientStoreError(f"{where}: throttled ({text})", key=key) from None
    if status == 408 or status >= 500:
        raise lost_answer(
            f"{where}: {text}", key, write=write, on_write=f"{where}: {text} on a write"
        ) from None
    raise StoreError(f"{where}: {text}", key=key) from None
