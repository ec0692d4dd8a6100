"""``cloudckpt watch``: a real trainer-like writer process, a real watcher process, moto.

The writer imitates what trainers do on disk: Hugging Face ``Trainer`` writes the model,
optimizer, scheduler and RNG state into ``checkpoint-N/`` and ``trainer_state.json`` last;
Lightning writes ``epoch=E-step=S.ckpt`` zip archives (``torch.save``'s format) in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from cloudckpt import protocol
from cloudckpt.stores import open_store
from cloudckpt.watch import Watcher

WRITER = r"""
import json, os, random, sys, time, zipfile
out, kind, steps, hang_at, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
events = open(sys.argv[6], "a", buffering=1)

def event(what, step):
    events.write(json.dumps({"event": what, "step": step}) + "\n")

def write_slowly(path, data, hang):
    with open(path, "wb") as f:
        for i in range(0, len(data), 64 * 1024):
            f.write(data[i : i + 64 * 1024])
            f.flush()
            if hang and f.tell() >= len(data) // 2:
                return True
            time.sleep(0.002)
    return False

def hang_here(step):
    event("half", step)
    time.sleep(3600)  # the test kills us here: SIGKILL, half-way through a checkpoint

for step in map(int, steps.split(",")):
    rng = random.Random(step)
    event("writing", step)
    if kind == "hf":
        d = os.path.join(out, f"checkpoint-{step}")
        os.makedirs(d)
        for name, n in (("model.safetensors", size), ("optimizer.pt", size // 2),
                        ("scheduler.pt", 1000), ("rng_state.pth", 2000)):
            if write_slowly(os.path.join(d, name), rng.randbytes(n), step == hang_at):
                hang_here(step)
        with open(os.path.join(d, "trainer_state.json"), "w") as f:  # written last
            json.dump({"global_step": step, "log_history": []}, f)
    else:
        path = os.path.join(out, f"epoch=0-step={step}.ckpt")
        with open(path, "wb") as raw:
            z = zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED)
            z.writestr("archive/data.pkl", rng.randbytes(1000))
            z.writestr("archive/data/0", rng.randbytes(size))
            raw.flush()
            if step == hang_at:
                hang_here(step)  # the central directory (written by close) never comes
            z.close()
    event("done", step)
"""


def flags(t) -> list[str]:
    so = t.storage_options
    return [
        "--endpoint-url", so["endpoint_url"], "--region", "us-east-1",
        "-o", f"key={so['key']}", "-o", f"secret={so['secret']}",
    ]  # fmt: skip


class Proc:
    """A subprocess whose stdout goes to a file we can poll (never a pipe to drain)."""

    def __init__(self, argv, out: Path, events: Path | None = None):
        self.out = out
        self.events = events
        self._log = open(out, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT if events is None else open(str(out) + ".err", "wb"),  # noqa: SIM115
            stdin=subprocess.DEVNULL,
            env={**os.environ, "AWS_EC2_METADATA_DISABLED": "true"},
        )

    def lines(self) -> list[dict]:
        path = self.events or self.out
        found = []
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):  # a line still being written
                    found.append(json.loads(line))
        return found

    def wait_for(self, pred, what: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.lines():
                if pred(e):
                    return e
            if self.proc.poll() is not None and not any(pred(e) for e in self.lines()):
                raise AssertionError(f"process exited ({self.proc.returncode}) before {what}:\n"
                                     + self.log())  # fmt: skip
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log()}")

    def log(self) -> str:
        text = self.out.read_text(errors="replace")
        err = Path(str(self.out) + ".err")
        return text + (err.read_text(errors="replace") if err.exists() else "")

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        self._log.close()
        return rc


@pytest.fixture
def area(tmp_path):
    out = tmp_path / "output"
    out.mkdir()
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    return out, script, tmp_path


def start_writer(area, kind, steps, *, hang_at=-1, size=256 * 1024, name="writer"):
    out, script, tmp = area
    events = tmp / f"{name}.events"
    events.touch()
    argv = [sys.executable, str(script), str(out), kind, ",".join(map(str, steps)),
            str(hang_at), str(size), str(events)]  # fmt: skip
    return Proc(argv, tmp / f"{name}.log", events)


def start_watch(area, target, *extra, name="watch"):
    out, _, tmp = area
    argv = [sys.executable, "-m", "cloudckpt.cli", "watch", str(out), target.url, "--json",
            "--settle", "0.5", "--poll", "0.1", *extra, *flags(target)]  # fmt: skip
    return Proc(argv, tmp / f"{name}.out")


def committed(watch: Proc, step: int):
    return lambda e: e.get("event") == "committed" and e.get("step") == step


def every_committed_source(store) -> set[str]:
    """Sources of every checkpoint any LATEST ever named (all commit records)."""
    sources = set()
    for obj in store.list(protocol.COMMITS_PREFIX):
        latest = protocol.parse_latest(store.get(obj.key)[0])
        for rec in [*latest.retained(), *(t.record for t in latest.tombstones)]:
            sources.add(rec.metadata["watch"]["source"])
    return sources


@pytest.mark.parametrize("kind", ["hf", "lightning"])
def test_a_writer_killed_half_way_never_gets_its_partial_checkpoint_committed(
    area, s3_target, kind
):
    store = open_store(s3_target.url, s3_target.storage_options)
    watch = start_watch(area, s3_target)
    try:
        writer = start_writer(area, kind, [1, 2, 3], hang_at=3)
        writer.wait_for(lambda e: e == {"event": "half", "step": 3}, "the writer to hang")
        writer.stop(signal.SIGKILL)  # killed half-way through checkpoint 3
        watch.wait_for(committed(watch, 2), "step 2 to be committed")
        time.sleep(1.5)  # three settle periods: the partial checkpoint is now "quiet"
        # Training restarts (a new process) and writes the next checkpoint.
        writer2 = start_writer(area, kind, [4], name="writer2")
        watch.wait_for(committed(watch, 4), "step 4 to be committed")
        writer2.stop()
    finally:
        rc = watch.stop()
    assert rc == 0, watch.log()
    partial = "checkpoint-3" if kind == "hf" else "epoch=0-step=3.ckpt"
    events = watch.lines()
    assert not [e for e in events if e.get("source") == partial and e["event"] != "skipped"]
    sources = every_committed_source(store)
    assert partial not in sources and len(sources) == 3
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert [r.step for r in latest.retained()] == [4, 2, 1]
    assert not list(store.list(protocol.ckpt_prefix(3, 1, "x")[: len("ckpt/000000000003")]))
    store.close()


def test_restart_reuploads_nothing_and_sigterm_flushes(area, s3_target):
    store = open_store(s3_target.url, s3_target.storage_options)
    writer = start_writer(area, "hf", [10, 20, 30])
    watch = start_watch(area, s3_target)
    try:
        writer.wait_for(lambda e: e == {"event": "done", "step": 30}, "the writer to finish")
        watch.wait_for(committed(watch, 30), "step 30 to be committed")
    finally:
        assert watch.stop() == 0, watch.log()
    assert watch.lines()[-1]["event"] == "stopped"
    before = {o.key: o.version for o in store.list()}

    # Restarted: it looks at everything again and uploads nothing (and does not even claim).
    again = start_watch(area, s3_target, name="watch2")
    try:
        again.wait_for(lambda e: e.get("event") == "started", "the watcher to start")
        assert again.lines()[0]["committed_step"] == 30
        time.sleep(1.5)
        assert {o.key: o.version for o in store.list()} == before
        assert not [e for e in again.lines() if e["event"] in ("queued", "committed")]

        # A new, large checkpoint: SIGTERM lands while it uploads; the watcher finishes
        # the upload, commits it, and exits 0.
        big = start_writer(area, "hf", [40], size=32 * 1024 * 1024, name="big")
        again.wait_for(lambda e: e.get("event") == "queued" and e["step"] == 40, "upload")
        assert not [e for e in again.lines() if e.get("event") == "committed"]
        rc = again.stop(signal.SIGTERM)
        big.stop()
    finally:
        again.stop(signal.SIGKILL)
    assert rc == 0, again.log()
    events = [e["event"] for e in again.lines()]
    assert events.index("committed") < events.index("stopped")
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert latest.current.step == 40
    assert latest.current.metadata["watch"] == {"source": "checkpoint-40", "kind": "hf"}
    # Exactly one new attempt prefix: nothing of 10-30 was uploaded again.
    prefixes = {o.key.split("/")[1] for o in store.list("ckpt/")}
    old = {k.split("/")[1] for k in before if k.startswith("ckpt/")}
    assert len(prefixes - old) == 1
    store.close()


# --- the completeness rules, in-process on the memory store (fast) ------------------------


def _watcher(tmp_path, target, **kw):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    events: list[dict] = []
    w = Watcher(out, target.url, settle=0, on_event=events.append,
                staging_dir=tmp_path / "staging", **kw)  # fmt: skip
    return w, out, events


def _flush(w: Watcher) -> list[int]:
    w.manager.wait()
    w.poll()
    return [e["step"] for e in w.committed]


def test_completeness_rules(tmp_path, memory_target):
    w, out, events = _watcher(tmp_path, memory_target, markers=(".complete", "DONE"))
    try:
        hf = out / "checkpoint-5"
        hf.mkdir()
        (hf / "model.safetensors").write_bytes(b"m" * 1000)
        (hf / "trainer_state.json").write_text('{"global_step": 5')  # still being written
        (out / "tmp-checkpoint-6").mkdir()  # transformers' staging name: never taken
        (out / "tmp-checkpoint-6" / "trainer_state.json").write_text("{}")
        (out / "epoch=0-step=7.ckpt").write_bytes(b"PK\x03\x04 truncated zip")
        (out / "last.ckpt").write_bytes(b"no step in this name")
        generic = out / "snapshot_8"
        generic.mkdir()
        (generic / "weights").write_bytes(b"w")
        assert w.poll() == 0

        (hf / "trainer_state.json").write_text('{"global_step": 5}')
        assert w.poll() == 1 and _flush(w) == [5]

        lightning = out / "sub" / "checkpoints" / "epoch=1-step=9.ckpt"
        lightning.parent.mkdir(parents=True)
        with zipfile.ZipFile(lightning, "w") as z:
            z.writestr("archive/data.pkl", b"x" * 100)
        (generic / "DONE").write_text("8")  # a marker; the step is its content
        assert w.poll() == 2  # handed over in step order: 8, then 9
    finally:
        w.close()
    assert [e["step"] for e in w.committed] == [5, 8, 9]
    assert [e["source"] for e in w.committed] == [
        "checkpoint-5", "snapshot_8", "sub/checkpoints/epoch=1-step=9.ckpt",
    ]  # fmt: skip
    skipped = {e["source"]: e["reason"] for e in events if e["event"] == "skipped"}
    assert "no step" in skipped["last.ckpt"]
    assert "epoch=0-step=7.ckpt" not in skipped  # never complete, so never judged
    assert "tmp-checkpoint-6" not in {e.get("source") for e in events}


def test_only_moves_forward_and_ignores_quiet_dirs_unless_asked(tmp_path, memory_target):
    w, out, events = _watcher(tmp_path, memory_target)
    try:
        (out / "run_40").mkdir()  # quiet, step-numbered, no marker: not taken by default
        (out / "run_40" / "w").write_bytes(b"w")
        for step in (30, 10):
            d = out / f"checkpoint-{step}"
            d.mkdir()
            (d / "trainer_state.json").write_text("{}")
            w.poll()
        assert _flush(w) == [30]
    finally:
        w.close()
    skipped = {e["source"]: e["reason"] for e in events if e["event"] == "skipped"}
    assert skipped == {"checkpoint-10": "step 10 is not newer than step 30, already committed"}

    # A new watcher (a restart) reads what is committed from LATEST.
    w2, out, events = _watcher(tmp_path, memory_target)
    try:
        assert w2.committed_step == 30 and w2.committed_sources == {"checkpoint-30"}
        assert w2.poll() == 0
    finally:
        w2.close()


def test_quiet_dirs_opt_in(tmp_path, memory_target):
    w, out, _ = _watcher(tmp_path, memory_target, accept_quiet_dirs=True)
    try:
        (out / "run_40").mkdir()
        (out / "run_40" / "w").write_bytes(b"w")
        w.poll()
        assert _flush(w) == [40]
    finally:
        w.close()


def test_a_checkpoint_that_changes_while_being_snapshotted_is_not_taken(
    tmp_path, memory_target, monkeypatch
):
    from cloudckpt import watch

    w, out, events = _watcher(tmp_path, memory_target)
    d = out / "checkpoint-1"
    d.mkdir()
    (d / "trainer_state.json").write_text("{}")
    (d / "model").write_bytes(b"old")
    real = watch._signature

    def rotated_meanwhile(c):  # the stable listing still names a file that is now gone
        sig = real(c)
        (d / "model").unlink(missing_ok=True)
        return sig

    monkeypatch.setattr(watch, "_signature", rotated_meanwhile)
    try:
        assert w.poll() == 0
        monkeypatch.setattr(watch, "_signature", real)
        (d / "model").write_bytes(b"new")
        w.poll()
        assert _flush(w) == [1]
    finally:
        w.close()
    assert [e["event"] for e in events if e["event"] == "queued"] == ["queued"]


def test_watch_once_through_the_cli_on_gcs(tmp_path, gcs_target):
    from click.testing import CliRunner

    from cloudckpt.cli import cli

    out = tmp_path / "out"
    (out / "checkpoint-7").mkdir(parents=True)
    (out / "checkpoint-7" / "model.safetensors").write_bytes(b"m" * 100_000)
    (out / "checkpoint-7" / "trainer_state.json").write_text('{"global_step": 7}')
    (out / "checkpoint-8").mkdir()  # being written: no trainer_state.json yet
    (out / "checkpoint-8" / "model.safetensors").write_bytes(b"partial")
    so = gcs_target.storage_options
    argv = ["watch", str(out), gcs_target.url, "--once", "--settle", "0.2", "--json",
            "--endpoint-url", so["endpoint_url"], "-o", "token=anon", "-o", "project=test"]  # fmt: skip
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["started", "queued"] and kinds[-1] == "stopped"
    assert sorted(kinds[2:-1]) == ["committed", "flushing"]  # in either order
    (done,) = [e for e in events if e["event"] == "committed"]
    assert done["source"] == "checkpoint-7" and events[-1]["committed_step"] == 7
    store = open_store(gcs_target.url, so)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert [r.step for r in latest.retained()] == [7]
    # Again: nothing new is finished, so nothing is uploaded and LATEST is not even touched.
    again = CliRunner().invoke(cli, argv)
    assert again.exit_code == 0 and '"queued"' not in again.stdout
    assert store.get(protocol.LATEST_KEY)[0] == latest.to_bytes()
    store.close()


def test_watch_once_exits_non_zero_when_an_upload_fails(tmp_path, memory_target, monkeypatch):
    """--once has no later poll to retry in: a failed upload is final, and the exit status
    says so (it used to be reported as "will retry" and the watcher exited 0)."""
    from click.testing import CliRunner

    from cloudckpt import manager
    from cloudckpt.cli import cli
    from cloudckpt.errors import PermissionDeniedError
    from cloudckpt.testing.faults import WRITE_OPS, FailBefore, FaultInjectingStore, Rule

    rules: list[Rule] = []
    real_open = manager.open_store

    def refusing(*args, **kwargs):
        store = FaultInjectingStore(real_open(*args, **kwargs))
        deny = Rule(FailBefore(PermissionDeniedError), ops=WRITE_OPS, key="ckpt/*", times=None)
        rules.append(store.add(deny))
        return store

    monkeypatch.setattr(manager, "open_store", refusing)
    out = tmp_path / "out"
    (out / "checkpoint-7").mkdir(parents=True)
    (out / "checkpoint-7" / "trainer_state.json").write_text('{"global_step": 7}')
    argv = ["watch", str(out), memory_target.url, "--once", "--settle", "0.2", "--json",
            "--staging-dir", str(tmp_path / "staging")]  # fmt: skip
    result = CliRunner().invoke(cli, argv)
    assert sum(r.fired for r in rules) > 0
    assert result.exit_code == 1, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["source"] for e in events if e["event"] == "failed"] == ["checkpoint-7"]
    assert events[-1]["event"] == "stopped" and events[-1]["failed"] == 1
    assert "could not be uploaded" in result.stderr
