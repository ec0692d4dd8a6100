"""What a run prints and writes: the limits table, a table per group, the summary of
ratios, and the JSON record (``--json``, rewritten after every group)."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench import Bench
from benchmarks.machine import QUIET, machine_info
from benchmarks.peers import find_s5cmd

SCHEMA = "cloudckpt.bench/1"


def apply_limits(results: list[dict[str, Any]], limits: dict[str, Any] | None) -> None:
    """Each contender's GiB/s as a fraction of its group's limit (``info["limit"]``)."""
    if not limits:
        return
    rates = {n: c.get("gib_per_s") for n, c in limits["contenders"].items()}
    for g in results:
        limit = rates.get(g.get("limit", ""))
        if not limit:
            continue
        g["limit_gib_per_s"] = limit
        for c in g["contenders"].values():
            if c.get("gib_per_s"):
                c["fraction_of_limit"] = c["gib_per_s"] / limit


def limits_table(limits: dict[str, Any] | None) -> str:
    if not limits:
        return ""
    lines = [limits["title"], f"  {'limit':<28} {'median s':>9} {'GiB/s':>6} {'s per GiB':>9}"]
    for name, c in limits["contenders"].items():
        s = c["metrics"]["s"]["median"]
        gib = c.get("gib_per_s") or float("nan")
        lines.append(f"  {name:<28} {_fmt_s(s):>9} {gib:>6.2f} {1 / gib:>9.3f}")
    return "\n".join(lines)


def _fmt_s(x: float) -> str:
    return "-" if x != x else (f"{x:.3f}" if x < 1 else f"{x:.2f}")


def table(results: list[dict[str, Any]]) -> str:
    lines = []
    for g in results:
        lines.append("")
        lines.append(g["title"])
        lines.append(
            f"  {'contender':<32} {'median s':>9} {'GiB/s':>6} {'of limit':>8} {'cpu client':>10} "
            f"{'cpu/GiB':>8} {'cpu server':>10}   other medians"
        )
        if g.get("limit_gib_per_s"):
            lines[-2] += f"  [limit: {g['limit']}, {g['limit_gib_per_s']:.2f} GiB/s]"
        for name, c in g["contenders"].items():
            m = c["metrics"]
            other = ", ".join(
                f"{k} {_fmt_s(v['median'])}"
                for k, v in m.items()
                if k not in ("s",) and not k.startswith("cpu_")
            )
            gib = c.get("gib_per_s")
            frac = c.get("fraction_of_limit")
            lines.append(
                f"  {name:<32} {_fmt_s(m['s']['median']):>9} "
                f"{'' if gib is None else f'{gib:.2f}':>6} "
                f"{'' if frac is None else f'{frac:.0%}':>8} "
                f"{_fmt_s(m['cpu_client_s']['median']):>10} "
                f"{_fmt_s(c.get('cpu_client_s_per_gib', float('nan'))):>8} "
                f"{_fmt_s(m.get('cpu_server_s', {}).get('median', float('nan'))):>10}   {other}"
            )
        for cmp in g["comparisons"]:
            target = "" if cmp["target"] is None else f"target >= {cmp['target']:g}x"
            met = {True: "MET", False: "NOT MET", None: ""}[cmp["met"]]
            who = "" if cmp["cloudckpt"] == "cloudckpt" else f" [{cmp['cloudckpt']}]"
            lines.append(
                f"  -> {cmp['label']}{who}: {cmp['baseline']} / cloudckpt = "
                f"{cmp['speedup']:.2f}x  ({_fmt_s(cmp['baseline_median_s'])} s vs "
                f"{_fmt_s(cmp['cloudckpt_median_s'])} s)  {target} {met}".rstrip()
            )
    return "\n".join(lines)


def summary(results: list[dict[str, Any]]) -> str:
    rows = [
        f"{'group':<14} {'comparison':<58} {'ratio':>7} {'target':>8}  met  "
        f"{'cloudckpt':>9} {'peer':>5}  (fraction of the limit)",
    ]
    for g in results:
        for cmp in g["comparisons"]:
            label = f"{cmp['label']} vs {cmp['baseline']}"
            if cmp["label"].startswith(("stall", "save-to")):
                label = cmp["label"]
            sig = g.get("signing")
            name = g["name"] + (f"/{sig[0]}" if sig and g["name"] != "torch" else "")
            target = "" if cmp["target"] is None else f">={cmp['target']:g}x"
            met = {True: "yes", False: "NO", None: "-"}[cmp["met"]]
            fr = [
                g["contenders"][who].get("fraction_of_limit")
                for who in (cmp["cloudckpt"], cmp["baseline"])
            ]
            lim = "  ".join(f"{'' if f is None else f'{f:.0%}':>5}" for f in fr)
            rows.append(
                f"{name:<14} {label[:58]:<58} {cmp['speedup']:>6.2f}x {target:>8}  {met:<3}  "
                f"    {lim}".rstrip()
            )
    return "\n".join(rows)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    mods = ("cloudckpt", "torch", "boto3", "botocore", "s3transfer", "s3fs", "gcsfs")
    for mod in (*mods, "awscrt", "obstore", "s3torchconnector", "safetensors"):
        with contextlib.suppress(Exception):
            out[mod] = __import__(mod).__version__
    with contextlib.suppress(Exception):
        exe = find_s5cmd()
        if exe:
            out["s5cmd"] = subprocess.run(
                [exe, "version"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
    return out


def write_json(
    args: argparse.Namespace,
    argv: list[str] | None,
    signings: list[str],
    started: float,
    bench: Bench,
    *,
    partial: bool,
) -> dict[str, Any]:
    """Write the results so far to ``args.json`` (after every group, so a killed run keeps
    what it measured; ``partial`` says the run had not finished)."""
    apply_limits(bench.results, bench.limits)
    doc = {
        "schema": SCHEMA,
        "command": " ".join(
            ["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])]
        ),
        "started_at": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(),
        "duration_s": time.time() - started,
        "quick": args.quick,
        "partial": partial,
        "config": {
            "pairs": args.pairs,
            "warmup": args.warmup,
            "mib": args.mib,
            "files": args.files,
            "state_mib": args.state_mib,
            "tensors": args.tensors,
            "gcs_mib": args.gcs_mib,
            "moto_mib": args.moto_mib,
            "signing": signings,
            "s3_url": args.s3_url,
            "gcs_url": args.gcs_url,
            "hogs": args.hogs,
            "peers": args.peers,
            "limits_mib": args.limits_mib,
            "dcp_mib": args.dcp_mib,
            "scale_mib": args.scale_mib,
            "dlio_hidden": args.dlio_hidden,
            "dlio_layers": args.dlio_layers,
            "dlio_ranks": args.dlio_ranks,
        },
        "machine": machine_info(),
        "idle_wait": {
            "enabled": QUIET.enabled,
            "waited_s": round(QUIET.waited_s, 1),
            "measurements_started_busy": QUIET.busy_starts,
        },
        "versions": _versions(),
        "limits": bench.limits,
        "groups": bench.results,
    }
    Path(args.json).write_text(json.dumps(doc, indent=2, allow_nan=True) + "\n")
    return doc
