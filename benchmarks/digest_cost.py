"""The cost of hashing every byte once (issue 31, items 1-2): ``python -m benchmarks.digest_cost``.

One buffer (default 256 MiB of random bytes, in memory) is hashed as a save hashes it: in
8 MiB leaves, each by one call (the pipeline's workers hash leaves side by side; here one
thread, to price one core). Variants, each timed in the same process, rounds interleaved,
median wall and CPU seconds:

- ``sha256``: the ``sha256-tree`` leaves (hashlib; SHA-NI where the CPU has it);
- ``blake3``: ``blake3-tree`` leaves, one thread per leaf;
- ``blake3-mt``: the same with ``max_threads=AUTO`` (what ``cloudckpt.digest`` uses for
  buffers of 1 MiB and more);
- ``blake3+crc32c``: BLAKE3 leaf, then the S3 transfer checksum (CRC32C) of the same leaf
  in a second pass over it, as a save does today;
- ``blake3+crc32c-fused``: both in one pass, 1 MiB block by block, so the CRC reads bytes
  BLAKE3 has just brought into cache;
- ``crc32c``: the CRC alone.

``--hogs N`` starts N busy-looping processes first (``python -c 'while 1: pass'``) and
stops them at the end. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import blake3

from cloudckpt import _crc32c

LEAF = 8 * 1024 * 1024
BLOCK = 1024 * 1024


def _variants(view: memoryview) -> dict[str, Callable[[], object]]:
    leaves = [view[i : i + LEAF] for i in range(0, len(view), LEAF)]
    auto = blake3.blake3.AUTO

    def sha256() -> object:
        import hashlib

        return [hashlib.sha256(x).digest() for x in leaves]

    def b3() -> object:
        return [blake3.blake3(x).digest() for x in leaves]

    def b3_mt() -> object:
        return [blake3.blake3(x, max_threads=auto).digest() for x in leaves]

    def b3_crc() -> object:
        return [(blake3.blake3(x).digest(), _crc32c.value(x)) for x in leaves]

    def b3_crc_fused() -> object:
        out = []
        for x in leaves:
            h, crc = blake3.blake3(), 0
            for i in range(0, len(x), BLOCK):
                block = x[i : i + BLOCK]
                h.update(block)
                crc = _crc32c.extend(crc, block)
            out.append((h.digest(), crc))
        return out

    def crc() -> object:
        return [_crc32c.value(x) for x in leaves]

    return {
        "sha256": sha256,
        "blake3": b3,
        "blake3-mt": b3_mt,
        "blake3+crc32c": b3_crc,
        "blake3+crc32c-fused": b3_crc_fused,
        "crc32c": crc,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hogs", type=int, default=0)
    args = ap.parse_args(argv)
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.hogs)]
    try:
        view = memoryview(os.urandom(args.mib * 1024 * 1024))
        variants = _variants(view)
        for fn in variants.values():  # warm up (page faults, thread pools)
            fn()
        walls: dict[str, list[float]] = {k: [] for k in variants}
        cpus: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                walls[name].append(time.perf_counter() - t0)
                cpus[name].append(time.process_time() - c0)
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    gib = args.mib / 1024
    result = {
        "mib": args.mib,
        "rounds": args.rounds,
        "hogs": args.hogs,
        "cores": os.cpu_count(),
        "variants": {
            name: {
                "wall_s": round(statistics.median(walls[name]), 4),
                "cpu_s": round(statistics.median(cpus[name]), 4),
                "gib_per_s": round(gib / statistics.median(walls[name]), 3),
                "gib_per_cpu_s": round(gib / max(statistics.median(cpus[name]), 1e-9), 3),
            }
            for name in variants
        },
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
