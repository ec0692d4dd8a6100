"""Where the whole-file upload's client CPU goes, cloudckpt beside obstore (issue 31 item 5).

    perf record -F 999 -g -k CLOCK_MONOTONIC -o /tmp/up.data -- \\
        python -m benchmarks.upload_profile run --windows /tmp/up.json --rounds 7
    python -m benchmarks.upload_profile split /tmp/up.data /tmp/up.json

``run``: the ``s3-upload`` group's cloudckpt row (``save_dir`` of 1 GiB in 8 random files,
``chunking="off"``, 32 MiB parts, unsigned, the benchmark endpoint in its own process) and
obstore's ``put`` of the same files, alternated round by round in one process, each round
timed (``time.process_time``: client CPU of every thread of this process) and its
``CLOCK_MONOTONIC`` window written to ``--windows``. ``split``: reads ``perf script`` of
that recording, keeps the samples of this process inside each contender's windows, sorts
each by what it was doing (the sampled function's library, the kernel path under it) and
prints CPU-seconds per GiB per category: each round's share of its samples times that
round's measured CPU, median over rounds; then the same by thread name (Python's threads
are all ``python``; obstore's are ``tokio-rt-worker``). Python 3.11 has no perf frames: the
interpreter is one category here; ``py-spy record --gil --native --format raw -- python -m
benchmarks.upload_profile run ...`` splits it by Python function (docs/performance.md,
"Where the whole-file upload's CPU goes, exactly").

``--variants`` (comma list, each alternated with the others and obstore): ``cloudckpt``
(as configured), ``threadsN`` (a manager with N transfer workers), ``blockK`` (the
read-and-hash block, ``digest.FUSED_BLOCK``, of K KiB), ``gateN`` (at most N parts in the
read-and-hash pass at once, the requests still ``--concurrency`` wide).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


def _manager(s3t: Any, work: Path, prefix: str, threads: int, part_size: int) -> Any:
    """Another manager like ``whole_file_upload``'s, with ``threads`` transfer workers."""
    from cloudckpt import CheckpointManager
    from cloudckpt.transfer import TransferConfig

    return CheckpointManager(
        s3t.url(prefix),
        storage_options=s3t.storage_options("unsigned"),
        staging_dir=work / f"staging-{threads}",
        keep_last=1,
        auto_gc=False,
        chunking="off",
        transfer=TransferConfig(concurrency=threads, part_size=part_size),
    )


def _rounds(contenders: list[tuple[str, Any]], tidy: Any, rounds: int, gib: float) -> list:
    """A warm-up each, then ``rounds`` rounds, the order rotated each round: each measured
    call's ``CLOCK_MONOTONIC`` window and process CPU per GiB."""
    out = []
    for name, fn in contenders:
        fn(0)  # warm-up, unmeasured
        tidy(name)
    for r in range(1, rounds + 1):
        shift = (r - 1) % len(contenders)
        for name, fn in contenders[shift:] + contenders[:shift]:
            t0, c0 = time.clock_gettime(time.CLOCK_MONOTONIC), time.process_time()
            fn(r)
            c1, t1 = time.process_time(), time.clock_gettime(time.CLOCK_MONOTONIC)
            out.append(
                {"who": name, "round": r, "t0": t0, "t1": t1, "cpu_per_gib": (c1 - c0) / gib}
            )
            tidy(name)
    return out


def run(args: argparse.Namespace) -> int:
    from benchmarks.harness import S3Target, whole_file_upload
    from benchmarks.peers import Peers
    from cloudckpt import digest
    from cloudckpt.transfer import TransferConfig

    s3t = S3Target("bench")
    work = Path(tempfile.mkdtemp(prefix="cloudckpt-upload-profile-"))
    windows: dict[str, Any] = {"pid": os.getpid(), "rounds": []}
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:
        files, gib, mgr = whole_file_upload(
            s3t,
            work,
            args.mib,
            args.files,
            transfer=TransferConfig(concurrency=args.concurrency, part_size=args.part_mib * MiB),
        )
        managers = {args.concurrency: (mgr, "ck/")}
        for v in variants:
            if v.startswith("threads") and int(v[7:]) not in managers:
                n = int(v[7:])
                managers[n] = (_manager(s3t, work, f"ck-{n}/", n, args.part_mib * MiB), f"ck-{n}/")
        peers = Peers(s3t, "unsigned")
        last: dict[str, tuple[str, str]] = {}
        real_pass = digest.leaves_and_crc32c_as_read

        def saver(variant: str) -> Any:
            m, prefix = managers[
                int(variant[7:]) if variant.startswith("threads") else args.concurrency
            ]
            block = int(variant[5:]) * 1024 if variant.startswith("block") else None
            gate = threading.Semaphore(int(variant[4:])) if variant.startswith("gate") else None

            def gated(*a: Any, **k: Any) -> Any:
                assert gate is not None
                with gate:
                    return real_pass(*a, **k)

            def save(r: int) -> None:
                was = digest.FUSED_BLOCK
                if block:
                    digest.FUSED_BLOCK = block
                if gate:
                    digest.leaves_and_crc32c_as_read = gated  # type: ignore[assignment]
                try:
                    last[variant] = (prefix, m.save_dir(r, files[0].parent).result().ckpt)
                finally:
                    digest.FUSED_BLOCK = was
                    digest.leaves_and_crc32c_as_read = real_pass  # type: ignore[assignment]

            return save

        def obstore(r: int) -> None:
            peers.obstore_upload(files, f"{s3t.root}obstore/{r}/")

        def tidy(name: str) -> None:
            if name == "obstore":
                s3t.drop("obstore/")
            else:
                prefix, ckpt = last.pop(name)
                s3t.drop(prefix + ckpt)

        contenders = [(v, saver(v)) for v in variants] + [("obstore", obstore)]
        windows["rounds"] = _rounds(contenders, tidy, args.rounds, gib)
        for m, _ in managers.values():
            m.close()
        peers.close()
    finally:
        s3t.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    Path(args.windows).write_text(json.dumps(windows, indent=1))
    for who in [*variants, "obstore"]:
        xs = [w["cpu_per_gib"] for w in windows["rounds"] if w["who"] == who]
        print(
            f"{who:<12} CPU-s per GiB: median {statistics.median(xs):.3f} "
            f"[{min(xs):.3f}-{max(xs):.3f}]"
        )
    return 0


# -- split: perf samples into categories -----------------------------------------------


# Kernel paths, first match wins: (functions anywhere in the sample's stack, category).
_KERNEL = [
    ({"asm_exc_page_fault", "exc_page_fault"}, "kernel: page faults"),
    (
        {"filemap_read", "__x64_sys_preadv", "__x64_sys_pread64", "vfs_read"},
        "kernel: read() copy out of the page cache",
    ),
    ({"tcp_sendmsg", "tcp_sendmsg_locked"}, "kernel: sendmsg"),
    ({"tcp_recvmsg", "sock_recvmsg", "__x64_sys_recvfrom", "inet_recvmsg"}, "kernel: recv"),
    (
        {"__x64_sys_futex", "futex_wait", "futex_wake", "do_futex"},
        "kernel: futex (GIL, locks, thread hand-offs)",
    ),
    (
        {"schedule", "__schedule", "finish_task_switch", "__x64_sys_sched_yield"},
        "kernel: scheduling",
    ),
    (
        {"__x64_sys_epoll_wait", "__x64_sys_poll", "__x64_sys_select", "do_sys_poll"},
        "kernel: poll/select/epoll",
    ),
    ({"__x64_sys_munmap", "__x64_sys_mmap", "__x64_sys_madvise"}, "kernel: mmap/munmap"),
]
_COPY = {"_copy_from_iter", "copy_user_generic", "skb_copy_to_page_nocache", "rep_movs_alternative"}
# User space, by library then by the sampled function's name prefix.
_LIBS = [
    ("blake3", "BLAKE3"),
    ("crc32c", "CRC32C"),
    ("obstore", "obstore (Rust: HTTP, runtime)"),
    ("libpython", "Python"),
    ("libc", "libc"),
    ("ssl", "OpenSSL"),
    ("crypto", "OpenSSL"),
]
_PREFIXES = {
    "Python": [
        (("take_gil", "drop_gil", "PyThread_", "PyCOND", "PyMUTEX"), "Python: GIL hand-offs"),
        (("gc_", "deduce_unreachable", "visit_"), "Python: garbage collector"),
    ],
    "libc": [
        (("__memmove", "__memcpy", "memcpy", "memmove"), "libc memcpy"),
        (("malloc", "free", "_int_", "tcache", "__libc_malloc", "cfree"), "libc malloc/free"),
        (("pthread_", "__pthread", "___pthread", "__lll", "sem_", "futex"), "libc threads/locks"),
    ],
}
_DEFAULT = {
    "Python": "Python interpreter (botocore, urllib3, cloudckpt, ...)",
    "libc": "libc other",
    "OpenSSL": "OpenSSL (SigV4 HMAC)",
}


def _category(frames: list[tuple[str, str]]) -> str:
    """What a sample was doing; ``frames``: (symbol, library) from the sampled function
    outwards."""
    sym, dso = frames[0] if frames else ("?", "?")
    if "kallsyms" in dso or dso.startswith("["):
        syms = {s for s, _ in frames}
        for names, label in _KERNEL:
            if syms & names:
                if label == "kernel: sendmsg":
                    copying = "copy" in sym or bool(_COPY & {s for s, _ in frames[:4]})
                    return label + (
                        " copy into the socket" if copying else " TCP (loopback rx included)"
                    )
                return label
        return "kernel: other"
    lib = next((label for key, label in _LIBS if key in dso), None)
    if lib is None:
        return f"other ({Path(dso).name})"
    for prefixes, label in _PREFIXES.get(lib, []):
        if sym.lstrip("_").startswith(tuple(p.lstrip("_") for p in prefixes)):
            return label
    return _DEFAULT.get(lib, lib)


def _samples(data: str) -> Any:
    """(pid, comm, time, frames) of every sample of ``perf script -i data``."""
    out = subprocess.run(
        ["perf", "script", "-i", data, "-F", "pid,tid,comm,time,ip,sym,dso"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for block in out.split("\n\n"):
        lines = [ln for ln in block.splitlines() if ln.strip()]
        if not lines:
            continue
        head = lines[0].split()
        try:
            pid = int(head[-2].split("/")[0])
            when = float(head[-1].rstrip(":"))
        except (ValueError, IndexError):
            continue
        comm = " ".join(head[:-2])
        frames = []
        for ln in lines[1:]:
            parts = ln.split(None, 1)
            if len(parts) < 2:
                continue
            rest = parts[1]
            sym, _, dso = rest.rpartition(" (")
            frames.append((sym.split("+")[0].strip(), dso.rstrip(")")))
        yield pid, comm, when, frames


def split(args: argparse.Namespace) -> int:
    windows = json.loads(Path(args.windows).read_text())
    rounds = windows["rounds"]
    counts: list[collections.Counter[str]] = [collections.Counter() for _ in rounds]
    threads: list[collections.Counter[str]] = [collections.Counter() for _ in rounds]
    starts = sorted((w["t0"], i) for i, w in enumerate(rounds))
    for pid, comm, when, frames in _samples(args.data):
        if pid != windows["pid"]:
            continue
        for t0, i in starts:
            if t0 <= when <= rounds[i]["t1"]:
                counts[i][_category(frames)] += 1
                threads[i][comm.rstrip("0123456789_")] += 1
                break
    for who in dict.fromkeys(w["who"] for w in rounds):
        mine = [i for i, w in enumerate(rounds) if w["who"] == who]
        cats = sorted({c for i in mine for c in counts[i]})
        per: dict[str, list[float]] = {c: [] for c in cats}
        per_thread: dict[str, list[float]] = collections.defaultdict(list)
        for i in mine:
            total = sum(counts[i].values()) or 1
            for c in cats:
                per[c].append(counts[i][c] / total * rounds[i]["cpu_per_gib"])
            for t, n in threads[i].items():
                per_thread[t].append(n / total * rounds[i]["cpu_per_gib"])
        cpu = statistics.median(rounds[i]["cpu_per_gib"] for i in mine)
        nsamples = sum(sum(counts[i].values()) for i in mine)
        print(f"\n{who}: {len(mine)} rounds, {nsamples} samples, CPU-s per GiB median {cpu:.3f}")
        for c in sorted(cats, key=lambda c: -statistics.median(per[c])):
            print(f"  {c:<58} {statistics.median(per[c]):.3f}")
        print("  by thread:")
        for t in sorted(per_thread, key=lambda t: -sum(per_thread[t])):
            xs = per_thread[t] + [0.0] * (len(mine) - len(per_thread[t]))
            print(f"    {t:<56} {statistics.median(xs):.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.upload_profile")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--windows", required=True)
    r.add_argument("--rounds", type=int, default=7)
    r.add_argument("--mib", type=int, default=1024)
    r.add_argument("--files", type=int, default=8)
    r.add_argument("--part-mib", type=int, default=32)
    r.add_argument("--concurrency", type=int, default=16)
    r.add_argument(
        "--variants",
        default="cloudckpt",
        help="comma list, alternated with obstore: cloudckpt (as configured), threadsN "
        "(N transfer workers), blockK (the read-and-hash block of K KiB), gateN (at most N "
        "parts in the read-and-hash pass at once)",
    )
    s = sub.add_parser("split")
    s.add_argument("data")
    s.add_argument("windows")
    args = p.parse_args(argv)
    return run(args) if args.cmd == "run" else split(args)


if __name__ == "__main__":
    sys.exit(main())
