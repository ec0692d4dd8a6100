"""cloudckpt against what users would pick instead: one command, a table and a JSON file.

    python -m benchmarks                      # the full run (about 15 minutes on 2 cores)
    python -m benchmarks --quick              # a smoke run in well under a minute (CI)
    python -m benchmarks --s3-url s3://bucket/prefix --gcs-url gs://bucket/prefix

Every group runs its contenders side by side in the same process, rotating the order each
round (A B C, B C A, C A B, ...), after one unmeasured warm-up round; figures are medians
over ``--pairs`` rounds and every ratio is the median of the per-round ratios. Between
measurements (never inside one) the harness deletes what the last contender wrote, calls
``sync`` so no contender pays for another's disk writeback, and collects garbage.

Groups (targets on a 2-core machine, from issue 7):

- ``torch``: 1 GiB of tensors. Stall (time the training loop is blocked): cloudckpt
  ``save_state`` vs ``torch.save`` to local disk (target: <= 0.1x) vs DCP ``async_save``
  with its ``FileSystemWriter`` (target: <= 0.5x). save()-to-commit: ``save_state`` until
  LATEST names the checkpoint vs ``torch.save`` followed by boto3 ``upload_file``
  (target: >= 2x faster). Then the resume groups (``benchmarks/resume.py``):
  ``torch-restore``, the state back into memory on a new host (``load_state`` from the
  store, verified, vs DCP ``load`` + ``S3StorageReader``, s5cmd + ``torch.load``, obstore
  ranged reads into buffers, ``download_file`` + ``torch.load``; target >= 1.3x the
  strongest; and ``restore`` of the same checkpoint to disk: into memory must be at least
  as fast, issue 31), and ``torch-resume``, a same-host restart from the verified local
  copy vs a new host (target >= 4x) and the time from a fresh process to its first
  training step. ``--groups memory`` runs ``torch-restore`` alone.
- ``dcp``: the DCP reader (``CloudStorageReader``) at 2 ranks and resharded 2 -> 3 ranks
  (gloo, one torchrun job each) vs s3torchconnector's ``S3StorageReader``
  (``benchmarks/dcp_restore.py``).
- ``s3-upload``: a 1 GiB checkpoint of 8 files on local disk: cloudckpt ``save_dir`` until
  committed vs boto3 ``upload_file`` per file (default ``TransferConfig``) vs s3fs ``put``
  (targets: >= 1.5x each). Run once per payload-signing setting (``--signing``).
- ``s3-restore``: cloudckpt ``restore`` (verified, fsynced) vs boto3 ``download_file`` per
  file vs s3fs ``get`` (target: >= 2x boto3); plus cloudckpt with the fsync switched off
  by the benchmark, to compare like with like.
- ``gcs-upload`` / ``gcs-restore``: the same against fake-gcs-server, gcsfs as the peer.
- ``moto-upload`` / ``moto-restore``: the S3 groups against moto (smaller), a realism check.
- ``dlio``: MLPerf Storage's checkpointing workload (DLIO's, llama3-8b at ZeRO-3 over 8
  ranks, scaled by ``--dlio-hidden``): ``dlio-save`` and ``dlio-restore`` (with the time to
  the first step) against DLIO's own writers and DCP + s3torchconnector
  (``benchmarks/dlio_checkpoint.py``; not run by default: ``--groups dlio``).
- ``scale``: 2 simulated hosts x 2 ranks at data-parallel degree 2, cloudckpt's
  ``DistributedCheckpointManager`` vs DCP + s3torchconnector; host 1 is killed and replaced
  by an empty one between the save job and the restore job; bytes from the endpoint's own
  request accounting (``benchmarks/scale.py``; not run by default: ``--groups scale``).

S3 throughput groups use ``benchmarks/s3_endpoint.py`` (an in-memory endpoint cheap enough
per byte to measure clients) unless ``--s3-url`` names a real bucket. Every S3 client gets
the same botocore ``payload_signing_enabled`` setting (``unsigned``: UNSIGNED-PAYLOAD, what
botocore does over HTTPS when a checksum is sent; ``signed``: SHA-256 of every payload, what
it does over plain HTTP by default). Every cloudckpt figure includes computing the SHA-256
tree digests (upload) or verifying them (restore).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from benchmarks.bench import Bench
from benchmarks.gcs_groups import gcs_groups
from benchmarks.harness import GCSTarget, S3Target
from benchmarks.limits_group import limits_group
from benchmarks.machine import QUIET, start_hogs, stop_hogs
from benchmarks.report import limits_table, summary, table, write_json
from benchmarks.s3_groups import s3_restore_group, s3_upload_group
from benchmarks.torch_group import torch_group

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


log = logging.getLogger("cloudckpt.bench")


GROUPS = ("limits", "torch", "resume", "dcp", "s3", "gcs", "moto", "dlio", "scale", "memory")
# dlio, scale: on request (their own torchrun jobs); memory: on request (torch runs it too)
DEFAULT_GROUPS = GROUPS[:-3]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 pair (CI smoke run)")
    p.add_argument("--pairs", type=int, default=5, help="measured rounds per group (>= 5)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds per group")
    p.add_argument("--mib", type=int, default=1024, help="checkpoint size for S3 groups")
    p.add_argument("--files", type=int, default=8, help="files per checkpoint")
    p.add_argument("--state-mib", type=int, default=1024, help="tensor state for 'torch'")
    p.add_argument("--tensors", type=int, default=8, help="tensors in the state")
    p.add_argument("--gcs-mib", type=int, default=1024, help="checkpoint size for GCS groups")
    p.add_argument("--moto-mib", type=int, default=256, help="checkpoint size against moto")
    p.add_argument("--dcp-mib", type=int, default=512, help="state loaded by the dcp group")
    p.add_argument("--scale-mib", type=int, default=256, help="state of the scale group")
    p.add_argument(
        "--dlio-hidden",
        type=int,
        default=352,
        help="'dlio': llama3-8b's widths scaled to this hidden size (4096: the full model)",
    )
    p.add_argument("--dlio-layers", type=int, default=32, help="'dlio': transformer layers")
    p.add_argument("--dlio-ranks", type=int, default=8, help="'dlio': data-parallel ranks")
    p.add_argument(
        "--signing",
        default="unsigned,signed",
        help="S3 payload signing settings to run: unsigned, signed or both (comma list); "
        "the torch group and restores use the first",
    )
    p.add_argument(
        "--groups", default=",".join(DEFAULT_GROUPS), help=f"comma list of {', '.join(GROUPS)}"
    )
    p.add_argument("--s3-url", help="run the S3 groups against this bucket/prefix instead")
    p.add_argument("--gcs-url", help="run the GCS groups against this bucket/prefix instead")
    p.add_argument("--workdir", help="local directory for files and staging (default: tmp)")
    p.add_argument("--json", default="cloudckpt-bench.json", help="where to write results")
    p.add_argument("--profile", metavar="DIR", help="write profiles here (py-spy, pyinstrument)")
    p.add_argument(
        "--peers",
        default="all",
        help="comma list of the S3 peers to run (s5cmd, obstore, boto3 CRT, s3torchconnector, "
        "boto3 tuned, s3fs tuned) or 'all'",
    )
    p.add_argument(
        "--hogs",
        type=int,
        nargs="?",
        const=2,
        default=0,
        help="run N busy CPU hogs (python -c 'while True: pass') beside the benchmark "
        "(default with the flag: 2)",
    )
    p.add_argument("--limits-mib", type=int, default=1024, help="bytes per limit measurement")
    p.add_argument(
        "--max-idle-wait",
        type=float,
        default=120.0,
        help="seconds to wait at most for an idle machine before each measurement",
    )
    p.add_argument(
        "--no-wait-idle",
        action="store_true",
        help="do not wait for other processes to leave the CPUs idle before each measurement",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.pairs = min(args.pairs, 1) if "--pairs" not in (argv or sys.argv) else args.pairs
        args.warmup = 0
        args.mib = args.state_mib = args.gcs_mib = args.moto_mib = args.limits_mib = 24
        args.dcp_mib = args.scale_mib = 24
        args.dlio_hidden, args.dlio_layers, args.dlio_ranks = 64, 2, 2
        args.files = 2
        args.tensors = 2
    return args


def _s3_groups(
    bench: Bench, s3: S3Target, signings: list[str], groups: list[str], args: argparse.Namespace
) -> None:
    """The groups that write to the S3 endpoint, in order."""
    if "torch" in groups:
        from benchmarks import resume

        torch_group(bench, s3, signings[0])
        resume.torch_restore_group(bench, s3, signings[0])
        resume.torch_resume_group(bench, s3, signings[0])
    if "memory" in groups and "torch" not in groups:  # "memory": torch-restore alone
        from benchmarks import resume

        resume.torch_restore_group(bench, s3, signings[0])
    if "torch" in groups or "resume" in groups:  # "resume": the restarts alone
        from benchmarks import resume

        if "torch" not in groups:
            resume.torch_resume_group(bench, s3, signings[0])
        resume.dir_resume_group(bench, s3, signings[0])
    if "dcp" in groups:
        from benchmarks import dcp_restore

        dcp_restore.dcp_groups(bench, s3, signings[0])
    if "dlio" in groups:
        from benchmarks import dlio_checkpoint as dlio

        workload = dlio.Workload.scaled(args.dlio_hidden, args.dlio_layers, args.dlio_ranks)
        dlio.dlio_groups(bench, s3, signings[0], workload)
    if "scale" in groups:
        from benchmarks import scale

        scale.scale_group(bench, s3, signings[0])
    if "s3" in groups:
        for signing in signings:
            s3_upload_group(bench, s3, signing, args.mib, "s3-upload")
        s3_restore_group(bench, s3, signings[0], args.mib, "s3-restore")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    QUIET.enabled = not args.no_wait_idle and not args.quick
    QUIET.max_wait = args.max_idle_wait
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise SystemExit(f"unknown groups: {', '.join(sorted(unknown))}")
    if "dlio" in groups:
        from benchmarks.dlio_checkpoint import Workload

        try:
            Workload.scaled(args.dlio_hidden, args.dlio_layers, args.dlio_ranks)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    signings = [s.strip() for s in args.signing.split(",") if s.strip()]
    if not signings or set(signings) - {"signed", "unsigned"}:
        raise SystemExit("--signing takes unsigned, signed or both")
    started = time.time()
    bench = Bench(args)
    bench.on_result = lambda: write_json(args, argv, signings, started, bench, partial=True)
    hogs = start_hogs(args.hogs)
    QUIET.exclude = [h.pid for h in hogs]
    print(
        f"cloudckpt benchmarks: pairs={args.pairs} warm-up={args.warmup} work={bench.work} "
        f"signing={','.join(signings)} hogs={len(hogs)}",
        flush=True,
    )
    try:
        if "limits" in groups:
            limits_group(bench, args.limits_mib)
        if {"torch", "resume", "s3", "dcp", "dlio", "scale", "memory"} & set(groups):
            s3 = S3Target("real", args.s3_url) if args.s3_url else S3Target("bench")
            try:
                _s3_groups(bench, s3, signings, groups, args)
            finally:
                s3.close()
        if "gcs" in groups:
            gcs = GCSTarget(args.gcs_url)
            try:
                gcs_groups(bench, gcs, args.gcs_mib)
            finally:
                gcs.close()
        if "moto" in groups and not args.s3_url:
            moto = S3Target("moto")
            try:
                s3_upload_group(bench, moto, signings[0], args.moto_mib, "moto-upload")
                s3_restore_group(bench, moto, signings[0], args.moto_mib, "moto-restore")
            finally:
                moto.close()
    finally:
        bench.close()
        stop_hogs(hogs)

    doc = write_json(args, argv, signings, started, bench, partial=False)
    print("\n" + limits_table(bench.limits))
    print("\n" + table(bench.results))
    print("\n" + summary(bench.results))
    print(f"\nresults: {args.json}  ({doc['duration_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
