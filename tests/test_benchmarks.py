"""The benchmark command works end to end (issue 7). No timing assertions: CI machines are
noisy; this proves the one command runs every group against real servers and writes the
JSON the docs describe."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_quick_benchmark_runs_every_group_and_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out),
         "--workdir", str(tmp_path / "work"), "--groups", "limits,torch,s3,gcs,moto"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "cloudckpt.bench/1" and doc["quick"] is True
    assert doc["partial"] is False
    names = [g["name"] for g in doc["groups"]]
    for expected in ("torch", "torch-restore", "torch-resume", "s3-upload", "s3-restore",
                     "gcs-upload", "gcs-restore", "moto-upload", "moto-restore"):  # fmt: skip
        assert expected in names, names
    assert names.count("s3-upload") == 2, "one upload group per payload-signing setting"
    for group in doc["groups"]:
        assert group["contenders"], group["name"]
        for name, contender in group["contenders"].items():
            median = contender["metrics"]["s"]["median"]
            assert math.isfinite(median) and median > 0, (group["name"], name)
        assert group["comparisons"], group["name"]
        for cmp in group["comparisons"]:
            assert cmp["baseline"] in group["contenders"]
            assert math.isfinite(cmp["speedup"]) and cmp["speedup"] > 0
    # The table and the summary of ratios reach the terminal.
    assert " / cloudckpt = " in proc.stdout and "ratio" in proc.stdout


@pytest.mark.timeout(300)
def test_quick_dcp_benchmark_loads_at_2_and_3_ranks(tmp_path):
    """The dcp group (issue 23): torchrun jobs save with 2 ranks, load with 2 and with 3
    through both readers; every rank checks what it loaded."""
    out = tmp_path / "dcp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out),
         "--workdir", str(tmp_path / "work"), "--groups", "dcp"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    groups = {g["name"]: g for g in doc["groups"]}
    assert sorted(groups) == ["dcp-load-2", "dcp-load-3"]
    for group in groups.values():
        assert set(group["contenders"]) == {"cloudckpt CloudStorageReader", "DCP S3StorageReader"}
        (cmp,) = group["comparisons"]
        assert math.isfinite(cmp["speedup"]) and cmp["speedup"] > 0


@pytest.mark.timeout(300)
def test_quick_incremental_benchmark_runs_and_writes_its_json(tmp_path):
    """python -m benchmarks.incremental --quick (issue 15): every scenario and mode runs."""
    try:
        import peft  # noqa: F401
    except ImportError:  # CI installs [test], which brings it: never a silent skip
        pytest.fail("peft is not installed (pip install -e '.[test]')", pytrace=False)
    out = tmp_path / "inc.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.incremental", "--quick", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "cloudckpt.bench-incremental/1" and doc["quick"] is True
    for name in ("lora", "full"):
        scenario = doc["scenarios"][name]
        for mode in ("off", "fixed", "tensor"):
            assert scenario[mode]["later_saves_bytes_uploaded"] > 0
            assert math.isfinite(scenario[mode]["median_seconds_later_saves"])
    assert doc["scenarios"]["two-runs"]["B_first_save_ratio"] > 0
    assert "(a) LoRA" in proc.stdout and "(b) full" in proc.stdout
