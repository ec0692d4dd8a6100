"""A real moto S3 server in a separate OS process, for tests and ``cloudckpt demo``.

::

    from cloudckpt.testing.moto_server import MotoServer

    with MotoServer() as server:
        server.create_bucket("demo")
        store = open_store("s3://demo/run", server.storage_options())

The server is ``python -m moto.server -H 127.0.0.1 -p <free port>`` (moto 5.x) started with
the current interpreter, so it needs ``moto[server]`` installed and nothing else. It listens
on loopback only, accepts any credentials (unless started with
``env={"INITIAL_NO_AUTH_ACTION_COUNT": ...}``, moto's switch for IAM checks) and keeps
everything in memory. Its output goes to a temporary log file, never to a pipe, so a
chatty server cannot block; the log's tail is included in the error if the server dies
while starting. ``stop()`` terminates the process, kills it if it does not exit, and
removes the log.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from cloudckpt.testing._process import ServerProcess

__all__ = ["MotoServer", "MotoServerError"]

#: Credentials moto accepts by default; they are not secrets.
TEST_KEY = "testing"
TEST_SECRET = "testing"
TEST_REGION = "us-east-1"


class MotoServerError(RuntimeError):
    """The moto server could not be started (not installed, died, or never answered)."""


# ``python -m moto.server -H HOST -p PORT``, plus a watchdog thread that ends the server when
# its parent dies (even by SIGKILL), so a crashed test run or demo leaves no server behind,
# and (argv[3] == "1") one lock around every request: moto checks If-Match/If-None-Match and
# then writes without a lock, so concurrent conditional writes could both win; S3's are atomic.
_LAUNCHER = """
import os, sys, threading, time
parent = os.getppid()
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
if sys.argv[3] == "1":
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication
    lock = threading.Lock()
    dispatch = DomainDispatcherApplication.__call__
    def serialized(self, environ, start_response):
        with lock:
            result = dispatch(self, environ, start_response)
            try:
                return [b"".join(result)]
            finally:
                getattr(result, "close", lambda: None)()
    DomainDispatcherApplication.__call__ = serialized
from moto.server import main
main(["-H", sys.argv[1], "-p", sys.argv[2]])
"""


class _PortTaken(Exception):
    pass


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class MotoServer(ServerProcess):
    """A moto server on a free 127.0.0.1 port. Use as a context manager, or call
    ``start()`` and ``stop()``.

    Args:
        host: interface to bind (loopback by default; the server has no authentication).
        port: fixed port, or None for a free one.
        startup_timeout: seconds to wait for the server to answer HTTP.
        env: extra environment variables for the server process (e.g.
            ``{"INITIAL_NO_AUTH_ACTION_COUNT": "5"}`` to enforce IAM after five requests).
        serialize: handle one request at a time (the default), which makes moto's
            conditional writes atomic as they are on S3. Without it, racing
            ``If-Match`` / ``If-None-Match`` writes can all succeed.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        startup_timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
        serialize: bool = True,
    ) -> None:
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        self.startup_timeout = startup_timeout
        self._env = dict(env or {})
        self.serialize = serialize
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: str | None = None
        self._admin: Any = None

    # --- lifecycle ------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """``http://host:port`` of the running server."""
        if self.port is None:
            raise MotoServerError("the moto server is not running; call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> MotoServer:
        """Start the server and wait until it answers. Raises MotoServerError."""
        if self.running:
            return self
        # A free port can be taken between probing and binding: try another one.
        attempts = 1 if self._requested_port else 3
        for attempt in range(attempts):
            try:
                self._start_once(self._requested_port or _free_port(self.host))
                return self
            except _PortTaken as exc:
                if attempt == attempts - 1:
                    raise MotoServerError(str(exc)) from None
        return self  # unreachable

    def _start_once(self, port: int) -> None:
        fd, self._log_path = tempfile.mkstemp(prefix="cloudckpt-moto-", suffix=".log")
        env = {**os.environ, **self._env}
        env.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        cmd = [sys.executable, "-c", _LAUNCHER, self.host, str(port), str(int(self.serialize))]
        with os.fdopen(fd, "wb") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                # Its own process group: a Ctrl-C in a terminal demo reaches us, and we
                # stop the server ourselves.
                start_new_session=True,
            )
        self.port = port
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc.poll() is not None:
                log_tail = self._log_tail()
                code = self._proc.returncode
                self._cleanup()
                message = (
                    f"moto server exited with code {code} while starting on port {port} "
                    f"(is moto[server] installed?). Its output:\n{log_tail}"
                )
                if "in use" in log_tail:
                    raise _PortTaken(message)
                raise MotoServerError(message)
            if self._answers() and self._proc.poll() is None:
                return
            if time.monotonic() > deadline:
                log_tail = self._log_tail()
                self.stop()
                raise MotoServerError(
                    f"moto server did not answer on {self.host}:{port} within "
                    f"{self.startup_timeout:.0f}s. Its output:\n{log_tail}"
                )
            time.sleep(0.05)

    def _answers(self) -> bool:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=1.0)
        try:
            conn.request("GET", "/moto-api/data.json")
            conn.getresponse().read()
            return True
        except OSError:
            return False
        finally:
            conn.close()

    def _log_tail(self, limit: int = 4000) -> str:
        if not self._log_path:
            return ""
        try:
            with open(self._log_path, "rb") as f:
                return f.read()[-limit:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server (terminate, then kill after 5 s) and remove its log."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._cleanup()

    def _cleanup(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        self._proc = None
        self.port = None
        if self._log_path:
            with contextlib.suppress(OSError):
                os.unlink(self._log_path)
            self._log_path = None

    # --- helpers --------------------------------------------------------------------

    def storage_options(self) -> dict[str, Any]:
        """s3fs-style options that point a client at this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": TEST_KEY,
            "secret": TEST_SECRET,
            "client_kwargs": {"region_name": TEST_REGION},
        }

    def client(self, **kwargs: Any) -> Any:
        """A plain boto3 S3 client for this server (imports boto3 on first use)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=TEST_KEY,
            aws_secret_access_key=TEST_SECRET,
            region_name=TEST_REGION,
            **kwargs,
        )

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (in us-east-1, so no location constraint)."""
        if self._admin is None:  # one client for all buckets: creating one costs ~0.3 s
            self._admin = self.client()
        self._admin.create_bucket(Bucket=name)

    def enforce_auth(self, enabled: bool = True) -> None:
        """Make moto check signatures and IAM policies from the next request on
        (``/moto-api/reset-auth``); by default it accepts any credentials. Create the
        IAM users and keys you need before enabling it."""
        self._post("/moto-api/reset-auth", b"0" if enabled else b"inf")

    def reset(self) -> None:
        """Forget every bucket and object (moto's ``/moto-api/reset``)."""
        self._post("/moto-api/reset", b"")

    def _post(self, path: str, body: bytes) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request("POST", path, body=body)
            resp = conn.getresponse()
            text = resp.read()
            if resp.status != 200:
                raise MotoServerError(f"POST {path}: HTTP {resp.status}: {text[:200]!r}")
        finally:
            conn.close()

    def __repr__(self) -> str:
        where = self.endpoint_url if self.port else "stopped"
        return f"MotoServer({where})"
