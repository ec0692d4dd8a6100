"""Incremental checkpoints (issue 15): bytes uploaded and time per save, chunking on vs off.

    python -m benchmarks.incremental                 # the full run (a few minutes, 2 cores)
    python -m benchmarks.incremental --quick         # a smoke run (CI)
    python -m benchmarks.incremental --json out.json

Scenarios, each against the local moto S3 server (``cloudckpt.testing.moto_server``), every
save of a scenario taken by one manager per contender, on the same files, in rotating order:

- ``lora``: a GPT-2 built from a config (no downloads) with LoRA adapters (peft), the base
  frozen. Each checkpoint is what a user restores from: the whole model (base and
  adapters) as safetensors, the optimizer state (``torch.save``), an RNG file.
- ``full``: the same model fully fine-tuned (every weight and the Adam state change).
- ``two-runs``: a second run started from the same base model, in its own run prefix.

Contenders: ``off`` (whole files, the layout before chunks), ``fixed`` (8 MiB chunks) and
``tensor`` (8 MiB chunks cut at tensor boundaries too; the default). "Bytes uploaded" counts
every byte the manager sent to the store (puts and parts, manifests included); "save time"
is from the hand-over of the save to the commit (``CommitInfo.commit_seconds``). The first
save of a run uploads everything in every mode; ratios are over the later saves.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from cloudckpt import CheckpointManager, open_store
from cloudckpt.stores.base import MultipartUpload, PutMode
from cloudckpt.testing.wrappers import ForwardingStore

MODES = ("off", "fixed", "tensor")


class CountingStore(ForwardingStore):
    """Counts the bytes sent to the store (puts and multipart parts)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.sent = 0
        self._lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._lock:
            self.sent += n

    def put(self, key: str, data, *, mode: PutMode | None = None):
        self._count(len(data))
        return self.inner.put(key, data, **({} if mode is None else {"mode": mode}))

    def upload_part(self, upload: MultipartUpload, part_number: int, data, *, crc32c=None):
        self._count(len(data))
        return self.inner.upload_part(upload, part_number, data, crc32c=crc32c)


def _model(size: str, seed: int = 0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    if size == "quick":
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    else:
        cfg = GPT2Config(n_layer=4, n_embd=384, n_head=6, vocab_size=8192, n_positions=256)
    return GPT2LMHeadModel(cfg)


def _lora(model, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,
        lora_dropout=0.0,
        init_lora_weights=False,  # B != 0: every adapter tensor changes from step one
    )
    return get_peft_model(model, cfg)


class Trainer:
    """A few optimizer steps on random tokens between saves; writes a checkpoint dir."""

    def __init__(self, model, seed: int) -> None:
        import torch

        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = model.config.vocab_size
        self.ctx = min(64, model.config.n_positions)

    def steps(self, n: int) -> None:
        import torch

        self.model.train()
        for _ in range(n):
            ids = torch.randint(0, self.vocab, (2, self.ctx), generator=self.gen)
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()

    def write(self, d: Path) -> int:
        import torch
        from safetensors.torch import save_model

        d.mkdir(parents=True, exist_ok=True)
        save_model(self.model, str(d / "model.safetensors"))
        torch.save(self.opt.state_dict(), d / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state(), "gen": self.gen.get_state()}, d / "rng.pt")
        (d / "trainer_state.json").write_text(json.dumps({"time": time.time()}))
        return sum(p.stat().st_size for p in d.iterdir())


def _run_scenario(
    name: str, server, make_trainer, saves: int, steps: int, tmp: Path
) -> dict[str, Any]:
    """One trainer; after every ``steps`` steps its checkpoint is saved by one manager per
    mode (each its own run), in rotating order."""
    trainer = make_trainer()
    mgrs, stores = {}, {}
    for mode in MODES:
        bucket = f"inc-{name}-{mode}-{uuid.uuid4().hex[:6]}"
        server.create_bucket(bucket)
        stores[mode] = CountingStore(open_store(f"s3://{bucket}/run", server.storage_options()))
        mgrs[mode] = CheckpointManager(
            stores[mode], staging_dir=tmp / f"staging-{name}-{mode}", chunking=mode, auto_gc=False
        )
    rows = []
    try:
        for i in range(saves):
            trainer.steps(steps)
            src = tmp / f"{name}-ckpt-{i}"
            size = trainer.write(src)
            order = MODES[i % 3 :] + MODES[: i % 3]
            row: dict[str, Any] = {"save": i, "checkpoint_bytes": size}
            for mode in order:
                before = stores[mode].sent
                info = mgrs[mode].save_dir(step=i + 1, src=src).result()
                row[mode] = {
                    "bytes_uploaded": stores[mode].sent - before,
                    "seconds": info.commit_seconds,
                }
            rows.append(row)
            print(
                f"{name} save {i}: {size / 1e6:.1f} MB; "
                + ", ".join(
                    f"{m} {row[m]['bytes_uploaded'] / 1e6:.2f} MB {row[m]['seconds']:.2f}s"
                    for m in MODES
                ),
                flush=True,
            )
        # Restore the last checkpoint (verified, fsynced), 3 rounds in rotating order.
        restores: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(3):
            for mode in MODES[r:] + MODES[:r]:
                into = tmp / f"restore-{name}-{mode}-{r}"
                t0 = time.perf_counter()
                mgrs[mode].restore(into=into)
                restores[mode].append(time.perf_counter() - t0)
                shutil.rmtree(into)
    finally:
        for m in MODES:
            mgrs[m].close()
    later = rows[1:]
    summary: dict[str, Any] = {"saves": rows, "restore_seconds": restores}
    for mode in MODES:
        up = sum(r[mode]["bytes_uploaded"] for r in later)
        total = sum(r["checkpoint_bytes"] for r in later)
        summary[mode] = {
            "later_saves_bytes_uploaded": up,
            "later_saves_checkpoint_bytes": total,
            "bytes_ratio_vs_checkpoint": up / total if total else None,
            "median_seconds_later_saves": statistics.median(r[mode]["seconds"] for r in later),
            "median_restore_seconds": statistics.median(restores[mode]),
        }
    for mode in ("fixed", "tensor"):
        ratios = [r[mode]["seconds"] / r["off"]["seconds"] for r in later]
        summary[mode]["time_ratio_vs_off_median"] = statistics.median(ratios)
        summary[mode]["bytes_ratio_vs_off"] = (
            summary[mode]["later_saves_bytes_uploaded"]
            / summary["off"]["later_saves_bytes_uploaded"]
        )
    return summary


def _two_runs(server, size: str, steps: int, tmp: Path) -> dict[str, Any]:
    """Run B starts from run A's base weights, in a run prefix of its own: chunks live in
    the attempt prefixes of one run, so B's first save shares nothing with A."""
    out = {}
    for run, seed in (("A", 1), ("B", 2)):
        bucket = f"inc-two-{run.lower()}-{uuid.uuid4().hex[:6]}"
        server.create_bucket(bucket)
        store = CountingStore(open_store(f"s3://{bucket}/run", server.storage_options()))
        trainer = Trainer(_lora(_model(size, seed=0), seed), seed)
        trainer.steps(steps)
        src = tmp / f"two-{run}"
        ckpt = trainer.write(src)
        with CheckpointManager(store, staging_dir=tmp / f"staging-two-{run}", auto_gc=False) as m:
            m.save_dir(step=1, src=src).result()
        out[run] = {"checkpoint_bytes": ckpt, "first_save_bytes_uploaded": store.sent}
    out["B_first_save_ratio"] = out["B"]["first_save_bytes_uploaded"] / out["B"]["checkpoint_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 saves (CI)")
    parser.add_argument("--saves", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    import torch

    torch.set_num_threads(1)
    size = "quick" if args.quick else "full"
    saves = args.saves or (3 if args.quick else 5)
    steps = 1 if args.quick else 3
    from cloudckpt.testing.moto_server import MotoServer

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cloudckpt-inc-") as t, MotoServer() as server:
        tmp = Path(t)
        lora = _run_scenario(
            "lora", server, lambda: Trainer(_lora(_model(size), 1), 1), saves, steps, tmp
        )
        full = _run_scenario("full", server, lambda: Trainer(_model(size), 1), saves, steps, tmp)
        two = _two_runs(server, size, steps, tmp)
    doc = {
        "schema": "cloudckpt.bench-incremental/1",
        "quick": args.quick,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        },
        "endpoint": "moto (cloudckpt.testing.moto_server), http://127.0.0.1",
        "scenarios": {"lora": lora, "full": full, "two-runs": two},
        "seconds": time.perf_counter() - started,
    }
    print()
    print(f"(a) LoRA, base frozen: later saves upload {lora['tensor']['bytes_ratio_vs_checkpoint']:.1%} "
          f"of their bytes (tensor), {lora['fixed']['bytes_ratio_vs_checkpoint']:.1%} (fixed), "
          f"{lora['off']['bytes_ratio_vs_checkpoint']:.1%} (off)")  # fmt: skip
    print(f"(b) full fine-tuning: save time tensor/off = {full['tensor']['time_ratio_vs_off_median']:.3f}, "
          f"fixed/off = {full['fixed']['time_ratio_vs_off_median']:.3f}; bytes tensor/off = "
          f"{full['tensor']['bytes_ratio_vs_off']:.3f}")  # fmt: skip
    print("restore of the last checkpoint (median s): "
          + ", ".join(f"{n} {m} {s[m]['median_restore_seconds']:.2f}"
                      for n, s in (("lora", lora), ("full", full)) for m in MODES))  # fmt: skip
    print(f"(c) two runs from one base: run B's first save uploads {two['B_first_save_ratio']:.1%} "
          "of its bytes (no sharing across runs)")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
