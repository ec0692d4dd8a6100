"""How a GCS store's failures become ``cloudckpt.errors`` errors: transport and credential
failures of a request on gcsfs's event loop (``run``), and error answers by HTTP status
(``response_error``).

``write`` marks requests whose effect is not idempotent: a lost answer to one (no answer,
a timeout, a 5xx) is ``OutcomeUnknownError``; to a read, ``TransientStoreError``. Messages
never contain credentials.
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any, Protocol

# gcsfs >= 2026 otherwise swaps in a filesystem that probes every bucket over gRPC with a
# 60 s timeout, which hangs against emulators. Must be set before gcsfs is imported (here and
# in every module of this package that imports gcsfs).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import aiohttp
import fsspec.asyn
import google.auth.exceptions
from gcsfs.retry import HttpError, NonRetryableError

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

#: What to do about missing or rejected Google credentials.
CREDENTIALS_HINT = (
    "Run `gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS="
    "/path/to/key.json, or run where a service account is attached (the metadata server); "
    "for an emulator add -o token=anon (Python: storage_options={'token': 'anon'})"
)


def run(
    loop: Any, coro_fn: Any, *args: Any, url: str, endpoint: str, write: bool, key: str | None
) -> Any:
    """Run ``coro_fn(*args)`` on gcsfs's ``loop``; map transport failures to store errors.

    Raises TransientStoreError (no connection, a read without an answer, the credentials
    service out of reach), OutcomeUnknownError (a write without an answer),
    CredentialsError (credentials gcsfs could not refresh); store errors raised by
    ``coro_fn`` pass through.
    """
    where = f"{url}{key or ''} (endpoint {endpoint})"
    try:
        return fsspec.asyn.sync(loop, coro_fn, *args)
    except aiohttp.ClientConnectorError as exc:
        # The connection was never made, so nothing was sent: safe for writes too.
        raise TransientStoreError(
            f"cannot connect to the GCS endpoint {endpoint} for {url}{key or ''}: "
            f"{exc.os_error.strerror or type(exc.os_error).__name__}",
            key=key,
        ) from None
    except (HttpError, NonRetryableError) as exc:  # gcsfs failed to refresh credentials
        raise CredentialsError(
            f"{where}: {type(exc).__name__}", key=key, hint=CREDENTIALS_HINT
        ) from None
    except google.auth.exceptions.TransportError:
        raise TransientStoreError(
            f"{where}: could not reach the credentials service", key=key
        ) from None
    except google.auth.exceptions.GoogleAuthError as exc:
        raise CredentialsError(
            f"{where}: {type(exc).__name__}", key=key, hint=CREDENTIALS_HINT
        ) from None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        what = type(exc).__name__
        raise lost_answer(
            f"{where}: request failed ({what})",
            key,
            write=write,
            on_write=f"{where}: no answer to a write ({what})",
        ) from None


class Answer(Protocol):
    """What the mapping reads of an error answer (``_gcs_client.Response``, which imports
    this module: named by its shape, the two modules do not import each other)."""

    status: int

    def message(self) -> str: ...


def response_error(
    r: Answer, url: str, bucket: str, key: str | None, *, write: bool, bucket_missing: bool
) -> StoreError:
    """The cloudckpt error for a failed answer ``r`` about ``key`` of the store at ``url``
    (``bucket_missing``: a 404 meant the bucket, not the object)."""
    where = f"{url}{key or ''}"
    msg = r.message()
    status = r.status
    if status == 404:
        if bucket_missing:
            return BucketNotFoundError(f"GCS bucket {bucket!r} does not exist", key=key)
        return ObjectNotFoundError(f"{where} does not exist", key=key)
    if status == 412:
        return PreconditionFailedError(f"{where}: precondition failed ({msg})", key=key)
    if status == 400 and re.search(r"(?i)crc32c|md5", msg):
        return ChecksumMismatchError(f"{where}: the store rejected the bytes: {msg}", key=key)
    if status == 401:
        return CredentialsError(
            f"{where}: the store rejected the credentials ({msg})",
            key=key,
            hint=CREDENTIALS_HINT,
        )
    if status == 403:
        return PermissionDeniedError(f"{where}: permission denied ({msg})", key=key)
    if status == 409:
        return StoreConflictError(f"{where}: conflicting concurrent request ({msg})", key=key)
    if status == 429:
        # Rate limiting rejects the request before it is applied: safe to retry.
        return TransientStoreError(f"{where}: rate limited (HTTP 429)", key=key)
    if status == 408 or status >= 500:
        return lost_answer(
            f"{where}: HTTP {status} ({msg})",
            key,
            write=write,
            on_write=f"{where}: HTTP {status} on a write ({msg})",
        )
    return StoreError(f"{where}: HTTP {status} ({msg})", key=key)
