"""Retention by metric and by time through the command line, against moto (S3): ``push
--metric`` and the retention flags, ``watch`` recording what a Trainer logged, and the
``metrics``/``settings`` fields of ``ls --json`` and ``show --json``."""

from __future__ import annotations

import json
import re

import pytest
from test_cli import ok_json, run


def _push(tmp_path, url, step, *args, target):
    src = tmp_path / f"ck{step}"
    src.mkdir(exist_ok=True)
    (src / "model.bin").write_bytes(b"weights %d" % step)
    return run("push", src, url, "--step", step, "--force", "--json", *args, target=target)


def test_push_records_metrics_and_keeps_the_best(s3_target, tmp_path):
    url, t = s3_target.url, s3_target
    first = ok_json(_push(tmp_path, url, 1, "--metric", "eval_loss=0.5", "--metric", "acc=0.7",
                          "--keep-last", "1", "--keep-best", "1", "--best-metric", "eval_loss",
                          target=t))  # fmt: skip
    assert first["metrics"] == {"eval_loss": 0.5, "acc": 0.7}
    # Later pushes name no retention: the run's stays. NaN is recorded, never best.
    for step, loss in [(2, "0.2"), (3, "nan"), (4, "0.4"), (5, "-inf")]:
        ok_json(_push(tmp_path, url, step, "--metric", f"eval_loss={loss}", target=t))
    listing = ok_json(run("ls", url, "--json", target=t))
    assert [c["step"] for c in listing["checkpoints"]] == [5, 2]
    assert [c["metrics"] for c in listing["checkpoints"]] == [
        {"eval_loss": "-inf"},
        {"eval_loss": 0.2},
    ]
    assert listing["settings"] == {
        "keep_last": 1, "keep_every": None, "gc_grace_s": 7200, "keep_best": 1,
        "best_metric": "eval_loss", "best_mode": "min", "keep_periods": [],
    }  # fmt: skip
    shown = ok_json(run("show", url, "--step", 2, "--json", target=t))
    assert shown["metrics"] == {"eval_loss": 0.2}
    assert "eval_loss=0.2" in run("show", url, "--step", 2, target=t).stdout

    # --keep-best 0 stops keeping by metric; --keep-period keeps one per period.
    ok_json(_push(tmp_path, url, 6, "--keep-best", "0", "--keep-period", "1h:1d", target=t))
    settings = ok_json(run("ls", url, "--json", target=t))["settings"]
    assert settings["keep_best"] is None and settings["best_metric"] is None
    assert settings["keep_periods"] == [{"period_s": 3600, "window_s": 86400}]
    ok_json(_push(tmp_path, url, 7, "--keep-period", "none", target=t))
    assert ok_json(run("ls", url, "--json", target=t))["settings"]["keep_periods"] == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--keep-best", "2"], "--best-metric"),
        (["--best-metric", "loss"], "--keep-best"),
        (["--metric", "loss=low"], "not a number"),
        (["--metric", "loss"], "NAME=VALUE"),
        (["--keep-period", "1h:30m"], "shorter than the period"),
        (["--keep-period", "1h"], "(period, window)"),
        (["--keep-period", "none", "--keep-period", "1h:1d"], "'none'"),
    ],
)
def test_bad_retention_flags_exit_2_before_touching_the_store(tmp_path, args, says):
    result = _push(tmp_path, f"file://{tmp_path}/run", 1, *args, target=None)
    assert result.exit_code == 2, result.output
    assert says in result.output
    # In the CLI's words, never the Python API's (issue 32 item 9).
    python_names = r"\b(keep_best|best_metric|best_mode|keep_periods|keep_last|keep_every)\b"
    assert not re.search(python_names, result.output), result.output
    assert not (tmp_path / "run").exists()


def test_watch_records_what_the_trainer_logged_and_keeps_the_best(s3_target, tmp_path):
    out = tmp_path / "out"
    losses = {3: 0.4, 6: 0.1, 9: 0.3, 12: 0.5}
    history = []
    for step, loss in losses.items():
        history += [{"loss": 2.0, "step": step},
                    {"eval_loss": loss, "eval_runtime": 0.1, "epoch": 1.0, "step": step}]  # fmt: skip
        d = out / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"m%d" % step)
        (d / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    result = run("watch", out, s3_target.url, "--once", "--json", "--keep-last", "1",
                 "--keep-best", "1", "--best-metric", "eval_loss", target=s3_target)  # fmt: skip
    assert result.exit_code == 0, result.output
    listing = ok_json(run("ls", s3_target.url, "--json", target=s3_target))
    assert [(c["step"], c["metrics"]) for c in listing["checkpoints"]] == [
        (12, {"eval_loss": 0.5, "eval_runtime": 0.1}),
        (6, {"eval_loss": 0.1, "eval_runtime": 0.1}),
    ]


def test_a_mistyped_best_metric_is_reported_by_push_watch_ls_and_verify(s3_target, tmp_path):
    """``--best-metric eval_los`` while the checkpoints record ``eval_loss``: push warns
    at the first save, and ls and verify say it (stderr and --json ``warnings``), naming
    what the checkpoints record; verify's exit status stays 0 (it is not damage)."""
    url, t = s3_target.url, s3_target
    first = _push(tmp_path, url, 1, "--metric", "eval_loss=0.3", "--keep-best", "1",
                  "--best-metric", "eval_los", target=t)  # fmt: skip
    assert first.exit_code == 0, first.output
    assert "keep-best ranks checkpoints by 'eval_los'" in first.stderr
    assert "did you mean 'eval_loss'?" in first.stderr
    assert first.stderr.count("keep-best ranks") == 1
    listing = ok_json(run("ls", url, "--json", target=t))
    (warning,) = listing["warnings"]
    assert "'eval_los'" in warning and "(eval_loss)" in warning
    table = run("ls", url, target=t)
    assert table.exit_code == 0 and "keep-best ranks checkpoints by 'eval_los'" in table.stderr
    assert "keep_best 1 by eval_los (min)" in table.stdout  # the header names the rule
    verified = ok_json(run("verify", url, "--json", target=t))
    assert verified["ok"] is True and verified["warnings"] == [warning]
    human = run("verify", url, target=t)
    assert human.exit_code == 0 and "warning: keep-best ranks" in human.stdout
    # The right name: no warning anywhere.
    ok_json(_push(tmp_path, url, 2, "--metric", "eval_loss=0.2", "--keep-best", "1",
                  "--best-metric", "eval_loss", target=t))  # fmt: skip
    assert ok_json(run("ls", url, "--json", target=t))["warnings"] == []


def test_watch_warns_when_the_trainer_logs_no_metric_of_that_name(s3_target, tmp_path):
    out = tmp_path / "out"
    d = out / "checkpoint-3"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"m")
    history = [{"eval_loss": 0.4, "eval_runtime": 0.1, "step": 3}]
    (d / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    result = run("watch", out, s3_target.url, "--once", "--keep-best", "1",
                 "--best-metric", "eval_los", target=s3_target)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "keep-best ranks checkpoints by 'eval_los', but step 3 records metrics" in result.stderr
    assert "(eval_loss, eval_runtime)" in result.stderr
