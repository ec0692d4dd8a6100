"""The ``scale`` group (issue 30 item 8): 2 simulated hosts x 2 ranks, data-parallel degree 2.

Each host is one torchrun agent (``--nnodes=2 --nproc_per_node=2``, c10d rendezvous on
127.0.0.1, gloo) with a directory of its own (staging, restores) and a door of its own into
the benchmark S3 endpoint (``benchmarks/s3_endpoint.py``: one port per host, all serving
the same objects, each accounted apart). The state (``--scale-mib`` of fp32) is sharded over
a host's 2 ranks and replicated over the 2 hosts: rank ``r`` holds shard ``r % 2`` of
replica ``r // 2``, as DCP's 2-D device mesh ``(dp=2, shard=2)`` lays it out.

Job 1 (``--phase save``) saves, rotating the order every round: cloudckpt's
``DistributedCheckpointManager`` (every rank writes its shard as one safetensors file)
beside DCP ``save`` with s3torchconnector's ``S3StorageWriter`` (the same shards as
DTensors, ``[Replicate(), Shard(0)]``), each round into a fresh prefix. Then, unmeasured
for time: a DP=1 save of the same state (only replica 0's ranks write), and two saves of a
LoRA-like state (a frozen base, small adapters that change). Every rank then waits; the
harness kills host 1 (its agent and ranks, SIGKILL) and deletes its directory, then stops
host 0 the same way (a job restart; host 0's directory stays).

Job 2 (``--phase restore``), with host 1 a replacement with an empty directory: every rank
resumes the first round's cloudckpt checkpoint and compares its tensors exactly, then the
timed rounds restore both checkpoints (cloudckpt ``restore`` + safetensors load vs DCP
``load`` + ``S3StorageReader``), every one checked exactly (after its timing). Each cloudckpt
run stages under a directory of its own on each host, so host 0 restores from its kept copy
and sends host 1 the chunks it holds (peer copies; the replicas' chunks are the same, so
the post-commit peer transfer had nothing to send): the cloudckpt restores read almost
nothing from the store.

Every byte figure is the endpoint's own request accounting (bytes of PUT bodies it
received, object bytes its GETs sent, per key prefix and per door), never a client's
report. A create-only PUT that loses to a replica's identical chunk (412) counts: its
body crossed the network. Run as a worker: ``python -m torch.distributed.run ... -m benchmarks.scale``
(``scale_group`` does this).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
TENSORS = 8
COLS = 1024
HOSTS, PER_HOST = 2, 2
SAVERS = ("cloudckpt DistributedCheckpointManager", "DCP save S3StorageWriter")
LOADERS = ("cloudckpt DistributedCheckpointManager", "DCP load S3StorageReader")


# ----------------------------------------------------------------------------- the state


def _rows(mib: int) -> int:
    return max(2 * PER_HOST, mib * MiB // 4 // COLS // TENSORS // (2 * PER_HOST) * 2 * PER_HOST)


def full_state(mib: int) -> dict[str, Any]:
    """The replicated, sharded state: ``TENSORS`` fp32 tensors of ``mib`` MiB in all."""
    import torch

    g = torch.Generator().manual_seed(7)
    return {f"layer{i}.weight": torch.randn(_rows(mib), COLS, generator=g) for i in range(TENSORS)}


def lora_state(mib: int, version: int) -> dict[str, Any]:
    """A frozen base (``full_state``) plus adapters of about 1.5% of its bytes that change
    with ``version`` (what a LoRA fine-tune's next checkpoint changes)."""
    import torch

    state = {f"base.{k}": v for k, v in full_state(mib).items()}
    rows = max(PER_HOST, _rows(mib) // 64 // PER_HOST * PER_HOST)
    g = torch.Generator().manual_seed(100 + version)
    for i in range(TENSORS):
        state[f"adapter.layer{i}.lora"] = torch.randn(rows, COLS, generator=g)
    return state


def state_bytes(mib: int) -> int:
    return _rows(mib) * COLS * 4 * TENSORS


def local_shard(state: dict[str, Any], shard: int) -> dict[str, Any]:
    """Rank ``shard``'s rows of every tensor (what ``Shard(0)`` over 2 ranks gives it)."""
    return {k: v.chunk(PER_HOST)[shard].contiguous() for k, v in state.items()}


# ----------------------------------------------------------------------------- the job


class _Rank:
    """One rank's view of the job: where it is, its host's door, its manager options."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import torch.distributed as dist

        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.host = int(os.environ["SCALE_HOST"])  # the simulated machine (its directory)
        self.replica, self.shard = divmod(self.rank, PER_HOST)
        self.dir = Path(cfg["work"]) / f"host{self.host}"
        self.endpoint = cfg["doors"][self.host]

    def manager(self, sub: str) -> Any:
        from cloudckpt.distributed import DistributedCheckpointManager

        return DistributedCheckpointManager(
            self.cfg["url"] + sub,
            storage_options={**self.cfg["options"], "endpoint_url": self.endpoint},
            # A staging directory per run: each keeps its own newest copy (keep_local=1).
            # One shared by every run kept only the last save's (retention counts copies,
            # whatever run they belong to), so host 0 read dp2-r0 from the store.
            staging_dir=self.dir / "staging" / sub.strip("/"),
            node_id=f"host{self.host}",
            auto_gc=False,
            timeout=120,
        )

    def s3tc(self, sub: str, kind: str) -> Any:
        from benchmarks.dcp_restore import _s3tc

        cfg = {"dcp_path": self.cfg["dcp_url"] + sub, "endpoint": self.endpoint}
        return _s3tc(cfg, kind)

    def stats(self, prefix: str) -> list[dict[str, Any]]:
        """The endpoint's counts for keys under ``prefix`` (rank 0 asks, every door)."""
        from benchmarks.s3_endpoint import endpoint_stats

        return endpoint_stats(self.cfg["doors"][0], self.cfg["key_root"] + prefix)


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _save(mgr: Any, step: int, tensors: dict[str, Any] | None) -> None:
    """A cloudckpt save of ``tensors`` (None: this rank writes nothing), until committed."""
    from safetensors.torch import save_file

    handle = mgr.save(step)
    with handle as d:
        if tensors is not None:
            save_file(tensors, str(d / "shard.safetensors"))
    handle.result()


def _save_ck(me: _Rank, sub: str, tensors: dict[str, Any] | None, timed: bool = False) -> float:
    """One save into run ``sub`` by a new manager; with ``timed``, the seconds from
    ``save()`` to the commit on every rank (the manager is built beforehand: a job builds
    it once)."""
    mgr = me.manager(sub)
    try:
        if timed:
            return _timed(lambda: _save(mgr, 1, tensors))
        _save(mgr, 1, tensors)
        return 0.0
    finally:
        mgr.close()


def _dtensors(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Replicate(), Shard(0)]) for k, v in state.items()}


def save_phase(me: _Rank, out: dict[str, Any]) -> None:
    """Job 1 (see the module docstring); rank 0 records times and the store's counts."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mib, rounds = me.cfg["mib"], me.cfg["rounds"]
    full = full_state(mib)
    mine = local_shard(full, me.shard)
    mesh = init_device_mesh("cpu", (HOSTS, PER_HOST), mesh_dim_names=("dp", "shard"))
    dstate = _dtensors(full, mesh)
    samples: dict[str, list[float]] = {n: [] for n in SAVERS}
    runs: dict[str, Callable[[int], float]] = {
        SAVERS[0]: lambda r: _save_ck(me, f"dp2-r{r}/", mine, timed=True),
        SAVERS[1]: lambda r: _timed(
            lambda: dcp.save(dstate, storage_writer=me.s3tc(f"r{r}/", "writer"))
        ),
    }
    for r in range(rounds):
        k = r % len(SAVERS)
        for name in SAVERS[k:] + SAVERS[:k]:
            samples[name].append(runs[name](r))
    _save_ck(me, "dp1/", mine if me.replica == 0 else None)
    dist.barrier()
    lora: list[list[dict[str, Any]]] = []
    mgr = me.manager("lora/")  # one manager, two saves: as a training job makes them
    try:
        for version in (1, 2):  # the base frozen, the adapters trained
            _save(mgr, version, local_shard(lora_state(mib, version), me.shard))
            dist.barrier()
            if me.rank == 0:
                lora.append(me.stats("lora/"))
    finally:
        mgr.close()
    if me.rank == 0:
        out.update(
            samples=samples,
            lora=lora,
            lora_bytes=sum(v.numel() * 4 for v in lora_state(mib, 1).values()),
            stats={p: me.stats(p) for p in ("dp1/", "dp2-r0/")},
            dcp_stats=me.stats("dcp/r0/"),
        )


def _check(got: dict[str, Any], want: dict[str, Any], what: str, rank: int) -> None:
    if sorted(got) != sorted(want) or any(not got[k].equal(want[k]) for k in want):
        raise AssertionError(f"rank {rank}: {what} restored tensors that differ")


def _load_ck(me: _Rank, mgr: Any, into: Path, first: bool) -> dict[str, Any]:
    from safetensors.torch import load_file

    result = mgr.resume(into) if first else mgr.restore(into)
    assert result is not None and result.rank_path is not None
    return load_file(str(result.rank_path / "shard.safetensors"))


def restore_phase(me: _Rank, out: dict[str, Any]) -> None:
    """Job 2 (see the module docstring): the first resume's counts, then timed rounds."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mib, rounds = me.cfg["mib"], me.cfg["rounds"]
    full = full_state(mib)
    mine = local_shard(full, me.shard)
    mesh = init_device_mesh("cpu", (HOSTS, PER_HOST), mesh_dim_names=("dp", "shard"))
    mgr = me.manager("dp2-r0/")
    try:
        before = me.stats("dp2-r0/") if me.rank == 0 else None
        dist.barrier()
        got = _load_ck(me, mgr, me.dir / "resume", first=True)
        dist.barrier()
        after = me.stats("dp2-r0/") if me.rank == 0 else None
        _check(got, mine, "cloudckpt resume", me.rank)
        restored = (me.dir / "resume" / f"rank-{me.rank:05d}" / "shard.safetensors").stat()
        samples: dict[str, list[float]] = {n: [] for n in LOADERS}
        dcp_before = me.stats("dcp/r0/") if me.rank == 0 else None

        def dcp_load(r: int) -> dict[str, Any]:
            target = _dtensors({k: torch.zeros_like(v) for k, v in full.items()}, mesh)
            dcp.load(target, storage_reader=me.s3tc("r0/", "reader"))
            return {k: v.to_local() for k, v in target.items()}

        runs: dict[str, Callable[[int], dict[str, Any]]] = {
            LOADERS[0]: lambda r: _load_ck(me, mgr, me.dir / f"restore-{r}", first=False),
            LOADERS[1]: dcp_load,
        }
        for r in range(rounds):
            k = r % len(LOADERS)
            for name in LOADERS[k:] + LOADERS[:k]:
                box: dict[str, Any] = {}
                samples[name].append(
                    _timed(lambda name=name, r=r, box=box: box.update(t=runs[name](r)))
                )
                _check(box["t"], mine, name, me.rank)  # every restore, untimed
        dist.barrier()
        dcp_after = me.stats("dcp/r0/") if me.rank == 0 else None
    finally:
        mgr.close()
    mine_report = {"host": me.host, "restored": restored.st_size}
    everyone: list[Any] = [None] * me.world
    dist.all_gather_object(everyone, mine_report)
    if me.rank == 0:
        out.update(samples=samples, before=before, after=after, ranks=everyone, exact=True)
        out.update(dcp_loads=_minus(dcp_after or [], dcp_before or []))


def worker(cfg: dict[str, Any], phase: str) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", cfg["key"])
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", cfg["secret"])
    dist.init_process_group("gloo")
    me = _Rank(cfg)
    (me.dir / "pids").mkdir(parents=True, exist_ok=True)
    (me.dir / "pids" / str(os.getpid())).touch()
    out: dict[str, Any] = {}
    (save_phase if phase == "save" else restore_phase)(me, out)
    if me.rank == 0:
        Path(cfg["out"]).write_text(json.dumps(out))
    if phase == "save":  # wait to be killed: a host lost, then the job restarted
        (Path(cfg["work"]) / f"saved-{me.rank}").touch()
        time.sleep(600)
        return
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the hosts


class Hosts:
    """The two torchrun agents of one job, each a simulated host."""

    def __init__(self, cfg: dict[str, Any], phase: str) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        work = Path(cfg["work"])
        work.mkdir(parents=True, exist_ok=True)
        cfg_path = work / f"cfg-{phase}.json"
        cfg_path.write_text(json.dumps(cfg))
        self.work, self.procs = work, []
        for host in range(HOSTS):
            (work / f"host{host}").mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable, "-m", "torch.distributed.run", f"--nnodes={HOSTS}",
                f"--nproc_per_node={PER_HOST}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=scale-{phase}-{port}",
                f"--rdzv_conf=is_host={int(host == 0)}", "--max-restarts=0",
                "-m", "benchmarks.scale", "--phase", phase, "--config", str(cfg_path),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            env["SCALE_HOST"] = str(host)
            log = open(work / f"host{host}-{phase}.log", "wb")  # noqa: SIM115
            self.procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            log.close()

    def wait(self, timeout: float, done: Callable[[], bool] | None = None) -> None:
        """Until both agents exited 0 (or ``done()``). Raises RuntimeError with the logs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in self.procs]
            if done is not None and done():
                return
            if any(c not in (None, 0) for c in codes) or (done is None and None not in codes):
                if all(c == 0 for c in codes):
                    return
                break
            time.sleep(0.2)
        self.kill_all()
        logs = "\n".join(
            f"--- host {h}:\n" + (self.work / f"host{h}-{p}.log").read_text()[-3000:]
            for h in range(HOSTS)
            for p in ("save", "restore")
            if (self.work / f"host{h}-{p}.log").exists()
        )
        raise RuntimeError(f"the scale job failed or timed out:\n{logs}")

    def kill(self, host: int) -> int:
        """SIGKILL host ``host``: its agent and its ranks; how many of its ranks were
        running and are now gone (waited for: a dead rank is gone or a zombie)."""
        pids = [int(p.name) for p in (self.work / f"host{host}" / "pids").glob("*")]
        for pid in [self.procs[host].pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.procs[host].wait(30)
        for p in (self.work / f"host{host}" / "pids").glob("*"):
            p.unlink()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return sum(not _alive(pid) for pid in pids)

    def kill_all(self) -> None:
        for host in range(HOSTS):
            self.kill(host)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def run_jobs(
    cfg: dict[str, Any], timeout: float
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Job 1, the loss of host 1 (ranks and directory), job 2: the two jobs' reports and
    what the loss did (``replacement``: ranks killed per host, whether host 1's directory
    was gone and host 0's kept when job 2 started)."""
    import shutil

    work = Path(cfg["work"])
    save_out, restore_out = work / "save.json", work / "restore.json"
    job = Hosts({**cfg, "out": str(save_out)}, "save")
    world = HOSTS * PER_HOST
    job.wait(timeout, lambda: all((work / f"saved-{r}").exists() for r in range(world)))
    killed = [job.kill(1)]
    shutil.rmtree(work / "host1")  # the lost host's disk goes with it
    killed.insert(0, job.kill(0))  # the job restarts; host 0 keeps its directory
    replacement = {
        "ranks_killed_by_host": killed,
        "host1_dir_gone": not (work / "host1").exists(),
        "host0_staging_kept": (work / "host0" / "staging").is_dir(),
    }
    job = Hosts({**cfg, "out": str(restore_out)}, "restore")
    job.wait(timeout)
    return json.loads(save_out.read_text()), json.loads(restore_out.read_text()), replacement


# ----------------------------------------------------------------------------- the group


def written(rows: list[dict[str, Any]]) -> int:
    """Object bytes the store received (PUT bodies: whole objects and parts)."""
    return sum(r["received"] for r in rows if r["kind"] == "PUT")


def sent(rows: list[dict[str, Any]], door: int | None = None) -> int:
    """Object bytes the store's GETs sent (through ``door``, or every door)."""
    return sum(r["sent"] for r in rows if r["kind"] == "GET" and door in (None, r["door"]))


def requests(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Requests by kind (PUT, GET, HEAD, LIST, DELETE, POST)."""
    out: dict[str, int] = {}
    for r in rows:
        out[r["kind"]] = out.get(r["kind"], 0) + r["requests"]
    return {k: n for k, n in sorted(out.items()) if n}


def _minus(after: list[dict[str, Any]], before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The counts ``after`` less ``before`` (rows matched by door, kind and key)."""
    base = {(r["door"], r["kind"], r["key"]): r for r in before}
    out = []
    for r in after:
        b = base.get((r["door"], r["kind"], r["key"]), {})
        out.append({**r, **{f: r[f] - b.get(f, 0) for f in ("requests", "received", "sent")}})
    return out


def figures(saved: dict[str, Any], restored: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """The group's ``figures`` (issue 30 item 8) from the two jobs' reports."""
    first, second = saved["lora"]
    resume = _minus(restored["after"], restored["before"])
    host1 = sum(r["restored"] for r in restored["ranks"] if r["host"] == 1)
    return {
        "dp2_save_bytes_ratio": written(saved["stats"]["dp2-r0/"])
        / written(saved["stats"]["dp1/"]),
        "second_save_bytes_ratio": (written(second) - written(first)) / written(first),
        "dp2_restore_bytes_ratio": sent(resume) / nbytes,
        "replaced_host_store_bytes_ratio": sent(resume, door=1) / host1,
        "exact": bool(restored["exact"]),
    }


def restart(restored: dict[str, Any]) -> dict[str, Any]:
    """Where each host's resume read from: GET bytes through its door / its ranks'
    restored bytes (host 0: a restart on the same host, its kept copy; host 1: the
    replacement, served by host 0 over gloo)."""
    resume = _minus(restored["after"], restored["before"])
    out = {}
    for host, name in ((0, "same_host"), (1, "replaced_host")):
        mine = sum(r["restored"] for r in restored["ranks"] if r["host"] == host)
        out[f"{name}_store_bytes_ratio"] = sent(resume, door=host) / mine
    return out


def scale_group(bench: Any, s3: Any, signing: str) -> None:
    """Run the two jobs (see the module docstring) and record the ``scale`` group."""
    from benchmarks.harness import Comparison, Contender, Group

    if s3.kind != "bench":
        raise SystemExit("the scale group counts bytes at the benchmark endpoint: no --s3-url")
    mib = bench.args.scale_mib
    work = bench.work / "scale"
    work.mkdir()
    cfg: dict[str, Any] = {
        "url": s3.url("scale/"),
        "dcp_url": s3.url("scale/dcp/"),
        "key_root": f"{s3.bucket}/{s3.root}scale/",
        "options": {k: v for k, v in s3.storage_options(signing).items() if k != "endpoint_url"},
        "doors": [s3.server.door_url(h) for h in range(HOSTS)],
        "key": s3.creds.get("key", ""),
        "secret": s3.creds.get("secret", ""),
        "mib": mib,
        "work": str(work),
        "rounds": bench.args.warmup + bench.args.pairs,
    }
    saved, restored, replacement = run_jobs(cfg, 600 + 60 * mib / 64 * cfg["rounds"])
    nbytes = state_bytes(mib)
    resume = _minus(restored["after"], restored["before"])
    dp2, dcp_rows = saved["stats"]["dp2-r0/"], saved["dcp_stats"]

    def replay(i: int) -> Callable[[int], dict[str, float]]:
        return lambda r: {"s": saved["samples"][SAVERS[i]][r],
                          "restore": restored["samples"][LOADERS[i]][r]}  # fmt: skip

    names = ("cloudckpt", "DCP + s3torchconnector")
    group = Group(
        name="scale",
        title=f"{HOSTS} hosts x {PER_HOST} ranks, data-parallel degree 2, "
        f"{nbytes / MiB:.0f} MiB state (gloo; S3 endpoint: {s3.kind}, {signing} payload)",
        nbytes=nbytes,
        contenders=[
            Contender(
                names[0],
                replay(0),
                cloudckpt=True,
                note="DistributedCheckpointManager: every rank its shard as one "
                "safetensors file; restore: resume/restore + safetensors load",
            ),
            Contender(
                names[1],
                replay(1),
                note="DCP save/load with S3StorageWriter/Reader, DTensors "
                "[Replicate(), Shard(0)] on a (2, 2) mesh",
            ),
        ],
        comparisons=[
            Comparison("s", names[1], None, cloudckpt=names[0], label="save"),
            Comparison("restore", names[1], None, cloudckpt=names[0], label="restore"),
        ],
        servers={"server": s3.pid},
        info={
            "figures": figures(saved, restored, nbytes),
            "restart": restart(restored),
            "bytes": {
                "state": nbytes,
                "lora_state": saved["lora_bytes"],
                "cloudckpt_dp1_save_written": written(saved["stats"]["dp1/"]),
                "cloudckpt_dp2_save_written": written(dp2),
                "dcp_dp2_save_written": written(dcp_rows),
                "lora_first_save_written": written(saved["lora"][0]),
                "lora_second_save_written": written(saved["lora"][1]) - written(saved["lora"][0]),
                "cloudckpt_resume_read": sent(resume),
                "cloudckpt_resume_read_by_host": [sent(resume, h) for h in range(HOSTS)],
                "dcp_load_read": sent(restored["dcp_loads"]) // cfg["rounds"],
            },
            "requests": {
                "cloudckpt_dp2_save": requests(dp2),
                "dcp_dp2_save": requests(dcp_rows),
                "cloudckpt_resume": requests(resume),
                "dcp_loads_all_rounds": requests(restored["dcp_loads"]),
            },
            "figures_note": "dp2_save_bytes_ratio: PUT bytes of the DP=2 save / of a DP=1 "
            "save of the same state (replica 1's ranks write nothing); second_save: PUT bytes "
            "of the LoRA-like state's second save / its first (one manager); dp2_restore: GET "
            "bytes of the resume, all hosts / the state's bytes (each shard once); "
            "replaced_host: GET bytes through host 1's door / the bytes its ranks restored "
            "(host 0 sends it the chunks its kept copy holds: peer copies, issue 30 item 4); "
            "exact: every restore (resume, every timed round, both contenders) compared",
            "hosts": HOSTS,
            "ranks_per_host": PER_HOST,
            "replaced_host": "host 1: agent and ranks SIGKILLed, directory deleted, "
            "restarted empty; host 0 restarted with its directory",
            "replacement": replacement,
            "note": "bytes are the endpoint's request accounting (PUT bodies received, GET "
            "object bytes sent, per door = per host); times measured inside the torchrun "
            "jobs (barrier to barrier) and replayed here; cpu columns do not apply",
        },
    )
    bench.run(group)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["save", "restore"], required=True)
    p.add_argument("--config", required=True)
    args = p.parse_args()
    worker(json.loads(Path(args.config).read_text()), args.phase)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
