"""One rank of a multi-rank cloudckpt job, for tests/test_distributed.py and test_dcp.py.

Run under ``torchrun --nproc_per_node=2`` (gloo, CPU), or as a single plain process::

    python -m torch.distributed.run --nproc_per_node=2 --master_addr 127.0.0.1 \\
        --master_port PORT tests/scripts/dist_ckpt.py --scenario main --url s3://b/run \\
        --work DIR

Scenarios (each rank appends JSON lines to ``DIR/events-<rank>.jsonl``):

- ``main`` (2 ranks): a fresh run; a multi-rank ``save`` (step 1, per-rank files), a DCP
  ``save`` (step 2) and ``async_save`` (step 3) of DTensors sharded over both ranks, a save
  where rank 1's upload fails (step 4), a DCP save where it fails (step 5), a save whose
  block raises on rank 1 (step 6), colliding user paths on another run, incremental saves
  on a third run (``scenario_chunks``); then, as a new job, ``resume`` of step 1 (one download for the
  node), a read-only restore as if each rank were its own node, and DCP loads of steps 2
  and 3 resharded onto another placement.
- ``load1`` (1 process): DCP load of step 3 into plain tensors, and a restore of step 1.
- ``load3`` (3 ranks): DCP loads of steps 2 and 3, saved by 2 ranks, resharded over 3
  (``Shard(0)`` of 8 rows as 3 + 3 + 2), each rank streaming only what its plan reads.
- ``kill`` (2 ranks): step 1 commits; in step 2 rank 1 stalls after its first uploaded file
  and writes ``DIR/stalled.json`` (its pid), for the test to SIGKILL or SIGSTOP it. Rank 0
  records the error its save raises, and how long it took.

Storage options come as JSON in CLOUDCKPT_TEST_STORAGE_OPTIONS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from cloudckpt import TransferConfig
from cloudckpt.distributed import DistributedCheckpointManager, rank_dir
from cloudckpt.errors import StoreError
from cloudckpt.integrations.dcp import CloudStorageReader, CloudStorageWriter

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # never a real metadata host
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

OPTIONS = json.loads(os.environ.get("CLOUDCKPT_TEST_STORAGE_OPTIONS", "{}"))
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


class Events:
    def __init__(self, work: Path) -> None:
        self.path = work / f"events-{RANK}.jsonl"

    def __call__(self, event: str, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, "rank": RANK, **fields}, default=str) + "\n")
            f.flush()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def full_state(step: int) -> dict[str, torch.Tensor]:
    """The model's full tensors at ``step`` (every rank computes the same)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(5, generator=g)}


def error_fields(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)}


def manager(url: str, work: Path, name: str, **kwargs) -> DistributedCheckpointManager:
    return DistributedCheckpointManager(
        url, storage_options=OPTIONS, staging_dir=work / f"staging-{name}", **kwargs
    )


def inject_upload_failure(mgr) -> callable:
    """Make this rank's next uploads fail (multi-rank saves upload through
    ``mgr.attempts.upload_chunks``, or ``upload_files`` with chunking off, as DCP writers
    do); returns the undo."""

    def failing(*args, **kwargs):
        raise StoreError("injected upload failure on rank 1")

    mgr.attempts.upload_files = failing
    mgr.attempts.upload_chunks = failing

    def undo() -> None:
        delattr(mgr.attempts, "upload_files")
        delattr(mgr.attempts, "upload_chunks")

    return undo


# ------------------------------------------------------------------------------ main


def scenario_main(url: str, work: Path, ev: Events) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    downloaded = [0]
    mgr = manager(
        url, work, "a", timeout=30, progress=lambda n: downloaded.__setitem__(0, downloaded[0] + n)
    )
    ev("resume-empty", result=mgr.resume(work / "restore-empty"))

    # 1. A multi-rank save: each rank's own files, one commit.
    payload = f"shard of rank {RANK} ".encode() * (1000 * (RANK + 1))
    handle = mgr.save(1, metadata={"loss": 0.5})
    with handle as d:
        (d / "shard.bin").write_bytes(payload)
        torch.save({"rank": RANK, "t": torch.arange(4) + RANK}, d / "extra.pt")
    info = handle.result(timeout=60)
    ev(
        "saved",
        step=1,
        commit_id=info.commit_id,
        seq=info.seq,
        num_files=info.num_files,
        sha=hashlib.sha256(payload).hexdigest(),
    )

    # 2./3. DCP save and async_save of DTensors sharded across the ranks.
    def dtensor_state(step: int) -> dict:
        full = full_state(step)
        return {
            "model": {
                "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                "b": distribute_tensor(full["b"], mesh, [Replicate()]),
            },
            "extra": {"step": step, "name": f"step-{step}"},
        }

    writer = CloudStorageWriter(mgr, step=2, metadata={"kind": "dcp"})
    dcp.save(dtensor_state(2), storage_writer=writer)
    ev(
        "dcp-saved",
        step=2,
        commit=None if writer.commit_info is None else writer.commit_info.commit_id,
    )

    ckpt_group = dist.new_group(backend="gloo")  # async_save's collectives run in a thread
    writer = CloudStorageWriter(mgr, step=3, metadata={"kind": "dcp-async"})
    fut = dcp.async_save(dtensor_state(3), storage_writer=writer, process_group=ckpt_group)
    fut.result(timeout=60)
    ev(
        "dcp-saved",
        step=3,
        commit=None if writer.commit_info is None else writer.commit_info.commit_id,
    )
    ev("expected", step=2, **{k: digest(v) for k, v in full_state(2).items()})
    ev("expected", step=3, **{k: digest(v) for k, v in full_state(3).items()})

    # 4. Rank 1's upload fails: no commit, every rank's handle raises.
    undo = inject_upload_failure(mgr) if RANK == 1 else (lambda: None)
    handle = mgr.save(4)
    with handle as d:
        (d / "shard.bin").write_bytes(b"doomed")
    try:
        handle.result(timeout=60)
        ev("unexpected-commit", step=4)
    except Exception as exc:
        ev("save-failed", step=4, failures=getattr(exc, "failures", None), **error_fields(exc))

    # 5. The same in a DCP save: DCP raises on every rank, nothing commits.
    try:
        dcp.save(dtensor_state(5), storage_writer=CloudStorageWriter(mgr, step=5))
        ev("unexpected-commit", step=5)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        ev("save-failed", step=5, **error_fields(exc))
    undo()

    # 6. Rank 1's block raises: its part is abandoned, every rank fails the save at once.
    handle = mgr.save(6)
    started = time.monotonic()
    try:
        with handle as d:
            (d / "shard.bin").write_bytes(b"half")
            if RANK == 1:
                raise RuntimeError("the model refused to serialize")
    except RuntimeError:
        pass
    try:
        handle.result(timeout=60)
        ev("unexpected-commit", step=6)
    except Exception as exc:
        ev("save-failed", step=6, seconds=time.monotonic() - started, **error_fields(exc))

    # 7. Two ranks writing the same user path are refused before any upload.
    other = manager(url + "-collide", work, "collide", timeout=30, per_rank_dirs=False)
    handle = other.save(1)
    with handle as d:
        (d / "same.bin").write_bytes(b"x")
    try:
        handle.result(timeout=60)
        ev("unexpected-commit", step="collide")
    except Exception as exc:
        ev("save-failed", step="collide", **error_fields(exc))
    other.close()
    mgr.close()
    scenario_chunks(url + "-chunks", work, ev)

    # A new job resumes: rank 0 claims, the node downloads step 1 once.
    downloaded[0] = 0
    mgr = manager(
        url, work, "b", timeout=30, progress=lambda n: downloaded.__setitem__(0, downloaded[0] + n)
    )
    restored = mgr.resume(work / "restore-node", step=1)
    mine = (restored.rank_path / "shard.bin").read_bytes()
    ev(
        "resumed",
        step=restored.step,
        commit_id=restored.commit_id,
        epoch=restored.epoch,
        saved_world_size=restored.saved_world_size,
        downloaded=downloaded[0],
        ok=mine == payload,
        files=sorted(
            p.relative_to(restored.path).as_posix() for p in restored.path.rglob("*") if p.is_file()
        ),
    )

    # Each rank on its "own node": read-only, each downloads only its own directory.
    split = manager(url, work, "split", timeout=30, node_id=f"node-{RANK}")
    res = split.restore(work / f"restore-own-node-{RANK}", step=1)
    ev(
        "restored-split",
        files=sorted(
            p.relative_to(res.path).as_posix() for p in res.path.rglob("*") if p.is_file()
        ),
        ok=(res.rank_path / "shard.bin").read_bytes() == payload,
    )
    split.close()

    # DCP loads resharded onto another placement (Shard(1) instead of Shard(0)).
    for step in (3, 2):
        before = sorted(str(p) for p in work.rglob("*.distcp"))
        reader, target = _dcp_load(mgr, mesh, step, Shard(1))
        ev(
            "dcp-loaded",
            **_loaded(reader, target),
            files_written=sorted(set(map(str, work.rglob("*.distcp"))) - set(before)),
        )
    mgr.close()


def scenario_chunks(url: str, work: Path, ev: Events) -> None:
    """Incremental multi-rank saves (issue 30 item 1), on a run of their own: steps 1 and 2
    where each rank's frozen files are unchanged; then rank 0 deletes a chunk of rank 1's
    that step 2 reused, and step 3 must upload it again. Each step restored and compared
    after its save (steps 1 and 2 name the chunk deleted before step 3)."""
    frozen = {f"frozen-{i}.bin": os.urandom(150_000 + 1000 * RANK + i) for i in range(3)}
    mgr = manager(url, work, "chunks", timeout=30, keep_last=5)
    for step in (1, 2, 3):
        if step == 3:
            dist.barrier()  # step 2 is committed and restored on every rank
            if RANK == 0:
                ev("chunk-deleted", key=_delete_reused_chunk(url))
            dist.barrier()
        files = {**frozen, "changing.bin": f"step {step} of rank {RANK} ".encode() * 50}
        handle = mgr.save(step)
        with handle as d:
            for name, data in files.items():
                (d / name).write_bytes(data)
        info = handle.result(timeout=60)
        ev("chunks-saved", step=step, ckpt=info.ckpt, commit_id=info.commit_id)
        res = mgr.restore(work / f"restore-chunks-{step}", step=step)
        got = {p.name: p.read_bytes() for p in res.rank_path.iterdir()}
        ev("chunks-restored", step=step, exact=got == files)
    mgr.close()


def _delete_reused_chunk(url: str) -> str:
    """Delete the chunk of rank 1's frozen-0.bin that the current checkpoint (step 2)
    names from step 1's attempt; returns its key."""
    from cloudckpt.committer import read_latest
    from cloudckpt.reader import fetch_manifest
    from cloudckpt.stores import open_store

    store = open_store(url, OPTIONS)
    current = read_latest(store).latest.current
    entry = next(
        f for f in fetch_manifest(store, current).files if f.path == "rank-00001/frozen-0.bin"
    )
    (chunk,) = entry.chunks
    assert chunk.owner != current.ckpt  # reused, not uploaded by step 2
    store.delete(chunk.key)
    store.close()
    return chunk.key


def _dcp_load(mgr: Any, mesh: Any, step: int, w_placement: Any) -> tuple[Any, dict]:
    """DCP-load ``step`` through a CloudStorageReader into zeros placed as asked (``w``
    by ``w_placement``, ``b`` replicated); the reader and the loaded state."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    reader = CloudStorageReader(mgr, step=step)
    target = {
        "model": {
            "w": distribute_tensor(torch.zeros(8, 6), mesh, [w_placement]),
            "b": distribute_tensor(torch.zeros(5), mesh, [Replicate()]),
        },
        "extra": {"step": -1, "name": ""},
    }
    dcp.load(target, storage_reader=reader)
    return reader, target


def _loaded(reader: Any, target: dict) -> dict[str, Any]:
    """What a dcp-loaded event reports of every load."""
    return {
        "step": reader.step,
        "w": digest(target["model"]["w"].full_tensor()),
        "b": digest(target["model"]["b"].full_tensor()),
        "extra": target["extra"],
        "streamed": reader.read_stats.bytes_from_store,
    }


def scenario_load3(url: str, work: Path, ev: Events) -> None:
    """Checkpoints saved by 2 ranks, loaded by 3 (resharded)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (WORLD,))
    mgr = manager(url, work, "three", timeout=30)
    for step in (2, 3):
        reader, target = _dcp_load(mgr, mesh, step, Shard(0))
        ev(
            "dcp-loaded",
            **_loaded(reader, target),
            local_rows=target["model"]["w"].to_local().shape[0],
        )
    mgr.close()


def scenario_load1(url: str, work: Path, ev: Events) -> None:
    downloaded = [0]
    mgr = manager(
        url,
        work,
        "one",
        timeout=30,
        progress=lambda n: downloaded.__setitem__(0, downloaded[0] + n),
    )
    reader = CloudStorageReader(mgr, step=3)
    target = {
        "model": {"w": torch.zeros(8, 6), "b": torch.zeros(5)},
        "extra": {"step": -1, "name": ""},
    }
    dcp.load(target, storage_reader=reader)
    ev(
        "dcp-loaded",
        step=reader.step,
        w=digest(target["model"]["w"]),
        b=digest(target["model"]["b"]),
        extra=target["extra"],
    )
    res = mgr.restore(work / "restore-one", step=1)
    ev(
        "restored",
        saved_world_size=res.saved_world_size,
        files=sorted(
            p.relative_to(res.path).as_posix() for p in res.path.rglob("*") if p.is_file()
        ),
        shards=[
            hashlib.sha256((res.path / rank_dir(r) / "shard.bin").read_bytes()).hexdigest()
            for r in range(2)
        ],
    )
    mgr.close()


def scenario_kill(url: str, work: Path, ev: Events, timeout: float) -> None:
    stall = {"armed": False}
    stalled = work / "stalled.json"

    def progress(n: int) -> None:
        if stall["armed"]:  # rank 1, step 2: stop for good after the first uploaded file
            stall["armed"] = False
            stalled.write_text(json.dumps({"pid": os.getpid(), "bytes": n}))
            time.sleep(120)  # the test kills or stops this process meanwhile

    def on_sigterm(signum, frame):  # torchrun's agent stops the survivor: note it, go on
        ev("sigterm")

    signal.signal(signal.SIGTERM, on_sigterm)
    mgr = manager(
        url, work, "k", timeout=timeout, progress=progress, transfer=TransferConfig(concurrency=2)
    )
    with mgr.save(1) as d:
        (d / "shard.bin").write_bytes(b"one" * 100)
    mgr.wait()
    ev("saved", step=1)
    handle = mgr.save(2)
    with handle as d:
        for i in range(8 if RANK == 1 else 1):
            (d / f"part-{i}.bin").write_bytes(os.urandom(64 * 1024))
    stall["armed"] = RANK == 1
    started = time.monotonic()
    try:
        handle.result(timeout=timeout * 6)
        ev("unexpected-commit", step=2)
    except Exception as exc:
        ev(
            "save-failed",
            step=2,
            seconds=time.monotonic() - started,
            at=time.time(),
            **error_fields(exc),
        )
    try:
        mgr.save(3)
        ev("accepted-after-failure")
    except Exception as exc:
        ev("refused", **error_fields(exc))
    mgr.close(timeout=30)  # the caller saw the failure: close() does not raise it again
    ev("exit")
    sys.exit(3)


def exit_with_parent() -> None:
    """End this rank if its launcher dies (a test that failed half-way must not leave a
    rank waiting for minutes)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main() -> int:
    exit_with_parent()
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, choices=["main", "load1", "load3", "kill"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--events", default=None)  # accepted for ChildRun compatibility
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ev = Events(args.work)
    if WORLD > 1:
        dist.init_process_group("gloo")
    ev("start", world=WORLD, pid=os.getpid())
    try:
        if args.scenario == "main":
            scenario_main(args.url, args.work, ev)
        elif args.scenario == "load1":
            scenario_load1(args.url, args.work, ev)
        elif args.scenario == "load3":
            scenario_load3(args.url, args.work, ev)
        else:
            scenario_kill(args.url, args.work, ev, args.timeout)
    except SystemExit:
        raise
    except BaseException as exc:
        ev("crashed", **error_fields(exc))
        raise
    ev("done")
    if WORLD > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
