"""A small training job that checkpoints with cloudckpt: the ``trainer`` service of
docker-compose.yml.

A tiny PyTorch MLP learns a synthetic regression task. Every ``SAVE_EVERY`` steps the model
and optimizer state are saved with ``CheckpointManager`` (staged locally, uploaded in the
background, committed through ``LATEST``). On start the job resumes from the newest committed
checkpoint, so ``docker compose restart trainer`` (or a crash, or SIGTERM) loses at most the
steps since the last save. On SIGTERM it saves once more before exiting.

Environment (all optional):

- ``CKPT_URL``: run URL (default ``s3://checkpoints/runs/compose-demo``)
- ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``:
  the S3 endpoint (MinIO in the compose stack) and its credentials
- ``TOTAL_STEPS`` (2000), ``SAVE_EVERY`` (100), ``STEP_SLEEP`` seconds per step (0.05)
- ``STAGING_DIR`` (``/tmp/cloudckpt-staging``): keep it on a volume so that a save staged
  before a crash is recovered by the next start
- ``HEARTBEAT_FILE`` (``/tmp/trainer.heartbeat``): touched every step, for the healthcheck

Prints one JSON object per line: ``resumed``/``started``, ``saved``, ``done``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cloudckpt import CheckpointManager

IN_FEATURES = 8


def log(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def storage_options() -> dict[str, Any]:
    """S3 options from the environment (boto3 reads the credentials itself)."""
    options: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["client_kwargs"] = {"region_name": region}
    return options


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN_FEATURES, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch per step, so a resumed run sees the same data."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(64, IN_FEATURES, generator=gen)
    true_w = torch.arange(1, IN_FEATURES + 1, dtype=torch.float32) / IN_FEATURES
    y = (x * true_w).sum(dim=1, keepdim=True) + 0.01 * torch.randn(64, 1, generator=gen)
    return x, y


def main() -> int:
    url = os.environ.get("CKPT_URL", "s3://checkpoints/runs/compose-demo")
    total_steps = int(os.environ.get("TOTAL_STEPS", "2000"))
    save_every = int(os.environ.get("SAVE_EVERY", "100"))
    step_sleep = float(os.environ.get("STEP_SLEEP", "0.05"))
    staging = Path(os.environ.get("STAGING_DIR", "/tmp/cloudckpt-staging"))
    heartbeat = Path(os.environ.get("HEARTBEAT_FILE", "/tmp/trainer.heartbeat"))

    stop = {"requested": False}

    def on_sigterm(signum: int, frame: Any) -> None:
        stop["requested"] = True  # finish the step, save, exit

    signal.signal(signal.SIGTERM, on_sigterm)

    model, optimizer = make_model()
    mgr = CheckpointManager(
        url, staging_dir=staging, keep_last=3, storage_options=storage_options()
    )
    start = 1
    with tempfile.TemporaryDirectory(prefix="cloudckpt-restore-") as tmp:
        restored = mgr.resume(into=Path(tmp) / "restore")
        if restored is None:
            log("started", url=url)
        else:
            state = torch.load(Path(restored.path) / "state.pt", weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = restored.step + 1
            log("resumed", step=restored.step, loss=restored.metadata.get("loss"))

    def save(step: int, loss: float) -> None:
        with mgr.save(step=step, metadata={"loss": round(loss, 6)}) as d:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, d / "state.pt")
        log("saved", step=step, loss=round(loss, 6))

    loss_fn = nn.MSELoss()
    step, loss = start - 1, float("nan")
    try:
        for step in range(start, total_steps + 1):
            x, y = batch(step)
            optimizer.zero_grad()
            out = loss_fn(model(x), y)
            out.backward()
            optimizer.step()
            loss = out.item()
            heartbeat.touch()
            if step % save_every == 0 or step == total_steps or stop["requested"]:
                save(step, loss)
            if stop["requested"]:
                log("preempted", step=step)
                break
            if step_sleep:
                time.sleep(step_sleep)
        mgr.wait()
    finally:
        mgr.close()  # waits for the last upload to commit
    log("done", step=step, loss=round(loss, 6) if loss == loss else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
