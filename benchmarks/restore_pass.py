"""Restore into memory, variant by variant (issue 31: client CPU of ``load_state``).

    python -m benchmarks.restore_pass --rounds 7     # 1 GiB in 8 tensors, each variant per round

Saves one ``save_state`` checkpoint (default chunking) to the benchmark S3 endpoint (its own
process; unsigned payload), then loads it into new tensors with ``load_state`` from a new
manager (an empty staging directory: every byte from the store, verified) once per variant
per round, in one process, the order alternated each round; obstore's unverified ranged
reads of the same bytes (a safetensors file) into new tensors in the same rounds. Variants
(``--variants``): ``before`` (the buffers as they were: ``bytearray`` scratch buffers, new
tensors' pages faulted in one by one), ``unpopulated`` (page-aligned scratch buffers, pages
faulted in one by one) and ``now`` (what cloudckpt does: also each range's pages mapped in
one call before it lands); ``botocore-get`` (``now`` with every ranged GET through botocore,
not the lean GET of ``cloudckpt/stores/_s3_fast_get.py``). ``--same-host``: load from the writer's kept local copy instead. Prints each one's
client CPU-seconds per GiB (``time.process_time``) and wall time: median and range.
Nothing is asserted; with the machine shared, compare within one run.

    python -m benchmarks.restore_pass --kept-copy-pass   # a kept copy's pass, per buffer
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


@contextlib.contextmanager
def _before() -> Iterator[None]:
    """The read buffers as they were before page-aligned restore buffers."""
    from cloudckpt.integrations import _torch_restore as tr

    saved = tr.TensorSink.scratch, tr.populate

    def scratch(self: Any, size: int) -> memoryview:
        if self.ops is None:
            return memoryview(bytearray(size))
        return saved[0](self, size)

    tr.TensorSink.scratch = scratch  # type: ignore[method-assign]
    tr.populate = lambda address, nbytes: None
    try:
        yield
    finally:
        tr.TensorSink.scratch, tr.populate = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def _unpopulated() -> Iterator[None]:
    """What cloudckpt does, but new tensors' pages fault in one at a time."""
    from cloudckpt.integrations import _torch_restore as tr

    saved = tr.populate
    tr.populate = lambda address, nbytes: None
    try:
        yield
    finally:
        tr.populate = saved


@contextlib.contextmanager
def _botocore_get() -> Iterator[None]:
    """What cloudckpt does, but every ranged GET through botocore (the lean GET of
    ``_s3_fast_get`` never ready: as ``SAVINGS["lean_get"]`` off, for stores already made)."""
    from cloudckpt.stores import _s3_fast_get

    saved = _s3_fast_get.FastGet.ready
    _s3_fast_get.FastGet.ready = property(lambda self: False)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        _s3_fast_get.FastGet.ready = saved  # type: ignore[method-assign]


def kept_copy_pass(mib: int, rounds: int) -> None:
    """``fetch._pread_leaves`` (a kept copy read 512 KiB at a time, each piece hashed while
    hot: ``verify_local``'s and ``verify_files``' path) of a ``mib`` MiB file in the page
    cache into a 16 MiB ``bytearray`` against a page-aligned buffer, alternated; thread
    CPU-s per GiB."""
    import os

    from cloudckpt import fetch, transfer

    work = Path(tempfile.mkdtemp(prefix="cloudckpt-kept-pass-"))
    try:
        path = work / "f.bin"
        path.write_bytes(os.urandom(mib * MiB))
        bufs = {
            "bytearray": memoryview(bytearray(16 * MiB)),
            "aligned": transfer.aligned_buffer(16 * MiB),
        }
        cpu: dict[str, list[float]] = {k: [] for k in bufs}
        for r in range(rounds + 1):
            for name in list(bufs) if r % 2 == 0 else list(bufs)[::-1]:
                c0 = time.thread_time()
                for off in range(0, mib * MiB, 16 * MiB):
                    fetch._pread_leaves(path, off, bufs[name], 8 * MiB, None, False)
                if r:
                    cpu[name].append((time.thread_time() - c0) * GiB / (mib * MiB))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"kept copy of {mib} MiB read and hashed, {rounds} rounds; thread CPU-s per GiB")
    for name, xs in cpu.items():
        print(f"  {name:<9} median {statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.restore_pass", description=__doc__.split("\n")[0]
    )
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--variants", default="before,unpopulated,now")
    p.add_argument("--no-obstore", action="store_true")
    p.add_argument(
        "--same-host",
        action="store_true",
        help="load from the writer's kept local copy (verified, nothing downloaded)",
    )
    p.add_argument(
        "--kept-copy-pass",
        action="store_true",
        help="only time a kept copy's read-and-hash pass into each kind of buffer",
    )
    args = p.parse_args(argv)
    if args.kept_copy_pass:
        kept_copy_pass(min(args.mib, 256), args.rounds)
        return 0

    import torch
    from safetensors.torch import save_file

    from benchmarks.harness import S3Target
    from benchmarks.peers import Peers
    from benchmarks.resume import obstore_into_buffers
    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import load_state, save_state

    variants: dict[str, Callable[[], Any]] = {
        "before": _before,
        "unpopulated": _unpopulated,
        "now": contextlib.nullcontext,
        "botocore-get": _botocore_get,
    }
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(wanted) - set(variants):
        raise SystemExit(f"--variants takes {', '.join(variants)}")

    s3t = S3Target("bench")
    work = Path(tempfile.mkdtemp(prefix="cloudckpt-restore-pass-"))
    try:
        n = max(1, args.tensors)
        numel = args.mib * MiB // 4 // n
        torch.manual_seed(1)
        state = {f"layer{i}.weight": torch.randn(numel) for i in range(n)}
        gib = sum(t.numel() * t.element_size() for t in state.values()) / GiB
        url, options = s3t.url("ck/"), s3t.storage_options("unsigned")
        writer = CheckpointManager(
            url, storage_options=options, staging_dir=work / "w", keep_local=int(args.same_host)
        )
        save_state(writer, 1, state).result()
        if not args.same_host:
            writer.close()
        save_file(state, str(work / "state.safetensors"))
        st_key = f"{s3t.root}obstore/state.safetensors"
        st_size = (work / "state.safetensors").stat().st_size
        s3t.boto3_client("unsigned").upload_file(
            str(work / "state.safetensors"), s3t.bucket, st_key
        )
        (work / "state.safetensors").unlink()
        first = next(iter(state))
        expected = state[first].clone()
        state.clear()
        peers = Peers(s3t, "unsigned")
        reader = CheckpointManager(
            url, storage_options=options, staging_dir=work / "r", keep_local=0
        )
        order = [*wanted] + ([] if args.no_obstore else ["obstore"])
        print("loading", flush=True)  # (a profiler attached now sees the loads alone)
        cpu: dict[str, list[float]] = {v: [] for v in order}
        wall: dict[str, list[float]] = {v: [] for v in order}
        for r in range(args.rounds + 1):  # round 0: warm-up (connections, allocator)
            for name in order if r % 2 == 0 else order[::-1]:
                c0, w0 = time.process_time(), time.perf_counter()
                if name == "obstore":
                    got = obstore_into_buffers(peers.obstore(), st_key, st_size, 16 * MiB)
                else:
                    with variants[name]():
                        got = load_state(writer if args.same_host else reader)
                took, took_wall = time.process_time() - c0, time.perf_counter() - w0
                if not torch.equal(got[first], expected):
                    raise AssertionError(f"{name}: {first} differs")
                del got
                if r:
                    cpu[name].append(took / gib)
                    wall[name].append(took_wall / gib)
        reader.close()
        writer.close()
        peers.close()
    finally:
        s3t.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.mib} MiB in {args.tensors} tensors, {args.rounds} rounds; per GiB")
    for name in order:
        xs, ws = cpu[name], wall[name]
        print(
            f"  {name:<8} client CPU-s median {statistics.median(xs):.3f} "
            f"[{min(xs):.3f}-{max(xs):.3f}]  wall s median {statistics.median(ws):.3f} "
            f"[{min(ws):.3f}-{max(ws):.3f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
