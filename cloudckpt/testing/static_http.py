"""A static HTTP file server on 127.0.0.1 (python's ``http.server`` in a thread), to read a
run over ``http://`` through fsspec's HTTP backend, as from a web server that serves a
directory of checkpoints::

    from cloudckpt.testing.static_http import StaticHTTPServer

    with StaticHTTPServer(root) as server:           # root holds the run directory "run"
        mgr = CheckpointManager(f"{server.url}/run", unsafe_single_writer=True)

Like common web servers it lists directories as HTML links, answers ``Range`` requests
with ``206`` and unknown paths with ``404``. With ``auth=(user, password)`` every request
must carry that HTTP Basic authorization (else ``401``). ``statuses`` records the status
of every answer, ``authorized`` how many requests carried the right credentials.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import os
import re
import threading
from pathlib import Path
from typing import Any

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _Handler(http.server.SimpleHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read statuses
        pass

    def send_response(self, code: int, message: str | None = None) -> None:
        with self.server.lock:
            self.server.statuses.append(code)
        super().send_response(code, message)

    def _authorized(self) -> bool:
        if self.server.auth is None:
            return True
        user, password = self.server.auth
        expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        if self.headers.get("Authorization") != expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="cloudckpt"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return False
        with self.server.lock:
            self.server.authorized += 1
        return True

    def do_HEAD(self) -> None:
        if self._authorized():
            super().do_HEAD()

    def do_GET(self) -> None:
        if not self._authorized():
            return
        match = _RANGE.match(self.headers.get("Range", ""))
        path = Path(self.translate_path(self.path))
        if match is None or not path.is_file():
            super().do_GET()
            return
        data = path.read_bytes()
        start = int(match[1])
        end = min(int(match[2]) if match[2] else len(data) - 1, len(data) - 1)
        if start >= len(data):
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = data[start : end + 1]
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler: Any, auth: tuple[str, str] | None) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.auth = auth
        self.lock = threading.Lock()
        self.statuses: list[int] = []
        self.authorized = 0


class StaticHTTPServer:
    """Serve ``root`` over HTTP on a free loopback port while the ``with`` block runs."""

    def __init__(self, root: str | os.PathLike[str], auth: tuple[str, str] | None = None):
        handler = functools.partial(_Handler, directory=str(root))
        self._server = _Server(handler, auth)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="static-http", daemon=True
        )

    @property
    def statuses(self) -> list[int]:
        with self._server.lock:
            return list(self._server.statuses)

    @property
    def authorized(self) -> int:
        with self._server.lock:
            return self._server.authorized

    def __enter__(self) -> StaticHTTPServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


@contextlib.contextmanager
def refused_port() -> Any:
    """A loopback port that refuses connections (bound, never listening) while the
    ``with`` block runs, so no other process can start listening on it meanwhile."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
    finally:
        sock.close()
