"""The command line: ``python -m cloudckpt.testing.simulation --seed N`` (replay one seed)
or ``--seeds A:B --jobs J`` (a soak); prints a JSON summary, exits 1 on any violation."""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cloudckpt.testing.simulation.result import DEFAULT_STEPS, SimResult
from cloudckpt.testing.simulation.runner import quiet, run_seeds, summarize


def _parse_seeds(text: str) -> list[int]:
    if ":" in text:
        a, b = text.split(":", 1)
        return list(range(int(a), int(b)))
    return [int(s) for s in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cloudckpt.testing.simulation",
        description="Seeded deterministic simulation of the cloudckpt commit protocol.",
    )
    parser.add_argument("--seed", type=int, help="replay one seed (prints its trace tail)")
    parser.add_argument("--seeds", default="0:300", help="a range A:B or a list a,b,c")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="scheduler ticks")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--json", help="write the summary as JSON to this file")
    parser.add_argument(
        "--verbose", action="store_true", help="print every seed, and cloudckpt's warnings"
    )
    args = parser.parse_args(argv)
    quiet(30 if args.verbose else 50)
    seeds = [args.seed] if args.seed is not None else _parse_seeds(args.seeds)
    started = time.perf_counter()
    done: collections.Counter[str] = collections.Counter()

    def progress(r: SimResult) -> None:
        done["seeds"] += 1
        done["violations"] += len(r.violations)
        if done["seeds"] % 500 == 0 and len(seeds) > 500:
            print(
                f"{done['seeds']}/{len(seeds)} seeds, {done['violations']} violations, "
                f"{time.perf_counter() - started:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    results = run_seeds(seeds, args.steps, args.jobs, progress)
    for r in results:
        if args.verbose or not r.ok or args.seed is not None:
            print(r.report())
            if args.seed is not None:
                print(f"  trace digest {r.trace_digest}")
                print(f"  counters {dict(sorted(r.counters.items()))}")
                print(f"  faults {dict(sorted(r.faults.items()))}")
    summary = summarize(results)
    summary["wall_seconds"] = round(time.perf_counter() - started, 1)
    summary["steps_per_seed"] = args.steps
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if summary["violations"] else 0
