"""One rank of the local-copy and restore-timeout jobs (tests/test_distributed_local.py,
tests/test_distributed.py), under ``torchrun --nproc_per_node=2`` (gloo, CPU, one node).

Scenarios (each rank appends JSON lines to ``DIR/events-<rank>.jsonl``, as dist_ckpt.py):

- ``local-save``: steps 1 and 2 saved with ``--staging`` as the staging directory (each
  rank keeps its files of the newest checkpoint: ``keep_local`` by default).
- ``local-resume`` (a restart on the same staging directory; every rank's store is a
  ``Served`` wrapper counting what the store served it): ``resume`` of step 2; a restore
  after rank 1's kept shard.bin was flipped and rank 0's kept extra.bin deleted; a restore
  of step 1 (the kept copies are step 2's). Each compares every file of its own rank with
  what was saved and reports what the store served it.
- ``fanout`` (2 simulated nodes of one rank each, ``node_id``; data-parallel replicas
  ``[[0, 1]]`` saving the same files, no kept copies; every rank's store a ``Served``):
  step 1 saved; a restore with fan-out (each rank reports what the store served it and
  the chunks it sent); a restore where rank 1, sending, flips a byte of every chunk it
  sends (``_fanout.outgoing``); a restore where rank 1 cannot read the chunks it is to
  send (``_fanout.fetch_chunk`` raises ``StoreError``); a restore with ``fanout=False``.
  Each compares its files.
- ``fanout-dead``: as ``fanout``, but rank 1 dies (``--how die``) or stalls (``stall``)
  where it would send its first shared chunk; rank 0 records the error of its restore.
- ``restore-stall``: step 1 saved; in a restore, rank 1 stops before the barrier that
  follows the download (the "placing" phase) and writes ``DIR/stalled.json``: it sleeps
  (``--how stall``) or exits (``--how die``); rank 0 records the error its restore raises,
  and when.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from dist_ckpt import OPTIONS, RANK, WORLD, Events, error_fields, exit_with_parent
from served import Served

from cloudckpt.distributed import DistributedCheckpointManager, rank_dir
from cloudckpt.errors import StoreError
from cloudckpt.stores import open_store

NAMES = ("shard.bin", "extra.bin")


def content(step: int, rank: int, name: str) -> bytes:
    seed = hashlib.sha256(f"{step}/{rank}/{name}".encode()).digest()
    return seed * (2000 * (rank + 1) if name == "shard.bin" else 300)


def save(mgr: DistributedCheckpointManager, step: int) -> None:
    with mgr.save(step) as d:
        for name in NAMES:
            (d / name).write_bytes(content(step, RANK, name))
    mgr.wait()


def report(ev: Events, what: str, res, served: Served, step: int) -> None:
    exact = all((res.rank_path / name).read_bytes() == content(step, RANK, name) for name in NAMES)
    ev(
        "restored",
        what=what,
        step=res.step,
        exact=exact and res.step == step,
        served=dict(served.by_key),
        served_checkpoint=served.checkpoint_bytes(),
    )
    served.reset()


def kept_file(staging: Path, step: int, name: str) -> Path:
    (copy,) = (staging / rank_dir(RANK) / "committed").glob(f"{step:012d}-*")
    return copy / "files" / name


def scenario_local_save(url: str, staging: Path, ev: Events) -> None:
    mgr = DistributedCheckpointManager(
        url, storage_options=OPTIONS, staging_dir=staging, timeout=60
    )
    for step in (1, 2):
        save(mgr, step)
        ev("saved", step=step)
    mgr.close()


def scenario_local_resume(url: str, work: Path, staging: Path, ev: Events) -> None:
    served = Served(open_store(url, OPTIONS))
    mgr = DistributedCheckpointManager(served, staging_dir=staging, timeout=60)
    ev("sizes", sizes={name: len(content(2, RANK, name)) for name in NAMES})
    report(ev, "resume", mgr.resume(work / "r1"), served, 2)

    if RANK == 1:  # damage the kept copies, before this rank enters the restore
        target = kept_file(staging, 2, "shard.bin")
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x40
        target.write_bytes(bytes(data))
    else:
        kept_file(staging, 2, "extra.bin").unlink()
    report(ev, "damaged", mgr.restore(work / "r2"), served, 2)
    report(ev, "step-1", mgr.restore(work / "r3", step=1), served, 1)
    mgr.close()


DP_NAMES = ("w1.bin", "w2.bin", "w3.bin", "big.bin")


def dp_content(name: str) -> bytes:
    """The same on every replica: 1 MiB files and a 9 MiB one (two chunks)."""
    seed = hashlib.sha256(name.encode()).digest()
    return seed * ((9 << 20 if name == "big.bin" else 1 << 20) // 32)


def scenario_fanout(url: str, work: Path, ev: Events) -> None:
    from cloudckpt.distributed import _fanout

    served = Served(open_store(url, OPTIONS))
    mgr = DistributedCheckpointManager(
        served, node_id=f"node{RANK}", replica_groups=[[0, 1]], keep_local=0, timeout=60
    )
    with mgr.save(1) as d:
        for name in DP_NAMES:
            (d / name).write_bytes(dp_content(name))
    mgr.wait()
    original = _fanout.outgoing
    sent: list[int] = []

    def counting(data):
        out = original(data)
        sent.append(len(out))
        return out

    def flipping(data):
        out = bytearray(original(data))
        out[len(out) // 2] ^= 0x01
        sent.append(len(out))
        return bytes(out)

    reading = _fanout.fetch_chunk

    def failing(engine, store, ref, into=None):
        sent.append(ref.size)  # what it would have sent
        raise StoreError(f"simulated: cannot read {ref.key}")

    for what, patch, fanout in (
        ("fanout", counting, True),
        ("corrupt", flipping if RANK == 1 else counting, True),
        ("unreadable", counting, True),
        ("off", counting, False),
    ):
        served.reset()
        sent.clear()
        _fanout.outgoing = patch
        _fanout.fetch_chunk = failing if what == "unreadable" and RANK == 1 else reading
        mgr.fanout = fanout
        res = mgr.restore(work / f"node{RANK}" / what)  # each simulated node its own
        exact = all((res.rank_path / name).read_bytes() == dp_content(name) for name in DP_NAMES)
        chunks = {k: n for k, n in served.by_key.items() if "/chunks/" in k}
        ev(
            "restored",
            what=what,
            exact=exact,
            chunks=chunks,
            sent=sum(sent),
            bytes_downloaded=res.bytes_downloaded,
            bytes_from_peers=res.bytes_from_peers,
        )
    _fanout.outgoing, _fanout.fetch_chunk = original, reading
    mgr.close()


def scenario_fanout_dead(url: str, work: Path, ev: Events, timeout: float, how: str) -> None:
    """Rank 1, about to send its first shared chunk, dies or stalls; rank 0 (its
    receiver) records the error its restore raises."""
    from cloudckpt.distributed import _fanout

    signal.signal(signal.SIGTERM, lambda signum, frame: ev("sigterm"))  # torchrun's
    mgr = DistributedCheckpointManager(
        url,
        storage_options=OPTIONS,
        node_id=f"node{RANK}",
        replica_groups=[[0, 1]],
        keep_local=0,
        timeout=timeout,
    )
    with mgr.save(1) as d:
        for name in DP_NAMES:
            (d / name).write_bytes(dp_content(name))
    mgr.wait()
    ev("saved", step=1)
    if RANK == 1:

        def stop(data):
            Path(work / "stalled.json").write_text(json.dumps({"pid": os.getpid()}))
            if how == "die":
                os._exit(9)
            time.sleep(600)

        _fanout.outgoing = stop
    try:
        mgr.restore(work / f"node{RANK}" / "r")
        ev("unexpected-restore")
    except Exception as exc:
        ev("restore-failed", **error_fields(exc))


def scenario_restore_stall(url: str, work: Path, ev: Events, timeout: float, how: str) -> None:
    signal.signal(
        signal.SIGTERM, lambda signum, frame: ev("sigterm")
    )  # torchrun's, on rank 1's exit
    mgr = DistributedCheckpointManager(
        url, storage_options=OPTIONS, staging_dir=work / "staging", timeout=timeout
    )
    save(mgr, 1)
    ev("saved", step=1)
    if RANK == 1:
        comm = mgr._comm
        original = comm.run_phase

        def stalling(work_fn, what, cancel=None):
            if "placing" in what:  # the barrier after the download: never reached
                Path(work / "stalled.json").write_text(json.dumps({"pid": os.getpid()}))
                if how == "die":
                    os._exit(9)
                time.sleep(600)
            return original(work_fn, what, cancel)

        comm.run_phase = stalling
    started = time.monotonic()
    try:
        mgr.restore(work / "r")
        ev("unexpected-restore")
    except Exception as exc:
        ev(
            "restore-failed",
            seconds=time.monotonic() - started,
            at=time.time(),
            **error_fields(exc),
        )
    mgr.close(timeout=30)
    ev("exit")
    sys.exit(3)


def apply_mutant() -> None:
    """``CLOUDCKPT_MUTANT=<name>`` (tests/test_mutations.py runs guards with it): break the
    rule in this rank too, as tests/conftest.py does in the pytest process."""
    name = os.environ.get("CLOUDCKPT_MUTANT")
    if name:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import mutants

        applied = mutants.applied(name)
        applied.__enter__()
        _KEEP.append(applied)  # alive: collecting it would undo the patch


_KEEP: list = []


def main() -> int:
    exit_with_parent()
    apply_mutant()
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--scenario",
        required=True,
        choices=["local-save", "local-resume", "restore-stall", "fanout", "fanout-dead"],
    )
    parser.add_argument("--url", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--staging", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--how", choices=["stall", "die"], default="stall")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ev = Events(args.work)
    dist.init_process_group("gloo")
    ev("start", world=WORLD, pid=os.getpid())
    try:
        if args.scenario == "local-save":
            scenario_local_save(args.url, args.staging, ev)
        elif args.scenario == "local-resume":
            scenario_local_resume(args.url, args.work, args.staging, ev)
        elif args.scenario == "fanout":
            scenario_fanout(args.url, args.work, ev)
        elif args.scenario == "fanout-dead":
            scenario_fanout_dead(args.url, args.work, ev, args.timeout, args.how)
        else:
            scenario_restore_stall(args.url, args.work, ev, args.timeout, args.how)
    except SystemExit:
        raise
    except BaseException as exc:
        ev("crashed", **error_fields(exc))
        raise
    ev("done")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
