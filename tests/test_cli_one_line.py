"""Each event the CLI reports is one line in the CLI's own style (issue 32 item 10): a
checkpoint skipped as damaged, once, as ``warning: ...`` (not also as the library's
``cloudckpt: WARNING: ...``); transfer rates in MiB/s like the sizes beside them."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cloudckpt.cli import cli


def invoke(*args: Any) -> Any:
    """The CLI in this process (so that ``CLOUDCKPT_MUTANT`` reaches it): its result has
    ``exit_code``, ``stdout`` and ``stderr``."""
    return CliRunner().invoke(cli, [str(a) for a in args])


def cloudckpt(*args: Any) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture
def damaged_newest(tmp_path: Path) -> str:
    """A file:// run of steps 1 and 2 whose step 2 has a damaged chunk. Returns its URL."""
    url = f"file://{tmp_path}/run"
    src = tmp_path / "src"
    src.mkdir()
    for step in (1, 2):
        (src / "w.bin").write_bytes(bytes([step]) * 100_000)
        done = cloudckpt("push", src, url, "--step", step, "--force")
        assert done.returncode == 0, done.stderr
    (chunk,) = (tmp_path / "run" / "ckpt").glob("000000000002-*/chunks/*")
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    return url


def _lines_about_step_2(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "step 2" in line]


@pytest.mark.parametrize("as_json", [False, True])
def test_get_after_a_fallback_warns_once_in_the_clis_style(damaged_newest, tmp_path, as_json):
    dest = tmp_path / "out.bin"
    got = invoke("get", damaged_newest, "w.bin", dest, *(["--json"] if as_json else []))
    assert got.exit_code == 0, got.stderr
    assert dest.read_bytes() == bytes([1]) * 100_000
    (line,) = _lines_about_step_2(got.stderr)
    assert line.startswith("warning: skipping the checkpoint of step 2 ("), got.stderr
    assert "does not match its digest; trying step 1" in line
    assert "WARNING" not in got.stderr
    if as_json:
        (skipped,) = json.loads(got.stdout)["skipped"]
        assert skipped["step"] == 2 and not skipped["dropped"]


def test_restore_after_a_fallback_warns_once_too(damaged_newest, tmp_path):
    restored = invoke("restore", damaged_newest, tmp_path / "dest")
    assert restored.exit_code == 0, restored.stderr
    (line,) = _lines_about_step_2(restored.stderr)
    assert line.startswith("warning: skipping the checkpoint of step 2 ("), restored.stderr


def test_watch_reports_a_failed_upload_once_in_the_clis_style(tmp_path):
    """The library's error for a failed upload is the one line (the CLI used to add its
    own second line, in another style)."""
    url = f"file://{tmp_path}/run"
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w" * 1000)
    assert cloudckpt("push", src, url, "--step", 0).returncode == 0
    # The run's ckpt/ is a file now: writing step 1's attempt fails, for good.
    ckpt = tmp_path / "run" / "ckpt"
    for path in sorted(ckpt.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    ckpt.rmdir()
    ckpt.write_text("not a directory")
    watched = tmp_path / "out" / "checkpoint-1"
    watched.mkdir(parents=True)
    (watched / "model.safetensors").write_bytes(b"m" * 1000)
    (watched / "trainer_state.json").write_text("{}")
    done = invoke("watch", tmp_path / "out", url, "--once", "--settle", "0")
    assert done.exit_code == 1, done.stderr
    failed = [line for line in done.stderr.splitlines() if "upload of checkpoint-1 failed" in line]
    assert len(failed) == 1, done.stderr
    assert failed[0].startswith("error: upload of checkpoint-1 failed ("), done.stderr
    assert failed[0].endswith("; giving up on it"), done.stderr


def _stderr_on_a_terminal(*args: Any) -> str:
    """``cloudckpt ARGS``' stderr on a pseudo-terminal 300 columns wide (where progress
    bars are drawn), every frame of it, ANSI removed; stdout to a pipe."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 300, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cloudckpt.cli", *map(str, args)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**env, "TERM": "xterm-256color"},
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
    proc.communicate(timeout=120)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))


def test_progress_shows_sizes_and_rates_in_mib(tmp_path):
    """push's and restore's bars: ``12.0/38.1 MiB 153.4 MiB/s``, never MB/s."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(40_000_000))
    url = f"file://{tmp_path}/run"
    for args in (
        ("push", src, url, "--step", 1),
        ("restore", url, tmp_path / "dest"),
    ):
        frames = _stderr_on_a_terminal(*args)
        assert re.search(r"/38\.1 MiB", frames), (args, frames)
        assert re.search(r"\d [KMGT]iB/s", frames), (args, frames)
        assert not re.search(r"\b[kMG]B\b|[kMG]B/s", frames), (args, frames)


_FRAME = re.compile(r"[┃│┏┓┗┛┡┩╇┳┻━╭╮╰╯┌┐└┘├┤┼]")


def _heading(text: str) -> list[str]:
    """The words of a table's heading: the line above its rule of ``─``, the one style
    (``cloudckpt.cli._table.new_table``)."""
    lines = text.splitlines()
    (rule,) = [i for i, line in enumerate(lines) if line and set(line.strip()) == {"─"}]
    return lines[rule - 1].split()


def test_every_table_has_one_style_and_verify_names_every_column(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w" * 1000)
    url = f"file://{tmp_path}/runs/exp1"
    assert cloudckpt("push", src, url, "--step", 5).returncode == 0
    tables = {
        "ls": invoke("ls", url),
        "runs": invoke("runs", f"file://{tmp_path}/runs"),
        "show": invoke("show", url),
        "verify": invoke("verify", url),
    }
    for name, result in tables.items():
        assert result.exit_code == 0, (name, result.output)
        assert not _FRAME.search(result.stdout), (name, result.stdout)
    assert _heading(tables["runs"].stdout)[:2] == ["run", "step"]
    assert _heading(tables["show"].stdout)[:2] == ["path", "size"]
    assert _heading(tables["verify"].stdout) == ["step", "role", "status", "size", "details"]
    assert re.search(r"^\s*5\s+current\s+ok\s", tables["verify"].stdout, re.M)
