"""The examples end non-zero when their checkpoints cannot be stored (issue 21).

Each example runs as a new user runs it, in a subprocess, against a ``file://`` run whose
store refuses every checkpoint write (``tests/scripts/refusing_store.py`` wraps the stores
the managers open in a ``FaultInjectingStore``). A run that trained while every save failed
must not exit 0; it must say why; and nothing may be committed. That the examples succeed
and commit on a working store is checked by ``tools/check_extras.py`` (in ``.ci/run``, each
extra alone in a fresh virtualenv) and, for HF, Lightning and compose, by their own tests.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cloudckpt.protocol import LATEST_KEY, parse_latest
from cloudckpt.stores import open_store

REPO = Path(__file__).resolve().parents[1]
REFUSING = REPO / "tests" / "scripts" / "refusing_store.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# example -> (arguments, extra environment)
EXAMPLES = {
    "torch_loop.py": ([], {}),
    "keep_best.py": ([], {}),
    "hf_trainer.py": (["out"], {}),
    "lightning_trainer.py": (["run"], {}),
    "compose_trainer.py": ([], {"TOTAL_STEPS": "30", "SAVE_EVERY": "10", "STEP_SLEEP": "0"}),
    # One rank of the torchrun example, without torchrun: the env:// rendezvous of rank 0.
    "distributed_train.py": (
        [],
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},
    ),
}


def _run(example: str, tmp_path: Path, **env_vars: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``example`` through tests/scripts/refusing_store.py; (process, writes refused)."""
    args, extra_env = EXAMPLES[example]
    url = f"file://{tmp_path}/store/run"
    env = {
        **os.environ,
        **extra_env,
        **env_vars,
        "CLOUDCKPT_URL": url,
        "CKPT_URL": url,  # compose_trainer's name for it
        "STAGING_DIR": str(tmp_path / "staging"),
        "HEARTBEAT_FILE": str(tmp_path / "heartbeat"),
        "TMPDIR": str(tmp_path),  # the examples' restore and staging directories
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
    }
    if example == "distributed_train.py":
        env["MASTER_PORT"] = str(_free_port())
    proc = subprocess.run(
        [sys.executable, str(REFUSING), str(REPO / "examples" / example), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    return proc, json.loads(proc.stderr.strip().splitlines()[-1])["refused"]


def _committed_steps(tmp_path: Path) -> list[int]:
    store = open_store(f"file://{tmp_path}/store/run")
    try:
        return [r.step for r in parse_latest(store.get(LATEST_KEY)[0]).retained()]
    finally:
        store.close()


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_an_example_whose_first_save_fails_exits_non_zero(example, tmp_path):
    """Only the first checkpoint is refused; later ones could commit. The run must still
    end non-zero: a newer commit does not make up for a checkpoint that was lost."""
    proc, refused = _run(example, tmp_path, REFUSE="first")
    output = proc.stdout + proc.stderr
    assert refused > 0, f"the store refused nothing: the fault never fired\n{output[-4000:]}"
    assert proc.returncode != 0, f"{example} exited 0 though a save failed:\n{output[-4000:]}"
    assert "PermissionDeniedError" in output, output[-4000:]


def test_torch_loop_without_numpy_fails_at_its_first_save(tmp_path):
    """The new user's install of issue 21 (a torch wheel without numpy): every save_state
    failed in the background and the example ended "step None", exit 0. Now the first
    save_state raises, naming the extra that brings numpy, and nothing is committed."""
    proc, _ = _run("torch_loop.py", tmp_path, REFUSE="none", NO_NUMPY="1")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert "MissingDependencyError" in output and "[torch] extra" in output, output[-4000:]
    assert "pip install 'safetensors>=0.4' 'numpy>=" in output, output[-4000:]
    assert _committed_steps(tmp_path) == []
