"""Copying a state's tensors into host memory for ``save_state``: which streams are waited
for, how the copies are cut into pieces, and the watermark the upload reads behind.

**The stream rule (issue 24 item 1).** Before the first copy from a CUDA device, the saver
waits for every stream of that device: ``torch.cuda.synchronize(device)``. A tensor may
have been written last on any stream (a side-stream optimizer, FSDP's or NCCL's
communication streams, a user's stream); waiting only for the current stream, as
``save_state`` did, let a copy read a tensor before such a write landed. Recording events
where the user says would be cheaper only for a loop that keeps long-running work queued on
other streams at the moment it saves, and it would put the burden of naming every stream on
the caller; a missed one is a silently stale checkpoint. Cost: the stall includes whatever
is still queued on the device when ``save_state`` is called (usually the tail of the
optimizer step, which the copy of the weights has to wait for anyway). A save called while
a collective is in flight waits for the collective, which completes once every rank has
issued it (each rank issues its collectives in the same order, so no rank waits for one
that another rank issues only after its own save).

**Pieces (item 3).** Device-to-host copies run on a copy stream of each device's own, in
file order, cut into pieces of at most ``PIECE`` bytes (a tensor that is not contiguous is
cut along its first dimension, so the contiguous temporary the GPU makes for it is one
piece, not the whole tensor), with an event recorded after every ``PIECE`` bytes. The
caller waits for the events in order and advances a ``Watermark`` after each: the upload
reads and hashes the first pieces while the later ones are still being copied. The caller
returns once the last piece has landed, as before, so the stall is the copy itself; the
hashing runs on other cores meanwhile, and a DMA copy needs none. Copies from CPU tensors
(plain memcpys on the copier threads) are all waited for before the watermark moves: they
use the very cores the hashing would, so overlapping them would lengthen the stall.

**CPU copies.** A contiguous CPU tensor is copied with plain memcpys (numpy's, which
release the GIL) on the saver's copier threads: one larger than ``_COPY_SLICE`` in slices
of that size, smaller ones gathered, in file order, into tasks of about that size (one
hand-off per 32 MiB however many tensors: a state of many small tensors was copied one
after the other in the caller's thread, 2x slower beside two busy CPU hogs than the same
bytes on the copier threads). ``Tensor.copy_`` would split large copies over torch's
intra-op pool, whose threads spin and wait on a busy or oversubscribed host: measured
3-10x slower than a single memcpy there. A few plain threads were measured 1.5-1.7x
faster than one memcpy on 2 cores (one thread does not saturate memory bandwidth).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from cloudckpt.errors import StagingError

MiB = 1024 * 1024
PIECE = 64 * MiB  # bytes per device-to-host copy between two events

_COPY_SLICE = 32 * MiB  # bytes per memcpy handed to a copier thread
# Four copier threads per core: memcpy is memory-bound, so on an idle host two threads
# already saturate it, but on a busy one (data loaders, other jobs: the --hogs benchmark)
# the scheduler shares the CPU per thread, and more threads get the copy a larger share.
COPY_THREADS = max(2, min(32, 4 * (os.cpu_count() or 1)))

#: How an item is copied: ``dma`` (from a CUDA device, asynchronously, into pinned
#: memory), ``memcpy`` (a contiguous CPU tensor, on the copier threads), ``blocking``
#: (anything else: ``Tensor.copy_`` in the caller's thread), ``ready`` (already in host
#: memory: a numpy array copied when the state was walked).
KINDS = ("dma", "memcpy", "blocking", "ready")


def kind_of(t: torch.Tensor) -> str:
    """How ``t`` is copied into host memory (see ``KINDS``)."""
    if t.device.type == "cuda":
        return "dma"
    if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return "memcpy"
    return "blocking"


@dataclasses.dataclass
class Item:
    """One tensor of the file: ``src`` is copied into ``dst`` (a host tensor of the same
    shape and dtype, viewing the arena); ``nbytes`` is its size in the file."""

    name: str
    src: torch.Tensor | None
    dst: torch.Tensor
    nbytes: int
    kind: str
    source_device: torch.device | None = None  # default: src.device

    @property
    def device(self) -> torch.device | None:
        if self.source_device is not None:
            return self.source_device
        return None if self.src is None else self.src.device


class Watermark:
    """How many bytes of the file's data section (its tensors, in file order) are in host
    memory. The copying thread advances it; readers wait for the bytes they need."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._pos = 0
        self._error: BaseException | None = None
        self._cv = threading.Condition()

    @property
    def position(self) -> int:
        return self._pos

    @property
    def failed(self) -> bool:
        return self._error is not None

    def advance(self, upto: int) -> None:
        with self._cv:
            self._pos = max(self._pos, min(upto, self.total))
            self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = exc
            self._cv.notify_all()

    def wait(self, upto: int) -> None:
        """Return once the first ``upto`` bytes are in host memory.

        Raises StagingError (chained to the cause) if the copy failed."""
        upto = min(upto, self.total)
        with self._cv:
            while self._pos < upto and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise StagingError(
                    f"copying the state into host memory failed: {self._error!r}",
                    hint="save_state raised the cause to its caller; nothing of this step "
                    "is stored",
                ) from self._error


class CudaOps:
    """The CUDA calls the copy makes; tests on machines without a GPU stand in for it."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()

    def drain(self, stream: Any) -> None:
        stream.synchronize()


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # only without the [torch] extra's numpy
        return None
    return numpy


def _host_arrays(dst: torch.Tensor, src: torch.Tensor) -> tuple[Any, Any] | None:
    """``dst`` and ``src`` as flat uint8 numpy arrays (numpy's copy releases the GIL), or
    None where ``Tensor.copy_`` must do it (no numpy, an empty tensor)."""
    np = _numpy()
    if np is None or src.numel() == 0:
        return None
    return dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy()


def _copy_all(pairs: Sequence[tuple[Any, Any]]) -> None:
    """One copier task: plain memcpys of (to, from) numpy arrays, in order."""
    np = _numpy()
    for to, frm in pairs:
        np.copyto(to, frm)


def pieces(
    dst: torch.Tensor, src: torch.Tensor, piece: int = PIECE
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """(dst part, src part, bytes) covering the tensor in order, each at most ``piece``
    bytes where the tensor allows: contiguous tensors are cut anywhere, others along
    their first dimension (a row bigger than ``piece`` is one piece)."""
    nbytes = src.numel() * src.element_size()
    if nbytes <= piece or src.dim() == 0:
        yield dst, src, nbytes
        return
    if src.is_contiguous():
        d, s = dst.reshape(-1), src.reshape(-1)
        step = max(1, piece // src.element_size())
        for i in range(0, s.numel(), step):
            part = s[i : i + step]
            yield d[i : i + step], part, part.numel() * part.element_size()
        return
    rows = src.shape[0]
    row_bytes = nbytes // rows
    step = max(1, piece // max(1, row_bytes))
    for i in range(0, rows, step):
        part = src[i : i + step]
        yield dst[i : i + step], part, part.numel() * part.element_size()


def _results(futures: list[cf.Future]) -> None:
    for f in futures:
        f.result()


def _nothing() -> None:
    pass


def wait_for_writers(ops: CudaOps, devices: set[torch.device]) -> None:
    """The stream rule (module docstring): every stream of every device copied from."""
    for device in sorted(devices, key=str):
        ops.synchronize(device)


def copy_items(
    items: Sequence[Item],
    watermark: Watermark,
    copiers: cf.Executor | None,
    ops: CudaOps | None,
    on_copied: Callable[[], None] | None = None,
    piece: int = PIECE,
) -> None:
    """Copy every item (in file order) and advance ``watermark`` as pieces land (module
    docstring); ``on_copied`` runs once everything is copied, just before the watermark
    reaches the end. Returns when every copy has completed; no copy outlives the call,
    whatever it raises, and on a failure the watermark fails with it.

    Raises what a copy raised (a CUDA error, a KeyboardInterrupt...)."""
    copies = _Copies(ops, copiers, piece)
    try:
        _wait_for_dma_sources(items, ops)
        copies.issue(items)
        _advance_as_they_land(copies, watermark, on_copied)
    except BaseException as exc:
        copies.abandon()
        watermark.fail(exc)
        raise


def _wait_for_dma_sources(items: Sequence[Item], ops: CudaOps | None) -> None:
    """The stream rule (module docstring) for the devices ``items`` copy from. Raises
    RuntimeError (a CUDA tensor without ``ops``), what the CUDA calls raise."""
    dma = [it for it in items if it.kind == "dma"]
    if dma and ops is None:
        raise RuntimeError("a CUDA tensor to copy without CUDA")
    if dma:
        assert ops is not None
        wait_for_writers(ops, {it.device for it in dma if it.device is not None})


class _Copies:
    """The copies one ``copy_items`` issues, in one pass in file order: ``marks`` (the data
    bytes each covers, and how to wait for them), the CPU copies still running, and every
    stream used: the cleanup must see every stream and host copy issued, whatever failed.
    A stream's copies are marked by an event after every ``piece`` bytes, and when the next
    item is copied another way (or from another device)."""

    def __init__(self, ops: CudaOps | None, copiers: cf.Executor | None, piece: int) -> None:
        self.ops, self.copiers, self.piece = ops, copiers, piece
        self.marks: list[tuple[int, Callable[[], None]]] = []  # (data bytes covered, wait)
        self.cpu_work: list[cf.Future] = []
        self.streams: list[Any] = []
        self._pos = 0
        self._stream: Any = None  # the stream with copies since its last event
        self._unmarked = 0
        # Small CPU copies gathered into one copier task, and the (one-future) list its
        # items' marks wait on, filled when the task is submitted.
        self._batch: list[tuple[Any, Any]] = []
        self._batch_bytes = 0
        self._batch_futures: list[cf.Future] = []

    def issue(self, items: Sequence[Item]) -> None:
        """Start every item's copy, in file order. Raises what a copy raised."""
        for it in items:
            if it.kind == "dma":
                self._dma(it)
            else:
                self._host(it)
        self._flush()
        self._submit_batch()

    def _memcpy(self, it: Item) -> list[cf.Future]:
        """Copy a contiguous CPU tensor with plain memcpys (module docstring): at once
        without copier threads; else a tensor larger than ``_COPY_SLICE`` in slices of
        it, one task each, and smaller ones gathered into tasks of about that size.
        Returns the futures covering it (the batch's list fills once it is submitted)."""
        assert it.src is not None
        arrays = _host_arrays(it.dst, it.src)
        if arrays is None:
            it.dst.copy_(it.src)
            return []
        to, frm = arrays
        if self.copiers is None:
            _copy_all([(to, frm)])
            return []
        if len(frm) > _COPY_SLICE:
            futures = [
                self.copiers.submit(
                    _copy_all, [(to[i : i + _COPY_SLICE], frm[i : i + _COPY_SLICE])]
                )
                for i in range(0, len(frm), _COPY_SLICE)
            ]
            self.cpu_work += futures
            return futures
        self._batch.append((to, frm))
        self._batch_bytes += len(frm)
        covering = self._batch_futures
        if self._batch_bytes >= _COPY_SLICE:
            self._submit_batch()
        return covering

    def _submit_batch(self) -> None:
        """Hand the gathered small copies to a copier thread as one task."""
        if self._batch:
            assert self.copiers is not None
            future = self.copiers.submit(_copy_all, self._batch)
            self._batch_futures.append(future)
            self.cpu_work.append(future)
        self._batch, self._batch_bytes, self._batch_futures = [], 0, []

    def abandon(self) -> None:
        """Wait for every copy issued (none outlives ``copy_items``), errors ignored."""
        cf.wait(self.cpu_work)
        if self.ops is None:
            return  # (no stream was used)
        for s in self.streams:
            # A broken stream (a CUDA error) runs none of its copies either.
            with contextlib.suppress(Exception):
                self.ops.drain(s)

    def _flush(self) -> None:
        """An event after the open stream's unmarked copies, and a mark waiting for it."""
        if self._stream is not None:
            assert self.ops is not None
            event = self.ops.record(self._stream)
            self.marks.append((self._pos, functools.partial(self.ops.wait, event)))
        self._stream, self._unmarked = None, 0

    def _dma(self, it: Item) -> None:
        assert it.src is not None and it.device is not None and self.ops is not None
        s = self.ops.stream(it.device)
        if self._stream is not None and s is not self._stream:
            self._flush()
        if s not in self.streams:
            self.streams.append(s)
        for d, src, n in pieces(it.dst, it.src, self.piece):
            if n:
                self.ops.copy(d, src, s)
            self._stream, self._unmarked, self._pos = s, self._unmarked + n, self._pos + n
            if self._unmarked >= self.piece:
                self._flush()

    def _host(self, it: Item) -> None:
        self._flush()
        self._pos += it.nbytes
        if it.kind == "memcpy":
            assert it.src is not None
            self.marks.append((self._pos, functools.partial(_results, self._memcpy(it))))
        elif it.kind == "blocking":
            assert it.src is not None
            it.dst.copy_(it.src)
            self.marks.append((self._pos, _nothing))
        else:
            self.marks.append((self._pos, _nothing))


def _advance_as_they_land(
    copies: _Copies, watermark: Watermark, on_copied: Callable[[], None] | None
) -> None:
    """Wait for ``copies``' marks in order, advancing ``watermark`` after each;
    ``on_copied`` just before the last. Raises what a copy raised."""
    for future in copies.cpu_work:  # see the module docstring: before the watermark moves
        future.result()
    marks = copies.marks
    for i, (end, wait) in enumerate(marks):
        wait()
        if i == len(marks) - 1 and on_copied is not None:
            on_copied()
        watermark.advance(end)
    if not marks and on_copied is not None:
        on_copied()
    watermark.advance(watermark.total)
