"""A plain PyTorch loop that checkpoints with ``save_state`` and stops cleanly on preemption.

    pip install '.[torch]'      # from the repository root, after the torch build you need
    python examples/torch_loop.py                     # trains, checkpoints every 50 steps
    python examples/torch_loop.py                     # run it again: resumes where it stopped

    python examples/torch_loop.py & sleep 10; kill -TERM $!  # preemption: saves, exits 0

``CLOUDCKPT_URL`` picks the store (default: a local ``file://`` directory, so the example
runs anywhere; use ``s3://bucket/prefix`` or ``gs://...`` for real runs).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from cloudckpt import CheckpointManager
from cloudckpt.integrations.torch import resume_state, save_state
from cloudckpt.preemption import PreemptionWatcher

URL = os.environ.get(
    "CLOUDCKPT_URL", f"file://{tempfile.gettempdir()}/cloudckpt-examples/torch-loop"
)
TOTAL_STEPS, SAVE_EVERY = 400, 50


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=TOTAL_STEPS)

    mgr = CheckpointManager(URL, keep_last=3)
    # Claims the run (None for a new one) and loads the newest checkpoint straight into the
    # model's own tensors, every byte verified; what into= lacks (the optimizer's moments,
    # the RNG state) comes back as new tensors (strict=False).
    state = resume_state(mgr, into={"model": model.state_dict()}, strict=False)
    start = 0
    if state is not None:  # the model holds the checkpoint's weights now
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        start = state["step"] + 1
        print(f"resumed from step {state['step']} ({URL})")

    def state_at(step: int) -> dict:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "step": step,
        }

    with PreemptionWatcher() as watcher:  # SIGTERM + the cloud's notice, if any
        for step in range(start, TOTAL_STEPS):
            x = torch.randn(32, 16)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            time.sleep(0.02)  # a real step takes longer; this leaves time to send SIGTERM

            if watcher.preempted:
                handle = save_state(mgr, step, state_at(step), {"loss": loss.item()})
                info = handle.result(timeout=watcher.seconds_left(default=120))
                print(f"preempted ({watcher.reason}): step {info.step} committed")
                break
            if step % SAVE_EVERY == SAVE_EVERY - 1:
                # Blocks only for the copy into host buffers; uploads in the background.
                # If the previous save failed, this raises its error: the run stops here
                # rather than train on with nothing stored.
                save_state(mgr, step, state_at(step), {"loss": loss.item()})
                print(f"step {step}: loss {loss.item():.4f}, checkpoint handed over")
    mgr.close()  # waits for every pending commit; raises if a save failed (exit status 1)
    with CheckpointManager(URL) as reader:
        latest = reader.latest()
    print(f"newest committed checkpoint: step {latest.step if latest else None}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
