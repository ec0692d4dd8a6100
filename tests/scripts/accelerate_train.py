"""A tiny model trained with ``accelerate``, saving ``save_state`` checkpoints under
automatic checkpoint naming (``PROJECT/checkpoints/checkpoint_N``) with ``total_limit=2``.

Run by tests/test_watch.py as a child process, beside a ``cloudckpt watch`` sidecar:

    python tests/scripts/accelerate_train.py --project-dir DIR --events EVENTS.jsonl
        [--saves 3] [--steps-per-save 4]

A registered custom object (the training step) makes accelerate write
``custom_checkpoint_0.pkl`` after ``random_states_0.pkl``, as real projects do. Every save is
appended to the events file as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed


class Progress:
    """The training step, checkpointed with the run (accelerate records none itself)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--project-dir", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--steps-per-save", type=int, default=4)
    args = p.parse_args()
    events = open(args.events, "a", buffering=1)  # noqa: SIM115 - closed below

    set_seed(0)
    config = ProjectConfiguration(
        project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(args.saves):
        for _ in range(args.steps_per_save):
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
        path = accelerator.save_state()
        events.write(
            json.dumps({"event": "saved", "path": str(path), "step": progress.step}) + "\n"
        )
    events.write(json.dumps({"event": "end"}) + "\n")
    events.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
