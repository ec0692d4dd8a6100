"""A tiny GPT-2 trained by the transformers Trainer with cloudckpt's CheckpointCallback.

Run by tests/test_integration_hf.py as a child process (so it can be killed or signalled):

    python tests/scripts/hf_train.py --output-dir OUT --events EVENTS.jsonl [--url s3://b/run]
        [--max-steps 12] [--save-steps 3] [--resume] [--upload-latency 0.3] [--no-callback]
        [--wait-for FILE] [--reference-first REF_EVENTS.jsonl]
        [--scores 3:0.2,6:0.5 --load-best --keep-last 2]

``--scores`` makes each evaluation report ``eval_score`` (lower is better) as scripted per
step, and ``metric_for_best_model="score"``: a test decides which checkpoint is the best.
``--load-best`` turns on ``load_best_model_at_end``.

``--reference-first`` first trains an uninterrupted reference run (no callback, 12 steps,
saves every 3) in this process and logs it to REF_EVENTS, then does the configured run: one
child serves as reference and preemption target, saving an interpreter start. Storage
options come as JSON in CLOUDCKPT_TEST_STORAGE_OPTIONS. Every log line, save and the end of
training are appended to the events file as JSON lines, flushed at once. No network:
HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE; the model is built from a config and the data are
synthetic token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("CLOUDCKPT_PREEMPTION_SOURCES", "signal")  # never a real metadata host

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(
    output_dir: str,
    events_path: str,
    *,
    max_steps: int,
    save_steps: int,
    url: str | None = None,
    resume: bool = False,
    upload_latency: float = 0.0,
    wait_for: str | None = None,
    scores: dict[int, float] | None = None,
    load_best: bool = False,
    keep_last: int = 3,
) -> int:
    events = open(events_path, "a", buffering=1)  # noqa: SIM115 - closed below

    def emit(**record):
        events.write(json.dumps(record) + "\n")
        events.flush()

    class Recorder(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            # Which process this rank is: a test signals exactly it (a scan of /proc for
            # LOCAL_RANK=1 also matches any child it forked, which shares its environment).
            emit(
                event="train_begin",
                global_step=state.global_step,
                pid=os.getpid(),
                rank=int(os.environ.get("RANK", "0")),
            )

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                emit(
                    event="log",
                    step=state.global_step,
                    loss=logs["loss"],
                    lr=logs.get("learning_rate"),
                    grad_norm=logs.get("grad_norm"),
                )
            elif logs and "eval_loss" in logs:
                emit(
                    event="eval",
                    step=state.global_step,
                    eval_loss=logs["eval_loss"],
                    eval_score=logs.get("eval_score"),
                )

        def on_save(self, targs, state, control, **kw):
            emit(event="saved", step=state.global_step)

    set_seed(42)
    # Dropout stays on (GPT-2's default 0.1): equal losses after a resume then also prove
    # that the RNG state was restored.
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    targs = TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=2,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=save_steps,
        metric_for_best_model="score" if scores else "eval_loss",
        greater_is_better=False,
        load_best_model_at_end=load_best,
        seed=42,
        data_seed=42,
        full_determinism=True,
        dataloader_num_workers=0,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callbacks = [Recorder()]
    ckpt = None
    if url:
        from cloudckpt.integrations.hf import CheckpointCallback

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
        ckpt = CheckpointCallback(target, storage_options=options, keep_last=keep_last)
        callbacks.insert(0, ckpt)

    if wait_for:  # started early to overlap the slow imports; go when told
        deadline = time.monotonic() + 600
        while not os.path.exists(wait_for):
            if time.monotonic() > deadline:
                raise SystemExit(f"{wait_for} never appeared")
            time.sleep(0.05)
        emit(event="go")

    resume_from = None
    if resume:
        resume_from = ckpt.resume(output_dir)
        emit(event="resumed", path=resume_from)

    def scripted(_prediction):
        return {"score": scores[trainer.state.global_step]}

    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=Tokens(32, 0),
        eval_dataset=Tokens(8, 1),
        callbacks=callbacks,
        compute_metrics=scripted if scores else None,
    )
    trainer.train(resume_from_checkpoint=resume_from)
    emit(
        event="end",
        global_step=trainer.state.global_step,
        preempted=bool(ckpt and ckpt.preempted),
        last_commit=ckpt.last_commit.step if ckpt and ckpt.last_commit else None,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        best_metric=trainer.state.best_metric,
    )
    events.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--wait-for", help="after importing everything, wait until this file exists")
    p.add_argument("--upload-latency", type=float, default=0.0)
    p.add_argument("--no-callback", action="store_true")
    p.add_argument("--reference-first", metavar="EVENTS", help="train a reference run first")
    p.add_argument("--scores", help="scripted eval_score per step: 3:0.2,6:0.5,...")
    p.add_argument("--load-best", action="store_true", help="load_best_model_at_end")
    p.add_argument("--keep-last", type=int, default=3)
    args = p.parse_args()
    if args.reference_first:
        train(args.output_dir + "-reference", args.reference_first, max_steps=12, save_steps=3)
    return train(
        args.output_dir,
        args.events,
        max_steps=args.max_steps,
        save_steps=args.save_steps,
        url=None if args.no_callback else args.url,
        resume=args.resume,
        upload_latency=args.upload_latency,
        wait_for=args.wait_for,
        scores={int(k): float(v) for k, v in (i.split(":") for i in args.scores.split(","))}
        if args.scores
        else None,
        load_best=args.load_best,
        keep_last=args.keep_last,
    )


if __name__ == "__main__":
    sys.exit(main())
