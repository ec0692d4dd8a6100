"""transformers ``Trainer`` with cloudckpt: every ``checkpoint-N`` committed to a store,
resume on any host, clean stop on preemption.

    pip install '.[hf]'      # from the repository root, after the torch build you need
    python examples/hf_trainer.py out-1        # trains a tiny GPT-2 on CPU, 60 steps
    python examples/hf_trainer.py out-2        # a "new host": resumes from the store

Kill the first run at any point (Ctrl-C, ``kill -9``): the second resumes from the newest
*committed* checkpoint. ``kill -TERM`` instead saves at the next step and exits with 0.
With ``load_best_model_at_end`` the store keeps the best checkpoint by ``eval_loss`` too
(beside ``keep_last``), so the new host gets it back and ends with the best model.

``CLOUDCKPT_URL`` picks the store (default: a local ``file://`` directory; use
``s3://bucket/prefix`` or ``gs://...`` for real runs). No downloads: the model is built from
a config and the data are random token ids.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from cloudckpt.integrations.hf import CheckpointCallback

URL = os.environ.get("CLOUDCKPT_URL", f"file://{tempfile.gettempdir()}/cloudckpt-examples/hf")


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, length: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(output_dir: str) -> int:
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=60,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=10,
        save_total_limit=2,  # local rotation; the store keeps keep_last=3 independently
        eval_strategy="steps",
        eval_steps=10,
        load_best_model_at_end=True,  # metric_for_best_model="loss": the store keeps the best
        logging_steps=10,
        seed=42,
        data_seed=42,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    ckpt = CheckpointCallback(URL, keep_last=3)
    resume_from = ckpt.resume(args.output_dir)  # claims the run; None for a new run
    print(f"resume_from_checkpoint={resume_from}")

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=RandomTokens(),
        eval_dataset=RandomTokens(n=32),
        callbacks=[ckpt],
    )
    trainer.train(resume_from_checkpoint=resume_from)
    print(
        f"best model: {trainer.state.best_model_checkpoint} (eval_loss {trainer.state.best_metric})"
    )
    if ckpt.last_commit is not None:
        print(f"newest committed checkpoint: step {ckpt.last_commit.step} in {URL}")
    if ckpt.preempted:
        print("stopped by a preemption notice; run again (anywhere) to continue")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out-hf"))
