"""Data-parallel training with torchrun, checkpointed with DCP through cloudckpt.

    pip install '.[torch]'      # from the repository root, after the torch build you need
    torchrun --nproc_per_node=2 examples/distributed_train.py     # trains, saves every 20 steps
    torchrun --nproc_per_node=2 examples/distributed_train.py     # again: resumes where it stopped
    torchrun --nproc_per_node=1 examples/distributed_train.py     # resumes at another world size

Every rank builds the same ``DistributedCheckpointManager``. Resuming, rank 0 claims the
run (fencing any zombie of an earlier job) and every rank loads the newest committed
checkpoint with ``dcp.load``; each node downloads what its ranks need once. Saving,
``dcp.async_save`` copies the state to CPU memory and returns; each rank then writes and
uploads its part in the background, and rank 0 commits once every rank's upload is in.

``CLOUDCKPT_URL`` picks the store (default: a local ``file://`` directory, so the example
runs anywhere; use ``s3://bucket/prefix`` or ``gs://...`` for real runs). Runs on CPU with
gloo, or on GPUs with NCCL (one GPU per rank).
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from cloudckpt.distributed import DistributedCheckpointManager
from cloudckpt.integrations.dcp import CloudStorageReader, CloudStorageWriter

URL = os.environ.get(
    "CLOUDCKPT_URL", f"file://{tempfile.gettempdir()}/cloudckpt-examples/distributed"
)
TOTAL_STEPS, SAVE_EVERY = 100, 20


class TrainState(Stateful):
    """Model and optimizer as DCP wants them (sharded-aware state dicts), plus the step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.step = model, optimizer, -1

    def state_dict(self) -> dict:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.step = state["step"]


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = DDP(net.to(device) if cuda else net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainState(model, optimizer)

    # Every rank, same arguments. timeout bounds how long ranks wait for a dead or hung peer.
    staging = os.path.join(tempfile.gettempdir(), "cloudckpt-examples", "staging")
    mgr = DistributedCheckpointManager(URL, staging_dir=staging, keep_last=3, timeout=300)
    # async_save runs DCP's collectives on a background thread: give it its own gloo group.
    ckpt_group = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=300))

    reader = CloudStorageReader(mgr, claim=True)  # rank 0 claims; everyone learns the step
    if reader.step is not None:
        dcp.load({"train": state}, storage_reader=reader)
        if rank == 0:
            print(f"resumed from step {state.step} at world size {world} ({URL})")
    start = state.step + 1

    pending = None
    for step in range(start, TOTAL_STEPS):
        g = torch.Generator().manual_seed(step * world + rank)  # each rank its own batch
        x = torch.randn(32, 16, generator=g)
        y = x.sum(dim=1, keepdim=True)
        if cuda:
            x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % SAVE_EVERY == 0 or step == TOTAL_STEPS - 1:
            if pending is not None:
                pending.result()  # one save in flight at a time
            state.step = step
            pending = dcp.async_save(
                {"train": state},
                storage_writer=CloudStorageWriter(mgr, step=step, metadata={"loss": loss.item()}),
                process_group=ckpt_group,
            )
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, checkpoint uploading")
    if pending is not None:
        pending.result()
    if rank == 0:
        latest = mgr.latest()
        print(f"done; newest committed checkpoint: step {latest.step if latest else None}")
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
