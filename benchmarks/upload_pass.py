"""The upload's read-and-digest pass, variant by variant (issue 31 item 5: client CPU).

    python -m benchmarks.upload_pass --rounds 9                     # whole files
    python -m benchmarks.upload_pass --rounds 9 --chunking tensor   # the default: chunks

Saves the same files with ``save_dir`` to the benchmark S3 endpoint (its own process;
unsigned payload), in one process, swapping the pass per save; obstore's ``put`` of the
same files in the same rounds. The order alternates each round. Prints each one's client
CPU-seconds per GiB (``time.process_time``): median and range. Nothing is asserted; with
the machine shared, compare within one run.

``--chunking off`` (as the ``s3-upload`` group): random files, saved whole. Variants:
``before`` (each part read whole into a ``bytearray``, then hashed), ``aligned`` (read
whole into page-aligned buffers), ``blocks`` (read 1 MiB at a time and hashed at once,
into ``bytearray`` buffers) and ``now`` (both, what cloudckpt does).

``--chunking tensor`` (what a save does by default): safetensors files of random tensors
of 0.25 to 13 MiB, so that most 8 MiB leaves hold a tensor cut and are uploaded as several
chunks; each save is a full one (the chunk index is emptied before it: a first save, or a
full fine-tune's). Variants: ``before`` (the pass of d42641b: each leaf read whole into a
page-aligned buffer, then hashed on BLAKE3's threads, each of its cut chunks hashed again,
a chunk's CRC32C computed in the pass only for a leaf of one chunk, else by the store) and
``now`` (the leaf read 1 MiB at a time, each block hashed into the leaf and its chunk and
CRC'd while in cache: ``digest.leaf_and_pieces_as_read``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
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


def _safetensors_files(root: Path, total: int, count: int) -> list[Path]:
    """``count`` safetensors files of random uint8 tensors (0.25 to 13 MiB each, most at
    least ``chunks.MIN_PIECE``: their starts and ends cut the leaves) of ``total`` bytes."""
    import os

    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(31)
    block = os.urandom(16 * MiB)
    paths = []
    for i in range(count):
        sizes, left = [], total // count
        while left > 0:
            n = min(left, rng.choice([MiB // 4, 3 * MiB // 2, 3 * MiB, 5 * MiB + 4096, 13 * MiB]))
            sizes.append(n)
            left -= n
        header: dict[str, Any] = {}
        at = 0
        for j, n in enumerate(sizes):
            header[f"t{j}"] = {"dtype": "U8", "shape": [n], "data_offsets": [at, at + n]}
            at += n
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        path = root / f"shard-{i:02d}.safetensors"
        with open(path, "wb") as f:
            f.write(len(head).to_bytes(8, "little") + head)
            f.write(i.to_bytes(8, "big"))  # files differ
            left = at - 8
            while left > 0:
                start = rng.randrange(MiB)
                n = min(left, len(block) - start)
                f.write(block[start : start + n])
                left -= n
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.upload_pass", description=__doc__.split("\n")[0]
    )
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--chunking", choices=("off", "tensor"), default="off")
    p.add_argument("--variants", default="", help="default: all of the --chunking's")
    args = p.parse_args(argv)

    from benchmarks.harness import S3Target, whole_file_upload
    from benchmarks.peers import Peers
    from cloudckpt import CheckpointManager, chunks, digest, transfer

    now_pass = transfer.TransferEngine.reading_digested
    now_span = chunks._Uploader.span

    @contextlib.contextmanager
    def whole_pass(
        self: Any, source: Any, offset: int, length: int
    ) -> Iterator[tuple[memoryview, list[bytes], int]]:
        with self.reading(source, offset, length) as data:  # read whole, then one pass
            leaves, crc = digest.leaves_and_crc32c(data)
            yield data, leaves, crc

    def before_span(self: Any, source: Any, offset: int, pieces: list[tuple[int, int]]) -> Any:
        """``_Uploader.span`` as of d42641b (read whole, then hashed; cut chunks again)."""
        length = sum(n for _, n in pieces)
        with self.engine.reading(source, offset, length) as data:
            crcs = None
            if not self.index and len(pieces) == 1:
                leaf, crc = digest.leaf_and_crc32c(data, self.algorithm)
                names, crcs = [leaf], [crc]
            else:
                leaf = digest.leaf(data, self.algorithm)
                names = [
                    leaf
                    if n == length
                    else digest.leaf(data[o - offset : o - offset + n], self.algorithm)
                    for o, n in pieces
                ]
            return self._span(data, offset, pieces, leaf, names, crcs)

    # name: (whole-file pass, chunk pass, part buffers)
    variants: dict[str, tuple[Any, Any, Any]] = (
        {
            "before": (whole_pass, now_span, bytearray),
            "aligned": (whole_pass, now_span, transfer.aligned_buffer),
            "blocks": (now_pass, now_span, bytearray),
            "now": (now_pass, now_span, transfer.aligned_buffer),
        }
        if args.chunking == "off"
        else {
            "before": (now_pass, before_span, transfer.aligned_buffer),
            "now": (now_pass, now_span, transfer.aligned_buffer),
        }
    )
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()] or list(variants)
    if set(wanted) - set(variants):
        raise SystemExit(f"--variants takes {', '.join(variants)} with --chunking {args.chunking}")
    pools: dict[str, Any] = {v: transfer.BufferPool(variants[v][2], 16) for v in wanted}

    s3t = S3Target("bench")
    work = Path(tempfile.mkdtemp(prefix="cloudckpt-upload-pass-"))
    try:
        if args.chunking == "off":
            files, gib, mgr = whole_file_upload(s3t, work, args.mib, args.files)
        else:
            files = _safetensors_files(work / "src", args.mib * MiB, args.files)
            gib = sum(f.stat().st_size for f in files) / GiB
            mgr = CheckpointManager(
                s3t.url("ck/"),
                storage_options=s3t.storage_options("unsigned"),
                staging_dir=work / "staging",
                keep_last=1,
                auto_gc=False,
                chunking="tensor",
            )
        peers = Peers(s3t, "unsigned")
        cpu: dict[str, list[float]] = {v: [] for v in [*wanted, "obstore"]}
        order = [*wanted, "obstore"]
        step = 0
        for r in range(args.rounds + 1):  # round 0: warm-up (buffers, connections)
            for name in order if r % 2 == 0 else order[::-1]:
                if args.chunking != "off":
                    mgr.attempts._chunk_index = chunks.ChunkIndex()  # a full save
                c0 = time.process_time()
                if name == "obstore":
                    peers.obstore_upload(files, f"{s3t.root}obstore/{r}/")
                    took = time.process_time() - c0
                    s3t.drop("obstore/")
                else:
                    file_pass, span, _ = variants[name]
                    transfer.TransferEngine.reading_digested = file_pass  # type: ignore[method-assign]
                    chunks._Uploader.span = span  # type: ignore[method-assign]
                    mgr.engine._part_buffers = pools[name]
                    step += 1
                    info = mgr.save_dir(step, files[0].parent).result()
                    took = time.process_time() - c0
                    s3t.drop(f"ck/{info.ckpt}")
                if r:
                    cpu[name].append(took / gib)
        transfer.TransferEngine.reading_digested = now_pass  # type: ignore[method-assign]
        chunks._Uploader.span = now_span  # type: ignore[method-assign]
        mgr.close()
        peers.close()
    finally:
        s3t.close()
        shutil.rmtree(work, ignore_errors=True)
    obstore = statistics.median(cpu["obstore"])
    print(
        f"{args.mib} MiB in {args.files} files, chunking={args.chunking}, {args.rounds} rounds; "
        "client CPU-s per GiB"
    )
    for name, xs in cpu.items():
        med = statistics.median(xs)
        print(
            f"  {name:<8} median {med:.3f}  [{min(xs):.3f}-{max(xs):.3f}]  "
            f"obstore / this {obstore / med:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
