"""Lightning with cloudckpt: checkpoints committed to a store, resume on any host, clean
stop on preemption, exact RNG continuation.

    pip install '.[lightning]'      # from the repository root, after the torch build you need
    python examples/lightning_trainer.py run-1     # 10 epochs of a tiny MLP on CPU
    python examples/lightning_trainer.py run-2     # a "new host": resumes from the store

``kill -9`` the first run at any point: the second resumes from the newest committed
checkpoint. ``kill -TERM`` saves at the next batch, waits for the commit and exits with 0.

``CLOUDCKPT_URL`` picks the store (default: a local ``file://`` directory; use
``s3://bucket/prefix`` or ``gs://...`` for real runs).
"""

from __future__ import annotations

import os
import sys
import tempfile

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cloudckpt.integrations.lightning import (
    CloudCheckpointIO,
    PreemptionCallback,
    RNGStateCallback,
)

URL = os.environ.get(
    "CLOUDCKPT_URL", f"file://{tempfile.gettempdir()}/cloudckpt-examples/lightning"
)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(root: str) -> int:
    L.seed_everything(0)
    x = torch.randn(512, 8)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32, shuffle=True)
    dirpath = os.path.join(root, "checkpoints")

    io = CloudCheckpointIO(URL, keep_last=3)
    ckpt_path = io.resume(dirpath)  # claims the run; None for a new run
    print(f"ckpt_path={ckpt_path}")
    trainer = L.Trainer(
        max_epochs=10,
        accelerator="cpu",
        default_root_dir=root,
        logger=False,
        plugins=[io],
        callbacks=[
            # Checkpoint at epoch ends (a plain DataLoader cannot resume mid-epoch exactly).
            ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=1, save_last="link"),
            PreemptionCallback(),
            RNGStateCallback(),
        ],
    )
    trainer.fit(Regressor(), loader, ckpt_path=ckpt_path)
    if io.last_commit is not None:
        print(f"newest committed checkpoint: step {io.last_commit.step} in {URL}")
    else:
        print("nothing left to train: the newest committed checkpoint is the last one")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "run-lightning"))
