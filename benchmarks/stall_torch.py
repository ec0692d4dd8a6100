"""How long a checkpoint holds the training loop: ``save_state`` vs ``torch.save``.

    python benchmarks/stall_torch.py [--mib 256] [--tensors 64] [--weights-only]
        [--rounds 4] [--hogs N] [--dir DIR] [--json]

Builds a state like a training loop's (model weights plus AdamW's two moment buffers, fp32,
so 3 x --mib MiB in all, in --tensors tensors each; ``--weights-only``: the weights alone,
the shape of ``python -m benchmarks --groups torch``'s state with ``--mib 1024 --tensors
8``), then per round measures the time the caller is blocked by:

- ``torch.save(state, file)`` to local disk (page cache; the usual baseline);
- the same followed by ``fsync`` (what it costs to be durable locally);
- ``save_state(manager, step, state)``: the copy into reused host buffers (round 1 also
  allocates them); files are written and committed (to a ``file://`` store on the same
  disk) in the background, and the time to commit is shown for scale.

Between rounds the state is modified, as training would. ``--hogs N`` runs N busy CPU
hogs beside it (a training job's data loaders, a noisy neighbour), as the benchmark's
``--hogs`` does; each round says whether they were all still running. The summary gives
the median and range of the stall and of the per-round ratio ``torch.save / save_state``
over rounds 2+. Not a test: nothing is asserted.
CPU tensors only; on a GPU the copy goes to pinned buffers (device-to-host bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="model size in MiB (state is 3x)")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--weights-only", action="store_true", help="no optimizer state")
    parser.add_argument("--hogs", type=int, default=0, help="busy CPU hogs to run beside it")
    parser.add_argument("--dir", help="local directory for files and the store (default: tmp)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch

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
    if args.weights_only:
        state = {"model": model, "step": 0}
    optimizer = state.get("optimizer", {"state": {}})
    total = sum(
        t.numel() * t.element_size()
        for t in [*model.values()] + [v for s in optimizer["state"].values() for v in s.values()]
    )

    # A loop other tools' "pkill -f 'while True'" does not match.
    hogs = [
        subprocess.Popen([sys.executable, "-c", "for _ in iter(int, 1): pass"])
        for _ in range(args.hogs)
    ]
    try:
        rows = _rounds(args, state, model, total, hogs)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    _report(args, rows, total, torch.__version__)
    return 0


def _rounds(
    args: argparse.Namespace,
    state: dict,
    model: dict,
    total: int,
    hogs: list[subprocess.Popen[bytes]],
) -> list[dict]:
    import torch

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import save_state

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
                    "ratio": round(torch_save / blocking, 2) if blocking > 0 else None,
                    "hogs_alive": all(h.poll() is None for h in hogs),
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }
            )
        mgr.close()
    return rows


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def _report(args: argparse.Namespace, rows: list[dict], total: int, version: str) -> None:
    steady = rows[1:] or rows
    summary = {
        "torch_save_s": [r["torch_save_s"] for r in steady],
        "save_state_blocking_s": [r["save_state_blocking_s"] for r in steady],
        "ratio": [r["ratio"] for r in steady if r["ratio"] is not None],
    }
    if args.json:
        print(json.dumps({"hogs": args.hogs, "rounds": rows}, indent=2))
        return
    n = args.tensors if args.weights_only else 3 * args.tensors + 1
    print(f"state: {total / 2**20:.0f} MiB in {n} tensors; torch {version}")
    print(
        f"{'round':>5} {'torch.save':>11} {'+fsync':>9} {'save_state':>11} {'(commit)':>9} "
        f"{'ratio':>7} {'hogs':>5} {'load':>5}"
    )
    for row in rows:
        ratio = f"{row['ratio']:.1f}x" if row["ratio"] is not None else "-"
        print(
            f"{row['round']:>5} {row['torch_save_s']:>10.3f}s {row['torch_save_fsync_s']:>8.3f}s "
            f"{row['save_state_blocking_s']:>10.3f}s {row['save_state_commit_s']:>8.3f}s "
            f"{ratio:>7} {'up' if row['hogs_alive'] else 'DEAD':>5} {row['load_avg_1m']:>5.1f}"
        )
    print(f"rounds 2+, median (range), {args.hogs} hogs:")
    for key, xs in summary.items():
        if xs:
            print(f"  {key:<22} {_spread(xs)}")


if __name__ == "__main__":
    sys.exit(main())
