"""The botocore client of an S3 store, set up: storage options, credentials, region and
endpoint, and the hooks that make its requests cheap.

Storage options follow s3fs (``ACCEPTED_OPTIONS``; s3fs's tuning options are accepted and
ignored). Anything not given comes from the usual AWS sources (``AWS_*`` environment
variables including ``AWS_ENDPOINT_URL[_S3]``, config and credentials files); the region falls
back to ``AWS_REGION`` and then ``us-east-1``. The hooks send ``bytes`` and ``memoryview``
bodies without copies, sign payloads with digests already known (``digest.known_sha256``),
and fail at once on a TLS handshake that can never succeed. Per request, botocore's CPU
is cut without changing what is sent or returned (``SAVINGS``: timestamps parsed without
dateutil, through the parser hook botocore offers; no checksum asked for on ranged reads
unless the user asks; ranged reads through ``_s3_fast_get``). A logging filter keeps
session tokens and access key ids out of botocore's DEBUG logs.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import botocore
import botocore.auth
import botocore.config
import botocore.exceptions as bce
import botocore.handlers
import botocore.session
import botocore.utils

from cloudckpt import digest
from cloudckpt.errors import ConfigurationError, CredentialsError, redact_url, scrub
from cloudckpt.stores._s3_errors import PLAIN_HTTP_REPLY, UNTRUSTED_CERT

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
    _parse_timestamps_cheaply(session)
    return session


# --- cheaper requests: the same headers and results, less Python per request -----------

#: The per-request savings of issue 31 item 5, each on unless a benchmark switches it off
#: (``benchmarks/request_cost.py`` builds a store with them off to measure them).
SAVINGS = {
    "timestamps": True,
    "checksum_mode": True,
    # Ranged reads of ``get_range_into`` through ``_s3_fast_get`` once botocore has shown
    # the request's shape (read when a store is made).
    "lean_get": True,
}

_MONTHS = {
    m: i
    for i, m in enumerate(
        ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1
    )
}
_HTTP_DATE = re.compile(
    r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), (\d\d) ([A-Z][a-z]{2}) (\d{4}) (\d\d):(\d\d):(\d\d) GMT"
)
_ISO_UTC = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?Z")
_UTC = botocore.utils.tzutc()  # (dateutil's, as botocore's parser gives)


def parse_timestamp(value: Any) -> dt.datetime:
    """botocore's ``parse_timestamp`` (what its parsers turn every response timestamp
    into), with the two forms S3 sends parsed without dateutil: the HTTP date of
    ``Last-Modified`` on every GET and HEAD (``Sun, 06 Dec 2026 18:23:42 GMT``) and the ISO
    8601 UTC of listings (``2026-12-06T18:23:42.000Z``). dateutil's general parser costs
    ~0.1 ms of CPU per timestamp; the result is the same instant, as an aware ``datetime``
    in ``tzutc()`` (dateutil gives an ISO ``Z`` ``tzlocal()`` where the local zone is UTC;
    the store converts every timestamp to ``datetime.timezone.utc`` anyway). Anything else,
    or a date that does not exist, goes to botocore's parser as before."""
    if isinstance(value, str):
        m = _HTTP_DATE.fullmatch(value)
        try:
            if m is not None and m.group(2) in _MONTHS:
                day, mon, year, hh, mm, ss = m.groups()
                return dt.datetime(
                    int(year), _MONTHS[mon], int(day), int(hh), int(mm), int(ss), tzinfo=_UTC
                )
            m = _ISO_UTC.fullmatch(value)
            if m is not None:
                year, mon, day, hh, mm, ss, frac = m.groups()
                micro = int(frac.ljust(6, "0")) if frac else 0
                return dt.datetime(
                    int(year), int(mon), int(day), int(hh), int(mm), int(ss), micro, tzinfo=_UTC
                )
        except ValueError:
            pass  # (a day or hour out of range: botocore's parser says what is wrong)
    result: dt.datetime = botocore.utils.parse_timestamp(value)
    return result


def _parse_timestamps_cheaply(session: botocore.session.Session) -> None:
    """Make ``parse_timestamp`` the timestamp parser of this session's response parsers
    (only this session's: each store has its own)."""
    if not SAVINGS["timestamps"]:
        return
    factory = session.get_component("response_parser_factory")
    setter = getattr(factory, "set_parser_defaults", None)
    if setter is not None:
        setter(timestamp_parser=parse_timestamp)


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
        PLAIN_HTTP_REPLY.search(str(caught_exception))
        or UNTRUSTED_CERT.search(str(caught_exception))
    ):
        raise caught_exception


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


def request_body(data: bytes | bytearray | memoryview) -> bytes | bytearray:
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


def parse_options(options: Mapping[str, Any], url: str) -> dict[str, Any]:
    """The ``s3_additional_kwargs`` (with ``RequestPayer`` for ``requester_pays``) of
    ``options``. Raises ConfigurationError for unknown options or ``client_kwargs``."""
    unknown = set(options) - ACCEPTED_OPTIONS - IGNORED_OPTIONS
    if unknown:
        raise ConfigurationError(
            f"unknown S3 storage option(s) {', '.join(sorted(map(repr, unknown)))} for {url}",
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


def make_client(options: Mapping[str, Any], url: str) -> tuple[Any, list[str]]:
    """The botocore S3 client for ``options`` (with every hook of this module installed),
    and the credentials it can see (to scrub from messages).

    Raises ConfigurationError (``key`` without ``secret``, bad ``config_kwargs``, an
    endpoint that is not an http(s) URL, botocore refusing the arguments) or
    CredentialsError (a profile that does not exist).
    """
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
    secrets = [c for c in candidates if isinstance(c, str) and len(c) >= 4]
    config = _client_config(options, client_kwargs, url)
    try:
        session = _session(options.get("profile"))
    except bce.ProfileNotFound as exc:
        raise CredentialsError(
            f"AWS profile {options.get('profile')!r} (for {url}) is not defined",
            hint="Check the profile name and AWS_CONFIG_FILE / ~/.aws/config",
        ) from exc
    config = _without_checksum_mode(session, config)
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
    return _create_client(session, kwargs, url, secrets), secrets


def _create_client(
    session: botocore.session.Session, kwargs: dict[str, Any], url: str, secrets: list[str]
) -> Any:
    """``session.create_client("s3", **kwargs)`` with its endpoint checked and this
    module's hooks installed. Raises ConfigurationError."""
    try:
        client = session.create_client("s3", **kwargs)
    except ValueError as exc:
        invalid = re.fullmatch(r"Invalid endpoint: (.*)", str(exc), re.S)
        if invalid:  # botocore's words for an endpoint without a scheme
            raise _endpoint_error(invalid.group(1), _endpoint_source(kwargs)) from None
        raise ConfigurationError(
            f"cannot create an S3 client for {url}: {scrub(str(exc), secrets)}"
        ) from None
    except bce.BotoCoreError as exc:
        raise ConfigurationError(
            f"cannot create an S3 client for {url}: {scrub(str(exc), secrets)}"
        ) from None
    _check_endpoint(client.meta.endpoint_url, _endpoint_source(kwargs))
    client.meta.events.register_first("needs-retry.s3", _no_retry_on_tls_mismatch)
    _send_bytes_whole(client)
    _send_views_whole(client)
    _use_prehashed_payloads(client)
    return client


def _without_checksum_mode(session: botocore.session.Session, config: Any) -> Any:
    """``config`` with ``response_checksum_validation="when_required"`` unless the user
    chose a value (``config_kwargs``, a Config in ``client_kwargs``,
    ``AWS_RESPONSE_CHECKSUM_VALIDATION``, the profile's ``response_checksum_validation``).

    botocore's default, ``when_supported``, adds ``x-amz-checksum-mode: ENABLED`` to every
    GetObject, so that S3 sends the object's checksum and botocore checks the body against
    it. For a ranged read S3 sends no full-object checksum, so on this store's reads
    (ranges) the header only costs CPU per request (a header to build, sign and send, the
    checksum context to set up), and where one does come back botocore's wrapper would
    push the body through a copy instead of into the caller's buffer. Every byte this
    store reads for a checkpoint is verified against the manifest's digests anyway, and
    ``get`` (whole small objects) still asks for the checksum itself and checks it."""
    if not SAVINGS["checksum_mode"]:
        return config
    chosen = "response_checksum_validation" in getattr(config, "_user_provided_options", {})
    chosen = chosen or bool(os.environ.get("AWS_RESPONSE_CHECKSUM_VALIDATION"))
    chosen = chosen or "response_checksum_validation" in session.get_scoped_config()
    if chosen:
        return config
    return botocore.config.Config(response_checksum_validation="when_required").merge(config)


def _client_config(options: Mapping[str, Any], client_kwargs: dict[str, Any], url: str) -> Any:
    """botocore's Config: our defaults, then ``config_kwargs``, unsigned for ``anon``,
    then a Config given in ``client_kwargs`` (taken out of them). Raises
    ConfigurationError for arguments botocore does not know."""
    try:
        config = botocore.config.Config(
            **{**_DEFAULT_CONFIG, **dict(options.get("config_kwargs") or {})}
        )
    except TypeError as exc:
        raise ConfigurationError(
            f"invalid config_kwargs for {url}: {exc}",
            hint="config_kwargs are botocore.config.Config arguments",
        ) from None
    if options.get("anon"):
        config = config.merge(botocore.config.Config(signature_version=botocore.UNSIGNED))
    if isinstance(client_kwargs.get("config"), botocore.config.Config):
        config = config.merge(client_kwargs.pop("config"))
    return config


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
