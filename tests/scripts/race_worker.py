"""Worker functions for tests/test_racing_writers.py, run in separate (spawned) processes.

Each waits until a shared wall-clock instant, then acts, so several processes hit the
store within a millisecond or two of each other.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import tempfile
import time
from pathlib import Path

from cloudckpt import (
    CheckpointManager,
    CommitConflictError,
    FencedError,
    attempt_layout,
    canonical,
    digest,
    manifests,
    protocol,
)
from cloudckpt.committer import Committer
from cloudckpt.errors import PreconditionFailedError, StoreConflictError
from cloudckpt.stores import Update, open_store


def _until(at: float) -> None:
    delay = at - time.time()
    if delay > 0:
        time.sleep(delay)


_STORES: dict = {}


def _store(url: str, options: dict):
    """One client per process and target (creating a GCS client costs a second)."""
    key = (url, repr(sorted(options.items())))
    if key not in _STORES:
        _STORES[key] = open_store(url, options)
    return _STORES[key]


def warm(url: str, options: dict) -> int:
    _store(url, options)
    return os.getpid()


def raw_cas(url: str, options: dict, version: str, body: bytes, at: float) -> str:
    """One compare-and-swap of LATEST from ``version``: "won" or the error's name."""
    store = _store(url, options)
    _until(at)
    try:
        store.put(protocol.LATEST_KEY, body, mode=Update(version))
        return "won"
    except (PreconditionFailedError, StoreConflictError) as exc:
        return type(exc).__name__


def upload_attempt(store, step: int, epoch: int, writer_id: str) -> protocol.CheckpointRecord:
    now = dt.datetime.now(dt.timezone.utc)
    attempt = attempt_layout.new_attempt_id(now)
    prefix = attempt_layout.ckpt_prefix(step, epoch, attempt)
    data = f"{writer_id}:{step}".encode()
    store.put(prefix + attempt_layout.ATTEMPT_NAME, b"{}")
    store.put(prefix + attempt_layout.FILES_DIR + "f", data)
    manifest = manifests.Manifest(
        ckpt=prefix,
        step=step,
        epoch=epoch,
        commit_id=attempt,
        writer_id=writer_id,
        created_at=canonical.iso(now),
        files=(manifests.FileEntry("f", len(data), digest.tree_digest(data)),),
        metadata={"writer": writer_id},
    )
    body = manifest.to_bytes()
    store.put(prefix + attempt_layout.MANIFEST_NAME, body)
    return manifest.record(body, now)


def claim_then_commit(url: str, options: dict, writer_id: str, claim_at: float, barrier) -> dict:
    """Claim at ``claim_at`` (racing the others), upload, wait until every writer has
    claimed and uploaded (``barrier``), then commit (racing again)."""
    store = _store(url, options)
    committer = Committer(store, writer_id, protocol.Settings(keep_last=None))
    _until(claim_at)
    epoch = committer.claim().writer.epoch
    record = upload_attempt(store, 1, epoch, writer_id)
    barrier.wait(timeout=60)
    try:
        committer.commit(record)
        outcome = "committed"
    except FencedError:
        outcome = "fenced"
    except CommitConflictError:
        outcome = "conflict"
    return {"writer": writer_id, "epoch": epoch, "outcome": outcome, "id": record.commit_id}


def content(name: str, step: int) -> bytes:
    return random.Random(f"{name}/{step}").randbytes(2000 + step)


def manager_race(url: str, options: dict, name: str, at: float, until: float, barrier) -> dict:
    """A full writer: resume (claiming the run) at ``at``, then save until fenced or until
    ``until``; then, once every writer has claimed (``barrier``), one last save, which
    only the newest writer can commit (so every older one is certain to meet its fence,
    however slow the store is)."""
    acks, fenced = [], False

    def save(mgr: CheckpointManager, step: int) -> bool:
        nonlocal fenced
        try:
            handle = mgr.save(step=step, metadata={"writer": name})
            with handle as d:
                (d / "model.bin").write_bytes(content(name, step))
            acks.append((step, handle.result().commit_id))
            return True
        except FencedError:
            fenced = True
            return False

    with tempfile.TemporaryDirectory() as tmp:
        mgr = CheckpointManager(
            _store(url, options),
            staging_dir=Path(tmp) / "staging",
            keep_last=None,
            auto_gc=False,
        )
        _until(at)
        res = mgr.resume(into=Path(tmp) / "restore")
        step = (res.step if res else 0) + 1
        while time.time() < until and save(mgr, step):
            step += 1
        barrier.wait(timeout=120)
        if not fenced:
            save(mgr, step)
        try:
            mgr.close()
        except FencedError:
            fenced = True
    return {"name": name, "acks": acks, "fenced": fenced, "epoch": mgr.committer.epoch}
