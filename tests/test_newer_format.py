"""A run a newer cloudckpt wrote (issue 28, item 1): a format this version does not know is
not damage. Readers, writers, GC, repair, verify, cp and export refuse it
(``UnknownFormatError``, exit 10 naming the version that wrote it); none falls back past it
to an older record, rolls it back, collects by it or writes over it (docs/design.md §3,
format changes).

The run is real (saved through ``CheckpointManager`` on the memory oracle, with its manual
clock); "a newer version wrote steps 4 and 5" is made by relabelling the records of those
commits to ``cloudckpt.latest/99`` (resealed, so they pass their self-check, as a newer
writer's would), or a manifest to ``cloudckpt.manifest/99``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json

import pytest
from click.testing import CliRunner

from cloudckpt import (
    CheckpointManager,
    UnknownFormatError,
    attempt_layout,
    canonical,
    formats,
    protocol,
)
from cloudckpt.cli import cli
from cloudckpt.gc import collect_garbage, execute_gc, plan_gc, preview_gc
from cloudckpt.integrations.torch import load_state
from cloudckpt.repair import repair
from cloudckpt.stores import CREATE, OVERWRITE, open_store
from cloudckpt.stores.memory import ManualClock
from cloudckpt.testing.faults import flip_bit
from cloudckpt.testing.wrappers import ForwardingStore

GRACE = 3600
NEWER = "9.0.0"  # the version that "wrote" the relabelled records
NEWER_LATEST = "cloudckpt.latest/99"


def _save(mgr, step):
    with mgr.save(step=step) as d:
        (d / "weights").write_bytes(b"w%d" % step * 1000)
    mgr.wait()


def _reseal(body: dict, **changes) -> bytes:
    """``body`` changed and sealed again, as the version that wrote it would have."""
    return canonical.seal({**body, **changes})


def _relabel(store, key, fmt=NEWER_LATEST, **changes) -> None:
    body = json.loads(store.get(key)[0])
    store.put(key, _reseal(body, format=fmt, written_by=NEWER, **changes), mode=OVERWRITE)


def _snapshot(store) -> dict[str, bytes]:
    return {o.key: store.get(o.key)[0] for o in store.list()}


@dataclasses.dataclass
class NewerRun:
    store: object
    clock: ManualClock
    url: str


@pytest.fixture
def newer_run(memory_target, manager_factory):
    """Steps 1-5 committed with keep_last=2 (steps 1-3 dropped: tombstones), every object
    older than grace; then a newer cloudckpt "wrote" the commits of steps 4 and 5: LATEST
    and their commit records are in format /99. The older records (current: step 3 and
    before) still parse: what a fallback past the newer ones would restore."""
    clock = ManualClock()
    store = open_store(memory_target.url, {"clock": clock})
    mgr = manager_factory(store, keep_last=2, gc_grace=GRACE, auto_gc=False)
    for step in range(1, 6):
        _save(mgr, step)
    mgr.close()
    for obj in store.list(protocol.COMMITS_PREFIX):
        record = protocol.parse_latest(store.get(obj.key)[0])
        if record.current is not None and record.current.step >= 4:
            _relabel(store, obj.key)
    _relabel(store, protocol.LATEST_KEY)
    clock.advance(GRACE * 3)
    return NewerRun(store, clock, memory_target.url)


def _refused(exc_info) -> None:
    exc = exc_info.value
    assert exc.found == NEWER_LATEST and exc.written_by == NEWER
    assert "cloudckpt.latest/2" in exc.known
    assert f"written by cloudckpt {NEWER}" in str(exc) and "upgrade this host" in str(exc)


# --------------------------------------------------------------------------- readers


def test_restore_and_load_state_refuse_a_newer_latest_never_an_older_step(
    newer_run, manager_factory, tmp_path
):
    before = _snapshot(newer_run.store)
    with pytest.raises(UnknownFormatError) as exc_info:
        manager_factory(newer_run.store).restore(tmp_path / "r")
    _refused(exc_info)
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())
    with pytest.raises(UnknownFormatError):
        load_state(newer_run.store, weights_only=False)
    assert _snapshot(newer_run.store) == before


def test_a_newer_commit_record_is_not_skipped_for_an_older_one(newer_run, tmp_path):
    # LATEST gone: readers use the newest commit record, which is a newer version's.
    newer_run.store.delete(protocol.LATEST_KEY)
    result = CliRunner().invoke(cli, ["restore", newer_run.url, str(tmp_path / "r")])
    assert result.exit_code == 10, result.output
    assert f"cloudckpt {NEWER}" in result.output and "upgrade this host" in result.output
    assert not (tmp_path / "r" / "weights").exists()


def test_the_cli_exits_10_naming_the_version_and_changes_nothing(newer_run, tmp_path):
    before = _snapshot(newer_run.store)
    for args in (
        ["restore", newer_run.url, str(tmp_path / "r")],
        ["ls", newer_run.url],
        ["verify", newer_run.url],
        ["gc", newer_run.url],
        ["repair", newer_run.url],
        ["repair", newer_run.url, "--force"],
        ["cp", newer_run.url, newer_run.url + "-copy"],
        ["export", newer_run.url, str(tmp_path / "exported")],
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 10, (args, result.output)
        assert f"cloudckpt {NEWER}" in result.output, (args, result.output)
        assert "upgrade this host" in result.output, (args, result.output)
    assert _snapshot(newer_run.store) == before
    assert not list(open_store(newer_run.url + "-copy").list())


def test_a_setting_this_version_does_not_know_is_refused_by_readers(newer_run, tmp_path):
    # A /2 LATEST whose settings name a rule this version lacks: not damage either.
    store = newer_run.store
    body = json.loads(store.get(protocol.LATEST_KEY)[0])
    body["format"] = formats.LATEST_FORMAT
    body["settings"]["keep_tagged"] = ["release"]
    store.put(protocol.LATEST_KEY, _reseal(body, written_by=NEWER), mode=OVERWRITE)
    result = CliRunner().invoke(cli, ["restore", newer_run.url, str(tmp_path / "r")])
    assert result.exit_code == 10, result.output
    assert "keep_tagged" in result.output and f"cloudckpt {NEWER}" in result.output


# --------------------------------------------------------------------------- repair


def test_repair_refuses_a_newer_latest_and_changes_nothing(newer_run):
    before = _snapshot(newer_run.store)
    for kwargs in ({}, {"force": True}, {"dry_run": True}):
        with pytest.raises(UnknownFormatError) as exc_info:
            repair(newer_run.store, **kwargs)
        _refused(exc_info)
    assert _snapshot(newer_run.store) == before


def test_repair_refuses_while_any_commit_record_is_newer(newer_run):
    # LATEST really is damaged now, but a newer version's records exist: rebuilding from
    # the newest record this version reads would roll the run back past them.
    flip_bit(newer_run.store, protocol.LATEST_KEY, seed=5)
    before = _snapshot(newer_run.store)
    with pytest.raises(UnknownFormatError) as exc_info:
        repair(newer_run.store)
    _refused(exc_info)
    assert _snapshot(newer_run.store) == before


def test_repair_refuses_when_an_unreferenced_manifest_is_newer(newer_run):
    """LATEST (a newer version's) is damaged and the records of that version's commits
    were never written (best effort): every record left is this version's, but the
    manifest of the newer commit, now unreferenced, says a newer version wrote the run.
    Rebuilding from step 3's record would roll its steps 4 and 5 back, and GC would then
    delete them: repair refuses instead, changing nothing."""
    store = newer_run.store
    for obj in store.list(protocol.COMMITS_PREFIX):
        if json.loads(store.get(obj.key)[0])["format"] == NEWER_LATEST:
            store.delete(obj.key)
    prefix = json.loads(store.get(protocol.LATEST_KEY)[0])["current"]["ckpt"]  # step 5
    key = prefix + attempt_layout.MANIFEST_NAME
    body = json.loads(store.get(key)[0])
    store.put(key, _reseal(body, format="cloudckpt.manifest/99", written_by=NEWER), mode=OVERWRITE)
    flip_bit(store, protocol.LATEST_KEY, seed=5)
    before = _snapshot(store)
    for kwargs in ({}, {"dry_run": True}):
        with pytest.raises(UnknownFormatError) as exc_info:
            repair(store, **kwargs)
        assert exc_info.value.found == "cloudckpt.manifest/99"
    assert _snapshot(store) == before


# --------------------------------------------------------------------------- GC


def test_gc_deletes_nothing_of_a_run_with_a_newer_latest(newer_run):
    before = _snapshot(newer_run.store)
    with pytest.raises(UnknownFormatError):
        collect_garbage(newer_run.store)
    assert _snapshot(newer_run.store) == before


def _newer_manifest_under_a_known_latest(store) -> None:
    """LATEST stays /2 and reads, but its current checkpoint's manifest is a newer
    version's (the policy forbids writing this; a reader must still refuse it)."""
    latest_body = None
    for obj in sorted(store.list(protocol.COMMITS_PREFIX), key=lambda o: o.key, reverse=True):
        body = json.loads(store.get(obj.key)[0])
        if body["format"] != NEWER_LATEST:
            latest_body = body
            break
    assert latest_body is not None
    current = latest_body["current"]
    key = current["ckpt"] + attempt_layout.MANIFEST_NAME
    manifest = _reseal(json.loads(store.get(key)[0]), format="cloudckpt.manifest/99")
    manifest = _reseal(json.loads(manifest), written_by=NEWER)
    store.put(key, manifest, mode=OVERWRITE)
    current.update(
        manifest_sha256=hashlib.sha256(manifest).hexdigest(), manifest_size=len(manifest)
    )
    latest_body["seq"] += 100
    latest_body["parent_seq"] = latest_body["seq"] - 1
    store.put(protocol.LATEST_KEY, _reseal(latest_body), mode=OVERWRITE)


def test_gc_deletes_nothing_by_a_newer_manifest(newer_run):
    store = newer_run.store
    _newer_manifest_under_a_known_latest(store)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert latest.tombstones  # steps GC would collect, if it went on
    before = _snapshot(store)
    with pytest.raises(UnknownFormatError) as exc_info:
        collect_garbage(store)
    assert exc_info.value.found == "cloudckpt.manifest/99"
    # Refused before its first write: not even the expired tombstones were marked.
    assert _snapshot(store) == before


class WriteLog(ForwardingStore):
    """Records every call that changes the store, in order."""

    def __init__(self, inner):
        super().__init__(inner)
        self.writes: list[tuple[str, str]] = []

    def put(self, key, data, *, mode=OVERWRITE):
        self.writes.append(("put", key))
        return self.inner.put(key, data, mode=mode)

    def delete(self, key):
        self.writes.append(("delete", key))
        self.inner.delete(key)

    def delete_many(self, keys):
        self.writes += [("delete", k) for k in keys]
        self.inner.delete_many(keys)

    def create_multipart(self, key):
        self.writes.append(("create_multipart", key))
        return self.inner.create_multipart(key)

    def upload_part(self, upload, number, data, *, crc32c=None):
        self.writes.append(("upload_part", upload.key))
        return self.inner.upload_part(upload, number, data, crc32c=crc32c)

    def complete_multipart(self, upload, parts, *, mode=CREATE):
        self.writes.append(("complete_multipart", upload.key))
        return self.inner.complete_multipart(upload, parts, mode=mode)

    def abort_multipart(self, upload):
        self.writes.append(("abort", upload.key))
        self.inner.abort_multipart(upload)


@pytest.mark.parametrize("work", ["tombstones", "orphan", "upload", "records"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_gc_refuses_a_newer_manifest_before_its_first_write(
    memory_target, manager_factory, work, dry_run
):
    """Whatever the plan holds (expired tombstones, an old orphan attempt, an old
    incomplete upload, old commit records), GC reads every manifest of the run before it
    writes: a newer version's is UnknownFormatError with no write at all."""
    clock = ManualClock()
    store = open_store(memory_target.url, {"clock": clock})
    mgr = manager_factory(
        store, keep_last=2 if work == "tombstones" else 10, gc_grace=GRACE, auto_gc=False
    )
    for step in range(1, 5):
        _save(mgr, step)
    mgr.close()
    if work == "orphan":
        store.put(attempt_layout.ckpt_prefix(9, 1, "20300101T000000009Z-deadbeef") + "x", b"x")
    if work == "upload":
        store.create_multipart("stray/big")
    _newer_manifest_under_a_known_latest(store)
    clock.advance(GRACE * 3)
    keep = 1 if work == "records" else 100
    plan = plan_gc(store, keep_commit_records=keep)
    planned = {
        "tombstones": plan.checkpoints,
        "orphan": plan.orphans,
        "upload": plan.uploads,
        "records": plan.commit_records,
    }
    assert planned[work]  # what GC would do, if it went on
    assert not any(v for k, v in planned.items() if k != work)
    logged = WriteLog(store)
    plan.store = logged
    with pytest.raises(UnknownFormatError) as exc_info:
        (preview_gc if dry_run else execute_gc)(plan)
    assert exc_info.value.found == "cloudckpt.manifest/99"
    assert logged.writes == []


def _known_run(memory_target, manager_factory):
    """Steps 1-4 committed in formats this version reads; every record and attempt is
    older than grace once the test advances the clock."""
    clock = ManualClock()
    store = open_store(memory_target.url, {"clock": clock})
    mgr = manager_factory(store, keep_last=10, gc_grace=GRACE, auto_gc=False)
    for step in range(1, 5):
        _save(mgr, step)
    mgr.close()
    return store, clock


@pytest.mark.parametrize("dry_run", [False, True])
def test_gc_never_deletes_a_newer_commit_record(memory_target, manager_factory, dry_run):
    """An old commit record a newer version wrote (it wrote LATEST /99 at that seq, then
    /2 again once its new rule was no longer used: the oldest format that carries
    everything) is refused, not deleted by its name as one beyond the newest N."""
    store, clock = _known_run(memory_target, manager_factory)
    oldest = min(store.list(protocol.COMMITS_PREFIX), key=lambda o: o.key).key
    _relabel(store, oldest)
    clock.advance(GRACE * 3)
    plan = plan_gc(store, keep_commit_records=1)
    assert oldest in [r.obj.key for r in plan.commit_records]  # GC would delete it
    before = _snapshot(store)
    with pytest.raises(UnknownFormatError) as exc_info:
        (preview_gc if dry_run else execute_gc)(plan)
    _refused(exc_info)
    assert _snapshot(store) == before


def _chunk_key(prefix: str, n: int) -> str:
    return prefix + attempt_layout.CHUNKS_DIR + hashlib.sha256(b"%d" % n).hexdigest()


@pytest.mark.parametrize("case", ["manifest", "marker", "young-names-old-chunks"])
def test_gc_never_collects_what_a_newer_attempt_holds_or_names(
    memory_target, manager_factory, case
):
    """Attempts LATEST does not reference, a newer version's: an old one whose manifest is
    /99 (committed under a LATEST since rolled back, or fenced), an old one whose
    ATTEMPT.json is /2 (crashed before its manifest), and an old crashed attempt's chunks
    named only by a young attempt's /99 manifest. GC refuses before its first write."""
    store, clock = _known_run(memory_target, manager_factory)
    old = attempt_layout.ckpt_prefix(7, 1, "20300101T000000007Z-deadbeef")
    store.put(_chunk_key(old, 1), b"chunk one")
    newer_manifest = canonical.seal(
        {
            "format": "cloudckpt.manifest/99",
            "written_by": NEWER,
            "files": [{"path": "weights", "chunks": [_chunk_key(old, 1)]}],
        }
    )
    if case == "manifest":
        store.put(old + attempt_layout.MANIFEST_NAME, newer_manifest)
    if case == "marker":
        marker = {"format": "cloudckpt.attempt/2", "written_by": NEWER, "ckpt": old}
        store.put(old + attempt_layout.ATTEMPT_NAME, canonical.canonical_json(marker))
    clock.advance(GRACE * 3)
    if case == "young-names-old-chunks":
        young = attempt_layout.ckpt_prefix(8, 1, "20300101T000000008Z-deadbeef")
        store.put(young + attempt_layout.MANIFEST_NAME, newer_manifest)
    plan = plan_gc(store)
    assert [o.prefix for o in plan.orphans] == [old]  # GC would delete it
    before = _snapshot(store)
    for run in (preview_gc, execute_gc):
        with pytest.raises(UnknownFormatError) as exc_info:
            run(plan)
        assert exc_info.value.written_by == NEWER
    assert _snapshot(store) == before


# --------------------------------------------------------------------------- writers


def test_a_save_refuses_a_newer_latest_and_writes_nothing(newer_run, tmp_path):
    before = _snapshot(newer_run.store)
    mgr = CheckpointManager(newer_run.store, staging_dir=tmp_path / "s", auto_gc=False)
    try:
        with pytest.raises(UnknownFormatError) as exc_info:
            mgr.resume(tmp_path / "r")
        _refused(exc_info)
        with pytest.raises(UnknownFormatError):
            _save(mgr, 6)
    finally:
        with contextlib.suppress(UnknownFormatError):  # the failed save, again
            mgr.close(timeout=60)
    assert _snapshot(newer_run.store) == before


def test_a_save_refuses_a_newer_manifest_under_its_latest(newer_run, tmp_path):
    store = newer_run.store
    _newer_manifest_under_a_known_latest(store)
    before = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False, chunking="tensor")
    try:
        with pytest.raises(UnknownFormatError):
            _save(mgr, 6)
    finally:
        with contextlib.suppress(UnknownFormatError):  # the failed save, again
            mgr.close(timeout=60)
    after = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert after.current == before.current and 6 not in [r.step for r in after.retained()]


def test_a_newer_staging_journal_is_refused_and_kept(memory_target, tmp_path):
    staging = tmp_path / "s"
    mgr = CheckpointManager(memory_target.url, staging_dir=staging, auto_gc=False)
    mgr.close()
    attempt = staging / "attempts" / "20300101T000000000Z-deadbeef"
    (attempt / "files").mkdir(parents=True)
    journal = {"format": "cloudckpt.journal/9", "written_by": NEWER, "id": attempt.name}
    (attempt / "journal.json").write_text(json.dumps(journal))
    with pytest.raises(UnknownFormatError) as exc_info:
        CheckpointManager(memory_target.url, staging_dir=staging, auto_gc=False)
    assert exc_info.value.written_by == NEWER
    assert json.loads((attempt / "journal.json").read_text()) == journal


def test_runs_lists_every_run_flags_the_newer_one_and_exits_10(newer_run, memory_target):
    """One run a newer version wrote does not hide the others from `runs`: each is listed
    (the newer one as newer-format, with what it stores), then the command exits 10."""
    sibling = newer_run.url.rsplit("/", 1)[0] + "/other"
    with CheckpointManager(sibling, keep_last=2) as other:
        _save(other, 7)
    parent = newer_run.url.rsplit("/", 1)[0]
    result = CliRunner().invoke(cli, ["runs", parent, "--json"])
    assert result.exit_code == 10, result.output
    doc = json.loads(result.stdout)
    by_path = {r["path"]: r for r in doc["runs"]}
    assert by_path["other"]["status"] == "ok" and by_path["other"]["step"] == 7
    newer = by_path[newer_run.url.rsplit("/", 1)[1]]
    assert newer["status"] == "newer-format" and newer["step"] is None
    assert newer["stored_bytes"] > 0 and f"cloudckpt {NEWER}" in newer["problem"]
    table = CliRunner().invoke(cli, ["runs", parent])
    assert table.exit_code == 10 and "newer-format" in table.output and "other" in table.output
    assert "upgrade this host" in table.output


def test_runs_json_says_its_error_as_every_command_does(newer_run):
    """`runs --json` on a listing with a newer run: its document carries the same `error`
    object, and stderr the same lines, as any command failing on a newer format (one
    reporter, cli._common.report_error), here `gc --json`."""
    parent = newer_run.url.rsplit("/", 1)[0]
    runs = CliRunner().invoke(cli, ["runs", parent, "--json"])
    gc = CliRunner().invoke(cli, ["gc", newer_run.url, "--json"])
    assert runs.exit_code == gc.exit_code == 10
    runs_error, gc_error = json.loads(runs.stdout)["error"], json.loads(gc.stdout)["error"]
    assert set(runs_error) == set(gc_error) == {"type", "message", "hint", "exit_code"}
    for key in ("type", "hint", "exit_code"):
        assert runs_error[key] == gc_error[key]
    for result, error in ((runs, runs_error), (gc, gc_error)):
        assert result.stderr.splitlines() == [
            f"cloudckpt: error: {error['message']}",
            f"hint: {error['hint']}",
        ]
