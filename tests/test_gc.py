"""Garbage collection (docs/design.md §8) on the memory store's manual clock, in the library and
through ``cloudckpt gc``: nothing referenced or younger than grace is deleted, manifests go
before data, orphans and incomplete uploads go after grace, and dry runs delete nothing."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from cloudckpt import attempt_layout, failpoints, manifests, protocol
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
    prefix = attempt_layout.ckpt_prefix(step, 1, f"20300101T000000{step:03d}Z-deadbeef")
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


# --- the plan: what --dry-run prints, on a real S3 server (moto) ---------------------------


def _s3_flags(target) -> list[str]:
    so = target.storage_options
    return ["--endpoint-url", so["endpoint_url"], "--region", "us-east-1",
            "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]  # fmt: skip


def _state(store) -> tuple[dict, list, bytes]:
    """Everything a dry run must leave alone: every object (version and bytes), the
    incomplete uploads, and LATEST's bytes."""
    objects = {o.key: (o.version, o.size, store.get(o.key)[0]) for o in store.list()}
    uploads = sorted((u.key, u.upload_id) for u in store.list_multipart(""))
    return objects, uploads, store.get(protocol.LATEST_KEY)[0]


def test_gc_dry_run_prints_the_plan_and_execution_follows_it(s3_target, manager_factory):
    """Expired tombstones (one holding a chunk the current checkpoint still names), an old
    orphan with an upload, an upload under a tombstone and one under the current checkpoint:
    ``gc --dry-run`` prints exactly what the real run then deletes, and changes nothing."""
    store = open_store(s3_target.url, s3_target.storage_options)
    mgr = manager_factory(s3_target, keep_last=1, gc_grace=5, auto_gc=False)
    shared = bytes(range(256)) * 64  # the same bytes in every step: one chunk, reused
    for step in (1, 2, 3):
        with mgr.save(step=step) as d:
            (d / "shared").write_bytes(shared)
            (d / "own").write_bytes(b"step %d " % step * 500)
        mgr.wait()
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert [t.record.step for t in latest.tombstones] == [1, 2]
    step1, step2 = (t.record.ckpt for t in latest.tombstones)
    orphan = _orphan(store, 9, manifest=True, upload=False)
    uploads = [
        store.create_multipart(step1 + "files/big").key,  # goes with its checkpoint
        store.create_multipart(orphan + "files/big").key,  # goes with its orphan
        store.create_multipart(latest.current.ckpt + "files/retry").key,  # old: goes alone
    ]
    # What the plan must count, computed from the listing: everything under the doomed
    # prefixes except the chunks the current checkpoint's manifest names.
    current = latest.current
    named = {
        c.key
        for f in manifests.parse_manifest(store.get(current.manifest_key)[0], current).files
        for c in f.chunks or ()
    }
    doomed = [o for o in store.list() if o.key.startswith((step1, step2, orphan))]
    kept = [o.key for o in doomed if o.key in named]
    assert kept and all(k.startswith(step1) for k in kept), "no shared chunk to protect"
    doomed = [o for o in doomed if o.key not in named]
    time.sleep(6.5)  # past the run's 5 s grace on the store's whole-second clock

    before = _state(store)
    url = [store.url, *_s3_flags(s3_target)]
    text = _cli("gc", *url, "--dry-run")
    dry = _cli("gc", *url, "--dry-run", "--json")
    assert text.exit_code == 0 and dry.exit_code == 0, text.output + dry.output
    assert _state(store) == before, "a dry run deleted or wrote something"

    plan = json.loads(dry.stdout)
    assert plan["dry_run"] is True
    assert plan["deleted_checkpoints"] == [{"step": 1, "ckpt": step1}, {"step": 2, "ckpt": step2}]
    assert plan["deleted_orphans"] == [orphan] and plan["kept_young"] == []
    assert [u["key"] for u in plan["aborted_uploads"]] == uploads
    assert plan["deleted_commit_records"] == []
    assert plan["deleted_objects"] == len(doomed)
    assert plan["freed_bytes"] == sum(o.size for o in doomed)
    out = text.stdout
    assert out.startswith(f"gc {store.url} (grace 5s, store clock) [dry run]\n")
    assert f"plan from LATEST seq {latest.seq}," in out
    assert f"would delete dropped checkpoint step 1: {step1} (dropped " in out
    assert f"would delete dropped checkpoint step 2: {step2} (dropped " in out
    assert f"would delete orphan attempt {orphan} (started " in out
    assert all(f"would abort incomplete upload {k}\n" in out for k in uploads)
    writes = [line.split(": ")[1] for line in out.splitlines() if "would write LATEST" in line]
    assert writes == ["gc-mark", "gc-forget", "gc-sweep"]
    assert f"would delete {len(doomed)} object(s)" in out and "nothing was deleted" in out

    done = _cli("gc", *url, "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert {k: v for k, v in report.items() if k != "store_now"} == {
        **{k: v for k, v in plan.items() if k != "store_now"},
        "dry_run": False,
    }
    left = {o.key for o in store.list() if o.key.startswith((step1, step2, orphan))}
    assert left == set(kept)
    assert store.list_multipart("") == []
