"""Host memory for GPU copies (issue 24 item 2), on the CPU: slot layout, the arena's
reuse / growth / shrink rules, and the lifetime rule (memory is unpinned and unmapped only
once no view is left). Pinning itself needs CUDA: tests/test_cuda.py."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from cloudckpt.integrations import _host_memory as hm

MiB = 1024 * 1024


def _gpt2_small_state_sizes() -> list[int]:
    """Bytes of every tensor of GPT-2 small's fp32 weights and AdamW's two moments (as
    ``model.state_dict()`` + ``optimizer.state_dict()`` hold them), from its config."""
    vocab, ctx, d, layers = 50257, 1024, 768, 12
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,)]
        shapes += [(d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    params = [4 * int(torch.Size(s).numel()) for s in shapes]
    return params * 3 + [4] * len(params)  # weights, exp_avg, exp_avg_sq, step


def test_layout_aligns_every_slot_and_wastes_almost_nothing():
    sizes = [3, 0, 1, MiB, 17, 5 * MiB + 1, 64, 0, 2]
    offsets, total = hm.layout(sizes)
    ends = []
    for off, n in zip(offsets, sizes, strict=True):
        assert off % hm.align_of(n) == 0
        assert not ends or off >= ends[-1]  # in order, no overlap
        ends.append(off + n)
    assert total == ends[-1]
    assert offsets[3] % hm.PAGE == 0 and offsets[5] % hm.PAGE == 0  # big slots: whole pages
    with pytest.raises(ValueError):
        hm.layout([1, -1])

    # A real state: one arena is within 1% of the state; one power-of-two block per
    # tensor (torch's caching host allocator) would be 1.3x.
    state = _gpt2_small_state_sizes()
    _, arena = hm.layout(state)
    assert arena <= 1.01 * sum(state)
    pow2 = sum(1 << (n - 1).bit_length() for n in state)
    assert pow2 > 1.25 * sum(state)


def test_the_arena_is_carved_per_save_and_kept_across_saves():
    arena = hm.HostArena(threads=2)
    sizes = [100, MiB, 3 * MiB, 8]
    views = arena.carve(sizes, pin=False)
    assert [v.numel() for v in views] == sizes
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel()) for v in views)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # disjoint
    for i, v in enumerate(views):
        v.fill_(i)  # writable, and each slot its own
    assert [int(v[0]) for v in views] == [0, 1, 2, 3]
    base = views[0].data_ptr()
    stats = arena.stats()
    assert stats.allocations == 1 and stats.pageable_bytes >= sum(sizes)
    assert stats.pageable_bytes <= hm.layout(sizes)[1] + hm.PAGE
    assert stats.used_pageable_bytes == hm.layout(sizes)[1] and stats.pinned_bytes == 0

    # The next save of the same state: same memory, nothing allocated.
    again = arena.carve(sizes, pin=False)
    assert again[0].data_ptr() == base and arena.stats().allocations == 1
    # Slightly smaller still fits; much smaller or larger gets a block of its own size.
    arena.carve([100, MiB, 3 * MiB], pin=False)
    assert arena.stats().allocations == 1
    arena.carve([MiB], pin=False)
    assert arena.stats().allocations == 2 and arena.stats().pageable_bytes < 2 * MiB
    arena.carve([9 * MiB], pin=False)
    assert arena.stats().allocations == 3 and arena.stats().pageable_bytes >= 9 * MiB
    # The two kinds are separate blocks (pinned: for copies from CUDA devices).
    arena.carve([MiB], pin=True)
    stats = arena.stats()
    assert stats.allocations == 4 and stats.pinned_bytes >= MiB
    assert stats.pin_failures == 0  # no CUDA here: nothing to pin, nothing failed
    arena.release()
    assert arena.stats().total_bytes == 0


def test_reserve_allocates_what_the_first_carve_then_uses():
    arena = hm.HostArena()
    sizes = [MiB, 7, 2 * MiB]
    reserved = arena.reserve(sizes, pin=True)
    assert reserved >= hm.layout(sizes)[1] and arena.stats().allocations == 1
    arena.carve(sizes, pin=True)
    assert arena.stats().allocations == 1


def test_pinned_memory_is_unregistered_only_when_its_last_view_is_gone(monkeypatch):
    """The lifetime rule, with CUDA's register/unregister stood in for: a view kept past
    the arena's release (or past the block's own tensor) keeps the pages pinned and
    mapped; the unregistration comes with the last view."""
    registered: list[int] = []
    unregistered: list[int] = []
    monkeypatch.setattr(hm, "cuda_pinning_available", lambda: True)
    monkeypatch.setattr(hm, "_register", lambda ptr, n: registered.append(ptr) or True)
    monkeypatch.setattr(hm, "_unregister", unregistered.append)

    arena = hm.HostArena()
    (view,) = arena.carve([MiB], pin=True)
    assert arena.is_pinned() and registered == [view.data_ptr()]
    arena.release()
    gc.collect()
    assert unregistered == []  # a view is still alive
    view.fill_(7)  # and its memory still valid
    del view
    gc.collect()
    assert unregistered == registered

    buf = hm.host_buffer(12345)
    assert buf.numel() == 12345 and buf.data_ptr() % hm.PAGE == 0
    half = buf[:100].view(torch.int32)
    del buf
    gc.collect()
    assert len(unregistered) == 1
    del half
    gc.collect()
    assert len(unregistered) == 2


def test_a_refused_pin_leaves_pageable_memory_and_is_counted(monkeypatch, caplog):
    monkeypatch.setattr(hm, "cuda_pinning_available", lambda: True)
    monkeypatch.setattr(hm, "_register", lambda ptr, n: False)
    arena = hm.HostArena()
    (view,) = arena.carve([4096], pin=True)
    view.fill_(1)
    assert not arena.is_pinned() and arena.stats().pin_failures == 1


def test_pages_are_touched_by_several_threads(monkeypatch):
    monkeypatch.setattr(hm, "_TOUCH_SLICE", 64 * 1024)
    block = hm.allocate(MiB + 1, pin=False, threads=4)
    assert block.nbytes == MiB + hm.PAGE and not block.pinned
    assert int(block.tensor.sum()) == 0
    with pytest.raises(ValueError):
        block.view(block.nbytes - 1, 2)
