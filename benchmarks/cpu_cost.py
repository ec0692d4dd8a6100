"""Client CPU-seconds per GiB uploaded, and where they go (issue 24 item 7).

    python -m benchmarks.cpu_cost                       # 512 MiB in 4 files, 5 saves each
    python -m benchmarks.cpu_cost --concurrency 2       # fewer transfer threads
    python -m benchmarks.cpu_cost --without digest,crc32c
    python -m benchmarks.cpu_cost --without blocks       # each part read whole, then hashed
    python -m benchmarks.cpu_cost --source state        # save_state of tensors in memory
    python -m benchmarks.cpu_cost --without requests     # botocore as before issue 31 item 5

Uploads the same files to the benchmark S3 endpoint (``benchmarks/s3_endpoint.py``, its
own process; unsigned payload) with cloudckpt's ``save_dir`` (``chunking="off"``, as the
throughput groups) and with obstore (``put_async`` per file, gathered), alternating, and
prints each one's client CPU-seconds per GiB (``time.process_time``: every thread of this
process) with the ratio of the medians. ``--source state``: cloudckpt saves the same bytes
as a state of CPU tensors with ``save_state`` (the copy into its host memory included),
obstore uploads the files. ``--without`` switches parts of cloudckpt's work
off by replacing, in this process only, the pass every part of a whole-file upload goes
through (``digest.leaves_and_crc32c_as_read``, called by ``TransferEngine.reading_digested``
for files and ``save_state``'s memory alike): ``digest``: no BLAKE3 leaves (zeros instead);
``crc32c``: no CRC32C (zero sent, which the benchmark endpoint does not check); ``blocks``:
each part read whole into its buffer, then hashed and CRC'd over it, as before the pass
went 1 MiB block by block; ``requests``: the S3 client's per-request savings
(``_s3_client.SAVINGS``). The differences are what each part costs. (``fused``, the
digest and CRC32C in two passes, is gone: the pass it switched off, ``leaf_and_crc32c``, is
no longer on any upload path; ``benchmarks.upload_pass`` compares whole passes.) Nothing
is asserted; with the machine shared, run it a few times. Where the rest of the CPU goes:
``benchmarks.upload_profile``.
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


WITHOUT = ("digest", "crc32c", "blocks", "requests")


def _switch_off(without: set[str]) -> None:
    """Replace parts of cloudckpt's per-byte work in this process (``--without``)."""
    from cloudckpt import _crc32c, digest
    from cloudckpt.stores import _s3_client

    if "requests" in without:
        _s3_client.SAVINGS.update(dict.fromkeys(_s3_client.SAVINGS, False))
    if not without & {"digest", "crc32c", "blocks"}:
        return
    real = digest.leaves_and_crc32c_as_read

    def the_pass(buf, read, chunk_size=digest.CHUNK_SIZE, algorithm=None):  # type: ignore[no-untyped-def]
        if "blocks" in without and read is not None:
            read(memoryview(buf).cast("B"), 0)  # the part whole, then the pass over it
            read = None
        if "digest" not in without and "crc32c" not in without:
            return real(buf, read, chunk_size, algorithm)
        size = memoryview(buf).nbytes
        if "digest" in without:
            leaves = [b"\0" * 32 for _ in range(0, size, chunk_size)]
        else:
            hashers = [digest.hasher(algorithm) for _ in range(0, size, chunk_size)]
        crc = 0
        for at, piece in digest.blocks_as_read(buf, read, range(chunk_size, size, chunk_size)):
            if "digest" not in without:
                hashers[at // chunk_size].update(piece)
            if "crc32c" not in without:
                crc = _crc32c.extend(crc, piece)
        if "digest" not in without:
            leaves = [h.digest() for h in hashers]
        return leaves, crc

    digest.leaves_and_crc32c_as_read = the_pass  # type: ignore[assignment]


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
    p.add_argument("--part-mib", type=int, default=0, help="cloudckpt part size (0: the default)")
    p.add_argument("--without", default="", help=f"comma list of {', '.join(WITHOUT)}")
    p.add_argument("--source", choices=("files", "state"), default="files")
    args = p.parse_args(argv)

    from benchmarks.harness import S3Target, whole_file_upload
    from benchmarks.peers import Peers
    from cloudckpt.transfer import TransferConfig

    without = {w.strip() for w in args.without.split(",") if w.strip()}
    without = {"digest" if w == "sha256" else w for w in without}  # the old name
    if without - set(WITHOUT):
        raise SystemExit(f"--without takes {', '.join(WITHOUT)} (fused is gone: see the docstring)")
    _switch_off(without)

    part_size = {"part_size": args.part_mib * MiB} if args.part_mib else {}
    s3t = S3Target("bench")
    work = Path(tempfile.mkdtemp(prefix="cloudckpt-cpu-cost-"))
    try:
        files, gib, mgr = whole_file_upload(
            s3t,
            work,
            args.mib,
            args.files,
            transfer=TransferConfig(concurrency=args.concurrency, **part_size),
        )
        peers = Peers(s3t, "unsigned")
        ck: list[float] = []
        obs: list[float] = []
        walls: list[float] = []
        save = _saver(args.source, mgr, files)
        save(0)  # warm-up, unmeasured
        peers.obstore_upload(files, f"{s3t.root}obstore/warm/")
        for r in range(1, args.saves + 1):
            c0, w0 = time.process_time(), time.perf_counter()
            info = save(r)
            ck.append((time.process_time() - c0) / gib)
            walls.append((time.perf_counter() - w0) / gib)
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
        f"{args.mib} MiB in {args.files} files, {args.saves} saves each, concurrency "
        f"{args.concurrency}, parts of {mgr.engine.config.part_size // MiB} MiB"
    )
    print(f"  {label:<40} CPU-s per GiB: median {med_ck:.3f}  {sorted(round(x, 3) for x in ck)}")
    print(
        f"  {'obstore':<40} CPU-s per GiB: median {med_obs:.3f}  {sorted(round(x, 3) for x in obs)}"
    )
    print(f"  {'cloudckpt wall s per GiB':<40} median {statistics.median(walls):.3f}")
    print(f"  ratio cloudckpt / obstore: {med_ck / med_obs:.2f}x  (goal, issue 31: <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
