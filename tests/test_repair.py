"""``repair`` (docs/design.md §7, LATEST missing or damaged) on the memory oracle: what it rebuilds, what it refuses, and
that writers from before the damage stay fenced."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest
from click.testing import CliRunner

from cloudckpt import (
    CorruptionError,
    FencedError,
    NeedsRepairError,
    attempt_layout,
    canonical,
    protocol,
)
from cloudckpt.cli import cli
from cloudckpt.errors import CommitConflictError
from cloudckpt.repair import repair
from cloudckpt.stores import OVERWRITE, open_store
from cloudckpt.testing.faults import flip_bit
from cloudckpt.testing.wrappers import ForwardingStore


def _save(mgr, step, data=b"x"):
    with mgr.save(step=step) as d:
        (d / "f").write_bytes(data)
    mgr.wait()


def _latest(store) -> protocol.Latest:
    return protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])


def _records(store) -> list[str]:
    return [o.key for o in store.list(protocol.COMMITS_PREFIX)]


@pytest.fixture
def run(memory_target, manager_factory):
    """A run with steps 1, 2, 3 committed by one writer (keep_last=3)."""
    store = open_store(memory_target.url)
    mgr = manager_factory(memory_target, auto_gc=False)
    for step in (1, 2, 3):
        _save(mgr, step, b"data %d" % step)
    return store, mgr


def test_healthy_latest_is_left_alone(run):
    store, _ = run
    before = store.get(protocol.LATEST_KEY)
    records = _records(store)
    report = repair(store)
    assert report.action == "healthy" and report.current_step == 3
    assert store.get(protocol.LATEST_KEY) == before
    assert _records(store) == records


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_rebuilds_and_fences_the_old_writer(run, manager_factory, memory_target, tmp_path, damage):
    store, old_writer = run
    old = _latest(store)
    if damage == "missing":
        store.delete(protocol.LATEST_KEY)
    else:
        flip_bit(store, protocol.LATEST_KEY, seed=5)
    # Writers stop, readers fall back; GC refuses.
    with pytest.raises(NeedsRepairError):
        manager_factory(memory_target).resume(into=tmp_path / "r0")

    report = repair(store)
    assert report.action == "rebuilt" and report.latest_state == damage.replace(
        "corrupt", "damaged"
    )
    new = _latest(store)
    assert new.current.step == 3 and [r.step for r in new.retained()] == [3, 2, 1]
    assert new.writer.epoch > old.writer.epoch and new.seq > old.seq
    assert new.op == "repair"
    # Its commit record exists and verifies.
    record = protocol.parse_latest(store.get(protocol.commit_record_key(new.seq))[0])
    assert record.writer.epoch == new.writer.epoch

    # The writer from before the damage (a zombie) stays fenced.
    with pytest.raises(FencedError):
        _save(old_writer, 4)
    assert _latest(store).current.step == 3

    # A new writer resumes normally.
    fresh = manager_factory(memory_target)
    assert fresh.resume(into=tmp_path / "r1").step == 3
    _save(fresh, 4)
    assert _latest(store).current.step == 4
    assert repair(store).action == "healthy"


@pytest.mark.parametrize(
    "prefix_epoch, latest_epoch, expected",
    [(7, 9, 10), (12, 9, 13), (3, None, 4)],
    ids=["damaged-latest-highest", "attempt-prefix-highest", "latest-missing"],
)
def test_epoch_is_above_every_epoch_seen(run, prefix_epoch, latest_epoch, expected):
    store, _ = run
    # Traces of writers whose commit records never landed: an attempt prefix (a writer that
    # claimed and uploaded), and the damaged LATEST's own bytes.
    prefix = attempt_layout.ckpt_prefix(5, prefix_epoch, "20300101T000000000Z-0badcafe")
    store.put(prefix + "ATTEMPT.json", b"{}")
    if latest_epoch is None:
        store.delete(protocol.LATEST_KEY)
    else:
        body = _latest(store).to_dict()
        body["writer"]["epoch"] = latest_epoch
        store.put(protocol.LATEST_KEY, canonical.canonical_json(body) + b"garbage")
    report = repair(store)
    assert report.highest_epoch_seen == expected - 1
    assert _latest(store).writer.epoch == expected


def test_walks_down_past_records_whose_current_manifest_is_gone(run):
    store, _ = run
    latest = _latest(store)
    store.delete(protocol.LATEST_KEY)
    store.delete(latest.current.manifest_key)  # step 3's manifest is gone
    report = repair(store)
    new = _latest(store)
    assert new.current.step == 2
    assert report.passed_over[0]["record"] == protocol.commit_record_key(latest.seq)
    assert new.seq == latest.seq + 1  # above every seq seen, including skipped records


def test_drops_retained_checkpoints_without_manifest_and_their_pins(run):
    from cloudckpt.admin import pin

    store, _ = run
    pin(store, 1, "keep")
    step1 = next(r for r in _latest(store).retained() if r.step == 1)
    store.delete(step1.manifest_key)
    report = repair(store, force=True)
    new = _latest(store)
    assert [r.step for r in new.retained()] == [3, 2]
    assert [d["step"] for d in report.dropped] == [1]
    assert new.pins == ()
    # It waits for GC as a 'deleting' tombstone (a pin cannot bring it back).
    assert [(t.record.step, t.state) for t in new.tombstones] == [(1, "deleting")]


def test_refuses_when_nothing_verifies_and_changes_nothing(run):
    store, _ = run
    for key in _records(store):
        flip_bit(store, key, seed=1)
    flip_bit(store, protocol.LATEST_KEY, seed=2)
    before = {o.key: store.get(o.key)[0] for o in store.list()}
    with pytest.raises(CorruptionError) as err:
        repair(store)
    message = str(err.value)
    assert "none of the" in message and "commit record" in message and "attempt" in message
    assert {o.key: store.get(o.key)[0] for o in store.list()} == before


def test_never_overwrites_a_latest_that_changed_meanwhile(run):
    store, _ = run
    flip_bit(store, protocol.LATEST_KEY, seed=3)

    class Racing(ForwardingStore):
        """Another writer replaces LATEST just before repair writes it."""

        def put(self, key, data, *, mode=OVERWRITE):
            if key == protocol.LATEST_KEY:
                self.inner.put(key, b"someone else's bytes")
            return self.inner.put(key, data, mode=mode)

    with pytest.raises(CommitConflictError):
        repair(Racing(store))
    assert store.get(protocol.LATEST_KEY)[0] == b"someone else's bytes"


def test_dry_run_writes_nothing(run):
    store, _ = run
    store.delete(protocol.LATEST_KEY)
    before = {o.key for o in store.list()}
    report = repair(store, dry_run=True)
    assert report.action == "would-rebuild" and report.current_step == 3
    assert {o.key for o in store.list()} == before


def test_empty_run_is_nothing_to_repair(memory_target):
    store = open_store(memory_target.url)
    assert repair(store).action == "empty"
    assert list(store.list()) == []


def test_repair_rerun_after_a_crash_converges(run):
    """A repair whose answer was lost (LATEST written, commit record not): re-running it
    finds LATEST healthy."""
    store, _ = run
    store.delete(protocol.LATEST_KEY)

    class LosesRecord(ForwardingStore):
        def put(self, key, data, *, mode=OVERWRITE):
            if key.startswith(protocol.COMMITS_PREFIX):
                raise KeyboardInterrupt  # the process dies right after LATEST landed
            return self.inner.put(key, data, mode=mode)

    with pytest.raises(KeyboardInterrupt):
        repair(LosesRecord(store))
    assert repair(store).action == "healthy"


def test_unreferenced_complete_attempts_are_reported(run):
    store, _ = run
    latest = _latest(store)
    # A commit whose LATEST was lost before its record was written: its attempt has a
    # manifest, but nothing references it any more.
    store.delete(protocol.commit_record_key(latest.seq))
    store.delete(protocol.LATEST_KEY)
    report = repair(store)
    assert report.unreferenced_manifests == [latest.current.ckpt]
    assert _latest(store).current.step == 2


def test_clock_and_writer_id_are_injectable(run):
    store, _ = run
    store.delete(protocol.LATEST_KEY)
    when = dt.datetime(2031, 1, 1, tzinfo=dt.timezone.utc)
    repair(store, writer_id="ops:me", clock=lambda: when)
    new = _latest(store)
    assert new.writer.id == "ops:me" and new.updated_at.startswith("2031-01-01")
    assert dataclasses.asdict(new.settings)["keep_last"] == 3


# --- the plan: what --dry-run prints, on a real S3 server (moto) ---------------------------


@pytest.mark.parametrize("damage", ["missing", "damaged"])
def test_repair_dry_run_prints_the_plan_and_execution_follows_it(
    s3_target, manager_factory, damage
):
    """``repair --dry-run`` prints what LATEST would be rebuilt from, its seq and epoch, and
    each write with its conditional mode; it writes nothing, and the real run then does
    exactly that."""
    store = open_store(s3_target.url, s3_target.storage_options)
    mgr = manager_factory(s3_target, auto_gc=False)
    for step in (1, 2, 3):
        _save(mgr, step, b"data %d" % step)
    old = _latest(store)
    if damage == "missing":
        store.delete(protocol.LATEST_KEY)
        first = {"key": protocol.LATEST_KEY, "mode": "create-only"}
    else:
        flip_bit(store, protocol.LATEST_KEY, seed=7)
        version = store.head(protocol.LATEST_KEY).version
        first = {"key": protocol.LATEST_KEY, "mode": "compare-and-swap", "version": version}
    seq, epoch = old.seq + 1, old.writer.epoch + 1
    record = protocol.commit_record_key(seq)

    def state():
        return {o.key: (o.version, store.get(o.key)[0]) for o in store.list()}

    so = s3_target.storage_options
    url = [store.url, "--endpoint-url", so["endpoint_url"], "--region", "us-east-1",
           "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]  # fmt: skip
    before = state()
    text = CliRunner().invoke(cli, ["repair", *url, "--dry-run"])
    dry = CliRunner().invoke(cli, ["repair", *url, "--dry-run", "--json"])
    assert text.exit_code == 0 and dry.exit_code == 0, text.output + dry.output
    assert state() == before, "a dry run wrote something"

    plan = json.loads(dry.stdout)
    assert plan["action"] == "would-rebuild" and plan["latest_state"] == damage
    assert plan["base"] == protocol.commit_record_key(old.seq)
    assert (plan["seq"], plan["epoch"]) == (seq, epoch)
    assert plan["current_step"] == 3 and plan["retained_steps"] == [3, 2, 1]
    assert plan["writes"] == [first, {"key": record, "mode": "create-only"}]
    out = text.stdout
    assert f"would rebuild LATEST from {plan['base']}: seq {seq}, writer epoch {epoch}" in out
    if damage == "missing":
        assert "would write LATEST create-only: stops if anything created it" in out
    else:
        assert (
            f"would write LATEST by compare-and-swap against the damaged version read ({version})"
            in out
        )
    assert f"would write {record} create-only" in out
    assert out.rstrip().endswith("nothing was written (dry run)")

    done = CliRunner().invoke(cli, ["repair", *url, "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout) == {**plan, "action": "rebuilt"}
    new = _latest(store)
    assert (new.seq, new.writer.epoch, new.current.step) == (seq, epoch, 3)
    assert store.get(record)[0] == store.get(protocol.LATEST_KEY)[0]
