"""Lightning: a ``CheckpointIO`` that commits every checkpoint to object storage.

::

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from cloudckpt.integrations.lightning import (
        CloudCheckpointIO, PreemptionCallback, RNGStateCallback)

    io = CloudCheckpointIO("s3://bucket/runs/exp1", keep_last=3)
    ckpt_path = io.resume("checkpoints/")              # None for a new run
    trainer = L.Trainer(
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath="checkpoints/", every_n_epochs=1, save_last="link"),
                   PreemptionCallback(), RNGStateCallback()],
    )
    trainer.fit(model, datamodule, ckpt_path=ckpt_path)

How the ``CheckpointIO`` methods behave (Lightning calls them on global rank zero only,
except ``load_checkpoint``, which every rank calls):

- ``save_checkpoint(checkpoint, path)``: ``torch.save`` into a fresh staging directory (the
  only blocking part: a local-disk write), then the manager uploads and commits it in the
  background; training goes on. With ``keep_local=True`` (default) the staged file is also
  hard-linked to ``path``, so local tools (``ckpt_path="last"``, ``save_last="link"``)
  keep working at no extra I/O.
- ``load_checkpoint(path)``: a local file at ``path`` (for instance what ``resume()``
  restored, already verified) is loaded as ``TorchCheckpointIO`` would. Otherwise the
  newest retained checkpoint saved under that file name is restored from the store
  (verified) into a temporary directory and loaded: a fresh node needs no local copy.
  Each checkpoint that a ``ModelCheckpoint`` with a ``monitor`` saves as one of its top k
  is recorded with its score as a metric (``{"val_loss": 0.23}``: read from the
  callback's state in the checkpoint, ``best_k_models[path]``), so the store can keep
  the best k as well: ``CloudCheckpointIO(..., keep_best=2, best_metric="val_loss")``.
- ``remove_checkpoint(path)``: deletes the *local* file only, never anything in the store.
  ``ModelCheckpoint`` calls it right after saving a newer checkpoint, while that one may
  still be uploading; deleting the older checkpoint in the store then would leave nothing
  committed if the machine died a second later. The store's retention (``keep_last``,
  ``keep_every``, pins) drops old checkpoints only inside a commit of a newer one, and
  garbage collection deletes them after a grace period.
- ``teardown()``: waits for every pending commit; raises the earliest save that failed
  (so ``trainer.fit()`` raises and the script exits non-zero).

A save that failed (its upload or commit, after the store calls' own retries) is raised by
the next ``save_checkpoint`` (so by ``trainer.save_checkpoint`` or ``ModelCheckpoint``),
which stops training at once: a run whose checkpoints do not reach the store must not go on
for days. An emergency checkpoint that fails on preemption is raised by ``teardown()``.

Preemption: ``PreemptionCallback`` checks a ``PreemptionWatcher`` at every batch end and
epoch end (any rank's notice counts); on a notice it saves ``preempted-epoch=E-step=S.ckpt``
through the trainer (so through this IO), waits for the commit until the notice's deadline,
and stops the trainer. Lightning's own SIGTERM handling then ends ``fit()`` with
``SIGTERMException`` (a ``SystemExit`` with status 0) at the end of the epoch; if Lightning
raises it first (multi-process runs check at the start of each batch), the callback saves
from ``on_exception`` instead.

Exact resumption: Lightning does not checkpoint RNG states; ``RNGStateCallback`` does
(Python, numpy, torch, CUDA; per rank). Mid-epoch checkpoints resume exactly only with a
resumable (stateful) dataloader; otherwise checkpoint at epoch ends (Lightning warns).
Strategies that write sharded checkpoint directories themselves (FSDP, DeepSpeed) do not
use a ``CheckpointIO``; use ``CheckpointManager.save_dir`` on their output instead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

import torch

from cloudckpt.attempts import CommitInfo
from cloudckpt.errors import (
    CloudCkptError,
    ConfigurationError,
    step_not_retained,
)
from cloudckpt.integrations._pending import DEFAULT_EMERGENCY_TIMEOUT as DEFAULT_EMERGENCY_TIMEOUT
from cloudckpt.integrations._pending import (
    collect_finished,
    emergency_timeout,
    finish_pending,
    wait_for_emergency,
)
from cloudckpt.manager import CheckpointManager
from cloudckpt.preemption import PreemptionWatcher
from cloudckpt.retention import INHERIT, RetentionOptions
from cloudckpt.savequeue import SaveHandle
from cloudckpt.stores import Store

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.fabric.utilities.cloud_io import _load as _pl_load
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone ``pytorch_lightning`` package
    # (the same classes under another module path: mypy sees them as other types)
    try:
        from lightning_fabric.plugins import CheckpointIO  # type: ignore[assignment]
        from lightning_fabric.utilities.cloud_io import _load as _pl_load
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]
    except ImportError as _exc:  # pragma: no cover - exercised only without the extra
        from cloudckpt._install import install_hint

        raise ImportError(
            "cloudckpt.integrations.lightning needs lightning, which is not installed. "
            f"{install_hint('lightning')}"
        ) from _exc

try:  # Lightning >= 2.3 raises this on SIGTERM; older versions exit another way
    from lightning.pytorch.utilities.exceptions import SIGTERMException
except ImportError:
    try:
        from pytorch_lightning.utilities.exceptions import (  # type: ignore[assignment]
            SIGTERMException,  # (the same class under another module path, as above)
        )
    except ImportError:
        SIGTERMException = SystemExit  # type: ignore[misc,assignment]  # a stand-in class

__all__ = ["CloudCheckpointIO", "PreemptionCallback", "RNGStateCallback", "resume"]

log = logging.getLogger("cloudckpt.lightning")

STAGING_SUBDIR = ".cloudckpt-staging"


def _is_local(path: str | os.PathLike[str]) -> bool:
    text = os.fspath(path)
    return "://" not in text or text.startswith("file://")


def _local(path: str | os.PathLike[str]) -> Path:
    text = os.fspath(path)
    return Path(text[len("file://") :] if text.startswith("file://") else text)


def _global_rank() -> int:
    """This process's global rank, also before the process group exists (Lightning and
    torchrun set RANK / LOCAL_RANK / NODE_RANK in the processes they launch)."""
    with contextlib.suppress(ImportError):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) or 0)
    return 0 if local == 0 and node == 0 else 1 + local + node


def _link_or_copy(src: Path, dst: Path) -> None:
    """Place ``src`` at ``dst`` atomically (hard link, or copy across filesystems)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.cloudckpt-{secrets.token_hex(4)}")
    try:
        try:
            os.link(src, tmp)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class CloudCheckpointIO(CheckpointIO):
    """Save, load and remove Lightning checkpoints through cloudckpt.

    Args:
        url: the run's location (``s3://``, ``gs://``, ``file://``...) or a ``Store``.
        storage_options: credentials and endpoint options for the store.
        staging_dir: local staging directory; default ``<checkpoint dir>/.cloudckpt-staging``
            (same filesystem as the checkpoints, so the local copy is a hard link).
        keep_last, keep_every: retention in the store. ``ModelCheckpoint(save_top_k=...)``
            governs local files only; pin checkpoints you must keep (``cloudckpt pin``).
        keep_best, best_metric, best_mode: keep the best K checkpoints in the store by a
            monitored metric, as ``ModelCheckpoint(monitor=..., mode=..., save_top_k=K)``
            does locally: pass ``keep_best=mc.save_top_k, best_metric=mc.monitor,
            best_mode=mc.mode``. Left unset, the run's setting stays.
        keep_local: also place each checkpoint at the path Lightning asked for.
        **manager_kwargs: further ``CheckpointManager`` options.

    Pass it as ``Trainer(plugins=[io])``. Do not wrap it in ``AsyncCheckpointIO``: uploads
    are already asynchronous, and the wrapper's teardown would not wait for commits.
    """

    def __init__(
        self,
        url: str | Store,
        *,
        storage_options: Mapping[str, Any] | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        keep_best: int | None = INHERIT,
        best_metric: str | None = INHERIT,
        best_mode: Literal["min", "max"] = INHERIT,
        keep_local: bool = True,
        **manager_kwargs: Any,
    ) -> None:
        self.url = url
        self.storage_options = storage_options
        self.staging_dir = staging_dir
        self.keep_local = keep_local
        #: The retention this plugin sets (``keep_periods`` among ``manager_kwargs`` too).
        self.retention = RetentionOptions.parse(
            keep_last=keep_last,
            keep_every=keep_every,
            keep_best=keep_best,
            best_metric=best_metric,
            best_mode=best_mode,
            keep_periods=manager_kwargs.pop("keep_periods", INHERIT),
        )
        self.manager_kwargs = manager_kwargs
        self._mgr: CheckpointManager | None = None
        self._reader: CheckpointManager | None = None
        #: Saves handed to the manager and not yet seen finished (newest last).
        self.pending_saves: list[SaveHandle] = []
        self._teardown_timeout: float | None = None
        self.last_commit: CommitInfo | None = None

    # ------------------------------------------------------------ CheckpointIO

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Serialise ``checkpoint`` to local staging, then upload and commit in the
        background (see the module docstring).

        Raises: the exception of an earlier save that failed (training stops), FencedError,
        StagingError, ``torch.save``'s errors.
        """
        if storage_options is not None:
            raise TypeError(
                "Trainer.save_checkpoint(..., storage_options=...) is not supported by "
                "CloudCheckpointIO; set storage_options on CloudCheckpointIO itself"
            )
        self._collect()
        name = os.path.basename(os.fspath(path).rstrip("/")) or "checkpoint.ckpt"
        step = int(checkpoint.get("global_step", 0))
        metadata: dict[str, Any] = {
            "framework": "lightning",
            "filename": name,
            "path": os.fspath(path),
            "global_step": step,
        }
        if isinstance(checkpoint.get("epoch"), int):
            metadata["epoch"] = checkpoint["epoch"]
        mgr = self._manager(os.path.dirname(os.fspath(path)))
        handle = mgr.save(step, metadata, metrics=_top_k_scores(checkpoint, os.fspath(path)))
        with handle as staged_dir:
            staged = staged_dir / name
            torch.save(checkpoint, staged)
            if self.keep_local and _is_local(path):
                _link_or_copy(staged, _local(path))
        self.pending_saves.append(handle)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load ``path`` if it exists locally; else restore the newest retained checkpoint
        saved under its file name from the store (verified) and load that.

        Raises: FileNotFoundError (neither), CorruptionError, StoreError.
        """
        if _is_local(path) and _local(path).is_file():
            return _pl_load(str(_local(path)), map_location=map_location, weights_only=weights_only)
        name = os.path.basename(os.fspath(path).rstrip("/"))
        reader = self._reader_manager()
        matches = [c for c in reader.list() if c.metadata.get("filename") == name]
        if not matches:
            raise FileNotFoundError(
                f"Checkpoint file not found: {path} (not on this machine, and no checkpoint "
                f"named {name!r} is retained in {reader.url}; retained: "
                + ", ".join(sorted({str(c.metadata.get("filename")) for c in reader.list()}))
                + ")"
            )
        found = max(matches, key=lambda c: (c.step, c.committed_at))
        with tempfile.TemporaryDirectory(prefix="cloudckpt-lightning-") as tmp:
            result = reader.restore(into=Path(tmp) / "ckpt", step=found.step)
            file = result.path / name
            if not file.is_file():
                raise FileNotFoundError(
                    f"the retained checkpoint of step {found.step} in {reader.url} does not "
                    f"hold {name} (two checkpoints share that step; use save_last='link' so "
                    "each step is saved once)"
                )
            log.info("loading %s restored from %s (step %d)", name, reader.url, result.step)
            return _pl_load(str(file), map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the local copy at ``path`` only. Nothing in the store is deleted here:
        retention drops old checkpoints inside the commit of a newer one, so an old
        checkpoint never disappears before its successor is committed."""
        if not _is_local(path):
            return
        local = _local(path)
        with contextlib.suppress(FileNotFoundError):
            if local.is_dir() and not local.is_symlink():
                shutil.rmtree(local)
            else:
                local.unlink()
            log.debug("removed local checkpoint %s", local)

    def limit_teardown(self, seconds: float | None) -> None:
        """Make the next ``teardown`` wait at most ``seconds`` for pending commits (a
        preemption notice's deadline; None: as long as they take)."""
        self._teardown_timeout = seconds

    def teardown(self) -> None:
        """Wait for pending commits (until a preemption deadline, if one was set), then
        release the manager. Raises the earliest failed save's exception."""
        timeout, self._teardown_timeout = self._teardown_timeout, None
        try:
            self._finish(timeout)
        finally:
            if self._reader is not None:
                self._reader.close()
                self._reader = None

    # ------------------------------------------------------------ extras

    @property
    def manager(self) -> CheckpointManager | None:
        return self._mgr

    def resume(self, dirpath: str | os.PathLike[str], *, step: int | None = None) -> str | None:
        """Restore the newest committed checkpoint (or ``step``) into ``dirpath`` and return
        its path for ``trainer.fit(ckpt_path=...)``; None for a new run.

        Only global rank zero claims the run and downloads; other ranks (processes that
        Lightning or torchrun launched) get the same path without claiming, and
        ``load_checkpoint`` restores it on nodes that cannot see the file.
        """
        dirpath = _local(dirpath)
        if _global_rank() != 0:
            reader = self._reader_manager()
            retained = reader.list()
            chosen = [c for c in retained if step is None or c.step == step]
            if not chosen:
                if step is None:
                    return None
                raise step_not_retained(reader.url, step, (c.step for c in retained))
            return str(dirpath / str(chosen[0].metadata.get("filename", "checkpoint.ckpt")))
        mgr = self._manager(dirpath)
        dirpath.mkdir(parents=True, exist_ok=True)
        tmp = dirpath / f".cloudckpt-restore-{secrets.token_hex(4)}"
        try:
            result = mgr.resume(into=tmp, step=step)
            if result is None:
                return None
            name = str(result.metadata.get("filename") or "")
            files = [p for p in tmp.iterdir() if p.is_file()]
            if not name or not (tmp / name).is_file():
                if len(files) != 1:
                    raise CloudCkptError(
                        f"the checkpoint of step {result.step} in {mgr.url} was not written by "
                        "CloudCheckpointIO",
                        hint="Restore it with CheckpointManager.restore() instead",
                    )
                name = files[0].name
            target = dirpath / name
            os.replace(tmp / name, target)
            log.info("restored step %d from %s into %s", result.step, mgr.url, target)
            return str(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def wait(self, timeout: float | None = None) -> CommitInfo | None:
        """Wait for the newest save to commit; return its ``CommitInfo`` (None if there
        was no save). Raises TimeoutError, the save's error, or an older save's."""
        if not self.pending_saves:
            return self.last_commit
        info = self.pending_saves[-1].result(timeout=timeout)
        self.last_commit = info
        self._collect()
        return info

    # ------------------------------------------------------------ internals

    def _manager(self, ckpt_dir: str | os.PathLike[str]) -> CheckpointManager:
        if self._mgr is None:
            staging = self.staging_dir
            if staging is None and ckpt_dir and _is_local(ckpt_dir):
                staging = _local(ckpt_dir) / STAGING_SUBDIR
            self._mgr = CheckpointManager(
                self.url,
                storage_options=self.storage_options,
                staging_dir=staging,
                **self.manager_kwargs,
                **self.retention.given(),
            )
        return self._mgr

    def _reader_manager(self) -> CheckpointManager:
        """A read-only manager (restore and list only; never claims)."""
        if self._mgr is not None:
            return self._mgr
        if self._reader is None:
            self._reader = CheckpointManager(self.url, storage_options=self.storage_options)
        return self._reader

    def _collect(self) -> None:
        """Note finished saves; a failed one is raised, which stops training."""
        collect_finished(self, log)

    def _finish(self, timeout: float | None) -> None:
        mgr, self._mgr = self._mgr, None
        handles, self.pending_saves = self.pending_saves, []
        if mgr is not None:
            finish_pending(mgr, handles, timeout, self._record_commit)

    def _record_commit(self, info: CommitInfo) -> None:
        self.last_commit = info


def _top_k_scores(checkpoint: Mapping[str, Any], path: str) -> dict[str, float]:
    """{monitor: score} of every ``ModelCheckpoint`` that saves ``path`` as one of its top
    k: it puts the path and its score into ``best_k_models`` just before saving, and its
    state is in the checkpoint. Other saves (``last.ckpt``, a manual or emergency save)
    get no score: a callback's ``current_score`` may be an earlier step's."""
    scores: dict[str, float] = {}
    states = checkpoint.get("callbacks")
    for key, state in states.items() if isinstance(states, Mapping) else ():
        if not str(key).startswith("ModelCheckpoint") or not isinstance(state, Mapping):
            continue
        monitor, best_k = state.get("monitor"), state.get("best_k_models")
        if isinstance(monitor, str) and monitor and isinstance(best_k, Mapping) and path in best_k:
            with contextlib.suppress(TypeError, ValueError, RuntimeError):
                scores[monitor] = float(best_k[path])
    return scores


def resume(
    url: str | Store,
    dirpath: str | os.PathLike[str],
    *,
    step: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **manager_kwargs: Any,
) -> str | None:
    """Restore the newest committed checkpoint of ``url`` into ``dirpath``; return its path
    for ``trainer.fit(ckpt_path=...)``, or None for a new run. Prefer
    ``CloudCheckpointIO.resume`` (same manager and settings as the saves)."""
    io = CloudCheckpointIO(url, storage_options=storage_options, **manager_kwargs)
    try:
        return io.resume(dirpath, step=step)
    finally:
        io.teardown()


# ------------------------------------------------------------------------------ callbacks


class PreemptionCallback(Callback):
    """On a preemption notice: save at the next batch end, wait for the commit, stop.

    Args:
        watcher: a ``PreemptionWatcher`` (started here if not running), or None for one
            watching SIGTERM and the detected cloud.
        emergency_timeout: seconds after the notice to wait for the commit; default: the
            notice's deadline if the source gives one, else 120 s.
        dirpath: where the emergency checkpoint goes; default: the ``ModelCheckpoint``'s
            directory, else ``<default_root_dir>/checkpoints``.
        filename: the emergency checkpoint's file name (``{epoch}`` and ``{step}`` are
            filled in).
    """

    def __init__(
        self,
        watcher: PreemptionWatcher | None = None,
        *,
        emergency_timeout: float | None = None,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str = "preempted-epoch={epoch}-step={step}.ckpt",
    ) -> None:
        self.watcher = watcher
        self._own = watcher is None
        self._started = False
        self.emergency_timeout = emergency_timeout
        self.dirpath = dirpath
        self.filename = filename
        self.preempted = False
        self.emergency_path: str | None = None
        self.last_commit: CommitInfo | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self.watcher is None:
            self.watcher = PreemptionWatcher()
        if not self.watcher.running and not self.watcher.preempted:
            self.watcher.start()
            self._started = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._check(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # A signal that lands after the epoch's last batch-end check: Lightning raises its
        # SIGTERMException right after the epoch-end hooks, so this is the last boundary.
        self._check(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Multi-process runs: Lightning broadcasts rank 0's SIGTERM at the start of the next
        # batch and raises on every rank before any hook of ours runs; the state is still
        # between two batches, and every rank is here, so the save's collectives line up.
        if isinstance(exception, SIGTERMException) and not self.preempted:
            self._check(trainer, force=True)

    def _check(self, trainer: Any, force: bool = False) -> None:
        if self.preempted or self.watcher is None:
            return
        if not force and not trainer.strategy.reduce_boolean_decision(
            self.watcher.preempted, all=False
        ):
            return
        self.preempted = True
        dirpath = self.dirpath
        if dirpath is None:
            cb = trainer.checkpoint_callback
            dirpath = getattr(cb, "dirpath", None) or os.path.join(
                trainer.default_root_dir, "checkpoints"
            )
        path = os.path.join(
            os.fspath(dirpath),
            self.filename.format(epoch=trainer.current_epoch, step=trainer.global_step),
        )
        log.warning(
            "preemption (%s): saving %s and stopping",
            self.watcher.reason or "another rank received SIGTERM or a notice",
            path,
        )
        trainer.save_checkpoint(path)
        self.emergency_path = path
        trainer.should_stop = True
        io = trainer.strategy.checkpoint_io
        if trainer.is_global_zero and isinstance(io, CloudCheckpointIO):
            timeout = emergency_timeout(self.watcher.notice, self.emergency_timeout)
            info = wait_for_emergency(
                lambda t: io.wait(timeout=t), trainer.global_step, timeout, log
            )
            if info is not None:
                self.last_commit = info
            # teardown must not wait past the deadline either
            io.limit_teardown(emergency_timeout(self.watcher.notice, self.emergency_timeout))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.watcher is not None and self._started:
            self.watcher.stop()
            self._started = False
        if self._own:
            self.watcher = None


class RNGStateCallback(Callback):
    """Checkpoint the RNG states (Python, numpy, torch CPU, CUDA) of every rank and restore
    them on resume, so random augmentation, dropout and sampling continue exactly.

    Stored as plain lists and tensors (loads with ``weights_only=True``).
    """

    def state_dict(self) -> dict[str, Any]:
        mine = _collect_rng()
        states: list[dict[str, Any] | None] = [mine]
        with contextlib.suppress(ImportError):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                states = [None] * dist.get_world_size()
                dist.all_gather_object(states, mine)
        return {"ranks": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ranks = state_dict.get("ranks") or []
        if not ranks:
            return
        rank = _global_rank()
        if rank >= len(ranks):
            log.warning("no RNG state saved for rank %d (world size changed); using rank 0's", rank)
        _set_rng(ranks[rank] if rank < len(ranks) else ranks[0])


def _collect_rng() -> dict[str, Any]:
    import numpy as np

    version, state, gauss = random.getstate()
    # np.random's global generator is MT19937, whose legacy state is this tuple
    legacy = cast("tuple[str, Any, int, int, float]", np.random.get_state())
    kind, keys, pos, has_gauss, cached = legacy
    out: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng(state: Mapping[str, Any]) -> None:
    import numpy as np

    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            raise ConfigurationError(
                f"the checkpoint holds {len(cuda)} CUDA RNG states, this process sees "
                f"{torch.cuda.device_count()} devices"
            )
