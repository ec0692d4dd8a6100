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
from cloudckpt.cli._table import metrics_summary, short_bytes

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


HF_METADATA = {  # what the HF callback records, plus the metrics of an evaluation
    "framework": "transformers",
    "checkpoint_dir": "checkpoint-1200000",
    "output_dir": "/data/runs/some-rather-long-experiment-name/output",
    "global_step": 1200000,
    "emergency": False,
    "epoch": 2.5,
    "loss": 1.2345678,
    "metrics": {"eval_loss": 0.312345, "eval_accuracy": 0.91234, "eval_runtime": 12.5},
}


@pytest.fixture(scope="module")
def listed_run(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    """A file:// run with three checkpoints (HF-like metadata, a plain one, a pinned one
    with a note). Returns (url, ``ls --json``'s checkpoints)."""
    root = tmp_path_factory.mktemp("ls")
    url = f"file://{root}/run"
    src = root / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"m" * 1_300_000)
    (src / "config.json").write_text("{}")
    pushes = [
        (1_100_000, ["-m", "note=a baseline run with a fairly long description"]),
        (1_150_000, []),
        (1_200_000, [a for k, v in HF_METADATA.items() for a in ("-m", f"{k}:={json.dumps(v)}")]),
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
    # One line per checkpoint: the header, 2 lines of table heading, the rows.
    assert len(lines) == 2 + 2 + len(checkpoints), text
    for c in checkpoints:
        row = _row(lines, c["step"])
        status = (["current"] if c["current"] else []) + [f"pin:{p}" for p in c["pins"]]
        for word in [*status, "ago", short_bytes(c["total_bytes"]), f" {c['num_files']} "]:
            assert word in row, (word, row)
        assert c["commit_id"] not in row  # the wide layout's
    top = _row(lines, 1_200_000)
    # Metrics first (LATEST stores metadata with sorted keys), no bookkeeping.
    assert "  eval_accuracy=0.9123 eval_loss=0.3" in top, top
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
        assert len(lines) == 4 + len(checkpoints), text
        for c in checkpoints:
            row = _row(lines, c["step"])
            assert c["commit_id"] in row and c["committed_at"][:16].replace("T", " ") in row
        top = _row(lines, 1_200_000)
        assert metrics_summary(checkpoints[0]["metadata"]) in top, top  # whole, not cut
    # A pipe with COLUMNS set gets that width.
    _assert_compact(cloudckpt("ls", url, COLUMNS="80").stdout, 80, checkpoints)


def test_metrics_summary_puts_metrics_first_and_leaves_out_bookkeeping():
    assert metrics_summary(HF_METADATA) == (
        "eval_loss=0.3123 eval_accuracy=0.9123 eval_runtime=12.5 epoch=2.5 loss=1.235"
    )
    assert metrics_summary({"emergency": True, "nested": {"a": 1}, "tags": [1]}) == (
        "emergency nested={…} tags=[…]"
    )
    assert metrics_summary({"watch": {"source": "checkpoint-5", "kind": "hf"}}) == ""
    long = metrics_summary({"note": "x" * 40})
    assert long == "note=" + "x" * 23 + "…"


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
