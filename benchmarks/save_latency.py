"""Blocking time of save() and time to commit, for a 256 MiB checkpoint, against moto.

    python benchmarks/save_latency.py [--mib 256] [--files 8] [--rounds 3] [--url URL]

Starts a moto S3 server on 127.0.0.1 (unless --url is given), saves ``--files`` files
totalling ``--mib`` MiB ``--rounds`` times, and prints per round: how long save() held the
caller (staging-directory creation and hand-over), how long the caller took to write the
files (the user's own I/O, for scale), and how long until LATEST named the checkpoint.
Not a test: nothing is asserted; figures depend on the machine (moto is CPU-bound at
roughly 0.1 GB/s, so commit times here measure moto more than cloudckpt).
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

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", help="run against this URL instead of a local moto server")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    from cloudckpt import CheckpointManager
    from cloudckpt.testing.moto_server import MotoServer

    server = None
    if args.url:
        url, options = args.url, {}
    else:
        server = MotoServer()
        server.start()
        server.create_bucket("bench")
        url, options = "s3://bench/save-latency", server.storage_options()
    per_file = args.mib * 1024 * 1024 // args.files
    payload = os.urandom(per_file)
    rows = []
    try:
        with (
            tempfile.TemporaryDirectory() as tmp,
            CheckpointManager(
                url, storage_options=options, staging_dir=Path(tmp) / "staging", keep_last=2
            ) as mgr,
        ):
            mgr.resume(into=Path(tmp) / "restore")
            for step in range(args.rounds):
                handle = mgr.save(step=step)
                t0 = time.perf_counter()
                with handle as d:
                    t1 = time.perf_counter()
                    for i in range(args.files):
                        (d / f"shard-{i:02d}.bin").write_bytes(payload)
                    t2 = time.perf_counter()
                info = handle.result()
                rows.append(
                    {
                        "step": step,
                        "bytes": info.total_bytes,
                        "save_blocking_s": info.blocking_seconds,
                        "caller_write_s": t2 - t1,
                        "with_block_s": t2 - t0,
                        "commit_s": info.commit_seconds,
                    }
                )
    finally:
        if server is not None:
            server.stop()
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print(f"{args.mib} MiB in {args.files} files to {url}")
    print(
        f"{'round':>5} {'save() blocking':>16} {'caller writes':>14} {'to commit':>10} {'MB/s':>7}"
    )
    for r in rows:
        mbps = r["bytes"] / r["commit_s"] / 1e6
        print(
            f"{r['step']:>5} {r['save_blocking_s'] * 1e3:>13.2f} ms {r['caller_write_s']:>12.2f} s"
            f" {r['commit_s']:>8.2f} s {mbps:>7.1f}"
        )
    print(
        f"median: save() blocking {statistics.median(r['save_blocking_s'] for r in rows) * 1e3:.2f} ms,"
        f" time to commit {statistics.median(r['commit_s'] for r in rows):.2f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
