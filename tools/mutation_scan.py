"""Find the simulation seeds that catch one mutant of tests/mutants.py.

    python tools/mutation_scan.py gc-forgets-pending-tombstones --seeds 0:1000

Prints each seed whose run reports a violation under the mutant (stops after --hits).
Use it to set a mutant's ``seeds`` when the simulation's traces change.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import mutants

from cloudckpt.testing import simulation


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutant", choices=sorted(mutants.MUTANTS))
    parser.add_argument("--seeds", default="0:400", help="A:B")
    parser.add_argument("--hits", type=int, default=5, help="stop after this many")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    first, last = (int(x) for x in args.seeds.split(":"))
    started, hits = time.perf_counter(), []
    with mutants.applied(args.mutant):
        for seed in range(first, last):
            result = simulation.run_seed(seed)
            if result.violations:
                hits.append(seed)
                print(f"seed {seed}: {result.violations[0][:200]}", flush=True)
                if len(hits) >= args.hits:
                    break
    print(f"{args.mutant}: {len(hits)} seed(s) {hits} in {time.perf_counter() - started:.0f} s")
    return 0 if hits else 1


if __name__ == "__main__":
    sys.exit(main())
