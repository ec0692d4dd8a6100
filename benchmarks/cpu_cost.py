"""Client CPU-seconds per GiB uploaded, and where they go (issue 24 item 7).

    python -m benchmarks.cpu_cost                       # 512 MiB in 4 files, 5 saves each
    python -m benchmarks.cpu_cost --concurrency 2       # fewer transfer threads
    python -m benchmarks.cpu_cost --without sha256,crc32c
    python -m benchmarks.cpu_cost --source state        # save_state of tensors in memory

Uploads the same files to the benchmark S3 endpoint (``benchmarks/s3_endpoint.py``, its
own process; unsigned payload) with cloudckpt's ``save_dir`` (``chunking="off"``, as the
throughput groups) and with obstore (``put_async`` per file, gathered), alternating, and
prints each one's client CPU-seconds per GiB (``time.process_time``: every thread of this
process) with the ratio of the medians. ``--source state``: cloudckpt saves the same bytes
as a state of CPU tensors with ``save_state`` (the copy into its host memory included),
obstore uploads the files. ``--without`` switches parts of cloudckpt's work
off by replacing them in this process only (``sha256``: the digest leaves; ``crc32c``: the
per-part CRC32C): the differences are what each part costs. Nothing is asserted; with the
machine shared, run it a few times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


def _saver(source: str, mgr: Any, files: list[Path]) -> Any:
    """``save(step) -> CommitInfo`` for the source: the directory, or a state of CPU
    tensors holding the same bytes (one per file)."""
    if source == "files":
        return lambda step: mgr.save_dir(step, files[0].parent).result()
    import torch

    from cloudckpt.integrations.torch import save_state

    state = {f.name: torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8) for f in files}
    return lambda step: save_state(mgr, step, state).result()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_cost", description=__doc__.split("\n")[0]
    )
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=16, help="cloudckpt transfer threads")
    p.add_argument("--without", default="", help="comma list of sha256, crc32c")
    p.add_argument("--source", choices=("files", "state"), default="files")
    args = p.parse_args(argv)

    from benchmarks.harness import S3Target, _write_files
    from benchmarks.peers import Peers
    from cloudckpt import CheckpointManager
    from cloudckpt.transfer import TransferConfig

    without = {w.strip() for w in args.without.split(",") if w.strip()}
    if without - {"sha256", "crc32c"}:
        raise SystemExit("--without takes sha256 and/or crc32c")
    if "sha256" in without:
        import cloudckpt.digest as digest

        digest.leaf = lambda chunk: b"\0" * 32  # type: ignore[assignment]
    if "crc32c" in without:
        import cloudckpt.stores.s3 as s3
        import cloudckpt.transfer as transfer

        s3.crc32c_b64 = transfer.crc32c_b64 = lambda data: "AAAAAA=="  # type: ignore[assignment]

    s3t = S3Target("bench")
    work = Path(tempfile.mkdtemp(prefix="cloudckpt-cpu-cost-"))
    try:
        files = _write_files(work / "src", args.mib * MiB, args.files)
        gib = sum(f.stat().st_size for f in files) / GiB
        mgr = CheckpointManager(
            s3t.url("ck/"),
            storage_options=s3t.storage_options("unsigned"),
            staging_dir=work / "staging",
            keep_last=1,
            auto_gc=False,
            chunking="off",
            transfer=TransferConfig(concurrency=args.concurrency),
        )
        peers = Peers(s3t, "unsigned")
        ck: list[float] = []
        obs: list[float] = []
        save = _saver(args.source, mgr, files)
        save(0)  # warm-up, unmeasured
        peers.obstore_upload(files, f"{s3t.root}obstore/warm/")
        for r in range(1, args.saves + 1):
            c0 = time.process_time()
            info = save(r)
            ck.append((time.process_time() - c0) / gib)
            s3t.drop(f"ck/{info.ckpt}")
            c0 = time.process_time()
            peers.obstore_upload(files, f"{s3t.root}obstore/{r}/")
            obs.append((time.process_time() - c0) / gib)
            s3t.drop("obstore/")
        mgr.close()
        peers.close()
    finally:
        s3t.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    med_ck, med_obs = statistics.median(ck), statistics.median(obs)
    label = f"cloudckpt (without {', '.join(sorted(without))})" if without else "cloudckpt"
    print(
        f"{args.mib} MiB in {args.files} files, {args.saves} saves each, concurrency {args.concurrency}"
    )
    print(f"  {label:<40} CPU-s per GiB: median {med_ck:.3f}  {sorted(round(x, 3) for x in ck)}")
    print(
        f"  {'obstore':<40} CPU-s per GiB: median {med_obs:.3f}  {sorted(round(x, 3) for x in obs)}"
    )
    print(f"  ratio cloudckpt / obstore: {med_ck / med_obs:.2f}x  (goal: <= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
