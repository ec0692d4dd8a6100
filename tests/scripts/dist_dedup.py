"""One rank of the 2-rank dedup and replica-agreement job (tests/test_distributed_dedup.py).

Run under ``torchrun --nproc_per_node=2`` (gloo, CPU, 127.0.0.1), scenario ``dedup``:

1. step 1: both ranks save the same 3 MiB ``shard.bin`` (data-parallel replicas, no
   ``replica_groups``: dedup is by digest) and a file of their own; each rank's store
   client is wrapped to count the chunk puts it sends (event ``saved``); then a restore,
   compared bit-exact (``restored``);
2. a second manager with ``replica_groups=[[0, 1]]`` on another run: step 1 agrees, step 2
   has one byte of rank 1's shard flipped and must raise ReplicaDivergedError on both
   ranks (``diverged``); LATEST still names step 1 (``after``);
3. a third run where rank 0, the owner of the shared shard, loses its put (its client
   answers without storing): the commit's listing must refuse it on both ranks
   (``lost``), and no checkpoint is current (``lost-after``).

Storage options come as JSON in CLOUDCKPT_TEST_STORAGE_OPTIONS.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
from pathlib import Path

import torch.distributed as dist
from dist_ckpt import OPTIONS, RANK, Events, error_fields, exit_with_parent

from cloudckpt import attempt_layout, digest
from cloudckpt.committer import read_latest
from cloudckpt.distributed import DistributedCheckpointManager
from cloudckpt.manifests import chunk_name
from cloudckpt.stores import OVERWRITE, open_store
from cloudckpt.testing.wrappers import ForwardingStore

SHARED = random.Random(7).randbytes(3 * 1024 * 1024 + 17)


class Counting(ForwardingStore):
    """Records (chunk name, bytes) of every chunk put this client sends; puts of the
    chunks named in ``lose`` are answered without being stored."""

    def __init__(self, inner, lose: frozenset[str] = frozenset()) -> None:
        super().__init__(inner)
        self.puts: list[tuple[str, int]] = []
        self.lose = lose
        self._lock = threading.Lock()

    def put(self, key, data, *, mode=OVERWRITE):
        if f"/{attempt_layout.CHUNKS_DIR}" in key:
            with self._lock:
                self.puts.append((key.rsplit("/", 1)[1], memoryview(data).nbytes))
            if key.rsplit("/", 1)[1] in self.lose:
                return None  # lost on the way: the caller sees success
        return self.inner.put(key, data, mode=mode)


def save(mgr, step: int, files: dict[str, bytes]):
    handle = mgr.save(step)
    with handle as d:
        for name, data in files.items():
            (d / name).write_bytes(data)
    return handle.result(timeout=60)


def scenario_dedup(url: str, work: Path, ev: Events) -> None:
    shared_name = chunk_name(digest.ALGORITHM, digest.hexleaf(SHARED))
    own = f"rank {RANK} alone ".encode() * 300
    store = Counting(open_store(url, OPTIONS))
    mgr = DistributedCheckpointManager(store, staging_dir=work / "staging", timeout=30)
    files = {"shard.bin": SHARED, "own.bin": own}
    info = save(mgr, 1, files)
    ev(
        "saved",
        bytes_uploaded=info.bytes_uploaded,
        chunk_bytes=sum(n for _, n in store.puts),
        shared_puts=sum(1 for name, _ in store.puts if name == shared_name),
        shared_bytes=len(SHARED),
        own_bytes=len(own),
    )
    res = mgr.restore(work / "restored")
    got = {p.name: p.read_bytes() for p in res.rank_path.iterdir()}
    ev("restored", exact=got == files)
    mgr.close()

    agree = DistributedCheckpointManager(
        url + "-agree",
        storage_options=OPTIONS,
        staging_dir=work / "staging-agree",
        timeout=30,
        replica_groups=[[0, 1]],
    )
    save(agree, 1, {"shard.bin": SHARED})
    flipped = bytearray(SHARED)
    if RANK == 1:
        flipped[123_456] ^= 0x10
    try:
        save(agree, 2, {"shard.bin": bytes(flipped)})
        ev("diverged", type=None, message="committed")
    except Exception as exc:
        ev("diverged", **error_fields(exc))
    check = open_store(url + "-agree", OPTIONS)
    ev("after", current=read_latest(check).latest.current.step)
    check.close()
    agree.close()

    lossy = Counting(
        open_store(url + "-lost", OPTIONS), frozenset({shared_name}) if RANK == 0 else frozenset()
    )
    lost = DistributedCheckpointManager(lossy, staging_dir=work / "staging-lost", timeout=30)
    try:
        save(lost, 1, files)
        ev("lost", type=None, message="committed")
    except Exception as exc:
        ev("lost", **error_fields(exc))
    check = open_store(url + "-lost", OPTIONS)
    latest = read_latest(check).latest
    ev("lost-after", current=None if latest is None or latest.current is None else 1)
    check.close()
    lost.close()


def main() -> int:
    exit_with_parent()
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, choices=["dedup"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--work", required=True, type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ev = Events(args.work)
    dist.init_process_group("gloo")
    ev("start", pid=os.getpid())
    try:
        scenario_dedup(args.url, args.work, ev)
    except BaseException as exc:
        ev("crashed", **error_fields(exc))
        raise
    ev("done")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
