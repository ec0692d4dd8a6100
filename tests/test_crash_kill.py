"""Real crashes: a process saving to an S3 server (moto, and SeaweedFS, whose conditional
writes are atomic on their own) is killed with SIGKILL at random moments, over and over. After every kill the store must hold the last acknowledged
checkpoint (``handle.result()`` returned) or a newer committed one, byte for byte, never a
torn one; the next process resumes from it (half of the time from the killed process's
staging directory, so the staging journal's recovery runs too).

Each saver is forked from a zygote that has already imported cloudckpt and botocore, so a
kill cycle costs about a second. CI: 50 kills on each server. Soak::

    CLOUDCKPT_CRASH_KILLS=1000 pytest tests/test_crash_kill.py -s --timeout 3600
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloudckpt import CheckpointManager
from cloudckpt.reader import fetch_manifest, load_latest_for_reading
from cloudckpt.restore import restore
from cloudckpt.stores import open_store
from cloudckpt.transfer import TransferEngine

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from crash_zygote import TRANSFER, content, read_tree

KILLS = int(os.environ.get("CLOUDCKPT_CRASH_KILLS", "50"))
SEED = int(os.environ.get("CLOUDCKPT_CRASH_SEED", "20261202"))


class Zygote:
    def __init__(self, url: str, options: dict) -> None:
        script = Path(__file__).parent / "scripts" / "crash_zygote.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        )
        self._send({"url": url, "options": options})
        assert self.proc.stdout.readline().strip() == "ready"

    def _send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def spawn(self, **cmd) -> int:
        self._send(cmd)
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the zygote reaps it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.002)
    raise AssertionError(f"saver {pid} survived SIGKILL")


def _wait_for(log: Path, skip: int, word: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = _lines(log)[skip:]
        if any(x[0] in (word, "BAD") for x in lines):
            return
        time.sleep(0.005)
    raise AssertionError(f"the saver wrote no {word} line within {timeout}s")


def _lines(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [line.split() for line in log.read_text().splitlines() if line.strip()]


def _shares_chunks(store, record) -> bool:
    """The checkpoint names a chunk an earlier attempt uploaded (chunks are shared)."""
    manifest = fetch_manifest(store, record)
    return any(c.owner != record.ckpt for f in manifest.files for c in f.chunks or ())


def _verify(store, engine, into: Path, acked: int) -> int:
    """The store's newest checkpoint is >= the last acknowledged step and intact."""
    latest, from_records = load_latest_for_reading(store)
    assert not from_records, "LATEST became unreadable"
    if latest is None or latest.current is None:
        assert acked == 0, f"step {acked} was acknowledged but nothing is committed"
        return 0
    res = restore(store, into, engine)
    assert not res.skipped, f"a committed checkpoint is damaged: {res.skipped}"
    assert res.step >= acked, f"acknowledged step {acked} lost; store has {res.step}"
    assert read_tree(res.path) == content(res.step), f"step {res.step} is torn"
    newer = [r.step for r in latest.retained() if r.step > acked]
    if acked and len(newer) < 3:  # keep_last=3: only newer commits may push it out
        assert any(r.step == acked for r in latest.retained()), f"step {acked} not retained"
    return res.step


@pytest.mark.slow
@pytest.mark.parametrize("server", ["moto_server", "seaweedfs_server"])
def test_sigkill_at_random_moments_never_loses_an_acknowledged_save(server, request, tmp_path):
    server = request.getfixturevalue(server)
    bucket = f"kill-{random.Random().getrandbits(32):08x}"
    server.create_bucket(bucket)
    url, options = f"s3://{bucket}/run", server.storage_options()
    store = open_store(url, options)
    engine = TransferEngine(TRANSFER)
    rng = random.Random(SEED)
    zygote = Zygote(url, options)
    log = tmp_path / "acks.log"
    staging = tmp_path / "staging-0"
    acked = committed = 0
    stats = {"kills": 0, "acks": 0, "recovered": 0, "reused_staging": 0, "max_step": 0}
    try:
        for cycle in range(KILLS):
            if cycle and rng.random() < 0.5:
                stats["reused_staging"] += 1  # the next process finds the dead one's journal
            else:
                staging = tmp_path / f"staging-{cycle}"
            before = len(_lines(log))
            pid = zygote.spawn(url=url, options=options, staging=str(staging), log=str(log))
            # Die anywhere: a quarter of the time while claiming, recovering or restoring,
            # otherwise somewhere in the next few saves (uploads, manifest, commit...).
            if rng.random() < 0.25:
                time.sleep(rng.uniform(0.0, 0.6))
            else:
                _wait_for(log, before, "RESUMED")
                time.sleep(rng.uniform(0.0, 1.0))
            _kill(pid)
            stats["kills"] += 1
            lines = _lines(log)[before:]
            bad = [" ".join(x) for x in lines if x[0] == "BAD"]
            assert not bad, f"cycle {cycle} (seed {SEED}): {bad}"
            resumed = [int(x[1]) for x in lines if x[0] == "RESUMED"]
            if resumed:  # the new process resumed from the last ack or newer
                assert resumed[0] >= acked, f"cycle {cycle}: resumed {resumed[0]} < ack {acked}"
            stats["recovered"] += sum(1 for x in lines if x[0] == "RECOVERING")
            acks = [int(x[1]) for x in lines if x[0] == "ACK"]
            stats["acks"] += len(acks)
            acked = max([acked, *acks])
            committed = _verify(store, engine, tmp_path / f"verify-{cycle}", acked)
            stats["max_step"] = committed
            latest, _ = load_latest_for_reading(store)
            if latest is not None and latest.current is not None:
                stats["shared"] = stats.get("shared", 0) + _shares_chunks(store, latest.current)
        # A last new host takes over (claims, fencing nobody alive) and resumes.
        mgr = CheckpointManager(url, storage_options=options, staging_dir=tmp_path / "final")
        res = mgr.resume(into=tmp_path / "final-restore")
        assert res.step >= acked and read_tree(res.path) == content(res.step)
        mgr.close()
    finally:
        zygote.close()
        engine.close()
        store.close()
    print(f"\ncrash test (seed {SEED}): {stats}")
    assert stats["kills"] == KILLS and stats["acks"] >= KILLS // 4
    assert stats.get("shared", 0) > 0, "no checkpoint reused a chunk of an earlier one"
