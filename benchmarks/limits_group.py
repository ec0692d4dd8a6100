"""The ``limits`` group: this machine's physical limits (``benchmarks/limits.py``), run like
any group; the others' figures are set against them (``report.apply_limits``)."""

from __future__ import annotations

from benchmarks.bench import Bench
from benchmarks.harness import Contender, Group, MiB
from benchmarks.limits import Limits
from benchmarks.rounds import run_group


def limits_group(bench: Bench, mib: int) -> None:
    lim = Limits(mib * MiB, bench.work / "limits")
    try:
        group = Group(
            name="limits",
            title=f"physical limits of this machine, {mib} MiB each (no comparisons)",
            nbytes=mib * MiB,
            contenders=[Contender(n, fn, after) for n, fn, after in lim.contenders()],
            comparisons=[],
            servers={"sink": lim.server.pid},
        )
        bench.limits = run_group(group, bench.args.pairs, bench.args.warmup, None)
        bench.record()
    finally:
        lim.close()
