"""Run a script (an example) whose checkpoints cannot be stored.

    REFUSE=first python tests/scripts/refusing_store.py examples/torch_loop.py [args...]

``REFUSE`` (default ``all``): every store ``CheckpointManager`` opens is wrapped in a
``FaultInjectingStore`` whose rule answers writes under ``ckpt/`` (a save's attempt marker,
files, chunks and manifest) with ``PermissionDeniedError``, as a bucket policy denying
writes would: ``all`` refuses every save's writes, ``first`` only those of the first step
saved (later saves commit). Reads, and LATEST (so the run can be claimed), go through.
``REFUSE=none`` wraps nothing. At exit, one JSON line on stderr says how many writes were
refused: ``{"refused": N}`` (tests assert that the rule fired).

``NO_NUMPY=1``: numpy cannot be imported, as in a virtualenv where the torch wheel was
installed without it.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import runpy
import sys
from typing import Any

if os.environ.get("NO_NUMPY") == "1":
    sys.modules["numpy"] = None  # type: ignore[assignment]  # import numpy -> ImportError

from cloudckpt import manager
from cloudckpt.errors import PermissionDeniedError
from cloudckpt.testing.faults import WRITE_OPS, FailBefore, FaultInjectingStore, Rule

MODE = os.environ.get("REFUSE", "all")
_STEP = re.compile(r"^ckpt/(\d+)-")
rules: list[Rule] = []
refused_steps: list[int] = []  # ``first``: the step whose writes are refused
_open_store = manager.open_store


def _refused(key: str) -> bool:
    match = _STEP.match(key)
    if match is None:
        return False
    step = int(match.group(1))
    if MODE == "first" and not refused_steps:
        refused_steps.append(step)
    return MODE == "all" or step in refused_steps


def _refusing(url: Any, *args: Any, **kwargs: Any) -> Any:
    store = FaultInjectingStore(_open_store(url, *args, **kwargs))
    rules.append(
        store.add(Rule(FailBefore(PermissionDeniedError), ops=WRITE_OPS, key=_refused, times=None))
    )
    return store


if MODE != "none":
    manager.open_store = _refusing
atexit.register(
    lambda: print(json.dumps({"refused": sum(r.fired for r in rules)}), file=sys.stderr, flush=True)
)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
