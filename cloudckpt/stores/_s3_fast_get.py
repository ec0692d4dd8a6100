"""A lean ranged GET for ``S3Store.get_range_into``: the happy path only, botocore for the rest.

botocore spends 1.1-1.7 ms of client CPU on each GetObject (parameter validation, endpoint
rules, event handlers, response parsing); ``load_state`` makes ~130 of them per GiB. This
path sends the same request (same URL, headers and SigV4 signature) with less Python:

- **The request's shape is learned from botocore**, never built from configuration: a
  ``before-send`` hook keeps (per thread) the last GetObject botocore sent, and only after
  ``get_range_into``'s botocore GetObject *succeeded* is it checked and promoted
  (``promote``): whatever endpoint rules, addressing style and region redirects botocore
  ended on is what the fast path uses. A store's first read therefore always goes through
  botocore.
- **Eligibility, decided once; refused = botocore for this store forever** (``refused``
  says why): the ``lean_get`` saving is on; no ``s3_additional_kwargs`` apply to GetObject
  (requester pays, SSE-C, expected bucket owner, ...); the bucket is not an ARN; the
  configured signature version is the default or ``s3v4``; the learned request carries
  only the headers this path reproduces (Range, User-Agent, the SigV4 ones, botocore's
  invocation headers: so no checksum mode, no S3 Express session token), is signed with
  plain ``AWS4-HMAC-SHA256`` for the signing name ``s3`` (not SigV4a, not anonymous), has no query string and its URL
  ends with the key quoted as botocore quotes it; botocore would use no proxy for it.
- **Sent through botocore's own HTTP session** (``client._endpoint.http_session``), so TLS
  verification (``verify=``, CA bundles, client certificates), timeouts and connection
  pooling are exactly the client's. Signed by botocore's ``S3SigV4Auth`` with credentials
  frozen per request from the client's credentials (refreshing ones keep working), the
  learned region and signing name and the payload hash botocore sent.
- **Accepted only**: a 206 whose ``Content-Range`` starts at the requested offset and ends
  at the requested end (or earlier where the object ends: ``/total`` = end + 1), with a
  ``Content-Length`` equal to the range's length, not chunked, not encoded; the body read
  with ``readinto`` straight into the caller's buffer. Anything else (another status, a
  header missing or mismatched, a connection error, a body cut short, a timeout) discards
  that connection and returns None: the caller does the request again through botocore,
  which has the retries and the error mapping. After ``MAX_FALLBACKS`` in a row *that say
  the path does not fit this store* (a 2xx it refused, a redirect, a 4xx other than 404,
  408, 416 and 429, a failure of its own before sending) the path turns itself off for the
  store and logs once (INFO) why; errors botocore meets as well and rides out or reports
  (5xx, throttling, a missing key, a reset or timed-out connection, a body cut short) do not count, so a
  burst of throttling across threads does not turn it off for good. Such an error of the
  store's (a 5xx, 408 or 429, a reset, a timeout, a body cut short; not a 404 or 416,
  answers about the object that botocore gets too) **rests** the path: every read goes straight to botocore
  until one of botocore's reads of the store succeeds. So a store that fails every read
  costs one lean request (and, stalled, one read timeout) more in all, not one per read.

Nothing here raises except what the caller's thread is interrupted with
(KeyboardInterrupt, ...).
"""

from __future__ import annotations

import http.client
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import botocore
import botocore.auth
import botocore.awsrequest
import botocore.exceptions
import botocore.utils

from cloudckpt.stores._s3_client import SAVINGS

log = logging.getLogger("cloudckpt.stores.s3")

#: Fallbacks in a row after which the fast path is off for the store.
MAX_FALLBACKS = 3

# The headers a learned GetObject may carry (lower case): those this path sends again.
_KNOWN_HEADERS = frozenset(
    {
        "range",
        "user-agent",
        "x-amz-date",
        "x-amz-content-sha256",
        "authorization",
        "x-amz-security-token",
        "amz-sdk-invocation-id",
        "amz-sdk-request",
    }
)
_AUTH = re.compile(r"AWS4-HMAC-SHA256 Credential=[^/]+/\d{8}/([^/]+)/([^/]+)/aws4_request,")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
# Answers botocore meets as well and rides out or reports: no sign the path does not fit.
_STORE_ANSWERS = frozenset({404, 408, 416, 429})
# Of those, the store's trouble (a timeout, throttling), which rests the path; a missing key
# or a range past the end is an answer about the object, and the next read may differ.
_STORE_TROUBLE = frozenset({408, 429})
# Transport failures (botocore's own wrappers, and the socket's under ``readinto``): the
# same for botocore's try; no sign the path does not fit.
_TRANSPORT_ERRORS = (botocore.exceptions.HTTPClientError, OSError, http.client.HTTPException)


@dataclass(frozen=True)
class _Shape:
    """What a promoted GetObject taught: the URL up to the key, and how it was signed."""

    prefix: str
    region: str
    signing_name: str
    payload_hash: str
    user_agent: str


class _Signer(botocore.auth.S3SigV4Auth):
    """botocore's S3 SigV4 with the payload hash botocore sent on the learned request
    (a GET's body is empty: UNSIGNED-PAYLOAD or the empty body's SHA-256)."""

    def __init__(self, credentials: Any, service_name: str, region_name: str, payload: str):
        super().__init__(credentials, service_name, region_name)
        self._payload_hash = payload

    def payload(self, request: Any) -> str:
        return self._payload_hash


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _quote(key: str) -> str:
    """A key in a URL path exactly as botocore's serializer quotes a greedy label."""
    quoted: str = botocore.utils.percent_encode(key, safe="/~")
    return quoted


def _range_matches(first: int, last: int, total: int, start: int, end: int) -> bool:
    """``Content-Range: bytes first-last/total`` answers a request for ``start-end``: the
    same start, and the same end or an earlier one where the object ends."""
    return first == start and (last == end or (start <= last < end and total == last + 1))


def _discard(raw: Any) -> None:
    """Close a response's connection: never hand a half-read one back to the pool (its
    unread bytes would be read as the next response)."""
    raw.close()


class FastGet:
    """The lean ranged GET of one store's client. ``ready`` once a shape is promoted."""

    def __init__(self, client: Any, bucket: str, extra_params: dict[str, Any]) -> None:
        self._client = client
        self._bucket = bucket
        self._pending = threading.local()
        self._lock = threading.Lock()
        self._shape: _Shape | None = None
        self._fallbacks = 0
        # The store's own trouble met a lean try: botocore's turn until it reads once.
        self._resting = False
        self.refused: str | None = None
        self._session: Any = None
        self._signer: Any = None
        session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        signer = getattr(client, "_request_signer", None)
        version = getattr(client.meta.config, "signature_version", None)
        if not SAVINGS["lean_get"]:
            self.refused = "switched off (SAVINGS['lean_get'])"
        elif extra_params:
            self.refused = f"s3_additional_kwargs apply to GetObject ({', '.join(extra_params)})"
        elif bucket.startswith("arn:"):
            self.refused = "the bucket is an ARN"
        elif version not in (None, "s3v4"):
            self.refused = f"signature version {version!r}"
        elif not (hasattr(session, "send") and hasattr(session, "_proxy_config")):
            self.refused = "this botocore's HTTP session is not the one this path knows"
        elif signer is None or not hasattr(signer, "_credentials"):
            self.refused = "this botocore's request signer is not the one this path knows"
        if self.refused is None:
            self._session = session
            self._signer = signer
            client.meta.events.register("before-send.s3.GetObject", self._seen)

    @property
    def ready(self) -> bool:
        """A shape is learned and the path is not resting after the store's trouble."""
        return self._shape is not None and not self._resting

    def _seen(self, request: Any, **_: Any) -> None:
        """``before-send``: remember this thread's last GetObject (returns None: a value
        would replace the response). Once the path is off there is nothing to learn: keep
        nothing (the hook stays: unregistering while other threads emit is not safe)."""
        if self.refused is None:
            self._pending.request = request

    def expect(self) -> None:
        """A botocore GetObject of ``get_range_into`` starts: forget older ones."""
        if self.refused is None:
            self._pending.request = None

    def promote(self, full_key: str, range_header: str) -> None:
        """This thread's botocore GetObject for ``full_key`` succeeded: the store answers
        again (the path rests no more); learn its shape, or refuse the store for good with
        the reason."""
        self._resting = False
        request = getattr(self._pending, "request", None)
        self._pending.request = None
        if self.refused is not None or self._shape is not None or request is None:
            return
        try:
            reason, shape = self._learn(request, full_key, range_header)
        except Exception as exc:  # (a botocore whose request looks otherwise) never raise
            reason, shape = f"it could not be read ({type(exc).__name__})", None
        with self._lock:
            if reason is not None:
                self._off(f"the request botocore sent: {reason}")
            elif self.refused is None:
                self._shape = shape

    def _learn(self, request: Any, full_key: str, range_header: str) -> tuple[str | None, Any]:
        """(why not, None) or (None, the shape) of a GetObject botocore sent."""
        headers = {_text(k).lower(): _text(v) for k, v in request.headers.items()}
        url = str(request.url)
        quoted = _quote(full_key)
        extra = sorted(set(headers) - _KNOWN_HEADERS)
        auth = _AUTH.match(headers.get("authorization", ""))
        if request.method != "GET" or urlsplit(url).query or not url.endswith("/" + quoted):
            return "its URL is not the endpoint's followed by the quoted key", None
        if extra:
            return f"it carries headers this path does not send ({', '.join(extra)})", None
        if headers.get("range") != range_header:
            return "its Range header is not the one asked for", None
        if auth is None:
            return "it is not signed with plain SigV4 (AWS4-HMAC-SHA256)", None
        if auth.group(2) != "s3":  # (S3 Express signs for s3express, with its own session)
            return f"it is signed for {auth.group(2)!r}, not 's3'", None
        if "x-amz-content-sha256" not in headers:
            return "it has no payload hash", None
        if self._session._proxy_config.proxy_url_for(url):
            return "botocore sends it through a proxy", None
        return None, _Shape(
            prefix=url[: len(url) - len(quoted)],
            region=auth.group(1),
            signing_name=auth.group(2),
            payload_hash=headers["x-amz-content-sha256"],
            user_agent=headers.get("user-agent", ""),
        )

    def _off(self, reason: str) -> None:
        """(under the lock) Turn the path off for this store, saying why once."""
        if self.refused is None:
            self.refused = reason
            self._shape = None
            log.info("lean ranged GETs off for this S3 store: %s", reason)

    def _fell_back(self, why: str, counts: bool = True, rest: bool = False) -> None:
        """A lean try was given up; ``counts``: it says the path does not fit this store
        (toward ``MAX_FALLBACKS``), rather than an error botocore meets as well; ``rest``:
        it was the store's own trouble (the path rests until botocore reads again)."""
        if rest:
            self._resting = True
        if not counts:
            return
        with self._lock:
            self._fallbacks += 1
            if self._fallbacks >= MAX_FALLBACKS:
                self._off(f"{MAX_FALLBACKS} fallbacks in a row, the last: {why}")

    def get_range_into(self, full_key: str, start: int, buf: memoryview) -> int | None:
        """Read bytes ``start..start+len(buf)-1`` of ``full_key`` into ``buf``; return how
        many came (fewer only where the object ends), or None: do it through botocore
        (nothing kept from this try; ``buf`` may hold some of its bytes)."""
        shape = self._shape
        if shape is None:
            return None
        end = start + len(buf) - 1
        try:
            creds = self._signer._credentials
            frozen = creds.get_frozen_credentials() if creds is not None else None
            if frozen is None:
                self._fell_back("no credentials")
                return None
            request = botocore.awsrequest.AWSRequest(
                method="GET",
                url=shape.prefix + _quote(full_key),
                headers={"Range": f"bytes={start}-{end}", "User-Agent": shape.user_agent},
            )
            _Signer(frozen, shape.signing_name, shape.region, shape.payload_hash).add_auth(request)
            request.stream_output = True
            response = self._session.send(request.prepare())
        except Exception as exc:  # (botocore maps the transport's errors) any: botocore
            failed = f"the request failed ({type(exc).__name__})"
            transport = isinstance(exc, _TRANSPORT_ERRORS)
            self._fell_back(failed, counts=not transport, rest=transport)
            return None
        raw = response.raw
        status = response.status_code
        counts = status < 500 and status not in _STORE_ANSWERS
        rest = status >= 500 or status in _STORE_TROUBLE
        try:
            why, got = self._read(response, start, end, buf)
        except Exception as exc:
            why, got = f"the body broke off ({type(exc).__name__})", None
            counts = not isinstance(exc, _TRANSPORT_ERRORS)
            rest = rest or not counts
        except BaseException:
            _discard(raw)
            raise
        if why is not None:
            _discard(raw)
            self._fell_back(why, counts, rest)
            return None
        raw.release_conn()
        with self._lock:
            self._fallbacks = 0
        return got

    @staticmethod
    def _read(response: Any, start: int, end: int, buf: memoryview) -> tuple[str | None, int]:
        """(why not, bytes read): the body of an accepted response, read into ``buf``."""
        if response.status_code != 206:
            return f"status {response.status_code}", 0
        headers = response.headers
        fp = getattr(response.raw, "_fp", None)
        if not isinstance(fp, http.client.HTTPResponse) or fp.chunked:
            return "not a plain response of known length", 0
        if headers.get("content-encoding", "identity") != "identity":
            return "an encoded body", 0
        m = _CONTENT_RANGE.fullmatch(headers.get("content-range", ""))
        if m is None:
            return "no Content-Range", 0
        first, last, total = (int(g) for g in m.groups())
        if not _range_matches(first, last, total, start, end):
            return f"Content-Range {first}-{last}/{total} for bytes {start}-{end}", 0
        length = last - first + 1
        if headers.get("content-length") != str(length) or fp.length != length:
            return "a Content-Length that is not the range's", 0
        got = 0
        while got < length:
            n = fp.readinto(buf[got:length])
            if not n:  # the connection closed early: transport, as a reset is
                raise http.client.IncompleteRead(bytes(buf[:0]), length - got)
            got += n
        return None, got
