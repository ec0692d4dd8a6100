"""Client CPU per S3 request: cloudckpt's S3Store against plain botocore and obstore.

    python -m benchmarks.request_cost                     # 1000 requests x 5 rounds
    python -m benchmarks.request_cost --ops get --requests 2000 --rounds 7
    python -m benchmarks.request_cost --profile get       # cProfile (CPU clock) of one loop
    python -m benchmarks.request_cost --off timestamps --contenders cloudckpt,cloudckpt-before
                                                          # one saving alone

Against the benchmark S3 endpoint (``benchmarks/s3_endpoint.py``, its own process, loopback,
unsigned payload), one thread, in loops of ``--requests`` requests:

- ``get``: a ranged GET of ``--size`` bytes of a 64 KiB object (``get_range_into``: what
  ``load_state`` and restores do per chunk object, minus the bytes);
- ``put``: a PutObject of ``--size`` bytes (``put``, with our CRC32C);
- ``part``: an UploadPart of ``--size`` bytes into one multipart upload (``upload_part``).

Each loop's CPU (``time.process_time``: every thread of this process, which for obstore
includes its runtime's threads) over the loop's requests is the client's CPU per request,
before the body (``--size`` is small). The contenders, in rotating order each round:

- ``cloudckpt``: ``S3Store`` as it is;
- ``cloudckpt-before``: ``S3Store`` with the per-request savings of issue 31 item 5 off
  (``_s3_client.SAVINGS``: built in this process, same code otherwise);
- ``botocore``: a plain botocore client (``boto3.client("s3")``, the same config), calling
  ``get_object`` and reading the body / ``put_object`` / ``upload_part`` with our CRC32C;
- ``obstore``: ``obstore.get_range`` / ``obstore.put`` (no multipart part call: skipped).

Prints the median over rounds of each contender's microseconds of CPU per request.
Nothing is asserted; with the machine shared, run it a few times.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

KiB = 1 << 10
OPS = ("get", "put", "part")
CONTENDERS = ("cloudckpt", "cloudckpt-before", "botocore", "obstore")


@contextlib.contextmanager
def _savings_off(names: list[str] | None = None) -> Iterator[None]:
    """Build an S3Store without this item's per-request savings (``SAVINGS``): ``names``,
    or all of them."""
    from cloudckpt.stores import _s3_client

    saved = dict(_s3_client.SAVINGS)
    _s3_client.SAVINGS.update(dict.fromkeys(names or saved, False))
    try:
        yield
    finally:
        _s3_client.SAVINGS.update(saved)


def _loops(
    s3t: Any, contender: str, size: int, off: list[str] | None = None
) -> dict[str, Callable[[int], None]]:
    """``op -> run(n)`` for one contender: ``n`` requests of that op, one after another."""
    from cloudckpt.stores.base import crc32c_b64

    prefix = f"{s3t.root}{contender}/"
    data = b"q" * size
    obj = b"o" * (64 * KiB)
    if contender.startswith("cloudckpt"):
        return _cloudckpt_loops(s3t, contender, prefix, data, obj, off)
    if contender == "botocore":
        return _botocore_loops(s3t, prefix, data, crc32c_b64(data), obj)
    return _obstore_loops(s3t, prefix, data, obj)


def _cloudckpt_loops(
    s3t: Any, contender: str, prefix: str, data: bytes, obj: bytes, off: list[str] | None
) -> dict[str, Callable[[int], None]]:
    from cloudckpt.stores.base import crc32c_b64
    from cloudckpt.stores.s3 import S3Store

    crc = crc32c_b64(data)
    with _savings_off(off) if contender == "cloudckpt-before" else contextlib.nullcontext():
        store = S3Store(s3t.bucket, prefix.rstrip("/"), **s3t.storage_options("unsigned"))
    store.put("obj", obj)
    buf = memoryview(bytearray(len(data)))
    upload = store.create_multipart("mp")

    def get(n: int) -> None:
        for _ in range(n):
            store.get_range_into("obj", 0, buf)

    def put(n: int) -> None:
        for _ in range(n):
            store.put("small", data)

    def part(n: int) -> None:
        for _ in range(n):
            store.upload_part(upload, 1, data, crc32c=crc)

    return {"get": get, "put": put, "part": part}


def _botocore_loops(
    s3t: Any, prefix: str, data: bytes, crc: str, obj: bytes
) -> dict[str, Callable[[int], None]]:
    client = s3t.boto3_client("unsigned")
    bucket = s3t.bucket
    client.put_object(Bucket=bucket, Key=prefix + "obj", Body=obj)
    upload_id = client.create_multipart_upload(
        Bucket=bucket, Key=prefix + "mp", ChecksumAlgorithm="CRC32C"
    )["UploadId"]
    rng = f"bytes=0-{len(data) - 1}"
    sent = {"Body": data, "ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": crc}

    def get(n: int) -> None:
        for _ in range(n):
            client.get_object(Bucket=bucket, Key=prefix + "obj", Range=rng)["Body"].read()

    def put(n: int) -> None:
        for _ in range(n):
            client.put_object(Bucket=bucket, Key=prefix + "small", **sent)

    def part(n: int) -> None:
        for _ in range(n):
            client.upload_part(
                Bucket=bucket, Key=prefix + "mp", UploadId=upload_id, PartNumber=1, **sent
            )

    return {"get": get, "put": put, "part": part}


def _obstore_loops(
    s3t: Any, prefix: str, data: bytes, obj: bytes
) -> dict[str, Callable[[int], None]]:
    import obstore

    from benchmarks.peers import Peers

    store = Peers(s3t, "unsigned").obstore()
    obstore.put(store, prefix + "obj", obj)

    def get(n: int) -> None:
        for _ in range(n):
            bytes(obstore.get_range(store, prefix + "obj", start=0, length=len(data)))

    def put(n: int) -> None:
        for _ in range(n):
            obstore.put(store, prefix + "small", data)

    return {"get": get, "put": put}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.request_cost", description=__doc__.split("\n")[0]
    )
    p.add_argument("--requests", type=int, default=1000, help="requests per loop")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=4 * KiB, help="bytes per request body")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument(
        "--off", default="", help="the savings cloudckpt-before goes without (default: all)"
    )
    p.add_argument(
        "--profile", default="", help="an op: cProfile one loop of cloudckpt's (CPU clock)"
    )
    args = p.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    contenders = [c for c in args.contenders.split(",") if c]
    if set(ops) - set(OPS) or set(contenders) - set(CONTENDERS):
        raise SystemExit(f"--ops takes {', '.join(OPS)}; --contenders {', '.join(CONTENDERS)}")

    from benchmarks.harness import S3Target

    s3t = S3Target("bench")
    try:
        off = [n for n in args.off.split(",") if n]
        loops = {c: _loops(s3t, c, args.size, off) for c in contenders}
        if args.profile:
            run = loops["cloudckpt"][args.profile]
            run(100)
            prof = cProfile.Profile(time.process_time)
            prof.runcall(run, args.requests)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(60)
            return 0
        for c in contenders:  # warm-up: connections, models, caches
            for op, run in loops[c].items():
                if op in ops:
                    run(50)
        cpu: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
            for op in ops:
                for c in order:
                    run_op = loops[c].get(op)
                    if run_op is None:
                        continue
                    c0 = time.process_time()
                    run_op(args.requests)
                    us = (time.process_time() - c0) / args.requests * 1e6
                    cpu.setdefault((op, c), []).append(us)
    finally:
        s3t.close()
    print(
        f"client CPU per request, us (median of {args.rounds} rounds of {args.requests} "
        f"requests of {args.size} bytes; rounds sorted)"
    )
    for op in ops:
        for c in contenders:
            got = cpu.get((op, c))
            if got:
                print(
                    f"  {op:<5} {c:<17} {statistics.median(got):8.0f}   "
                    f"{[round(x) for x in sorted(got)]}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
