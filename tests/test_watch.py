"""``cloudckpt watch``: a real trainer-like writer process, a real watcher process, moto;
and the real Hugging Face Trainer, Lightning and accelerate (tiny models) beside a watcher.

The writer imitates what trainers do on disk: Hugging Face ``Trainer`` writes the model,
optimizer, scheduler and RNG state into ``checkpoint-N/``, ``trainer_state.json`` last, then
deletes the oldest checkpoints beyond ``save_total_limit``; Lightning writes
``epoch=E-step=S.ckpt`` zip archives (``torch.save``'s format), here in place (as a copy
across filesystems does).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from cli_schema import assert_matches, parse

from cloudckpt import attempt_layout, protocol
from cloudckpt.stores import open_store
from cloudckpt.watch import Watcher

SCHEMAS = parse()  # docs/cli.md's blocks: every event a test sees must match its own

WRITER = r"""
import json, os, random, shutil, sys, time, zipfile
out, kind, steps, hang_at, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
events = open(sys.argv[6], "a", buffering=1)
keep, interval = int(sys.argv[7]), float(sys.argv[8])  # save_total_limit (0: none); seconds

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
        if keep:  # then the Trainer rotates: the oldest beyond save_total_limit go
            saved = sorted((e for e in os.listdir(out) if e.startswith("checkpoint-")),
                           key=lambda e: int(e.split("-")[1]))
            for old in saved[:-keep]:
                shutil.rmtree(os.path.join(out, old))
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
    time.sleep(interval)
"""


def flags(t) -> list[str]:
    so = t.storage_options
    return [
        "--endpoint-url", so["endpoint_url"], "--region", "us-east-1",
        "-o", f"key={so['key']}", "-o", f"secret={so['secret']}",
    ]  # fmt: skip


class Proc:
    """A subprocess whose stdout goes to a file we can poll (never a pipe to drain)."""

    def __init__(self, argv, out: Path, events: Path | None = None, env: dict | None = None):
        self.out = out
        self.events = events
        self._log = open(out, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT if events is None else open(str(out) + ".err", "wb"),  # noqa: SIM115
            stdin=subprocess.DEVNULL,
            env={**os.environ, "AWS_EC2_METADATA_DISABLED": "true", **(env or {})},
        )

    checked = False  # a `watch --json`: each event must match its block in docs/cli.md

    def lines(self) -> list[dict]:
        path = self.events or self.out
        found = []
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):  # a line still being written
                    found.append(json.loads(line))
        if self.checked:
            for event in found:
                assert_matches(event, "watch", SCHEMAS)
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


def start_writer(
    area, kind, steps, *, hang_at=-1, size=256 * 1024, keep=0, interval=0.0, name="writer"
):
    out, script, tmp = area
    events = tmp / f"{name}.events"
    events.touch()
    argv = [sys.executable, str(script), str(out), kind, ",".join(map(str, steps)),
            str(hang_at), str(size), str(events), str(keep), str(interval)]  # fmt: skip
    return Proc(argv, tmp / f"{name}.log", events)


def start_watch(area, target, *extra, name="watch", directory=None, python=(), env=None):
    """``cloudckpt watch`` with its default rules, looking every 0.1 s (``python``: argv
    that replaces ``-m cloudckpt.cli``, e.g. a wrapper script)."""
    out, _, tmp = area
    argv = [sys.executable, *(python or ["-m", "cloudckpt.cli"]), "watch",
            str(directory or out), target.url, "--json", "--poll", "0.1", *extra,
            *flags(target)]  # fmt: skip
    watch = Proc(argv, tmp / f"{name}.out", env=env)
    watch.checked = True  # its --json lines are checked against docs/cli.md
    return watch


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
    watch = start_watch(area, s3_target, "--quiet-period", "1s")
    partial = "checkpoint-3" if kind == "hf" else "epoch=0-step=3.ckpt"
    try:
        writer = start_writer(area, kind, [1, 2, 3], hang_at=3)
        writer.wait_for(lambda e: e == {"event": "half", "step": 3}, "the writer to hang")
        writer.stop(signal.SIGKILL)  # killed half-way through checkpoint 3
        watch.wait_for(committed(watch, 2), "step 2 to be committed")
        # Quiet for the quiet period: reported once as incomplete, and still not taken.
        watch.wait_for(
            lambda e: e.get("event") == "incomplete" and e["source"] == partial, "the report"
        )
        # Training restarts (a new process) and writes the next checkpoint.
        writer2 = start_writer(area, kind, [4], name="writer2")
        watch.wait_for(committed(watch, 4), "step 4 to be committed")
        writer2.stop()
    finally:
        rc = watch.stop()
    assert rc == 0, watch.log()
    events = watch.lines()
    assert [e["event"] for e in events if e.get("source") == partial] == ["incomplete"]
    sources = every_committed_source(store)
    assert partial not in sources and len(sources) == 3
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert [r.step for r in latest.retained()] == [4, 2, 1]
    assert not list(store.list(attempt_layout.ckpt_prefix(3, 1, "x")[: len("ckpt/000000000003")]))
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
    done = next(e for e in again.lines() if e["event"] == "committed")
    assert done["bytes_uploaded"] + done["bytes_reused"] == done["bytes"] > 32 * 1024 * 1024
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert latest.current.step == 40
    assert latest.current.metadata["watch"] == {"source": "checkpoint-40", "kind": "hf"}
    # Exactly one new attempt prefix: nothing of 10-30 was uploaded again.
    prefixes = {o.key.split("/")[1] for o in store.list("ckpt/")}
    old = {k.split("/")[1] for k in before if k.startswith("ckpt/")}
    assert len(prefixes - old) == 1
    store.close()


def first_look_done(watch: Proc, area) -> None:
    """Wait until the watcher has looked at the directory once: it reports the loose file
    ``notes.txt`` (put there before it started) as not uploaded."""
    watch.wait_for(
        lambda e: e.get("event") == "ignored" and e["source"] == "." and "notes.txt" in e["files"],
        "the watcher's first look",
    )


def test_a_trainer_saving_often_gets_every_checkpoint_uploaded(area, s3_target):
    """A trainer that saves every second and keeps only the last two checkpoints (HF's
    save_total_limit=2): each one lives two seconds. With the default rules each is
    committed as soon as trainer_state.json is written (a 30 s quiet period, the old rule,
    committed none of them before they were deleted)."""
    out, _, _ = area
    (out / "notes.txt").write_text("not a checkpoint")
    store = open_store(s3_target.url, s3_target.storage_options)
    steps = [1, 2, 3, 4, 5, 6]
    watch = start_watch(area, s3_target)
    try:
        first_look_done(watch, area)
        writer = start_writer(area, "hf", steps, keep=2, interval=1.0)
        for step in steps:
            watch.wait_for(committed(watch, step), f"step {step} to be committed")
        writer.stop()
    finally:
        rc = watch.stop()
    assert rc == 0, watch.log()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-5", "checkpoint-6", "notes.txt"]
    assert every_committed_source(store) == {f"checkpoint-{s}" for s in steps}
    queued = [e for e in watch.lines() if e["event"] == "queued"]
    assert {e["rule"] for e in queued} == {"trainer_state.json written (the Trainer's last file)"}
    store.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_uploads_the_complete_checkpoint_before_exiting(area, s3_target, sig):
    """The usual end of a job: the trainer wrote its last checkpoints, the orchestrator sends
    SIGTERM (or a user Ctrl-C) before the watcher's next look. The final upload takes them:
    committed before the exit, exit 0. The trainer also stopped half-way through another
    one: that is said (incomplete), and it is not uploaded."""
    out, _, _ = area
    (out / "notes.txt").write_text("not a checkpoint")
    store = open_store(s3_target.url, s3_target.storage_options)
    watch = start_watch(area, s3_target, "--poll", "1h")  # it looks once, then only at exit
    writer = None
    try:
        first_look_done(watch, area)
        writer = start_writer(area, "hf", [7, 8, 9], hang_at=9)
        writer.wait_for(lambda e: e == {"event": "half", "step": 9}, "the writer to stop")
        assert not [e for e in watch.lines() if e["event"] == "queued"]
    finally:
        rc = watch.stop(sig)
        if writer is not None:
            writer.stop(signal.SIGKILL)
    assert rc == 0, watch.log()
    events = watch.lines()
    (partial,) = [e for e in events if e.get("source") == "checkpoint-9"]
    assert partial["event"] == "incomplete"
    assert partial["reason"].startswith("no trainer_state.json yet (Trainer writes it last)")
    kinds = [e["event"] for e in events]
    assert kinds.index("flushing") < kinds.index("queued") < kinds.index("committed")
    assert [e["step"] for e in events if e["event"] == "committed"] == [7, 8]
    assert events[-1] == {"event": "stopped", "committed": 2, "failed": 0, "not_uploaded": 0,
                          "committed_step": 8}  # fmt: skip
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert latest.current.step == 8
    assert latest.current.metadata["watch"] == {"source": "checkpoint-8", "kind": "hf"}
    assert "did not finish" not in watch.log()  # the exit watchdog had nothing to do
    store.close()


STUCK_WATCH = r"""
import sys, threading
from pathlib import Path
import cloudckpt.stores
from cloudckpt.testing.faults import Callback, FaultInjectingStore, Rule

gate = Path(sys.argv.pop(1))
real_open = cloudckpt.stores.open_store

def stuck_open(*args, **kwargs):  # every upload into the run hangs, forever
    store = FaultInjectingStore(real_open(*args, **kwargs))
    def hang():
        gate.touch()
        threading.Event().wait()
    store.add(Rule(Callback(before=hang), ops={"put", "create_multipart"}, key="ckpt/*",
                   times=None))
    return store

cloudckpt.stores.open_store = stuck_open
from cloudckpt.cli import main
main()
"""


def test_a_checkpoint_that_does_not_fit_the_budget_stays_on_disk_and_is_reported(area, s3_target):
    """The store never finishes the upload: after --final-upload-timeout the watcher exits
    1 (not the watchdog's 130), naming the checkpoint and where its files are; nothing is
    committed and its own staging directory is removed (the files are in the output
    directory)."""
    out, _, tmp = area
    (out / "notes.txt").write_text("not a checkpoint")
    script, gate, scratch = tmp / "stuck_watch.py", tmp / "gate-hit", tmp / "scratch"
    script.write_text(STUCK_WATCH)
    scratch.mkdir()
    watch = start_watch(area, s3_target, "--poll", "1h", "--final-upload-timeout", "1s",
                        python=[str(script), str(gate)], env={"TMPDIR": str(scratch)})  # fmt: skip
    try:
        first_look_done(watch, area)
        assert any(p.name.startswith("cloudckpt-watch-") for p in scratch.iterdir())
        writer = start_writer(area, "hf", [5])
        writer.wait_for(lambda e: e == {"event": "done", "step": 5}, "the writer to finish")
    finally:
        rc = watch.stop()
    assert rc == 1, watch.log()
    assert gate.exists(), "the upload never reached the store"
    events = watch.lines()
    (left,) = [e for e in events if e["event"] == "not_uploaded"]
    assert left["source"] == "checkpoint-5" and left["step"] == 5
    assert left["path"] == str(out / "checkpoint-5")
    assert "did not finish within the 1s budget" in left["reason"]
    assert events[-1]["event"] == "stopped" and events[-1]["not_uploaded"] == 1
    log = watch.log()
    assert f"checkpoint-5 in {out / 'checkpoint-5'}" in log
    assert "did not finish within" in log and "exiting now" not in log  # not the watchdog
    assert (out / "checkpoint-5" / "trainer_state.json").exists()
    assert list(scratch.iterdir()) == []
    store = open_store(s3_target.url, s3_target.storage_options)
    latest = store.get(protocol.LATEST_KEY)[0] if store.exists(protocol.LATEST_KEY) else None
    assert latest is None or protocol.parse_latest(latest).current is None
    store.close()


def test_watch_waits_for_an_output_directory_that_does_not_exist_yet(area, s3_target):
    _, script, tmp = area
    later = tmp / "not-yet" / "output"
    watch = start_watch(area, s3_target, directory=later)
    try:
        watch.wait_for(lambda e: e.get("event") == "waiting", "the watcher to wait")
        assert watch.proc.poll() is None
        writer = start_writer((later, script, tmp), "hf", [3])  # creates the directories
        watch.wait_for(committed(watch, 3), "step 3 to be committed")
        writer.stop()
    finally:
        rc = watch.stop()
    assert rc == 0, watch.log()
    kinds = [e["event"] for e in watch.lines()]
    assert kinds[:3] == ["started", "waiting", "appeared"] and kinds.count("waiting") == 1


# --- the real frameworks: the watcher looks once, the trainer runs, SIGTERM ----------------

SCRIPTS = Path(__file__).parent / "scripts"
REAL = {
    # framework: (script and its arguments given the watched directory, events file; the
    # checkpoints left on disk at the end with their steps; the rule that took them)
    "hf": (
        lambda d, ev: ["hf_train.py", "--output-dir", d, "--events", ev, "--no-callback"],
        # save_steps=3, save_total_limit=2, best model kept: 6 and 9 are rotated away
        {"checkpoint-3": 3, "checkpoint-12": 12},
        {"checkpoint-3": "trainer_state.json written (the Trainer's last file)",
         "checkpoint-12": "trainer_state.json written (the Trainer's last file)"},
    ),
    "lightning": (
        lambda d, ev: ["lightning_train.py", "--root", d, "--events", ev, "--no-cloud",
                       "--max-epochs", "3"],
        # save_top_k=1, save_last="link": last.ckpt is a link to the one checkpoint
        {"checkpoints/epoch=2-step=12.ckpt": 12},
        {"checkpoints/epoch=2-step=12.ckpt":
            "a complete torch.save archive (Lightning writes by rename)"},
    ),
    "accelerate": (
        lambda d, ev: ["accelerate_train.py", "--project-dir", d, "--events", ev],
        # three saves, total_limit=2: checkpoint_0 is rotated away; N is the step
        {"checkpoints/checkpoint_1": 1, "checkpoints/checkpoint_2": 2},
        {"checkpoints/checkpoint_1":
            "checkpoint_2 begun (accelerate's next save starts after all finished)",
         "checkpoints/checkpoint_2": "random_states_*.pkl written, unchanged for 2s"},
    ),
}  # fmt: skip


def _files(root: Path) -> dict[str, bytes]:
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("framework", sorted(REAL))
def test_the_real_frameworks_last_checkpoints_are_uploaded_on_sigterm(
    area, s3_target, tmp_path, framework
):
    """The real Trainer / Lightning / accelerate (tiny models, CPU) write into a directory
    that does not exist when the watcher starts; the watcher looks once (it waits for the
    directory), then only when SIGTERM comes after training: it takes every checkpoint left
    on disk by the framework's own completion rule, commits them in step order and exits
    0. Each restores byte for byte."""
    argv, expected, rules = REAL[framework]
    out = tmp_path / f"{framework}-out"
    watch = start_watch(area, s3_target, "--poll", "1h", directory=out)
    try:
        watch.wait_for(lambda e: e.get("event") == "waiting", "the watcher's first look")
        script, *args = argv(str(out), str(tmp_path / "train.events"))
        trainer = Proc(
            [sys.executable, str(SCRIPTS / script), *args],
            tmp_path / "train.log",
            env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        )
        assert trainer.proc.wait(timeout=300) == 0, trainer.log()
        assert not [e for e in watch.lines() if e["event"] == "queued"]
    finally:
        rc = watch.stop()
    assert rc == 0, watch.log()
    events = watch.lines()
    queued = {e["source"]: e for e in events if e["event"] == "queued"}
    assert {src: e["step"] for src, e in queued.items()} == expected
    assert {src: e["rule"] for src, e in queued.items()} == rules
    assert [e["step"] for e in events if e["event"] == "committed"] == sorted(expected.values())
    store = open_store(s3_target.url, s3_target.storage_options)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert latest.current.step == max(expected.values())
    store.close()
    from cloudckpt import CheckpointManager

    with CheckpointManager(s3_target.url, storage_options=s3_target.storage_options) as mgr:
        for source, step in expected.items():
            dest = tmp_path / "restored" / str(step)
            mgr.restore(dest, step=step)
            assert _files(dest) == _files(out / source)


# --- the completeness rules, in-process on the memory store (fast) ------------------------


class CheckedEvents(list):
    """A Watcher's events, each checked against its block in docs/cli.md as it arrives."""

    def append(self, event: dict) -> None:
        assert_matches(event, "watch", SCHEMAS)
        super().append(event)


def _watcher(tmp_path, target, **kw):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    events: list[dict] = CheckedEvents()
    kw.setdefault("settle", 0)
    w = Watcher(out, target.url, on_event=events.append, staging_dir=tmp_path / "staging",
                **kw)  # fmt: skip
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
    w, out, _ = _watcher(tmp_path, memory_target, accept_quiet_dirs=True, quiet_period=0)
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
    for event in events:
        assert_matches(event, "watch", SCHEMAS)
    kinds = [e["event"] for e in events]
    assert kinds == ["started", "flushing", "queued", "committed", "incomplete", "stopped"]
    assert events[4]["source"] == "checkpoint-8" and events[4]["reason"] == (
        "no trainer_state.json yet (Trainer writes it last); still incomplete when the "
        "watcher stopped"
    )
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


def _zip(path: Path, payload: bytes = b"x" * 100) -> bytes:
    """A torch.save-like zip archive at ``path``; returns its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", payload)
    return path.read_bytes()


def _settled(w: Watcher, settle: float) -> int:
    """Poll until a checkpoint that waits out ``settle`` is handed over; return the polls."""
    for polls in range(1, 1000):
        if w.poll():
            return polls
        time.sleep(settle / 4)
    raise AssertionError("never handed over")


def test_accelerate_layout_step_and_completion(tmp_path, memory_target):
    """accelerate's checkpoints/checkpoint_N: N is the step; complete once the next save
    began, or once random_states_0.pkl (its last RNG file) is a complete zip, every rank's
    is there and the files stayed unchanged for settle (custom_checkpoint_K.pkl follows)."""
    w, out, events = _watcher(tmp_path, memory_target, settle=0.2)
    base = out / "checkpoints"
    try:
        c0 = base / "checkpoint_0"
        (c0 / "model.safetensors").parent.mkdir(parents=True)
        (c0 / "model.safetensors").write_bytes(b"w" * 100)
        data = _zip(c0 / "random_states_0.pkl")
        (c0 / "random_states_0.pkl").write_bytes(data[:-10])  # its zip directory not yet
        _zip(c0 / "random_states_1.pkl")
        _zip(c0 / "random_states_3.pkl")  # rank 2 has not written its file yet
        assert w.poll() == 0
        (c0 / "random_states_0.pkl").write_bytes(data)
        assert w.poll() == 0  # still rank 2
        _zip(c0 / "random_states_2.pkl")
        assert w.poll() == 0  # now complete but settling: nothing is taken at first sight
        assert [c.source for c, _ in w._settling] == ["checkpoints/checkpoint_0"]
        assert _settled(w, 0.2) >= 1 and _flush(w) == [0]

        c1 = base / "checkpoint_1"  # no RNG file yet, but the next save has begun
        c1.mkdir()
        (c1 / "model.safetensors").write_bytes(b"v" * 100)
        (base / "checkpoint_2").mkdir()
        assert w.poll() == 1 and _flush(w) == [0, 1]
    finally:
        w.close()
    queued = [(e["source"], e["step"], e["kind"], e["rule"]) for e in events
              if e["event"] == "queued"]  # fmt: skip
    assert queued == [
        ("checkpoints/checkpoint_0", 0, "accelerate",
         "random_states_*.pkl written, unchanged for 0.2s"),
        ("checkpoints/checkpoint_1", 1, "accelerate",
         "checkpoint_2 begun (accelerate's next save starts after all finished)"),
    ]  # fmt: skip


def test_hf_with_several_ranks_waits_for_every_rank_and_settles(tmp_path, memory_target):
    """Each rank writes its own rng_state_K.pth, with no barrier after trainer_state.json:
    a missing rank (K below the highest seen) holds the checkpoint back, and all present it
    still has to stay unchanged for settle. One process (rng_state.pth) is taken at once."""
    w, out, events = _watcher(tmp_path, memory_target, settle=0.2)
    try:
        d = out / "checkpoint-4"
        d.mkdir()
        for name in ("model.safetensors", "rng_state_0.pth", "rng_state_2.pth"):
            (d / name).write_bytes(b"x")
        (d / "trainer_state.json").write_text('{"global_step": 4}')
        assert w.poll() == 0 and not w._settling  # rank 1 missing: not complete
        (d / "rng_state_1.pth").write_bytes(b"x")
        assert w.poll() == 0 and [c.source for c, _ in w._settling] == ["checkpoint-4"]
        _settled(w, 0.2)
        single = out / "checkpoint-5"
        single.mkdir()
        (single / "rng_state.pth").write_bytes(b"x")
        (single / "trainer_state.json").write_text('{"global_step": 5}')
        assert w.poll() == 1  # at first sight
        assert _flush(w) == [4, 5]
    finally:
        w.close()
    rules = [e["rule"] for e in events if e["event"] == "queued"]
    assert rules == [
        "trainer_state.json written, 3 ranks' rng_state files, unchanged for 0.2s",
        "trainer_state.json written (the Trainer's last file)",
    ]


def test_lightning_sharded_checkpoint_needs_meta_pt(tmp_path, memory_target):
    """Lightning's FSDP strategy writes the shards and .metadata, then rank 0 meta.pt: a
    directory with .metadata alone is not complete."""
    w, out, _ = _watcher(tmp_path, memory_target)
    try:
        d = out / "epoch=0-step=6.ckpt"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"shard")
        (d / ".metadata").write_bytes(b"dcp metadata")
        assert w.poll() == 0
        meta = _zip(d / "meta.pt")
        (d / "meta.pt").write_bytes(meta[:-5])  # being written
        assert w.poll() == 0
        (d / "meta.pt").write_bytes(meta)
        assert w.poll() == 1 and _flush(w) == [6]
    finally:
        w.close()


def test_files_of_no_checkpoint_are_reported_once(tmp_path, memory_target):
    """Whatever the watcher will not upload it says, once per directory: the trainer's loose
    files, log directories, a layout it does not know (here a directory without marker)."""
    w, out, events = _watcher(tmp_path, memory_target)
    try:
        (out / "config.json").write_text("{}")
        (out / "runs" / "Dec04").mkdir(parents=True)
        (out / "runs" / "Dec04" / "events.out.tfevents").write_bytes(b"e")
        (out / "ckpts" / "step_100").mkdir(parents=True)
        (out / "ckpts" / "step_100" / "weights.bin").write_bytes(b"w")
        (out / "checkpoints").mkdir()
        (out / "checkpoints" / "last.ckpt").symlink_to("nowhere.ckpt")
        (out / "tmp-checkpoint-9").mkdir()  # being written (a temporary name): not reported
        (out / "tmp-checkpoint-9" / "x").write_bytes(b"x")
        w.poll()
        (out / "ckpts" / "step_100" / "more.bin").write_bytes(b"m")
        w.poll()
    finally:
        w.close()
    ignored = {e["source"]: e["files"] for e in events if e["event"] == "ignored"}
    assert ignored == {
        ".": ["config.json"],
        "runs/Dec04": ["events.out.tfevents"],
        "ckpts/step_100": ["weights.bin"],
        "checkpoints": ["last.ckpt"],
    }
    assert len([e for e in events if e["event"] == "ignored"]) == 4


def test_a_checkpoint_rotated_away_while_being_snapshotted_is_reported(
    tmp_path, memory_target, monkeypatch
):
    """The trainer deletes an old checkpoint (rotation) just as it is hard-linked: the
    partial snapshot is dropped and the watcher says what happened."""
    from cloudckpt import watch

    w, out, events = _watcher(tmp_path, memory_target)
    d = out / "checkpoint-1"
    d.mkdir()
    (d / "rng_state.pth").write_bytes(b"r")
    (d / "trainer_state.json").write_text("{}")
    real = watch._link_snapshot
    calls = []

    def rotated_meanwhile(c, sig, staging):  # judged complete; the trainer deletes it now
        calls.append(c.source)
        shutil.rmtree(d)
        return real(c, sig, staging)

    monkeypatch.setattr(watch, "_link_snapshot", rotated_meanwhile)
    try:
        assert w.poll() == 0 and calls == ["checkpoint-1"]
    finally:
        w.close()
    (skip,) = [e for e in events if e["event"] == "skipped"]
    assert skip["source"] == "checkpoint-1"
    assert skip["reason"].startswith("deleted by its writer (rotation?) while being copied")
    assert not [e for e in events if e["event"] == "queued"]
    assert not list((tmp_path / "staging").rglob("trainer_state.json"))


def test_a_checkpoint_losing_files_is_not_taken_from_that_listing(tmp_path, memory_target):
    """Files gone since the previous look (a rotation's rmtree half-way, say) while the
    completion marker is still there: not taken from that listing."""
    w, out, _ = _watcher(tmp_path, memory_target)
    try:
        d = out / "checkpoint-3"
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"a")
        (d / "optimizer.pt").write_bytes(b"b")
        assert w.poll() == 0  # no trainer_state.json yet
        (d / "optimizer.pt").unlink()
        (d / "rng_state.pth").write_bytes(b"r")
        (d / "trainer_state.json").write_text("{}")
        assert w.poll() == 0  # looks complete, but optimizer.pt vanished since the last look
        assert w.poll() == 1  # the same listing twice: taken
        assert _flush(w) == [3]
    finally:
        w.close()


def test_watch_once_exits_non_zero_when_an_upload_fails(tmp_path, memory_target, monkeypatch):
    """--once has no later poll to retry in: a failed upload is final, and the exit status
    says so (it used to be reported as "will retry" and the watcher exited 0)."""
    from click.testing import CliRunner

    from cloudckpt import stores
    from cloudckpt.cli import cli
    from cloudckpt.errors import PermissionDeniedError
    from cloudckpt.testing.faults import WRITE_OPS, FailBefore, FaultInjectingStore, Rule

    rules: list[Rule] = []
    real_open = stores.open_store

    def refusing(*args, **kwargs):
        store = FaultInjectingStore(real_open(*args, **kwargs))
        deny = Rule(FailBefore(PermissionDeniedError), ops=WRITE_OPS, key="ckpt/*", times=None)
        rules.append(store.add(deny))
        return store

    monkeypatch.setattr(stores, "open_store", refusing)
    out = tmp_path / "out"
    (out / "checkpoint-7").mkdir(parents=True)
    (out / "checkpoint-7" / "trainer_state.json").write_text('{"global_step": 7}')
    argv = ["watch", str(out), memory_target.url, "--once", "--settle", "0.2", "--json",
            "--staging-dir", str(tmp_path / "staging")]  # fmt: skip
    result = CliRunner().invoke(cli, argv)
    assert sum(r.fired for r in rules) > 0
    assert result.exit_code == 1, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    for event in events:
        assert_matches(event, "watch", SCHEMAS)
    assert [e["source"] for e in events if e["event"] == "failed"] == ["checkpoint-7"]
    assert events[-1]["event"] == "stopped" and events[-1]["failed"] == 1
    assert "could not be uploaded" in result.stderr


def test_deepspeed_steps_are_taken_once_latest_names_them(tmp_path, memory_target):
    """DeepSpeed's save_dir (files named as engine.save_checkpoint names them): a
    global_stepN/ is taken only once ``latest`` names it, with every rank's ZeRO shard
    present and settled (rank 0 writes ``latest`` with no barrier after the other ranks);
    the checkpoint holds global_stepN/ and a ``latest`` naming it, as DeepSpeed loads it."""
    w, out, events = _watcher(tmp_path, memory_target, settle=0.2)

    def shards(d: Path, *ranks: int) -> None:
        for r in ranks:
            _zip(d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")

    try:
        d2 = out / "global_step2"
        _zip(d2 / "mp_rank_00_model_states.pt")
        shards(d2, 0, 1, 2)
        (out / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")
        assert w.poll() == 0 and not w._settling  # every file there, but no `latest` yet
        (out / "latest").write_text("global_step1")  # the previous save's
        assert w.poll() == 0 and not w._settling
        (out / "latest").write_text("global_step2")
        assert w.poll() == 0 and [c.source for c, _ in w._settling] == ["global_step2"]
        _settled(w, 0.2)
        assert _flush(w) == [2]

        d4 = out / "global_step4"
        model = _zip(d4 / "mp_rank_00_model_states.pt", b"y" * 100)
        shards(d4, 0, 2)
        (out / "latest").write_text("global_step4")
        assert w.poll() == 0 and not w._settling  # rank 1's shard is missing
        shards(d4, 1)
        assert w.poll() == 0 and [c.source for c, _ in w._settling] == ["global_step4"]
        _settled(w, 0.2)
        assert _flush(w) == [2, 4]
        restored = w.manager.restore(tmp_path / "restored")
    finally:
        w.close()
    files = _files(restored.path)
    assert files["latest"] == b"global_step4"
    assert files["global_step4/mp_rank_00_model_states.pt"] == model
    assert sorted(files) == [
        "global_step4/mp_rank_00_model_states.pt",
        *(f"global_step4/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)),
        "latest",
    ]
    assert not [e for e in events if e["event"] == "ignored"]  # latest, zero_to_fp32.py
    rules = [e["rule"] for e in events if e["event"] == "queued"]
    assert rules == ["`latest` names it, 3 ranks' ZeRO shards, unchanged for 0.2s"] * 2
