"""Garbage collection (DESIGN §8) on the memory store's manual clock, in the library and
through ``cloudckpt gc``: nothing referenced or younger than grace is deleted, manifests go
before data, orphans and incomplete uploads go after grace, and dry runs delete nothing."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cloudckpt import failpoints, protocol
from cloudckpt.cli import cli
from cloudckpt.gc import collect_garbage, execute_gc, plan_gc, preview_gc
from cloudckpt.stores import OVERWRITE, open_store
from cloudckpt.stores.memory import ManualClock
from cloudckpt.testing.wrappers import ForwardingStore

GRACE = 3600


class Recording(ForwardingStore):
    """Logs every destructive call and every LATEST write, in order."""

    def __init__(self, inner):
        super().__init__(inner)
        self.log: list[tuple[str, str]] = []

    def delete(self, key):
        self.log.append(("delete", key))
        self.inner.delete(key)

    def abort_multipart(self, upload):
        self.log.append(("abort", upload.key))
        self.inner.abort_multipart(upload)

    def put(self, key, data, *, mode=OVERWRITE):
        if key == protocol.LATEST_KEY:
            latest = protocol.parse_latest(bytes(data))
            self.log.append(
                ("latest", ",".join(f"{t.record.step}:{t.state}" for t in latest.tombstones))
            )
        return self.inner.put(key, data, mode=mode)

    def deletes(self) -> list[str]:
        return [k for op, k in self.log if op == "delete"]


def _save(mgr, step):
    with mgr.save(step=step) as d:
        (d / "weights").write_bytes(b"w%d" % step * 1000)
        (d / "sub").mkdir()
        (d / "sub" / "opt").write_bytes(b"o%d" % step)
    mgr.wait()


def _orphan(store, step, *, manifest=False, upload=True):
    """What a crashed or fenced save leaves: ATTEMPT.json, some files, maybe a manifest,
    and an incomplete multipart upload."""
    prefix = protocol.ckpt_prefix(step, 1, f"20300101T000000{step:03d}Z-deadbeef")
    store.put(prefix + "ATTEMPT.json", b"{}")
    store.put(prefix + "files/weights", b"junk")
    if manifest:
        store.put(prefix + "MANIFEST.json", b"{}")
    if upload:
        store.create_multipart(prefix + "files/big")
    return prefix


def _snapshot(store) -> dict[str, bytes]:
    return {o.key: store.get(o.key)[0] for o in store.list()}


@pytest.fixture
def run(memory_target, manager_factory):
    """Steps 1-4 with keep_last=2 and step 1 pinned: retained 4, 3, 1; step 2 dropped
    (a tombstone); an old orphan with a manifest and an incomplete upload; all at t0."""
    clock = ManualClock()
    store = Recording(open_store(memory_target.url, {"clock": clock}))
    mgr = manager_factory(store, keep_last=2, gc_grace=GRACE, auto_gc=False)
    _save(mgr, 1)
    mgr.pin(1, "best")
    for step in (2, 3, 4):
        _save(mgr, step)
    orphan = _orphan(store, 9, manifest=True)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert [r.step for r in latest.retained()] == [4, 3, 1]
    assert [t.record.step for t in latest.tombstones] == [2]
    store.log.clear()
    return store, clock, mgr, latest, orphan


def test_nothing_referenced_or_young_is_deleted_and_dry_run_deletes_nothing(run):
    store, clock, _mgr, _latest, orphan = run
    clock.advance(GRACE - 10)
    before = _snapshot(store)
    uploads = store.list_multipart("")
    for dry_run in (True, False):
        report = collect_garbage(store, dry_run=dry_run)
        assert not report.deleted_checkpoints and not report.deleted_orphans
        assert not report.aborted_uploads and orphan in report.kept_young
    assert store.log == [] and _snapshot(store) == before
    assert store.list_multipart("") == uploads

    clock.advance(20)  # now past grace for everything made at t0
    dry = collect_garbage(store, dry_run=True)
    assert [s for s, _ in dry.deleted_checkpoints] == [2]
    assert dry.deleted_orphans == [orphan]
    assert [k for k, _ in dry.aborted_uploads] == [orphan + "files/big"]
    assert store.log == [], "a dry run deleted or wrote something"
    assert _snapshot(store) == before and store.list_multipart("") == uploads


def test_after_grace_garbage_goes_manifest_first_and_referenced_data_stays(run, tmp_path):
    store, clock, mgr, latest, orphan = run
    referenced = {
        k: v
        for k, v in _snapshot(store).items()
        if k.startswith(tuple(r.ckpt for r in latest.retained()))
    }
    young_clock = clock.advance(GRACE // 2)
    young = _orphan(store, 10)
    assert young_clock
    clock.advance(GRACE // 2 + 10)

    report = collect_garbage(store)
    dropped = next(t.record.ckpt for t in latest.tombstones)
    assert [c for _, c in report.deleted_checkpoints] == [dropped]
    assert report.deleted_orphans == [orphan] and report.kept_young == [young]

    # The tombstone was marked 'deleting' in LATEST before any of its objects went.
    first_delete = next(i for i, (op, _) in enumerate(store.log) if op == "delete")
    assert ("latest", "2:deleting") in store.log[:first_delete]
    # Per attempt: manifest first, ATTEMPT.json last.
    for prefix in (dropped, orphan):
        keys = [k for k in store.deletes() if k.startswith(prefix)]
        assert keys[0] == prefix + "MANIFEST.json", keys
        assert keys[-1] == prefix + "ATTEMPT.json"
        assert not list(store.list(prefix))
    assert {u.key for u in store.list_multipart("")} == {young + "files/big"}

    # Everything referenced is byte-for-byte intact and restorable; the young orphan too.
    now = _snapshot(store)
    assert {k: now.get(k) for k in referenced} == referenced
    assert any(k.startswith(young) for k in now)
    after = protocol.parse_latest(now[protocol.LATEST_KEY])
    assert after.tombstones == () and [r.step for r in after.retained()] == [4, 3, 1]
    for step in (4, 3, 1):
        assert mgr.restore(into=tmp_path / f"r{step}", step=step).step == step

    clock.advance(GRACE)
    report = collect_garbage(store)
    assert report.deleted_orphans == [young]
    assert store.list_multipart("") == []
    assert {o.key.split("/")[1] for o in store.list("ckpt/")} == {
        r.ckpt.split("/")[1] for r in after.retained()
    }


@pytest.mark.parametrize(
    "point",
    ["gc.after_mark", "gc.after_delete_manifest", "gc.after_delete_data", "gc.after_forget"],
)
def test_gc_interrupted_anywhere_converges_on_rerun(run, tmp_path, point):
    store, clock, mgr, latest, orphan = run
    clock.advance(GRACE + 1)
    with failpoints.armed(point), pytest.raises(failpoints.SimulatedCrash):
        collect_garbage(store)
    # Whatever the crash left, restores of retained checkpoints still work...
    assert mgr.restore(into=tmp_path / "mid").step == 4
    collect_garbage(store)
    after = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert after.tombstones == () and [r.step for r in after.retained()] == [4, 3, 1]
    assert not list(store.list(next(t.record.ckpt for t in latest.tombstones)))
    assert not list(store.list(orphan)) and store.list_multipart("") == []
    for step in (4, 3, 1):
        assert mgr.restore(into=tmp_path / f"r{step}", step=step).step == step


def test_execute_drops_what_became_referenced_after_the_plan(run, tmp_path):
    """The plan comes from one read of LATEST; a pin that brings the dropped step 2 back
    before the plan is executed keeps it: execute deletes less than the plan, never more."""
    store, clock, mgr, _latest, orphan = run
    clock.advance(GRACE + 1)
    plan = plan_gc(store)
    assert [a.step for a in plan.checkpoints] == [2] and [a.prefix for a in plan.orphans] == [
        orphan
    ]
    assert [s for s, _ in preview_gc(plan).deleted_checkpoints] == [2]
    assert store.log == [], "planning or previewing wrote something"
    mgr.pin(2, "back")

    report = execute_gc(plan)
    assert report.deleted_checkpoints == [] and report.deleted_orphans == [orphan]
    assert report.latest_writes == ["gc-sweep"]  # nothing left to mark, so nothing to forget
    after = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert after.tombstones == () and 2 in [r.step for r in after.retained()]
    assert mgr.restore(into=tmp_path / "r2", step=2).step == 2


# --- through the CLI ----------------------------------------------------------------------


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_gc_cli_dry_run_json_then_delete(run):
    store, clock, _mgr, _latest, orphan = run
    url = store.url
    clock.advance(GRACE + 1)
    before = _snapshot(store)
    result = _cli("gc", url, "--dry-run", "--grace", "1h", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc) == {
        "url",
        "dry_run",
        "grace_seconds",
        "store_now",
        "deleted_checkpoints",
        "deleted_orphans",
        "aborted_uploads",
        "deleted_commit_records",
        "kept_young",
        "deleted_objects",
        "freed_bytes",
    }
    assert doc["dry_run"] is True and doc["grace_seconds"] == GRACE
    assert [c["step"] for c in doc["deleted_checkpoints"]] == [2]
    assert doc["deleted_orphans"] == [orphan]
    assert doc["aborted_uploads"][0]["key"] == orphan + "files/big"
    assert _snapshot(store) == before and store.log == []

    # A longer grace keeps everything; the run's own grace is a floor for shorter ones.
    result = _cli("gc", url, "--grace", "1d", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["deleted_objects"] == 0
    result = _cli("gc", url, "--grace", "10m", "--dry-run", "--json")
    assert json.loads(result.stdout)["grace_seconds"] == GRACE
    assert "shorter than the run's gc_grace_s" in result.stderr

    result = _cli("gc", url)
    assert result.exit_code == 0, result.output
    assert "deleted dropped checkpoint step 2" in result.stdout
    assert f"deleted orphan attempt {orphan}" in result.stdout
    assert not list(store.list(orphan))


@pytest.mark.parametrize("bad", ["2x", "-1h", "h", "1h30", ""])
def test_gc_cli_rejects_bad_durations(memory_target, bad):
    result = _cli("gc", memory_target.url, "--grace", bad)
    assert result.exit_code == 2
    assert "not a duration" in result.stderr or "empty duration" in result.stderr


def test_gc_cli_refuses_a_run_without_latest(run):
    store, *_ = run
    store.delete(protocol.LATEST_KEY)
    before = _snapshot(store)
    result = _cli("gc", store.url)
    assert result.exit_code == 6 and "cloudckpt repair" in result.stderr
    assert _snapshot(store) == before
