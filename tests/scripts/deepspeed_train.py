"""A tiny DeepSpeed job on CPU (gloo) for tests/test_integration_deepspeed.py; run by torchrun.

    --phase save     train 3 steps, save_checkpoint at step 3 (waits for the commit),
                     train 2 more; writes per rank the parameters at the save and at the end
    --phase resume   a fresh model (another seed), load_checkpoint into a fresh directory,
                     train the same 2 steps; writes the same two snapshots

Both phases write ``<out>/<phase>-rank<r>.pt`` ({"at_save", "at_end", "step", "files",
"client_state"}); the test compares them exactly. The batches depend only on the step, so
a resume that restored the model and the optimizer (Adam moments, ZeRO partitions) ends
bit for bit where the uninterrupted run ended.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import deepspeed.ops
import torch

from cloudckpt.integrations import deepspeed as ds_ckpt

SAVE_AT, MORE = 3, 2


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def train(engine, first: int, count: int) -> None:
    for step in range(first, first + count):
        x, y = batch(step, engine.global_rank)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()


def params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "resume"], required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--staging", required=True)
    ap.add_argument("--zero-stage", type=int, default=1)
    args = ap.parse_args()
    options = json.loads(os.environ.get("CLOUDCKPT_TEST_STORAGE_OPTIONS", "{}"))

    # DeepSpeed would otherwise compile its shared-memory allreduce (a minute on a fresh
    # machine); gloo's own allreduce is what it falls back to where the op cannot build.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0 if args.phase == "save" else 12345)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rank = engine.global_rank
    mgr = ds_ckpt.checkpoint_manager(args.url, storage_options=options, staging_dir=args.staging)
    record: dict = {}
    if args.phase == "save":
        assert ds_ckpt.load_checkpoint(engine, mgr, os.path.join(args.staging, "restore")) is None
        train(engine, 1, SAVE_AT)
        handle = ds_ckpt.save_checkpoint(
            engine, mgr, client_state={"epoch": 7}, metrics={"loss": 0.5}
        )
        info = handle.result()
        record["step"] = info.step
        record["at_save"] = params(engine)
        train(engine, SAVE_AT + 1, MORE)
    else:
        resumed = ds_ckpt.load_checkpoint(engine, mgr, os.path.join(args.staging, "restore"))
        assert resumed is not None
        record["step"] = resumed.step
        record["client_state"] = {"epoch": resumed.client_state.get("epoch")}
        record["files"] = sorted(
            p.relative_to(resumed.path).as_posix() for p in resumed.path.rglob("*") if p.is_file()
        )
        record["at_save"] = params(engine)
        assert engine.global_steps == SAVE_AT, engine.global_steps
        train(engine, SAVE_AT + 1, MORE)
    record["at_end"] = params(engine)
    mgr.close()
    torch.save(record, os.path.join(args.out, f"{args.phase}-rank{rank}.pt"))


if __name__ == "__main__":
    main()
