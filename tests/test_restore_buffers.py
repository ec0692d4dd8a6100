"""The restore's buffers (issue 31): new host tensors' pages mapped in one call before a
range lands, page-aligned read and scratch buffers; and what must not change with them:
every tensor handed to the caller is an ordinary one that owns its memory (never pooled,
never shared with another load's, never a view into a larger storage), and every byte is
still checked.

docs/performance.md, "Restore buffers".
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from torch_states import tied_state  # noqa: E402

from cloudckpt import fetch, transfer  # noqa: E402
from cloudckpt.download import _Directory  # noqa: E402
from cloudckpt.integrations import _torch_restore as tr  # noqa: E402
from cloudckpt.integrations.torch import load_state, save_state  # noqa: E402
from cloudckpt.transfer import TransferConfig, TransferEngine  # noqa: E402

MiB = 1024 * 1024


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_new_tensors_of_a_load_are_ordinary_and_each_owns_its_memory(
    memory_target, manager_factory, monkeypatch
):
    """Two loads of the same checkpoint: each tensor has the checkpoint's bytes and is an
    ordinary tensor (its whole storage, 64-byte aligned: the caller's kernels run on it for
    the rest of the run); no tensor shares memory with another, of the same load or of the
    other (nothing handed to a caller is pooled or reused); changing one load's tensors
    leaves the other's alone."""
    mgr = manager_factory(memory_target, chunking="tensor", keep_local=0)
    save_state(mgr, 1, tied_state(1)).result(timeout=60)
    placed: list[torch.Tensor] = []
    original = tr.new_host_tensor

    def spy(shape, dtype):
        t = original(shape, dtype)
        placed.append(t)
        return t

    monkeypatch.setattr(tr, "new_host_tensor", spy)
    reader = manager_factory(memory_target, keep_local=0)
    first, second = load_state(reader), load_state(reader)
    expected = tied_state(1)
    big = [t for t in placed if t.numel() * t.element_size() >= MiB]
    assert len(big) == 4  # w and emb, each load: the seam the mutant uses was taken
    for t in placed:
        assert t.storage_offset() == 0 and t.data_ptr() % 64 == 0
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    spans = []
    for got in (first, second):
        for k, v in got["model"].items():
            assert torch.equal(v, expected["model"][k]), k
            if v.numel() and k != "tied":  # tied is w itself
                storage = v.untyped_storage()
                spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), k))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        assert end <= start, f"{a} and {b} share memory"
    first["model"]["w"].fill_(-1.0)
    first["model"]["emb"].fill_(-1.0)
    assert torch.equal(second["model"]["w"], expected["model"]["w"])
    assert torch.equal(second["model"]["emb"], expected["model"]["emb"])


def test_only_new_tensors_have_their_pages_mapped_ahead(
    memory_target, manager_factory, monkeypatch
):
    """``populate`` runs on the memory of the tensors the load made (each range before it
    lands), never on the caller's (``into``): their pages are the caller's business."""
    mgr = manager_factory(memory_target, chunking="tensor", keep_local=0)
    save_state(mgr, 1, tied_state(1)).result(timeout=60)
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(tr, "populate", lambda address, nbytes: calls.append((address, nbytes)))
    reader = manager_factory(memory_target, keep_local=0)
    got = load_state(reader)
    spans = [
        (v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in got["model"].values()
    ]
    assert calls
    for address, nbytes in calls:
        assert any(lo <= address and address + nbytes <= hi for lo, hi in spans)
    calls.clear()
    into = {"model": {k: torch.zeros_like(v) for k, v in got["model"].items()}, "step": 0}
    into["model"]["tied"] = into["model"]["w"]
    again = load_state(reader, into=into)
    assert calls == []
    assert torch.equal(again["model"]["w"], tied_state(1)["model"]["w"])


def test_populate_maps_pages_and_keeps_their_bytes():
    size = 16 * mmap.PAGESIZE
    m = mmap.mmap(-1, size)
    view = memoryview(m)
    try:
        view[:] = bytes(range(256)) * (size // 256)
        before = bytes(view)
        base = _address(view)
        for lo, n in [(0, size), (5, 3 * mmap.PAGESIZE), (100, 10), (size - 1, 1), (0, 0)]:
            tr.populate(base + lo, n)  # whole pages inside the range only
        assert bytes(view) == before
        fresh = mmap.mmap(-1, size)
        try:
            tr.populate(_address(memoryview(fresh)), size)
            assert fresh[:] == bytes(size)  # mapped, still zeros
        finally:
            fresh.close()
    finally:
        view.release()
        m.close()


def _kernel_has_populate_write() -> bool:
    import platform

    if platform.system() != "Linux":
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (5, 14)


@pytest.mark.skipif(
    not _kernel_has_populate_write(), reason="MADV_POPULATE_WRITE needs Linux 5.14 or later"
)
def test_populate_maps_exactly_the_whole_pages_inside_the_range(monkeypatch):
    """The pages ``populate`` maps are resident afterwards (``mincore``), and only whole
    pages inside the range are: the partial pages at either edge may be another object's
    memory, never touched."""
    monkeypatch.setattr(tr, "_populate_works", True)
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    m = mmap.mmap(-1, 16 * page)  # fresh anonymous memory: no page resident yet
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))

    def resident() -> list[int]:
        vec = ctypes.create_string_buffer(16)
        assert libc.mincore(base, 16 * page, vec) == 0, ctypes.get_errno()
        return [i for i in range(16) if vec.raw[i] & 1]

    assert resident() == []
    tr.populate(base + 5, 3 * page)  # pages 0 and 3 only in part
    assert resident() == [1, 2]
    tr.populate(base + 9 * page, 2 * page)
    assert resident() == [1, 2, 9, 10]
    tr.populate(base, 16 * page)
    assert resident() == list(range(16))
    assert m[:] == bytes(16 * page)  # mapped as a write would, still zeros


def test_a_kernel_without_populate_is_asked_once(monkeypatch):
    """Linux before 5.14 answers EINVAL: the pages then fault in one by one, as before."""
    asked = []

    class _Libc:
        class madvise:  # stands in for the C function
            def __new__(cls, address, nbytes, advice):
                asked.append(advice)
                ctypes.set_errno(errno.EINVAL)
                return -1

    monkeypatch.setattr(tr, "_libc", _Libc)
    monkeypatch.setattr(tr, "_populate_works", True)
    m = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    view = memoryview(m)
    try:
        tr.populate(_address(view), len(view))
        tr.populate(_address(view), len(view))
    finally:
        view.release()
        m.close()
    assert asked == [23]
    assert tr._populate_works is False


def test_restore_read_and_scratch_buffers_are_page_aligned():
    """A bytearray's memory starts 16 bytes into its page: a kept copy read into it and
    hashed while hot pays for every 64-byte load spanning two cache lines."""
    engine = TransferEngine(TransferConfig(concurrency=2))
    try:
        for buf in (
            engine.buffers.take(3 * MiB),
            tr.TensorSink(None).scratch(3 * MiB),
            fetch._Discard().scratch(3 * MiB),
            _Directory([]).scratch(3 * MiB),
        ):
            assert len(buf) == 3 * MiB
            assert _address(memoryview(buf)) % mmap.PAGESIZE == 0
    finally:
        engine.close()


def test_a_buffer_that_cannot_be_mapped_is_a_memory_error(monkeypatch):
    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(transfer.mmap, "mmap", no_memory)
    with pytest.raises(MemoryError):
        tr.TensorSink(None).scratch(MiB)
    assert len(transfer.aligned_buffer(0)) == 0  # nothing to map
