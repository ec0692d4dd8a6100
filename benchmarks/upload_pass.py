"""The upload's read-and-digest pass, variant by variant (issue 31 item 5: client CPU).

    python -m benchmarks.upload_pass --rounds 9                     # whole files
    python -m benchmarks.upload_pass --rounds 9 --chunking tensor   # the default: chunks
    python -m benchmarks.upload_pass --rounds 9 --names             # dedup's naming pass

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

``--names``: no store and no save; the naming pass of a multi-rank save's cross-rank dedup
(``distributed._chunks.chunk_names``) over the same safetensors files, staged and in the
page cache, tensor chunking. Variants: ``before`` (the pass of 7bf9735: each leaf read
whole into a part buffer, then each chunk hashed cold, on BLAKE3's threads for a chunk of
at least 1 MiB) and ``now`` (1 MiB at a time, each block hashed into its chunk while in
cache, no leaf digest: ``digest.pieces_as_read``); ``leaf`` is ``now`` with the leaf's
digest computed too (the upload's ``digest.leaf_and_pieces_as_read``: what the chunk-only
pass saves). All must give the same names. Process CPU (BLAKE3's threads included) and
wall seconds per GiB.
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
    p.add_argument("--names", action="store_true", help="time chunk_names only (no store)")
    args = p.parse_args(argv)
    if args.names:
        return _names(args)

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


def _names(args: argparse.Namespace) -> int:
    """``--names``: ``chunk_names`` before and now, alternated in one process."""
    from cloudckpt import chunks, digest, transfer
    from cloudckpt.distributed import _chunks
    from cloudckpt.manifests import ChunkRef

    def before(engine: Any, files: list[tuple[str, Path]], mode: Any) -> frozenset[str]:
        """``chunk_names`` as of 7bf9735: each leaf read whole, each chunk hashed after."""
        algorithm = digest.check(None)

        def span(source: Path, offset: int, pieces: list[tuple[int, int]]) -> list[str]:
            length = sum(n for _, n in pieces)
            with engine.reading(source, offset, length) as data:
                return [
                    ChunkRef(
                        "",
                        digest.hexleaf(data[o - offset : o - offset + n], algorithm),
                        n,
                        algorithm,
                    ).name
                    for o, n in pieces
                ]

        futures = []
        for rel, source in files:
            size = source.stat().st_size
            spans: dict[int, list[tuple[int, int]]] = {}
            for off, n in chunks.plan(source, size, mode, name=rel.rsplit("/", 1)[-1]):
                spans.setdefault(off // chunks.LEAF * chunks.LEAF, []).append((off, n))
            futures += [engine.submit(span, source, at, p) for at, p in sorted(spans.items())]
        return frozenset(n for names in engine.wait_all(futures) for n in names)

    def with_leaf(engine: Any, files: list[tuple[str, Path]], mode: Any) -> frozenset[str]:
        """``now`` on the upload's pass, the leaf's digest computed beside its chunks'."""
        only = digest.pieces_as_read

        def leaf_too(buf: Any, read: Any, sizes: Any, algorithm: Any = None) -> list[bytes]:
            return digest.leaf_and_pieces_as_read(buf, read, sizes, algorithm)[1]

        digest.pieces_as_read = leaf_too
        try:
            return _chunks.chunk_names(engine, files, mode)
        finally:
            digest.pieces_as_read = only

    variants = {"before": before, "leaf": with_leaf, "now": _chunks.chunk_names}
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()] or list(variants)
    if set(wanted) - set(variants):
        raise SystemExit(f"--variants takes {', '.join(variants)} with --names")
    work = Path(tempfile.mkdtemp(prefix="cloudckpt-names-pass-"))
    try:
        paths = _safetensors_files(work / "src", args.mib * MiB, args.files)
        files = [(f"rank-00000/{p.name}", p) for p in paths]
        gib = sum(p.stat().st_size for p in paths) / GiB
        engine = transfer.TransferEngine()  # the default config, as a save's
        cpu: dict[str, list[float]] = {v: [] for v in wanted}
        wall: dict[str, list[float]] = {v: [] for v in wanted}
        seen: set[frozenset[str]] = set()
        for r in range(args.rounds + 1):  # round 0: warm-up (page cache, buffers, threads)
            for name in wanted if r % 2 == 0 else wanted[::-1]:
                c0, t0 = time.process_time(), time.perf_counter()
                names = variants[name](engine, files, "tensor")
                took, waited = time.process_time() - c0, time.perf_counter() - t0
                seen.add(names)
                if r:
                    cpu[name].append(took / gib)
                    wall[name].append(waited / gib)
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len(seen) != 1:
        raise SystemExit("the variants named the chunks differently")
    print(
        f"chunk_names of {args.mib} MiB in {args.files} safetensors files ({len(names)} chunks), "
        f"{args.rounds} rounds; process CPU-s and wall s per GiB"
    )
    for name in wanted:
        c, w = cpu[name], wall[name]
        print(
            f"  {name:<8} CPU median {statistics.median(c):.3f}  [{min(c):.3f}-{max(c):.3f}]  "
            f"wall median {statistics.median(w):.3f}  [{min(w):.3f}-{max(w):.3f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
