#!/usr/bin/env python3
"""Install each user-facing extra alone into a fresh virtualenv and run it end to end.

    python tools/check_extras.py               # every extra (what .ci/run does)
    python tools/check_extras.py torch hf      # some of them

A resolver dry run (tests/test_install.py) proves an extra installs; it cannot see that the
extra lacks something its code imports at run time. ``[torch]`` once lacked numpy: every
``save_state`` failed in the background and ``examples/torch_loop.py`` ended "newest
committed checkpoint: step None" with exit status 0 (issue 21). So, for each extra:

1. a fresh virtualenv, and the install a user makes from a clone, e.g. ``pip install -c
   constraints.txt 'torch==2.13.0' -e '.[hf]'`` (torch first for the integrations, as their
   docs say; ``pip install -c constraints.txt -e '.[gcs]'`` for the others; nothing else);
2. its example, run as a user runs it, against a fresh run: ``examples/torch_loop.py``,
   ``examples/hf_trainer.py``, ``examples/lightning_trainer.py`` and
   ``examples/deepspeed_train.py`` on a ``file://`` run;
   ``cloudckpt push`` then ``cloudckpt restore`` (compared byte for byte) on
   fake-gcs-server for ``[gcs]`` and on Azurite for ``[azure]``; ``cloudckpt demo`` (which
   checks itself) for ``[demo]``;
3. it must exit 0, and the run must hold a committed checkpoint (the one the example says
   it committed) that ``cloudckpt verify --all --read-data`` passes.

Run it from the CI virtualenv (the ``[test]`` install): the emulators and the verification
come from there (Azurite needs ``.ci/run``'s ``npm ci``). Each check installs its own copy
of the package's files (pip builds in the source tree), ``--jobs`` checks at a time. Exit
status 0 if every extra passed; else 1, after trying them all, with each failure's output.
Prints what each check cost.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU build CI installs (.ci/run, docs/install.md)
COMMITTED = re.compile(r"newest committed checkpoint: step (\d+)")
INSTALL_TIMEOUT_S = 900
RUN_TIMEOUT_S = 600


class CheckFailed(Exception):
    """An extra's check failed; the message holds what it printed."""


@dataclasses.dataclass
class Env:
    """A fresh virtualenv with one extra installed, and a scratch directory for its run."""

    root: Path
    tmp: Path
    install_seconds: float = 0.0

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def run(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Run ``args`` (a program of this virtualenv, by name, or a path) as a user would:
        this virtualenv first on PATH, nothing of the CI virtualenv, in the scratch dir."""
        program = self.bin / args[0] if (self.bin / args[0]).exists() else Path(args[0])
        clean = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        clean.update(
            {
                "PATH": f"{self.bin}{os.pathsep}{clean.get('PATH', '')}",
                "TMPDIR": str(self.tmp),  # the examples' restore and staging directories
                "HF_HUB_OFFLINE": "1",  # nothing downloads: the HF example builds from a config
                "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                **(env or {}),
            }
        )
        proc = subprocess.run(
            [str(program), *args[1:]],
            cwd=self.tmp,
            env=clean,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise CheckFailed(f"{' '.join(args)} exited {proc.returncode}:\n{output[-6000:]}")
        return output


def _clone(dst: Path) -> Path:
    """What an editable install of a clone reads: the package and its build files. Each
    check installs its own copy, so installs run side by side (pip builds the project in
    its source tree)."""
    shutil.copytree(
        REPO / "cloudckpt", dst / "cloudckpt", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy2(REPO / name, dst / name)
    return dst


@contextlib.contextmanager
def fresh_env(extra: str, torch: bool) -> Iterator[Env]:
    """A new virtualenv holding only ``.[extra]`` (and torch, if the extra needs it)."""
    base = Path(tempfile.mkdtemp(prefix=f"cloudckpt-extra-{extra}-"))
    try:
        venv.EnvBuilder(with_pip=True).create(base / "venv")
        (base / "tmp").mkdir()
        env = Env(base / "venv", base / "tmp")
        src = _clone(base / "src")
        # --no-compile: the same packages, without byte-compiling them (about a third of
        # the install's CPU time for torch and transformers; Python compiles on import).
        cmd = ["pip", "install", "--quiet", "--no-compile", "-c", "constraints.txt"]
        cmd += [TORCH] if torch else []
        cmd += ["-e", f".[{extra}]"]
        started = time.monotonic()
        proc = subprocess.run(
            [str(env.bin / "python"), "-m", *cmd],
            cwd=src,
            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
        )
        env.install_seconds = time.monotonic() - started
        if proc.returncode != 0:
            raise CheckFailed(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
        yield env
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------------ verification


def verify_committed(
    url: str,
    options: dict[str, Any],
    flags: list[str],
    step: int,
    environ: dict[str, str] | None = None,
) -> None:
    """The run's current checkpoint is ``step``, and every retained one verifies (read
    back and hashed), checked with the CI virtualenv's cloudckpt."""
    from cloudckpt.reader import load_latest_for_reading
    from cloudckpt.stores import open_store

    store = open_store(url, options)
    try:
        latest, _ = load_latest_for_reading(store)
    finally:
        store.close()
    current = None if latest is None or latest.current is None else latest.current.step
    if current != step:
        raise CheckFailed(f"{url}: the current checkpoint is step {current}, not {step}")
    cli = Path(sys.executable).with_name("cloudckpt")
    proc = subprocess.run(
        [str(cli), "verify", url, "--all", "--read-data", *flags],
        env={**os.environ, **(environ or {})},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise CheckFailed(f"cloudckpt verify {url} exited {proc.returncode}:\n{proc.stderr}")


def run_example(env: Env, script: str, *args: str) -> None:
    """Run ``examples/<script>`` on a fresh ``file://`` run; it must say what it committed,
    and the store must agree."""
    url = f"file://{env.tmp}/store/run"
    output = env.run("python", str(REPO / "examples" / script), *args, env={"CLOUDCKPT_URL": url})
    said = COMMITTED.findall(output)
    if not said:
        raise CheckFailed(f"{script} committed nothing:\n{output[-6000:]}")
    verify_committed(url, {}, [], int(said[-1]))


def push_and_restore(env: Env, url: str, flags: list[str], environ: dict[str, str]) -> None:
    """``cloudckpt push`` a directory, ``cloudckpt restore`` it, compare byte for byte."""
    src = env.tmp / "checkpoint-7"
    src.mkdir()
    files = {"model.safetensors": os.urandom(3 * 1024 * 1024), "trainer_state.json": b"{}"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    env.run("cloudckpt", "push", str(src), url, "--step", "7", *flags, env=environ)
    env.run("cloudckpt", "restore", url, str(env.tmp / "restored"), *flags, env=environ)
    for name, data in files.items():
        if (env.tmp / "restored" / name).read_bytes() != data:
            raise CheckFailed(f"{name} restored from {url} differs from what was pushed")


def check_gcs(env: Env) -> None:
    from cloudckpt.testing.gcs_server import FakeGCSServer

    with FakeGCSServer() as server:
        server.create_bucket("extras")
        options = server.storage_options()
        flags = [
            "--endpoint-url",
            options["endpoint_url"],
            "-o",
            "token=anon",
            "-o",
            "project=test",
        ]
        push_and_restore(env, "gs://extras/run", flags, {})
        verify_committed("gs://extras/run", options, flags, 7)


def check_azure(env: Env) -> None:
    from cloudckpt.testing.azurite_server import AzuriteServer

    with AzuriteServer() as server:
        server.create_container("extras")
        environ = {"AZURE_STORAGE_CONNECTION_STRING": server.connection_string}
        push_and_restore(env, "az://extras/run", [], environ)
        verify_committed("az://extras/run", server.storage_options(), [], 7, environ)


def check_demo(env: Env) -> None:
    """The README's demo command; the demo checks its own outcome (exit status, PASS)."""
    output = env.run("cloudckpt", "demo")
    if "PASS" not in output:
        raise CheckFailed(f"cloudckpt demo did not report PASS:\n{output[-6000:]}")


# extra -> (needs torch, the check)
CHECKS: dict[str, tuple[bool, Callable[[Env], None]]] = {
    "torch": (True, lambda env: run_example(env, "torch_loop.py")),
    "hf": (True, lambda env: run_example(env, "hf_trainer.py", "out")),
    "lightning": (True, lambda env: run_example(env, "lightning_trainer.py", "run")),
    "deepspeed": (True, lambda env: run_example(env, "deepspeed_train.py")),
    "gcs": (False, check_gcs),
    "azure": (False, check_azure),
    "demo": (False, check_demo),
}


def check(extra: str) -> str:
    """Install ``extra`` alone and run its check; what it cost. Raises CheckFailed."""
    torch, run = CHECKS[extra]
    with fresh_env(extra, torch) as env:
        started = time.monotonic()
        run(env)
        ran = time.monotonic() - started
    return f"installed in {env.install_seconds:.0f} s, ran in {ran:.0f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("extras", nargs="*", help=f"default: all of {', '.join(CHECKS)}")
    parser.add_argument("--jobs", type=int, default=2, help="checks at a time (default 2)")
    args = parser.parse_args(argv)
    extras = args.extras or list(CHECKS)
    unknown = sorted(set(extras) - set(CHECKS))
    if unknown:
        parser.error(f"no check for {unknown}; known: {', '.join(CHECKS)}")
    started = time.monotonic()
    failed = 0
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {extra: pool.submit(check, extra) for extra in extras}
        for extra, future in futures.items():
            try:
                cost = future.result()
            except (CheckFailed, subprocess.TimeoutExpired, OSError) as exc:
                failed += 1
                print(f"[{extra}] FAILED: {exc}", flush=True)
            else:
                print(f"[{extra}] ok: {cost}", flush=True)
    print(
        f"{len(extras) - failed}/{len(extras)} extras passed in {time.monotonic() - started:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
