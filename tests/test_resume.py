"""An interrupted save resumes: a save of the same step names the chunks the interrupted
attempt uploaded instead of sending them again, and never names one GC may own
(docs/design.md §11, "Resuming an interrupted save"). Every save reports what it uploaded
and what it reused."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloudckpt import CheckpointManager, attempt_layout, failpoints, manifests, protocol
from cloudckpt.gc import collect_garbage
from cloudckpt.stores import open_store
from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket
from cloudckpt.testing.proxy import FaultProxy, ProxyRule
from cloudckpt.verify import verify_run

MiB = 1024 * 1024
GRACE = 100  # seconds: an attempt may be committed up to 90 s old (a 10 % margin)


@pytest.fixture
def clocked(tmp_path):
    """A memory:// run on a clock that moves only when told to."""
    clock, name = ManualClock(), f"resume-{random.getrandbits(32):08x}"
    store = MemoryStore(name, "run", clock=clock)
    yield store, clock
    drop_memory_bucket(name)


def _source(tmp_path: Path, seed: int = 1, size: int = 3 * 8 * MiB + 5) -> Path:
    src = tmp_path / f"src-{seed}"
    src.mkdir(exist_ok=True)
    (src / "weights.bin").write_bytes(random.Random(seed).randbytes(size))
    (src / "config.json").write_bytes(b'{"layers": 2}')
    return src


def _manager(store, tmp_path: Path, name: str) -> CheckpointManager:
    return CheckpointManager(
        store, staging_dir=tmp_path / name, gc_grace=GRACE, auto_gc=False, keep_last=2
    )


def _interrupt_upload(store, tmp_path: Path, src: Path, step: int) -> str:
    """A save of ``step`` whose upload finished and that never committed (a push stopped
    with Ctrl-C, a trainer killed before its commit). Returns its attempt prefix."""
    mgr = _manager(store, tmp_path, "interrupted")
    attempts = mgr.attempts
    attempts.claim()
    begun = attempts.begin(step)
    files = [(p.relative_to(src).as_posix(), p) for p in sorted(src.rglob("*")) if p.is_file()]
    attempts.upload(begun, files)
    mgr.staging.close()
    mgr.engine.close()
    return begun.prefix


def _chunk_owners(store, step: int) -> set[str]:
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    record = next(r for r in latest.retained() if r.step == step)
    manifest = manifests.parse_manifest(store.get(record.manifest_key)[0], record)
    return {c.owner for f in manifest.files for c in f.chunks or ()}


def test_a_save_of_the_same_step_resumes_the_interrupted_upload(clocked, tmp_path):
    store, clock = clocked
    src = _source(tmp_path)
    interrupted = _interrupt_upload(store, tmp_path, src, step=7)
    clock.advance(30)  # well within the grace period

    mgr = _manager(store, tmp_path, "again")
    info = mgr.save_dir(7, src).result()
    total = sum(p.stat().st_size for p in src.iterdir())
    assert info.total_bytes == total
    assert info.bytes_resumed == info.bytes_reused == total and info.bytes_uploaded == 0
    assert mgr.last_upload.chunks_resumed == mgr.last_upload.chunks_reused > 0
    assert _chunk_owners(store, 7) == {interrupted}
    mgr.close()

    # The run restores and verifies, and stays whole after GC removes what is left of the
    # interrupted attempt (it keeps the chunks the committed checkpoint names).
    clock.advance(3 * GRACE)
    report = collect_garbage(store)
    assert interrupted in report.deleted_orphans
    assert not store.exists(interrupted + attempt_layout.ATTEMPT_NAME)
    assert verify_run(store, all=True, read_data=True).ok
    restored = _manager(store, tmp_path, "reader").restore(tmp_path / "out")
    assert (tmp_path / "out" / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()
    assert restored.step == 7


def test_an_old_interrupted_attempt_is_not_resumed(clocked, tmp_path):
    """An interrupted attempt older than half the commit's age bound is left to GC: a save
    of its step uploads everything again."""
    store, clock = clocked
    src = _source(tmp_path, size=5000)
    _interrupt_upload(store, tmp_path, src, step=3)
    clock.advance(0.5 * 90 + 1)
    mgr = _manager(store, tmp_path, "late")
    info = mgr.save_dir(3, src).result()
    assert info.bytes_resumed == 0 and info.bytes_uploaded == info.total_bytes
    mgr.close()


def test_resumed_chunks_never_outlive_the_grace_period(clocked, tmp_path, caplog):
    """The guard of the resume rule. A save resumes an interrupted attempt's chunks while
    that attempt is young; then (its host slow or suspended) GC judges the interrupted
    attempt older than grace, sweeps and deletes it, between the save's pre-commit listing
    and its compare-and-swap. The commit must refuse to name those chunks (the age bound
    of the interrupted attempt, checked on the store's clock inside the commit) and upload
    them again: an acknowledged save that names deleted chunks would never restore."""
    store, clock = clocked
    src = _source(tmp_path)
    interrupted = _interrupt_upload(store, tmp_path, src, step=5)
    clock.advance(40)  # young enough to resume (40 s < 45 s)
    swept: list[object] = []

    def gc_under_the_commit(point: str) -> None:
        clock.advance(70)  # the interrupted attempt is 110 s old; this save only 70 s
        swept.append(collect_garbage(store))

    mgr = _manager(store, tmp_path, "resumer")
    failpoints.arm("save.after_manifest", gc_under_the_commit)  # once
    try:
        with caplog.at_level(logging.WARNING, logger="cloudckpt"):
            info = mgr.save_dir(5, src).result()
    finally:
        failpoints.disarm()
    mgr.close()
    # The fault fired: GC deleted the interrupted attempt under the save's commit.
    assert swept and interrupted in swept[0].deleted_orphans
    assert not any(store.list(interrupted))
    # The save committed, naming only chunks of its own (second) attempt, and restores.
    assert verify_run(store, all=True, read_data=True).ok
    assert _chunk_owners(store, 5) == {info.ckpt} and interrupted != info.ckpt
    assert info.bytes_resumed == 0 and info.bytes_uploaded == info.total_bytes
    assert "interrupted attempt" in caplog.text  # the first attempt was refused, and said so


def test_every_save_reports_bytes_uploaded_and_reused(clocked, tmp_path):
    store, _ = clocked
    src = _source(tmp_path, size=2 * 8 * MiB)
    mgr = _manager(store, tmp_path, "w")
    first = mgr.save_dir(1, src).result()
    assert (first.bytes_uploaded, first.bytes_reused) == (first.total_bytes, 0)
    (src / "config.json").write_bytes(b'{"layers": 3}')
    second = mgr.save_dir(2, src).result()
    assert second.bytes_uploaded == len(b'{"layers": 3}')
    assert second.bytes_reused == 2 * 8 * MiB and second.bytes_resumed == 0
    mgr.close()
    off = CheckpointManager(store, staging_dir=tmp_path / "off", chunking="off", auto_gc=False)
    third = off.save_dir(3, src).result()
    assert (third.bytes_uploaded, third.bytes_reused) == (third.total_bytes, 0)
    off.close()


def _push(src: Path, url: str, step: int, flags: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cloudckpt.cli", "push", str(src), url, "--step", str(step),
         "--force", "--json", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )  # fmt: skip


def test_a_push_abandoned_with_ctrl_c_resumes_when_pushed_again(s3_target, tmp_path):
    """The issue's scenario: a push interrupted twice (abandoned) after part of its upload
    landed, then the same push again: it uploads only what is missing and says so."""
    so = s3_target.storage_options
    store = open_store(s3_target.url, so)
    src = tmp_path / "ck"
    src.mkdir()
    (src / "model.bin").write_bytes(random.Random(5).randbytes(4 * 8 * MiB))
    landed = [0]

    def hold_after_two(target: str) -> bool:
        # Let two chunk PUTs through to moto; hold every later one for longer than the test.
        if "/chunks/" not in target:
            return False
        landed[0] += 1
        return landed[0] > 2

    def flags(endpoint: str) -> list[str]:
        return ["--endpoint-url", endpoint, "--region", "us-east-1",
                "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]  # fmt: skip

    with FaultProxy(so["endpoint_url"], stall_seconds=600) as proxy:
        rule = proxy.add(ProxyRule("stall", methods={"PUT"}, path=hold_after_two))
        proc = _push(src, s3_target.url, 9, flags(proxy.endpoint_url))
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if len([o for o in store.list("ckpt/") if "/chunks/" in o.key]) >= 2 and rule.fired:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()
        for _ in range(2):  # Ctrl-C twice: the first waits for the upload, the second abandons
            proc.send_signal(2)
            while proc.poll() is None:
                line = proc.stderr.readline()
                if "interrupted" in line or not line:
                    break
        proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert (
        store.exists(protocol.LATEST_KEY) is False
        or not protocol.parse_latest(store.get(protocol.LATEST_KEY)[0]).retained()
    )

    again = _push(src, s3_target.url, 9, flags(so["endpoint_url"]), env={**os.environ})
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    doc = json.loads(out)
    assert doc["bytes_resumed"] == doc["bytes_reused"] == 2 * 8 * MiB
    assert doc["bytes_uploaded"] == 2 * 8 * MiB
    assert doc["bytes_uploaded"] + doc["bytes_reused"] == doc["total_bytes"]
    assert verify_run(store, read_data=True).ok
    store.close()
