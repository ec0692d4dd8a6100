"""``load_state`` from the store: a ``save_state`` checkpoint straight into memory or a GPU.

No local file: the checkpoint's ``tensors.safetensors`` is read with parallel ranged GETs
(``cloudckpt.fetch``) straight into the tensors it holds, every byte checked before any
tensor reaches the caller:

1. LATEST, the manifest (checked against LATEST's record) and one listing, as every
   restore (``cloudckpt.reader``); with a verified local copy in ``staging_dir``
   (``cloudckpt.localcopy``) the manifest kept with it, and no listing.
2. ``state.json`` (and ``objects.pt``, if any), verified; the safetensors header, with one
   ranged GET (or a local read) of the file's first 64 KiB. The header says where each
   tensor's bytes lie; it is checked for sanity here and, once the file has verified,
   against the verified bytes. That first read is a guess and judges nothing: a damaged
   local copy is not a damaged checkpoint, a garbled response is not a damaged object. If
   it is not a sane header, or not the header the verified file holds, the header is read
   again from the store, verified against the manifest (``fetch``: its chunks against
   their SHA-256, or the whole file against its digest), and only that read decides.
3. The tensors are allocated as the header describes (on the CPU: the tensors returned;
   for a GPU: the device tensors), or, with ``load_state(into=...)``, are the caller's
   own (``Into``: checked against the verified ``state.json``, names, shapes and dtypes,
   before any byte lands; a non-contiguous one gets its bytes through a new tensor,
   copied in once the checkpoint verified), and the file is read in parallel: each range lands
   straight in the memory of the tensor it belongs to (a range that spans several small
   tensors lands in a scratch buffer and is copied out), is hashed as it lands by the
   worker that fetched it, while the other workers' ranges are in flight; each chunk is
   checked against its SHA-256, the file against its digest.
4. To a GPU, every range lands in a pinned staging buffer and is copied to the device on a
   stream of its own as soon as it has landed (and, for a chunk, verified), overlapping
   the transfer of the other ranges; the staging buffer is reused once its copy is done.
   The stream is synchronised before anything is returned.
5. A damaged checkpoint (a flipped byte, a missing chunk) is dropped whole, its tensors
   freed, and the previous checkpoint is tried, as ``restore`` does. The caller's tensors
   (``into``) are then overwritten by that checkpoint, every one of them whole (each must
   be in it); a load that raises leaves them undefined.

Memory: the tensors returned (none with ``into``: the caller's), plus at most ``concurrency`` scratch buffers of one range
(16 MiB by default; pinned for a GPU): about 256 MiB with the default 16 workers. Nothing
else scales with the checkpoint: for a GPU target, no host copy of the state is made.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import errno
import itertools
import json
import logging
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from cloudckpt import attempt_layout, fetch, reader
from cloudckpt.errors import (
    CloudCkptError,
    ConfigurationError,
    CorruptionError,
    ObjectNotFoundError,
    UnsafePathError,
)
from cloudckpt.integrations._host_memory import host_buffer
from cloudckpt.localcopy import LocalCopies, LocalCopy
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.reader import SkippedCheckpoint
from cloudckpt.retry import call_with_retries
from cloudckpt.stores import Store
from cloudckpt.transfer import TransferEngine, aligned_buffer

HEAD_PROBE = 64 * 1024  # bytes of the safetensors file read first, for its header
MAX_HEADER = 100 * 1024 * 1024

log = logging.getLogger("cloudckpt.restore")


def pinned_staging(nbytes: int) -> torch.Tensor:
    """Page-locked host memory for the staging buffers of a restore to a GPU: the same
    page-aligned, exactly sized, CUDA-registered memory the save side's arena is made of
    (``_host_memory.host_buffer``), so saves and restores pin memory one way."""
    return host_buffer(nbytes, pin=True)


@dataclasses.dataclass
class LoadReport:
    """Where a ``load_state`` / ``resume_state`` from the store spent its time, and what
    it read. Times in seconds of wall clock, adding up to ``total_s``:

    - ``listing_s``: LATEST, the manifest, the listing, ``state.json`` and the header;
    - ``transfer_s``: from the first tensor byte requested to the last one landed
      (hashing runs inside it, on the workers, as ranges land);
    - ``verify_s``: after the last byte landed: the last digests, and waiting for the
      copies to the device;
    - ``load_s``: allocating the tensors, building the state (``objects.pt`` included).

    ``hash_cpu_s``: CPU time spent hashing, over all workers (overlapped with the
    transfer). ``bytes_local``: taken from a verified local copy (no download).
    """

    step: int | None = None
    commit_id: str = ""
    skipped: tuple[SkippedCheckpoint, ...] = ()
    from_commit_records: bool = False
    device: str = "cpu"
    total_bytes: int = 0
    bytes_downloaded: int = 0
    bytes_local: int = 0
    bytes_scratch: int = 0
    requests: int = 0
    listing_s: float = 0.0
    transfer_s: float = 0.0
    verify_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    hash_cpu_s: float = 0.0

    @property
    def source(self) -> str:
        """``"local"``, ``"store"`` or ``"local+store"``: where the bytes came from."""
        if self.bytes_local and self.bytes_downloaded:
            return "local+store"
        return "local" if self.bytes_local else "store"

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["skipped"] = [dataclasses.asdict(s) for s in self.skipped]
        d["source"] = self.source
        return d


# --------------------------------------------------------------------------- devices


Waiter = Callable[[], None]


class DeviceOps(Protocol):
    """How a restore reaches a device (abstracted so the ordering is tested on CPU)."""

    device: torch.device

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor on the device."""

    def staging(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer the device copies from (pinned for CUDA)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Waiter:
        """Start copying host ``src`` into device ``dst`` (uint8, same length); the
        waiter returns once ``src`` may be reused."""

    def finish(self) -> None:
        """Wait until every copy started is done."""


class CudaOps:
    """Host-to-device copies on a stream of their own, one event per copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device=device)
        # Built in the caller's thread: the copies wait for the work the caller queued
        # on its stream so far (e.g. a model's init kernels writing the very tensors
        # load_state(into=...) fills), or that work could land after the loaded bytes.
        self._stream.wait_stream(torch.cuda.current_stream(device))

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def staging(self, nbytes: int) -> torch.Tensor:
        return pinned_staging(nbytes)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Waiter:
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event.synchronize

    def finish(self) -> None:
        self._stream.synchronize()


def device_ops(device: str | torch.device | None) -> DeviceOps | None:
    """The ops for a CUDA target (None: the CPU, or another device reached through it)."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return CudaOps(dev)
    return None


# --------------------------------------------------------------------------- into


def via_device(t: torch.Tensor) -> bool:
    """Whether a caller's tensor is filled through the device ops (pinned staging and a
    copy stream) rather than straight from the socket or file: a CUDA tensor. (A test
    patches it to send host tensors down that path.)"""
    return t.device.type == "cuda"


def lands_in_place(t: torch.Tensor) -> bool:
    """Whether the file's bytes can land in ``t``'s memory as they are: a dense,
    contiguous layout (else they land in a new tensor, copied into ``t`` once verified)."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of memory ``t``'s elements lie in: [first, last + 1)."""
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


@dataclasses.dataclass
class Into:
    """The caller's tensors a load fills in place (``load_state(into=...)``), by the names
    ``save_state`` gives them (``_torch_format.Flattener``). ``tensors``: name -> the
    caller's tensor object. ``strict``: the checkpoint may hold no tensor ``tensors``
    lacks (with False, those come back as new tensors). ``unfillable``: paths of leaves
    that are tensors but cannot be filled (meta, sparse, quantized), for messages.
    ``device``: the one CUDA device among them (None: all on the CPU)."""

    tensors: dict[str, torch.Tensor]
    strict: bool = True
    unfillable: tuple[str, ...] = ()
    device: torch.device | None = None
    #: The step whose bytes started landing in ``tensors`` (then found damaged, when a
    #: later ``check`` runs for an older checkpoint): set by the loader.
    landed_from: int | None = None

    def _written(self) -> str:
        """What a refusal says about the caller's tensors."""
        if self.landed_from is None:
            return "nothing was written into into's tensors"
        return (
            f"bytes of the checkpoint of step {self.landed_from} (found damaged) had "
            "already landed in into's tensors: their contents are undefined"
        )

    @classmethod
    def of(
        cls, tensors: dict[str, torch.Tensor], strict: bool, unfillable: Sequence[str] = ()
    ) -> Into:
        """Check the caller's tensors can be filled: on the CPU or one CUDA device, no
        two sharing memory. Raises ConfigurationError saying which and what to do."""
        devices: set[torch.device] = set()
        for name, t in tensors.items():
            if via_device(t):
                devices.add(t.device)
            elif t.device.type != "cpu":
                raise ConfigurationError(
                    f"into's tensor {name!r} is on {t.device}; load_state fills tensors on "
                    f"the CPU or a CUDA device",
                    hint="Load without into= and copy the tensors to the device yourself, "
                    "or pass into= a state on the CPU",
                )
        if len(devices) > 1:
            raise ConfigurationError(
                f"into's tensors are on {len(devices)} devices "
                f"({', '.join(sorted(str(d) for d in devices))}); one load fills tensors on "
                "the CPU and at most one CUDA device",
                hint="Load each device's part with its own load_state(into=...) and strict=False, "
                "or move the state to one device first",
            )
        _check_no_overlap(tensors)
        return cls(dict(tensors), strict, tuple(unfillable), next(iter(devices), None))

    def check(self, doc: Mapping[str, Any], where: str) -> None:
        """That the checkpoint's tensors (``state.json``'s, verified) fit the caller's:
        the same names (unless not ``strict``: the checkpoint may hold more), and for
        each, the same shape and dtype. Called before any byte lands. Raises
        ConfigurationError naming the first differences (``where``: "the checkpoint of
        step 7")."""
        described = doc.get("tensors")
        if not isinstance(described, dict):
            raise CorruptionError(f"state.json of {where} does not describe its tensors")
        saved_as_objects = set(doc.get("object_paths") or ())
        stale = [p for p in self.unfillable if p in saved_as_objects]
        if stale and self.strict:
            raise ConfigurationError(
                f"into holds tensors that cannot be filled in place at {_some(stale)} "
                f"(meta, sparse, quantized or of a dtype safetensors lacks), and {where} "
                f"holds them as pickled objects; {self._written()}",
                hint="Pass strict=False and take them from the returned state, or load "
                "without into=",
            )
        extra = sorted(set(self.tensors) - set(described))
        if extra:
            raise ConfigurationError(
                f"into holds {len(extra)} tensor(s) {where} lacks: {_some(extra)}; "
                f"{self._written()}",
                hint="Pass into= the same structure that was saved (the names are the key "
                "paths; a tensor shared by several entries, such as tied weights, is saved "
                "once, under its first path), or load without into= and use "
                "load_state_dict(strict=False)",
            )
        missing = sorted(set(described) - set(self.tensors))
        if missing and self.strict:
            unfillable = [p for p in self.unfillable if p in described]
            raise ConfigurationError(
                f"{where} holds {len(missing)} tensor(s) into lacks: "
                f"{_some(missing)}"
                + (
                    f" (into holds tensors that cannot be filled in place at "
                    f"{_some(unfillable)}: meta, sparse or quantized)"
                    if unfillable
                    else ""
                )
                + f"; {self._written()}",
                hint="Pass strict=False to load those into new tensors (returned in the "
                "state), or pass into= the whole saved structure",
            )
        for name, mine in sorted(self.tensors.items()):
            info = described[name]
            try:
                shape = tuple(int(d) for d in info["shape"])
                dtype = getattr(torch, str(info["dtype"]))
            except (KeyError, TypeError, ValueError, AttributeError):
                raise CorruptionError(f"state.json of {where} describes {name!r} oddly") from None
            if tuple(mine.shape) != shape or mine.dtype != dtype:
                raise ConfigurationError(
                    f"into's tensor {name!r} is {_kind(mine.shape, mine.dtype)} but the "
                    f"{where} holds {_kind(shape, dtype)} there; {self._written()}",
                    hint="Build the model with the configuration it was saved with, or load "
                    "without into= to see what the checkpoint holds",
                )

    def check_header(self, slots: Sequence[_Slot], verified: bool) -> None:
        """That the safetensors header places each of the caller's tensors as
        ``state.json`` (checked by ``check``) describes it. An unverified header that does
        not is read again, verified (``_HeaderMoved``); a verified one is damage.
        Raises CorruptionError."""
        for s in slots:
            mine = self.tensors.get(s.name)
            if mine is None or (s.shape == tuple(mine.shape) and s.dtype == mine.dtype):
                continue
            if not verified:
                raise _HeaderMoved
            raise CorruptionError(
                f"tensors.safetensors and state.json disagree on {s.name!r}'s shape or dtype"
            )
        if not {s.name for s in slots} >= set(self.tensors):
            raise CorruptionError("tensors.safetensors lacks tensors state.json lists")


def _some(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")


def _kind(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _check_no_overlap(tensors: Mapping[str, torch.Tensor]) -> None:
    """Raises ConfigurationError if two of the caller's tensors share memory (partly
    overlapping views: each would be written with its own bytes, in no set order)."""
    spans = sorted(
        (t.device.type, t.device.index or 0, *_extent(t), name)
        for name, t in tensors.items()
        if t.numel()
    )
    for a, b in itertools.pairwise(spans):
        if a[:2] == b[:2] and b[2] < a[3]:
            raise ConfigurationError(
                f"into's tensors {a[4]!r} and {b[4]!r} share memory (overlapping views); "
                "filled in place, each would overwrite the other",
                hint="Pass into= a state without one of them (entries that are the same "
                "view, such as tied weights, are fine), or load without into=",
            )


# --------------------------------------------------------------------------- the header


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One tensor of the safetensors file: where its bytes lie in the file."""

    name: str
    start: int
    end: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def parse_header(
    head: bytes, size: int, dtypes: Mapping[str, torch.dtype]
) -> tuple[int, list[_Slot]]:
    """The data offset and the tensors of a safetensors file of ``size`` bytes whose first
    bytes are ``head``. Raises CorruptionError if the header is not sane (bytes out of
    the file, overlapping tensors, sizes that do not match shapes)."""
    if len(head) < 8:
        raise CorruptionError("tensors.safetensors is shorter than its header")
    (n,) = struct.unpack("<Q", head[:8])
    base = 8 + n
    if n > MAX_HEADER or base > size:
        raise CorruptionError(f"tensors.safetensors has an impossible header length {n}")
    if len(head) < base:
        raise ValueError(base)  # the caller reads more and calls again
    try:
        header = json.loads(bytes(head[8:base]))
    except (UnicodeDecodeError, ValueError):
        raise CorruptionError("the header of tensors.safetensors does not parse") from None
    if not isinstance(header, dict):
        raise CorruptionError("the header of tensors.safetensors is not an object")
    slots = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        slots.append(_slot(name, info, base, size, dtypes))
    slots.sort(key=lambda s: s.start)
    for a, b in itertools.pairwise(slots):
        if b.start < a.end:
            raise CorruptionError(
                f"tensors {a.name!r} and {b.name!r} overlap in tensors.safetensors"
            )
    return base, slots


def _slot(name: str, info: Any, base: int, size: int, dtypes: Mapping[str, torch.dtype]) -> _Slot:
    try:
        dtype = dtypes[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        start, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CorruptionError(f"tensors.safetensors describes {name!r} oddly") from None
    numel = 1
    for d in shape:
        if d < 0:
            raise CorruptionError(f"tensors.safetensors gives {name!r} a negative dimension")
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not 0 <= start <= end <= size - base or end - start != numel * itemsize:
        raise CorruptionError(f"tensors.safetensors places {name!r} outside the file")
    return _Slot(name, base + start, base + end, shape, dtype)


class _HeaderMoved(Exception):
    """The header first read is not the one the verified file holds: read it again."""


def _header_bytes(
    read: Callable[[int], bytes], size: int, dtypes: Mapping[str, torch.dtype]
) -> bytes:
    """The first bytes of a safetensors file of ``size`` bytes, through its header, by
    ``read(n)`` (the first ``n`` bytes): 64 KiB, then more if the header is longer.
    Raises CorruptionError (not a sane header, or shorter than it says), as ``read``."""
    want = min(size, HEAD_PROBE)
    while True:
        data = read(want)
        try:
            parse_header(data, size, dtypes)
        except ValueError as more:
            if want >= more.args[0] or len(data) < want:
                raise CorruptionError("tensors.safetensors is shorter than its header") from None
            want = more.args[0]
            continue
        return data


# --------------------------------------------------------------------------- the sink


def new_host_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor for a load: an ordinary ``torch.empty`` (64-byte aligned,
    ``storage_offset()`` 0, a storage of its own the caller owns; never pooled). Placing
    it in phase with the file instead (its first byte on the file offset's position in a
    cache line) saved 0.03-0.04 CPU-s per GiB on a kept copy, but left a view a few bytes
    into its storage, misaligned for the caller's own kernels for the rest of the run:
    docs/performance.md, "Restore buffers"."""
    return torch.empty(tuple(shape), dtype=dtype)


_MADV_POPULATE_WRITE = 23  # Linux 5.14 (Python's mmap module names it from 3.12 only)
_populate_works = sys.platform == "linux"
_libc: Any = None


def populate(address: int, nbytes: int) -> None:
    """Fault in the whole pages of ``[address, address + nbytes)`` with one
    ``madvise(MADV_POPULATE_WRITE)``: the kernel maps them as a write would, without the
    contents changing and without one page fault per 4 KiB page (each a trap into the
    kernel; in a VM about a third of the cost of filling fresh memory: docs/performance.md,
    "Restore buffers"). Best effort: where the kernel lacks it (Linux before 5.14, other
    systems) or refuses (out of memory), the pages fault in one by one as before."""
    global _populate_works, _libc
    if not _populate_works:
        return
    page = mmap.PAGESIZE
    lo = -(-address // page) * page
    hi = (address + nbytes) // page * page
    if hi <= lo:
        return
    if _libc is None:  # set up whole before another worker may see it
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
        _libc = libc
    failed = _libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0
    if failed and ctypes.get_errno() == errno.EINVAL:  # this kernel lacks it: stop asking
        _populate_works = False


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (same memory)."""
    return t.reshape(-1).view(torch.uint8)


def _host_view(t: torch.Tensor) -> memoryview:
    return _bytes_of(t).numpy().data.cast("B")


class TensorSink:
    """Where each file's bytes go: host memory (returned through ``direct``, copied in
    ``deliver``) or a device tensor (copied from the scratch buffer by ``ops``).

    ``targets[job]``: sorted (start, end, host view or device uint8 tensor). ``fresh[job]``:
    start -> address of the host targets that are new memory (never touched: a range is
    ``populate``d before it lands there)."""

    def __init__(self, ops: DeviceOps | None) -> None:
        self.ops = ops
        self.targets: list[list[tuple[int, int, memoryview | torch.Tensor]]] = []
        self.fresh: list[dict[int, int]] = []
        self._starts: list[list[int]] = []
        self._staging: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def add_job(
        self,
        targets: list[tuple[int, int, memoryview | torch.Tensor]],
        fresh: dict[int, int] | None = None,
    ) -> int:
        targets = sorted((t for t in targets if t[1] > t[0]), key=lambda t: t[0])
        self.targets.append(targets)
        self.fresh.append(fresh or {})
        self._starts.append([t[0] for t in targets])
        return len(self.targets) - 1

    def _overlapping(
        self, job: int, lo: int, hi: int
    ) -> list[tuple[int, int, memoryview | torch.Tensor]]:
        starts, targets = self._starts[job], self.targets[job]
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        out = []
        while i < len(targets) and targets[i][0] < hi:
            if targets[i][1] > lo:
                out.append(targets[i])
            i += 1
        return out

    # -- fetch.Sink --

    def direct(self, job: int, offset: int, length: int) -> memoryview | None:
        found = self._overlapping(job, offset, offset + length)
        if len(found) != 1:
            return None
        start, end, target = found[0]
        if not isinstance(target, memoryview) or start > offset or end < offset + length:
            return None
        address = self.fresh[job].get(start)
        if address is not None:  # one call maps the range's pages, not a fault per page
            populate(address + offset - start, length)
        return target[offset - start : offset - start + length]

    def deliver(self, job: int, offset: int, data: memoryview) -> Waiter | None:
        waiters = []
        hi = offset + len(data)
        for start, end, target in self._overlapping(job, offset, hi):
            lo, up = max(start, offset), min(end, hi)
            piece = data[lo - offset : up - offset]
            if isinstance(target, memoryview):
                target[lo - start : up - start] = piece
            else:
                assert self.ops is not None
                src = self._staging_of(data)[lo - offset : up - offset]
                waiters.append(self.ops.copy(target[lo - start : up - start], src))
        if not waiters:
            return None

        def wait() -> None:
            for w in waiters:
                w()

        return wait

    def landed(self, job: int, offset: int, length: int) -> None:
        return None

    def scratch(self, size: int) -> memoryview:
        if self.ops is None:  # page-aligned, as ``staging``'s (cache-line aligned copies)
            return aligned_buffer(size)
        buf = self.ops.staging(size)
        view = buf.numpy().data.cast("B")
        with self._lock:
            self._staging[id(view.obj)] = buf
        return view

    def _staging_of(self, data: memoryview) -> torch.Tensor:
        """The staging tensor a scratch view (always sliced from its start) lies in."""
        with self._lock:
            buf = self._staging[id(data.obj)]
        return buf[: len(data)]


# --------------------------------------------------------------------------- one checkpoint


@dataclasses.dataclass
class _Files:
    state: FileEntry
    tensors: FileEntry | None
    objects: FileEntry | None


def _files_of(manifest: Manifest, names: tuple[str, str, str]) -> _Files:
    by_path = {e.path: e for e in manifest.files}
    state_file, tensors_file, objects_file = names
    if state_file not in by_path:
        raise CloudCkptError(
            f"the checkpoint of step {manifest.step} was not written by save_state (it has "
            f"no {state_file})",
            hint="Restore it into a directory with restore(), or pass step= of a checkpoint "
            "saved with save_state",
        )
    return _Files(by_path[state_file], by_path.get(tensors_file), by_path.get(objects_file))


def _count(report: LoadReport, stats: fetch.ReadStats) -> None:
    """Add what one set of reads (``stats``) fetched, and how, to ``report``."""
    report.bytes_downloaded += stats.bytes_from_store
    report.bytes_local += stats.bytes_from_local
    report.bytes_scratch += stats.bytes_scratch
    report.requests += stats.requests
    report.hash_cpu_s += stats.hash_cpu_s


class _Loader:
    """One ``load_state`` from the store (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        engine: TransferEngine,
        *,
        ops: DeviceOps | None,
        local: LocalCopies | None,
        report: LoadReport,
        names: tuple[str, str, str],
        dtypes: Mapping[str, torch.dtype],
        build: Callable[[dict[str, Any], Mapping[str, torch.Tensor], bytes | None], Any],
        into: Into | None = None,
        fresh_on_device: bool = True,
    ) -> None:
        self.store, self.engine, self.ops, self.local = store, engine, ops, local
        self.report, self.names, self.dtypes, self.build = report, names, dtypes, build
        self.into = into
        # Tensors not in ``into`` are allocated on the device (True, with ``ops``) or on
        # the host.
        self.fresh_on_device = fresh_on_device and ops is not None

    def try_one(self, record: CheckpointRecord) -> Any:
        """The state of ``record``, or ``reader.Damaged``."""
        try:
            try:
                return self._load(record, verified_head=False)
            except _HeaderMoved:
                # The first read of the header was not the verified file's header (a
                # damaged local copy, a garbled response): load again from a verified one.
                return self._load(record, verified_head=True)
        except (CorruptionError, UnsafePathError) as exc:
            return reader.Damaged.of(exc)

    def _load(self, record: CheckpointRecord, *, verified_head: bool) -> Any:
        report = self.report
        t0 = time.perf_counter()
        copy = self.local.find(record) if self.local is not None else None
        manifest = copy.manifest(record) if copy is not None else None
        if manifest is None:
            manifest = reader.fetch_manifest(self.store, record)
        files = _files_of(manifest, self.names)
        if copy is None:
            reader.check_objects(self.store, record, manifest)
        prefix = record.ckpt + attempt_layout.FILES_DIR
        stats, small_stats = fetch.ReadStats(), fetch.ReadStats()
        small = self._small_files(prefix, manifest, files, copy, small_stats)
        doc = self._doc(small[0], record.step)
        slots: list[_Slot] = []
        head = b""
        if files.tensors is not None:
            if verified_head:
                head = self._verified_head(prefix, files.tensors, manifest, small_stats)
            else:
                head = self._head(prefix, files.tensors, copy, manifest, small_stats)
            base, slots = parse_header(head, files.tensors.size, self.dtypes)
            head = head[:base]
        missing = set(doc.get("tensors", {})) - {s.name for s in slots}
        if missing:
            raise CorruptionError(f"tensors.safetensors lacks {sorted(missing)[:5]}")
        if self.into is not None:  # before any byte lands in the caller's tensors
            self.into.check(doc, f"the checkpoint of step {record.step}")
            self.into.check_header(slots, verified_head)
        report.listing_s += time.perf_counter() - t0

        t1 = time.perf_counter()
        if self.into is not None:  # from here on, bytes land in the caller's tensors
            self.into.landed_from = record.step
        tensors, sink, header, later = self._allocate(slots, len(head))
        alloc_s = time.perf_counter() - t1
        self._read_tensors(files.tensors, copy, prefix, sink, manifest.chunk_size, stats)
        done = time.perf_counter()
        if bytes(header) != head:
            if not verified_head:
                for st in (small_stats, stats):
                    _count(report, st)
                raise _HeaderMoved
            raise CorruptionError("the header of tensors.safetensors changed while it was read")
        with torch.no_grad():  # every byte verified: the layouts bytes cannot land in
            for mine, landed in later:
                mine.copy_(landed)
        first = stats.first_request or t1
        last = max(stats.last_landed or first, first)
        report.transfer_s += last - first
        report.verify_s += done - last

        t2 = time.perf_counter()
        state = self.build(doc, tensors, small[1])
        report.load_s += time.perf_counter() - t2 + alloc_s
        report.total_bytes = manifest.total_bytes
        for st in (small_stats, stats):
            _count(report, st)
        return state

    def _read_tensors(
        self,
        entry: FileEntry | None,
        copy: LocalCopy | None,
        prefix: str,
        sink: TensorSink,
        leaf_size: int,
        stats: fetch.ReadStats,
    ) -> None:
        """Read ``entry`` (tensors.safetensors; None: there is none) from the local
        ``copy`` or the store into ``sink``, verified, then let the device copies finish
        (also when the read fails: no copy may write into tensors being freed). Raises
        CorruptionError, StoreError."""
        try:
            if entry is not None:
                job = fetch.FileJob(entry, local=copy.file(entry.path) if copy else None)
                fetch.read_files(
                    self.engine, self.store, prefix, [job], sink, leaf_size=leaf_size, stats=stats
                )
            if self.ops is not None:
                self.ops.finish()
        except BaseException:
            if self.ops is not None:
                self.ops.finish()  # no copy may write into tensors being freed
            raise

    def _small_files(
        self,
        prefix: str,
        manifest: Manifest,
        files: _Files,
        copy: LocalCopy | None,
        stats: fetch.ReadStats,
    ) -> tuple[bytes, bytes | None]:
        """``state.json`` and ``objects.pt`` (or None), verified."""
        entries = [files.state] + ([files.objects] if files.objects is not None else [])
        sink = TensorSink(None)
        buffers = []
        jobs = []
        for e in entries:
            buf = bytearray(e.size)
            buffers.append(buf)
            sink.add_job([(0, e.size, memoryview(buf))])
            jobs.append(fetch.FileJob(e, local=copy.file(e.path) if copy else None))
        fetch.read_files(
            self.engine, self.store, prefix, jobs, sink, leaf_size=manifest.chunk_size, stats=stats
        )
        return bytes(buffers[0]), (bytes(buffers[1]) if len(buffers) > 1 else None)

    def _doc(self, data: bytes, step: int) -> dict[str, Any]:
        state_file = self.names[0]
        try:
            doc = json.loads(data)
        except ValueError:
            raise CloudCkptError(f"{state_file} of step {step} does not parse") from None
        return doc if isinstance(doc, dict) else {}

    def _head(
        self,
        prefix: str,
        entry: FileEntry,
        copy: LocalCopy | None,
        manifest: Manifest,
        stats: fetch.ReadStats,
    ) -> bytes:
        """The first bytes of the safetensors file, through its header: one quick read
        (the local copy's, or one ranged GET), unverified (the whole file is checked later,
        and the header against it). If that read gives no sane header it judges nothing:
        the header is read again, verified (``_verified_head``), and that read decides.
        Raises CorruptionError (the verified header is not sane), StoreError."""
        try:
            return _header_bytes(
                lambda n: self._read_head(prefix, entry, copy, n, stats), entry.size, self.dtypes
            )
        except CorruptionError as exc:
            where = "the local copy" if copy is not None else "the store"
            log.warning(
                "the header of %s read from %s is not sane (%s); reading it again, verified",
                entry.path,
                where,
                exc.message,
            )
            return self._verified_head(prefix, entry, manifest, stats)

    def _verified_head(
        self, prefix: str, entry: FileEntry, manifest: Manifest, stats: fetch.ReadStats
    ) -> bytes:
        """The header of the safetensors file read from the store and verified against the
        manifest (``fetch``: the chunks it lies in against their SHA-256 and the file's
        digest from the chunk list; a file stored whole, or whose digest leaves are cut into
        several chunks, is read whole to check its digest). Raises CorruptionError (damage:
        a missing or damaged object, or a verified header that is not sane), StoreError."""

        def read(n: int) -> bytes:
            buf = bytearray(n)
            sink = TensorSink(None)
            sink.add_job([(0, n, memoryview(buf))])
            job = fetch.FileJob(entry, ranges=((0, n),))
            fetch.read_files(
                self.engine,
                self.store,
                prefix,
                [job],
                sink,
                leaf_size=manifest.chunk_size,
                stats=stats,
            )
            return bytes(buf)

        return _header_bytes(read, entry.size, self.dtypes)

    def _read_head(
        self, prefix: str, entry: FileEntry, copy: LocalCopy | None, n: int, stats: fetch.ReadStats
    ) -> bytes:
        if copy is not None:
            try:
                with open(copy.file(entry.path), "rb") as f:
                    data = f.read(n)
                if len(data) == n:
                    return data
            except OSError:
                pass
        pieces = []
        offset = 0
        refs = entry.chunks or ()
        if not refs:
            return self._get(prefix + entry.path, 0, n, stats)
        for ref in refs:  # the header may span the first chunks
            if offset >= n:
                break
            pieces.append(self._get(ref.key, 0, min(ref.size, n - offset), stats))
            offset += ref.size
        return b"".join(pieces)

    def _get(self, key: str, start: int, n: int, stats: fetch.ReadStats) -> bytes:
        stats.requests += 1
        try:
            return bytes(
                call_with_retries(lambda: self.store.get_range(key, start, n), what=f"read {key}")
            )
        except ObjectNotFoundError:
            raise CorruptionError(f"{key} is missing from the store") from None

    def _allocate(
        self, slots: list[_Slot], base: int
    ) -> tuple[
        dict[str, torch.Tensor], TensorSink, bytearray, list[tuple[torch.Tensor, torch.Tensor]]
    ]:
        """The tensors (host, or on the device; the caller's where ``into`` has them), the
        sink that fills them, the header's buffer, and (caller's tensor, new tensor) pairs
        to copy once verified: caller's tensors whose layout the bytes cannot land in."""
        sink = TensorSink(self.ops)
        header = bytearray(base)
        tensors: dict[str, torch.Tensor] = {}
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        targets: list[tuple[int, int, memoryview | torch.Tensor]] = [(0, base, memoryview(header))]
        fresh: dict[int, int] = {}  # the new host tensors' memory (``TensorSink.fresh``)
        mine_all = self.into.tensors if self.into is not None else {}
        for s in slots:
            mine = mine_all.get(s.name)
            new = True
            if mine is None:  # a new tensor
                on_device = self.fresh_on_device
                t = land = self._empty(s, on_device)
            else:  # the caller's
                on_device = via_device(mine)
                t = mine
                land = mine.detach()
                new = not lands_in_place(land)
                if new:
                    land = self._empty(s, on_device)
                    later.append((mine, land))
            if s.end > s.start:
                targets.append((s.start, s.end, _bytes_of(land) if on_device else _host_view(land)))
                if new and not on_device:
                    fresh[s.start] = land.data_ptr()
            tensors[s.name] = t
        sink.add_job(targets, fresh)
        return tensors, sink, header, later

    def _empty(self, s: _Slot, on_device: bool) -> torch.Tensor:
        if on_device:
            assert self.ops is not None
            return self.ops.empty(s.shape, s.dtype)
        return new_host_tensor(s.shape, s.dtype)


def load_from_store(
    store: Store,
    engine: TransferEngine,
    *,
    step: int | None,
    ops: DeviceOps | None,
    local: LocalCopies | None,
    report: LoadReport,
    names: tuple[str, str, str],
    dtypes: Mapping[str, torch.dtype],
    build: Callable[[dict[str, Any], Mapping[str, torch.Tensor], bytes | None], Any],
    into: Into | None = None,
    fresh_on_device: bool = True,
) -> Any:
    """The state of the newest intact ``save_state`` checkpoint (or ``step``), falling
    back past damaged ones (module docstring). ``build(doc, tensors, objects_bytes)``
    turns the verified parts into the state. ``into``: the caller's tensors to fill in
    place (the others are new: on the device of ``ops`` if ``fresh_on_device``).

    Raises: CheckpointNotFoundError, CorruptionError (nothing intact; ``exc.skipped``),
    CloudCkptError (not a save_state checkpoint), ConfigurationError (``into`` does not
    fit the checkpoint), StoreError.
    """
    started = time.perf_counter()
    todo, from_records = reader.readable(store, step)
    report.listing_s += time.perf_counter() - started
    loader = _Loader(
        store,
        engine,
        ops=ops,
        local=local,
        report=report,
        names=names,
        dtypes=dtypes,
        build=build,
        into=into,
        fresh_on_device=fresh_on_device,
    )
    found = reader.first_intact(store, todo, step, loader.try_one, from_records=from_records)
    report.step = found.record.step
    report.commit_id = found.record.commit_id
    report.skipped = found.skipped
    report.from_commit_records = found.from_records
    report.total_s = time.perf_counter() - started
    return found.value


def read_file_into(
    path: Path, doc: Mapping[str, Any], into: Into, dtypes: Mapping[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """The tensors of a restored directory's safetensors file at ``path``: the caller's
    (``into``, checked against ``doc`` before any byte is read into them) filled in place,
    the others new, on the CPU. Nothing is verified here: a directory a restore produced
    was verified as it was written. Raises ConfigurationError (``into`` does not fit),
    CorruptionError (the file is not what ``doc`` describes), OSError."""
    into.check(doc, f"the checkpoint in {path.parent}")
    tensors: dict[str, torch.Tensor] = {}
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = _header_bytes(lambda n: os.pread(f.fileno(), n, 0), size, dtypes)
        _, slots = parse_header(head, size, dtypes)
        into.check_header(slots, verified=True)
        for s in slots:
            mine = into.tensors.get(s.name)
            if mine is not None and not via_device(mine) and lands_in_place(mine):
                land = mine.detach()
            else:
                land = torch.empty(s.shape, dtype=s.dtype)
                if mine is not None:
                    later.append((mine, land))
            tensors[s.name] = land if mine is None else mine
            view = _host_view(land) if s.end > s.start else memoryview(b"")
            f.seek(s.start)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise CorruptionError(f"{path} is shorter than its header says")
                got += n
    with torch.no_grad():
        for mine, landed in later:
            mine.copy_(landed)
    return tensors
