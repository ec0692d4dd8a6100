"""Lightning Trainer + CloudCheckpointIO against the moto S3 server, in child processes.

A tiny LightningModule (MLP with dropout, AdamW, a per-step StepLR) trains on synthetic
data in a child process (tests/scripts/lightning_train.py), checkpointing at every epoch
end. One run is SIGKILLed while a later checkpoint is uploading and resumed on a "new host"
(a fresh directory) from the store; its losses must equal an uninterrupted run's. Another
run gets SIGTERM mid-epoch and must commit an emergency checkpoint and exit with status 0.

Why exact equality holds: same seeds, ``deterministic=True``, one CPU thread, no workers, a
seeded ``DistributedSampler`` (one replica) whose order depends only on the epoch, and
``RNGStateCallback`` restoring the RNG (dropout is on) at the epoch boundary the checkpoint
was taken at. The resumed run repeats the same float operations in the same order.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from childrun import ChildRun, read_events

from cloudckpt.reader import load_latest_for_reading
from cloudckpt.stores import open_store

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "lightning_train.py"
MAX_EPOCHS, STEPS_PER_EPOCH = 6, 4


def _bucket(moto_server, name: str) -> tuple[str, dict[str, Any]]:
    moto_server.create_bucket(name)
    return f"s3://{name}/run", moto_server.storage_options()


def _latest(url: str, options: dict[str, Any]):
    store = open_store(url, options)
    try:
        latest, _ = load_latest_for_reading(store)
        return latest
    finally:
        store.close()


def _start(tmp: Path, name: str, *args: str, options=None) -> ChildRun:
    return ChildRun(
        SCRIPT,
        ["--root", str(tmp / name), *args],
        events=tmp / f"{name}.jsonl",
        log=tmp / f"{name}.log",
        storage_options=options,
    )


@pytest.fixture(scope="module")
def runs(moto_server, tmp_path_factory):
    """Three children start at once (importing lightning takes most of the time): the run
    to be killed; the run that will resume it, which waits after its imports until the test
    says go; and one that first trains the uninterrupted reference run, then the run that
    gets SIGTERM."""
    tmp = tmp_path_factory.mktemp("lightning")
    kill_url, kill_options = _bucket(moto_server, "pl-kill")
    preempt_url, preempt_options = _bucket(moto_server, "pl-preempt")
    epochs = f"--max-epochs={MAX_EPOCHS}"
    started = {
        "killed": _start(
            tmp,
            "killed",
            f"--url={kill_url}",
            epochs,
            "--upload-latency=0.4",  # slow uploads: a later checkpoint is in flight at the kill
            options=kill_options,
        ),
        "resumed": _start(
            tmp,
            "resumed",
            f"--url={kill_url}",
            epochs,
            "--resume",
            f"--wait-for={tmp / 'go'}",
            options=kill_options,
        ),
        "preempted": _start(
            tmp,
            "preempted",
            f"--reference-first={tmp / 'reference.jsonl'}",  # 6 epochs without cloudckpt
            f"--url={preempt_url}",
            "--max-epochs=200",
            options=preempt_options,
        ),
    }
    preempted = started["preempted"]
    # SIGTERM mid-epoch (step 6 of 4-step epochs), from a thread.
    preempted.signal_when(
        lambda: any(e["step"] >= 6 for e in preempted.events("loss")), signal.SIGTERM, 400
    )
    yield {
        **started,
        "tmp": tmp,
        "kill_url": (kill_url, kill_options),
        "preempt_url": (preempt_url, preempt_options),
    }
    for run in started.values():
        run.kill()


def test_sigkill_then_resume_in_a_fresh_dir_matches_an_uninterrupted_run(runs):
    url, options = runs["kill_url"]
    killed, resumed, tmp = runs["killed"], runs["resumed"], runs["tmp"]

    def committed_and_one_in_flight() -> bool:
        latest = _latest(url, options)
        saved = [e["step"] for e in killed.events("saved")]
        return bool(latest and latest.current and saved) and max(saved) > latest.current.step

    killed.wait_until(committed_and_one_in_flight, 240, "a commit with a later save in flight")
    killed.kill()
    killed.wait(10)
    current = _latest(url, options).current
    assert max(e["step"] for e in killed.events("saved")) > current.step
    assert current.step % STEPS_PER_EPOCH == 0
    assert current.metadata["filename"] == f"epoch={current.step // 4 - 1}-step={current.step}.ckpt"

    (tmp / "go").touch()  # the new host resumes from the store into a fresh directory
    assert resumed.wait(300) == 0, resumed.log_tail()
    new_dir = tmp / "resumed" / "checkpoints"
    assert resumed.events("resumed")[0]["path"] == str(new_dir / current.metadata["filename"])
    assert resumed.events("train_start")[0]["global_step"] == current.step

    reference = tmp / "reference.jsonl"
    runs["preempted"].wait_until(
        lambda: read_events(reference, "end"), 300, "the end of the reference run"
    )
    expected = {e["step"]: (e["loss"], e["lr"]) for e in read_events(reference, "loss")}
    got = {e["step"]: (e["loss"], e["lr"]) for e in resumed.events("loss")}
    total = MAX_EPOCHS * STEPS_PER_EPOCH
    assert sorted(got) == list(range(current.step, total))
    assert got == {step: expected[step] for step in got}  # bitwise-equal losses and lrs

    latest = _latest(url, options)
    assert latest.current.step == total
    # ModelCheckpoint(save_top_k=1) removed older local files; the store kept keep_last=3.
    local = sorted(p.name for p in new_dir.glob("*.ckpt"))
    assert f"epoch={MAX_EPOCHS - 1}-step={total}.ckpt" in local and "last.ckpt" in local
    assert len(latest.retained()) == 3


def test_sigterm_mid_epoch_commits_an_emergency_checkpoint_and_exits_zero(runs):
    run = runs["preempted"]
    url, options = runs["preempt_url"]
    assert run.wait(300) == 0, run.log_tail()
    end = run.events("end")[0]
    assert end["preempted"] is True
    assert 6 <= end["global_step"] < 800
    latest = _latest(url, options)
    assert latest.current.step == end["global_step"]
    emergency = [r for r in latest.retained() if r.metadata["filename"].startswith("preempted-")]
    assert [r.step for r in emergency] == [end["global_step"]]
    assert "preemption notice (signal): received SIGTERM" in run.log_tail(100_000)


def test_save_top_k_best_checkpoints_stay_in_the_store_across_a_kill_and_a_fresh_host(
    moto_server, tmp_path
):
    """ModelCheckpoint(monitor="val_loss", save_top_k=2) locally, keep_last=1 + keep_best=2
    by val_loss in the store. The run is killed after epoch 2's commit and resumed on a
    fresh directory, where Lightning forgets its top k (another dirpath) and saves worse
    checkpoints as its new "best": the store still keeps the true best two (epochs 2 and
    0), each recorded with its score, and a fresh host loads the old best_model_path from
    the store."""
    from cloudckpt.integrations.lightning import CloudCheckpointIO

    url, options = _bucket(moto_server, "pl-best")
    common = (f"--url={url}", f"--max-epochs={MAX_EPOCHS}", "--val-losses=0.3,0.5,0.2,0.6,0.7,0.8",
              "--top-k=2", "--keep-best=2", "--keep-last=1")  # fmt: skip
    killed = _start(tmp_path, "killed", *common, "--upload-latency=0.2", options=options)
    resumed = _start(tmp_path, "fresh", *common, "--resume", f"--wait-for={tmp_path / 'go'}",
                     options=options)  # fmt: skip
    try:
        killed.wait_until(
            lambda: (
                (c := _latest(url, options)) is not None
                and c.current is not None
                and c.current.step >= 3 * STEPS_PER_EPOCH
            ),
            240,
            "epoch 2 committed",
        )
        killed.kill()
        killed.wait(10)
        (tmp_path / "go").touch()
        assert resumed.wait(300) == 0, resumed.log_tail()
    finally:
        killed.kill()
        resumed.kill()
    assert resumed.events("end")[0]["global_step"] == MAX_EPOCHS * STEPS_PER_EPOCH

    latest = _latest(url, options)
    kept = [(r.step, r.metadata["filename"], r.metrics) for r in latest.retained()]
    # The newest (keep_last=1) is epoch 4's: at epoch 5 (0.8, no top k) Lightning only
    # links last.ckpt to it. Then the best two by val_loss over the whole run.
    assert kept == [
        (20, "epoch=4-step=20.ckpt", {"val_loss": pytest.approx(0.7)}),
        (12, "epoch=2-step=12.ckpt", {"val_loss": pytest.approx(0.2)}),
        (4, "epoch=0-step=4.ckpt", {"val_loss": pytest.approx(0.3)}),
    ]
    # `cloudckpt ls` shows each save's monitored value (recorded as a metric, not the
    # epoch alone) and why the store keeps it.
    from click.testing import CliRunner

    from cloudckpt.cli import cli

    flags = ["--endpoint-url", options["endpoint_url"], "-o", f"key={options['key']}",
             "-o", f"secret={options['secret']}"]  # fmt: skip
    table = CliRunner().invoke(cli, ["ls", url, *flags])
    assert table.exit_code == 0, table.output
    rows = {int(line.split()[0]): line for line in table.stdout.splitlines()
            if line.split() and line.split()[0].isdigit()}  # fmt: skip
    assert "current, last" in rows[20] and "val_loss=0.7" in rows[20], table.stdout
    for step, loss in ((12, "0.2"), (4, "0.3")):
        assert " best " in rows[step] and f"val_loss={loss}" in rows[step], table.stdout
    # What `ckpt_path="best"` on a new machine does: load the best_model_path the killed
    # run's ModelCheckpoint recorded; no local file, so it comes from the store, verified.
    old_best = str(tmp_path / "killed" / "checkpoints" / "epoch=2-step=12.ckpt")
    io = CloudCheckpointIO(url, storage_options=options)
    try:
        loaded = io.load_checkpoint(old_best)
    finally:
        io.teardown()
    assert loaded["global_step"] == 12 and loaded["epoch"] == 2
