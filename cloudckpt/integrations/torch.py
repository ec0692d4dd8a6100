"""Plain PyTorch state dicts: ``save_state`` and ``load_state``.

::

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import resume_state, save_state

    mgr = CheckpointManager("s3://bucket/runs/exp1", staging_dir="/nvme/ckpt")
    # Into the model's own tensors, in place (None for a new run): straight from the store,
    # or from the verified local copy in staging_dir, every byte verified.
    state = resume_state(mgr, into={"model": model.state_dict()}, strict=False)
    if state is not None:                          # the model holds the checkpoint now
        optimizer.load_state_dict(state["optimizer"])  # new tensors (strict=False)
        start = state["step"] + 1
    ...
    handle = save_state(mgr, step, {"model": model.state_dict(),
                                    "optimizer": optimizer.state_dict(), "step": step})
    # training continues at once; handle.result() waits for the commit

What ``save_state`` does, and what the training loop waits for:

1. (caller) Walk the state: nested dicts (any JSON-able keys, including the ``int`` keys of
   ``optimizer.state_dict()``), lists and tuples; tensors; plain values.
2. (caller) Wait for the previous ``save_state`` of this manager to be done with its host
   buffers (uploaded and committed, or failed), because they are about to be reused. Its
   staged copy, if still being written then, is cut short rather than waited for.
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

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cloudckpt.errors import (
    CloudCkptError,
    ConfigurationError,
    CorruptionError,
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
from cloudckpt.integrations._torch_format import (
    FORMAT,
    OBJECTS_FILE,
    STATE_FILE,
    TENSORS_FILE,
    Flattener,
    check_format,
    decode,
    flatten,
    load_objects,
    memory_files,
    require_numpy,
    state_doc,
)
from cloudckpt.integrations._torch_restore import LoadReport
from cloudckpt.manager import ManagerBase
from cloudckpt.restore import RestoreResult
from cloudckpt.savequeue import BackgroundWrite, SaveHandle
from cloudckpt.stores import Store, open_store

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


class StateSaver:
    """Saves state dicts through one ``CheckpointManager`` with one reused host arena.

    ``save_state(manager, ...)`` uses one ``StateSaver`` per manager, created on first
    use; make your own only to control its lifetime (``close()`` frees the host memory).
    ``arena`` is its ``HostArena``; ``reserve(state)`` allocates (and pins) it ahead of the
    first save; ``host_memory()`` reports it.
    """

    def __init__(self, manager: ManagerBase) -> None:
        self.manager = manager
        self.arena = HostArena()
        self.state_bytes = 0  # bytes of tensors in the last save (or reserve)
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cloudckpt-state")
        self._copiers = cf.ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="cloudckpt-copy")
        self._cuda: CudaOps | None = None
        self._previous: cf.Future[None] | None = None
        self._last: BackgroundWrite | None = None  # the last save's writer
        self._lock = threading.Lock()  # one save_state at a time per saver

    # Long because the caller's half of the hand-off (flatten, copy to host buffers, then
    # return) and the background writer's half (``background``) share its events and are
    # read side by side; the flattening is in ``flatten``.
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
        require_numpy()  # here: the background writer would fail on every save
        with self._lock:
            flat, tree, objects_blob = flatten(state, step)
            # The previous save's write must be done before its buffers are reused. Its
            # outcome is its handle's: if it failed and no one has been told, the
            # manager's save() below raises it (and this save starts nothing).
            if self._previous is not None:
                if self._reclaim_unless_refused(step, metadata, metrics):
                    # An earlier failure first, as ever, then why this one is refused.
                    # The previous save's outcome is enough: its local copy (nice 19,
                    # up to a minute beside busy CPUs) is not waited for, nor cut.
                    self._wait_for_previous_outcome()
                    self.manager.save(step, metadata, metrics=metrics)  # raises
                self._previous.result()  # background() itself raises only on a bug
            items, buffers = self._plan(flat)  # may allocate (and pin) host memory
            # Validates step, metadata and metrics.
            handle = self.manager.save(step, metadata, metrics=metrics)
            writer = self.manager.queue.background(handle)  # a failure there reaches no caller
            self._last = writer
            # The upload starts while the copy runs and reads each piece once it has
            # landed (module docstring of _device_copy).
            copied = Watermark(sum(it.nbytes for it in items))
            entered = threading.Event()
            cell: dict[str, BaseException] = {}

            def background() -> None:
                try:
                    files_dir = writer.open()  # may wait for a queue slot (backpressure)
                except BaseException as exc:
                    cell["enter_error"] = exc
                    entered.set()
                    return
                entered.set()
                try:
                    files = memory_files(tree, buffers, flat, objects_blob, copied)
                    if files is None:  # a layout only safetensors' own writer knows
                        copied.wait(copied.total)
                        self._write(files_dir, tree, buffers, flat, objects_blob)
                    writer.upload_from_memory(files)
                except BaseException as exc:
                    if not copied.failed:  # the copy's failure is raised to the caller: told
                        log.error("writing the state of step %d failed: %r", step, exc)
                    # The save fails; the next save()/wait()/close() raises it.
                    writer.fail(exc, told=copied.failed)
                    return
                try:
                    writer.finish()  # the upload starts, behind the copy
                except Exception:  # the hand-over failed (staging disk): the handle has it
                    return
                if files is not None:
                    # The upload (and the staged copy kept as the local tier) read the host
                    # memory until they are done: the next save_state waits for that
                    # before reusing it. (Written to staging instead, it is free already.)
                    writer.release_memory()  # and let go of this save's views of the arena

            def copy_done() -> None:
                handle.blocking_seconds = time.perf_counter() - started

            future = self._executor.submit(background)
            self._previous = future
            try:
                copy_items(items, copied, self._copiers, self._cuda_ops(items), copy_done)
            except BaseException:
                # Raised to the caller here; the save fails (its upload reads behind the
                # copy and stops at the failure) and is not raised again later.
                writer.told()
                raise
            finally:
                entered.wait()
            if "enter_error" in cell:
                raise cell["enter_error"]
            handle.blocking_seconds = time.perf_counter() - started
            return handle

    def _reclaim_unless_refused(
        self, step: int, metadata: Mapping[str, Any] | None, metrics: Mapping[str, Any] | None
    ) -> bool:
        """Cut the previous save's local copy short (``reclaim_memory``: it does not hold
        this save's stall) unless the manager would refuse this save's step, metadata or
        metrics: a refused save reuses no buffers, so that step keeps its local copy.
        True if refused (``manager.save()`` then raises why)."""
        try:
            self.manager.check_save_args(step, metadata, metrics)
        except Exception:
            return True
        if self._last is not None:
            self._last.reclaim_memory()
        return False

    def _wait_for_previous_outcome(self) -> None:
        """Until the previous save has committed or failed (its handle), or its background
        write has ended (a failure before hand-over); its local copy may still run."""
        assert self._previous is not None
        waiting: list[cf.Future[Any]] = [self._previous]
        if self._last is not None:
            waiting.append(self._last.handle._future)
        cf.wait(waiting, return_when=cf.FIRST_COMPLETED)

    def _cuda_ops(self, items: list[Item]) -> CudaOps | None:
        if self._cuda is None and any(it.kind == "dma" for it in items):
            self._cuda = CudaOps()
        return self._cuda

    @staticmethod
    def _sizes(flat: Flattener) -> tuple[list[str], dict[str, str], list[int], list[int]]:
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

    def _plan(self, flat: Flattener) -> tuple[list[Item], dict[str, torch.Tensor]]:
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
        flat = Flattener(sizing=True)
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
        flat: Flattener,
        objects_blob: bytes | None,
    ) -> None:
        _st.save_file(dict(buffers), str(files_dir / TENSORS_FILE), metadata={"format": "pt"})
        if objects_blob is not None:
            (files_dir / OBJECTS_FILE).write_bytes(objects_blob)
        doc = state_doc(tree, flat)
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
        failure = self._last.take_failure() if self._last is not None else None
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


_savers: weakref.WeakKeyDictionary[ManagerBase, StateSaver] = weakref.WeakKeyDictionary()
_savers_lock = threading.Lock()


def save_state(
    manager: ManagerBase,
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
    SaverStoppedError (the background saver stopped for good: restart, do not retry);
    MissingDependencyError (numpy is not installed); ConfigurationError (unsupported
    keys, a cycle, bad step or metadata), FencedError, StagingError. Failures after the
    return are raised by ``handle.result()`` too.
    """
    return _saver(manager).save(step, state_dict, metadata, metrics=metrics)


def _saver(manager: ManagerBase) -> StateSaver:
    """The ``StateSaver`` ``save_state`` uses for ``manager`` (created on first use)."""
    with _savers_lock:
        saver = _savers.get(manager)
        if saver is None:
            saver = _savers[manager] = StateSaver(manager)
    return saver


def reserve_host_memory(manager: ManagerBase, state_dict: Any) -> HostMemoryStats:
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


def host_memory_stats(manager: ManagerBase) -> HostMemoryStats:
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


def load_state(
    source: RestoreResult | str | os.PathLike[str] | ManagerBase | Store,
    *,
    into: Any = None,
    strict: bool = True,
    step: int | None = None,
    device: str | torch.device | None = None,
    weights_only: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    report: LoadReport | None = None,
) -> Any:
    """Rebuild the state ``save_state`` saved: straight from the store into memory (or a
    GPU), or from a restored checkpoint directory; with ``into``, into the caller's own
    tensors, in place (as ``torch.distributed.checkpoint.load`` does).

    Args:
        source: the run: a ``CheckpointManager`` (read-only here; ``resume_state`` claims
            the run first), a ``Store`` or a run URL (``s3://bucket/run``): the newest
            committed checkpoint (or ``step``) is read into memory with no local file,
            every byte verified, falling back past damaged checkpoints as ``restore``
            does (see ``cloudckpt.integrations._torch_restore``). A manager also uses the
            verified local copy in its ``staging_dir``, if it has one (zero bytes
            downloaded). Or a directory: a ``RestoreResult`` (from ``manager.resume()`` /
            ``restore()``) or its path.
        into: a nested state like the one saved (``{"model": model.state_dict(), ...}``)
            whose tensors are filled in place with the checkpoint's, matched by their key
            paths (the names ``save_state`` gives them): no second copy of the state in
            memory, no fresh pages to fault in. ``model.state_dict()``'s tensors share
            memory with the parameters, so ``model.load_state_dict`` is then unnecessary.
            Each of its tensors must have the checkpoint's shape and dtype, be on the CPU
            (filled straight from the socket or file) or on one CUDA device (through
            pinned staging buffers), and share no memory with another (views of one
            tensor other than the same view, such as tied weights). A non-contiguous
            tensor (e.g. ``channels_last``) is filled through a new tensor, copied in once
            verified. Plain values, numpy arrays and pickled leaves are not written into
            ``into``: they are in the returned state (e.g. ``state["step"]``; an
            optimizer's ``param_groups``: call ``optimizer.load_state_dict(state[...])``,
            which keeps the filled tensors). Sparse, quantized and meta tensors cannot be
            filled.
        strict: with ``into``, the checkpoint may hold no tensor ``into`` lacks. False:
            those come back as new tensors in the returned state (e.g. an optimizer's
            state, which a new optimizer has not created yet). Every tensor of ``into``
            must be in the checkpoint either way: it is filled, or the call raises. A
            tensor of ``into`` that cannot be filled in place (sparse, quantized, a dtype
            safetensors lacks) which the checkpoint holds pickled is refused under
            ``strict``; without it, it comes back in the returned state.
        step: (from a run) load this step instead of the newest.
        device: where new tensors go (default: CPU): all of them, or with ``into`` those
            it lacks and ``objects.pt``'s. A CUDA device is filled through pinned staging
            buffers, the copies overlapped with the download.
        weights_only: load ``objects.pt`` (only present for unusual leaves) with
            ``torch.load(weights_only=True)``. Set False only for checkpoints you trust.
        storage_options: for a run URL, as ``CheckpointManager`` takes them.
        report: a ``LoadReport`` to fill (from a run): where the time went, bytes read.

    Returns: the state, as saved; with ``into``, holding ``into``'s tensor objects where
    it had them, filled. Each new tensor owns its memory.

    Raises: CheckpointNotFoundError (nothing committed, or no such step), CorruptionError
    (no intact checkpoint, unknown format, missing tensor), CloudCkptError (not a
    save_state checkpoint), ConfigurationError (``into`` does not fit the checkpoint: a
    tensor of another shape or dtype, a name one has and the other lacks, tensors on
    other devices or sharing memory; raised before any byte is written into ``into``'s
    tensors when it is the newest intact checkpoint that does not fit), StoreError, and
    ``torch.load``'s error for a disallowed pickled type. With ``into``, bytes land in
    its tensors before their chunk is verified: a checkpoint found damaged is then
    overwritten by the older one loaded instead, but after any error raised past the
    first byte written, the contents of ``into``'s tensors are undefined (load again).
    """
    plan = _into(into, strict) if into is not None else None
    if isinstance(source, (ManagerBase, Store)) or (isinstance(source, str) and "://" in source):
        return _load_from_run(source, step, device, weights_only, storage_options, report, plan)
    root = _state_dir(source)
    doc = json.loads((root / STATE_FILE).read_text())
    check_format(doc, str(root / STATE_FILE))
    target = "cpu" if device is None else str(device)
    if plan is None:
        tensors = _st.load_file(str(root / TENSORS_FILE), device=target)
    else:
        from cloudckpt.integrations import _torch_restore as tr

        tensors = tr.read_file_into(root / TENSORS_FILE, doc, plan, _st_dtypes())
        if target != "cpu":
            tensors = {k: v if k in plan.tensors else v.to(target) for k, v in tensors.items()}
    missing = set(doc.get("tensors", {})) - set(tensors)
    if missing:
        raise CorruptionError(f"{TENSORS_FILE} lacks {sorted(missing)[:5]}")
    objects: list[Any] = []
    if doc.get("objects"):
        objects = load_objects(root / OBJECTS_FILE, doc, target, weights_only)
    return decode(doc["tree"], tensors, objects)


def _st_dtypes() -> Mapping[str, torch.dtype]:
    """safetensors' dtype names."""
    dtypes: Mapping[str, torch.dtype] = getattr(_st, "_TYPES", {})
    return dtypes


class _IntoFlattener(Flattener):
    """``Flattener`` over a state to load into: the names of its tensors, and the
    caller's tensor objects (not the detached aliases the flattener keeps)."""

    def __init__(self) -> None:
        super().__init__(sizing=True)
        self.originals: dict[str, torch.Tensor] = {}
        #: Paths of tensors that cannot be filled in place (save_state pickles them).
        self.unfillable: list[str] = []

    def tensor(self, t: torch.Tensor, path: tuple[str, ...]) -> Any:
        node = super().tensor(t, path)
        name = node.get("__tensor__") if isinstance(node, dict) else None
        if name is not None:
            self.originals.setdefault(name, t)
        elif isinstance(node, dict) and "__object__" in node:
            self.unfillable.append("/".join(path))
        return node


def _into(state: Any, strict: bool) -> Any:
    """The caller's tensors in ``state`` by the names ``save_state`` gives them
    (``_torch_restore.Into``). Raises ConfigurationError (as ``Into.of``, or what
    ``save_state`` would refuse in the state)."""
    from cloudckpt.integrations import _torch_restore as tr

    if isinstance(state, torch.nn.Module):
        raise ConfigurationError(
            "into is a module; load_state fills the tensors of a state",
            hint="Pass into=model.state_dict() (its tensors are the module's parameters and "
            "buffers), or a tree of state dicts as saved",
        )
    flat = _IntoFlattener()
    flat.node(state, ())
    if not flat.originals:
        raise ConfigurationError(
            f"into ({type(state).__name__}) holds no tensor to fill",
            hint="Pass into= the state as saved, e.g. {'model': model.state_dict()}, or "
            "leave it out to load into new tensors",
        )
    return tr.Into.of(flat.originals, strict, flat.unfillable)


def _load_from_run(
    source: ManagerBase | Store | str,
    step: int | None,
    device: str | torch.device | None,
    weights_only: bool,
    storage_options: Mapping[str, Any] | None,
    report: LoadReport | None,
    plan: Any = None,
) -> Any:
    """``load_state`` from the store (see there); ``plan``: the ``_torch_restore.Into``
    of ``into``, or None."""
    from cloudckpt.integrations import _torch_restore as tr
    from cloudckpt.transfer import TransferEngine

    report = report if report is not None else LoadReport()
    into: tr.Into | None = plan
    wanted = None if device is None else torch.device(device)
    if into is not None and into.device is not None:
        _one_cuda_device(into.device, wanted)
        ops = tr.device_ops(into.device)  # the caller's CUDA tensors, through staging
        fresh_on_device = wanted is not None and wanted.type == "cuda"
    else:
        ops = tr.device_ops(device)
        fresh_on_device = ops is not None
    report.device = str(ops.device) if ops is not None else "cpu"
    later = None if fresh_on_device or wanted is None or wanted.type == "cpu" else wanted
    keep = into.tensors if into is not None else {}

    def build(doc: dict[str, Any], tensors: Mapping[str, torch.Tensor], blob: bytes | None) -> Any:
        check_format(doc, STATE_FILE)
        if later is not None:  # a device reached through host memory
            tensors = {k: v if k in keep else v.to(later) for k, v in tensors.items()}
        if fresh_on_device:
            assert ops is not None
            target = str(ops.device)
        else:
            target = "cpu" if later is None else str(later)
        objects = load_objects(blob, doc, target, weights_only) if blob is not None else []
        if doc.get("objects") and blob is None:
            raise CorruptionError(f"the checkpoint lacks {OBJECTS_FILE}")
        return decode(doc["tree"], tensors, objects)

    load = functools.partial(
        tr.load_from_store,
        step=step,
        ops=ops,
        report=report,
        names=(STATE_FILE, TENSORS_FILE, OBJECTS_FILE),
        dtypes=_st_dtypes(),
        build=build,
        into=into,
        fresh_on_device=fresh_on_device,
    )
    if isinstance(source, ManagerBase):
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


def _one_cuda_device(theirs: torch.device, wanted: torch.device | None) -> None:
    """Raises ConfigurationError if ``device=`` names another CUDA device than the one
    ``into``'s tensors are on (one load copies to one device)."""
    if wanted is None or wanted.type != "cuda":
        return
    if wanted.index is None:
        wanted = torch.device("cuda", torch.cuda.current_device())
    if wanted != theirs:
        raise ConfigurationError(
            f"into's tensors are on {theirs} but device= is {wanted}; one load fills one "
            "CUDA device",
            hint=f"Leave device= out, or pass device={str(theirs)!r}",
        )


def resume_state(
    manager: ManagerBase,
    *,
    into: Any = None,
    strict: bool = True,
    step: int | None = None,
    device: str | torch.device | None = None,
    weights_only: bool = True,
    report: LoadReport | None = None,
) -> Any:
    """``manager.resume()`` into memory: claim the run (fencing any older writer), commit
    saves a crashed process left in ``staging_dir``, and load the newest committed
    checkpoint (or ``step``) straight from the store, or from the verified local copy in
    ``staging_dir`` (see ``load_state``). With ``into`` (e.g. ``{"model":
    model.state_dict(), "optimizer": optimizer.state_dict()}``), into those tensors, in
    place (``load_state``'s ``into`` and ``strict``). Returns None for a new, empty run
    (``into`` is then untouched).

    Raises: as ``CheckpointManager.claim`` and ``load_state`` (after a failure past the
    first byte written, ``into``'s tensors hold undefined contents).
    """
    plan = _into(into, strict) if into is not None else None  # refused before the claim
    if manager.claim() is None:
        return None
    return _load_from_run(manager, step, device, weights_only, None, report, plan)
