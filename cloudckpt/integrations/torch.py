"""Plain PyTorch state dicts: ``save_state`` and ``load_state``.

::

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import load_state, save_state

    mgr = CheckpointManager("s3://bucket/runs/exp1", staging_dir="/nvme/ckpt")
    restored = mgr.resume(into="/nvme/restore")          # None for a new run
    if restored is not None:
        state = load_state(restored)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    ...
    handle = save_state(mgr, step, {"model": model.state_dict(),
                                    "optimizer": optimizer.state_dict(), "step": step})
    # training continues at once; handle.result() waits for the commit

What ``save_state`` does, and what the training loop waits for:

1. (caller) Walk the state: nested dicts (any JSON-able keys, including the ``int`` keys of
   ``optimizer.state_dict()``), lists and tuples; tensors; plain values.
2. (caller) Wait for the previous ``save_state`` of this manager to be done with its host
   buffers (uploaded and committed, or failed), because they are about to be reused.
3. (caller) Copy every tensor into reused host memory (``HostArena``: one block per kind,
   carved per save, kept between saves). From a CUDA device: first wait for every stream
   of the device (``torch.cuda.synchronize(device)``: a tensor last written on a side
   stream is copied after that write), then copy into pinned memory on a copy stream of
   the saver's own, in pieces of at most 64 MiB with an event after each. This copy is
   all the loop waits for; after it the tensors may change freely.
4. (background, from the first piece on) Describe the files in memory:
   ``tensors.safetensors`` laid out as its header followed by the host memory itself (no
   copy, ``transfer.MemoryFile``), a small ``state.json`` describing the structure and the
   plain values, and, only if some leaf is neither a tensor nor a plain value,
   ``objects.pt``. The manager uploads them straight from memory and commits: the upload
   reads (hashes, sends) each piece as soon as it has landed, while later pieces are
   still being copied from the GPU (``_device_copy``). The staged copy on local disk,
   which only a crash before the commit would need, is written and fsynced beside the
   upload (the commit does not wait for it) and dropped once the commit lands. A buffer
   safetensors' own layout cannot describe here (a big-endian host) falls back to writing
   the files once the copy is done.

Host memory: pinned (registered with CUDA with ``cudaHostRegister``, as DCP's stager does)
for tensors on CUDA devices, pageable for the rest, each kind one page-aligned block sized
to the state (slots aligned to 64 bytes, 4 KiB for tensors of 1 MiB or more; torch's
``pin_memory=True`` would round every tensor up to a power of two: 1.3-2x the state). So
host memory is one copy of the state plus at most a page per large tensor, allocated and
pinned by the first save (inside its stall) or ahead of it by ``reserve_host_memory``;
steady-state saves allocate and pin nothing. A second ``save_state`` issued while the
first is still uploading waits for that upload rather than allocate a second copy:
checkpoints are minutes apart and an upload takes seconds, so the wait is almost always
zero, and host RAM is usually what is short. A state that grows gets a larger block (the
old one is released first); one that shrinks below 80% of the block gets a smaller one.
``host_memory_stats(manager)`` reports it; ``StateSaver(manager).close()`` frees it.

File format (``cloudckpt.torch/1``):

- ``tensors.safetensors``: every dense tensor, named by its key path (``model/encoder.weight``,
  ``optimizer/state/0/exp_avg``; ``/`` and ``%`` in keys are %-escaped). Any safetensors
  reader can open it. numpy arrays (e.g. numpy's RNG state) are stored here too.
- ``state.json``: the tree. Dicts keep their key types (str, int, float, bool, None,
  tuples) and whether they were ``OrderedDict`` (with a state dict's ``_metadata``);
  lists stay lists and tuples tuples; floats round-trip exactly (NaN and infinities
  included); bytes, ``torch.dtype``, ``torch.device``, ``torch.Size`` and numpy scalars
  are encoded too.
- ``objects.pt`` (rare): leaves of any other type, ``torch.save``-d in the caller's thread
  (they may be mutable) and loaded with ``torch.load(weights_only=True)``. Allow extra
  types with ``torch.serialization.add_safe_globals`` or, for trusted checkpoints only,
  ``load_state(..., weights_only=False)``. Sparse, quantized and other non-dense tensors,
  and dtypes safetensors lacks, go here as well (cloned at save time).

Tensors are saved contiguous with their shape and dtype (bfloat16, float16, int64, bool,
0-d...); strides are not kept. Entries that are the *same view* of the same memory (tied
weights such as GPT-2's ``lm_head.weight`` and ``wte.weight``) are stored once and load as
one tensor, so ties survive a round trip. Views that only partly overlap are stored as
independent copies (listed under ``shared_storage`` in ``state.json``). ``load_state``
returns CPU tensors unless ``device=`` says otherwise; ``nn.Parameter`` leaves come back as
plain tensors, as ``state_dict()`` returns them.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import io
import json
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cloudckpt._version import __version__
from cloudckpt.errors import (
    CloudCkptError,
    ConfigurationError,
    CorruptionError,
    MissingDependencyError,
)
from cloudckpt.integrations._device_copy import (
    COPY_THREADS,
    CudaOps,
    Item,
    Watermark,
    copy_items,
    kind_of,
)
from cloudckpt.integrations._host_memory import HostArena, HostMemoryStats
from cloudckpt.integrations._torch_restore import LoadReport
from cloudckpt.manager import CheckpointManager, SaveHandle
from cloudckpt.restore import RestoreResult
from cloudckpt.stores import Store, open_store
from cloudckpt.transfer import MemoryFile

try:
    import safetensors.torch as _st
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    from cloudckpt._install import install_hint

    raise ImportError(
        f"cloudckpt.integrations.torch needs safetensors, which is not installed. "
        f"{install_hint('torch')}"
    ) from _exc

__all__ = [
    "FORMAT",
    "HostMemoryStats",
    "LoadReport",
    "StateSaver",
    "host_memory_stats",
    "load_state",
    "reserve_host_memory",
    "resume_state",
    "save_state",
]

log = logging.getLogger("cloudckpt.torch")

FORMAT = "cloudckpt.torch/1"
TENSORS_FILE = "tensors.safetensors"
STATE_FILE = "state.json"
OBJECTS_FILE = "objects.pt"

# dtypes safetensors stores (its own list, so new ones are picked up).
_ST_DTYPES = frozenset(getattr(_st, "_TYPES", {}).values()) or frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)
_NP_TO_TORCH_OK = {
    "float64",
    "float32",
    "float16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
}


# ------------------------------------------------------------------------------ buffers


# ------------------------------------------------------------------------------ encoding


def _escape(component: str) -> str:
    return component.replace("%", "%25").replace("/", "%2F")


class _Flattener:
    """Turn a nested state into (JSON tree, named tensors, pickled leftovers)."""

    def __init__(self, sizing: bool = False) -> None:
        self.sizing = sizing  # only to size host memory: copy nothing
        self.tensors: dict[str, torch.Tensor] = {}  # name -> source tensor (dense)
        self.arrays: dict[str, Any] = {}  # name -> numpy array (copied at once)
        self.objects: list[Any] = []
        self.object_paths: list[str] = []
        self._views: dict[tuple[Any, ...], str] = {}
        self._storages: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
        self._active: set[int] = set()

    def _name(self, path: tuple[str, ...]) -> str:
        base = "/".join(path) or "_"
        name, n = base, 1
        while name in self.tensors or name in self.arrays:
            name, n = f"{base}~{n}", n + 1
        return name

    def key(self, key: Any, path: tuple[str, ...]) -> Any:
        if isinstance(key, torch.Tensor):
            raise ConfigurationError(f"a tensor is used as a dict key at {'/'.join(path)!r}")
        return self.leaf(key, path, as_key=True)

    def node(self, value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, (dict, list, tuple)) and type(value) in (
            dict,
            collections.OrderedDict,
            list,
            tuple,
        ):
            if id(value) in self._active:
                raise ConfigurationError(f"the state contains a cycle at {'/'.join(path)!r}")
            self._active.add(id(value))
            try:
                if isinstance(value, dict):
                    items = [
                        [self.key(k, path), self.node(v, (*path, _escape(str(k))))]
                        for k, v in value.items()
                    ]
                    if type(value) is dict:
                        return {"__dict__": items}
                    out: dict[str, Any] = {"__odict__": items}
                    meta = getattr(value, "_metadata", None)
                    if meta is not None:
                        out["__metadata__"] = self.leaf(meta, (*path, "_metadata"))
                    return out
                children = [self.node(v, (*path, str(i))) for i, v in enumerate(value)]
                return children if type(value) is list else {"__tuple__": children}
            finally:
                self._active.discard(id(value))
        return self.leaf(value, path)

    def leaf(self, value: Any, path: tuple[str, ...], as_key: bool = False) -> Any:
        """Plain values as JSON; anything else into ``objects.pt``."""
        kind = type(value)
        if value is None or kind in (str, bool, int):
            return value
        if kind is float:
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if kind in (bytes, bytearray):
            return {
                "__bytes__": base64.b64encode(bytes(value)).decode("ascii"),
                "ba": kind is bytearray,
            }
        if kind is torch.dtype:
            return {"__dtype__": str(value).removeprefix("torch.")}
        if kind is torch.device:
            return {"__device__": str(value)}
        if kind is torch.Size:
            return {"__size__": list(value)}
        if kind in (tuple, list) and as_key:
            return {
                "__tuple__" if kind is tuple else "__list__": [
                    self.leaf(v, path, True) for v in value
                ]
            }
        if kind in (dict, collections.OrderedDict) and not as_key:
            # Only reached for nested plain data such as a state dict's ``_metadata``.
            return {
                "__dict__" if kind is dict else "__odict__": [
                    [self.leaf(k, path, True), self.leaf(v, path)] for k, v in value.items()
                ]
            }
        if kind in (tuple, list) and not as_key:
            return (
                [self.leaf(v, path) for v in value]
                if kind is list
                else {"__tuple__": [self.leaf(v, path) for v in value]}
            )
        np = _numpy()
        if np is not None:
            if isinstance(value, np.generic) and value.dtype.name in _NP_TO_TORCH_OK:
                return {"__np__": [value.dtype.name, self.leaf(value.item(), path)]}
            if type(value) is np.ndarray and not as_key and _array_ok(value):
                name = self._name(path)
                self.arrays[name] = value if self.sizing else np.array(value, copy=True, order="C")
                return {"__ndarray__": name}
        if as_key:
            raise ConfigurationError(
                f"dict key {value!r} ({kind.__name__}) at {'/'.join(path)!r} is not supported",
                hint="Use str, int, float, bool, None or tuples of them as keys",
            )
        return self.obj(value, path)

    def obj(self, value: Any, path: tuple[str, ...]) -> Any:
        self.objects.append(value)
        self.object_paths.append("/".join(path))
        return {"__object__": len(self.objects) - 1}

    def tensor(self, t: torch.Tensor, path: tuple[str, ...]) -> Any:
        t = t.detach()
        dense = (
            t.layout == torch.strided
            and not t.is_quantized
            and t.device.type != "meta"
            and t.dtype in _ST_DTYPES
            and not t.is_nested
        )
        if not dense:
            if self.sizing:
                return self.obj(None, path)
            return self.obj(t.clone() if t.device.type == "cpu" else t.cpu(), path)
        storage = t.untyped_storage()
        view = (
            t.device.type,
            t.device.index,
            storage.data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
        )
        if storage.nbytes() and view in self._views:
            return {"__tensor__": self._views[view]}
        name = self._name(path)
        self.tensors[name] = t
        if storage.nbytes():
            self._views[view] = name
            self._storages[(str(t.device), storage.data_ptr())].add(name)
        return {"__tensor__": name}

    def shared_storage(self) -> list[list[str]]:
        return sorted(sorted(names) for names in self._storages.values() if len(names) > 1)


_np_module: Any = None


def _array_ok(array: Any) -> bool:
    """Whether a numpy array can go into safetensors as a torch tensor, losslessly."""
    try:
        return (
            torch.from_numpy(array[:0] if array.ndim else array.reshape(1)[:0]).dtype in _ST_DTYPES
        )
    except (TypeError, ValueError, RuntimeError):
        return False


def _numpy() -> Any:
    global _np_module
    if _np_module is None:
        try:
            import numpy

            _np_module = numpy
        except ImportError:  # only without the [torch] extra's numpy
            _np_module = False
    return _np_module or None


def _decode(node: Any, tensors: Mapping[str, torch.Tensor], objects: list[Any]) -> Any:
    """The object a JSON node of ``STATE_FILE`` stands for (the inverse of the encoder's
    tagged nodes). Raises CorruptionError for a node it does not know."""
    if isinstance(node, list):
        return [_decode(v, tensors, objects) for v in node]
    if not isinstance(node, dict):
        return node
    if "__tensor__" in node:
        return tensors[node["__tensor__"]]
    if "__dict__" in node or "__odict__" in node:
        return _decode_mapping(node, tensors, objects)
    if "__tuple__" in node:
        return tuple(_decode(v, tensors, objects) for v in node["__tuple__"])
    if "__list__" in node:
        return [_decode(v, tensors, objects) for v in node["__list__"]]
    if "__float__" in node:
        return float(node["__float__"])
    if "__bytes__" in node:
        data = base64.b64decode(node["__bytes__"])
        return bytearray(data) if node.get("ba") else data
    if "__dtype__" in node:
        return _decode_dtype(node["__dtype__"])
    if "__device__" in node:
        return torch.device(node["__device__"])
    if "__size__" in node:
        return torch.Size(node["__size__"])
    if "__np__" in node:
        np = _numpy()
        name, value = node["__np__"]
        return np.dtype(name).type(_decode(value, tensors, objects))
    if "__ndarray__" in node:
        return tensors[node["__ndarray__"]].cpu().numpy()
    if "__object__" in node:
        return objects[node["__object__"]]
    raise CorruptionError(f"{STATE_FILE} holds an unknown node {sorted(node)!r}")


def _decode_dtype(name: str) -> torch.dtype:
    """The torch dtype ``torch.<name>``. Raises CorruptionError if there is none."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptionError(f"unknown torch dtype {name!r} in {STATE_FILE}")
    return dtype


def _decode_mapping(
    node: dict[str, Any], tensors: Mapping[str, torch.Tensor], objects: list[Any]
) -> dict[Any, Any]:
    """A ``__dict__`` or ``__odict__`` node: its (key, value) pairs, in order."""
    cls = dict if "__dict__" in node else collections.OrderedDict
    items = node["__dict__"] if "__dict__" in node else node["__odict__"]
    out = cls((_decode(k, tensors, objects), _decode(v, tensors, objects)) for k, v in items)
    if "__metadata__" in node:
        # a state_dict's OrderedDict carries torch's ``_metadata`` attribute; the type has none
        out._metadata = _decode(node["__metadata__"], tensors, objects)  # type: ignore[attr-defined]
    return out


# ------------------------------------------------------------------------------ saving


_ST_NAMES = {dtype: name for name, dtype in getattr(_st, "_TYPES", {}).items()}


def _state_doc(tree: Any, flat: _Flattener) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "writer": f"cloudckpt {__version__}, torch {torch.__version__}",
        "tree": tree,
        "tensors": {
            name: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "device": str(t.device),
            }
            for name, t in flat.tensors.items()
        },
        "arrays": sorted(flat.arrays),
        "objects": len(flat.objects),
        "object_paths": flat.object_paths,
        "shared_storage": flat.shared_storage(),
    }


def _memory_files(
    tree: Any,
    buffers: Mapping[str, torch.Tensor],
    flat: _Flattener,
    objects_blob: bytes | None,
    copied: Watermark | None = None,
) -> list[tuple[str, MemoryFile]] | None:
    """The checkpoint's files as in-memory buffers, to upload without writing them first:
    ``tensors.safetensors`` laid out here (an 8-byte little-endian header length, the JSON
    header padded with spaces to 8 bytes, then every tensor's bytes back to back, in name
    order) over the host buffers themselves, no copy; ``state.json``; ``objects.pt``.
    With ``copied``, reads of the tensors' bytes wait until the copy has reached them.
    None when a buffer cannot be laid out so (a dtype without a safetensors name, a
    big-endian host): the caller then writes the files with safetensors as before."""
    if sys.byteorder != "little":
        return None
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    segments: list[Any] = []
    offset = 0
    for name in sorted(buffers):
        t = buffers[name]
        dtype = _ST_NAMES.get(t.dtype)
        if dtype is None or t.device.type != "cpu" or not t.is_contiguous():
            return None
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        if nbytes:
            segments.append(t.reshape(-1).view(torch.uint8).numpy().data)  # (a memoryview)
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    ready = None
    if copied is not None:
        data_start = 8 + len(head)

        def ready(end: int) -> None:
            if end > data_start:
                copied.wait(end - data_start)

    files = [(TENSORS_FILE, MemoryFile([len(head).to_bytes(8, "little"), head, *segments], ready))]
    if objects_blob is not None:
        files.append((OBJECTS_FILE, MemoryFile([objects_blob])))
    doc = json.dumps(_state_doc(tree, flat), allow_nan=False, sort_keys=True).encode()
    files.append((STATE_FILE, MemoryFile([doc])))
    return sorted(files)


def _flatten(state: Any, step: int) -> tuple[_Flattener, Any, bytes | None]:
    """``state`` as its tensors, its JSON tree, and its other objects pickled (None if
    there are none) for the save of ``step``."""
    flat = _Flattener()
    tree = flat.node(state, ())
    objects_blob = None
    if flat.objects:
        log.info(
            "step %d: %d value(s) are neither tensors nor plain data and are pickled "
            "(loaded with weights_only=True): %s",
            step,
            len(flat.objects),
            ", ".join(flat.object_paths[:5]) + (" ..." if len(flat.objects) > 5 else ""),
        )
        buf = io.BytesIO()
        torch.save(flat.objects, buf)
        objects_blob = buf.getvalue()
    return flat, tree, objects_blob


class StateSaver:
    """Saves state dicts through one ``CheckpointManager`` with one reused host arena.

    ``save_state(manager, ...)`` uses one ``StateSaver`` per manager, created on first
    use; make your own only to control its lifetime (``close()`` frees the host memory).
    ``arena`` is its ``HostArena``; ``reserve(state)`` allocates (and pins) it ahead of the
    first save; ``host_memory()`` reports it.
    """

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        self.arena = HostArena()
        self.state_bytes = 0  # bytes of tensors in the last save (or reserve)
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cloudckpt-state")
        self._copiers = cf.ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="cloudckpt-copy")
        self._cuda: CudaOps | None = None
        self._previous: cf.Future[None] | None = None
        self._last: SaveHandle | None = None
        self._lock = threading.Lock()  # one save_state at a time per saver

    # Long because the caller's half of the hand-off (flatten, copy to host buffers, then
    # return) and the background writer's half (``background``) share its events and are
    # read side by side; the flattening is in ``_flatten``.
    def save(
        self,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """See ``save_state``."""
        started = time.perf_counter()
        if _numpy() is None:  # checked here: the background writer would fail on every save
            raise MissingDependencyError(
                "save_state needs numpy (the host buffers are uploaded and written through "
                "it), which is not installed",
                extra="torch",
            )
        with self._lock:
            flat, tree, objects_blob = _flatten(state, step)
            # The previous save's write must be done before its buffers are reused. Its
            # outcome is its handle's: if it failed and no one has been told, the
            # manager's save() below raises it (and this save starts nothing).
            if self._previous is not None:
                self._previous.result()  # background() itself raises only on a bug
            items, buffers = self._plan(flat)  # may allocate (and pin) host memory
            # Validates step, metadata and metrics.
            handle = self.manager.save(step, metadata, metrics=metrics)
            handle.set_background(True)  # a failure in background() reaches no caller
            self._last = handle
            # The upload starts while the copy runs and reads each piece once it has
            # landed (module docstring of _device_copy).
            copied = Watermark(sum(it.nbytes for it in items))
            entered = threading.Event()
            cell: dict[str, BaseException] = {}

            def background() -> None:
                try:
                    files_dir = handle.__enter__()  # may wait for a queue slot (backpressure)
                except BaseException as exc:
                    cell["enter_error"] = exc
                    entered.set()
                    return
                entered.set()
                try:
                    files = _memory_files(tree, buffers, flat, objects_blob, copied)
                    if files is None:  # a layout only safetensors' own writer knows
                        copied.wait(copied.total)
                        self._write(files_dir, tree, buffers, flat, objects_blob)
                    handle.upload_from_memory(files)
                except BaseException as exc:
                    if copied.failed:  # the copy's failure is raised to the caller: told
                        handle.set_background(False)
                    else:
                        log.error("writing the state of step %d failed: %r", step, exc)
                    # The save fails; the next save()/wait()/close() raises it.
                    handle.__exit__(type(exc), exc, exc.__traceback__)
                    return
                try:
                    handle.__exit__(None, None, None)  # the upload starts, behind the copy
                except Exception:  # the hand-over failed (staging disk): the handle has it
                    return
                if files is not None:
                    # The upload (and the staged copy kept as the local tier) read the host
                    # memory until they are done: the next save_state waits for that
                    # before reusing it. (Written to staging instead, it is free already.)
                    handle.release_memory()  # and let go of this save's views of the arena

            def copy_done() -> None:
                handle.blocking_seconds = time.perf_counter() - started

            future = self._executor.submit(background)
            self._previous = future
            try:
                copy_items(items, copied, self._copiers, self._cuda_ops(items), copy_done)
            except BaseException:
                # Raised to the caller here; the save fails (its upload reads behind the
                # copy and stops at the failure) and is not raised again later.
                handle.mark_reported()
                raise
            finally:
                entered.wait()
            if "enter_error" in cell:
                raise cell["enter_error"]
            handle.blocking_seconds = time.perf_counter() - started
            return handle

    def _cuda_ops(self, items: list[Item]) -> CudaOps | None:
        if self._cuda is None and any(it.kind == "dma" for it in items):
            self._cuda = CudaOps()
        return self._cuda

    @staticmethod
    def _sizes(flat: _Flattener) -> tuple[list[str], dict[str, str], list[int], list[int]]:
        """Names in file order, each tensor's copy kind, and the slot sizes per kind
        (pinned for copies from CUDA devices, pageable for the rest)."""
        names = sorted({*flat.tensors, *flat.arrays})
        kinds: dict[str, str] = {}
        pinned: list[int] = []
        pageable: list[int] = []
        for name in names:
            t = flat.tensors.get(name)
            if t is None:
                continue
            kinds[name] = kind_of(t)
            (pinned if kinds[name] == "dma" else pageable).append(t.numel() * t.element_size())
        return names, kinds, pinned, pageable

    def _plan(self, flat: _Flattener) -> tuple[list[Item], dict[str, torch.Tensor]]:
        """The copy items in file order and the host tensors they fill (slots of the
        arena, carved for this save; numpy arrays as they are)."""
        names, kinds, pinned_sizes, pageable_sizes = self._sizes(flat)
        slots = {
            True: iter(self.arena.carve(pinned_sizes, pin=True)),
            False: iter(self.arena.carve(pageable_sizes, pin=False)),
        }
        items: list[Item] = []
        buffers: dict[str, torch.Tensor] = {}
        for name in names:
            if name in flat.arrays:
                array = torch.from_numpy(flat.arrays[name])
                items.append(Item(name, None, array, array.numel() * array.element_size(), "ready"))
                buffers[name] = array
                continue
            t = flat.tensors[name]
            slot = next(slots[kinds[name] == "dma"])
            dst = slot.view(t.dtype).view(t.shape)
            items.append(Item(name, t, dst, slot.numel(), kinds[name]))
            buffers[name] = dst
        self.state_bytes = sum(pinned_sizes) + sum(pageable_sizes)
        return items, buffers

    def reserve(self, state: Any) -> HostMemoryStats:
        """Allocate (and pin, for tensors on CUDA devices) the host memory a save of
        ``state`` will use, now instead of inside the first save's stall; nothing is
        copied. Returns ``host_memory()``.

        Raises ConfigurationError (what ``save_state`` would refuse in the state),
        StagingError (the memory cannot be allocated)."""
        flat = _Flattener(sizing=True)
        flat.node(state, ())
        _, _, pinned_sizes, pageable_sizes = self._sizes(flat)
        with self._lock:
            if self._previous is not None:  # a block it reads may be replaced
                cf.wait([self._previous])
            self.arena.reserve(pinned_sizes, pin=True)
            self.arena.reserve(pageable_sizes, pin=False)
            self.state_bytes = sum(pinned_sizes) + sum(pageable_sizes)
        return self.host_memory()

    def host_memory(self) -> HostMemoryStats:
        """The host memory this saver holds (``HostMemoryStats``; ``state_bytes``: the
        tensors of the last save or reserve)."""
        return dataclasses.replace(self.arena.stats(), state_bytes=self.state_bytes)

    @staticmethod
    def _write(
        files_dir: Path,
        tree: Any,
        buffers: Mapping[str, torch.Tensor],
        flat: _Flattener,
        objects_blob: bytes | None,
    ) -> None:
        _st.save_file(dict(buffers), str(files_dir / TENSORS_FILE), metadata={"format": "pt"})
        if objects_blob is not None:
            (files_dir / OBJECTS_FILE).write_bytes(objects_blob)
        doc = _state_doc(tree, flat)
        (files_dir / STATE_FILE).write_text(json.dumps(doc, allow_nan=False, sort_keys=True))

    def wait(self) -> None:
        """Wait until the last save is done with the host buffers: its files written, or
        (when uploaded from the buffers, the usual case) its upload finished.

        Raises: the last save's exception if it failed and no one has been told of it yet
        (as ``CheckpointManager.wait`` would; it is then not raised again).
        """
        if self._previous is None:
            return
        self._previous.result()  # background() itself raises only on a bug
        failure = self._last._take_failure() if self._last is not None else None
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Wait for the last write, stop the writer thread and free the buffers.

        Raises: as ``wait()``, once everything is released.
        """
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._copiers.shutdown(wait=True)
            self.arena.release()
            with contextlib.suppress(KeyError, TypeError):
                if _savers.get(self.manager) is self:
                    del _savers[self.manager]


_savers: weakref.WeakKeyDictionary[CheckpointManager, StateSaver] = weakref.WeakKeyDictionary()
_savers_lock = threading.Lock()


def save_state(
    manager: CheckpointManager,
    step: int,
    state_dict: Any,
    metadata: Mapping[str, Any] | None = None,
    *,
    metrics: Mapping[str, Any] | None = None,
) -> SaveHandle:
    """Checkpoint a nested state (dicts, lists, tuples, tensors, plain values) as ``step``.
    ``metrics``: numbers recorded with it (``CheckpointManager.save``; ``keep_best`` ranks
    by them).

    Returns once the tensors are copied into host buffers (see the module docstring); the
    files are written and uploaded in the background. ``handle.result()`` waits for the
    commit; ``manager.wait()`` / ``manager.close()`` wait for every save, including one
    whose files are still being written.

    Raises (at once): an earlier save's failure that no one has been told of (see
    ``CheckpointManager``: a save whose files could not be written or uploaded in the
    background is raised by the next ``save_state``, ``manager.save()``, ``wait()`` or
    ``close()``, whichever comes first, and this call then saves nothing);
    MissingDependencyError (numpy is not installed); ConfigurationError (unsupported
    keys, a cycle, bad step or metadata), FencedError, StagingError. Failures after the
    return are raised by ``handle.result()`` too.
    """
    return _saver(manager).save(step, state_dict, metadata, metrics=metrics)


def _saver(manager: CheckpointManager) -> StateSaver:
    """The ``StateSaver`` ``save_state`` uses for ``manager`` (created on first use)."""
    with _savers_lock:
        saver = _savers.get(manager)
        if saver is None:
            saver = _savers[manager] = StateSaver(manager)
    return saver


def reserve_host_memory(manager: CheckpointManager, state_dict: Any) -> HostMemoryStats:
    """Allocate the host memory ``save_state(manager, ...)`` will copy ``state_dict`` into,
    now: pinned (registered with CUDA) for tensors on CUDA devices, pageable for the rest,
    each kind one block sized to the state (``HostArena``). Call it once the model and
    optimizer exist (after a first step, so that the optimizer's state exists too);
    otherwise the first save pays for it inside its stall (pinning gigabytes takes
    seconds). Nothing is copied. Returns what is held, as ``host_memory_stats``.

    Raises ConfigurationError (what ``save_state`` would refuse in the state) or
    StagingError (the memory cannot be allocated).
    """
    return _saver(manager).reserve(state_dict)


def host_memory_stats(manager: CheckpointManager) -> HostMemoryStats:
    """The host memory ``save_state`` holds for ``manager``: ``pinned_bytes`` and
    ``pageable_bytes`` against ``state_bytes`` (the tensors of its last save or reserve),
    blocks allocated so far, pins CUDA refused."""
    return _saver(manager).host_memory()


# ------------------------------------------------------------------------------ loading


def _state_dir(source: RestoreResult | str | os.PathLike[str]) -> Path:
    path = Path(source.path if isinstance(source, RestoreResult) else source)
    if path.is_file() and path.name == STATE_FILE:
        path = path.parent
    if not (path / STATE_FILE).is_file():
        raise CloudCkptError(
            f"{path} holds no {STATE_FILE}",
            hint="Pass the directory a restore produced (RestoreResult or its .path) for a "
            "checkpoint written by save_state, or the run (a manager, store or URL) to load "
            "from the store",
        )
    return path


def _check_format(doc: Mapping[str, Any], where: str) -> None:
    if doc.get("format") != FORMAT:
        raise CorruptionError(
            f"{where} has format {doc.get('format')!r}; this cloudckpt reads {FORMAT}"
        )


def _load_objects(
    source: Path | bytes, doc: Mapping[str, Any], target: str, weights_only: bool
) -> list[Any]:
    """The leaves ``objects.pt`` holds. Raises CloudCkptError for a type
    ``torch.load(weights_only=True)`` refuses."""
    try:
        return torch.load(
            io.BytesIO(source) if isinstance(source, bytes) else source,
            map_location=target,
            weights_only=weights_only,
        )
    except Exception as exc:
        if not weights_only:
            raise
        detail = [line for line in str(exc).splitlines() if "WeightsUnpickler" in line]
        raise CloudCkptError(
            f"{OBJECTS_FILE} holds a type torch.load(weights_only=True) refuses "
            f"(values at {', '.join(doc.get('object_paths', [])[:5])}): "
            + (detail[0].strip() if detail else str(exc).splitlines()[0]),
            hint="Allow the type with torch.serialization.add_safe_globals([...]), or pass "
            "weights_only=False if you trust this checkpoint",
        ) from exc


def load_state(
    source: RestoreResult | str | os.PathLike[str] | CheckpointManager | Store,
    *,
    step: int | None = None,
    device: str | torch.device | None = None,
    weights_only: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    report: LoadReport | None = None,
) -> Any:
    """Rebuild the state ``save_state`` saved: straight from the store into memory (or a
    GPU), or from a restored checkpoint directory.

    Args:
        source: the run: a ``CheckpointManager`` (read-only here; ``resume_state`` claims
            the run first), a ``Store`` or a run URL (``s3://bucket/run``): the newest
            committed checkpoint (or ``step``) is read into memory with no local file,
            every byte verified, falling back past damaged checkpoints as ``restore``
            does (see ``cloudckpt.integrations._torch_restore``). A manager also uses the
            verified local copy in its ``staging_dir``, if it has one (zero bytes
            downloaded). Or a directory: a ``RestoreResult`` (from ``manager.resume()`` /
            ``restore()``) or its path.
        step: (from a run) load this step instead of the newest.
        device: where tensors go (default: CPU). A CUDA device is filled through pinned
            staging buffers, the copies overlapped with the download.
        weights_only: load ``objects.pt`` (only present for unusual leaves) with
            ``torch.load(weights_only=True)``. Set False only for checkpoints you trust.
        storage_options: for a run URL, as ``CheckpointManager`` takes them.
        report: a ``LoadReport`` to fill (from a run): where the time went, bytes read.

    Raises: CheckpointNotFoundError (nothing committed, or no such step), CorruptionError
    (no intact checkpoint, unknown format, missing tensor), CloudCkptError (not a
    save_state checkpoint), StoreError, and ``torch.load``'s error for a disallowed
    pickled type.
    """
    if isinstance(source, (CheckpointManager, Store)) or (
        isinstance(source, str) and "://" in source
    ):
        return _load_from_run(source, step, device, weights_only, storage_options, report)
    root = _state_dir(source)
    doc = json.loads((root / STATE_FILE).read_text())
    _check_format(doc, str(root / STATE_FILE))
    target = "cpu" if device is None else str(device)
    tensors = _st.load_file(str(root / TENSORS_FILE), device=target)
    missing = set(doc.get("tensors", {})) - set(tensors)
    if missing:
        raise CorruptionError(f"{TENSORS_FILE} lacks {sorted(missing)[:5]}")
    objects: list[Any] = []
    if doc.get("objects"):
        objects = _load_objects(root / OBJECTS_FILE, doc, target, weights_only)
    return _decode(doc["tree"], tensors, objects)


def _load_from_run(
    source: CheckpointManager | Store | str,
    step: int | None,
    device: str | torch.device | None,
    weights_only: bool,
    storage_options: Mapping[str, Any] | None,
    report: LoadReport | None,
) -> Any:
    """``load_state`` from the store (see there)."""
    from cloudckpt.integrations import _torch_restore as tr
    from cloudckpt.transfer import TransferEngine

    report = report if report is not None else LoadReport()
    ops = tr.device_ops(device)
    report.device = str(ops.device) if ops is not None else "cpu"
    later = None if ops is not None or device is None else torch.device(device)
    if later is not None and later.type == "cpu":
        later = None

    def build(doc: dict[str, Any], tensors: Mapping[str, torch.Tensor], blob: bytes | None) -> Any:
        _check_format(doc, STATE_FILE)
        if later is not None:  # a device reached through host memory
            tensors = {k: v.to(later) for k, v in tensors.items()}
        target = report.device if later is None else str(later)
        objects = _load_objects(blob, doc, target, weights_only) if blob is not None else []
        if doc.get("objects") and blob is None:
            raise CorruptionError(f"the checkpoint lacks {OBJECTS_FILE}")
        return _decode(doc["tree"], tensors, objects)

    load = functools.partial(
        tr.load_from_store,
        step=step,
        ops=ops,
        report=report,
        names=(STATE_FILE, TENSORS_FILE, OBJECTS_FILE),
        dtypes=getattr(_st, "_TYPES", {}),
        build=build,
    )
    if isinstance(source, CheckpointManager):
        source.check_open()
        return load(source.store, source.engine, local=source.local)
    store = (
        open_store(source, storage_options, writable=False) if isinstance(source, str) else source
    )
    try:
        with TransferEngine() as engine:
            return load(store, engine, local=None)
    finally:
        if store is not source:
            store.close()


def resume_state(
    manager: CheckpointManager,
    *,
    step: int | None = None,
    device: str | torch.device | None = None,
    weights_only: bool = True,
    report: LoadReport | None = None,
) -> Any:
    """``manager.resume()`` into memory: claim the run (fencing any older writer), commit
    saves a crashed process left in ``staging_dir``, and load the newest committed
    checkpoint (or ``step``) straight from the store, or from the verified local copy in
    ``staging_dir`` (see ``load_state``). Returns None for a new, empty run.

    Raises: as ``CheckpointManager.claim`` and ``load_state``.
    """
    if manager.claim() is None:
        return None
    return load_state(manager, step=step, device=device, weights_only=weights_only, report=report)
