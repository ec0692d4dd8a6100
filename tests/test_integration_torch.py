"""save_state / load_state: nested state dicts through the moto S3 server."""

from __future__ import annotations

import collections
import json
import math
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402

from cloudckpt import CloudCkptError, ConfigurationError, MissingDependencyError  # noqa: E402
from cloudckpt.errors import PermissionDeniedError  # noqa: E402
from cloudckpt.integrations import torch as ct  # noqa: E402
from cloudckpt.integrations.torch import StateSaver, load_state, save_state  # noqa: E402
from cloudckpt.stores import open_store  # noqa: E402
from cloudckpt.testing.faults import WRITE_OPS, FailBefore, FaultInjectingStore, Rule  # noqa: E402
from cloudckpt.transfer import MemoryFile  # noqa: E402


class Opaque:
    """Neither a tensor nor plain data: goes to objects.pt."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.value == self.value

    def __hash__(self):
        return hash(self.value)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4)
    )
    model[2].weight = torch.nn.Parameter(torch.randn(8, 4).T)  # a non-contiguous parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def _nested_state():
    model, optimizer, scheduler = _model_and_optimizer()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),  # int keys, tuples (betas), 0-d step tensors
        "scheduler": scheduler.state_dict(),
        "step": 1234,
        "name": "run-é",
        "flags": [True, False, None],
        "floats": (0.1, -0.0, math.inf, math.nan, 1e300),
        "big": 2**70,
        "dtypes": {
            "bf16": torch.randn(3, 5, dtype=torch.bfloat16),
            "f16": torch.randn(7, dtype=torch.float16),
            "i64": torch.tensor([2**62, -3], dtype=torch.int64),
            "bool": torch.tensor([[True, False], [False, True]]),
            "u8": torch.arange(5, dtype=torch.uint8),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 3),
        },
        "views": {
            "transposed": base.T,  # non-contiguous
            "strided": base[::2, 1::3],
            "tied_a": base,
            "tied_b": base,  # the same tensor twice: one entry, one object after loading
            "row": base[1],  # overlaps base: stored as its own copy
        },
        7: "an int key",
        (1, "a"): "a tuple key",
        "odd/key%": torch.ones(2),
        "rng": {"numpy": np.random.RandomState(3).get_state(), "torch": torch.get_rng_state()},
        "np_scalar": np.float32(1.5),
        "meta": {
            "dtype": torch.bfloat16,
            "device": torch.device("cpu"),
            "size": torch.Size([2, 3]),
        },
        "blob": b"\x00\xffbytes",
        "odict": collections.OrderedDict([("z", 1), ("a", 2)]),
    }


def _assert_same(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path
        if isinstance(a, float):
            assert math.copysign(1, a) == math.copysign(1, b), path


def test_round_trip_of_a_nested_state_through_s3(s3_target, manager_factory, tmp_path):
    state = _nested_state()
    writer = manager_factory(s3_target)
    handle = save_state(writer, 1234, state, metadata={"loss": 0.5})
    assert handle.blocking_seconds > 0
    info = handle.result(timeout=60)
    assert info.step == 1234 and info.metadata == {"loss": 0.5}
    assert info.num_files == 2  # tensors.safetensors + state.json: no pickle was needed

    reader = manager_factory(s3_target)
    restored = reader.resume(into=tmp_path / "restored")
    loaded = load_state(restored)
    _assert_same(state, loaded)
    assert loaded["views"]["tied_a"] is loaded["views"]["tied_b"]
    assert loaded["model"]._metadata == state["model"]._metadata
    assert type(loaded["optimizer"]["param_groups"][0]["betas"]) is tuple

    # The optimizer and model accept what came back.
    model, optimizer, scheduler = _model_and_optimizer()
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    np.random.set_state(loaded["rng"]["numpy"])

    # Any safetensors reader can open the tensors, named by their key paths.
    with safe_open(str(restored.path / "tensors.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"model/0.weight", "optimizer/state/0/exp_avg", "dtypes/bf16", "odd%2Fkey%25"} <= names
    doc = json.loads((restored.path / "state.json").read_text())
    assert doc["format"] == "cloudckpt.torch/1"
    # Views of one storage that are not the same view are independent copies, noted:
    assert ["views/row", "views/strided", "views/tied_a", "views/transposed"] in doc[
        "shared_storage"
    ]


def test_the_loop_waits_only_for_the_copy_and_buffers_are_reused(
    s3_target, manager_factory, tmp_path, monkeypatch
):
    mgr = manager_factory(s3_target)
    weights = {"w": torch.full((256, 256), 1.0), "b": torch.zeros(256)}

    real_view = MemoryFile.view
    reading = threading.Event()

    def slow_view(self, offset, length):
        reading.set()
        time.sleep(0.3)  # a slow upload, straight from the host buffers
        return real_view(self, offset, length)

    monkeypatch.setattr(MemoryFile, "view", slow_view)
    first = save_state(mgr, 1, weights)
    # Returned before anything was uploaded; the tensors may change at once.
    assert first.blocking_seconds < 0.3
    weights["w"].fill_(2.0)
    weights["b"].fill_(2.0)
    saver = ct._savers[mgr]
    allocations = saver.arena.stats().allocations
    # The second save reuses the buffers, which the first save's upload reads: it must
    # wait for that upload before copying (otherwise step 1 would get step 2's values).
    second = save_state(mgr, 2, weights)
    assert reading.is_set() and first.done()
    assert saver.arena.stats().allocations == allocations == 1  # one block, reused
    first.result(timeout=60)
    second.result(timeout=60)

    one = load_state(mgr.restore(into=tmp_path / "one", step=1))
    two = load_state(mgr.restore(into=tmp_path / "two", step=2))
    assert torch.all(one["w"] == 1.0) and torch.all(one["b"] == 0.0)
    assert torch.all(two["w"] == 2.0) and torch.all(two["b"] == 2.0)

    # A state that shrank: a block of its own size replaces the old one.
    save_state(mgr, 3, {"w": torch.ones(3)}).result(timeout=60)
    held = ct.host_memory_stats(mgr)
    assert held.state_bytes == 3 * 4 and held.total_bytes == held.pageable_bytes == 4096


def test_the_upload_reads_the_host_buffers_and_the_staged_copy_is_written_beside_it(
    s3_target, manager_factory, monkeypatch, tmp_path
):
    mgr = manager_factory(s3_target)
    release = threading.Event()
    real_read = MemoryFile.read

    def held_read(self, offset, length):
        # The upload is slow; the local copy does not wait for it. Held until the test has
        # looked (the bound only keeps a failed test from hanging): a hold that ran out on a
        # loaded CI machine let the save commit and leave attempts/ before the test looked.
        release.wait(240)
        return real_read(self, offset, length)

    monkeypatch.setattr(MemoryFile, "read", held_read)
    handle = save_state(mgr, 1, {"w": torch.arange(100_000.0), "b": torch.ones(3)})
    attempts = mgr.staging.attempts_dir
    try:
        deadline = time.monotonic() + 120
        journal: dict = {}
        while time.monotonic() < deadline and journal.get("state") != "durable":
            found = list(attempts.glob("*/journal.json"))
            journal = json.loads(found[0].read_text()) if found else {}
            time.sleep(0.02)
        assert journal.get("state") == "durable"  # a crash now would be recovered from it
        staged = next(attempts.glob("*/files/tensors.safetensors")).read_bytes()
    finally:
        release.set()
    assert handle.result(timeout=60).step == 1
    handle._job.wait_until_buffers_free()  # the staged copy is finished after the commit
    assert not list(attempts.iterdir())  # ... and leaves attempts/
    kept = mgr.staging.root / "committed"  # ... and stays as the local tier (keep_local=1)
    assert [p.read_bytes() for p in kept.glob("*/files/tensors.safetensors")] == [staged]
    restored = mgr.restore(into=tmp_path / "r")
    assert (restored.path / "tensors.safetensors").read_bytes() == staged
    state = load_state(restored)
    assert torch.equal(state["w"], torch.arange(100_000.0))


def test_close_waits_for_a_state_still_being_written(s3_target, manager_factory, monkeypatch):
    real_files = ct.memory_files

    def slow_files(*args, **kwargs):
        time.sleep(0.5)
        return real_files(*args, **kwargs)

    monkeypatch.setattr(ct, "memory_files", slow_files)
    mgr = manager_factory(s3_target)
    handle = save_state(mgr, 5, {"x": torch.ones(10)})
    mgr.close()  # must not lose the save whose files were still being written
    assert handle.done() and handle.result().step == 5
    assert manager_factory(s3_target).latest().step == 5


def test_unusual_leaves_are_pickled_and_loaded_weights_only(s3_target, manager_factory, tmp_path):
    mgr = manager_factory(s3_target)
    state = {"model": {"w": torch.ones(2)}, "extra": Opaque(3), "sparse": torch.eye(3).to_sparse()}
    save_state(mgr, 1, state).result(timeout=60)
    restored = mgr.restore(into=tmp_path / "r")
    assert (restored.path / "objects.pt").is_file()

    with pytest.raises(CloudCkptError, match="add_safe_globals"):
        load_state(restored)
    with torch.serialization.safe_globals([Opaque]):
        loaded = load_state(restored)
    assert loaded["extra"] == Opaque(3)
    assert torch.equal(loaded["sparse"].to_dense(), torch.eye(3))
    assert load_state(restored.path, weights_only=False)["extra"] == Opaque(3)


def test_bad_states_are_refused_before_anything_is_written(s3_target, manager_factory):
    mgr = manager_factory(s3_target)
    cyclic: dict = {"a": 1}
    cyclic["self"] = cyclic
    with pytest.raises(ConfigurationError, match="cycle"):
        save_state(mgr, 1, cyclic)
    with pytest.raises(ConfigurationError, match="tensor is used as a dict key"):
        save_state(mgr, 1, {torch.ones(1): 1})
    with pytest.raises(ConfigurationError, match="not supported"):
        save_state(mgr, 1, {Opaque(1): 1})
    assert mgr.latest() is None


def test_load_state_explains_a_directory_it_cannot_read(tmp_path):
    with pytest.raises(CloudCkptError, match=r"holds no state\.json"):
        load_state(tmp_path)


def test_a_private_saver_can_be_closed(s3_target, manager_factory, tmp_path):
    mgr = manager_factory(s3_target)
    saver = StateSaver(mgr)
    handle = saver.save(9, {"t": torch.arange(4)})
    saver.close()
    assert saver.host_memory().total_bytes == 0
    assert handle.result(timeout=60).step == 9
    assert torch.equal(load_state(mgr.restore(into=tmp_path / "r"))["t"], torch.arange(4))


def test_save_state_is_incremental_frozen_tensors_are_not_uploaded_again(
    s3_target, manager_factory, tmp_path
):
    """save_state uploads from host buffers as chunks cut at tensor boundaries: a frozen
    base (LoRA-style) is sent once; later saves send only what changed and name the rest."""
    mgr = manager_factory(s3_target)
    base = torch.arange(1024 * 1024, dtype=torch.float32)  # 4 MiB, frozen
    adapter = torch.zeros(1024)
    save_state(mgr, 1, {"base": base, "adapter": adapter}).result(timeout=60)
    first = mgr.last_upload
    assert first.bytes_uploaded >= base.numel() * 4 and first.bytes_reused == 0

    adapter += 1.0
    save_state(mgr, 2, {"base": base, "adapter": adapter}).result(timeout=60)
    second = mgr.last_upload
    assert second.bytes_reused >= base.numel() * 4  # the base was named, not sent
    assert second.bytes_uploaded < base.numel() * 4 // 4

    for step, expected in ((1, 0.0), (2, 1.0)):
        state = load_state(
            manager_factory(s3_target).restore(into=tmp_path / f"r{step}", step=step)
        )
        assert torch.equal(state["base"], base) and torch.all(state["adapter"] == expected)


def test_save_state_with_chunking_off_uploads_whole_files(s3_target, manager_factory, tmp_path):
    mgr = manager_factory(s3_target, chunking="off")
    base = torch.arange(1024 * 1024, dtype=torch.float32)
    for step in (1, 2):
        save_state(mgr, step, {"base": base, "step": torch.tensor(step)}).result(timeout=60)
    keys = [o.key for o in mgr.store.list("ckpt/")]
    assert not [k for k in keys if "/chunks/" in k]  # whole files, every save
    assert len([k for k in keys if k.endswith("/files/tensors.safetensors")]) == 2
    state = load_state(mgr.restore(into=tmp_path / "r", step=2))
    assert torch.equal(state["base"], base) and int(state["step"]) == 2


# -- a save that fails in the background is never silent (issue 21) --


def _unwritable(monkeypatch) -> list[int]:
    """Writing a state's files fails in the background, as every save_state did on a
    torch install without numpy. Returns the list of failed writes."""
    failed: list[int] = []

    def fail(*args, **kwargs):
        failed.append(1)
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(ct, "memory_files", fail)
    return failed


def test_a_state_that_cannot_be_written_is_raised_by_close(
    memory_target, manager_factory, monkeypatch
):
    failed = _unwritable(monkeypatch)
    mgr = manager_factory(memory_target)
    handle = save_state(mgr, 1, {"x": torch.ones(4)})  # returns: the write is in the background
    with pytest.raises(CloudCkptError, match="step 1 was abandoned") as raised:
        mgr.close()
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert failed == [1] and handle.done()


def test_a_state_that_cannot_be_written_fails_the_next_save_state_once(
    memory_target, manager_factory, monkeypatch
):
    failed = _unwritable(monkeypatch)
    mgr = manager_factory(memory_target)
    save_state(mgr, 1, {"x": torch.ones(4)})
    with pytest.raises(CloudCkptError, match="step 1 was abandoned"):
        save_state(mgr, 2, {"x": torch.ones(4)})  # the loop learns at its next checkpoint
    assert failed == [1]  # step 2 started nothing
    monkeypatch.undo()
    assert save_state(mgr, 3, {"x": torch.full((4,), 3.0)}).result(timeout=60).step == 3
    mgr.wait()  # step 1 was reported once, by save_state
    mgr.close()
    assert [c.step for c in manager_factory(memory_target).list()] == [3]


def test_a_private_saver_raises_its_last_failure_once(memory_target, manager_factory, monkeypatch):
    failed = _unwritable(monkeypatch)
    mgr = manager_factory(memory_target)
    saver = StateSaver(mgr)
    saver.save(1, {"x": torch.ones(4)})
    with pytest.raises(CloudCkptError, match="step 1 was abandoned"):
        saver.wait()
    saver.close()
    mgr.close()
    assert failed == [1]


def test_an_upload_the_store_refuses_fails_the_next_save_state(memory_target, manager_factory):
    faulty = FaultInjectingStore(open_store(memory_target.url))
    refused = faulty.add(
        Rule(FailBefore(PermissionDeniedError), ops=WRITE_OPS, key="ckpt/*", times=1)
    )
    mgr = manager_factory(faulty)
    first = save_state(mgr, 1, {"x": torch.ones(4)})
    with pytest.raises(PermissionDeniedError) as raised:
        save_state(mgr, 2, {"x": torch.ones(4)})  # it waits for step 1's upload: always told
    assert raised.value is first._future.exception()
    assert save_state(mgr, 3, {"x": torch.ones(4)}).result(timeout=60).step == 3
    mgr.close()
    assert refused.fired == 1


def test_an_earlier_failure_is_raised_before_a_refused_save_states_own_error(
    memory_target, manager_factory
):
    """A save_state refused for its arguments still waits for the previous upload and
    raises its failure first, as save() does; then, called again, its own error."""
    faulty = FaultInjectingStore(open_store(memory_target.url))
    faulty.add(Rule(FailBefore(PermissionDeniedError), ops=WRITE_OPS, key="ckpt/*", times=1))
    mgr = manager_factory(faulty)
    first = save_state(mgr, 1, {"x": torch.ones(4)})
    with pytest.raises(PermissionDeniedError) as raised:
        save_state(mgr, 2, {"x": torch.ones(4)}, {"opaque": object()})
    assert raised.value is first._future.exception()
    with pytest.raises(ConfigurationError, match="metadata"):
        save_state(mgr, 2, {"x": torch.ones(4)}, {"opaque": object()})
    assert save_state(mgr, 2, {"x": torch.ones(4)}).result(timeout=60).step == 2
    mgr.close()


def test_save_state_without_numpy_names_the_extra(memory_target, manager_factory, monkeypatch):
    from cloudckpt.integrations import _torch_format

    monkeypatch.setattr(_torch_format, "_np_module", False)  # as if `import numpy` had failed
    mgr = manager_factory(memory_target)
    # The hint names the [torch] extra and numpy (an install line that works as written:
    # docs/install.md).
    with pytest.raises(MissingDependencyError, match=r"numpy.*\[torch\]"):
        save_state(mgr, 1, {"x": torch.ones(4)})
    mgr.close()
    assert mgr.latest() is None
