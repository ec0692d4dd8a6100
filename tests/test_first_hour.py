"""A user's first hour (issue 32 items 8-11): what the CLI says, read from the real
``cloudckpt`` command (the virtualenv's entry point, as the README installs it) against a
real moto S3 server on 127.0.0.1 or a local directory, and what the Python API says.

- pushing twice from one host names no fenced writer (the earlier push has exited); a
  writer that may still be running is named;
- ``push`` without ``--step`` reads it from the directory's name, and says so;
- the CLI's hints are in the CLI's words (``--force``, ``--keep-period 1h:1d``), Python's in
  Python's (``overwrite=True``);
- the smaller ones: ``ls`` of a missing run names the runs beside it, one unknown-step
  message everywhere, the Azure extra's message names a real package, ``abfss://`` URLs keep
  their container, ``gc_grace`` is checked when the manager is built, and saving an older
  step after a resume warns in Python too.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cloudckpt import CheckpointManager
from cloudckpt.cli._step_name import step_from_name
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    DestinationNotEmptyError,
    redact_url,
)

ENTRY_POINT = Path(sys.executable).parent / "cloudckpt"
KEYS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


def cloudckpt(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The installed ``cloudckpt`` command in its own process."""
    return subprocess.run(
        [str(ENTRY_POINT), *map(str, args)],
        env={**os.environ, **KEYS, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def make_checkpoint(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    (path / "model.bin").write_bytes(os.urandom(4096) + step.to_bytes(4, "big"))
    (path / "state.json").write_text(json.dumps({"step": step}))
    return path


@pytest.fixture
def s3_run(s3_target, moto_server):
    """An empty run on moto, and the flags that reach it."""
    return s3_target.url, ("--endpoint-url", moto_server.endpoint_url)


# --- item 8: fencing is news only when the fenced writer may still run ---------------------


def test_a_second_push_from_this_host_names_no_fenced_writer(s3_run, tmp_path):
    url, flags = s3_run
    first = cloudckpt("push", make_checkpoint(tmp_path / "a", 1), url, "--step", 1, *flags)
    assert first.returncode == 0, first.stderr
    second = cloudckpt(
        "push", make_checkpoint(tmp_path / "b", 2), url, "--step", 2, "--json", *flags
    )
    assert second.returncode == 0, second.stderr
    assert "fenced" not in second.stderr, second.stderr
    doc = json.loads(second.stdout)
    assert doc["fenced_writer"]["exited"] is True and doc["epoch"] == 2


_LIVE_WRITER = """
import sys, time
from cloudckpt import CheckpointManager
mgr = CheckpointManager(sys.argv[1], storage_options={"endpoint_url": sys.argv[2]},
                        staging_dir=sys.argv[3])
with mgr.save(1) as d:
    (d / "w.bin").write_bytes(b"x" * 100)
mgr.wait()
print(mgr.writer_id, flush=True)
time.sleep(120)
"""


def test_a_push_that_fences_a_running_trainer_names_it(s3_run, tmp_path, moto_server):
    url, flags = s3_run
    trainer = subprocess.Popen(
        [sys.executable, "-c", _LIVE_WRITER, url, moto_server.endpoint_url, tmp_path / "st"],
        env={**os.environ, **KEYS},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        writer_id = trainer.stdout.readline().strip()
        assert writer_id, "the trainer did not commit"
        pushed = cloudckpt("push", make_checkpoint(tmp_path / "b", 2), url, "--step", 2,
                           "--force", *flags)  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        assert f"writer {writer_id} (epoch 1) is fenced from now on" in pushed.stderr
    finally:
        trainer.kill()
        trainer.wait()


# --- item 11: push reads the step from the directory's name --------------------------------


@pytest.mark.parametrize(
    "name, step",
    [("checkpoint-500", 500), ("global_step500", 500), ("step_500", 500),
     ("epoch=3-step=500", 500), ("step-7", 7), ("run1-step_20", 20)],
)  # fmt: skip
def test_step_names_the_trainers_write(name, step):
    assert step_from_name(name) == step


@pytest.mark.parametrize("name", ["weights", "checkpoint_5", "laststep5", "v2"])
def test_names_without_a_step_are_refused(name):
    with pytest.raises(ConfigurationError, match="cannot tell the step") as exc:
        step_from_name(name)
    assert "--step" in exc.value.hint


def test_push_without_step_reads_it_and_says_so(s3_run, tmp_path):
    url, flags = s3_run
    src = make_checkpoint(tmp_path / "checkpoint-500", 500)
    pushed = cloudckpt("push", src, url, "--json", *flags)
    assert pushed.returncode == 0, pushed.stderr
    assert "step 500, read from the directory name 'checkpoint-500'" in pushed.stderr
    doc = json.loads(pushed.stdout)
    assert doc["step"] == 500 and doc["step_from"] == "checkpoint-500"
    # A DeepSpeed directory, given as "." from inside it.
    ds = make_checkpoint(tmp_path / "global_step700", 700)
    pushed = subprocess.run(
        [str(ENTRY_POINT), "push", ".", url, *flags],
        cwd=ds, env={**os.environ, **KEYS}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    listed = json.loads(cloudckpt("ls", url, "--json", *flags).stdout)
    assert [c["step"] for c in listed["checkpoints"]] == [700, 500]


@pytest.mark.parametrize(
    "name, says", [("weights", "cannot tell the step"), ("checkpoint-500-step_600", "ambiguous")]
)
def test_push_without_step_refuses_a_name_with_none_or_two(s3_run, tmp_path, name, says):
    url, flags = s3_run
    refused = cloudckpt("push", make_checkpoint(tmp_path / name, 1), url, *flags)
    assert refused.returncode == 2, refused.stderr
    assert says in refused.stderr and "--step N" in refused.stderr
    # Nothing was claimed or written.
    assert json.loads(cloudckpt("ls", url, "--json", *flags).stdout)["writer"] is None


# --- item 9: hints in the caller's words ---------------------------------------------------


def test_cli_hints_name_flags_and_python_hints_name_arguments(s3_run, tmp_path):
    url, flags = s3_run
    pushed = cloudckpt("push", make_checkpoint(tmp_path / "step_1", 1), url, *flags)
    assert pushed.returncode == 0, pushed.stderr

    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    refused = cloudckpt("restore", url, full, *flags)
    assert refused.returncode == 7, refused.stderr
    assert "--force" in refused.stderr and "overwrite=True" not in refused.stderr

    got = cloudckpt("get", url, "state.json", full / "keep.txt", *flags)
    assert got.returncode == 7, got.stderr
    assert "--force" in got.stderr and "overwrite=True" not in got.stderr

    bad = cloudckpt("push", make_checkpoint(tmp_path / "step_2", 2), url, "--keep-period",
                    "1d:1h", *flags)  # fmt: skip
    assert bad.returncode == 2, bad.stderr
    assert "--keep-period 1h:1d" in bad.stderr and "keep_periods=" not in bad.stderr

    # The same mistake in Python is told in Python's words.
    options = {"endpoint_url": flags[1], "key": "testing", "secret": "testing"}
    mgr = CheckpointManager(url, storage_options=options, staging_dir=tmp_path / "st")
    with mgr, pytest.raises(DestinationNotEmptyError) as exc:
        mgr.restore(full)
    assert "overwrite=True" in str(exc.value) and "--force" not in str(exc.value)
    with pytest.raises(ConfigurationError) as exc:
        CheckpointManager(url, storage_options=options, keep_periods=[("1d", "1h")])
    assert '("1h", "1d")' in str(exc.value) and "--keep-period" not in str(exc.value)


# --- item 10: the smaller ones -------------------------------------------------------------


def test_ls_of_a_missing_run_names_the_runs_beside_it(s3_run, tmp_path):
    url, flags = s3_run
    for name, step in (("exp42", 1), ("exp43", 2)):
        pushed = cloudckpt("push", make_checkpoint(tmp_path / name, step), f"{url}/{name}",
                           "--step", step, *flags)  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
    listed = cloudckpt("ls", f"{url}/exp24", *flags)
    assert listed.returncode == 0, listed.stderr  # an empty listing, as before
    assert "no checkpoints" in listed.stderr
    beside = listed.stderr.split("runs beside it: ", 1)[1].split(" (did you mean")[0]
    assert sorted(beside.split(", ")) == [f"{url}/exp42", f"{url}/exp43"]


def test_every_command_says_the_same_for_an_unknown_step(s3_run, tmp_path):
    url, flags = s3_run
    for step in (10, 20):
        pushed = cloudckpt("push", make_checkpoint(tmp_path / f"s{step}", step), url,
                           "--step", step, *flags)  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
    expected = f"{url}/ retains no checkpoint of step 15"
    for command in (
        ("show", url, "--step", 15),
        ("restore", url, tmp_path / "out", "--step", 15),
        ("get", url, "state.json", tmp_path / "x", "--step", 15),
        ("pin", url, 15),
        ("unpin", url, 15),
        ("export", url, f"file://{tmp_path}/exported", "--step", 15),
    ):
        result = cloudckpt(*command, *flags)
        assert result.returncode == 3, (command, result.stderr)
        assert expected in result.stderr, (command, result.stderr)
        assert "Retained steps: 20, 10" in result.stderr, (command, result.stderr)


def test_the_azure_extra_names_a_package_that_exists(tmp_path):
    # An environment without the Azure SDK: an `azure` namespace with nothing in it.
    (tmp_path / "azure").mkdir()
    (tmp_path / "azure" / "__init__.py").write_text("")
    listed = cloudckpt(
        "ls",
        "az://ckpts/run",
        env={
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])
            )
        },
    )
    assert listed.returncode == 2, listed.stderr
    assert "'azure-storage-blob' package" in listed.stderr, listed.stderr
    assert "'azure' package" not in listed.stderr


@pytest.mark.parametrize(
    "url, shown",
    [
        ("abfss://ckpts@acct.dfs.core.windows.net/run", "abfss://ckpts@acct.dfs.core.windows.net/run"),
        ("abfss://ckpts:s3cret@acct.dfs.core.windows.net/run", "abfss://***@acct.dfs.core.windows.net/run"),
        ("az://ckpts@acct/run", "az://ckpts@acct/run"),
        ("http://user:pw@host/run", "http://***@host/run"),
        ("s3://user@bucket/run", "s3://***@bucket/run"),
    ],
)  # fmt: skip
def test_abfss_urls_keep_their_container(url, shown):
    assert redact_url(url) == shown


def test_gc_grace_too_short_is_refused_when_the_manager_is_built(s3_target, tmp_path):
    """S3's clock counts whole seconds: a grace of 1 s leaves no time to commit. Refused
    when the manager is built, not at its first save."""
    url, options = s3_target.url, s3_target.storage_options
    with pytest.raises(ConfigurationError, match="gc_grace=1s is too short"):
        CheckpointManager(url, storage_options=options, gc_grace=1, staging_dir=tmp_path / "a")
    with CheckpointManager(
        url, storage_options=options, gc_grace=60, staging_dir=tmp_path / "b"
    ) as mgr:
        with mgr.save(1) as d:
            (d / "w.bin").write_bytes(b"x")
        mgr.wait()


def test_saving_an_older_step_after_resume_warns_in_python(tmp_path, caplog):
    url = f"file://{tmp_path}/run"
    with CheckpointManager(url, staging_dir=tmp_path / "a") as mgr:
        with mgr.save(500) as d:
            (d / "w.bin").write_bytes(b"x")
        mgr.wait()
    with CheckpointManager(url, staging_dir=tmp_path / "b") as mgr:
        mgr.resume(tmp_path / "restored")
        with caplog.at_level(logging.WARNING, logger="cloudckpt"):
            with mgr.save(100) as d:
                (d / "w.bin").write_bytes(b"y")
            mgr.wait()
            assert "step 100 is older than the run's current step 500" in caplog.text
            caplog.clear()
            with mgr.save(600) as d:
                (d / "w.bin").write_bytes(b"z")
            mgr.wait()
        assert "older than" not in caplog.text


def test_unknown_step_in_python_names_the_run_and_the_retained_steps(tmp_path):
    url = f"file://{tmp_path}/run"
    with CheckpointManager(url, staging_dir=tmp_path / "a") as mgr:
        for step in (1, 2):
            with mgr.save(step) as d:
                (d / "w.bin").write_bytes(b"x")
        mgr.wait()
        with pytest.raises(CheckpointNotFoundError) as exc:
            mgr.restore(tmp_path / "out", step=7)
    assert f"{mgr.url} retains no checkpoint of step 7" in str(exc.value)
    assert "Retained steps: 2, 1" in str(exc.value)


def test_an_exited_writer_is_fenced_without_a_warning_in_process(tmp_path):
    """The rule behind the second push's silence, in this process (the mutant's guard): a
    writer of this host whose process is gone is fenced silently; one still running is
    named."""
    from click.testing import CliRunner

    from cloudckpt.cli import cli

    url = f"file://{tmp_path}/run"
    saved = subprocess.run(
        [sys.executable, "-c", _EXITED_WRITER, url, str(tmp_path / "st")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    pushed = CliRunner().invoke(
        cli, ["push", str(make_checkpoint(tmp_path / "b", 2)), url, "--step", "2"]
    )
    assert pushed.exit_code == 0, pushed.output
    assert "fenced" not in pushed.stderr
    # This process (still running) now owns the run: fencing it is news.
    again = CliRunner().invoke(
        cli, ["push", str(make_checkpoint(tmp_path / "c", 3)), url, "--step", "3", "--force"]
    )
    assert again.exit_code == 0, again.output
    assert "is fenced from now on" in again.stderr


_EXITED_WRITER = """
import sys
from cloudckpt import CheckpointManager
with CheckpointManager(sys.argv[1], staging_dir=sys.argv[2]) as mgr:
    with mgr.save(1) as d:
        (d / "w.bin").write_bytes(b"x")
"""
