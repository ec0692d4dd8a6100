"""What a person reads (issue 25 item 7): ``ls`` as a table that fits an 80-column terminal,
one line per checkpoint, with metrics; the help naming every URL scheme; shell completion
that works in a real bash.

The table is read from a real ``cloudckpt`` process on a real pseudo-terminal of a set
size (what a user's terminal is), and through a pipe (what ``grep`` gets)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cloudckpt.cli import cli
from cloudckpt.cli._table import kept_because, metrics_summary, short_bytes

BIN = Path(sys.executable).parent
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return {**env, "TERM": "xterm-256color", **more}


def cloudckpt(*args: Any, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(**env),
    )


def in_terminal(args: list[str], columns: int) -> str:
    """``cloudckpt ARGS``' stdout on a pseudo-terminal ``columns`` wide, ANSI removed."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cloudckpt.cli", *args],
        stdin=slave,
        stdout=slave,
        stderr=subprocess.DEVNULL,
        env=_env(),
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    return _ANSI.sub("", b"".join(chunks).decode()).replace("\r\n", "\n")


HF_METADATA = {  # what the HF callback records as metadata
    "framework": "transformers",
    "checkpoint_dir": "checkpoint-1200000",
    "output_dir": "/data/runs/some-rather-long-experiment-name/output",
    "global_step": 1200000,
    "emergency": False,
    "epoch": 2.5,
    "loss": 1.2345678,
}
#: The metrics of an evaluation, recorded as metrics (``--metric``: the record's own field).
HF_METRICS = {"eval_loss": 0.312345, "eval_accuracy": 0.91234, "eval_runtime": 12.5}


@pytest.fixture(scope="module")
def listed_run(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    """A file:// run with three checkpoints (HF-like metadata and metrics, kept as the best
    by eval_loss; a plain one; a pinned one with a note). Returns (url, ``ls --json``'s
    checkpoints)."""
    root = tmp_path_factory.mktemp("ls")
    url = f"file://{root}/run"
    src = root / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"m" * 1_300_000)
    (src / "config.json").write_text("{}")
    hf = [a for k, v in HF_METADATA.items() for a in ("-m", f"{k}:={json.dumps(v)}")]
    hf += [a for k, v in HF_METRICS.items() for a in ("--metric", f"{k}={v}")]
    pushes = [
        (1_100_000, ["-m", "note=a baseline run with a fairly long description"]),
        (1_150_000, []),
        (1_200_000, [*hf, "--keep-best", "1", "--best-metric", "eval_loss"]),
    ]
    for step, meta in pushes:
        done = cloudckpt("push", src, url, "--step", step, *meta, "--force")
        assert done.returncode == 0, done.stderr
    assert cloudckpt("pin", url, 1_100_000, "--label", "best").returncode == 0
    listing = json.loads(cloudckpt("ls", url, "--json").stdout)["checkpoints"]
    return url, listing


def _row(lines: list[str], step: int) -> str:
    (row,) = [line for line in lines if re.match(rf"\s*{step}\s", line)]
    return row


def _assert_compact(text: str, columns: int, checkpoints: list[dict[str, Any]]) -> None:
    lines = text.rstrip("\n").split("\n")
    assert max(len(line) for line in lines) <= columns, text
    # One line per checkpoint: the header (3 lines: run, writer, every retention setting),
    # 2 lines of table heading, the rows.
    assert lines[2] == "retention: keep_last 3 · keep_best 1 by eval_loss (min) · gc_grace 2h"
    assert len(lines) == 3 + 2 + len(checkpoints), text
    for c in checkpoints:
        row = _row(lines, c["step"])
        status = (["current"] if c["current"] else []) + [f"pin:{p}" for p in c["pins"]]
        for word in [*status, "ago", short_bytes(c["total_bytes"]), f" {c['num_files']} "]:
            assert word in row, (word, row)
        assert c["commit_id"] not in row  # the wide layout's
    top = _row(lines, 1_200_000)
    # Metrics first (the record's own field: sorted names), no bookkeeping.
    assert re.search(r"\s{2}eval_accuracy=0\.9", top), top
    assert "framework" not in top and "output_dir" not in top


def test_ls_fits_an_80_column_terminal_one_line_per_checkpoint(listed_run):
    url, checkpoints = listed_run
    text = in_terminal(["ls", url], 80)
    _assert_compact(text, 80, checkpoints)
    assert "…" in _row(text.split("\n"), 1_200_000)  # only the metrics gave way


def test_ls_on_a_wide_terminal_and_through_a_pipe_shows_every_column(listed_run):
    url, checkpoints = listed_run
    for text, columns in ((in_terminal(["ls", url], 200), 200), (cloudckpt("ls", url).stdout, 200)):
        lines = text.rstrip("\n").split("\n")
        assert max(len(line) for line in lines) <= columns, text
        assert len(lines) == 5 + len(checkpoints), text
        for c in checkpoints:
            row = _row(lines, c["step"])
            assert c["commit_id"] in row and c["committed_at"][:16].replace("T", " ") in row
            assert kept_because(c) in row  # whole, not cut
        top = _row(lines, 1_200_000)
        summary = metrics_summary(checkpoints[0]["metrics"], checkpoints[0]["metadata"])
        assert summary[:50] in top, top  # the metrics column gives way last
    # Wider, the metadata is whole too.
    assert summary in _row(cloudckpt("ls", url, COLUMNS="260").stdout.splitlines(), 1_200_000)
    # A pipe with COLUMNS set gets that width.
    _assert_compact(cloudckpt("ls", url, COLUMNS="80").stdout, 80, checkpoints)


def test_metrics_summary_puts_metrics_first_and_leaves_out_bookkeeping():
    assert metrics_summary(HF_METRICS, HF_METADATA) == (
        "eval_loss=0.3123 eval_accuracy=0.9123 eval_runtime=12.5 epoch=2.5 loss=1.235"
    )
    # A run that recorded them in metadata (before metrics had a field of their own).
    legacy = {"metrics": {"eval_loss": 0.3, "acc": 0.9}, "note": "n"}
    assert metrics_summary({"eval_loss": 0.2}, legacy) == "eval_loss=0.2 acc=0.9 note=n"
    assert metrics_summary({}, {"emergency": True, "nested": {"a": 1}, "tags": [1]}) == (
        "emergency nested={…} tags=[…]"
    )
    assert metrics_summary({}, {"watch": {"source": "checkpoint-5", "kind": "hf"}}) == ""
    long = metrics_summary({}, {"note": "x" * 40})
    assert long == "note=" + "x" * 23 + "…"


def test_ls_shows_the_metrics_recorded_each_documented_way_and_why_each_is_kept(
    s3_target, tmp_path
):
    """Metrics recorded by ``push --metric``, ``save(..., metrics=)`` and ``watch`` (from
    ``trainer_state.json``) live in the record's own field: ``ls`` shows them (the table
    and ``--json``), and says why retention keeps each checkpoint, from the rules the
    commits applied."""
    from cloudckpt import CheckpointManager

    url, so = s3_target.url, s3_target.storage_options
    flags = ["--endpoint-url", so["endpoint_url"], "-o", f"key={so['key']}",
             "-o", f"secret={so['secret']}"]  # fmt: skip
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w" * 1000)
    pushed = cloudckpt("push", src, url, "--step", 100, "--metric", "eval_loss=0.25",
                       "--keep-last", 1, "--keep-best", 1, "--best-metric", "eval_loss", *flags)  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    mgr = CheckpointManager(url, storage_options=so, staging_dir=tmp_path / "st")
    with mgr.save(200, metrics={"eval_loss": 0.5, "acc": 0.75}) as d:
        (d / "w.bin").write_bytes(b"v" * 1000)
    mgr.close()
    out = tmp_path / "out" / "checkpoint-300"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"m" * 1000)
    history = [{"eval_loss": 0.125, "step": 300}]
    (out / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    watched = cloudckpt("watch", out.parent, url, "--once", *flags)
    assert watched.returncode == 0, watched.stderr

    doc = json.loads(cloudckpt("ls", url, "--json", *flags).stdout)
    assert [(c["step"], c["metrics"], c["kept_because"]) for c in doc["checkpoints"]] == [
        (300, {"eval_loss": 0.125}, ["current", "last 1", "best by eval_loss"]),
    ]  # keep_last 1 and the best is the newest: 100 and 200 were dropped
    assert [t["step"] for t in doc["tombstones"]] == [200, 100]
    # Each way, shown in the table (a pipe: every column).
    src2 = tmp_path / "src2"
    src2.mkdir()
    (src2 / "w.bin").write_bytes(b"x" * 1000)
    for step, loss in ((400, "0.75"), (500, "0.875")):
        done = cloudckpt("push", src2, url, "--step", step, "--metric", f"eval_loss={loss}",
                         "--keep-last", 2, "--force", *flags)  # fmt: skip
        assert done.returncode == 0, done.stderr
    table = cloudckpt("ls", url, *flags).stdout
    assert "retention: keep_last 2 · keep_best 1 by eval_loss (min) · gc_grace 2h" in table
    lines = table.splitlines()
    assert re.search(r"current, last\s.*eval_loss=0\.875", _row(lines, 500)), table
    assert re.search(r"\slast\s.*eval_loss=0\.75", _row(lines, 400)), table
    assert re.search(r"\sbest\s.*eval_loss=0\.125", _row(lines, 300)), table
    assert "watch=" not in table  # watch's own bookkeeping stays out


# --------------------------------------------------------------------------- help


def test_help_names_every_url_scheme_and_completion():
    text = CliRunner().invoke(cli, ["--help"]).output
    for scheme in ("s3://", "gs://", "az://", "abfs[s]://", "file://"):
        assert scheme in text, scheme
    assert "AZURE_STORAGE_CONNECTION_STRING" in text and "--profile" in text
    assert 'eval "$(_CLOUDCKPT_COMPLETE=bash_source cloudckpt)"' in text


def test_watch_help_says_json_lines():
    text = " ".join(CliRunner().invoke(cli, ["watch", "--help"]).output.split())
    assert "one JSON object per line" in text and "one JSON document" not in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion_script_completes_commands_and_choices(tmp_path):
    """The documented line, in a real bash: the script defines the completion, and it
    completes commands and an option's choices."""
    script = cloudckpt_completion("bash_source")
    assert "complete -o nosort -F _cloudckpt_completion cloudckpt" in script
    (tmp_path / "complete.bash").write_text(script)

    def complete(*words: str) -> list[str]:
        program = (
            f"source {tmp_path / 'complete.bash'}; COMP_WORDS=({' '.join(words)} ''); "
            f"COMP_CWORD={len(words)}; _cloudckpt_completion cloudckpt; "
            'printf "%s\\n" "${COMPREPLY[@]}"'
        )
        done = subprocess.run(
            ["bash", "-c", program], capture_output=True, text=True, env=_env(), timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert {"restore", "repair", "ls", "watch"} <= set(complete("cloudckpt"))
    assert complete("cloudckpt", "push", "--chunking") == ["tensor", "fixed", "off"]


def cloudckpt_completion(shell: str) -> str:
    done = subprocess.run(
        ["cloudckpt"],
        capture_output=True,
        text=True,
        env=_env(_CLOUDCKPT_COMPLETE=shell),
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout, done.stderr
    return done.stdout


def test_zsh_and_fish_completion_scripts_are_produced():
    assert "#compdef cloudckpt" in cloudckpt_completion("zsh_source")
    assert "complete --no-files --command cloudckpt" in cloudckpt_completion("fish_source")
