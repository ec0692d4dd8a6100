"""One group's run: its contenders in rotating order, quiet between measurements, each
measurement's wall time and CPU seconds (ours and the local servers'); the group's JSON
record with medians and per-round ratios."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import GiB, Group
from benchmarks.machine import proc_cpu, quiesce
from benchmarks.profiling import start_profile, stop_profile


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_group(group: Group, pairs: int, warmup: int, profile_dir: Path | None) -> dict[str, Any]:
    """Run the contenders in rotating order; return the group's JSON record."""
    names = [c.name for c in group.contenders]
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    total_rounds = warmup + pairs
    print(f"\n== {group.title}", flush=True)
    for r in range(total_rounds):
        measured = r >= warmup
        k = r % len(group.contenders)
        order = group.contenders[k:] + group.contenders[:k]
        line = []
        for c in order:
            quiesce(list(group.servers.values()))
            cpu0 = time.process_time()
            srv0 = {s: proc_cpu(pid) for s, pid in group.servers.items()}
            profiler = start_profile(profile_dir, group, c) if r == warmup else None
            t0 = time.perf_counter()
            metrics = c.run(r) or {}
            wall = time.perf_counter() - t0
            stop_profile(profiler)
            metrics.setdefault("s", wall)
            metrics["cpu_client_s"] = time.process_time() - cpu0
            for s, pid in group.servers.items():
                metrics[f"cpu_{s}_s"] = proc_cpu(pid) - srv0[s]
            if c.after is not None:
                c.after(r)
            if measured:
                for m, v in metrics.items():
                    samples[c.name].setdefault(m, []).append(v)
            line.append(f"{c.name} {metrics['s']:.2f}s")
        tag = f"round {r - warmup + 1}/{pairs}" if measured else "warm-up"
        print(f"   {tag}: " + ", ".join(line), flush=True)

    contenders = {}
    for c in group.contenders:
        m = samples[c.name]
        rec: dict[str, Any] = {
            "cloudckpt": c.cloudckpt,
            "metrics": {k: {"median": _median(v), "samples": v} for k, v in m.items()},
        }
        if c.note:
            rec["note"] = c.note
        s = _median(m.get("s", []))
        if group.nbytes and s > 0:
            rec["gib_per_s"] = group.nbytes / GiB / s
        if group.nbytes and m.get("cpu_client_s"):
            # Client CPU-seconds per GiB moved (copy, hashing, upload, all threads): what a
            # training host's data loaders lose to the checkpoint (issue 24 item 7).
            rec["cpu_client_s_per_gib"] = _median(m["cpu_client_s"]) / (group.nbytes / GiB)
        contenders[c.name] = rec
    comparisons = []
    for cmp in group.comparisons:
        a = samples[cmp.cloudckpt].get(cmp.metric, [])
        b = samples[cmp.baseline].get(cmp.metric, [])
        ratios = [y / x for x, y in zip(a, b, strict=False) if x > 0]
        speedup = _median(ratios)
        comparisons.append(
            {
                "metric": cmp.metric,
                "label": cmp.label or cmp.metric,
                "cloudckpt": cmp.cloudckpt,
                "baseline": cmp.baseline,
                "cloudckpt_median_s": _median(a),
                "baseline_median_s": _median(b),
                "speedup": speedup,
                "speedups": ratios,
                "target": cmp.target,
                "met": None if cmp.target is None else bool(speedup >= cmp.target),
            }
        )
    return {
        "name": group.name,
        "title": group.title,
        "bytes": group.nbytes,
        "pairs": pairs,
        "warmup": warmup,
        "contenders": contenders,
        "comparisons": comparisons,
        **group.info,
    }
