"""Run a training script as a child process and follow its JSON-lines event file.

Used by the HF and Lightning integration tests: the child can be SIGKILLed or sent SIGTERM
at a chosen moment, and its events (losses, saves, the end) are read back afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def read_events(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written
            continue
    return [r for r in records if kind is None or r.get("event") == kind]


class ChildRun:
    def __init__(
        self,
        script: Path,
        args: Sequence[str],
        events: Path,
        log: Path,
        storage_options: Mapping[str, Any] | None = None,
        launcher: Sequence[str] = (),
    ) -> None:
        self.events_path = events
        self.log_path = log
        env = dict(os.environ)
        env.update(
            CLOUDCKPT_TEST_STORAGE_OPTIONS=json.dumps(dict(storage_options or {})),
            OMP_NUM_THREADS="1",  # tests run several children at once on small machines
            MKL_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            CLOUDCKPT_PREEMPTION_SOURCES="signal",
            PYTHONUNBUFFERED="1",
        )
        self._log = open(log, "wb")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, str(script), "--events", str(events), *args],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def events(self, kind: str | None = None, path: Path | None = None) -> list[dict[str, Any]]:
        """Records of the events file (or another file the child writes), by kind."""
        return read_events(path or self.events_path, kind)

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the child exited ({self.proc.returncode}) before {what}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.log_tail()}")
            time.sleep(0.05)

    def signal_when(
        self, condition: Callable[[], bool], sig: int, timeout: float
    ) -> threading.Thread:
        """Send ``sig`` from a background thread once ``condition()`` holds."""

        def run() -> None:
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                if condition():
                    self.proc.send_signal(sig)
                    return
                time.sleep(0.05)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"the child did not finish in {timeout}s:\n{self.log_tail()}"
            ) from None
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, limit: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-limit:].decode("utf-8", "replace")
        except OSError:
            return ""
