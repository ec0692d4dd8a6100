"""The upload's read-and-digest pass, variant by variant (issue 31 item 5: client CPU).

    python -m benchmarks.upload_pass --rounds 9      # 1 GiB in 8 files, each variant per round

Saves the same files with ``save_dir`` (``chunking="off"``, as the ``s3-upload`` group) to
the benchmark S3 endpoint (its own process; unsigned payload), in one process, swapping
the part pass per save: ``before`` (each part read whole into a ``bytearray``, then
hashed), ``aligned`` (read whole into page-aligned buffers), ``blocks`` (read 1 MiB at a
time and hashed at once, into ``bytearray`` buffers) and ``now`` (both, what cloudckpt
does); obstore's ``put`` of the same files in the same rounds. The order alternates each
round. Prints each one's client CPU-seconds per GiB (``time.process_time``): median and
range. Nothing is asserted; with the machine shared, compare within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.upload_pass", description=__doc__.split("\n")[0]
    )
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--variants", default="before,aligned,blocks,now")
    args = p.parse_args(argv)

    from benchmarks.harness import S3Target, whole_file_upload
    from benchmarks.peers import Peers
    from cloudckpt import digest, transfer

    now_pass = transfer.TransferEngine.reading_digested

    @contextlib.contextmanager
    def whole_pass(
        self: Any, source: Any, offset: int, length: int
    ) -> Iterator[tuple[memoryview, list[bytes], int]]:
        with self.reading(source, offset, length) as data:  # read whole, then one pass
            leaves, crc = digest.leaves_and_crc32c(data)
            yield data, leaves, crc

    variants: dict[str, tuple[Any, Any]] = {
        "before": (whole_pass, bytearray),
        "aligned": (whole_pass, transfer.aligned_buffer),
        "blocks": (now_pass, bytearray),
        "now": (now_pass, transfer.aligned_buffer),
    }
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(wanted) - set(variants):
        raise SystemExit(f"--variants takes {', '.join(variants)}")
    pools: dict[str, Any] = {v: transfer.BufferPool(variants[v][1], 16) for v in wanted}

    s3t = S3Target("bench")
    work = Path(tempfile.mkdtemp(prefix="cloudckpt-upload-pass-"))
    try:
        files, gib, mgr = whole_file_upload(s3t, work, args.mib, args.files)
        peers = Peers(s3t, "unsigned")
        cpu: dict[str, list[float]] = {v: [] for v in [*wanted, "obstore"]}
        order = [*wanted, "obstore"]
        step = 0
        for r in range(args.rounds + 1):  # round 0: warm-up (buffers, connections)
            for name in order if r % 2 == 0 else order[::-1]:
                c0 = time.process_time()
                if name == "obstore":
                    peers.obstore_upload(files, f"{s3t.root}obstore/{r}/")
                    took = time.process_time() - c0
                    s3t.drop("obstore/")
                else:
                    transfer.TransferEngine.reading_digested = variants[name][0]  # type: ignore[method-assign]
                    mgr.engine._part_buffers = pools[name]
                    step += 1
                    info = mgr.save_dir(step, files[0].parent).result()
                    took = time.process_time() - c0
                    s3t.drop(f"ck/{info.ckpt}")
                if r:
                    cpu[name].append(took / gib)
        transfer.TransferEngine.reading_digested = now_pass  # type: ignore[method-assign]
        mgr.close()
        peers.close()
    finally:
        s3t.close()
        shutil.rmtree(work, ignore_errors=True)
    obstore = statistics.median(cpu["obstore"])
    print(f"{args.mib} MiB in {args.files} files, {args.rounds} rounds; client CPU-s per GiB")
    for name, xs in cpu.items():
        med = statistics.median(xs)
        print(
            f"  {name:<8} median {med:.3f}  [{min(xs):.3f}-{max(xs):.3f}]  "
            f"obstore / this {obstore / med:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
