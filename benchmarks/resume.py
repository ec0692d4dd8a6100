"""Resume benchmarks (issue 23), run by ``python -m benchmarks --groups torch`` (and ``dcp``).

- ``torch-restore``: a state dict back into memory on a new host. cloudckpt ``load_state``
  from the store (verified, no local file) against DCP ``load`` with s3torchconnector's
  ``S3StorageReader``, s5cmd + ``torch.load``, obstore ranged reads straight into buffers
  (unverified: what a model streamer does), boto3 ``download_file`` + ``torch.load``, and
  cloudckpt's earlier way (``restore`` into a directory + ``load_state``). Into the model:
  ``load_state(into=...)`` filling a state dict built and touched before the timed part (as
  a restarted job's model is), against DCP ``load`` and obstore's ranged reads into that
  same prebuilt destination. On a CUDA machine also ``load_state(device="cuda")`` against
  DCP ``load`` into CUDA tensors.
- ``torch-resume``: the same state after a restart: on the same host, where the staging
  directory holds a verified copy of the committed checkpoint (``resume_state``, zero
  bytes downloaded), against a new host (``resume_state`` with an empty staging
  directory), each also into the model (``resume_state(into=...)``, a prebuilt, touched
  destination). And the time from a fresh process to its first training step after resume,
  split into process start, listing, transfer, verification, load and the step, for both.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    REGION,
    Comparison,
    Contender,
    GiB,
    Group,
    S3Target,
    _dcp_endpoint,
    _limit,
    _rm,
)
from benchmarks.peers import Peers, _env_creds

REPORT_METRICS = ("listing_s", "transfer_s", "verify_s", "load_s")


def _report_metrics(report: Any) -> dict[str, float]:
    out = {k: float(getattr(report, k)) for k in REPORT_METRICS}
    out["hash_cpu_s"] = report.hash_cpu_s
    out["bytes_downloaded"] = float(report.bytes_downloaded)
    out["bytes_local"] = float(report.bytes_local)
    return out


# ----------------------------------------------------------------------------- peers


def obstore_into_buffers(
    store: Any, key: str, size: int, range_size: int, into: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The safetensors file at ``key`` read with parallel ranged GETs (obstore, 16 threads)
    into preallocated tensors (``into``'s, given: built and touched beforehand, as a
    model is; else new ones), nothing verified: the header by one GET, then every range,
    each copied into the tensor(s) it covers (obstore hands each range over as a buffer)."""
    import json as _json
    import struct

    import obstore
    import torch
    from safetensors.torch import _TYPES  # type: ignore[attr-defined]

    head = bytes(obstore.get_range(store, key, start=0, length=min(size, 1 << 16)))
    (n,) = struct.unpack("<Q", head[:8])
    if 8 + n > len(head):
        head = bytes(obstore.get_range(store, key, start=0, length=8 + n))
    header = _json.loads(head[8 : 8 + n])
    base = 8 + n
    tensors: dict[str, Any] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if into is not None:
            t = into[name]
        else:
            t = torch.empty(info["shape"], dtype=_TYPES[info["dtype"]])
        start, end = info["data_offsets"]
        if end > start:
            spans.append((base + start, base + end, t.reshape(-1).view(torch.uint8).numpy()))
        tensors[name] = t
    spans.sort(key=lambda s: s[0])
    starts = list(range(base, size, range_size))

    def one(s: int) -> None:
        e = min(s + range_size, size)
        view = memoryview(obstore.get_range(store, key, start=s, end=e))
        for a, b, dst in spans:
            lo, hi = max(a, s), min(b, e)
            if lo < hi:
                dst[lo - a : hi - a] = view[lo - s : hi - s]

    # Threads: each get_range releases the GIL while Rust fetches. (asyncio.gather over
    # get_range_async was measured 50x slower here, in its event-loop bridge.)
    with cf.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, starts))
    return tensors


# ----------------------------------------------------------------------------- groups


def torch_restore_group(bench: Any, s3: S3Target, signing: str) -> None:
    """A state dict back into memory on a new host (module docstring)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from safetensors.torch import save_file

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import LoadReport, load_state, save_state

    state, n, nbytes = bench._torch_state(seed=1)
    client = s3.boto3_client(signing)
    peers = Peers(s3, signing)
    disk = bench.work / "torch-restore"
    disk.mkdir()
    url = s3.url("torch-restore-ck/")
    options = s3.storage_options(signing)
    # The checkpoints, written once, unmeasured. cloudckpt's with its default chunking.
    writer = CheckpointManager(url, storage_options=options, staging_dir=disk / "w", keep_local=0)
    save_state(writer, 1, state).result()
    writer.close()
    torch.save(state, disk / "state.pt")
    pt_key = f"{s3.root}torch-restore-boto3/state.pt"
    client.upload_file(str(disk / "state.pt"), s3.bucket, pt_key)
    (disk / "state.pt").unlink()
    save_file(state, str(disk / "state.safetensors"))
    st_key = f"{s3.root}torch-restore-obstore/state.safetensors"
    st_size = (disk / "state.safetensors").stat().st_size
    client.upload_file(str(disk / "state.safetensors"), s3.bucket, st_key)
    (disk / "state.safetensors").unlink()
    dcp_path = f"s3://{s3.bucket}/{s3.root}torch-restore-dcp/"
    dcp_writer = S3StorageWriter(region=REGION, path=dcp_path, s3client_config=peers.config())
    _dcp_endpoint(dcp_writer.fs, s3, signing)
    with warnings.catch_warnings(), _env_creds(s3):
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp_writer)
    expected = {k: v.clone() for k, v in state.items()}
    state.clear()
    # A new host each round: a fresh manager, nothing in its staging directory.
    reader = CheckpointManager(url, storage_options=options, staging_dir=disk / "r", keep_local=0)

    def check(loaded: dict[str, Any]) -> None:
        # Every contender must really return the state (one tensor compared per round).
        name = next(iter(expected))
        if not torch.equal(loaded[name].cpu(), expected[name]):
            raise AssertionError(f"restored {name} differs")

    def cloudckpt(r: int) -> dict[str, float]:
        report = LoadReport()
        check(load_state(reader, report=report))
        return _report_metrics(report)

    def cloudckpt_disk(r: int) -> dict[str, float]:
        res = reader.restore(disk / f"rd-{r}")
        if res.bytes_downloaded < nbytes:  # a new host: every byte from the store
            raise AssertionError(f"{res.bytes_downloaded} bytes downloaded")
        return {"bytes_downloaded": float(res.bytes_downloaded)}

    def cloudckpt_dir(r: int) -> None:
        check(load_state(reader.restore(disk / f"ck-{r}")))

    def torch_load(r: int) -> None:
        path = disk / f"state-{r}.pt"
        client.download_file(s3.bucket, pt_key, str(path))
        check(torch.load(path, weights_only=True))

    def s5cmd_load(r: int) -> None:
        dest = disk / f"s5-{r}"
        dest.mkdir()
        peers.s5cmd_download(f"{s3.root}torch-restore-boto3/", ["state.pt"], dest)
        check(torch.load(dest / "state.pt", weights_only=True))

    def obstore_load(r: int) -> None:
        check(obstore_into_buffers(peers.obstore(), st_key, st_size, 16 << 20))

    def dcp_load(r: int, device: str = "cpu") -> None:
        dcp_reader = S3StorageReader(region=REGION, path=dcp_path, s3client_config=peers.config())
        _dcp_endpoint(dcp_reader.fs, s3, signing)
        target = {k: torch.empty_like(v, device=device) for k, v in expected.items()}
        with warnings.catch_warnings(), _env_creds(s3):
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=dcp_reader)
        check(target)

    contenders = [
        Contender(
            "cloudckpt",
            cloudckpt,
            cloudckpt=True,
            note="load_state from the store (new host): LATEST, manifest, listing, parallel "
            "ranged GETs straight into the tensors, every chunk and file digest verified",
        ),
        Contender(
            "DCP load S3StorageReader",
            dcp_load,
            note="s3torchconnector's DCP storage reader (dcp_optimized) into preallocated "
            "tensors; nothing verified",
        ),
        Contender(
            "obstore ranges into buffers",
            obstore_load,
            note="obstore get_range, 16 MiB ranges, 16 in flight (threads), each copied into "
            "preallocated tensors (a model streamer's way); nothing verified",
        ),
        Contender(
            "download_file + torch.load",
            torch_load,
            lambda r: (disk / f"state-{r}.pt").unlink(),
            note="boto3 download_file (default TransferConfig) + torch.load (weights_only); "
            "nothing verified",
        ),
        Contender(
            "cloudckpt restore to disk",
            cloudckpt_disk,
            lambda r: _rm(disk / f"rd-{r}"),
            cloudckpt=True,
            note="restore of the same checkpoint into a directory (new host: every byte "
            "downloaded, verified, written and fsynced): the bytes to disk, as fast as into "
            "memory is the goal (issue 31)",
        ),
        Contender(
            "cloudckpt restore + load_state",
            cloudckpt_dir,
            lambda r: _rm(disk / f"ck-{r}"),
            cloudckpt=True,
            note="the earlier way: restore into a directory (verified, fsynced), then "
            "load_state of the directory",
        ),
    ]
    # Into the model: one destination, built and touched before any round (a restarted
    # job's model exists, its pages faulted in, before it loads), reused by every round.
    model = {k: torch.empty_like(v).fill_(0.5) for k, v in expected.items()}
    into_model = _into_model_contenders(
        model, check, reader, peers, s3, signing, dcp_path, (st_key, st_size)
    )
    if peers.s5cmd:
        contenders.insert(
            3,
            Contender(
                "s5cmd + torch.load",
                s5cmd_load,
                lambda r: _rm(disk / f"s5-{r}"),
                note="s5cmd cp (its defaults) + torch.load (weights_only); nothing verified",
            ),
        )
    comparisons = [
        Comparison("s", c.name, 1.3, label="into memory") for c in contenders if not c.cloudckpt
    ]
    comparisons.append(
        Comparison("s", "cloudckpt restore to disk", 1.0, label="into memory vs to disk")
    )
    comparisons.append(
        Comparison("s", "cloudckpt restore + load_state", None, label="vs the directory way")
    )
    contenders += into_model
    comparisons += [
        Comparison("s", c.name, 1.3, cloudckpt="cloudckpt into the model", label="into the model")
        for c in into_model
        if not c.cloudckpt
    ]
    comparisons.append(
        Comparison(
            "s",
            "cloudckpt",
            None,
            cloudckpt="cloudckpt into the model",
            label="into the model vs new tensors",
        )
    )
    if torch.cuda.is_available():
        from cloudckpt.integrations.torch import LoadReport as _LR

        def cloudckpt_gpu(r: int) -> dict[str, float]:
            report = _LR()
            check(load_state(reader, device="cuda", report=report))
            torch.cuda.synchronize()
            return _report_metrics(report)

        def dcp_gpu(r: int) -> None:
            dcp_load(r, "cuda")
            torch.cuda.synchronize()

        contenders += [
            Contender(
                "cloudckpt to GPU",
                cloudckpt_gpu,
                cloudckpt=True,
                note="load_state(device='cuda'): pinned staging, copies overlapped",
            ),
            Contender("DCP load S3StorageReader to GPU", dcp_gpu, note="into CUDA tensors"),
        ]
        comparisons.append(
            Comparison(
                "s",
                "DCP load S3StorageReader to GPU",
                1.3,
                cloudckpt="cloudckpt to GPU",
                label="into GPU memory",
            )
        )
    group = Group(
        name="torch-restore",
        title=f"state dict back into memory: {nbytes / GiB:.2f} GiB in {n} fp32 tensors "
        f"(S3 endpoint: {s3.kind}, {signing} payload)",
        nbytes=nbytes,
        contenders=contenders,
        comparisons=comparisons,
        servers={"server": s3.pid},
        info={"signing": signing, "endpoint": s3.kind, **_limit(s3, "http get (source)")},
    )
    try:
        bench.run(group)
    finally:
        reader.close()
        peers.close()
        _rm(disk)
        expected.clear()
        model.clear()


def _into_model_contenders(
    model: dict[str, Any],
    check: Any,
    reader: Any,
    peers: Peers,
    s3: S3Target,
    signing: str,
    dcp_path: str,
    st_object: tuple[str, int],
) -> list[Contender]:
    """``torch-restore``'s contenders into a prebuilt model: cloudckpt ``load_state(into=)``,
    DCP ``load`` and obstore's ranged reads, all into ``model`` (built and touched by the
    caller, reused by every round). After each round one tensor is scribbled on, so the
    next round's check shows that round filled it."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageReader

    from cloudckpt.integrations.torch import LoadReport, load_state

    first = next(iter(model))
    st_key, st_size = st_object

    def scribble(r: int) -> None:
        model[first].fill_(0.5)

    def check_model(loaded: dict[str, Any]) -> None:
        if loaded[first] is not model[first]:
            raise AssertionError("not loaded into the model's tensors")
        check(loaded)

    def cloudckpt_into(r: int) -> dict[str, float]:
        report = LoadReport()
        check_model(load_state(reader, into=model, report=report))
        return _report_metrics(report)

    def dcp_into(r: int) -> None:
        dcp_reader = S3StorageReader(region=REGION, path=dcp_path, s3client_config=peers.config())
        _dcp_endpoint(dcp_reader.fs, s3, signing)
        with warnings.catch_warnings(), _env_creds(s3):
            warnings.simplefilter("ignore")
            dcp.load(model, storage_reader=dcp_reader)
        check(model)

    def obstore_into(r: int) -> None:
        check_model(obstore_into_buffers(peers.obstore(), st_key, st_size, 16 << 20, model))

    return [
        Contender(
            "cloudckpt into the model",
            cloudckpt_into,
            scribble,
            cloudckpt=True,
            note="load_state(reader, into=model) from the store (new host), every byte "
            "verified, landed in a prebuilt state dict whose pages were touched before the "
            "timed part (one destination reused by every round)",
        ),
        Contender(
            "DCP load into the model",
            dcp_into,
            scribble,
            note="dcp.load(model) with s3torchconnector's S3StorageReader into the same "
            "prebuilt, touched destination; nothing verified",
        ),
        Contender(
            "obstore ranges into the model",
            obstore_into,
            scribble,
            note="obstore ranged reads as above, copied into the same prebuilt, touched "
            "destination (fair to it: no fresh pages either); nothing verified",
        ),
    ]


def torch_resume_group(bench: Any, s3: S3Target, signing: str) -> None:
    """Same-host restart (a verified local copy) against a new host (module docstring)."""
    import torch

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import LoadReport, resume_state, save_state

    state, n, nbytes = bench._torch_state(seed=2)
    disk = bench.work / "torch-resume"
    disk.mkdir()
    url = s3.url("torch-resume-ck/")
    options = s3.storage_options(signing)
    staging = disk / "same-host"
    writer = CheckpointManager(url, storage_options=options, staging_dir=staging)
    save_state(writer, 1, state).result()
    writer.close()  # the process ends; its staging directory keeps the committed copy
    name = next(iter(state))
    expected = state[name].clone()
    # The restarted job's model: built and touched before any round, reused by every
    # round (its pages are resident, as a model's are once built); after each round its
    # first tensor is scribbled on, so the next round's check shows that round filled it.
    model = {k: torch.empty_like(v).fill_(0.5) for k, v in state.items()}
    state.clear()

    def resume(staging_dir: Path, into: dict[str, Any] | None = None) -> dict[str, float]:
        mgr = CheckpointManager(url, storage_options=options, staging_dir=staging_dir)
        try:
            report = LoadReport()
            got = resume_state(mgr, into=into, report=report)
            if not torch.equal(got[name], expected):
                raise AssertionError("resumed state differs")
            if into is not None and got[name] is not into[name]:
                raise AssertionError("not resumed into the model's tensors")
            return _report_metrics(report)
        finally:
            mgr.close()

    def scribble(r: int) -> None:
        model[name].fill_(0.5)

    def scribble_and_rm(r: int) -> None:
        scribble(r)
        _rm(disk / f"new-into-{r}")

    def first_step(mode: str, r: int) -> dict[str, float]:
        staging_dir = staging if mode == "local" else disk / f"fresh-{r}"
        return _fresh_process(url, options, staging_dir, disk / f"fp-{mode}-{r}.json")

    contenders = [
        Contender(
            "cloudckpt same host",
            lambda r: resume(staging),
            cloudckpt=True,
            note="resume_state with the staging directory of the process that saved: the "
            "local copy verified (every digest recomputed), nothing downloaded",
        ),
        Contender(
            "cloudckpt new host",
            lambda r: resume(disk / f"new-{r}"),
            lambda r: _rm(disk / f"new-{r}"),
            cloudckpt=True,
            note="resume_state with an empty staging directory: every byte from the store",
        ),
        Contender(
            "cloudckpt same host into the model",
            lambda r: resume(staging, model),
            scribble,
            cloudckpt=True,
            note="resume_state(into=model) with the staging directory of the process that "
            "saved: the local copy verified and landed in the model's tensors (built and "
            "touched before the timed part, reused by every round)",
        ),
        Contender(
            "cloudckpt new host into the model",
            lambda r: resume(disk / f"new-into-{r}", model),
            scribble_and_rm,
            cloudckpt=True,
            note="resume_state(into=model) with an empty staging directory: every byte from "
            "the store, landed in the same prebuilt, touched model",
        ),
        Contender(
            "fresh process, same host",
            lambda r: first_step("local", r),
            cloudckpt=True,
            note="a new python process: imports, manager, resume_state, load_state_dict, one "
            "training step; s = process start to the first step done",
        ),
        Contender(
            "fresh process, new host",
            lambda r: first_step("store", r),
            lambda r: _rm(disk / f"fresh-{r}"),
            cloudckpt=True,
            note="the same with an empty staging directory",
        ),
    ]
    group = Group(
        name="torch-resume",
        title=f"restart: {nbytes / GiB:.2f} GiB in {n} fp32 tensors, same host (local copy) "
        f"vs new host (S3 endpoint: {s3.kind}, {signing} payload)",
        nbytes=nbytes,
        contenders=contenders,
        comparisons=[
            Comparison(
                "s",
                "cloudckpt new host",
                4.0,
                cloudckpt="cloudckpt same host",
                label="same-host restart",
            ),
            Comparison(
                "s",
                "cloudckpt new host into the model",
                4.0,
                cloudckpt="cloudckpt same host into the model",
                label="same-host restart, in place",
            ),
            Comparison(
                "s",
                "fresh process, new host",
                None,
                cloudckpt="fresh process, same host",
                label="time to first step",
            ),
        ],
        servers={"server": s3.pid},
        info={"signing": signing, "endpoint": s3.kind},
    )
    try:
        bench.run(group)
    finally:
        _rm(disk)
        model.clear()


def _fresh_process(url: str, options: dict[str, Any], staging: Path, out: Path) -> dict[str, float]:
    """Run ``benchmarks.first_step`` in a new interpreter; its split of the time."""
    started = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.first_step",
        "--url",
        url,
        "--options",
        json.dumps(options),
        "--staging",
        str(staging),
        "--out",
        str(out),
        "--spawned-at",
        repr(started),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"first_step failed: {proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    result["s"] = time.time() - started
    return result


def dir_resume_group(bench: Any, s3: S3Target, signing: str) -> None:
    """A directory restore on the same host (the verified local copy: each file reflinked
    where the filesystem can, else copied; or hard-linked with ``link_local=True``) against
    a new host (every byte from the store). Each round opens a manager, restores, closes."""
    from cloudckpt import CheckpointManager

    nbytes = bench.args.state_mib * 1024 * 1024
    nfiles = max(1, bench.args.files)
    disk = bench.work / "dir-resume"
    disk.mkdir()
    url = s3.url("dir-resume-ck/")
    options = s3.storage_options(signing)
    staging = disk / "same-host"
    writer = CheckpointManager(url, storage_options=options, staging_dir=staging)
    with writer.save(step=1) as d:
        for i in range(nfiles):
            (d / f"shard-{i}.bin").write_bytes(os.urandom(nbytes // nfiles))
    writer.close()  # its staging directory keeps the committed copy

    def restore(staging_dir: Path, out: Path, link_local: bool, local: bool) -> dict[str, float]:
        mgr = CheckpointManager(url, storage_options=options, staging_dir=staging_dir)
        try:
            res = mgr.restore(out, link_local=link_local)
        finally:
            mgr.close()
        if local != (res.bytes_downloaded == 0):
            raise AssertionError(f"{res.bytes_downloaded} bytes downloaded")
        return {"bytes_downloaded": float(res.bytes_downloaded)}

    def tidy(r: int) -> None:
        for p in disk.glob(f"*-{r}"):
            _rm(p)

    contenders = [
        Contender(
            "restore same host (copy)",
            lambda r: restore(staging, disk / f"copy-{r}", False, True),
            tidy,
            cloudckpt=True,
            note="mgr.restore on the host that saved: each verified file of the local copy "
            "reflinked where the filesystem can, else copied (copy_file_range); nothing "
            "downloaded; restored files independent of the copy",
        ),
        Contender(
            "restore same host (link_local)",
            lambda r: restore(staging, disk / f"link-{r}", True, True),
            tidy,
            cloudckpt=True,
            note="the same with link_local=True: hard links to the kept copy (an in-place "
            "edit of a restored file edits the copy)",
        ),
        Contender(
            "restore new host",
            lambda r: restore(disk / f"new-staging-{r}", disk / f"new-{r}", False, False),
            tidy,
            cloudckpt=True,
            note="mgr.restore with an empty staging directory: every byte from the store",
        ),
    ]
    group = Group(
        name="dir-resume",
        title=f"restart into a directory: {nbytes / GiB:.2f} GiB in {nfiles} files, same host "
        f"(local copy) vs new host (S3 endpoint: {s3.kind}, {signing} payload)",
        nbytes=nbytes,
        contenders=contenders,
        comparisons=[
            Comparison(
                "s",
                "restore new host",
                4.0,
                cloudckpt="restore same host (copy)",
                label="same-host directory restore (copy)",
            ),
            Comparison(
                "s",
                "restore new host",
                4.0,
                cloudckpt="restore same host (link_local)",
                label="same-host directory restore (link_local)",
            ),
        ],
        servers={"server": s3.pid},
        info={"signing": signing, "endpoint": s3.kind},
    )
    try:
        bench.run(group)
    finally:
        _rm(disk)
