"""DeepSpeed training (ZeRO stage 1) checkpointed to object storage through cloudckpt.

    pip install -c constraints.txt 'torch==2.13.0' -e '.[deepspeed]'   # from the repository root
    python examples/deepspeed_train.py                            # one process on CPU
    torchrun --nproc_per_node=2 examples/deepspeed_train.py       # two ranks (gloo on CPU)
    python examples/deepspeed_train.py                            # again: resumes where it stopped

DeepSpeed writes its checkpoint (``global_step<N>/`` with the model states and one ZeRO
optimizer shard per rank, and ``latest``) into each rank's cloudckpt staging directory;
every rank uploads its files and rank 0 commits once all are in. Resuming, every node
downloads the newest committed checkpoint (verified) and ``engine.load_checkpoint`` reads
it. ``CLOUDCKPT_URL`` picks the store (default: a local ``file://`` directory, so the
example runs anywhere; use ``s3://bucket/prefix``, ``gs://...`` or ``az://...``).
"""

from __future__ import annotations

import os
import tempfile

import deepspeed
import torch

from cloudckpt.integrations import deepspeed as ds_ckpt

URL = os.environ.get("CLOUDCKPT_URL", f"file://{tempfile.gettempdir()}/cloudckpt-examples/ds")
TOTAL_STEPS, SAVE_EVERY = 30, 10


def main() -> None:
    if "RANK" not in os.environ:  # plain `python`: one process (DeepSpeed would look for MPI)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rank = engine.global_rank
    base = os.path.join(tempfile.gettempdir(), "cloudckpt-examples", "ds")  # same on every rank
    # Every rank, same arguments (after deepspeed.initialize set up torch.distributed).
    mgr = ds_ckpt.checkpoint_manager(URL, staging_dir=os.path.join(base, "staging"), keep_last=2)
    # The node-local restore directory: the same path on every rank of a node; it is the
    # example's own scratch space, so an earlier run's copy may be replaced.
    resumed = ds_ckpt.load_checkpoint(engine, mgr, os.path.join(base, "restore"), overwrite=True)
    if resumed is not None and rank == 0:
        print(f"resumed from step {resumed.step} ({resumed.tag})")

    while engine.global_steps < TOTAL_STEPS:
        x = torch.randn(8, 16, device=engine.device)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
        if engine.global_steps % SAVE_EVERY == 0:
            # Returns once DeepSpeed wrote its files locally; the upload runs meanwhile.
            ds_ckpt.save_checkpoint(engine, mgr, metrics={"loss": float(loss)})

    mgr.wait()  # every rank: waits for the last upload and commit, raises if one failed
    latest = mgr.latest()
    mgr.close()
    if rank == 0:
        print(f"newest committed checkpoint: step {latest.step if latest else None}", flush=True)


if __name__ == "__main__":
    main()
