"""Bad input gets a clear error, never "a bug in cloudckpt" (issue 28 item 11): storage
options file:// and memory:// do not take, metrics beyond a float's range (save, push,
watch), and a copy slower than the destination's grace period (said as such, not blamed on
the store or a proxy)."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from cloudckpt import CheckpointManager, ConfigurationError, StaleAttemptError, open_store
from cloudckpt.catalog import copy_checkpoint
from cloudckpt.cli import cli
from cloudckpt.digest import CHUNK_SIZE
from cloudckpt.gc import collect_garbage
from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket

SECRET = "SECRETcloudckptOptionValue"


@pytest.mark.parametrize("url", ["file://{tmp}/run", "{tmp}/run", "memory://opts/run"])
def test_options_a_store_does_not_take_are_named_with_the_ones_it_does(tmp_path, url):
    url = url.format(tmp=tmp_path)
    accepts = "clock, min_part_size" if url.startswith("memory") else "fsync"
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(cli, ["ls", url, "-o", f"secret={SECRET}", *extra])
        assert result.exit_code == 2, result.output
        assert "this is a bug" not in result.output and SECRET not in result.output
        assert "takes no storage option 'secret'" in result.output
        assert f"(it accepts: {accepts})" in result.output
    with pytest.raises(ConfigurationError, match=r"takes no storage options? .*'secret'") as err:
        CheckpointManager(url, storage_options={"secret": SECRET, "fsync": False})
    assert SECRET not in str(err.value) and "s3://, gs:// and az://" in err.value.hint
    if not url.startswith("memory"):  # what file:// takes still works
        CheckpointManager(url, storage_options={"fsync": False}, staging_dir=tmp_path / "s").close()


HUGE = 10**400  # a Python int no float can hold


def test_a_metric_beyond_a_floats_range_is_a_configuration_error(memory_target, tmp_path):
    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    with pytest.raises(ConfigurationError, match="'loss' is too large for a float"):
        mgr.save(step=1, metrics={"loss": HUGE})
    with mgr.save(step=1, metrics={"loss": 0.5}) as d:  # the manager is fine afterwards
        (d / "f").write_bytes(b"x")
    mgr.wait()
    assert mgr.latest().step == 1 and mgr.latest().metrics == {"loss": 0.5}
    mgr.close()


def test_push_refuses_a_metric_beyond_a_floats_range(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    url = f"file://{tmp_path}/run"
    for value in (str(HUGE), "1e400", "-1e999"):
        result = CliRunner().invoke(cli, ["push", str(src), url, "--step", "1",
                                          "--metric", f"loss={value}"])  # fmt: skip
        assert result.exit_code == 2, result.output
        assert "too large for a float" in result.output and "write inf" in result.output
    assert not (tmp_path / "run").exists()
    # inf is a number, spelled as such: recorded (and never ranked best).
    result = CliRunner().invoke(
        cli, ["push", str(src), url, "--step", "1", "--metric", "loss=-inf", "--metric", "x=1e300"]
    )
    assert result.exit_code == 0, result.output
    listed = json.loads(CliRunner().invoke(cli, ["ls", url, "--json"]).stdout)
    assert listed["checkpoints"][0]["metrics"] == {"loss": "-inf", "x": 1e300}


def test_watch_skips_a_logged_metric_beyond_a_floats_range_and_uploads(tmp_path):
    """The Trainer's file is not ours: an unusable metric in it is left out, and the
    checkpoint is uploaded with the rest (not failed over a number)."""
    out = tmp_path / "out"
    d = out / "checkpoint-3"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"weights")
    history = [{"eval_loss": 0.25, "eval_huge": HUGE, "step": 3}]
    (d / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    url = f"file://{tmp_path}/run"
    result = CliRunner().invoke(cli, ["watch", str(out), url, "--once", "--json"])
    assert result.exit_code == 0, result.output
    assert "OverflowError" not in result.output
    listed = json.loads(CliRunner().invoke(cli, ["ls", url, "--json"]).stdout)
    assert [(c["step"], c["metrics"]) for c in listed["checkpoints"]] == [(3, {"eval_loss": 0.25})]


def test_a_record_with_such_a_metric_never_ranks_and_breaks_nothing():
    from cloudckpt.retention import metric_value

    assert metric_value({"loss": HUGE}, "loss") is None
    assert metric_value({"loss": 2**60}, "loss") == float(2**60)


@pytest.fixture
def slow_copy(tmp_path):
    """A source run on memory:// and a destination on a memory bucket whose clock the test
    moves: the copy's progress callback runs ``during`` after its first piece landed."""
    rng = random.Random(3)
    src_url = f"memory://slow-src-{rng.getrandbits(32):08x}/run"
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(rng.randbytes(3 * CHUNK_SIZE + 5))
    mgr = CheckpointManager(src_url, staging_dir=tmp_path / "st")
    mgr.save_dir(7, src).result()
    mgr.close()
    clock, name = ManualClock(), f"slow-dst-{rng.getrandbits(32):08x}"
    dest = MemoryStore(name, "copy", clock=clock)
    yield src_url, dest, clock
    drop_memory_bucket(name)
    drop_memory_bucket(src_url.split("/")[2])


@pytest.mark.parametrize("gc_ran", [True, False])
def test_a_copy_slower_than_grace_says_so_and_what_to_do(slow_copy, gc_ran):
    """Slower than the destination's grace: with GC collecting its attempt meanwhile (its
    uploaded chunks gone before the commit), and without (the commit's own age check).
    Either way the error names the grace period and what to do, not the store or a proxy."""
    src_url, dest, clock = slow_copy
    reports = []

    def progress(_n):
        if not reports:
            clock.advance(3 * 3600)  # past the default 2 h grace, on the store's clock
            reports.append(
                collect_garbage(MemoryStore(dest.bucket.name, "copy")) if gc_ran else None
            )

    with pytest.raises(StaleAttemptError) as err:
        copy_checkpoint(src_url, dest, progress=progress)
    if gc_ran:
        assert reports[0].deleted_objects > 0  # GC did collect the copy's attempt
    message, hint = err.value.message, err.value.hint
    assert "copy of step 7" in message and "slower than the destination run's gc grace" in message
    assert "7200 s" in message and "proxy" not in str(err.value)
    assert "gc_grace" in hint and "--grace" in hint and "fewer checkpoints at once" in hint
    # Nothing was committed: the destination holds no checkpoint.
    latest = json.loads(open_store(f"memory://{dest.bucket.name}/copy").get("LATEST")[0])
    assert latest["current"] is None
