"""A loopback HTTP fault proxy: put it between a store client and a real (emulated) server
and make the network misbehave at the HTTP level, request by request.

::

    from cloudckpt.testing.moto_server import MotoServer
    from cloudckpt.testing.proxy import FaultProxy, ProxyRule

    with MotoServer() as moto, FaultProxy(moto.endpoint_url, seed=3) as proxy:
        proxy.add(ProxyRule("503", probability=0.1))                    # any request
        proxy.add(ProxyRule("reset_after", methods={"PUT"}, path="LATEST", times=1))
        options = {**moto.storage_options(), "endpoint_url": proxy.endpoint_url}
        mgr = CheckpointManager("s3://bucket/run", storage_options=options)

Faults (``ProxyRule.fault``):

==================  ========================================================================
``503``             answer ``503 Service Unavailable`` at once; the request never reaches
                    the server (not applied)
``500_after``       forward the request, then answer ``500 Internal Error`` instead of the
                    server's answer (applied, the client is told it failed)
``reset_before``    read part of the request, then reset the connection (not applied)
``reset_after``     forward the request, then reset the connection instead of answering
                    (applied, answer lost)
``cut_response``    forward, then send the answer's headers and only half its body, then
                    reset the connection (RST: a truncated download)
``cut_fin``         the same, but close the connection cleanly (FIN): the client sees the
                    body end early with no error from the socket
``stall``           hold the request for ``stall_seconds`` (the client times out), then
                    forward it anyway: a late duplicate of a request the client retried
                    (a request still held when the proxy stops is dropped)
==================  ========================================================================

Rules match by HTTP method and a substring of the request target (path and query), fire
at most ``times`` times (None: unlimited) with ``probability`` drawn from the proxy's seeded
RNG; the first matching rule wins. ``injected`` counts what was injected, ``requests``
what was seen. Requests are parsed just enough to find their end (Content-Length,
chunked bodies, ``Expect: 100-continue``); answers likewise. One thread per connection.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import socket
import struct
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

__all__ = ["FAULTS", "FaultProxy", "ProxyRule"]

FAULTS = ("503", "500_after", "reset_before", "reset_after", "cut_response", "cut_fin", "stall")


@dataclasses.dataclass
class ProxyRule:
    """Inject ``fault`` into requests whose method is in ``methods`` (None: any) and whose
    target contains ``path`` (or satisfies it, if it is a predicate)."""

    fault: str
    probability: float = 1.0
    times: int | None = None
    methods: set[str] | frozenset[str] | None = None
    path: str | Callable[[str], bool] | None = None
    fired: int = 0

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown proxy fault {self.fault!r}; known: {', '.join(FAULTS)}")

    def matches(self, method: str, target: str, rng: random.Random) -> bool:
        if self.times == 0 or (self.methods is not None and method not in self.methods):
            return False
        if self.path is not None:
            ok = self.path in target if isinstance(self.path, str) else self.path(target)
            if not ok:
                return False
        return self.probability >= 1.0 or rng.random() < self.probability


class _Closed(Exception):
    """The peer closed the connection."""


class _Reader:
    """Buffered reads from a socket: lines and exact byte counts."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise _Closed()
        self.buf += chunk

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if len(self.buf) > 1 << 20:
                raise _Closed()
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line + b"\r\n"

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def until_close(self) -> bytes:
        with contextlib.suppress(_Closed, OSError):
            while True:
                self._fill()
        data, self.buf = self.buf, b""
        return data


def _head(reader: _Reader) -> tuple[bytes, list[tuple[str, str]], list[bytes]]:
    """Start line, parsed headers, raw header lines."""
    start = reader.line()
    raw, headers = [], []
    while True:
        line = reader.line()
        if line == b"\r\n":
            break
        raw.append(line)
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip().lower(), value.strip()))
    return start, headers, raw


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    return next((v for n, v in headers if n == name), None)


def _body(reader: _Reader, headers: list[tuple[str, str]], *, until_close: bool) -> bytes:
    """The raw body bytes as framed on the wire (chunked bodies keep their framing)."""
    if "chunked" in (_get(headers, "transfer-encoding") or "").lower():
        out = b""
        while True:
            size_line = reader.line()
            out += size_line
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    trailer = reader.line()
                    out += trailer
                    if trailer == b"\r\n":
                        return out
            out += reader.exactly(size + 2)
    length = _get(headers, "content-length")
    if length is not None:
        return reader.exactly(int(length))
    return reader.until_close() if until_close else b""


def _reset(sock: socket.socket) -> None:
    """Close with RST instead of FIN (SO_LINGER 0): what a crashed middlebox does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


_ERROR_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    b"<Message>injected by cloudckpt.testing.proxy</Message></Error>"
)


def _error_response(status: int, reason: str, code: str) -> bytes:
    body = _ERROR_BODY.replace(b"{code}", code.encode())
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


class FaultProxy:
    """See the module docstring. Use as a context manager, or ``start()``/``stop()``."""

    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        stall_seconds: float = 2.0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.rules: list[ProxyRule] = []
        self.rng = random.Random(seed)
        self.stall_seconds = stall_seconds
        self.injected: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self._lock = threading.Lock()
        self._host, self._port = host, port
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()
        self._stopping = False
        self._stopped = threading.Event()  # wakes stalled requests when the proxy stops

    # -- configuration --

    def add(self, rule: ProxyRule) -> ProxyRule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    @property
    def endpoint_url(self) -> str:
        if self._listener is None:
            raise RuntimeError("the proxy is not running; call start() first")
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    # -- lifecycle --

    def start(self) -> FaultProxy:
        listener = socket.create_server((self._host, self._port))
        listener.settimeout(0.2)
        self._listener = listener
        self._spawn(self._accept_loop, listener)
        return self

    def stop(self) -> None:
        self._stopping = True
        self._stopped.set()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            _reset(s)
        for t in self._threads:
            t.join(timeout=5)
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, target: Callable, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="cloudckpt-proxy")
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _track(self, sock: socket.socket, add: bool = True) -> None:
        with self._lock:
            (self._sockets.add if add else self._sockets.discard)(sock)

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._track(client)
            self._spawn(self._serve, client)

    # -- one client connection --

    def _pick(self, method: str, target: str) -> str | None:
        with self._lock:
            self.requests += 1
            for rule in self.rules:
                if rule.matches(method, target, self.rng):
                    if rule.times is not None:
                        rule.times -= 1
                    rule.fired += 1
                    self.injected[rule.fault] += 1
                    return rule.fault
        return None

    # Kept whole (62 lines): one request's way through the proxy, with each fault at the
    # point a request meets it, in that order.
    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        reader = _Reader(client)
        try:
            while not self._stopping:
                start, headers, raw = _head(reader)
                method, target = start.decode("latin-1").split(" ")[:2]
                fault = self._pick(method, target)
                if fault == "reset_before":
                    reader.exactly(min(len(reader.buf), 10))  # a little of the body, maybe
                    _reset(client)
                    return
                expect = (_get(headers, "expect") or "").lower() == "100-continue"
                if expect:
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = _body(reader, headers, until_close=False)
                if fault == "503":
                    client.sendall(_error_response(503, "Service Unavailable", "SlowDown"))
                    _reset(client)
                    return
                if fault == "stall" and self._stopped.wait(self.stall_seconds):
                    _reset(client)  # stopped while holding it: the request never arrives
                    return
                forward = start + b"".join(
                    line for line in raw if not line.lower().startswith(b"expect:")
                )
                forward += b"\r\n" + body
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=60)
                    self._track(upstream)
                    up_reader = _Reader(upstream)
                upstream.sendall(forward)
                r_start, r_headers, r_raw = _head(up_reader)
                no_body = method == "HEAD" or r_start.split(b" ")[1] in (b"204", b"304")
                r_body = b"" if no_body else _body(up_reader, r_headers, until_close=True)
                if (_get(r_headers, "connection") or "").lower() == "close":
                    self._track(upstream, add=False)
                    upstream.close()
                    upstream = None
                if fault == "500_after":
                    client.sendall(_error_response(500, "Internal Server Error", "InternalError"))
                    _reset(client)
                    return
                if fault == "reset_after":
                    _reset(client)
                    return
                response = r_start + b"".join(r_raw) + b"\r\n"
                if fault in ("cut_response", "cut_fin") and len(r_body) > 1:
                    client.sendall(response + r_body[: len(r_body) // 2])
                    if fault == "cut_response":
                        _reset(client)
                    else:
                        with contextlib.suppress(OSError):
                            client.shutdown(socket.SHUT_RDWR)
                    return
                client.sendall(response + r_body)
        except (_Closed, OSError, ValueError, IndexError):
            pass
        finally:
            self._track(client, add=False)
            with contextlib.suppress(OSError):
                client.close()
            if upstream is not None:
                self._track(upstream, add=False)
                with contextlib.suppress(OSError):
                    upstream.close()
