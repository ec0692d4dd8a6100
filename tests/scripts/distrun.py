"""Launch tests/scripts/dist_ckpt.py under torchrun (loopback, gloo, CPU) and read its events.

torchrun starts slowly (each rank imports torch), so the tests launch few jobs and check
many things per launch. The expensive one, the 2-rank ``main`` scenario followed by the
1-process ``load1`` scenario, runs once per pytest session: ``main_run`` caches it, and
both tests/test_distributed.py and tests/test_dcp.py assert on it.

Every launch binds only 127.0.0.1. On any failure or timeout the launcher and its ranks
(pids from their ``start`` events) are killed, so no rank outlives the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("dist_ckpt.py")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Launch:
    """One job: ``torchrun --nproc_per_node=N`` (or a plain process when ``nproc`` is None)."""

    def __init__(
        self,
        scenario: str,
        url: str,
        work: Path,
        storage_options: dict[str, Any],
        *,
        nproc: int | None = 2,
        extra: tuple[str, ...] = (),
        script: Path = SCRIPT,
    ) -> None:
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        args = [str(script), "--scenario", scenario, "--url", url, "--work", str(work), *extra]
        if nproc is None:
            cmd = [sys.executable, *args]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1",
                f"--master_port={free_port()}",
                "--max-restarts=0",
                *args,
            ]
        env = dict(os.environ)
        env.update(
            CLOUDCKPT_TEST_STORAGE_OPTIONS=json.dumps(storage_options),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            MASTER_ADDR="127.0.0.1",
        )
        self.log_path = work / "launch.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    def events(self, rank: int, kind: str | None = None) -> list[dict[str, Any]]:
        try:
            lines = (self.work / f"events-{rank}.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        records = []
        for line in lines:
            with contextlib.suppress(ValueError):  # a line being written
                records.append(json.loads(line))
        return [r for r in records if kind is None or r["event"] == kind]

    def one(self, rank: int, kind: str, **match: Any) -> dict[str, Any]:
        found = [e for e in self.events(rank, kind) if all(e.get(k) == v for k, v in match.items())]
        assert len(found) == 1, f"rank {rank}: {kind} {match}: {found}\n{self.log_tail()}"
        return found[0]

    def wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"the job exited before {what}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"timed out waiting for {what}:\n{self.log_tail()}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"the job did not finish in {timeout}s:\n{self.log_tail()}"
            ) from None
        finally:
            self._log.close()

    def kill(self) -> None:
        """SIGKILL the launcher and every rank it started (by pid)."""
        pids = [self.proc.pid]
        for rank in range(8):
            pids += [e["pid"] for e in self.events(rank, "start")]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def log_tail(self, limit: int = 8000) -> str:
        text = ""
        with contextlib.suppress(OSError):
            text = self.log_path.read_bytes()[-limit:].decode("utf-8", "replace")
        for rank in range(3):
            text += f"\n--- events of rank {rank} ---\n"
            text += "\n".join(json.dumps(e)[:600] for e in self.events(rank))
        return text


_cache: dict[str, Any] = {}


def main_run(moto_server: Any, tmp_path_factory: Any) -> dict[str, Any]:
    """The 2-rank ``main`` job, then the 1-process ``load1`` job and the 3-rank ``load3``
    job, once per session."""
    if "main" in _cache:
        if isinstance(_cache["main"], BaseException):
            raise _cache["main"]
        return _cache["main"]
    bucket = f"dist-{os.urandom(4).hex()}"
    moto_server.create_bucket(bucket)
    url, options = f"s3://{bucket}/run", moto_server.storage_options()
    work = tmp_path_factory.mktemp("dist-main")
    try:
        main = Launch("main", url, work / "main", options)
        rc = main.wait(150)
        assert rc == 0, f"the 2-rank job failed ({rc}):\n{main.log_tail()}"
        load1 = Launch("load1", url, work / "load1", options, nproc=None)
        rc = load1.wait(90)
        assert rc == 0, f"the 1-process job failed ({rc}):\n{load1.log_tail()}"
        load3 = Launch("load3", url, work / "load3", options, nproc=3)
        rc = load3.wait(120)
        assert rc == 0, f"the 3-rank job failed ({rc}):\n{load3.log_tail()}"
    except BaseException as exc:
        _cache["main"] = exc
        raise
    _cache["main"] = {
        "url": url,
        "options": options,
        "main": main,
        "load1": load1,
        "load3": load3,
    }
    return _cache["main"]
