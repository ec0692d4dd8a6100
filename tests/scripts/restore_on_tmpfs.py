"""Restore onto a small tmpfs (the test mounts it in a private mount namespace and runs
this script there): into the mount point itself, then into a destination on it while
another writer fills the disk after the free-space check. Prints one JSON line.

    python restore_on_tmpfs.py URL MOUNTPOINT
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

from cloudckpt import CloudCkptError
from cloudckpt.restore import restore
from cloudckpt.stores import open_store
from cloudckpt.testing.faults import Callback, FaultInjectingStore, Rule
from cloudckpt.transfer import TransferEngine


def _fill(mount: Path) -> None:
    """Another process's file takes every free byte of the volume."""
    with open(mount / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def _attempt(store, into: Path, **kwargs) -> dict:
    try:
        with TransferEngine() as engine:
            res = restore(store, into, engine, **kwargs)
    except CloudCkptError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"step": res.step}


def main() -> None:
    url, mount = sys.argv[1], Path(sys.argv[2])
    out: dict = {"statvfs_blocks": os.statvfs(mount).f_blocks}
    store = FaultInjectingStore(open_store(url))
    out["mount point"] = _attempt(store, mount)

    dest = mount / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_bytes(b"precious")
    rule = store.add(
        Rule(Callback(before=lambda: _fill(mount)), ops={"get_range"}, key="ckpt/*/chunks/*")
    )
    out["disk full"] = _attempt(store, dest, overwrite=True)
    out["fired"] = rule.fired
    out["dest"] = sorted(p.name for p in dest.iterdir())
    out["left"] = sorted(p.name for p in mount.iterdir())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
