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


# A guard that hangs under its mutant is stopped by the inner run's own pytest-timeout (so
# its stacks are printed and it counts as failed), well before this test's own limit.
GUARD_TIMEOUT_S = 180


@pytest.mark.timeout(GUARD_TIMEOUT_S + 240)
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_fast_guards_fail_under_the_mutant(name, tmp_path):
    mutant = MUTANTS[name]
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         f"--timeout={GUARD_TIMEOUT_S}", f"--junitxml={report}", *mutant.guards],
        cwd=ROOT,
        env={**os.environ, "CLOUDCKPT_MUTANT": name},
        capture_output=True,
        text=True,
        timeout=GUARD_TIMEOUT_S + 200,
    )  # fmt: skip
    # No report: the run never started its tests (a mutant patching a name that is gone,
    # a guard that no longer exists). Say so with what pytest printed.
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
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


def test_the_reliability_table_has_one_row_per_mutant_and_states_the_score():
    """docs/reliability.md's table is the list users read: exactly the mutants here, and
    the score line counts them (each is caught: the tests above fail otherwise)."""
    import re

    doc = (ROOT / "docs" / "reliability.md").read_text()
    section = doc[doc.index("## Mutation check") : doc.index("## Figures of the last runs")]
    rows = re.findall(r"^\| `([^`]+)`", section, re.M)
    assert sorted(rows) == sorted(MUTANTS), set(rows) ^ set(MUTANTS)
    simulated = sum(1 for m in MUTANTS.values() if m.seeds is not None)
    score = f"**Mutation score: {len(MUTANTS)} of {len(MUTANTS)} mutants caught**"
    assert score in section and f"{simulated} of them also by the simulation" in section
