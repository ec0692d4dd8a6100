"""The HTTP side of a GCS store: gcsfs's filesystem (session and credentials) set up from
the storage options, one request through its session, the plain ``http.client``
connections (one per thread) that ranged reads use, and the parsing of the answers'
headers and times.

gcsfs supplies the aiohttp session, the credentials (``token``, ``project``, application
default credentials, ``STORAGE_EMULATOR_HOST``/``endpoint_url``) and its event loop; the
requests themselves are made here, without gcsfs's retries (docs/design.md §4).
"""

from __future__ import annotations

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
from typing import Any
from urllib.parse import urlsplit

# gcsfs >= 2026 otherwise swaps in a filesystem that probes every bucket over gRPC with a
# 60 s timeout, which hangs against emulators. Must be set before gcsfs is imported (here and
# in every module of this package that imports gcsfs).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import aiohttp
import google.auth.exceptions
from gcsfs.core import GCSFileSystem  # the plain HTTP filesystem, always

from cloudckpt.errors import ConfigurationError, CredentialsError, redact_url
from cloudckpt.stores._gcs_errors import CREDENTIALS_HINT

# The adapter's logger: everything the GCS store logs goes under one name.
logger = logging.getLogger("cloudckpt.stores.gcs")

# Without a total timeout large parts can take as long as they need; a silent server cannot.
DEFAULT_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)

# fsspec options every filesystem takes, and that gcsfs passes on to it.
_FSSPEC_OPTIONS = frozenset(
    {"use_listings_cache", "listings_expiry_time", "max_paths", "batch_size"}
)


class Response:
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


_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)")


def parse_time(value: str | None) -> dt.datetime | None:
    """RFC 3339 time from the JSON API (any number of fraction digits; 3.10-safe)."""
    m = _RFC3339.fullmatch(value or "")
    if m is None:
        return None
    frac = (m[2] or "0")[:6].ljust(6, "0")
    return dt.datetime.fromisoformat(f"{m[1]}.{frac}{'+00:00' if m[3] == 'Z' else m[3]}")


def goog_hashes(headers: Any) -> dict[str, str]:
    """``x-goog-hash: crc32c=...,md5=...`` (one or several headers) as a dict."""
    pairs = (p.strip() for h in headers.getall("x-goog-hash", []) for p in h.split(","))
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def parse_http_date(value: str | None) -> dt.datetime | None:
    """An HTTP date header (``Date``, ``Last-Modified``), or None if absent or malformed."""
    try:
        return email.utils.parsedate_to_datetime(value) if value else None
    except (TypeError, ValueError):
        return None


@functools.cache
def accepted_options() -> frozenset[str]:
    """Keyword arguments GCSFileSystem really uses (it accepts any, silently)."""
    params = inspect.signature(GCSFileSystem.__init__).parameters
    named = {
        n
        for n, p in params.items()
        if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
    }
    return frozenset(named - {"self", "asynchronous", "loop"}) | _FSSPEC_OPTIONS


def make_filesystem(storage_options: dict[str, Any], url: str) -> GCSFileSystem:
    """A private ``GCSFileSystem`` for ``storage_options`` (the store at ``url``).

    Raises:
        ConfigurationError: an unknown storage option, or a value gcsfs refuses.
        CredentialsError: gcsfs could not set up the requested credentials.
    """
    unknown = set(storage_options) - accepted_options()
    if unknown:
        # GCSFileSystem swallows unknown keyword arguments; a typo must not go unnoticed.
        raise ConfigurationError(
            f"unknown GCS storage option(s) {', '.join(sorted(map(repr, unknown)))} for {url}",
            hint=f"Accepted options: {', '.join(sorted(accepted_options()))}",
        )
    try:
        # A private instance: gcsfs shares instances (and their caches) by arguments.
        return GCSFileSystem(skip_instance_cache=True, **storage_options)
    except (TypeError, ValueError) as exc:  # gcsfs's own messages carry no secrets
        raise ConfigurationError(f"invalid GCS storage options for {url}: {exc}") from None
    except (google.auth.exceptions.GoogleAuthError, OSError) as exc:
        # Auth library messages may quote credential files; name the type only.
        raise CredentialsError(
            f"cannot set up GCS credentials for {url} ({type(exc).__name__})",
            hint=CREDENTIALS_HINT,
        ) from None


async def send(
    fs: GCSFileSystem,
    method: str,
    url: str,
    *,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    data: io.BytesIO | None = None,
    json_body: Any = None,
) -> Response:
    """One request through gcsfs's session with its credentials; no retries. Raises
    aiohttp, asyncio and google.auth errors as they come (``_gcs_errors.run`` maps them)."""
    await fs._set_session()
    query = {k: str(v) for k, v in fs._get_params(params or {}).items()}
    async with fs.session.request(
        method,
        url,
        params=query,
        headers=fs._get_headers(headers),  # adds (and refreshes) the credentials
        data=data,
        json=json_body,
        timeout=DEFAULT_TIMEOUT
        if fs.requests_timeout is None
        else aiohttp.ClientTimeout(total=fs.requests_timeout),
    ) as response:
        body = await response.read()
    logger.debug("%s %s -> %d", method, redact_url(url), response.status)
    return Response(response.status, response.headers, body)


class ThreadConnections:
    """One kept-alive ``http.client`` connection per thread to gcsfs's endpoint (for
    ranged reads outside gcsfs's single event loop)."""

    def __init__(self, fs: GCSFileSystem) -> None:
        self._fs = fs
        self._local = threading.local()

    def get(self, target: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """GET on this thread's kept-alive connection; once more on a fresh connection
        when the server had closed the idle one (nothing was answered: a safe retry).
        Raises OSError / http.client.HTTPException."""
        reused = getattr(self._local, "conn", None) is not None
        try:
            conn = self._connection()
            conn.request("GET", target, headers=headers)
            return conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.drop()
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
            timeout = self._fs.requests_timeout or DEFAULT_TIMEOUT.sock_read
            conn = self._local.conn = cls(url.hostname, url.port, timeout=timeout)
        return conn

    def drop(self) -> None:
        """Close this thread's connection (after a failure: its state is unknown)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()
