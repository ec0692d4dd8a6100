"""Retention by metric and by time: the store keeps the newest checkpoints, the best ones by
an evaluation metric, and one per hour for the last day.

    pip install .                             # from the repository root; no torch needed
    python examples/keep_best.py              # 12 "evaluations", then what is retained
    python examples/keep_best.py              # again: the run continues; the best stay
    cloudckpt ls file:///tmp/cloudckpt-examples/keep-best --json \\
        | jq '.checkpoints[] | {step, metrics}'

``CLOUDCKPT_URL`` picks the store (default: a local ``file://`` directory; use
``s3://bucket/prefix`` or ``gs://...`` for real runs). The retention settings are stored in
the run: a later writer that does not name them (a resumed trainer, ``cloudckpt push``)
keeps them, and an older cloudckpt refuses to write the run rather than drop the best.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile

from cloudckpt import CheckpointManager

URL = os.environ.get(
    "CLOUDCKPT_URL", f"file://{tempfile.gettempdir()}/cloudckpt-examples/keep-best"
)


def eval_loss(step: int) -> float:
    """A made-up validation curve: improves, then overfits, with some noise."""
    return round(1.0 / (1 + step / 4) + (step / 40) ** 2 + 0.03 * math.sin(step * 2.1), 4)


def main() -> int:
    with CheckpointManager(
        URL,
        keep_last=2,  # the newest two (to resume from)
        keep_best=2,  # and the best two by eval_loss (lower is better)
        best_metric="eval_loss",
        best_mode="min",
        keep_periods=[("1h", "1d")],  # and the newest of each hour of the last day
    ) as mgr:
        newest = mgr.latest()  # a read: None for a new run
        start = 1 if newest is None else newest.step + 1
        for step in range(start, start + 12):
            loss = eval_loss(step)
            with mgr.save(step, metrics={"eval_loss": loss}) as d:
                (d / "model.bin").write_bytes(f"weights after step {step}".encode())
            print(f"step {step}: eval_loss {loss}")
        mgr.wait()  # raises if a save failed

        print("retained (newest first):")
        for c in mgr.list():
            print(f"  step {c.step:3d}  eval_loss {c.metrics.get('eval_loss')}")
        best = min(mgr.list(), key=lambda c: c.metrics["eval_loss"])
        restored = mgr.restore(into=tempfile.mkdtemp(prefix="cloudckpt-best-"), step=best.step)
        print(f"best: step {best.step}, restored to {restored.path}")
        print(f"newest committed checkpoint: step {mgr.latest().step} in {URL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
