"""Host memory for tensors on their way between a GPU and the store: sized to the byte,
pinned without torch's power-of-two rounding, reused across saves.

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every
block up to a power of two, so one pinned buffer per tensor costs 1.3-1.4x the state for a
typical model and up to 2x. Here a block is anonymous, page-aligned memory (``mmap``)
registered with CUDA (``cudaHostRegister``, what DCP's ``StateDictStager`` does), exactly
as large as asked (rounded to the page), and an arena carves one block per kind
(pinned / pageable) into aligned slots per save.

- ``host_buffer(nbytes, pin=True)``: one page-aligned uint8 tensor, pinned when CUDA is
  available (the restore path to GPU uses these for its host-to-device staging). Its
  memory is unpinned and unmapped when the last tensor viewing it is gone.
- ``HostArena``: one block per kind kept between saves; ``carve(sizes, pin=...)`` lays
  the sizes out (``layout``) and returns one uint8 view per size; ``reserve`` allocates
  ahead of the first save; ``stats`` reports what is held.

Pages are touched by several threads before registration: ``cudaHostRegister`` then only
locks pages already present (faulting 4 KiB at a time inside the driver is slower), and a
pageable block's first copy does not pay its page faults inside the caller's stall.
Transparent huge pages are requested (``MADV_HUGEPAGE``) where the kernel honours it.

Lifetime rule: memory is released only when no tensor views it (the mapping's own
finaliser unregisters it first), so a view never points at freed memory. A caller must not
drop its last view while an asynchronous copy into or out of it is still in flight (the
saver and the restore path synchronise first).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import dataclasses
import logging
import mmap
import os
import threading
from collections.abc import Sequence

import torch

from cloudckpt.errors import StagingError

log = logging.getLogger("cloudckpt.torch")

PAGE = mmap.PAGESIZE
#: Slot alignment inside a block: small tensors on 64 bytes (any dtype's alignment, a cache
#: line), tensors of at least ``BIG`` bytes on a page (whole pages for the DMA engine).
SMALL_ALIGN = 64
BIG = 1 << 20
#: A kept block is replaced by a smaller one when a save needs less than this share of it.
SHRINK_BELOW = 0.8
_TOUCH_SLICE = 64 << 20  # bytes per page-touching task
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, as DCP registers


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def align_of(nbytes: int) -> int:
    """The alignment of a slot of ``nbytes`` bytes (see ``SMALL_ALIGN`` / ``BIG``)."""
    return PAGE if nbytes >= BIG else SMALL_ALIGN


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of slots of ``sizes`` bytes laid out in order, each aligned per ``align_of``,
    and the bytes they span. Raises ValueError for a negative size."""
    offsets: list[int] = []
    end = 0
    for n in sizes:
        if n < 0:
            raise ValueError(f"a slot cannot be {n} bytes")
        start = _round_up(end, align_of(n))
        offsets.append(start)
        end = start + n
    return offsets, end


def cuda_pinning_available() -> bool:
    """Whether host memory can be registered with CUDA in this process."""
    return torch.cuda.is_available()


# ------------------------------------------------------------------------------ blocks


class _Mapping(mmap.mmap):
    """An anonymous mapping that unregisters itself from CUDA when it dies. Python
    finalises it only once every buffer export (every tensor viewing it) is gone, so the
    pages are never unpinned or unmapped under a live view."""

    registered_ptr: int = 0

    def __del__(self) -> None:
        ptr, self.registered_ptr = self.registered_ptr, 0
        if ptr:
            _unregister(ptr)


def _register(ptr: int, nbytes: int) -> bool:
    """cudaHostRegister; False (logged) if the driver refuses (the memory stays pageable:
    copies are then synchronous and slower, never wrong)."""
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    except (RuntimeError, AttributeError) as exc:
        log.warning("could not pin %d bytes of host memory: %s", nbytes, exc)
        return False
    if err != 0:
        log.warning(
            "could not pin %d bytes of host memory (cudaHostRegister error %d); copies "
            "from the GPU use pageable memory and are slower",
            nbytes,
            err,
        )
        return False
    return True


def _unregister(ptr: int) -> None:
    try:
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    except Exception as exc:  # interpreter shutdown, CUDA context gone: nothing to do
        log.debug("cudaHostUnregister failed: %s", exc)
        return
    if err != 0:
        log.debug("cudaHostUnregister returned %d", err)


def _touch(view: torch.Tensor, threads: int) -> None:
    """Fault every page of ``view`` in, several threads at a time (ctypes.memset releases
    the GIL)."""
    n = view.numel()
    if n == 0:
        return
    base = view.data_ptr()
    slices = [(base + i, min(_TOUCH_SLICE, n - i)) for i in range(0, n, _TOUCH_SLICE)]
    if len(slices) == 1 or threads <= 1:
        for ptr, size in slices:
            ctypes.memset(ptr, 0, size)
        return
    with cf.ThreadPoolExecutor(
        min(threads, len(slices)), thread_name_prefix="cloudckpt-touch"
    ) as ex:
        list(ex.map(lambda s: ctypes.memset(s[0], 0, s[1]), slices))


def _default_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


@dataclasses.dataclass(eq=False)
class HostBlock:
    """Page-aligned host memory: ``tensor`` (1-D uint8, ``nbytes`` long), pinned when
    ``pinned``. ``close()`` drops this object's hold; the memory goes with the last view."""

    tensor: torch.Tensor
    nbytes: int
    pinned: bool

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes at ``offset`` (a uint8 view; no copy)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"[{offset}, {offset + nbytes}) is outside a {self.nbytes}-byte block")
        return self.tensor[offset : offset + nbytes]

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0


def allocate(nbytes: int, *, pin: bool, threads: int | None = None) -> HostBlock:
    """A block of at least ``nbytes`` bytes (rounded up to the page; at least one page),
    touched, and pinned when ``pin`` and CUDA is available.

    Raises StagingError when the memory cannot be mapped (out of memory)."""
    size = max(PAGE, _round_up(nbytes, PAGE))
    try:
        mapping = _Mapping(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        raise StagingError(
            f"cannot allocate {size} bytes of host memory for tensor copies: {exc.strerror}",
            hint="Free host memory, or save a smaller state per process",
        ) from None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP off in this kernel: 4 KiB pages
            mapping.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    _touch(tensor, threads or _default_threads())
    pinned = False
    if pin and cuda_pinning_available():
        pinned = _register(tensor.data_ptr(), size)
        if pinned:
            mapping.registered_ptr = tensor.data_ptr()
    del mapping  # from now on only views keep it (and unregister it when the last goes)
    return HostBlock(tensor, size, pinned)


def host_buffer(nbytes: int, *, pin: bool = True) -> torch.Tensor:
    """A page-aligned 1-D uint8 tensor of exactly ``nbytes`` bytes, pinned when ``pin``
    and CUDA is available (``tensor.is_pinned()`` says whether it is). Views of it
    (``t[a:b].view(dtype)``) are fine; the memory is unpinned and freed when the last one
    is gone. Meant for host-to-device staging (``dst.copy_(buf_view, non_blocking=True)``):
    keep a view alive until the copy has completed.

    Raises StagingError when the memory cannot be mapped."""
    return allocate(nbytes, pin=pin).tensor[:nbytes]


# ------------------------------------------------------------------------------ arena


@dataclasses.dataclass(frozen=True)
class HostMemoryStats:
    """What a ``HostArena`` holds: bytes per kind (``pinned_bytes``: registered with CUDA
    for copies from GPUs; ``pageable_bytes``), the bytes the last carve of each kind spans
    (``used_*``: the slots, aligned), how many blocks it has allocated so far, how many
    pins CUDA refused, and (from a saver) ``state_bytes``, the tensors themselves."""

    pinned_bytes: int
    pageable_bytes: int
    used_pinned_bytes: int
    used_pageable_bytes: int
    allocations: int
    pin_failures: int
    state_bytes: int = 0  # filled by the saver: the tensors of its last save or reserve

    @property
    def total_bytes(self) -> int:
        return self.pinned_bytes + self.pageable_bytes


class HostArena:
    """One block per kind (pinned, pageable), carved into aligned slots per save and kept
    between saves. A carve that needs more than the block holds replaces it (the old one
    is released first, so at most one block per kind is held); one that needs less than
    ``SHRINK_BELOW`` of it replaces it with a smaller one. Not thread-safe: one carve at a
    time, and the caller keeps views of the previous carve unused once it carves again."""

    def __init__(self, *, threads: int | None = None) -> None:
        self._blocks: dict[bool, HostBlock | None] = {True: None, False: None}
        self._used: dict[bool, int] = {True: 0, False: 0}
        self._threads = threads
        self._lock = threading.Lock()
        self.allocations = 0
        self.pin_failures = 0

    def _block(self, nbytes: int, pin: bool) -> HostBlock | None:
        """A block of the kind able to hold ``nbytes`` (allocated or replaced as needed)."""
        block = self._blocks[pin]
        if nbytes == 0:  # this save has nothing of the kind: do not hold memory for it
            if block is not None:
                block.close()
                self._blocks[pin] = None
            return None
        if block is not None and block.nbytes >= nbytes >= SHRINK_BELOW * block.nbytes:
            return block
        if block is not None:
            block.close()
            self._blocks[pin] = None
        block = allocate(nbytes, pin=pin, threads=self._threads)
        self.allocations += 1
        if pin and cuda_pinning_available() and not block.pinned:
            self.pin_failures += 1
        self._blocks[pin] = block
        return block

    def carve(self, sizes: Sequence[int], *, pin: bool) -> list[torch.Tensor]:
        """One uint8 view per size, laid out by ``layout`` in the kind's block (``pin``:
        the pinned block, used for copies from CUDA devices).

        Raises StagingError when memory cannot be allocated."""
        offsets, total = layout(sizes)
        with self._lock:
            block = self._block(total, pin)
            self._used[pin] = total
            if block is None:
                return [torch.empty(0, dtype=torch.uint8) for _ in sizes]
            return [block.view(off, n) for off, n in zip(offsets, sizes, strict=True)]

    def reserve(self, sizes: Sequence[int], *, pin: bool) -> int:
        """Allocate (and pin, and touch) the block ``carve(sizes, pin=pin)`` will use, now
        rather than inside the first save's stall; return its size in bytes."""
        _, total = layout(sizes)
        with self._lock:
            block = self._block(total, pin)
        return 0 if block is None else block.nbytes

    def stats(self) -> HostMemoryStats:
        with self._lock:
            pinned, pageable = self._blocks[True], self._blocks[False]
            return HostMemoryStats(
                pinned_bytes=pinned.nbytes if pinned is not None else 0,
                pageable_bytes=pageable.nbytes if pageable is not None else 0,
                used_pinned_bytes=self._used[True],
                used_pageable_bytes=self._used[False],
                allocations=self.allocations,
                pin_failures=self.pin_failures,
            )

    def is_pinned(self) -> bool:
        """Whether the pinned kind's block is really registered with CUDA."""
        block = self._blocks[True]
        return block is not None and block.pinned

    def release(self) -> None:
        """Drop both blocks (their memory goes once no view of it is left)."""
        with self._lock:
            for pin, block in self._blocks.items():
                if block is not None:
                    block.close()
                self._blocks[pin] = None
                self._used[pin] = 0
