"""Short reads (issue 28 #5 and "the guards must keep up"): ``get_range_into`` is part of
every store and every wrapper forwards it, so the fault injector reaches the zero-copy
read path; a ranged read that comes back short is read again before a file is judged
truncated; a file that really is short is still damage once the retries are spent.

The cut responses themselves (FIN and RST, per backend) are in
``test_store_conformance.py`` and ``test_network_faults.py``.
"""

from __future__ import annotations

import pytest

from cloudckpt import TransferConfig
from cloudckpt.committer import read_latest
from cloudckpt.errors import TransientStoreError
from cloudckpt.restore import restore
from cloudckpt.stores import open_store
from cloudckpt.testing.faults import (
    FailBefore,
    FaultInjectingStore,
    Rule,
    ShortRead,
    truncate_object,
)
from cloudckpt.testing.wrappers import ForwardingStore
from cloudckpt.transfer import TransferEngine

TRANSFER = TransferConfig(concurrency=2, attempts=4)
CONTENT = {1: {"model.bin": b"one" * 7000, "meta.json": b"1"}, 2: {"model.bin": b"two" * 7000}}


def _data(key: str) -> bool:
    return "/files/" in key or "/chunks/" in key


def _two_steps(target, manager_factory, chunking="tensor"):
    mgr = manager_factory(target, chunking=chunking)
    for step, files in CONTENT.items():
        with mgr.save(step=step) as d:
            for name, data in files.items():
                (d / name).write_bytes(data)
    mgr.wait()
    mgr.close()
    return open_store(target.url, target.storage_options)


def _tree(root):
    return {p.name: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("wrapper", [ForwardingStore, FaultInjectingStore])
def test_wrappers_forward_the_zero_copy_read(seaweedfs_target, wrapper):
    """A wrapper's ``get_range_into`` is the inner store's, straight from the socket into
    the buffer (``S3Store.read_paths``), not the copying default of ``Store``."""
    inner = open_store(seaweedfs_target.url, seaweedfs_target.storage_options)
    inner.put("obj", bytes(range(256)) * 64)
    buf = bytearray(1000)
    assert wrapper(inner).get_range_into("obj", 300, memoryview(buf)) == 1000
    assert bytes(buf) == (bytes(range(256)) * 64)[300:1300]
    assert inner.read_paths["direct"] == 1, inner.read_paths


@pytest.mark.parametrize("backend", ["memory", "seaweedfs"])
def test_the_fault_injector_reaches_the_zero_copy_read_path(request, backend):
    """Rules on ``get_range`` fire on ``get_range_into`` too (it is the same ranged GET)."""
    target = request.getfixturevalue(f"{backend}_target")
    inner = open_store(target.url, target.storage_options)
    inner.put("obj", b"0123456789")
    faulty = FaultInjectingStore(inner)
    fail = faulty.add(Rule(FailBefore(), ops={"get_range"}, key="obj"))
    buf = bytearray(8)
    with pytest.raises(TransientStoreError):
        faulty.get_range_into("obj", 2, memoryview(buf))
    short = faulty.add(Rule(ShortRead(keep=3), ops={"get_range"}, key="obj"))
    assert faulty.get_range_into("obj", 2, memoryview(buf)) == 3 and buf[:3] == b"234"
    assert faulty.get_range_into("obj", 2, memoryview(buf)) == 8 and buf == b"23456789"
    assert fail.fired == 1 and short.fired == 1
    if backend == "seaweedfs":  # botocore's read into the buffer, then the lean GET's
        assert inner.read_paths == {"direct": 1, "lean": 1}, inner.read_paths


@pytest.mark.parametrize("chunking", ["off", "tensor"])
@pytest.mark.parametrize("backend", ["memory", "seaweedfs"])
def test_a_short_read_is_read_again_before_a_file_is_judged_truncated(
    request, manager_factory, tmp_path, backend, chunking
):
    """A ranged read of the newest checkpoint's data (a whole file, or a chunk) that
    returns half its bytes, with no error, is read again: the newest checkpoint is
    restored, nothing skipped."""
    target = request.getfixturevalue(f"{backend}_target")
    store = _two_steps(target, manager_factory, chunking)
    faulty = FaultInjectingStore(store)
    rule = faulty.add(Rule(ShortRead(), ops={"get_range"}, key=_data, times=1))
    with TransferEngine(TRANSFER) as engine:
        res = restore(faulty, tmp_path / "r", engine)
    assert rule.fired == 1
    assert res.step == 2 and not res.skipped, res.skipped
    assert _tree(res.path) == CONTENT[2]
    if backend == "seaweedfs":
        assert store.read_paths["direct"] > 0, store.read_paths


@pytest.mark.parametrize("backend", ["memory", "seaweedfs"])
def test_a_truly_short_file_is_still_damage_after_the_retries(
    request, manager_factory, tmp_path, backend
):
    """An object shorter than its manifest says answers short every time: after the
    engine's attempts the checkpoint counts as damaged and the older one is restored."""
    target = request.getfixturevalue(f"{backend}_target")
    store = _two_steps(target, manager_factory)
    current = read_latest(store).latest.current
    data = [o for o in store.list(current.ckpt) if _data(o.key) and o.size > 100]
    assert data, "step 2 stored no data object to truncate"
    truncate_object(store, data[0].key, data[0].size // 2)
    faulty = FaultInjectingStore(store)
    with TransferEngine(TRANSFER) as engine:
        res = restore(faulty, tmp_path / "r", engine)
    assert res.step == 1 and [s.step for s in res.skipped] == [2], res.skipped
    assert _tree(res.path) == CONTENT[1]
    # Read again, up to the engine's attempts, before judging.
    assert faulty.calls["get_range"] >= TRANSFER.attempts
    assert read_latest(store).latest.current.step == 2  # the run itself is untouched


def test_answers_cut_short_every_time_are_a_store_failure_not_damage(
    memory_target, manager_factory, tmp_path
):
    """Every answer for the newest checkpoint's data comes back half long, although the
    objects hold every byte (HEAD says so): the store failed, nothing is concluded about
    the data. The restore raises TransientStoreError and never restores an older step as
    if the newest were damaged (simulation seed 1430 found this)."""
    store = _two_steps(memory_target, manager_factory, "off")
    current = read_latest(store).latest.current
    faulty = FaultInjectingStore(store)
    rule = faulty.add(
        Rule(
            ShortRead(),
            ops={"get_range"},
            key=lambda k: k.startswith(current.ckpt) and _data(k),
            times=None,
        )
    )
    with TransferEngine(TRANSFER) as engine, pytest.raises(TransientStoreError, match="cut"):
        restore(faulty, tmp_path / "r", engine)
    assert rule.fired >= TRANSFER.attempts and faulty.calls["head"] >= 1
    assert not (tmp_path / "r").exists()
