"""The ``torch`` group: 1 GiB of tensors, the stall and save()-to-commit of ``save_state``
against ``torch.save`` + ``upload_file`` and DCP ``async_save`` (local disk and
s3torchconnector's ``S3StorageWriter``)."""

from __future__ import annotations

import gc
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.bench import Bench
from benchmarks.harness import (
    REGION,
    Comparison,
    Contender,
    GiB,
    Group,
    S3Target,
    _dcp_endpoint,
    _rm,
)
from benchmarks.peers import Peers, _env_creds


def torch_group(bench: Bench, s3: S3Target, signing: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from cloudckpt.integrations.torch import save_state

    state, n, nbytes = bench._torch_state(seed=0)
    client = s3.boto3_client(signing)
    mgr = bench.manager(s3.url("torch-ck/"), s3.storage_options(signing), "torch")
    disk = bench.work / "torch"
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
            Comparison("cpu_client_s", "DCP async_save S3StorageWriter", None, label="client CPU"),
        ],
        servers={"server": s3.pid},
        info={"signing": signing, "endpoint": s3.kind},
    )
    _run_and_release(bench, group, mgr, disk, state)


def _run_and_release(bench: Bench, group: Group, mgr: Any, disk: Path, state: dict) -> None:
    """Run ``group``, then free its manager, files and tensors before the next one."""
    try:
        bench.run(group)
    finally:
        mgr.close()
        _rm(disk)
        state.clear()
        gc.collect()
