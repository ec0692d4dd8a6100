"""What ``save_state`` waits for before it returns (issue 31 item 5, the stall beside CPU
hogs): the previous save's upload, never the staged copy of it still being written after
its commit (a low-priority thread a busy host can starve for a minute): the next save
cuts that copy short, and a copy cut short is never kept, since it may have read buffers
the next save had already overwritten. And the copy itself: many small CPU tensors reach
the copier threads in tasks of about 32 MiB, in file order, every byte in place.

Real directories: a ``file://`` store and a staging directory per manager.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import cloudckpt.integrations._device_copy as dc  # noqa: E402
from cloudckpt.integrations.torch import load_state, save_state  # noqa: E402
from cloudckpt.localcopy import COMMITTED_DIR  # noqa: E402
from cloudckpt.staging import Attempt  # noqa: E402

MiB = 1024 * 1024


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(512, 1024, generator=g),  # 2 MiB
        "b": torch.randn(1000, generator=g),
        "step": seed,
    }


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a[k], b[k]) for k in ("w", "b"))


def _hold_step_1s_staged_write(monkeypatch, gate: threading.Event, wrote: list) -> None:
    """Step 1's staged copy waits for ``gate``, then writes every byte whatever cancels it
    (a write already under way when the next save reused the buffers); other steps'
    copies are written as usual."""
    real = Attempt.write_files

    def held(self, files, cancelled=None):
        if self.step != 1:
            return real(self, files, cancelled)
        gate.wait(60)
        done = real(self, files, None)
        wrote.append(done)
        return done

    monkeypatch.setattr(Attempt, "write_files", held)


def _step_1_committed_with_its_copy_held(monkeypatch, manager_factory, target):
    """Step 1 saved and committed, its staged local copy held until ``gate`` is set
    (``_hold_step_1s_staged_write``). Returns the manager, step 1's handle, the gate and
    the list the held write appends to."""
    gate = threading.Event()
    wrote: list = []
    _hold_step_1s_staged_write(monkeypatch, gate, wrote)
    mgr = manager_factory(target, keep_local=2)
    try:
        first = save_state(mgr, 1, _state(1))
        assert first.result(timeout=60).step == 1
    except BaseException:
        gate.set()
        raise
    return mgr, first, gate, wrote


def _kept(staging) -> list[str]:
    return sorted(p.name[:12] for p in (staging / COMMITTED_DIR).iterdir())


def test_the_next_save_does_not_wait_for_the_previous_saves_local_copy(
    file_target, manager_factory, monkeypatch, tmp_path
):
    mgr, _, gate, wrote = _step_1_committed_with_its_copy_held(
        monkeypatch, manager_factory, file_target
    )
    try:
        # Step 1 is committed; its staged copy, kept as the local tier, is held. Step 2
        # reuses the buffers that copy reads: it returns without waiting for it.
        second = cf.ThreadPoolExecutor(1).submit(save_state, mgr, 2, _state(2))
        handle = second.result(timeout=30)
        assert not gate.is_set() and not wrote
    finally:
        gate.set()
    assert handle.result(timeout=60).step == 2
    mgr.close()
    assert wrote == [True]
    assert _kept(mgr.staging.root) == ["000000000002"]  # step 1's copy was cut short
    for step in (1, 2):  # the store has both
        restored = mgr_restore(file_target, manager_factory, tmp_path, step)
        assert _same(restored, _state(step))


def mgr_restore(target, manager_factory, tmp_path, step: int) -> dict:
    """``step`` restored from the store alone (a new host: no local copy)."""
    other = manager_factory(target)
    try:
        return load_state(other.restore(into=tmp_path / f"r{step}", step=step))
    finally:
        other.close()


def test_a_local_copy_cut_short_is_never_kept_even_if_its_writes_completed(
    file_target, manager_factory, monkeypatch
):
    """Step 1's held write completes after step 2 copied its state into the same buffers:
    what it wrote is step 2's bytes under step 1's name. It must not become step 1's local
    copy (a restore would find it damaged at best)."""
    mgr, first, gate, wrote = _step_1_committed_with_its_copy_held(
        monkeypatch, manager_factory, file_target
    )
    try:
        second = cf.ThreadPoolExecutor(1).submit(save_state, mgr, 2, _state(2))
        handle = second.result(timeout=30)  # step 2's bytes are in the buffers now
    finally:
        gate.set()
    first._job.local_copy.result(timeout=60)  # step 1's write ran to its end
    assert wrote == [True]
    assert handle.result(timeout=60).step == 2
    mgr.close()
    assert _kept(mgr.staging.root) == ["000000000002"]
    assert not list((mgr.staging.root / "attempts").iterdir())


@pytest.mark.parametrize(
    "step, metadata, metrics",
    [
        (-2, None, None),
        (2, {"opaque": object()}, None),
        (2, None, {"loss": "high"}),
    ],
    ids=["step", "metadata", "metrics"],
)
def test_a_refused_save_never_cuts_the_previous_saves_local_copy(
    file_target, manager_factory, monkeypatch, step, metadata, metrics
):
    """A save_state the manager refuses (bad step, metadata or metrics) reuses no buffers:
    step 1's local copy, still being written, is not cut short for it, nor waited for."""
    from cloudckpt.errors import ConfigurationError

    mgr, first, gate, wrote = _step_1_committed_with_its_copy_held(
        monkeypatch, manager_factory, file_target
    )
    try:
        refused = cf.ThreadPoolExecutor(1).submit(
            save_state, mgr, step, _state(2), metadata, metrics=metrics
        )
        # It waits for step 1's outcome (committed), not for its local copy, held here.
        cf.wait([refused], timeout=20)
        assert refused.done(), "a refused save_state waited for the previous local copy"
    finally:
        gate.set()
    with pytest.raises(ConfigurationError):
        refused.result(timeout=60)
    first._job.local_copy.result(timeout=60)
    assert wrote == [True]
    assert not first._job.stop_local_copy.is_set()
    assert save_state(mgr, 2, _state(2)).result(timeout=60).step == 2
    mgr.close()
    assert _kept(mgr.staging.root) == ["000000000001", "000000000002"]


class _Recording(cf.ThreadPoolExecutor):
    """A copier pool that records the bytes of each task it is given."""

    def __init__(self) -> None:
        super().__init__(4)
        self.tasks: list[int] = []

    def submit(self, fn, /, *args, **kwargs):
        if fn is dc._copy_all:
            self.tasks.append(sum(len(frm) for _, frm in args[0]))
        return super().submit(fn, *args, **kwargs)


def test_small_cpu_tensors_reach_the_copier_threads_in_tasks_of_about_32_mib():
    small = [torch.full((MiB,), float(i)) for i in range(20)]  # 4 MiB each
    big = torch.arange(17 * MiB, dtype=torch.float32)  # 68 MiB: three slices
    tiny = torch.arange(5, dtype=torch.int16)
    srcs = [*small[:10], big, *small[10:], tiny]
    items = [
        dc.Item(f"t{i}", s, torch.empty_like(s), s.numel() * s.element_size(), "memcpy")
        for i, s in enumerate(srcs)
    ]
    watermark = dc.Watermark(sum(it.nbytes for it in items))
    copiers = _Recording()
    with copiers:
        dc.copy_items(items, watermark, copiers, None)
    # Eight 4 MiB tensors per task; the big one's slices at once, the small ones
    # before and after it gathered; what is left goes at the end.
    assert copiers.tasks == [32 * MiB, 32 * MiB, 32 * MiB, 4 * MiB, 32 * MiB, 16 * MiB + 10]
    assert watermark.position == watermark.total
    for it in items:
        assert torch.equal(it.dst, it.src)


def test_a_failed_small_copy_fails_the_watermark_and_is_raised():
    items = [
        dc.Item(f"t{i}", torch.ones(MiB), torch.empty(MiB), 4 * MiB, "memcpy") for i in range(3)
    ]
    items[1].dst = torch.empty(MiB // 2)  # numpy refuses to copy 4 MiB into 2 MiB
    watermark = dc.Watermark(12 * MiB)
    with cf.ThreadPoolExecutor(2) as copiers, pytest.raises(ValueError):
        dc.copy_items(items, watermark, copiers, None)
    assert watermark.failed and watermark.position == 0
