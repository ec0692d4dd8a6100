"""Azurite's blob service (Microsoft's Azure Storage emulator, npm ``azurite``) in a separate
OS process, for tests and probes.

::

    from cloudckpt.testing.azurite_server import AzuriteServer

    with AzuriteServer() as server:
        server.create_container("demo")
        store = open_store("az://demo/run", server.storage_options())

Only the blob service runs (``azurite-blob``), bound to 127.0.0.1 on a port the kernel
picks (``--blobPort 0``; the server prints the one it got), with in-memory persistence
(nothing on disk), telemetry off, ``--skipApiVersionCheck`` (the Python SDK may be newer
than the emulator) and ``--loose`` (unsupported headers are ignored rather than refused).
Clients use the well-known development account ``devstoreaccount1`` through a connection
string. The binary comes from ``.ci/node`` (``npm ci --prefix .ci/node --ignore-scripts``,
which ``.ci/run`` does), else ``$CLOUDCKPT_AZURITE_BINARY``, else ``azurite-blob`` on
``PATH``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "ACCOUNT_KEY",
    "ACCOUNT_NAME",
    "AzuriteServer",
    "AzuriteServerError",
    "azurite_binary",
]

#: Azurite's built-in development account: public, documented test credentials.
ACCOUNT_NAME = "devstoreaccount1"
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

_REPO_NODE_BIN = Path(__file__).resolve().parents[2] / ".ci" / "node" / "node_modules" / ".bin"
_LISTENING = re.compile(rb"successfully listens on https?://[^:\s]+:(\d+)")


class AzuriteServerError(RuntimeError):
    """Azurite could not be started (not installed, died, or never answered)."""


def azurite_binary() -> Path:
    """Path of ``azurite-blob``: ``$CLOUDCKPT_AZURITE_BINARY``, else the repository's
    ``.ci/node/node_modules/.bin/azurite-blob``, else ``azurite-blob`` on ``PATH``.

    Raises AzuriteServerError saying how to install it.
    """
    explicit = os.environ.get("CLOUDCKPT_AZURITE_BINARY")
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise AzuriteServerError(
                f"CLOUDCKPT_AZURITE_BINARY={explicit!r} is not an executable file; point it "
                "at Azurite's azurite-blob or unset it"
            )
        return path
    candidate = _REPO_NODE_BIN / "azurite-blob"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("azurite-blob")
    if found:
        return Path(found)
    # In a source checkout, install the pinned version on first use, as the other test
    # servers come from the test extra: the README's test command then works on a fresh
    # clone with only node and npm on the machine.
    if _install_pinned_azurite() and candidate.is_file():
        return candidate
    raise AzuriteServerError(
        "Azurite's azurite-blob was not found. Install the pinned version with: "
        "npm ci --prefix .ci/node --ignore-scripts (needs node and npm), or set "
        "CLOUDCKPT_AZURITE_BINARY to an azurite-blob executable"
    )


def _install_pinned_azurite(timeout: float = 600.0) -> bool:
    """``npm ci`` the repository's pinned Azurite into ``.ci/node``; False when there is no
    lock file (not a source checkout) or no npm. Raises AzuriteServerError if npm fails."""
    node_dir = _REPO_NODE_BIN.parents[1]
    npm = shutil.which("npm")
    if npm is None or not (node_dir / "package-lock.json").is_file():
        return False
    import fcntl

    # One installer at a time (several test processes may start Azurite at once).
    with open(node_dir / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (_REPO_NODE_BIN / "azurite-blob").is_file():
            return True
        cmd = [npm, "ci", "--prefix", str(node_dir), "--ignore-scripts", "--no-audit", "--no-fund"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise AzuriteServerError(f"{' '.join(cmd)} took over {timeout:.0f} s") from exc
        if proc.returncode != 0:
            raise AzuriteServerError(
                f"installing the pinned Azurite failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}"
            )
    return True


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: SIGKILL the server when the thread that started it dies (even by SIGKILL)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


class AzuriteServer:
    """``azurite-blob`` on a free 127.0.0.1 port. Use as a context manager, or call
    ``start()`` and ``stop()``.

    Args:
        startup_timeout: seconds to wait until the blob service answers.
        memory_limit_mb: cap of Azurite's in-memory blob storage (``--extentMemoryLimit``).
        extra_args: more ``azurite-blob`` flags, appended last.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        *,
        startup_timeout: float = 60.0,
        memory_limit_mb: int = 2048,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.startup_timeout = startup_timeout
        self.memory_limit_mb = memory_limit_mb
        self.extra_args = tuple(extra_args)
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._service: Any = None

    # --- lifecycle ------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def blob_endpoint(self) -> str:
        """``http://127.0.0.1:<port>/devstoreaccount1`` (Azurite's path-style account URL)."""
        if self.port is None:
            raise AzuriteServerError("the Azurite server is not running; call start() first")
        return f"http://{self.host}:{self.port}/{ACCOUNT_NAME}"

    @property
    def connection_string(self) -> str:
        """A connection string for the development account on this server."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT_NAME};"
            f"AccountKey={ACCOUNT_KEY};BlobEndpoint={self.blob_endpoint};"
        )

    def start(self) -> AzuriteServer:
        """Start the server and wait until it answers. Raises AzuriteServerError."""
        if self.running:
            return self
        binary = azurite_binary()
        self._dir = Path(tempfile.mkdtemp(prefix="cloudckpt-azurite-"))
        cmd = [
            str(binary),
            "--blobHost",
            self.host,
            "--blobPort",
            "0",
            "--inMemoryPersistence",
            "--extentMemoryLimit",
            str(self.memory_limit_mb),
            "--skipApiVersionCheck",
            "--loose",
            "--disableTelemetry",
            *self.extra_args,
        ]
        # Azurite reads AZURITE_ACCOUNTS to replace the development account; ours must stay.
        env = {k: v for k, v in os.environ.items() if k != "AZURITE_ACCOUNTS"}
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=self._dir,
            env=env,
            start_new_session=True,  # a Ctrl-C reaches us, and we stop it
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self._log = bytearray()
        found = threading.Event()
        reader = threading.Thread(target=self._read_output, args=(found,), daemon=True)
        reader.start()
        deadline = time.monotonic() + self.startup_timeout
        while not found.wait(0.05):
            if self._proc.poll() is not None:
                reader.join(timeout=2)
                code, log = self._proc.returncode, self.log_tail()
                self._cleanup()
                raise AzuriteServerError(f"azurite-blob exited with code {code}. Output:\n{log}")
            if time.monotonic() > deadline:
                log = self.log_tail()
                self.stop()
                raise AzuriteServerError(
                    f"Azurite did not listen within {self.startup_timeout:.0f}s. Output:\n{log}"
                )
        self._wait_until_ready(deadline)
        return self

    def _read_output(self, found: threading.Event) -> None:
        """Collect the server's output (keeping the pipe drained); note the port."""
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._log += line
            del self._log[:-20000]
            m = _LISTENING.search(line)
            if m and not found.is_set():
                self.port = int(m[1])
                found.set()

    def _wait_until_ready(self, deadline: float) -> None:
        from azure.core.exceptions import AzureError

        service = self.service_client()
        try:
            while True:
                try:
                    next(iter(service.list_containers(results_per_page=1)), None)
                    return
                except AzureError:
                    if time.monotonic() > deadline:
                        log = self.log_tail()
                        self.stop()
                        raise AzuriteServerError(
                            f"Azurite listens but does not answer. Output:\n{log}"
                        ) from None
                    time.sleep(0.1)
        finally:
            service.close()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and remove its directory."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._cleanup()

    def _cleanup(self) -> None:
        if self._service is not None:
            self._service.close()
            self._service = None
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None
        self.port = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> AzuriteServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(timeout=5)

    # --- helpers --------------------------------------------------------------------

    def storage_options(self) -> dict[str, Any]:
        """adlfs-style options that point cloudckpt at this server."""
        return {"connection_string": self.connection_string}

    def service_client(self, **kwargs: Any) -> Any:
        """A plain ``BlobServiceClient`` for this server (no retries unless asked)."""
        from azure.storage.blob import BlobServiceClient

        kwargs.setdefault("retry_total", 0)
        return BlobServiceClient.from_connection_string(self.connection_string, **kwargs)

    def create_container(self, name: str) -> None:
        """Create container ``name`` (3-63 lowercase letters, digits and hyphens)."""
        if self._service is None:
            self._service = self.service_client()
        self._service.create_container(name)

    def log_tail(self, limit: int = 4000) -> str:
        """The last ``limit`` bytes of the server's output."""
        return bytes(getattr(self, "_log", b"")[-limit:]).decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"AzuriteServer({self.blob_endpoint if self.port else 'stopped'})"
