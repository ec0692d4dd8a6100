"""One rank of the peer-copy jobs (tests/test_distributed_peers.py): 2 simulated hosts x 2
ranks under ``torchrun --nproc_per_node=4`` (gloo, CPU, loopback). Ranks 0-1 are host 0,
ranks 2-3 host 1 (``node_id``); each host stages under ``WORK/host<h>/staging`` (``--root``).
Every rank writes files of its own (nothing replicated), so only a peer can hold them.

Scenarios (each rank appends JSON lines to ``DIR/events-<rank>.jsonl``, as dist_ckpt.py):

- ``save``: steps 1 and 2 saved (peer copies on by default). In step 2's post-commit peer
  transfer rank 0 flips a byte of the first chunk it sends (``_fanout.outgoing``): rank 2
  must not hold it. Each leader then reports what its peer store holds. Step 3: host 1
  dies in the peer transfer: rank 2, about to send its first chunk, SIGKILLs rank 3 and
  exits; ranks 0 and 1 report step 3's save result (committed, with a warning) and exit.
- ``restore`` (host 1 replaced: the harness deleted its directory; every rank's store a
  ``Served`` wrapper counting what the store served it): a resume (step 3: host 0 holds
  no complete copy of host 1's step 3, so host 1 reads its files from the store); a
  restore of step 2 (host 0 holds host 1's files); the same with rank 0 flipping a byte
  of each chunk it sends; step 1 with a forged peer chunk (rank 0 writes wrong bytes
  under the name of one of host 1's step-1 chunks); then step 2 again where rank 0 dies
  sending its first chunk: the others record their error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist
from dist_ckpt import OPTIONS, RANK, WORLD, Events, error_fields, exit_with_parent
from dist_more import apply_mutant
from served import Served

from cloudckpt import attempt_layout, digest
from cloudckpt.committer import read_latest
from cloudckpt.distributed import DistributedCheckpointManager, _fanout
from cloudckpt.manifests import parse_manifest
from cloudckpt.stores import open_store

HOST = RANK // 2
NAMES = ("a.bin", "b.bin")


def content(step: int, rank: int, name: str) -> bytes:
    """Distinct per step, rank and file: ~0.5 MiB and ~1 MiB (one chunk each)."""
    seed = hashlib.sha256(f"{step}/{rank}/{name}".encode()).digest()
    return seed * ((16384 if name == "a.bin" else 32768) + 100 * rank)


def manager(store, root: Path, **kwargs) -> DistributedCheckpointManager:
    return DistributedCheckpointManager(
        store,
        staging_dir=root / f"host{HOST}" / "staging",
        node_id=f"host{HOST}",
        timeout=20,
        **kwargs,
    )


def save(mgr: DistributedCheckpointManager, step: int):
    handle = mgr.save(step)
    with handle as d:
        for name in NAMES:
            (d / name).write_bytes(content(step, RANK, name))
    return handle.result()


def pool_report(mgr: DistributedCheckpointManager) -> dict:
    """What this leader's peer store holds, and whether every chunk is what its name says."""
    store = mgr.peer_store
    if store is None:
        return {}
    names = sorted(store.holds())
    ok = True
    for name in names:
        algorithm, hexdigest = attempt_layout.parse_chunk_name(name) or ("", "")
        ok &= digest.hexleaf(store.path(name).read_bytes(), algorithm) == hexdigest
    indexes = sorted(p.name for p in store.root.glob("*.json"))
    return {"names": names, "verify": ok, "indexes": indexes, "bytes": store.used()}


def scenario_save(url: str, root: Path, ev: Events) -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: ev("sigterm"))  # torchrun's
    mgr = manager(url, root, storage_options=OPTIONS)
    info = save(mgr, 1)
    ev("saved", step=1, warnings=list(info.warnings), pool=pool_report(mgr))
    original = _fanout.outgoing
    flipped: list[int] = []

    def flip_first(data):
        out = bytearray(original(data))
        if not flipped:
            out[0] ^= 0x01
            flipped.append(len(out))
        return bytes(out)

    if RANK == 0:
        _fanout.outgoing = flip_first
    info = save(mgr, 2)
    _fanout.outgoing = original
    ev("saved", step=2, warnings=list(info.warnings), pool=pool_report(mgr), flipped=flipped)

    if RANK == 2:  # host 1 dies: rank 3 (SIGKILL, by its pid), then rank 2 itself

        def die(data):
            lines = ev.path.with_name("events-3.jsonl").read_text().splitlines()
            (pid,) = [json.loads(x)["pid"] for x in lines if '"start"' in x]
            os.kill(pid, signal.SIGKILL)
            os._exit(9)

        _fanout.outgoing = die
    try:
        info = save(mgr, 3)
        ev("saved", step=3, warnings=list(info.warnings), pool=pool_report(mgr))
    except Exception as exc:
        ev("save-failed", step=3, **error_fields(exc))
    ev("exit")
    os._exit(3)  # the group is broken: no teardown


def restore(mgr, served, root: Path, what: str, step: int | None, ev, resume=False) -> None:
    into = root / f"host{HOST}" / what
    res = mgr.resume(into) if resume else mgr.restore(into, step=step)
    exact = all(
        (res.rank_path / n).read_bytes() == content(res.step, RANK, n) for n in NAMES
    ) and res.step == (step or 3)
    ev(
        "restored",
        what=what,
        step=res.step,
        exact=exact,
        served=dict(served.by_key),
        served_checkpoint=served.checkpoint_bytes(),
        own=sum(len(content(res.step, RANK, n)) for n in NAMES),
        bytes_from_peers=res.bytes_from_peers,
        bytes_downloaded=res.bytes_downloaded,
    )
    served.reset()


def forge(mgr, store) -> str:
    """(Rank 0.) Wrong bytes under the name of one of rank 2's step-1 chunks."""
    record = next(r for r in read_latest(store).latest.retained() if r.step == 1)
    data, _ = store.get(record.ckpt + attempt_layout.MANIFEST_NAME)
    manifest = parse_manifest(data, record)
    entry = next(e for e in manifest.files if e.path.startswith("rank-00002/"))
    ref = (entry.chunks or ())[0]
    mgr.peer_store.put(ref, b"\0" * ref.size)
    return ref.name


def scenario_restore(url: str, root: Path, ev: Events) -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: ev("sigterm"))
    served = Served(open_store(url, OPTIONS))
    mgr = manager(served, root)
    ev("pool", pool=pool_report(mgr))
    restore(mgr, served, root, "resume", None, ev, resume=True)
    restore(mgr, served, root, "step-2", 2, ev)
    original = _fanout.outgoing
    sent: list[int] = []

    def flipping(data):
        out = bytearray(original(data))
        out[len(out) // 2] ^= 0x01
        sent.append(len(out))
        return bytes(out)

    _fanout.outgoing = flipping if RANK == 0 else original
    restore(mgr, served, root, "corrupt", 2, ev)
    ev("sent", what="corrupt", sent=sum(sent))
    sent.clear()
    _fanout.outgoing = original
    forged = forge(mgr, served.inner) if RANK == 0 else None

    def counting(data):
        out = original(data)
        sent.append(len(out))
        return out

    _fanout.outgoing = counting
    restore(mgr, served, root, "forged", 1, ev)
    ev("sent", what="forged", sent=sum(sent), forged=forged)
    _fanout.outgoing = original

    if RANK == 0:

        def die(data):
            os._exit(9)

        _fanout.outgoing = die
    try:
        mgr.restore(root / f"host{HOST}" / "dead", step=2)
        ev("unexpected-restore")
    except Exception as exc:
        ev("restore-failed", **error_fields(exc))
    ev("exit")
    os._exit(3)


def main() -> int:
    exit_with_parent()
    apply_mutant()
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, choices=["save", "restore"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--root", required=True, type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ev = Events(args.work)
    dist.init_process_group("gloo")
    ev("start", world=WORLD, pid=os.getpid())
    try:
        if args.scenario == "save":
            scenario_save(args.url, args.root, ev)
        else:
            scenario_restore(args.url, args.root, ev)
    except SystemExit:
        raise
    except BaseException as exc:
        ev("crashed", **error_fields(exc))
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
