"""What peer copies cost a save (issue 30 item 4): ``python -m benchmarks.peer_cost``.

2 simulated hosts x 2 ranks under torchrun (gloo on 127.0.0.1, ``node_id``), a ``file://``
store and a staging directory per host. Each rank saves ``--mib`` of random bytes (nothing
replicated, so each host's whole share travels to the other after every commit), with two
managers side by side, ``peer_copies=1`` and ``peer_copies=0``, rounds interleaved (the
order alternating), each save timed on every rank from ``save()`` until its
``handle.result()`` returned (the commit, the local copies and, with peer copies, the
transfer). Every save's content is new, so every chunk travels. Prints one JSON object:
the medians, their difference, the bytes host 0 holds for host 1 at the end, and the
transfer rate that difference implies (both hosts send their share at once).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
HOSTS, PER_HOST = 2, 2


def worker(root: Path, mib: int, rounds: int) -> None:
    import torch.distributed as dist

    from cloudckpt.distributed import DistributedCheckpointManager

    rank = int(os.environ["RANK"])
    host = rank // PER_HOST
    dist.init_process_group("gloo")
    mgrs = {
        k: DistributedCheckpointManager(
            f"file://{root}/store-{k}",
            staging_dir=root / f"host{host}" / f"staging-{k}",
            node_id=f"host{host}",
            timeout=300,
            peer_copies=k,
        )
        for k in (1, 0)
    }
    times: dict[int, list[float]] = {1: [], 0: []}
    for step in range(1, rounds + 1):
        for k in (1, 0) if step % 2 else (0, 1):
            data = random.Random(f"{k}/{step}/{rank}").randbytes(mib * MiB)
            dist.barrier()
            started = time.monotonic()
            handle = mgrs[k].save(step)
            with handle as d:
                (d / "shard.bin").write_bytes(data)
            info = handle.result()
            dist.barrier()
            times[k].append(time.monotonic() - started)
            if info.warnings:
                raise RuntimeError(f"unexpected warnings: {info.warnings}")
    for mgr in mgrs.values():
        mgr.close()
    if rank == 0:
        chunks = root / "host0" / "staging-1" / "rank-00000" / "peers" / "chunks"
        held = sum(p.stat().st_size for p in chunks.iterdir())
        on, off = statistics.median(times[1]), statistics.median(times[0])
        moved = HOSTS * PER_HOST * mib * MiB
        print(
            json.dumps(
                {
                    "mib_per_rank": mib,
                    "rounds": rounds,
                    "save_s_peer_copies_1": times[1],
                    "save_s_peer_copies_0": times[0],
                    "median_s_peer_copies_1": on,
                    "median_s_peer_copies_0": off,
                    "peer_copy_s": on - off,
                    "held_by_host0_bytes": held,
                    "implied_mib_per_s": moved / MiB / (on - off) if on > off else None,
                }
            )
        )
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=64, help="bytes each rank saves (MiB)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args.mib, args.rounds)
        return 0
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="peer-cost-") as tmp:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={HOSTS * PER_HOST}", "--master_addr=127.0.0.1",
            f"--master_port={port}", "--max-restarts=0", "-m", "benchmarks.peer_cost",
            "--worker", tmp, "--mib", str(args.mib), "--rounds", str(args.rounds),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.run(cmd, env=env, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
