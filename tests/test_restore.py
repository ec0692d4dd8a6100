"""Restore: every file checked against its recorded digest, whatever path brought its bytes
(whole files, chunks, multi-rank).

The hostile manifests here are consistent: the manifest is resealed and LATEST records its
new size and digest, so only the file digests can tell (``verify`` without ``--read-data``
passes them).
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from cloudckpt import CheckpointManager, protocol
from cloudckpt.chunks import MIN_PIECE
from cloudckpt.distributed import DistributedCheckpointManager
from cloudckpt.restore import restore
from cloudckpt.stores import open_store
from cloudckpt.transfer import TransferEngine
from cloudckpt.verify import verify_run

MiB = 1024 * 1024


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _save(mgr: CheckpointManager, step: int, files: dict[str, bytes]) -> None:
    handle = mgr.save(step)
    with handle as d:
        for rel, data in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)
    handle.result()


def _safetensors(tensors: dict[str, bytes]) -> bytes:
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {
            "dtype": "U8",
            "shape": [len(data)],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())


def _rewrite_current_manifest(store, edit: Callable[[dict], None]) -> None:
    """Edit the current checkpoint's manifest as a hostile bucket writer could, keeping
    everything consistent: the manifest is resealed and LATEST records its new digest."""
    latest = json.loads(store.get(protocol.LATEST_KEY)[0])
    record = latest["current"]
    key = record["ckpt"] + protocol.MANIFEST_NAME
    body = json.loads(store.get(key)[0])
    edit(body)
    manifest = protocol._sealed(body)
    store.put(key, manifest)
    latest["current"] = {
        **record,
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        "manifest_size": len(manifest),
    }
    store.put(protocol.LATEST_KEY, protocol._sealed(latest))


def _by_path(body: dict) -> dict[str, dict]:
    return {f["path"]: f for f in body["files"]}


def _swap_chunks_of_two_files(body: dict) -> None:
    a, b = _by_path(body)["a.bin"], _by_path(body)["b.bin"]
    a["chunks"], b["chunks"] = b["chunks"], a["chunks"]


def _swap_two_leaves(body: dict) -> None:
    chunks = _by_path(body)["big.bin"]["chunks"]
    assert [c[2] for c in chunks] == [8 * MiB, 8 * MiB]  # two whole leaves
    chunks.reverse()


def _swap_two_tensors_in_one_leaf(body: dict) -> None:
    chunks = _by_path(body)["model.safetensors"]["chunks"]
    # header, tensor x, tensor y: all within the first leaf
    assert len(chunks) == 3 and sum(c[2] for c in chunks) < 8 * MiB
    chunks[1], chunks[2] = chunks[2], chunks[1]


def _swap_digests_of_two_whole_files(body: dict) -> None:
    a, b = _by_path(body)["a.bin"], _by_path(body)["b.bin"]
    assert "chunks" not in a and a["size"] == b["size"]
    a["digest"], b["digest"] = b["digest"], a["digest"]


def _files(case: str, rng: random.Random) -> dict[str, bytes]:
    if case == "two whole leaves swapped":
        return {"big.bin": rng.randbytes(16 * MiB)}
    if case == "two chunks inside one leaf swapped":
        x, y = rng.randbytes(MIN_PIECE), rng.randbytes(MIN_PIECE + 4096)
        return {"model.safetensors": _safetensors({"x": x, "y": y})}
    return {"a.bin": rng.randbytes(3000), "b.bin": rng.randbytes(3000)}


WRONG_ORDER = {
    "chunks of two files swapped": ("tensor", _swap_chunks_of_two_files),
    "two whole leaves swapped": ("tensor", _swap_two_leaves),
    "two chunks inside one leaf swapped": ("tensor", _swap_two_tensors_in_one_leaf),
    "whole files' digests swapped": ("off", _swap_digests_of_two_whole_files),
}


@pytest.mark.parametrize("backend", ["memory", "s3"])
@pytest.mark.parametrize("case", sorted(WRONG_ORDER))
def test_valid_chunks_in_the_wrong_order_never_restore(request, backend, case, tmp_path):
    """Every chunk (every object) is intact and the manifest verifies against LATEST, but
    the bytes it assembles are not the files it records: the restore refuses the
    checkpoint and falls back, through every reader."""
    target = request.getfixturevalue(f"{backend}_target")
    store = open_store(target.url, target.storage_options)
    chunking, edit = WRONG_ORDER[case]
    rng = random.Random(case)
    good = {"a.bin": b"step one"}
    with CheckpointManager(store, staging_dir=tmp_path / "s", chunking=chunking) as mgr:
        _save(mgr, 1, good)
        _save(mgr, 2, _files(case, rng))
    _rewrite_current_manifest(store, edit)
    assert verify_run(store).ok  # consistent: only the file digests can tell
    assert not verify_run(store, read_data=True).ok

    with TransferEngine() as engine:
        res = restore(store, tmp_path / "out", engine)
    assert res.step == 1 and _tree(tmp_path / "out") == good
    assert [s.step for s in res.skipped] == [2]
    assert "does not match its digest" in res.skipped[0].reason
    assert not list(tmp_path.glob(".out.cloudckpt-*"))

    if backend == "memory":  # the multi-rank reader (world size 1) shares the check
        dist = DistributedCheckpointManager(store, staging_dir=tmp_path / "d", timeout=30)
        try:
            got = dist.restore(tmp_path / "dist")
        finally:
            dist.close()
        assert got.step == 1 and [s.step for s in got.skipped] == [2]
        assert _tree(tmp_path / "dist") == good
    store.close()
