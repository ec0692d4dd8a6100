"""What cross-rank dedup and replica agreement cost one rank (issue 30, items 1-2):
``python -m benchmarks.dedup_cost``.

One staged file (default 256 MiB of random bytes, a ``torch.save``-like blob cut on the
8 MiB grid) and one rank's view of a multi-rank save, timed in the same process, rounds
interleaved, medians:

- ``upload_s``: the rank's chunked upload of the file to an in-memory store (read, hash,
  put), what a save costs without dedup;
- ``names_s``: the hashing pass dedup adds before the save's first collective
  (``_chunks.chunk_names``: read and hash every byte once more); ``names_ratio`` =
  names_s / upload_s;
- ``plan_bytes``: what the names add to the rank's plan (pickled), per GiB staged;
- ``agreement_s``: the coordinator's comparison of ``--world`` replicas' entries of the
  file (``_replicas.divergence``): no hashing at all, the digests are those the upload
  computed; ``agreement_per_gib_s`` scales it to a GiB per replica.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path

from cloudckpt.chunks import ChunkIndex, upload_chunked
from cloudckpt.distributed._chunks import chunk_names
from cloudckpt.distributed._replicas import divergence
from cloudckpt.stores import open_store
from cloudckpt.stores.memory import drop_memory_bucket
from cloudckpt.transfer import TransferEngine

GIB = 1024**3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = TransferEngine()
    times: dict[str, list[float]] = {"upload_s": [], "names_s": [], "agreement_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.pt"
        with open(path, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1024 * 1024))
        files = [("rank-00000/shard.pt", path)]
        names: frozenset[str] = frozenset()
        entries = []
        for i in range(args.rounds):
            store = open_store(f"memory://dedup-cost-{i}/run")
            t = time.perf_counter()
            entries, _ = upload_chunked(engine, store, f"ckpt/{i}/", files, ChunkIndex(), "fixed")
            times["upload_s"].append(time.perf_counter() - t)
            store.close()
            drop_memory_bucket(f"dedup-cost-{i}")
            t = time.perf_counter()
            names = chunk_names(engine, files, "fixed")
            times["names_s"].append(time.perf_counter() - t)
            replicas = [
                [dataclasses.replace(e, path=f"rank-{r:05d}/shard.pt") for e in entries]
                for r in range(args.world)
            ]
            t = time.perf_counter()
            assert divergence((tuple(range(args.world)),), replicas) == []
            times["agreement_s"].append(time.perf_counter() - t)
    engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    size = args.mib * 1024 * 1024
    print(
        json.dumps(
            {
                "mib": args.mib,
                "world": args.world,
                "rounds": args.rounds,
                "chunks": len(names),
                **{k: round(v, 6) for k, v in med.items()},
                "names_ratio": round(med["names_s"] / med["upload_s"], 3),
                "plan_bytes_per_gib": round(len(pickle.dumps(names)) * GIB / size),
                "agreement_per_gib_s": round(med["agreement_s"] * GIB / size, 6),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
