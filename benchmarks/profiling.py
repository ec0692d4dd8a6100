"""``--profile DIR``: a profile of the first measured run of every cloudckpt contender
(py-spy when installed, else pyinstrument) and a summary of where its samples are."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Contender, Group


def start_profile(profile_dir: Path | None, group: Group, c: Contender) -> Any:
    """Profile the first measured run of every cloudckpt contender: py-spy (all threads,
    native waits excluded) on this process and on the local servers when py-spy is
    installed, else pyinstrument (main thread only)."""
    if profile_dir is None or not c.cloudckpt:
        return None
    profile_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{group.name}--{c.name.replace(' ', '_').replace('(', '').replace(')', '')}"
    pyspy = shutil.which("py-spy")
    if pyspy:
        procs = []
        targets = {"client": os.getpid(), **group.servers}
        for who, pid in targets.items():
            if pid is None:
                continue
            out = profile_dir / f"{stem}--{who}.collapsed"
            cmd = [pyspy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw"]
            cmd += ["--output", str(out), "--nonblocking"]
            procs.append(
                (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)
            )
        time.sleep(0.5)  # let py-spy attach
        return ("py-spy", procs)
    try:
        import pyinstrument
    except ImportError:
        return None
    p = pyinstrument.Profiler(interval=0.002, async_mode="disabled")
    p.start()
    return ("pyinstrument", (p, profile_dir / f"{stem}.txt"))


def stop_profile(profiler: Any) -> None:
    if profiler is None:
        return
    kind, state = profiler
    if kind == "pyinstrument":
        p, path = state
        p.stop()
        path.write_text(p.output_text(unicode=False, color=False))
        return
    for proc, out in state:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if out.exists():
            out.with_suffix(".top.txt").write_text(_top_frames(out))


def _top_frames(collapsed: Path, n: int = 30) -> str:
    """Where the samples of a py-spy raw profile are: own time per frame, and inclusive
    time for the cloudckpt/botocore/urllib3 frames."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + k
        for f in set(frames):
            incl[f] = incl.get(f, 0) + k
    out = [f"{total} samples (active threads only; 250 Hz)", "", "own time:"]
    for f, k in sorted(own.items(), key=lambda x: -x[1])[:n]:
        out.append(f"{100 * k / max(total, 1):6.1f}%  {f}")
    out += ["", "inclusive (cloudckpt, botocore, s3transfer, urllib3, http):"]
    keep = ("cloudckpt", "botocore", "s3transfer", "urllib3", "http/", "s3fs", "gcsfs")
    ranked = [(f, k) for f, k in incl.items() if any(x in f for x in keep)]
    for f, k in sorted(ranked, key=lambda x: -x[1])[:n]:
        out.append(f"{100 * k / max(total, 1):6.1f}%  {f}")
    return "\n".join(out) + "\n"
