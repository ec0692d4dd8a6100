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
import contextlib
import datetime as dt
import gc
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    REGION,
    Comparison,
    Contender,
    GCSTarget,
    GiB,
    Group,
    MiB,
    S3Target,
    _dcp_endpoint,
    _limit,
    _rm,
    _write_files,
)
from benchmarks.limits import Limits
from benchmarks.peers import Peers, _env_creds, find_s5cmd

SCHEMA = "cloudckpt.bench/1"

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


log = logging.getLogger("cloudckpt.bench")


# ----------------------------------------------------------------------------- helpers


def _proc_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its threads."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine_busy_s(pids: list[int | None], window: float) -> float:
    """CPU seconds per second used during ``window`` by processes other than ours."""

    def total() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

    def ours() -> float:
        return time.process_time() + sum(_proc_cpu(p) for p in pids)

    t0, o0 = total(), ours()
    time.sleep(window)
    return max(0.0, (total() - t0) - (ours() - o0)) / window


class _Quiet:
    """Waits, between measurements, until other processes leave the CPUs alone (a shared
    CI or dev machine otherwise makes single measurements meaningless); counts the
    measurements that had to start on a busy machine."""

    def __init__(self, enabled: bool, max_wait: float = 120.0, threshold: float = 0.15):
        self.enabled, self.max_wait, self.threshold = enabled, max_wait, threshold
        self.waited_s = 0.0
        self.busy_starts = 0
        self.exclude: list[int] = []

    def wait(self, pids: list[int | None]) -> None:
        if not self.enabled or not os.path.exists("/proc/stat"):
            return
        pids = [*pids, *self.exclude]
        started = time.monotonic()
        while _machine_busy_s(pids, 0.5) > self.threshold * (os.cpu_count() or 1):
            if time.monotonic() - started > self.max_wait:
                self.busy_starts += 1
                break
            time.sleep(1.0)
        self.waited_s += time.monotonic() - started


QUIET = _Quiet(enabled=True)


def _start_hogs(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` busy CPU hogs beside the benchmark (``--hogs``): a training job's data loaders
    or a noisy neighbour. Their CPU time does not count as "busy" for the idle wait."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]


def _stop_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    for h in hogs:
        h.kill()
        h.wait()


def _quiesce(pids: list[int | None] = ()) -> None:
    """Between measurements: flush dirty pages (one contender's writeback must not slow
    the next one), collect garbage, wait for other processes to leave the CPUs idle."""
    gc.collect()
    os.sync()
    QUIET.wait(list(pids))


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _run_group(group: Group, pairs: int, warmup: int, profile_dir: Path | None) -> dict[str, Any]:
    """Run the contenders in rotating order; return the group's JSON record."""
    names = [c.name for c in group.contenders]
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    total_rounds = warmup + pairs
    print(f"\n== {group.title}", flush=True)
    for r in range(total_rounds):
        measured = r >= warmup
        k = r % len(group.contenders)
        order = group.contenders[k:] + group.contenders[:k]
        line = []
        for c in order:
            _quiesce(list(group.servers.values()))
            cpu0 = time.process_time()
            srv0 = {s: _proc_cpu(pid) for s, pid in group.servers.items()}
            profiler = _start_profile(profile_dir, group, c) if r == warmup else None
            t0 = time.perf_counter()
            metrics = c.run(r) or {}
            wall = time.perf_counter() - t0
            _stop_profile(profiler)
            metrics.setdefault("s", wall)
            metrics["cpu_client_s"] = time.process_time() - cpu0
            for s, pid in group.servers.items():
                metrics[f"cpu_{s}_s"] = _proc_cpu(pid) - srv0[s]
            if c.after is not None:
                c.after(r)
            if measured:
                for m, v in metrics.items():
                    samples[c.name].setdefault(m, []).append(v)
            line.append(f"{c.name} {metrics['s']:.2f}s")
        tag = f"round {r - warmup + 1}/{pairs}" if measured else "warm-up"
        print(f"   {tag}: " + ", ".join(line), flush=True)

    contenders = {}
    for c in group.contenders:
        m = samples[c.name]
        rec: dict[str, Any] = {
            "cloudckpt": c.cloudckpt,
            "metrics": {k: {"median": _median(v), "samples": v} for k, v in m.items()},
        }
        if c.note:
            rec["note"] = c.note
        s = _median(m.get("s", []))
        if group.nbytes and s > 0:
            rec["gib_per_s"] = group.nbytes / GiB / s
        if group.nbytes and m.get("cpu_client_s"):
            # Client CPU-seconds per GiB moved (copy, hashing, upload, all threads): what a
            # training host's data loaders lose to the checkpoint (issue 24 item 7).
            rec["cpu_client_s_per_gib"] = _median(m["cpu_client_s"]) / (group.nbytes / GiB)
        contenders[c.name] = rec
    comparisons = []
    for cmp in group.comparisons:
        a = samples[cmp.cloudckpt].get(cmp.metric, [])
        b = samples[cmp.baseline].get(cmp.metric, [])
        ratios = [y / x for x, y in zip(a, b, strict=False) if x > 0]
        speedup = _median(ratios)
        comparisons.append(
            {
                "metric": cmp.metric,
                "label": cmp.label or cmp.metric,
                "cloudckpt": cmp.cloudckpt,
                "baseline": cmp.baseline,
                "cloudckpt_median_s": _median(a),
                "baseline_median_s": _median(b),
                "speedup": speedup,
                "speedups": ratios,
                "target": cmp.target,
                "met": None if cmp.target is None else bool(speedup >= cmp.target),
            }
        )
    return {
        "name": group.name,
        "title": group.title,
        "bytes": group.nbytes,
        "pairs": pairs,
        "warmup": warmup,
        "contenders": contenders,
        "comparisons": comparisons,
        **group.info,
    }


def _start_profile(profile_dir: Path | None, group: Group, c: Contender) -> Any:
    """Profile the first measured run of every cloudckpt contender: py-spy (all threads,
    native waits excluded) on this process and on the local servers when py-spy is
    installed, else pyinstrument (main thread only)."""
    if profile_dir is None or not c.cloudckpt:
        return None
    profile_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{group.name}--{c.name.replace(' ', '_').replace('(', '').replace(')', '')}"
    pyspy = shutil.which("py-spy")
    if pyspy:
        procs = []
        targets = {"client": os.getpid(), **group.servers}
        for who, pid in targets.items():
            if pid is None:
                continue
            out = profile_dir / f"{stem}--{who}.collapsed"
            cmd = [pyspy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw"]
            cmd += ["--output", str(out), "--nonblocking"]
            procs.append(
                (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)
            )
        time.sleep(0.5)  # let py-spy attach
        return ("py-spy", procs)
    try:
        import pyinstrument
    except ImportError:
        return None
    p = pyinstrument.Profiler(interval=0.002, async_mode="disabled")
    p.start()
    return ("pyinstrument", (p, profile_dir / f"{stem}.txt"))


def _stop_profile(profiler: Any) -> None:
    if profiler is None:
        return
    kind, state = profiler
    if kind == "pyinstrument":
        p, path = state
        p.stop()
        path.write_text(p.output_text(unicode=False, color=False))
        return
    for proc, out in state:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if out.exists():
            out.with_suffix(".top.txt").write_text(_top_frames(out))


def _top_frames(collapsed: Path, n: int = 30) -> str:
    """Where the samples of a py-spy raw profile are: own time per frame, and inclusive
    time for the cloudckpt/botocore/urllib3 frames."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + k
        for f in set(frames):
            incl[f] = incl.get(f, 0) + k
    out = [f"{total} samples (active threads only; 250 Hz)", "", "own time:"]
    for f, k in sorted(own.items(), key=lambda x: -x[1])[:n]:
        out.append(f"{100 * k / max(total, 1):6.1f}%  {f}")
    out += ["", "inclusive (cloudckpt, botocore, s3transfer, urllib3, http):"]
    keep = ("cloudckpt", "botocore", "s3transfer", "urllib3", "http/", "s3fs", "gcsfs")
    ranked = [(f, k) for f, k in incl.items() if any(x in f for x in keep)]
    for f, k in sorted(ranked, key=lambda x: -x[1])[:n]:
        out.append(f"{100 * k / max(total, 1):6.1f}%  {f}")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- stores


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.workdir:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-", dir=args.workdir))
        self.profile_dir = Path(args.profile) if args.profile else None
        self.results: list[dict[str, Any]] = []
        self.limits: dict[str, Any] | None = None
        #: Called after every group with the results so far (the JSON is written as it goes).
        self.on_result: Callable[[], None] | None = None

    def close(self) -> None:
        _rm(self.work)

    def run(self, group: Group) -> None:
        self.results.append(_run_group(group, self.args.pairs, self.args.warmup, self.profile_dir))
        self.record()

    def record(self) -> None:
        if self.on_result is not None:
            self.on_result()

    # -- helpers ----------------------------------------------------------------------

    def manager(self, url: str, options: dict[str, Any], name: str) -> Any:
        from cloudckpt import CheckpointManager

        return CheckpointManager(
            url,
            storage_options=options,
            staging_dir=self.work / f"staging-{name}",
            keep_last=1,
            auto_gc=False,
            # These groups save the same bytes every round: chunked, every round after the
            # first would upload nothing. Chunked saves: python -m benchmarks.incremental.
            chunking="off",
        )

    def peer_rows(self, peers: Any) -> list[tuple[str, Any, Any, str]]:
        """The peers to run: all of them, or ``--peers``' comma list."""
        if peers.s3.kind == "moto":  # moto measures moto: the realism check keeps two clients
            return []
        rows = peers.rows()
        if self.args.peers != "all":
            wanted = {p.strip() for p in self.args.peers.split(",") if p.strip()}
            rows = [r for r in rows if r[0] in wanted]
        return rows

    # -- torch: stall and save()-to-commit --------------------------------------------

    def torch_group(self, s3: S3Target, signing: str) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        from cloudckpt.integrations.torch import save_state

        state, n, nbytes = self._torch_state(seed=0)
        client = s3.boto3_client(signing)
        mgr = self.manager(s3.url("torch-ck/"), s3.storage_options(signing), "torch")
        disk = self.work / "torch"
        disk.mkdir()
        last: dict[str, Any] = {}

        def touch() -> None:  # training changes the weights between checkpoints
            for t in state.values():
                t.add_(1e-3)

        def cloudckpt(r: int) -> dict[str, float]:
            touch()
            t0 = time.perf_counter()
            handle = save_state(mgr, r, state)
            t1 = time.perf_counter()
            info = handle.result()
            t2 = time.perf_counter()
            last["ckpt"] = info.ckpt
            return {"stall": t1 - t0, "commit": t2 - t0, "s": t2 - t0}

        def cloudckpt_after(r: int) -> None:
            s3.drop(f"torch-ck/{last.pop('ckpt')}")

        def torch_save(r: int) -> dict[str, float]:
            touch()
            path = disk / f"state-{r}.pt"
            t0 = time.perf_counter()
            torch.save(state, path)
            t1 = time.perf_counter()
            client.upload_file(str(path), s3.bucket, f"{s3.root}torch-boto3/state-{r}.pt")
            t2 = time.perf_counter()
            return {"stall": t1 - t0, "commit": t2 - t0, "upload_file": t2 - t1, "s": t2 - t0}

        def torch_after(r: int) -> None:
            (disk / f"state-{r}.pt").unlink()
            s3.drop("torch-boto3/")

        def dcp_s3(r: int) -> dict[str, float]:
            from s3torchconnector.dcp import S3StorageWriter

            touch()
            writer = S3StorageWriter(
                region=REGION,
                path=f"s3://{s3.bucket}/{s3.root}torch-dcp-s3/{r}/",
                s3client_config=Peers(s3, signing).config(),
                thread_count=2,
            )
            _dcp_endpoint(writer.fs, s3, signing)
            with warnings.catch_warnings(), _env_creds(s3):
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=writer)
                t1 = time.perf_counter()
                fut.result()
                t2 = time.perf_counter()
            return {"stall": t1 - t0, "commit": t2 - t0, "s": t2 - t0}

        def dcp_async(r: int) -> dict[str, float]:
            touch()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=FileSystemWriter(disk / f"dcp-{r}"))
                t1 = time.perf_counter()
                fut.result()
                t2 = time.perf_counter()
            return {"stall": t1 - t0, "written": t2 - t0, "s": t2 - t0}

        group = Group(
            name="torch",
            title=f"stall and save()-to-commit: {nbytes / GiB:.2f} GiB in {n} fp32 tensors "
            f"(S3 endpoint: {s3.kind}, {signing} payload)",
            nbytes=nbytes,
            contenders=[
                Contender(
                    "cloudckpt",
                    cloudckpt,
                    cloudckpt_after,
                    cloudckpt=True,
                    note="save_state: stall = until it returns; commit = until LATEST names "
                    "the checkpoint (staged durably on local disk, uploaded, digests computed)",
                ),
                Contender(
                    "torch.save + upload_file",
                    torch_save,
                    torch_after,
                    note="stall = torch.save to local disk (page cache, no fsync); commit = "
                    "that plus boto3 upload_file (default TransferConfig)",
                ),
                Contender(
                    "DCP async_save S3StorageWriter",
                    dcp_s3,
                    lambda r: s3.drop("torch-dcp-s3/"),
                    note="s3torchconnector's DCP storage writer: stall = until async_save "
                    "returns; commit = until its future completes (every file in S3)",
                ),
                Contender(
                    "DCP async_save",
                    dcp_async,
                    lambda r: _rm(disk / f"dcp-{r}"),
                    note="stall = until async_save returns (FileSystemWriter, local disk); "
                    "written = until its future completes",
                ),
            ],
            comparisons=[
                Comparison("stall", "torch.save + upload_file", 10.0, label="stall vs torch.save"),
                Comparison("stall", "DCP async_save", 2.0, label="stall vs DCP async_save"),
                Comparison(
                    "commit",
                    "torch.save + upload_file",
                    2.0,
                    label="save-to-commit vs torch.save + upload_file",
                ),
                Comparison(
                    "stall",
                    "DCP async_save S3StorageWriter",
                    2.0,
                    label="stall vs DCP async_save to S3 (s3torchconnector)",
                ),
                Comparison(
                    "commit",
                    "DCP async_save S3StorageWriter",
                    1.0,
                    label="save-to-commit vs DCP async_save to S3 (s3torchconnector)",
                ),
                Comparison("cpu_client_s", "DCP async_save", None, label="client CPU"),
                Comparison(
                    "cpu_client_s", "DCP async_save S3StorageWriter", None, label="client CPU"
                ),
            ],
            servers={"server": s3.pid},
            info={"signing": signing, "endpoint": s3.kind},
        )
        self._run_and_release(group, mgr, disk, state)

    def _torch_state(self, seed: int) -> tuple[dict[str, Any], int, int]:
        """The torch groups' state dict: ``--state-mib`` of fp32 in ``--tensors`` tensors."""
        import torch

        n = max(1, self.args.tensors)
        numel = self.args.state_mib * MiB // 4 // n
        torch.manual_seed(seed)
        state = {f"layer{i}.weight": torch.randn(numel) for i in range(n)}
        return state, n, sum(t.numel() * t.element_size() for t in state.values())

    def _run_and_release(self, group: Group, mgr: Any, disk: Path, state: dict) -> None:
        """Run ``group``, then free its manager, files and tensors before the next one."""
        try:
            self.run(group)
        finally:
            mgr.close()
            _rm(disk)
            state.clear()
            gc.collect()

    # -- limits -------------------------------------------------------------------------

    def limits_group(self, mib: int) -> None:
        lim = Limits(mib * MiB, self.work / "limits")
        try:
            group = Group(
                name="limits",
                title=f"physical limits of this machine, {mib} MiB each (no comparisons)",
                nbytes=mib * MiB,
                contenders=[Contender(n, fn, after) for n, fn, after in lim.contenders()],
                comparisons=[],
                servers={"sink": lim.server.pid},
            )
            self.limits = _run_group(group, self.args.pairs, self.args.warmup, None)
            self.record()
        finally:
            lim.close()

    # -- upload -------------------------------------------------------------------------

    def source(self, mib: int, files: int) -> Path:
        src = self.work / f"src-{mib}x{files}"
        if not src.exists():
            _write_files(src, mib * MiB, files)
            os.sync()
        return src

    def s3_upload_group(self, s3: S3Target, signing: str, mib: int, name: str) -> None:
        src = self.source(mib, self.args.files)
        files = sorted(src.iterdir())
        nbytes = sum(f.stat().st_size for f in files)
        mgr = self.manager(s3.url("up-ck/"), s3.storage_options(signing), name)
        client = s3.boto3_client(signing)
        fs = s3.s3fs(signing)
        last: dict[str, Any] = {}

        def cloudckpt(r: int) -> None:
            last["ckpt"] = mgr.save_dir(r, src).result().ckpt

        def boto3_upload(r: int) -> None:
            for f in files:
                client.upload_file(str(f), s3.bucket, f"{s3.root}up-boto3/{r}/{f.name}")

        def s3fs_put(r: int) -> None:
            fs.put(f"{src}/", f"{s3.bucket}/{s3.root}up-s3fs/{r}/", recursive=True)

        peers = Peers(s3, signing)
        peer_rows = self.peer_rows(peers)

        def peer_contender(tag: str, name: str, upload: Any, note: str) -> Contender:
            return Contender(
                name,
                lambda r: upload(files, f"{s3.root}up-{tag}/{r}/"),
                lambda r: s3.drop(f"up-{tag}/"),
                note=note,
            )

        group = Group(
            name=name,
            title=f"upload {nbytes / GiB:.2f} GiB in {len(files)} files from local disk "
            f"(S3 endpoint: {s3.kind}, {signing} payload)",
            nbytes=nbytes,
            contenders=[
                Contender(
                    "cloudckpt",
                    cloudckpt,
                    lambda r: s3.drop(f"up-ck/{last.pop('ckpt')}"),
                    cloudckpt=True,
                    note="save_dir until committed (hard links, ATTEMPT.json, parallel "
                    "multipart with CRC32C and SHA-256 tree digests, listing check, "
                    "manifest, LATEST)",
                ),
                Contender(
                    "boto3 upload_file",
                    boto3_upload,
                    lambda r: s3.drop("up-boto3/"),
                    note="one upload_file per file, default TransferConfig",
                ),
                Contender("s3fs put", s3fs_put, lambda r: s3.drop("up-s3fs/"), note="recursive"),
                *(
                    peer_contender(f"p{i}", name, up, note)
                    for i, (name, up, _, note) in enumerate(peer_rows)
                ),
            ],
            comparisons=[
                Comparison("s", "boto3 upload_file", 1.5),
                Comparison("s", "s3fs put", 1.5),
                *(Comparison("s", name, 1.0) for name, *_ in peer_rows),
                *(
                    # CPU-s per GiB, hashing included, at most 1.5x obstore's (issue 31).
                    Comparison("cpu_client_s", name, 0.67, label="client CPU")
                    for name, *_ in peer_rows
                    if name == "obstore"
                ),
            ],
            servers={"server": s3.pid},
            info={"signing": signing, "endpoint": s3.kind, **_limit(s3, "http put (sink)")},
        )
        try:
            self.run(group)
        finally:
            mgr.close()
            peers.close()

    # -- restore ------------------------------------------------------------------------

    def s3_restore_group(self, s3: S3Target, signing: str, mib: int, name: str) -> None:

        src = self.source(mib, self.args.files)
        files = sorted(src.iterdir())
        nbytes = sum(f.stat().st_size for f in files)
        mgr = self.manager(s3.url("down-ck/"), s3.storage_options(signing), name)
        mgr.save_dir(0, src).result()
        client = s3.boto3_client(signing)
        for f in files:
            client.upload_file(str(f), s3.bucket, f"{s3.root}down-peer/{f.name}")
        fs = s3.s3fs(signing)
        dest = self.work / "restore"

        def boto3_download(r: int) -> None:
            out = dest / f"boto3-{r}"
            out.mkdir(parents=True)
            for f in files:
                client.download_file(s3.bucket, f"{s3.root}down-peer/{f.name}", str(out / f.name))

        def s3fs_get(r: int) -> None:
            out = dest / f"s3fs-{r}"
            out.mkdir(parents=True)
            fs.get(f"{s3.bucket}/{s3.root}down-peer/", f"{out}/", recursive=True)

        peers = Peers(s3, signing)
        peer_rows = self.peer_rows(peers)
        names = [f.name for f in files]

        def peer_contender(tag: str, name: str, download: Any, note: str) -> Contender:
            def run(r: int) -> None:
                out = dest / f"{tag}-{r}"
                out.mkdir(parents=True)
                download(f"{s3.root}down-peer/", names, out)

            return Contender(name, run, lambda r: _rm(dest), note=note)

        group = Group(
            name=name,
            title=f"restore {nbytes / GiB:.2f} GiB in {len(files)} files to local disk "
            f"(S3 endpoint: {s3.kind}, {signing} payload)",
            nbytes=nbytes,
            contenders=[
                *_restore_contenders(mgr, dest),
                Contender(
                    "boto3 download_file",
                    boto3_download,
                    lambda r: _rm(dest),
                    note="one download_file per file, default TransferConfig",
                ),
                Contender("s3fs get", s3fs_get, lambda r: _rm(dest), note="recursive"),
                *(
                    peer_contender(f"p{i}", name, down, note)
                    for i, (name, _, down, note) in enumerate(peer_rows)
                ),
            ],
            comparisons=[
                Comparison("s", "boto3 download_file", 2.0),
                Comparison("s", "s3fs get", None),
                _without_fsync("boto3 download_file"),
                *(Comparison("s", name, 1.0) for name, *_ in peer_rows),
                *(_without_fsync(name, 1.0) for name, *_ in peer_rows),
            ],
            servers={"server": s3.pid},
            info={"signing": signing, "endpoint": s3.kind, **_limit(s3, "http get (source)")},
        )
        try:
            self.run(group)
        finally:
            mgr.close()
            peers.close()
            s3.drop("down-")

    # -- GCS ----------------------------------------------------------------------------

    def gcs_groups(self, gcs: GCSTarget, mib: int) -> None:

        src = self.source(mib, self.args.files)
        files = sorted(src.iterdir())
        nbytes = sum(f.stat().st_size for f in files)
        server = {"server": gcs.pid}
        kind = "fake-gcs-server" if gcs.server else "GCS"

        mgr = self.manager(gcs.url("up-ck/"), gcs.options, "gcs-up")
        fs = gcs.gcsfs()
        last: dict[str, Any] = {}

        def up_ck(r: int) -> None:
            last["ckpt"] = mgr.save_dir(r, src).result().ckpt

        def up_gcsfs(r: int) -> None:
            fs.put(f"{src}/", f"{gcs.bucket}/{gcs.root}up-gcsfs/{r}/", recursive=True)

        up = Group(
            name="gcs-upload",
            title=f"upload {nbytes / GiB:.2f} GiB in {len(files)} files ({kind})",
            nbytes=nbytes,
            contenders=[
                Contender(
                    "cloudckpt",
                    up_ck,
                    lambda r: gcs.drop(f"up-ck/{last.pop('ckpt')}"),
                    cloudckpt=True,
                    note="save_dir until committed (parallel composite upload)",
                ),
                Contender("gcsfs put", up_gcsfs, lambda r: gcs.drop("up-gcsfs/")),
            ],
            comparisons=[Comparison("s", "gcsfs put", 1.5)],
            servers=server,
            info={"endpoint": kind},
        )
        try:
            self.run(up)
        finally:
            mgr.close()

        mgr = self.manager(gcs.url("down-ck/"), gcs.options, "gcs-down")
        mgr.save_dir(0, src).result()
        fs.put(f"{src}/", f"{gcs.bucket}/{gcs.root}down-peer/", recursive=True)
        dest = self.work / "restore"

        def down_gcsfs(r: int) -> None:
            out = dest / f"gcsfs-{r}"
            out.mkdir(parents=True)
            fs.get(f"{gcs.bucket}/{gcs.root}down-peer/", f"{out}/", recursive=True)

        down = Group(
            name="gcs-restore",
            title=f"restore {nbytes / GiB:.2f} GiB in {len(files)} files ({kind})",
            nbytes=nbytes,
            contenders=[
                *_restore_contenders(mgr, dest),
                Contender("gcsfs get", down_gcsfs, lambda r: _rm(dest)),
            ],
            comparisons=[
                Comparison("s", "gcsfs get", 2.0),
                _without_fsync("gcsfs get"),
            ],
            servers=server,
            info={"endpoint": kind},
        )
        try:
            self.run(down)
        finally:
            mgr.close()
            gcs.drop("down-")


def _restore_contenders(mgr: Any, dest: Path) -> list[Contender]:
    """cloudckpt's restore as shipped, and with fsync switched off (as the peers run)."""
    import cloudckpt.download as download

    def restore(r: int) -> None:
        mgr.restore(dest / f"ck-{r}")

    def restore_without_fsync(r: int) -> None:
        with _no_fsync(download):
            mgr.restore(dest / f"cknf-{r}")

    return [
        Contender(
            "cloudckpt",
            restore,
            lambda r: _rm(dest),
            cloudckpt=True,
            note="restore: LATEST, manifest, listing, parallel ranged GETs, every "
            "digest verified, files fsynced, directory renamed into place",
        ),
        Contender(
            "cloudckpt (no fsync)",
            restore_without_fsync,
            lambda r: _rm(dest),
            cloudckpt=True,
            note="the same with fsync switched off by the benchmark (like the peers)",
        ),
    ]


def _without_fsync(peer: str, target: float = 2.0) -> Comparison:
    """``peer`` against cloudckpt's restore with fsync off: like with like."""
    return Comparison(
        "s", peer, target, cloudckpt="cloudckpt (no fsync)", label="s (both without fsync)"
    )


@contextlib.contextmanager
def _no_fsync(download: Any) -> Iterator[None]:
    """Benchmark-only: restore without fsyncing the files, as boto3/s3fs/gcsfs do."""
    saved = download._fsync_path
    download._fsync_path = lambda path: None
    try:
        yield
    finally:
        download._fsync_path = saved


# ----------------------------------------------------------------------------- output


def apply_limits(results: list[dict[str, Any]], limits: dict[str, Any] | None) -> None:
    """Each contender's GiB/s as a fraction of its group's limit (``info["limit"]``)."""
    if not limits:
        return
    rates = {n: c.get("gib_per_s") for n, c in limits["contenders"].items()}
    for g in results:
        limit = rates.get(g.get("limit", ""))
        if not limit:
            continue
        g["limit_gib_per_s"] = limit
        for c in g["contenders"].values():
            if c.get("gib_per_s"):
                c["fraction_of_limit"] = c["gib_per_s"] / limit


def limits_table(limits: dict[str, Any] | None) -> str:
    if not limits:
        return ""
    lines = [limits["title"], f"  {'limit':<28} {'median s':>9} {'GiB/s':>6} {'s per GiB':>9}"]
    for name, c in limits["contenders"].items():
        s = c["metrics"]["s"]["median"]
        gib = c.get("gib_per_s") or float("nan")
        lines.append(f"  {name:<28} {_fmt_s(s):>9} {gib:>6.2f} {1 / gib:>9.3f}")
    return "\n".join(lines)


def _fmt_s(x: float) -> str:
    return "-" if x != x else (f"{x:.3f}" if x < 1 else f"{x:.2f}")


def table(results: list[dict[str, Any]]) -> str:
    lines = []
    for g in results:
        lines.append("")
        lines.append(g["title"])
        lines.append(
            f"  {'contender':<32} {'median s':>9} {'GiB/s':>6} {'of limit':>8} {'cpu client':>10} "
            f"{'cpu/GiB':>8} {'cpu server':>10}   other medians"
        )
        if g.get("limit_gib_per_s"):
            lines[-2] += f"  [limit: {g['limit']}, {g['limit_gib_per_s']:.2f} GiB/s]"
        for name, c in g["contenders"].items():
            m = c["metrics"]
            other = ", ".join(
                f"{k} {_fmt_s(v['median'])}"
                for k, v in m.items()
                if k not in ("s",) and not k.startswith("cpu_")
            )
            gib = c.get("gib_per_s")
            frac = c.get("fraction_of_limit")
            lines.append(
                f"  {name:<32} {_fmt_s(m['s']['median']):>9} "
                f"{'' if gib is None else f'{gib:.2f}':>6} "
                f"{'' if frac is None else f'{frac:.0%}':>8} "
                f"{_fmt_s(m['cpu_client_s']['median']):>10} "
                f"{_fmt_s(c.get('cpu_client_s_per_gib', float('nan'))):>8} "
                f"{_fmt_s(m.get('cpu_server_s', {}).get('median', float('nan'))):>10}   {other}"
            )
        for cmp in g["comparisons"]:
            target = "" if cmp["target"] is None else f"target >= {cmp['target']:g}x"
            met = {True: "MET", False: "NOT MET", None: ""}[cmp["met"]]
            who = "" if cmp["cloudckpt"] == "cloudckpt" else f" [{cmp['cloudckpt']}]"
            lines.append(
                f"  -> {cmp['label']}{who}: {cmp['baseline']} / cloudckpt = "
                f"{cmp['speedup']:.2f}x  ({_fmt_s(cmp['baseline_median_s'])} s vs "
                f"{_fmt_s(cmp['cloudckpt_median_s'])} s)  {target} {met}".rstrip()
            )
    return "\n".join(lines)


def summary(results: list[dict[str, Any]]) -> str:
    rows = [
        f"{'group':<14} {'comparison':<58} {'ratio':>7} {'target':>8}  met  "
        f"{'cloudckpt':>9} {'peer':>5}  (fraction of the limit)",
    ]
    for g in results:
        for cmp in g["comparisons"]:
            label = f"{cmp['label']} vs {cmp['baseline']}"
            if cmp["label"].startswith(("stall", "save-to")):
                label = cmp["label"]
            sig = g.get("signing")
            name = g["name"] + (f"/{sig[0]}" if sig and g["name"] != "torch" else "")
            target = "" if cmp["target"] is None else f">={cmp['target']:g}x"
            met = {True: "yes", False: "NO", None: "-"}[cmp["met"]]
            fr = [
                g["contenders"][who].get("fraction_of_limit")
                for who in (cmp["cloudckpt"], cmp["baseline"])
            ]
            lim = "  ".join(f"{'' if f is None else f'{f:.0%}':>5}" for f in fr)
            rows.append(
                f"{name:<14} {label[:58]:<58} {cmp['speedup']:>6.2f}x {target:>8}  {met:<3}  "
                f"    {lim}".rstrip()
            )
    return "\n".join(rows)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    mods = ("cloudckpt", "torch", "boto3", "botocore", "s3transfer", "s3fs", "gcsfs")
    for mod in (*mods, "awscrt", "obstore", "s3torchconnector", "safetensors"):
        with contextlib.suppress(Exception):
            out[mod] = __import__(mod).__version__
    with contextlib.suppress(Exception):
        exe = find_s5cmd()
        if exe:
            out["s5cmd"] = subprocess.run(
                [exe, "version"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
    return out


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    with contextlib.suppress(OSError, ValueError, IndexError):
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu"] = next(x for x in cpuinfo if x.startswith("model name")).split(":")[1].strip()
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        total = next(x for x in meminfo if x.startswith("MemTotal"))
        info["mem_gib"] = round(int(total.split()[1]) / 2**20, 1)
    return info


# ----------------------------------------------------------------------------- main


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

        bench.torch_group(s3, signings[0])
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
            bench.s3_upload_group(s3, signing, args.mib, "s3-upload")
        bench.s3_restore_group(s3, signings[0], args.mib, "s3-restore")


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
    bench.on_result = lambda: _write_json(args, argv, signings, started, bench, partial=True)
    hogs = _start_hogs(args.hogs)
    QUIET.exclude = [h.pid for h in hogs]
    print(
        f"cloudckpt benchmarks: pairs={args.pairs} warm-up={args.warmup} work={bench.work} "
        f"signing={','.join(signings)} hogs={len(hogs)}",
        flush=True,
    )
    try:
        if "limits" in groups:
            bench.limits_group(args.limits_mib)
        if {"torch", "resume", "s3", "dcp", "dlio", "scale", "memory"} & set(groups):
            s3 = S3Target("real", args.s3_url) if args.s3_url else S3Target("bench")
            try:
                _s3_groups(bench, s3, signings, groups, args)
            finally:
                s3.close()
        if "gcs" in groups:
            gcs = GCSTarget(args.gcs_url)
            try:
                bench.gcs_groups(gcs, args.gcs_mib)
            finally:
                gcs.close()
        if "moto" in groups and not args.s3_url:
            moto = S3Target("moto")
            try:
                bench.s3_upload_group(moto, signings[0], args.moto_mib, "moto-upload")
                bench.s3_restore_group(moto, signings[0], args.moto_mib, "moto-restore")
            finally:
                moto.close()
    finally:
        bench.close()
        _stop_hogs(hogs)

    doc = _write_json(args, argv, signings, started, bench, partial=False)
    print("\n" + limits_table(bench.limits))
    print("\n" + table(bench.results))
    print("\n" + summary(bench.results))
    print(f"\nresults: {args.json}  ({doc['duration_s']:.0f} s)")
    return 0


def _write_json(
    args: argparse.Namespace,
    argv: list[str] | None,
    signings: list[str],
    started: float,
    bench: Bench,
    *,
    partial: bool,
) -> dict[str, Any]:
    """Write the results so far to ``args.json`` (after every group, so a killed run keeps
    what it measured; ``partial`` says the run had not finished)."""
    apply_limits(bench.results, bench.limits)
    doc = {
        "schema": SCHEMA,
        "command": " ".join(
            ["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])]
        ),
        "started_at": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(),
        "duration_s": time.time() - started,
        "quick": args.quick,
        "partial": partial,
        "config": {
            "pairs": args.pairs,
            "warmup": args.warmup,
            "mib": args.mib,
            "files": args.files,
            "state_mib": args.state_mib,
            "tensors": args.tensors,
            "gcs_mib": args.gcs_mib,
            "moto_mib": args.moto_mib,
            "signing": signings,
            "s3_url": args.s3_url,
            "gcs_url": args.gcs_url,
            "hogs": args.hogs,
            "peers": args.peers,
            "limits_mib": args.limits_mib,
            "dcp_mib": args.dcp_mib,
            "scale_mib": args.scale_mib,
            "dlio_hidden": args.dlio_hidden,
            "dlio_layers": args.dlio_layers,
            "dlio_ranks": args.dlio_ranks,
        },
        "machine": _machine(),
        "idle_wait": {
            "enabled": QUIET.enabled,
            "waited_s": round(QUIET.waited_s, 1),
            "measurements_started_busy": QUIET.busy_starts,
        },
        "versions": _versions(),
        "limits": bench.limits,
        "groups": bench.results,
    }
    Path(args.json).write_text(json.dumps(doc, indent=2, allow_nan=True) + "\n")
    return doc


if __name__ == "__main__":
    sys.exit(main())
