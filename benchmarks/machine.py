"""The machine the benchmarks run on: CPU seconds per process, the wait for an idle machine
between measurements (``QUIET``), the ``--hogs`` beside the run, and what the machine is
(for the JSON record)."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def proc_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its threads."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine_busy_s(pids: list[int | None], window: float) -> float:
    """CPU seconds per second used during ``window`` by processes other than ours."""

    def total() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

    def ours() -> float:
        return time.process_time() + sum(proc_cpu(p) for p in pids)

    t0, o0 = total(), ours()
    time.sleep(window)
    return max(0.0, (total() - t0) - (ours() - o0)) / window


class _Quiet:
    """Waits, between measurements, until other processes leave the CPUs alone (a shared
    CI or dev machine otherwise makes single measurements meaningless); counts the
    measurements that had to start on a busy machine."""

    def __init__(self, enabled: bool, max_wait: float = 120.0, threshold: float = 0.15):
        self.enabled, self.max_wait, self.threshold = enabled, max_wait, threshold
        self.waited_s = 0.0
        self.busy_starts = 0
        self.exclude: list[int] = []

    def wait(self, pids: list[int | None]) -> None:
        if not self.enabled or not os.path.exists("/proc/stat"):
            return
        pids = [*pids, *self.exclude]
        started = time.monotonic()
        while _machine_busy_s(pids, 0.5) > self.threshold * (os.cpu_count() or 1):
            if time.monotonic() - started > self.max_wait:
                self.busy_starts += 1
                break
            time.sleep(1.0)
        self.waited_s += time.monotonic() - started


QUIET = _Quiet(enabled=True)


def start_hogs(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` busy CPU hogs beside the benchmark (``--hogs``): a training job's data loaders
    or a noisy neighbour. Their CPU time does not count as "busy" for the idle wait."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]


def stop_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    for h in hogs:
        h.kill()
        h.wait()


def quiesce(pids: list[int | None] = ()) -> None:
    """Between measurements: flush dirty pages (one contender's writeback must not slow
    the next one), collect garbage, wait for other processes to leave the CPUs idle."""
    gc.collect()
    os.sync()
    QUIET.wait(list(pids))


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    with contextlib.suppress(OSError, ValueError, IndexError):
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu"] = next(x for x in cpuinfo if x.startswith("model name")).split(":")[1].strip()
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        total = next(x for x in meminfo if x.startswith("MemTotal"))
        info["mem_gib"] = round(int(total.split()[1]) / 2**20, 1)
    return info
