"""Client CPU per S3 request: cloudckpt's S3Store against plain botocore and obstore.

    python -m benchmarks.request_cost                     # 1000 requests x 5 rounds
    python -m benchmarks.request_cost --ops get --requests 2000 --rounds 7
    python -m benchmarks.request_cost --profile get       # cProfile (CPU clock) of one loop
    python -m benchmarks.request_cost --off timestamps --contenders cloudckpt,cloudckpt-before
                                                          # one saving alone
    python -m benchmarks.request_cost --ops get,part --contenders lean,cloudckpt,obstore \
        --threads 16                                      # 16 threads at once

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
  (``_s3_client.SAVINGS``: built in this process, same code otherwise; ``lean_get``, the
  lean ranged GET, is one of them: ``--off lean_get`` for botocore's GET against the
  lean one);
- ``botocore``: a plain botocore client (``boto3.client("s3")``, the same config), calling
  ``get_object`` and reading the body / ``put_object`` / ``upload_part`` with our CRC32C;
- ``obstore``: ``obstore.get_range`` / ``obstore.put`` (no multipart part call: skipped);
- ``lean`` (the experiment of issue 31, before ``_s3_fast_get`` was built; that one sends
  through botocore's HTTP session instead): UploadPart and ranged GET over ``http.client``
  (one kept-alive connection per thread), each request signed by botocore's own SigV4 signer
  (``S3SigV4Auth``, UNSIGNED-PAYLOAD) with the headers ``S3Store`` sends (our
  ``x-amz-checksum-crc32c`` on parts), the part body sent as one ``sendall`` of a memoryview,
  the GET body ``readinto`` the destination buffer. No retries, error mapping, redirects,
  TLS, proxies... (see docs/performance.md); a wrong status, a missing ETag or wrong bytes
  raise (checked before the rounds and after every loop). No ``put``.

``--threads N`` runs each loop in N threads at once (each ``--requests`` / N requests, one
client shared as the transfers share theirs, lean's connection per thread) and divides the
process's CPU by all the requests.

Prints the median over rounds of each contender's microseconds of CPU per request.
Nothing is asserted; with the machine shared, run it a few times.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

KiB = 1 << 10
OPS = ("get", "put", "part")
CONTENDERS = ("cloudckpt", "cloudckpt-before", "botocore", "obstore", "lean")


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
    if contender == "lean":
        return _lean_loops(s3t, prefix, data, crc32c_b64(data), obj)
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


class _LeanS3:
    """The experiment: S3 requests over ``http.client``, signed by botocore's SigV4 signer.

    Path-style addressing on a plain-HTTP endpoint, one kept-alive connection per thread.
    Not a store: no retries, no error mapping, no redirects (see the module docstring)."""

    def __init__(self, endpoint_url: str, bucket: str, credentials: Any, region: str) -> None:
        import threading
        import urllib.parse

        from botocore.auth import S3SigV4Auth

        class _Unsigned(S3SigV4Auth):
            # What ``payload_signing_enabled=False`` (--signing unsigned) gives botocore.
            def _should_sha256_sign_payload(self, request: Any) -> bool:
                return False

        url = urllib.parse.urlsplit(endpoint_url)
        assert url.scheme == "http" and url.hostname, endpoint_url
        self.host, self.port = url.hostname, url.port or 80
        self.base = f"{endpoint_url.rstrip('/')}/{urllib.parse.quote(bucket)}/"
        self.path0 = f"/{urllib.parse.quote(bucket)}/"
        self.signer = _Unsigned(credentials, "s3", region)
        self._local = threading.local()

    def _conn(self) -> Any:
        import http.client

        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port)
        return conn

    def _send(
        self, method: str, key: str, query: str, headers: dict[str, str], body: memoryview | None
    ) -> Any:
        """Sign, send the head and (one sendall) the body; return the response, head read."""
        import urllib.parse

        from botocore.awsrequest import AWSRequest

        path = urllib.parse.quote(key, safe="/~")
        req = AWSRequest(method=method, url=self.base + path + query, headers=headers)
        self.signer.add_auth(req)
        conn = self._conn()
        conn.putrequest(method, self.path0 + path + query, skip_accept_encoding=True)
        for name, value in req.headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        if body is not None:
            conn.sock.sendall(body)
        return conn.getresponse()

    def upload_part(
        self, key: str, upload_id: str, part_number: int, data: memoryview, crc: str
    ) -> str:
        """UploadPart with our CRC32C, as S3Store sends it; return the ETag."""
        import urllib.parse

        resp = self._send(
            "PUT",
            key,
            f"?partNumber={part_number}&uploadId={urllib.parse.quote(upload_id, safe='')}",
            {
                "x-amz-sdk-checksum-algorithm": "CRC32C",
                "x-amz-checksum-crc32c": crc,
                "Content-Length": str(data.nbytes),
            },
            data,
        )
        resp.read()
        etag = resp.getheader("ETag")
        if resp.status != 200 or not etag:
            raise AssertionError(f"lean UploadPart: {resp.status} {resp.reason}, ETag {etag!r}")
        return str(etag)

    def get_range_into(self, key: str, start: int, buf: memoryview) -> int:
        """Ranged GET, the body read straight into ``buf``; return the bytes read."""
        resp = self._send("GET", key, "", {"Range": f"bytes={start}-{start + len(buf) - 1}"}, None)
        if resp.status != 206:
            resp.read()
            raise AssertionError(f"lean GET: {resp.status} {resp.reason}")
        got = 0
        while got < len(buf):
            n = resp.readinto(buf[got:])
            if not n:
                break
            got += n
        if got != len(buf) or resp.read(1):
            raise AssertionError(f"lean GET: {got} bytes for a range of {len(buf)}")
        return got


def _lean_loops(
    s3t: Any, prefix: str, data: bytes, crc: str, obj: bytes
) -> dict[str, Callable[[int], None]]:
    client = s3t.boto3_client("unsigned")  # set-up only: the object and the upload
    bucket = s3t.bucket
    client.put_object(Bucket=bucket, Key=prefix + "obj", Body=obj)
    upload_id = client.create_multipart_upload(
        Bucket=bucket, Key=prefix + "mp", ChecksumAlgorithm="CRC32C"
    )["UploadId"]
    creds = client._request_signer._credentials.get_frozen_credentials()
    lean = _LeanS3(s3t.endpoint_url, bucket, creds, client.meta.region_name)
    body = memoryview(data)
    want = obj[: len(data)]

    def get(n: int) -> None:
        buf = memoryview(bytearray(len(data)))
        for _ in range(n):
            lean.get_range_into(prefix + "obj", 0, buf)
        if buf != want:
            raise AssertionError("lean GET: the bytes differ from the object's")

    def part(n: int) -> None:
        for _ in range(n):
            lean.upload_part(prefix + "mp", upload_id, 1, body, crc)

    # Correctness, once, before any round: the endpoint takes a lean part (200, an ETag
    # that CompleteMultipartUpload accepts, the object then holds the part's bytes) and a
    # lean GET returns the object's bytes.
    check = client.create_multipart_upload(
        Bucket=bucket, Key=prefix + "check", ChecksumAlgorithm="CRC32C"
    )["UploadId"]
    etag = lean.upload_part(prefix + "check", check, 1, body, crc)
    client.complete_multipart_upload(
        Bucket=bucket,
        Key=prefix + "check",
        UploadId=check,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag, "ChecksumCRC32C": crc}]},
    )
    if client.get_object(Bucket=bucket, Key=prefix + "check")["Body"].read() != data:
        raise AssertionError("lean UploadPart: the completed object differs from the part")
    get(1)
    return {"get": get, "part": part}


def _timer(
    pool: ThreadPoolExecutor | None, threads: int
) -> Callable[[Callable[[int], None], int], float]:
    """``timed(run, n)``: process CPU seconds of ``n`` requests, in ``threads`` threads at once
    (``n / threads`` each)."""

    def timed(run_op: Callable[[int], None], n: int) -> float:
        c0 = time.process_time()
        if pool is None:
            run_op(n)
        else:
            for f in [pool.submit(run_op, -(-n // threads)) for _ in range(threads)]:
                f.result()
        return time.process_time() - c0

    return timed


def _rounds(
    loops: dict[str, dict[str, Callable[[int], None]]],
    contenders: list[str],
    ops: list[str],
    rounds: int,
    n: int,
    timed: Callable[[Callable[[int], None], int], float],
) -> dict[tuple[str, str], list[float]]:
    """``(op, contender) -> [us of CPU per request, per round]``, contenders rotating."""
    cpu: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for op in ops:
            for c in order:
                run_op = loops[c].get(op)
                if run_op is not None:
                    cpu.setdefault((op, c), []).append(timed(run_op, n) / n * 1e6)
    return cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.request_cost", description=__doc__.split("\n")[0]
    )
    p.add_argument("--requests", type=int, default=1000, help="requests per loop")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=4 * KiB, help="bytes per request body")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--threads", type=int, default=1, help="run each loop in N threads at once")
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

    threads = max(1, args.threads)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    timed = _timer(pool, threads)

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
                    timed(run, 50 * threads)
        cpu = _rounds(
            loops, contenders, ops, args.rounds, -(-args.requests // threads) * threads, timed
        )
    finally:
        if pool is not None:
            pool.shutdown()
        s3t.close()
    print(
        f"client CPU per request, us (median of {args.rounds} rounds of {args.requests} "
        f"requests of {args.size} bytes in {threads} thread(s); rounds sorted; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})"
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
