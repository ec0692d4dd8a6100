"""How an S3 store's botocore failures become ``cloudckpt.errors`` errors.

One ``S3Errors`` per store (it knows the store's URL, bucket, endpoint and the secrets to
keep out of messages): S3 error codes, HTTP statuses, TLS and transport failures each map to
the error that says what happened and what to do next. ``write`` marks requests whose effect
is not idempotent: a lost answer to one is ``OutcomeUnknownError``, never a retryable error.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import NoReturn

import botocore.exceptions as bce

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
    scrub,
)
from cloudckpt.stores._lost_answers import lost_answer

_PRECONDITION_CODES = {"PreconditionFailed", "412"}
_CONFLICT_CODES = {"ConditionalRequestConflict", "OperationAborted"}
_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchUpload", "NotFound", "404"}
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
    "RequestTimeTooSkewed",
}
_DENIED_CODES = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "403"}
_CHECKSUM_CODES = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"}
_NOT_APPLIED_CODES = {"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException"}


#: What to do about missing or rejected AWS credentials (the CLI flag first, then the
#: environment, then Python).
_CREDENTIALS_HINT = (
    "Name an AWS profile with --profile NAME or AWS_PROFILE=NAME (Python: "
    "storage_options={'profile': NAME}), or set AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for temporary keys); `aws sso login "
    "--profile NAME` renews an SSO profile, and an instance or pod role is used when none "
    "is set"
)
_REJECTED_HINT = (
    "`aws sts get-caller-identity` shows which credentials are in use: pick others with "
    "--profile NAME / AWS_PROFILE=NAME (Python: storage_options={'profile': NAME}), renew "
    "expired ones (`aws sso login`), or for an S3-compatible endpoint use that server's "
    "own keys"
)
# OpenSSL's reason when the server answered the TLS hello with something that is not TLS:
# plain HTTP.
PLAIN_HTTP_REPLY = re.compile(r"WRONG_VERSION_NUMBER|wrong version number|record layer failure")
UNTRUSTED_CERT = re.compile(r"CERTIFICATE_VERIFY_FAILED")


def client_error_info(exc: bce.ClientError) -> tuple[str, int, str, int]:
    """(S3 error code, HTTP status, message, botocore's retry count) of a ClientError."""
    response = exc.response or {}
    error = response.get("Error", {})
    meta = response.get("ResponseMetadata", {})
    code = str(error.get("Code", ""))
    status = int(meta.get("HTTPStatusCode") or (code if code.isdigit() else 0))
    return code, status, str(error.get("Message", "")), int(meta.get("RetryAttempts") or 0)


class S3Errors:
    """Translates one S3 store's botocore failures into ``cloudckpt.errors`` errors, with
    the store's URL in every message and its credentials scrubbed from them. Calling it
    (``with errors(op, key, write=...):``) maps every failure inside the block."""

    def __init__(self, url: str, bucket: str, endpoint: str, secrets: list[str]) -> None:
        self.url, self.bucket, self.endpoint = url, bucket, endpoint
        self._secrets = secrets

    def scrub(self, text: str) -> str:
        """``text`` without any credential this store can see."""
        return scrub(text, self._secrets)

    def where(self, key: str | None) -> str:
        """The URL of ``key`` (of the store's root without one), for messages."""
        return f"{self.url}{key or ''}"

    @contextlib.contextmanager
    def __call__(
        self,
        op: str,
        key: str | None = None,
        *,
        write: bool = False,
        missing: type[StoreError] = ObjectNotFoundError,
    ) -> Iterator[None]:
        """Turn every botocore failure inside the block into a ``cloudckpt.errors`` error.

        ``write`` marks calls whose effect is not idempotent (put, complete, delete): a
        timeout, reset or 5xx after sending then means OutcomeUnknownError, not a
        retryable TransientStoreError. ``missing`` is what a 404 on the key means.
        """
        try:
            yield
        except bce.ClientError as exc:
            self.raise_client_error(exc, op, key, write, missing)
        except bce.NoCredentialsError as exc:
            raise CredentialsError(
                f"no AWS credentials found for {self.where(key)} ({op})",
                key=key,
                hint=_CREDENTIALS_HINT,
            ) from exc
        except (bce.PartialCredentialsError, bce.CredentialRetrievalError) as exc:
            raise CredentialsError(
                f"incomplete or unusable AWS credentials for {self.where(key)} ({op}): "
                f"{self.scrub(str(exc))}",
                key=key,
                hint=_CREDENTIALS_HINT,
            ) from exc
        except (bce.ChecksumError, bce.FlexibleChecksumError) as exc:
            raise ChecksumMismatchError(
                f"{op} {self.where(key)}: response bytes do not match their checksum",
                key=key,
                hint="The bytes were damaged in transit; reading again fetches them anew",
            ) from exc
        except bce.SSLError as exc:
            self.raise_tls_error(exc, op, key)
        except bce.ConnectionError as exc:
            # Could not connect (refused, DNS, TLS, connect timeout): nothing was sent.
            raise TransientStoreError(
                f"could not reach the S3 endpoint {self.endpoint} ({op} {self.where(key)}): "
                f"{type(exc).__name__}",
                key=key,
                hint="Check endpoint_url / AWS_ENDPOINT_URL, the network and the region; "
                "the operation can be retried",
            ) from exc
        except (bce.HTTPClientError, bce.IncompleteReadError) as exc:
            # Read timeout, connection reset, truncated response (IncompleteReadError: the
            # body ended before its Content-Length, as a clean close mid-body does): the
            # request went out.
            what = f"{op} {self.where(key)}: no complete answer from {self.endpoint} "
            what += f"({type(exc).__name__})"
            raise lost_answer(what, key, write=write) from exc
        except bce.BotoCoreError as exc:
            raise StoreError(f"{op} {self.where(key)}: {self.scrub(str(exc))}", key=key) from exc

    def raise_tls_error(self, exc: bce.SSLError, op: str, key: str | None) -> NoReturn:
        """An ``https://`` endpoint whose TLS handshake failed (nothing was sent).

        Raises: ConfigurationError when the server spoke plain HTTP or its certificate is
        not trusted (the same every time); TransientStoreError otherwise.
        """
        where = f"{op} {self.where(key)}"
        text = str(exc)
        if PLAIN_HTTP_REPLY.search(text):
            plain = "http://" + self.endpoint.split("://", 1)[-1]
            raise ConfigurationError(
                f"the S3 endpoint {self.endpoint} answered in plain HTTP, not TLS ({where})",
                hint=f"The server does not speak https: use --endpoint-url {plain} (or "
                "AWS_ENDPOINT_URL / storage_options['endpoint_url'])",
            ) from exc
        if UNTRUSTED_CERT.search(text):
            raise ConfigurationError(
                f"the TLS certificate of the S3 endpoint {self.endpoint} is not trusted ({where})",
                hint="For a private CA or a self-signed certificate set AWS_CA_BUNDLE="
                '/path/to/ca.pem (or -o \'client_kwargs:={"verify": "/path/to/ca.pem"}\')',
            ) from exc
        raise TransientStoreError(
            f"TLS handshake with the S3 endpoint {self.endpoint} failed ({where}): "
            f"{self.scrub(text)[:200]}",
            key=key,
            hint="Check that the endpoint speaks https and that its certificate is trusted "
            "(AWS_CA_BUNDLE); a handshake cut short by the network can be retried",
        ) from exc

    def raise_client_error(
        self,
        exc: bce.ClientError,
        op: str,
        key: str | None,
        write: bool,
        missing: type[StoreError],
    ) -> NoReturn:
        code, status, message, retries = client_error_info(exc)
        where = self.where(key)
        detail = self.scrub(f"{code or status}: {message}" if message else code or str(status))
        retried = f" after {retries} retries" if retries else ""
        if code == "NoSuchBucket":
            raise BucketNotFoundError(
                f"bucket {self.bucket!r} does not exist ({op} {where})", key=key
            ) from exc
        if write and retries and (code in _PRECONDITION_CODES or code in _NOT_FOUND_CODES):
            # An earlier attempt may have been applied and the retry tripped over it.
            raise OutcomeUnknownError(
                f"{op} {where} failed with {detail}{retried}: an earlier attempt may have "
                "been applied",
                key=key,
            ) from exc
        if code in _PRECONDITION_CODES or status == 412:
            raise PreconditionFailedError(
                f"{op} {where}: precondition failed ({detail})", key=key
            ) from exc
        if code in _CONFLICT_CODES:
            raise StoreConflictError(
                f"{op} {where}: concurrent conditional write ({detail})", key=key
            ) from exc
        if code in _NOT_FOUND_CODES:
            raise missing(f"{op} {where}: not found ({detail})", key=key) from exc
        if code in _CREDENTIAL_CODES:
            raise CredentialsError(
                f"{op} {where}: the store rejected the credentials ({detail})",
                key=key,
                hint=_REJECTED_HINT
                if code != "RequestTimeTooSkewed"
                else "This host's clock is off by more than 15 minutes: sync it (NTP)",
            ) from exc
        if code in _DENIED_CODES or status == 403:
            raise PermissionDeniedError(f"{op} {where}: access denied ({detail})", key=key) from exc
        if code in _CHECKSUM_CODES:
            raise ChecksumMismatchError(
                f"{op} {where}: the store rejected the bytes ({detail})", key=key
            ) from exc
        if code in _NOT_APPLIED_CODES:  # refused before it was applied: safe to retry
            raise TransientStoreError(f"{op} {where}: {detail}{retried}", key=key) from exc
        if status >= 500:
            raise lost_answer(f"{op} {where}: {detail}{retried}", key, write=write) from exc
        raise StoreError(f"{op} {where}: {detail}", key=key) from exc
