"""A tiny LightningModule trained with cloudckpt's CloudCheckpointIO.

Run by tests/test_integration_lightning.py as a child process (so it can be killed or
signalled):

    python tests/scripts/lightning_train.py --root DIR --events EVENTS.jsonl [--url s3://b/run]
        [--max-epochs 6] [--resume] [--upload-latency 0.3] [--no-cloud] [--wait-for FILE]
        [--reference-first REF_EVENTS.jsonl] [--val-losses 0.3,0.5,... --top-k 2 --keep-best 2]

``--val-losses`` logs a scripted ``val_loss`` per epoch (validation every epoch) and makes
the ``ModelCheckpoint`` monitor it (``mode="min"``, ``save_top_k`` from ``--top-k``);
``--keep-best`` has the store keep that many best by it (``--keep-last`` beside it).

``--reference-first`` first trains an uninterrupted reference run (no cloudckpt, 6 epochs)
in this process and logs it to REF_EVENTS, then does the configured run. Storage options
come as JSON in CLOUDCKPT_TEST_STORAGE_OPTIONS. Every training step's loss and every save
are appended to the events file as JSON lines. Checkpoints are taken at epoch ends (a plain
DataLoader cannot resume mid-epoch exactly); the sampler is a seeded DistributedSampler
(one replica) whose order depends only on the epoch, dropout is on, and RNGStateCallback
carries the RNG across the restart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("CLOUDCKPT_PREEMPTION_SOURCES", "signal")  # never a real metadata host

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from cloudckpt.integrations.lightning import (
    CloudCheckpointIO,
    PreemptionCallback,
    RNGStateCallback,
)


def train(
    root: str,
    events_path: str,
    *,
    max_epochs: int,
    url: str | None = None,
    resume: bool = False,
    upload_latency: float = 0.0,
    wait_for: str | None = None,
    devices: int = 1,
    val_losses: list[float] | None = None,
    top_k: int = 1,
    keep_best: int | None = None,
    keep_last: int = 3,
) -> int:
    events = open(events_path, "a", buffering=1)  # noqa: SIM115 - closed below

    def emit(**record):
        events.write(json.dumps(record) + "\n")
        events.flush()

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            emit(event="loss", step=self.global_step, loss=loss.item(), lr=lr)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.tensor(val_losses[self.current_epoch]))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Recorder(Callback):
        def on_train_start(self, trainer, pl_module):
            emit(event="train_start", global_step=trainer.global_step, epoch=trainer.current_epoch)

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            emit(event="saved", step=trainer.global_step, epoch=trainer.current_epoch)

    L.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=0)

    dirpath = os.path.join(root, "checkpoints")
    monitored = {"monitor": "val_loss", "mode": "min"} if val_losses else {}
    best = ModelCheckpoint(
        dirpath=dirpath, every_n_epochs=1, save_top_k=top_k, save_last="link", **monitored
    )
    callbacks = [Recorder(), best, RNGStateCallback()]
    plugins = []
    io = None
    preemption = None
    if url:
        options = json.loads(os.environ.get("CLOUDCKPT_TEST_STORAGE_OPTIONS", "{}"))
        target = url
        if upload_latency:
            from cloudckpt.stores import open_store
            from cloudckpt.testing.faults import FaultInjectingStore, Latency, Rule

            target = FaultInjectingStore(open_store(url, options))
            target.add(
                Rule(Latency(upload_latency), ops={"put", "upload_part"}, key="ckpt/*", times=None)
            )
            options = None
        best_options = {}
        if keep_best:
            best_options = {"keep_best": keep_best, "best_metric": "val_loss", "best_mode": "min"}
        io = CloudCheckpointIO(target, storage_options=options, keep_last=keep_last, **best_options)
        plugins.append(io)
        preemption = PreemptionCallback()
        callbacks.append(preemption)

    if wait_for:  # started early to overlap the slow imports; go when told
        deadline = time.monotonic() + 600
        while not os.path.exists(wait_for):
            if time.monotonic() > deadline:
                raise SystemExit(f"{wait_for} never appeared")
            time.sleep(0.05)
        emit(event="go")

    ckpt_path = None
    if resume:
        ckpt_path = io.resume(dirpath)
        emit(event="resumed", path=ckpt_path)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        use_distributed_sampler=False,  # the seeded sampler above (also in DDP, for tests)
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        default_root_dir=root,
        callbacks=callbacks,
        plugins=plugins,
    )
    val_loader = None
    if val_losses:
        val_loader = DataLoader(TensorDataset(x[:8], x[:8].sum(dim=1, keepdim=True)), batch_size=8)
    try:
        trainer.fit(Net(), loader, val_loader, ckpt_path=ckpt_path)
    finally:  # also on Lightning's SIGTERMException (a SystemExit)
        emit(
            event="end",
            global_step=trainer.global_step,
            preempted=bool(preemption and preemption.preempted),
            last_commit=io.last_commit.step if io and io.last_commit else None,
            best_model_path=best.best_model_path,
        )
        events.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url")
    p.add_argument("--root", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--max-epochs", type=int, default=6)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--wait-for", help="after importing everything, wait until this file exists")
    p.add_argument("--upload-latency", type=float, default=0.0)
    p.add_argument("--no-cloud", action="store_true")
    p.add_argument("--reference-first", metavar="EVENTS", help="train a reference run first")
    p.add_argument("--devices", type=int, default=1, help="> 1: DDP on CPU processes")
    p.add_argument("--val-losses", help="scripted val_loss per epoch: 0.3,0.5,...")
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--keep-best", type=int)
    p.add_argument("--keep-last", type=int, default=3)
    args = p.parse_args()
    if args.reference_first:
        train(args.root + "-reference", args.reference_first, max_epochs=6)
    return train(
        args.root,
        args.events,
        max_epochs=args.max_epochs,
        url=None if args.no_cloud else args.url,
        resume=args.resume,
        upload_latency=args.upload_latency,
        wait_for=args.wait_for,
        devices=args.devices,
        val_losses=[float(v) for v in args.val_losses.split(",")] if args.val_losses else None,
        top_k=args.top_k,
        keep_best=args.keep_best,
        keep_last=args.keep_last,
    )


if __name__ == "__main__":
    sys.exit(main())
