"""The GPU copy logic of save_state on a machine without a GPU (issue 24 items 1, 3, 6).

``cloudckpt.integrations._device_copy`` makes its few CUDA calls through ``CudaOps``; here a
recorder stands in for it (its "device copies" are CPU copies whose completion the test
releases piece by piece), so the ordering the module promises is checked for real: every
stream of a device waited for before the first copy from it, pieces in file order, the
watermark advancing only past pieces that have landed, the upload reading behind it, and a
failure stopping every reader. The same paths on a real GPU: tests/test_cuda.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import cloudckpt.integrations._device_copy as dc
import cloudckpt.integrations.torch as ct
from cloudckpt.errors import StagingError
from cloudckpt.integrations.torch import load_state, save_state
from cloudckpt.transfer import MemoryFile

KiB = 1024
MiB8 = 8 * 1024 * 1024


class FakeCuda(dc.CudaOps):
    """Records the calls; a copy happens at once, but its event completes only when the
    test releases it (``release(n)``: the first n events), as a DMA engine would finish."""

    def __init__(self, fail_on_copy: int | None = None) -> None:
        super().__init__()
        self.calls: list[tuple] = []
        self.events: list[threading.Event] = []
        self.fail_on_copy = fail_on_copy
        self.copies = 0

    def synchronize(self, device):
        self.calls.append(("synchronize", str(device)))

    def stream(self, device):
        return ("stream", str(device))

    def copy(self, dst, src, stream):
        self.copies += 1
        if self.fail_on_copy is not None and self.copies == self.fail_on_copy:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.calls.append(("copy", stream[1], src.numel() * src.element_size()))
        dst.copy_(src)

    def record(self, stream):
        event = threading.Event()
        self.events.append(event)
        self.calls.append(("record", stream[1], len(self.events) - 1))
        return event

    def wait(self, event):
        assert event.wait(30), "an event the test never released"

    def drain(self, stream):
        self.calls.append(("drain", stream[1]))

    def release(self, n: int) -> None:
        for event in self.events[:n]:
            event.set()


def _item(name, src, kind, device=None):
    dst = torch.empty_like(src)
    n = src.numel() * src.element_size()
    return dc.Item(name, src, dst, n, kind, torch.device(device) if device else None)


def _run(items, watermark, ops, piece):
    errors: list[BaseException] = []

    def target():
        try:
            dc.copy_items(items, watermark, None, ops, piece=piece)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, errors


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_every_stream_is_waited_for_then_pieces_land_in_order_behind_the_watermark():
    ops = FakeCuda()
    a = torch.arange(3 * KiB, dtype=torch.float32)  # 12 KiB: three 4 KiB pieces
    b = torch.arange(KiB, dtype=torch.int32)  # from another device
    c = torch.arange(10, dtype=torch.int64)  # a CPU tensor
    items = [
        _item("a", a, "dma", "cuda:0"),
        _item("b", b, "dma", "cuda:1"),
        _item("c", c, "memcpy"),
    ]
    total = sum(it.nbytes for it in items)
    watermark = dc.Watermark(total)
    thread, errors = _run(items, watermark, ops, piece=4 * KiB)

    # The rule: every stream of every device waited for before any copy.
    _until(lambda: len(ops.events) == 4, "the copies were not all issued")
    kinds = [c[0] for c in ops.calls]
    assert kinds[:2] == ["synchronize", "synchronize"]
    assert {c[1] for c in ops.calls[:2]} == {"cuda:0", "cuda:1"}
    assert [c for c in ops.calls if c[0] == "copy"] == [
        ("copy", "cuda:0", 4 * KiB),
        ("copy", "cuda:0", 4 * KiB),
        ("copy", "cuda:0", 4 * KiB),
        ("copy", "cuda:1", 4 * KiB),
    ]
    # An event after each piece (4 KiB), and one before the device changes.
    assert [c for c in ops.calls if c[0] == "record"] == [
        ("record", "cuda:0", 0),
        ("record", "cuda:0", 1),
        ("record", "cuda:0", 2),
        ("record", "cuda:1", 3),
    ]

    # Readers of the file's data wait for the bytes they need, piece by piece.
    got: list[int] = []
    reader = threading.Thread(target=lambda: (watermark.wait(5 * KiB), got.append(1)))
    reader.start()
    time.sleep(0.05)
    assert watermark.position == 0 and not got
    ops.release(1)
    _until(lambda: watermark.position == 4 * KiB, "the first piece did not advance it")
    assert not got  # 5 KiB are not all there yet
    ops.release(2)
    reader.join(30)
    assert got == [1] and watermark.position == 8 * KiB
    ops.release(4)
    thread.join(30)
    assert not errors and watermark.position == total
    for it in items:
        assert torch.equal(it.dst, it.src)


def test_a_failed_copy_stops_the_readers_and_leaves_no_copy_running():
    ops = FakeCuda(fail_on_copy=2)
    a = torch.ones(2 * KiB)
    watermark = dc.Watermark(a.numel() * 4)
    thread, errors = _run([_item("a", a, "dma", "cuda:0")], watermark, ops, piece=4 * KiB)
    thread.join(30)
    assert len(errors) == 1 and "illegal memory access" in str(errors[0])
    assert ("drain", "cuda:0") in ops.calls  # what was issued has completed
    with pytest.raises(StagingError) as raised:
        watermark.wait(1)
    assert raised.value.__cause__ is errors[0]


def test_copy_kinds_and_pieces():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert dc.kind_of(t) == "memcpy"
    assert dc.kind_of(t.t()) == "blocking"  # not contiguous: Tensor.copy_
    assert dc.kind_of(torch.empty(3, device="meta")) == "blocking"

    # Contiguous: cut anywhere; not contiguous: along the first dimension (so the GPU's
    # contiguous temporary is one piece); together they cover the tensor exactly.
    for src in (t, t.t(), t[:, ::2]):
        dst = torch.empty(src.shape, dtype=src.dtype)
        parts = list(dc.pieces(dst, src, piece=32))
        assert sum(n for *_, n in parts) == src.numel() * 4
        assert all(n <= 32 or (d.dim() and d.shape[0] == 1) for d, _, n in parts)
        for d, s, _ in parts:
            d.copy_(s)
        assert torch.equal(dst, src)


def _fake_gpu(monkeypatch, ops: FakeCuda, piece: int) -> None:
    """save_state treats the state's CPU tensors as tensors on cuda:0, copied by ``ops``
    in pieces of ``piece`` bytes."""
    monkeypatch.setattr(ct, "kind_of", lambda t: "dma")
    monkeypatch.setattr(ct.StateSaver, "_cuda_ops", lambda self, items: ops)
    real_plan = ct.StateSaver._plan

    def plan(self, flat):
        items, buffers = real_plan(self, flat)
        for it in items:
            it.source_device = torch.device("cuda:0")
        return items, buffers

    monkeypatch.setattr(ct.StateSaver, "_plan", plan)
    monkeypatch.setattr(ct, "copy_items", lambda *a, **k: dc.copy_items(*a, **k, piece=piece))


def test_the_upload_reads_the_first_pieces_while_later_ones_are_still_copying(
    s3_target, manager_factory, tmp_path, monkeypatch
):
    ops = FakeCuda()
    _fake_gpu(monkeypatch, ops, piece=MiB8)
    mgr = manager_factory(s3_target)
    # Four 8 MiB pieces: the upload reads (hashes, sends) the file in 8 MiB leaves.
    state = {f"w{i}": torch.full((MiB8 // 4,), float(i)) for i in range(4)}
    reads: list[int] = []
    real_view = MemoryFile.view

    def view(self, offset, length):
        out = real_view(self, offset, length)
        reads.append(offset + length)
        return out

    monkeypatch.setattr(MemoryFile, "view", view)
    handles: list = []
    saver = threading.Thread(target=lambda: handles.append(save_state(mgr, 1, state)))
    saver.start()
    _until(lambda: len(ops.events) == 4, "the copies were not all issued")
    assert ops.calls[0] == ("synchronize", "cuda:0")
    ops.release(1)
    # The first piece is read (hashed, uploaded) while three are still being copied, and
    # save_state has not returned: the stall is still the copy.
    _until(lambda: any(r > MiB8 // 2 for r in reads), "nothing was read behind the first piece")
    time.sleep(0.1)
    assert saver.is_alive() and not handles
    assert max(reads) <= MiB8 + 4 * KiB  # no read past the first piece (and the header)
    ops.release(4)
    saver.join(30)
    info = handles[0].result(timeout=60)
    assert handles[0].blocking_seconds > 0 and info.blocking_seconds > 0
    restored = load_state(mgr.restore(into=tmp_path / "r"))
    for name, t in state.items():
        assert torch.equal(restored[name], t)


def test_a_copy_that_fails_after_the_upload_started_stores_nothing_and_is_raised_once(
    s3_target, manager_factory, monkeypatch
):
    ops = FakeCuda(fail_on_copy=3)
    _fake_gpu(monkeypatch, ops, piece=64 * KiB)
    ops.wait = lambda event: None  # every piece lands at once: the upload runs ahead
    mgr = manager_factory(s3_target)
    state = {f"w{i}": torch.full((64 * KiB // 4,), float(i)) for i in range(4)}
    with pytest.raises(RuntimeError, match="illegal memory access"):
        save_state(mgr, 1, state)
    mgr.wait()  # told once, by save_state itself: not raised again
    assert mgr.list() == []  # nothing of step 1 was committed
    monkeypatch.undo()
    assert save_state(mgr, 2, {"x": torch.ones(3)}).result(timeout=60).step == 2
    mgr.close()


def test_host_memory_reserved_before_the_first_save_is_the_memory_it_uses(
    memory_target, manager_factory, tmp_path
):
    import numpy as np

    mgr = manager_factory(memory_target)
    state = {
        "w": torch.ones(300_000),
        "b": torch.zeros(7, dtype=torch.bfloat16),
        "rng": np.arange(10),  # copied when the state is walked: needs no host memory
        "step": 4,
    }
    held = ct.reserve_host_memory(mgr, state)
    assert held.allocations == 1 and held.state_bytes == 300_000 * 4 + 7 * 2
    assert held.state_bytes <= held.pageable_bytes <= held.state_bytes + 2 * 4096
    save_state(mgr, 1, state).result(timeout=60)
    after = ct.host_memory_stats(mgr)
    assert after.allocations == 1 and after.used_pageable_bytes <= after.pageable_bytes
    loaded = load_state(mgr.restore(into=tmp_path / "r"))
    assert torch.equal(loaded["w"], state["w"]) and (loaded["rng"] == state["rng"]).all()
