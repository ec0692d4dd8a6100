"""Every guard of a safety rule fails when its rule is broken (issue 21, item 7).

For each mutant in ``tests/mutants.py`` (one rule broken the way a plausible bug would):
its fast tests are run in a fresh pytest process with the mutant applied and must all
fail, and, where the rule can be reached there, the simulation must report a violation
within the mutant's seed range. docs/reliability.md ("Mutation check") has the table.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from mutants import MUTANTS, applied

from cloudckpt.testing import simulation

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_fast_guards_fail_under_the_mutant(name, tmp_path):
    mutant = MUTANTS[name]
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         f"--junitxml={report}", *mutant.guards],
        cwd=ROOT,
        env={**os.environ, "CLOUDCKPT_MUTANT": name},
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = {
        f"{c.get('classname')}::{c.get('name')}": "failed"
        if c.find("failure") is not None or c.find("error") is not None
        else "skipped"
        if c.find("skipped") is not None
        else "passed"
        for c in cases
    }
    assert outcomes, proc.stdout[-2000:] + proc.stderr[-2000:]
    survivors = [t for t, outcome in outcomes.items() if outcome != "failed"]
    assert not survivors, f"{name} ({mutant.rule}): these guards did not notice: {survivors}"


@pytest.mark.parametrize("name", sorted(n for n, m in MUTANTS.items() if m.seeds is not None))
def test_the_simulation_catches_the_mutant(name):
    with applied(name) as mutant:
        for seed in mutant.seeds:
            found = [v for v in simulation.run_seed(seed).violations if mutant.violation in v]
            if found:
                return
    pytest.fail(
        f"no seed in {mutant.seeds} showed a violation with {mutant.violation!r} under {name}"
        f" ({mutant.rule}); find seeds that do: python tools/mutation_scan.py {name}"
    )


def test_every_mutant_is_simulated_or_says_why_not():
    for mutant in MUTANTS.values():
        assert (mutant.seeds is None) != (not mutant.why_not_simulated), mutant.name
