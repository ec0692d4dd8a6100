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
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as dt
import email.utils
import http.client
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn
from urllib.parse import urlsplit

import botocore
import botocore.auth
import botocore.config
import botocore.exceptions as bce
import botocore.handlers
import botocore.response
import botocore.session

from cloudckpt import digest
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
    scrub,
)
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

log = logging.getLogger(__name__)

#: Storage options S3Store understands (s3fs names).
ACCEPTED_OPTIONS = frozenset(
    {
        "key",
        "secret",
        "token",
        "username",  # s3fs alias of key
        "password",  # s3fs alias of secret
        "endpoint_url",
        "region_name",
        "profile",
        "anon",
        "use_ssl",
        "client_kwargs",
        "config_kwargs",
        "s3_additional_kwargs",
        "requester_pays",
    }
)
#: s3fs tuning options that mean nothing here; accepted so one options dict serves both.
IGNORED_OPTIONS = frozenset(
    {
        "use_listings_cache",
        "listings_expiry_time",
        "skip_instance_cache",
        "default_block_size",
        "default_cache_type",
        "default_fill_cache",
        "cache_regions",
        "max_concurrency",
    }
)
_CLIENT_KWARGS = frozenset(
    {
        "region_name",
        "endpoint_url",
        "use_ssl",
        "verify",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "aws_account_id",
        "api_version",
        "config",
    }
)

# Enough pooled connections for ~32 concurrent transfers plus metadata calls; standard
# retries (with backoff, 5xx/throttling/timeouts); timeouts that notice a dead peer.
_DEFAULT_CONFIG: dict[str, Any] = {
    "max_pool_connections": 64,
    "retries": {"mode": "standard", "max_attempts": 5},
    "connect_timeout": 10,
    "read_timeout": 60,
    "tcp_keepalive": True,
}

_CREDENTIAL_NAMES = ("access_key_id", "secret_access_key", "session_token")

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
_PLAIN_HTTP_REPLY = re.compile(r"WRONG_VERSION_NUMBER|wrong version number|record layer failure")
_UNTRUSTED_CERT = re.compile(r"CERTIFICATE_VERIFY_FAILED")

_LOADER: Any = None
_LOADER_LOCK = threading.Lock()


def _session(profile: str | None) -> botocore.session.Session:
    """A fresh botocore session (it reads the AWS environment and files now) that shares
    one model loader with every other store: loading S3's models costs ~0.25 s a client.
    (A botocore client is what boto3.client() returns, minus resource helpers.)"""
    global _LOADER
    session = botocore.session.Session(profile=profile)
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _LOADER)
    session.get_scoped_config()  # raises ProfileNotFound here, not on the first request
    return session


def _endpoint_error(endpoint: str, source: str) -> ConfigurationError:
    """The error for an endpoint that is not an ``http://`` or ``https://`` URL, with the
    two URLs it may have meant."""
    shown = redact_url(endpoint)
    host = shown.split("://", 1)[1] if "://" in shown else shown.lstrip("/:")
    host = host.rstrip("/") or "HOST:PORT"
    return ConfigurationError(
        f"the S3 endpoint {shown!r} (from {source}) is not an http:// or https:// URL",
        hint=f"Write it with its scheme: http://{host} for a server without TLS (moto, "
        f"MinIO, SeaweedFS and LocalStack serve plain HTTP by default) or https://{host}",
    )


def _endpoint_source(kwargs: Mapping[str, Any]) -> str:
    if kwargs.get("endpoint_url"):
        return "--endpoint-url / storage_options['endpoint_url']"
    return "AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL or the profile's endpoint_url"


def _check_endpoint(endpoint: str, source: str) -> None:
    """Raises ConfigurationError (with the URLs it may have meant) unless ``endpoint`` is
    an ``http://`` or ``https://`` URL with a host."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _endpoint_error(endpoint, source)


def _no_retry_on_tls_mismatch(caught_exception: BaseException | None = None, **_: Any) -> None:
    """A ``needs-retry`` handler: a TLS handshake that failed because the server spoke
    plain HTTP, or because its certificate is not trusted, fails the same way every time,
    so re-raise it at once rather than let botocore retry it with backoff (90 s in all,
    with our own retries, before the user saw why)."""
    if isinstance(caught_exception, bce.SSLError) and (
        _PLAIN_HTTP_REPLY.search(str(caught_exception))
        or _UNTRUSTED_CERT.search(str(caught_exception))
    ):
        raise caught_exception


def _client_error_info(exc: bce.ClientError) -> tuple[str, int, str, int]:
    response = exc.response or {}
    error = response.get("Error", {})
    meta = response.get("ResponseMetadata", {})
    code = str(error.get("Code", ""))
    status = int(meta.get("HTTPStatusCode") or (code if code.isdigit() else 0))
    return code, status, str(error.get("Message", "")), int(meta.get("RetryAttempts") or 0)


class _PrehashedS3SigV4Auth(botocore.auth.S3SigV4Auth):
    """S3 SigV4 that, when botocore would SHA-256 the payload (plain HTTP, or payload
    signing switched on), takes the digest the transfer engine registered for exactly this
    body object (``digest.known_sha256``: a one-chunk part's leaf, computed from these very
    bytes), which saves hashing every uploaded byte twice. Any other body is hashed by
    botocore as usual."""

    def payload(self, request: Any) -> str:
        known = digest.sha256_if_known(request.body)
        if (
            known is not None
            and not self._is_streaming_checksum_payload(request)
            and self._should_sha256_sign_payload(request)
        ):
            return known.hex()
        return super().payload(request)


def _send_bytes_whole(client: Any) -> None:
    """Send PutObject/UploadPart ``bytes`` bodies as they are, in one ``sendall``.

    botocore wraps a bytes body in a ``BytesIO`` (``convert_body_to_file_like_object``);
    urllib3 then sends it 16 KiB at a time (a new bytes object each), adds an
    ``Expect: 100-continue`` round trip, and a payload-signing client reads it again in
    1 MiB copies to hash it. Every body this store sends is immutable ``bytes``, which a
    retry simply sends again, so the wrapper buys nothing here. Only this client changes."""
    handler = getattr(botocore.handlers, "convert_body_to_file_like_object", None)
    if handler is None:
        return
    for op in ("PutObject", "UploadPart"):
        client.meta.events.unregister(f"before-parameter-build.s3.{op}", handler)


class _ViewBody(bytearray):
    """An empty stand-in for a body that lives in memory the caller owns (a ``memoryview``
    of a reused part buffer or of ``save_state``'s host memory). botocore's parameter
    validation takes only bytes, bytearray or file-like bodies, and a copy into ``bytes``
    costs a fresh allocation per part (page faults: more CPU than hashing it). This object
    passes the validation and is replaced by the view itself when the request is created
    (``_send_views_whole``), before signing and before Content-Length is computed. Should a
    botocore version read the body in between, it would see zero bytes, which the CRC32C we
    send with every body does not match: the store refuses the request, nothing is stored."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view = view


def _body(data: bytes | bytearray | memoryview) -> bytes | bytearray:
    """What to hand botocore for ``data``, without copying it."""
    if isinstance(data, (bytes, bytearray)):
        return data
    view = memoryview(data)
    if not view.c_contiguous:
        return bytes(view)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return _ViewBody(view)


def _no_rewind() -> None:
    """A view body is sent again whole on a retry: nothing to rewind."""


def _send_views_whole(client: Any) -> None:
    """Put each ``_ViewBody``'s view in its place once the request exists (first, before
    this client's signer sees it); http.client then sends it with one ``sendall``. Before
    a retry botocore rewinds the body of the request it sent (``reset_stream``, which
    refuses anything but bytes, str, bytearray or a seekable stream) and then builds the
    request anew from the parameters, so the swap happens again: for a view there is
    nothing to rewind."""

    def swap(request: Any, **kwargs: Any) -> None:
        if isinstance(request.data, _ViewBody):
            request.data = request.data.view

    def sent_whole(request: Any, **kwargs: Any) -> None:
        if isinstance(request.body, memoryview):
            request.reset_stream = _no_rewind
        # (None: a before-send handler that returned something would replace the response)

    for op in ("PutObject", "UploadPart"):
        client.meta.events.register_first(f"request-created.s3.{op}", swap)
        client.meta.events.register(f"before-send.s3.{op}", sent_whole)


def _use_prehashed_payloads(client: Any) -> None:
    """Make this client's plain S3 SigV4 signer a ``_PrehashedS3SigV4Auth`` (only this
    client; other signature versions are left alone; no-op if botocore's internals differ)."""
    signer = getattr(client, "_request_signer", None)
    found = getattr(signer, "get_auth_instance", None)
    if signer is None or found is None:
        return
    get_auth: Callable[..., Any] = found  # (bound once: the closure below sees it non-None)

    def get_auth_instance(*args: Any, **kwargs: Any) -> Any:
        auth = get_auth(*args, **kwargs)
        if type(auth) is botocore.auth.S3SigV4Auth:
            auth.__class__ = _PrehashedS3SigV4Auth
        elif (
            type(auth).__name__ == "CrtS3SigV4Auth" and type(auth).__module__ == "botocore.crt.auth"
        ):
            # With awscrt installed (boto3[crt], s3transfer's CRT) botocore signs with the
            # CRT's SigV4 instead, which hashes every signed payload again, in C, whatever
            # digest we hold (measured: +1.2 CPU-s per GiB uploaded with payload signing).
            # Same signature version, same credentials and scope, computed by botocore's
            # own signer with the known digest.
            auth = _PrehashedS3SigV4Auth(auth.credentials, auth._service_name, auth._region_name)
        return auth

    signer.get_auth_instance = get_auth_instance


def _read_body_into(resp: Mapping[str, Any], buf: memoryview) -> int:
    """Read a GetObject response body into ``buf``; return the body's length.

    When the body is botocore's plain ``StreamingBody`` over an ``http.client`` response of
    known length that fits, the bytes are read straight from the socket into ``buf`` and
    the connection goes back to the pool; otherwise (other botocore versions, checksum-
    validating bodies) through ``read()`` and one copy. A body longer than ``buf`` reports
    its full length (the caller treats that as damage) and only ``len(buf)`` bytes are kept.
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
        data = body.read()
        n = min(len(data), len(buf))
        buf[:n] = memoryview(data)[:n]
        return len(data)
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
        self._secrets: list[str] = []
        self._extra = self._parse_options(dict(storage_options))
        self._client = self._make_client(storage_options)
        self._endpoint = redact_url(self._client.meta.endpoint_url or "")
        self._op_members: dict[str, frozenset[str]] = {}

    # --- construction ---------------------------------------------------------------

    def _parse_options(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = set(options) - ACCEPTED_OPTIONS - IGNORED_OPTIONS
        if unknown:
            raise ConfigurationError(
                f"unknown S3 storage option(s) {', '.join(sorted(map(repr, unknown)))} "
                f"for {self.url}",
                hint=f"Accepted options: {', '.join(sorted(ACCEPTED_OPTIONS))}",
            )
        bad_client = set(options.get("client_kwargs") or {}) - _CLIENT_KWARGS
        if bad_client:
            raise ConfigurationError(
                f"unknown client_kwargs {', '.join(sorted(map(repr, bad_client)))}",
                hint=f"client_kwargs accepts: {', '.join(sorted(_CLIENT_KWARGS))}",
            )
        extra = dict(options.get("s3_additional_kwargs") or {})
        if options.get("requester_pays"):
            extra["RequestPayer"] = "requester"
        return extra

    def _make_client(self, options: Mapping[str, Any]) -> Any:
        client_kwargs = dict(options.get("client_kwargs") or {})
        key = options.get("key", options.get("username"))
        secret = options.get("secret", options.get("password"))
        token = options.get("token")
        if (key is None) != (secret is None):
            raise ConfigurationError(
                "S3 storage options 'key' and 'secret' must be given together",
                hint="Pass both, or neither to use the AWS environment, profile or role",
            )
        # Remember every credential we can see, to scrub it from any message.
        candidates = [key, secret, token]
        candidates += [client_kwargs.get(f"aws_{n}") for n in _CREDENTIAL_NAMES]
        candidates += [os.environ.get(f"AWS_{n.upper()}") for n in _CREDENTIAL_NAMES]
        self._secrets = [c for c in candidates if isinstance(c, str) and len(c) >= 4]
        config = self._client_config(options, client_kwargs)
        try:
            session = _session(options.get("profile"))
        except bce.ProfileNotFound as exc:
            raise CredentialsError(
                f"AWS profile {options.get('profile')!r} (for {self.url}) is not defined",
                hint="Check the profile name and AWS_CONFIG_FILE / ~/.aws/config",
            ) from exc
        region = (
            client_kwargs.pop("region_name", None)
            or options.get("region_name")
            or session.get_config_variable("region")
            or os.environ.get("AWS_REGION")
            or "us-east-1"
        )
        kwargs: dict[str, Any] = {"region_name": region, "config": config}
        if options.get("endpoint_url"):
            kwargs["endpoint_url"] = options["endpoint_url"]
        if "use_ssl" in options:
            kwargs["use_ssl"] = bool(options["use_ssl"])
        if key is not None and not options.get("anon"):
            kwargs.update(aws_access_key_id=key, aws_secret_access_key=secret)
            if token:
                kwargs["aws_session_token"] = token
        kwargs.update(client_kwargs)  # explicit client_kwargs win, as in s3fs
        try:
            client = session.create_client("s3", **kwargs)
        except ValueError as exc:
            invalid = re.fullmatch(r"Invalid endpoint: (.*)", str(exc), re.S)
            if invalid:  # botocore's words for an endpoint without a scheme
                raise _endpoint_error(invalid.group(1), _endpoint_source(kwargs)) from None
            raise ConfigurationError(
                f"cannot create an S3 client for {self.url}: {self._scrub(str(exc))}"
            ) from None
        except bce.BotoCoreError as exc:
            raise ConfigurationError(
                f"cannot create an S3 client for {self.url}: {self._scrub(str(exc))}"
            ) from None
        _check_endpoint(client.meta.endpoint_url, _endpoint_source(kwargs))
        client.meta.events.register_first("needs-retry.s3", _no_retry_on_tls_mismatch)
        _send_bytes_whole(client)
        _send_views_whole(client)
        _use_prehashed_payloads(client)
        return client

    def _client_config(self, options: Mapping[str, Any], client_kwargs: dict[str, Any]) -> Any:
        """botocore's Config: our defaults, then ``config_kwargs``, unsigned for ``anon``,
        then a Config given in ``client_kwargs`` (taken out of them). Raises
        ConfigurationError for arguments botocore does not know."""
        try:
            config = botocore.config.Config(
                **{**_DEFAULT_CONFIG, **dict(options.get("config_kwargs") or {})}
            )
        except TypeError as exc:
            raise ConfigurationError(
                f"invalid config_kwargs for {self.url}: {exc}",
                hint="config_kwargs are botocore.config.Config arguments",
            ) from None
        if options.get("anon"):
            config = config.merge(botocore.config.Config(signature_version=botocore.UNSIGNED))
        if isinstance(client_kwargs.get("config"), botocore.config.Config):
            config = config.merge(client_kwargs.pop("config"))
        return config

    # --- error mapping --------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        return scrub(text, self._secrets)

    def _where(self, key: str | None) -> str:
        return f"{self.url}{key or ''}"

    @contextlib.contextmanager
    def _errors(
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
            self._raise_client_error(exc, op, key, write, missing)
        except bce.NoCredentialsError as exc:
            raise CredentialsError(
                f"no AWS credentials found for {self._where(key)} ({op})",
                key=key,
                hint=_CREDENTIALS_HINT,
            ) from exc
        except (bce.PartialCredentialsError, bce.CredentialRetrievalError) as exc:
            raise CredentialsError(
                f"incomplete or unusable AWS credentials for {self._where(key)} ({op}): "
                f"{self._scrub(str(exc))}",
                key=key,
                hint=_CREDENTIALS_HINT,
            ) from exc
        except (bce.ChecksumError, bce.FlexibleChecksumError) as exc:
            raise ChecksumMismatchError(
                f"{op} {self._where(key)}: response bytes do not match their checksum",
                key=key,
                hint="The bytes were damaged in transit; reading again fetches them anew",
            ) from exc
        except bce.SSLError as exc:
            self._raise_tls_error(exc, op, key)
        except bce.ConnectionError as exc:
            # Could not connect (refused, DNS, TLS, connect timeout): nothing was sent.
            raise TransientStoreError(
                f"could not reach the S3 endpoint {self._endpoint} ({op} {self._where(key)}): "
                f"{type(exc).__name__}",
                key=key,
                hint="Check endpoint_url / AWS_ENDPOINT_URL, the network and the region; "
                "the operation can be retried",
            ) from exc
        except bce.HTTPClientError as exc:
            # Read timeout, connection reset, truncated response: the request went out.
            what = f"{op} {self._where(key)}: no complete answer from {self._endpoint} "
            what += f"({type(exc).__name__})"
            if write:
                raise OutcomeUnknownError(what, key=key) from exc
            raise TransientStoreError(what, key=key) from exc
        except bce.BotoCoreError as exc:
            raise StoreError(f"{op} {self._where(key)}: {self._scrub(str(exc))}", key=key) from exc

    def _raise_tls_error(self, exc: bce.SSLError, op: str, key: str | None) -> NoReturn:
        """An ``https://`` endpoint whose TLS handshake failed (nothing was sent).

        Raises: ConfigurationError when the server spoke plain HTTP or its certificate is
        not trusted (the same every time); TransientStoreError otherwise.
        """
        where = f"{op} {self._where(key)}"
        text = str(exc)
        if _PLAIN_HTTP_REPLY.search(text):
            plain = "http://" + self._endpoint.split("://", 1)[-1]
            raise ConfigurationError(
                f"the S3 endpoint {self._endpoint} answered in plain HTTP, not TLS ({where})",
                hint=f"The server does not speak https: use --endpoint-url {plain} (or "
                "AWS_ENDPOINT_URL / storage_options['endpoint_url'])",
            ) from exc
        if _UNTRUSTED_CERT.search(text):
            raise ConfigurationError(
                f"the TLS certificate of the S3 endpoint {self._endpoint} is not trusted ({where})",
                hint="For a private CA or a self-signed certificate set AWS_CA_BUNDLE="
                '/path/to/ca.pem (or -o \'client_kwargs:={"verify": "/path/to/ca.pem"}\')',
            ) from exc
        raise TransientStoreError(
            f"TLS handshake with the S3 endpoint {self._endpoint} failed ({where}): "
            f"{self._scrub(text)[:200]}",
            key=key,
            hint="Check that the endpoint speaks https and that its certificate is trusted "
            "(AWS_CA_BUNDLE); a handshake cut short by the network can be retried",
        ) from exc

    def _raise_client_error(
        self,
        exc: bce.ClientError,
        op: str,
        key: str | None,
        write: bool,
        missing: type[StoreError],
    ) -> NoReturn:
        code, status, message, retries = _client_error_info(exc)
        where = self._where(key)
        detail = self._scrub(f"{code or status}: {message}" if message else code or str(status))
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
        if code in _NOT_APPLIED_CODES or (status >= 500 and not write):
            raise TransientStoreError(f"{op} {where}: {detail}{retried}", key=key) from exc
        if status >= 500:
            raise OutcomeUnknownError(f"{op} {where}: {detail}{retried}", key=key) from exc
        raise StoreError(f"{op} {where}: {detail}", key=key) from exc

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
                f"get_object {self._where(key)}: bytes do not match the stored CRC32C",
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
            if isinstance(cause, bce.ClientError) and _client_error_info(cause)[1] == 416:
                return b""
            raise

    def get_range_into(self, key: str, start: int, buf: memoryview) -> int:
        """Read ``len(buf)`` bytes from offset ``start`` into ``buf`` (from the socket
        straight into the buffer where botocore allows); return how many the store sent
        (fewer only at the end of the object). Raises like ``get_range``; a response cut
        short raises TransientStoreError."""
        length = len(buf)
        if length <= 0:
            self.head(key)
            return 0
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
                resp = self._client.get_object(**params)
                try:
                    return _read_body_into(resp, buf)
                except (OSError, http.client.HTTPException) as exc:
                    raise TransientStoreError(
                        f"get_object {self._where(key)}: the response broke off "
                        f"({type(exc).__name__})",
                        key=key,
                    ) from exc
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, bce.ClientError) and _client_error_info(cause)[1] == 416:
                return 0
            raise

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        """Raises PreconditionFailedError (lost create/compare-and-swap, or Update of a
        missing key), StoreConflictError (409), OutcomeUnknownError, BucketNotFoundError, ..."""
        body = _body(data)  # no copy: the caller keeps data unchanged until this returns
        params: dict[str, Any] = {
            "Key": self._full(key),
            "Body": body,
            # Our own CRC32C: botocore then computes none, and S3 verifies this one.
            "ChecksumAlgorithm": "CRC32C",
            "ChecksumCRC32C": crc32c_b64(data),
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
                self._raise_client_error(fake, "delete_objects", rel, True, ObjectNotFoundError)

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
        body = _body(data)  # no copy: the caller keeps data unchanged until this returns
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


# --- keep session tokens out of botocore's DEBUG logs ---------------------------------

_TOKEN_RE = re.compile(r"(?i)(x-amz-security-token['\"]?\s*[:=]\s*(?:b?['\"])?)[^'\"\s,}]+")
_ACCESS_KEY_RE = re.compile(r"(Credential=)[^/\s'\"]+")


class _RedactTokens(logging.Filter):
    """botocore logs request headers (and the canonical request) at DEBUG, session
    token and access key id included; blank them so DEBUG logs of a training job hold
    no credentials."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = message
        if "security-token" in message.lower():
            redacted = _TOKEN_RE.sub(r"\1***", redacted)
        if "Credential=" in redacted:  # the access key id in the Authorization header
            redacted = _ACCESS_KEY_RE.sub(r"\1***", redacted)
        if redacted is not message:
            record.msg, record.args = redacted, None
        return True


for _name in ("botocore.endpoint", "botocore.auth", "botocore.awsrequest"):
    logging.getLogger(_name).addFilter(_RedactTokens())
