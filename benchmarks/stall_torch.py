"""How long a checkpoint holds the training loop: ``save_state`` vs ``torch.save``.

    python benchmarks/stall_torch.py [--mib 256] [--tensors 64] [--rounds 4] [--dir DIR]

Builds a state like a training loop's (model weights plus AdamW's two moment buffers, fp32,
so 3 x --mib MiB in all, in --tensors tensors each), then per round measures the time the
caller is blocked by:

- ``torch.save(state, file)`` to local disk (page cache; the usual baseline);
- the same followed by ``fsync`` (what it costs to be durable locally);
- ``save_state(manager, step, state)``: the copy into reused host buffers (round 1 also
  allocates them); files are written and committed (to a ``file://`` store on the same
  disk) in the background, and the time to commit is shown for scale.

Between rounds the state is modified, as training would. Not a test: nothing is asserted.
CPU tensors only; on a GPU the copy goes to pinned buffers (device-to-host bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="model size in MiB (state is 3x)")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", help="local directory for files and the store (default: tmp)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import save_state

    numel = args.mib * 1024 * 1024 // 4 // args.tensors
    torch.manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(numel) for i in range(args.tensors)}
    state = {
        "model": model,
        "optimizer": {
            "state": {
                i: {
                    "step": torch.tensor(1.0),
                    "exp_avg": torch.randn(numel),
                    "exp_avg_sq": torch.rand(numel),
                }
                for i in range(args.tensors)
            },
            "param_groups": [
                {"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(args.tensors))}
            ],
        },
        "step": 0,
    }
    total = sum(
        t.numel() * t.element_size()
        for t in [*model.values()]
        + [v for s in state["optimizer"]["state"].values() for v in s.values()]
    )

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="stall-torch-") as tmp:
        root = Path(tmp)
        mgr = CheckpointManager(
            f"file://{root / 'store'}", staging_dir=root / "staging", keep_last=2, auto_gc=False
        )
        rows = []
        for r in range(args.rounds):
            for t in model.values():  # training changes the weights between checkpoints
                t.add_(1e-3)
            state["step"] = r

            path = root / f"torch-{r}.pt"
            started = time.perf_counter()
            torch.save(state, path)
            torch_save = time.perf_counter() - started
            started = time.perf_counter()
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            fsync = time.perf_counter() - started
            path.unlink()

            started = time.perf_counter()
            handle = save_state(mgr, r, state)
            blocking = time.perf_counter() - started
            info = handle.result()
            rows.append(
                {
                    "round": r + 1,
                    "state_mib": round(total / 2**20),
                    "torch_save_s": round(torch_save, 3),
                    "torch_save_fsync_s": round(torch_save + fsync, 3),
                    "save_state_blocking_s": round(blocking, 3),
                    "save_state_commit_s": round(info.commit_seconds, 3),
                }
            )
        mgr.close()

    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"state: {total / 2**20:.0f} MiB in {3 * args.tensors + 1} tensors; torch {torch.__version__}"
    )
    print(f"{'round':>5} {'torch.save':>11} {'+fsync':>9} {'save_state':>11} {'(commit)':>9}")
    for row in rows:
        print(
            f"{row['round']:>5} {row['torch_save_s']:>10.3f}s {row['torch_save_fsync_s']:>8.3f}s "
            f"{row['save_state_blocking_s']:>10.3f}s {row['save_state_commit_s']:>8.3f}s"
        )
    steady = rows[1:] or rows
    print(
        "steady state (rounds 2+), median blocking: "
        f"torch.save {statistics.median(r['torch_save_s'] for r in steady):.3f}s, "
        f"save_state {statistics.median(r['save_state_blocking_s'] for r in steady):.3f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
