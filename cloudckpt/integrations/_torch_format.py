"""How ``save_state`` lays a state dict out as files and reads it back (the format
``cloudckpt.integrations.torch``'s docstring describes): the tree flattened into tensors,
a JSON document and rare pickled leaves, and decoded again. No I/O beyond the files named
here; the saver, the loaders and their threads are in ``cloudckpt.integrations.torch``."""

from __future__ import annotations

import base64
import collections
import io
import json
import logging
import math
import sys
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
from cloudckpt.integrations._device_copy import Watermark
from cloudckpt.transfer import MemoryFile

try:
    import safetensors.torch as _st
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    from cloudckpt._install import install_hint

    raise ImportError(
        f"cloudckpt.integrations.torch needs safetensors, which is not installed. "
        f"{install_hint('torch')}"
    ) from _exc

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


class Flattener:
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


def decode(node: Any, tensors: Mapping[str, torch.Tensor], objects: list[Any]) -> Any:
    """The object a JSON node of ``STATE_FILE`` stands for (the inverse of the encoder's
    tagged nodes). Raises CorruptionError for a node it does not know."""
    if isinstance(node, list):
        return [decode(v, tensors, objects) for v in node]
    if not isinstance(node, dict):
        return node
    if "__tensor__" in node:
        return tensors[node["__tensor__"]]
    if "__dict__" in node or "__odict__" in node:
        return _decode_mapping(node, tensors, objects)
    if "__tuple__" in node:
        return tuple(decode(v, tensors, objects) for v in node["__tuple__"])
    if "__list__" in node:
        return [decode(v, tensors, objects) for v in node["__list__"]]
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
        return np.dtype(name).type(decode(value, tensors, objects))
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
    out = cls((decode(k, tensors, objects), decode(v, tensors, objects)) for k, v in items)
    if "__metadata__" in node:
        # a state_dict's OrderedDict carries torch's ``_metadata`` attribute; the type has none
        out._metadata = decode(node["__metadata__"], tensors, objects)  # type: ignore[attr-defined]
    return out


# ------------------------------------------------------------------------------ saving


_ST_NAMES = {dtype: name for name, dtype in getattr(_st, "_TYPES", {}).items()}


def state_doc(tree: Any, flat: Flattener) -> dict[str, Any]:
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


def memory_files(
    tree: Any,
    buffers: Mapping[str, torch.Tensor],
    flat: Flattener,
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
    doc = json.dumps(state_doc(tree, flat), allow_nan=False, sort_keys=True).encode()
    files.append((STATE_FILE, MemoryFile([doc])))
    return sorted(files)


def flatten(state: Any, step: int) -> tuple[Flattener, Any, bytes | None]:
    """``state`` as its tensors, its JSON tree, and its other objects pickled (None if
    there are none) for the save of ``step``."""
    flat = Flattener()
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


def require_numpy() -> None:
    """Raises MissingDependencyError if numpy is not installed (``save_state`` needs it)."""
    if _numpy() is None:
        raise MissingDependencyError(
            "save_state needs numpy (the host buffers are uploaded and written through "
            "it), which is not installed",
            extra="torch",
        )


def check_format(doc: Mapping[str, Any], where: str) -> None:
    if doc.get("format") != FORMAT:
        raise CorruptionError(
            f"{where} has format {doc.get('format')!r}; this cloudckpt reads {FORMAT}"
        )


def load_objects(
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
