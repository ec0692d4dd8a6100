"""Running seeds: one (``run_seed``), many in worker processes (``run_seeds``), and the
summary of their results (``summarize``)."""

from __future__ import annotations

import collections
import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any

from cloudckpt.stores.base import Store
from cloudckpt.testing.simulation.result import DEFAULT_STEPS, SimResult
from cloudckpt.testing.simulation.world import Simulation


def run_seed(
    seed: int, steps: int = DEFAULT_STEPS, mutate: Callable[[Store], Store] | None = None
) -> SimResult:
    """Run one seed and return its result (never raises for a violation)."""
    return Simulation(seed, steps, mutate=mutate).run()


def quiet(level: int = 50) -> None:
    """The simulated faults make cloudckpt chatty: show only ``level`` and above."""
    import logging

    logging.basicConfig(level=level)


def run_seeds(
    seeds: Sequence[int],
    steps: int = DEFAULT_STEPS,
    jobs: int = 1,
    progress: Callable[[SimResult], None] | None = None,
) -> list[SimResult]:
    """Run many seeds (in ``jobs`` processes); results in seed order."""
    if jobs <= 1:
        results = []
        for s in seeds:
            results.append(run_seed(s, steps))
            if progress:
                progress(results[-1])
        return results
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=quiet) as pool:
        results = []
        for r in pool.map(run_seed, seeds, [steps] * len(seeds), chunksize=8):
            results.append(r)
            if progress:
                progress(r)
        return results


def summarize(results: Sequence[SimResult]) -> dict[str, Any]:
    counters: collections.Counter = collections.Counter()
    faults: collections.Counter = collections.Counter()
    for r in results:
        counters.update(r.counters)
        faults.update(r.faults)
    return {
        "seeds": len(results),
        "ticks": sum(r.ticks for r in results),
        "violations": sum(len(r.violations) for r in results),
        "failed_seeds": [r.seed for r in results if not r.ok],
        "faults_injected": dict(sorted(faults.items())),
        "crashes": counters["crashes"],
        "counters": dict(sorted(counters.items())),
        "cpu_seconds": round(sum(r.seconds for r in results), 1),
    }
