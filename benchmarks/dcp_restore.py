"""The ``dcp`` group: DCP loads through cloudckpt's ``CloudStorageReader`` against
s3torchconnector's ``S3StorageReader``, at 2 ranks and resharded from 2 ranks to 3.

One torchrun job (gloo, CPU) saves a state of DTensors sharded (``Shard(0)``) over 2 ranks
through both writers; then one torchrun job per layout (2 ranks, 3 ranks) loads it through
both readers, rotating the order every round, and rank 0 writes every round's time
(barrier, ``dcp.load``, barrier) to a JSON file. The harness turns those samples into a
group (medians, per-round ratios) like every other group. Every rank checks its loaded
shard against the expected values once per contender.

Run as a worker: ``python -m torch.distributed.run --nproc_per_node=N -m
benchmarks.dcp_restore --phase save|load ...`` (``dcp_groups`` does this).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

MiB = 1 << 20
TENSORS = 8
COLS = 1024
READERS = ("cloudckpt CloudStorageReader", "DCP S3StorageReader")


# ----------------------------------------------------------------------------- the job


def _full_state(mib: int) -> dict[str, Any]:
    import torch

    rows = max(6, mib * MiB // 4 // COLS // TENSORS // 6 * 6)
    g = torch.Generator().manual_seed(7)
    return {f"layer{i}.weight": torch.randn(rows, COLS, generator=g) for i in range(TENSORS)}


def _sharded(full: dict[str, Any], mesh: Any, zeros: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        k: distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, [Shard(0)])
        for k, v in full.items()
    }


def _s3tc(cfg: dict[str, Any], kind: str) -> Any:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    config = S3ClientConfig(force_path_style=True, part_size=8 * MiB)
    cls = S3StorageWriter if kind == "writer" else S3StorageReader
    obj = cls(region="us-east-1", path=cfg["dcp_path"], s3client_config=config)
    fs: Any = obj.fs  # its S3FileSystem builds a client for AWS only: give it the endpoint
    fs._client = S3Client("us-east-1", endpoint=cfg["endpoint"], s3client_config=config)
    return obj


def _manager(cfg: dict[str, Any], name: str) -> Any:
    from cloudckpt.distributed import DistributedCheckpointManager

    rank = int(os.environ.get("RANK", "0"))
    return DistributedCheckpointManager(
        cfg["url"],
        storage_options=cfg["options"],
        staging_dir=Path(cfg["work"]) / f"staging-{name}-{rank}",
        auto_gc=False,
        timeout=120,
    )


def worker(cfg: dict[str, Any], phase: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from cloudckpt.integrations.dcp import CloudStorageReader, CloudStorageWriter

    warnings.filterwarnings("ignore")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", cfg["key"])
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", cfg["secret"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = _full_state(cfg["mib"])
    mgr = _manager(cfg, phase)
    try:
        if phase == "save":
            state = _sharded(full, mesh, zeros=False)
            dcp.save(state, storage_writer=CloudStorageWriter(mgr, step=1))
            dcp.save(state, storage_writer=_s3tc(cfg, "writer"))
            return
        expected = {k: v.to_local() for k, v in _sharded(full, mesh, zeros=False).items()}
        samples: dict[str, list[float]] = {n: [] for n in READERS}
        checked: set[str] = set()
        for r in range(cfg["rounds"]):
            k = r % len(READERS)
            for name in READERS[k:] + READERS[:k]:
                target = _sharded(full, mesh, zeros=True)
                reader = CloudStorageReader(mgr) if name.startswith("cloudckpt") else None
                dist.barrier()
                t0 = time.perf_counter()
                if reader is None:
                    reader = _s3tc(cfg, "reader")
                dcp.load(target, storage_reader=reader)
                dist.barrier()
                samples[name].append(time.perf_counter() - t0)
                if name not in checked:
                    for key, t in target.items():
                        if not t.to_local().equal(expected[key]):
                            raise AssertionError(f"rank {rank}: {name} loaded {key} wrong")
                    checked.add(name)
        if rank == 0:
            Path(cfg["out"]).write_text(json.dumps({"world": world, "samples": samples}))
    finally:
        mgr.close()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the group


def _launch(cfg: dict[str, Any], phase: str, nproc: int, timeout: float) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg_path = Path(cfg["work"]) / f"cfg-{phase}-{nproc}.json"
    cfg_path.write_text(json.dumps(cfg))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "--max-restarts=0",
        "-m",
        "benchmarks.dcp_restore",
        "--phase",
        phase,
        "--config",
        str(cfg_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the {nproc}-rank {phase} job failed:\n{proc.stdout[-3000:]}")


def dcp_groups(bench: Any, s3: Any, signing: str) -> None:
    """Save once with 2 ranks, then load at 2 ranks and at 3 (2 -> 3) through both readers."""
    from benchmarks.harness import Comparison, Contender, Group

    mib = bench.args.dcp_mib
    work = bench.work / "dcp"
    work.mkdir()
    cfg: dict[str, Any] = {
        "url": s3.url("dcp-ck/"),
        "options": s3.storage_options(signing),
        "dcp_path": f"s3://{s3.bucket}/{s3.root}dcp-s3tc/",
        "endpoint": s3.endpoint_url,
        "key": s3.creds.get("key", ""),
        "secret": s3.creds.get("secret", ""),
        "mib": mib,
        "work": str(work),
        "rounds": bench.args.warmup + bench.args.pairs,
    }
    _launch(cfg, "save", 2, 1200)
    nbytes = _full_state_bytes(mib)
    for world in (2, 3):
        out = work / f"load-{world}.json"
        _launch({**cfg, "out": str(out)}, "load", world, 3600)
        samples = json.loads(out.read_text())["samples"]

        def replay(name: str, samples: dict[str, list[float]] = samples) -> Any:
            return lambda r: {"s": samples[name][r]}

        group = Group(
            name=f"dcp-load-{world}",
            title=f"DCP load of {nbytes / (1 << 30):.2f} GiB saved by 2 ranks, loaded by "
            f"{world} ranks{' (resharded)' if world != 2 else ''} (gloo, S3 endpoint: "
            f"{s3.kind}, {signing} payload)",
            nbytes=nbytes,
            contenders=[
                Contender(
                    READERS[0],
                    replay(READERS[0]),
                    cloudckpt=True,
                    note="each rank streams its plan's byte ranges: only the chunks it "
                    "touches, each verified (SHA-256), no local file",
                ),
                Contender(
                    READERS[1],
                    replay(READERS[1]),
                    note="s3torchconnector's DCP reader; nothing verified",
                ),
            ],
            comparisons=[Comparison("s", READERS[1], 1.0, cloudckpt=READERS[0], label="dcp load")],
            servers={"server": s3.pid},
            info={
                "signing": signing,
                "endpoint": s3.kind,
                "world": world,
                "note": "times measured inside the torchrun job (barrier to barrier) and "
                "replayed here; cpu columns do not apply",
            },
        )
        bench.run(group)


def _full_state_bytes(mib: int) -> int:
    rows = max(6, mib * MiB // 4 // COLS // TENSORS // 6 * 6)
    return rows * COLS * 4 * TENSORS


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["save", "load"], required=True)
    p.add_argument("--config", required=True)
    args = p.parse_args()
    worker(json.loads(Path(args.config).read_text()), args.phase)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
