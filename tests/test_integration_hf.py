"""transformers Trainer + CheckpointCallback against the moto S3 server, in child processes.

A tiny GPT-2 (2 layers, 32 dims, built from a config: no downloads) trains on synthetic
token ids. Each run is a child process (tests/scripts/hf_train.py) so it can be SIGKILLed or
sent SIGTERM. The children start together to use both cores (imports dominate): the killed
run, the run that resumes it (which waits after its imports until the kill), and one that
trains the uninterrupted reference run and then the run that gets SIGTERM.

Why losses can be compared exactly: every run uses the same seeds (``seed``, ``data_seed``),
``full_determinism`` (deterministic kernels), no dataloader workers and one CPU thread. A
resumed Trainer reloads the weights (safetensors), optimizer and scheduler state, skips the
batches already seen in the epoch and restores ``rng_state.pth``, so it runs the very same
float operations in the same order as the uninterrupted run: the losses are bitwise equal,
and dropout (on, p=0.1) would diverge at once if the RNG state were not restored.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from childrun import ChildRun, read_events

from cloudckpt.reader import fetch_manifest, load_latest_for_reading
from cloudckpt.stores import open_store

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "hf_train.py"
MAX_STEPS, SAVE_STEPS = 12, 3  # 32 samples / batch 4: epochs of 8 steps, so one boundary


def _bucket(moto_server, name: str) -> tuple[str, dict[str, Any]]:
    moto_server.create_bucket(name)
    return f"s3://{name}/run", moto_server.storage_options()


def _current(url: str, options: dict[str, Any]):
    store = open_store(url, options)
    try:
        latest, _ = load_latest_for_reading(store)
        return None if latest is None else latest.current
    finally:
        store.close()


def _start(tmp: Path, name: str, *args: str, options=None) -> ChildRun:
    return ChildRun(
        SCRIPT,
        ["--output-dir", str(tmp / name), *args],
        events=tmp / f"{name}.jsonl",
        log=tmp / f"{name}.log",
        storage_options=options,
    )


@pytest.fixture(scope="module")
def runs(moto_server, tmp_path_factory):
    """Three children start at once (their imports take most of the time): the run to be
    killed; the run that will resume it, which waits after its imports until the test says
    go; and one that first trains the uninterrupted reference run, then the run that gets
    SIGTERM."""
    tmp = tmp_path_factory.mktemp("hf")
    steps = (f"--max-steps={MAX_STEPS}", f"--save-steps={SAVE_STEPS}")
    kill_url, kill_options = _bucket(moto_server, "hf-kill")
    preempt_url, preempt_options = _bucket(moto_server, "hf-preempt")
    started = {
        "killed": _start(
            tmp,
            "killed",
            f"--url={kill_url}",
            *steps,
            "--upload-latency=0.4",  # slow uploads: a later checkpoint is in flight at the kill
            options=kill_options,
        ),
        "resumed": _start(
            tmp,
            "resumed",
            f"--url={kill_url}",
            *steps,
            "--resume",
            f"--wait-for={tmp / 'go'}",
            options=kill_options,
        ),
        "preempted": _start(
            tmp,
            "preempted",
            f"--reference-first={tmp / 'reference.jsonl'}",  # 12 steps, saves every 3
            f"--url={preempt_url}",
            "--max-steps=400",
            "--save-steps=1000",  # no scheduled save: the only checkpoint is the emergency one
            "--resume",  # on an empty run: resume() returns None
            options=preempt_options,
        ),
    }
    preempted = started["preempted"]
    # SIGTERM mid-run, after a few steps (from a thread, whatever test runs meanwhile).
    preempted.signal_when(
        lambda: any(e["step"] >= 3 for e in preempted.events("log")), signal.SIGTERM, 400
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
        current = _current(url, options)
        saved = [e["step"] for e in killed.events("saved")]
        return current is not None and bool(saved) and max(saved) > current.step

    killed.wait_until(committed_and_one_in_flight, 240, "a commit with a later save in flight")
    killed.kill()
    killed.wait(10)
    current = _current(url, options)
    saved_locally = max(e["step"] for e in killed.events("saved"))
    assert saved_locally > current.step  # written locally, never committed
    assert current.step % SAVE_STEPS == 0 and current.metadata["emergency"] is False
    # That save is still on local disk, or a later one is: the Trainer may have saved
    # again and rotated it away (save_total_limit) just before the kill.
    local = [int(p.name.rpartition("-")[2]) for p in (tmp / "killed").glob("checkpoint-*")]
    assert local and max(local) >= saved_locally

    (tmp / "go").touch()  # the new host resumes from the store into a fresh directory
    assert resumed.wait(300) == 0, resumed.log_tail()
    new_dir = tmp / "resumed"
    assert resumed.events("resumed")[0]["path"] == str(new_dir / f"checkpoint-{current.step}")
    assert resumed.events("train_begin")[0]["global_step"] == current.step

    reference = tmp / "reference.jsonl"
    runs["preempted"].wait_until(
        lambda: read_events(reference, "end"), 300, "the end of the reference run"
    )
    expected = {e["step"]: e for e in read_events(reference, "log")}
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))
    got = {e["step"]: e for e in resumed.events("log")}
    assert sorted(got) == list(range(current.step + 1, MAX_STEPS + 1))
    for step, event in got.items():
        # Bitwise-equal floats: loss, learning rate (scheduler) and grad norm (optimizer).
        assert (event["loss"], event["lr"], event["grad_norm"]) == (
            expected[step]["loss"],
            expected[step]["lr"],
            expected[step]["grad_norm"],
        ), f"step {step} differs after resuming from step {current.step}"
    end = resumed.events("end")[0]
    assert end["global_step"] == MAX_STEPS and end["last_commit"] == MAX_STEPS
    final = _current(url, options)
    assert final.step == MAX_STEPS
    # Chunked by default: files that did not change since the previous save (the config,
    # training_args.bin...) are named where an earlier attempt stored them, not re-sent.
    store = open_store(url, options)
    try:
        manifest = fetch_manifest(store, final)
    finally:
        store.close()
    shared = {f.path for f in manifest.files for c in f.chunks or () if c.owner != final.ckpt}
    assert "config.json" in shared, shared
    assert final.owned_bytes < final.total_bytes

    # trainer_state.json points into the new output directory, not the dead host's.
    state = json.loads((new_dir / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"].startswith(str(new_dir) + "/")


def test_sigterm_mid_run_commits_an_emergency_checkpoint_and_stops_cleanly(runs):
    run = runs["preempted"]
    url, options = runs["preempt_url"]
    assert run.wait(300) == 0, run.log_tail()
    assert run.events("resumed")[0]["path"] is None  # a new run
    end = run.events("end")[0]
    assert end["preempted"] is True
    assert 3 <= end["global_step"] < 400
    assert end["last_commit"] == end["global_step"]
    current = _current(url, options)
    assert current.step == end["global_step"]
    assert current.metadata["emergency"] is True
    assert current.metadata["checkpoint_dir"] == f"checkpoint-{end['global_step']}"
    assert "preemption notice (signal): received SIGTERM" in run.log_tail(100_000)


def test_two_ranks_barrier_resume_and_one_rank_sigterm(moto_server, tmp_path):
    """torchrun with 2 CPU ranks (gloo): only rank 0 commits, every rank's rng_state is in
    the checkpoint, resume() broadcasts rank 0's path, and SIGTERM to rank 1 alone stops
    both ranks at the same step with a committed emergency checkpoint."""
    url, options = _bucket(moto_server, "hf-ddp")

    def torchrun(name: str, *args: str) -> ChildRun:
        with socket.socket() as probe:  # a free port for the rendezvous
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return ChildRun(
            SCRIPT,
            ["--output-dir", str(tmp_path / name), f"--url={url}", *args],
            events=tmp_path / f"{name}.jsonl",
            log=tmp_path / f"{name}.log",
            storage_options=options,
            launcher=["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"],
        )

    first = torchrun("first", "--max-steps=6", "--save-steps=3")
    assert first.wait(600) == 0, first.log_tail()
    assert _current(url, options).step == 6
    files = {p.name for p in (tmp_path / "first" / "checkpoint-6").iterdir()}
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= files

    second = torchrun("second", "--max-steps=400", "--save-steps=1000", "--resume")

    second.wait_until(
        lambda: any(e["step"] >= 9 for e in second.events("log")), 600, "step 9 after resume"
    )
    # Rank 1 names its own pid: a scan of /proc for LOCAL_RANK=1 could pick a process rank
    # 1 forked (same command line and environment), whose SIGTERM stops no training.
    (rank1,) = [e["pid"] for e in second.events("train_begin") if e["rank"] == 1]
    os.kill(rank1, signal.SIGTERM)
    assert second.wait(600) == 0, second.log_tail()
    assert [e["path"] for e in second.events("resumed")] == [
        str(tmp_path / "second" / "checkpoint-6")
    ] * 2
    ends = second.events("end")
    assert len(ends) == 2 and len({e["global_step"] for e in ends}) == 1
    assert all(e["preempted"] for e in ends)
    current = _current(url, options)
    assert current.step == ends[0]["global_step"] and current.metadata["emergency"] is True


def test_the_best_checkpoint_survives_a_kill_and_a_resume_on_a_fresh_directory(
    moto_server, tmp_path
):
    """load_best_model_at_end + save_total_limit=2 + keep_last=2, the best checkpoint the
    oldest (step 3): killed after the commit of step 9, resumed on a fresh directory. The
    callback keeps the best in the store too (metric_for_best_model), resume() restores it
    beside the current one, and the Trainer still knows its best model at the end."""
    url, options = _bucket(moto_server, "hf-best")
    common = (
        f"--url={url}", "--max-steps=15", "--save-steps=3", "--load-best", "--keep-last=2",
        "--scores=3:0.2,6:0.5,9:0.6,12:0.7,15:0.8",
    )  # fmt: skip
    killed = _start(tmp_path, "killed", *common, "--upload-latency=0.3", options=options)
    resumed = _start(tmp_path, "fresh", *common, "--resume", f"--wait-for={tmp_path / 'go'}",
                     options=options)  # fmt: skip
    try:
        killed.wait_until(
            lambda: (c := _current(url, options)) is not None and c.step >= 9, 300, "step 9"
        )
        killed.kill()
        killed.wait(10)
        at_kill = _current(url, options)
        (tmp_path / "go").touch()
        assert resumed.wait(300) == 0, resumed.log_tail()
    finally:
        killed.kill()
        resumed.kill()
    fresh = tmp_path / "fresh"
    assert resumed.events("resumed")[0]["path"] == str(fresh / f"checkpoint-{at_kill.step}")
    end = resumed.events("end")[0]
    assert end["best_model_checkpoint"] == str(fresh / "checkpoint-3")
    assert end["best_metric"] == 0.2
    log = resumed.log_tail(1_000_000)
    assert "no longer retained" not in log and "does not exist anymore" not in log

    store = open_store(url, options)
    try:
        latest, _ = load_latest_for_reading(store)
    finally:
        store.close()
    assert [r.step for r in latest.retained()] == [15, 12, 3]
    best = latest.retained()[-1]
    assert best.metrics["eval_score"] == 0.2 and "eval_loss" in best.metrics
    assert best.metadata["best_step"] == 3 and best.metadata["metric_for_best_model"] == "score"
    s = latest.settings
    assert (s.keep_last, s.keep_best, s.best_metric, s.best_mode) == (2, 1, "eval_score", "min")


def test_keep_best_follows_the_trainers_metric(memory_target, tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from cloudckpt.errors import ConfigurationError
    from cloudckpt.integrations.hf import CheckpointCallback

    def retention(*, preset=None, **callback):
        def settings(**training):
            args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], **training)
            ckpt = CheckpointCallback(memory_target.url, preemption=False, **callback)
            state = TrainerState()
            if preset:  # the run's settings, as resume() would have claimed them
                ckpt._manager(args.output_dir).set_retention(**preset)
            ckpt.on_train_begin(args, state, TrainerControl())
            s = ckpt.manager.settings
            ckpt.manager.close()
            return (s.keep_best, s.best_metric, s.best_mode)

        return settings

    auto = retention()
    assert auto(metric_for_best_model="loss") == (1, "eval_loss", "min")
    assert auto(metric_for_best_model="eval_accuracy") == (1, "eval_accuracy", "max")
    assert auto(metric_for_best_model="bleu", greater_is_better=False) == (1, "eval_bleu", "min")
    assert auto() == (None, None, "min")  # no metric: the run's setting (none) stays
    assert retention(keep_best=3)(metric_for_best_model="loss") == (3, "eval_loss", "min")
    assert retention(keep_best=2, best_metric="eval_f1", best_mode="max")() == (
        2, "eval_f1", "max",
    )  # fmt: skip
    assert retention(keep_best=None)(metric_for_best_model="loss") == (None, None, "min")
    # "auto" never keeps fewer than the run already keeps by the same metric.
    preset = {"keep_best": 3, "best_metric": "eval_loss", "best_mode": "min"}
    assert retention(preset=preset)(metric_for_best_model="loss") == (3, "eval_loss", "min")
    with pytest.raises(ConfigurationError, match=r"needs a metric.*metric_for_best_model") as e:
        retention(keep_best=2)()
    assert "metric_for_best_model" in e.value.hint  # where a Trainer user names one
