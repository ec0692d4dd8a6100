"""``verify_run``: every kind of damage is found (and nothing intact is reported damaged)."""

from __future__ import annotations

import pytest

from cloudckpt import CheckpointNotFoundError, protocol
from cloudckpt.stores import OVERWRITE, open_store
from cloudckpt.testing.faults import flip_bit
from cloudckpt.testing.layout import data_bit, data_key
from cloudckpt.verify import verify_run

MiB = 1024 * 1024


def _save(mgr, step, files):
    with mgr.save(step=step) as d:
        for rel, data in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)
    mgr.wait()


@pytest.fixture
def run(memory_target, manager_factory):
    """Steps 1 and 2, each a multi-chunk file (3 digest leaves) and a small one."""
    store = open_store(memory_target.url)
    mgr = manager_factory(memory_target, auto_gc=False)
    for step in (1, 2):
        _save(mgr, step, {"big.bin": bytes([step]) * (17 * MiB), "dir/small": b"s%d" % step})
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    return store, {r.step: r for r in latest.retained()}


def _by_step(report):
    return {c.step: c for c in report.checkpoints}


def test_intact_run_verifies_with_every_byte(run):
    store, _ = run
    report = verify_run(store, all=True, read_data=True, range_size=5 * MiB)
    assert report.ok and report.latest_ok
    assert [c.step for c in report.checkpoints] == [2, 1]
    assert all(c.bytes_read == 17 * MiB + 2 for c in report.checkpoints)
    assert report.commit_records_checked == 3 and not report.commit_records_damaged
    assert verify_run(store).checkpoints[0].step == 2  # default: the current one only


def test_bit_flip_in_data_is_found_only_by_reading_it(run):
    store, records = run
    key, bit = data_bit(store, records[1], "big.bin", 9 * MiB * 8 + 3)
    flip_bit(store, key, bit=bit)
    assert verify_run(store, all=True).ok  # sizes still match
    report = verify_run(store, all=True, read_data=True)
    assert not report.ok and not report.needs_repair
    assert _by_step(report)[2].ok
    (reason,) = _by_step(report)[1].reasons
    assert reason.startswith("big.bin: ") and reason.endswith("does not match its digest")


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("delete-file", "missing"),
        ("truncate-file", "is 1 bytes"),
        ("delete-manifest", "manifest: the manifest of step 2 is missing"),
        ("flip-manifest", "manifest: manifest of ckpt/"),
    ],
)
def test_metadata_level_damage_is_found_without_reading_data(run, damage, reason):
    store, records = run
    rec = records[2]
    if damage == "delete-file":
        store.delete(data_key(store, rec, "dir/small"))
    elif damage == "truncate-file":
        store.put(data_key(store, rec, "dir/small"), b"s", mode=OVERWRITE)
    elif damage == "delete-manifest":
        store.delete(rec.manifest_key)
    else:
        flip_bit(store, rec.manifest_key, seed=4)
    report = verify_run(store)
    assert not report.ok
    (check,) = report.checkpoints
    assert check.step == 2 and not check.ok
    assert "dir/small" in check.reasons[0] or "manifest" in check.reasons[0]
    assert check.reasons[0].startswith(reason) or reason in check.reasons[0]


def test_damaged_latest_needs_repair_and_checkpoints_are_still_checked(run):
    store, _ = run
    flip_bit(store, protocol.LATEST_KEY, seed=1)
    report = verify_run(store, all=True)
    assert report.needs_repair and not report.ok
    assert report.latest_source == protocol.commit_record_key(3)
    # The flipped bit breaks the seal or the JSON itself (where it lands depends on the body).
    assert "self-check" in report.latest_problem or "not valid JSON" in report.latest_problem
    assert [c.ok for c in report.checkpoints] == [True, True]
    store.delete(protocol.LATEST_KEY)
    assert "missing" in verify_run(store).latest_problem


def test_damaged_commit_record_is_reported_with_all(run):
    store, _ = run
    flip_bit(store, protocol.commit_record_key(1), seed=2)
    assert verify_run(store).ok  # not looked at by default
    report = verify_run(store, all=True)
    assert not report.ok and report.commit_records_damaged[0].startswith("commits/")
    assert report.to_dict()["commit_records"]["checked"] == 3


def test_empty_run_has_nothing_to_verify(memory_target):
    with pytest.raises(CheckpointNotFoundError):
        verify_run(open_store(memory_target.url))
