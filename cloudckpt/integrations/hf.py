"""Hugging Face ``transformers.Trainer``: commit every ``checkpoint-N`` to object storage.

::

    from transformers import Trainer, TrainingArguments
    from cloudckpt.integrations.hf import CheckpointCallback

    args = TrainingArguments(output_dir="out", save_steps=500, save_total_limit=2, ...)
    ckpt = CheckpointCallback("s3://bucket/runs/exp1", keep_last=3)
    last = ckpt.resume(args.output_dir)                 # None for a new run
    # With metric_for_best_model (load_best_model_at_end), the store keeps the best too.
    trainer = Trainer(model=model, args=args, callbacks=[ckpt], ...)
    trainer.train(resume_from_checkpoint=last)
    if ckpt.preempted:                                  # stopped early by a notice
        raise SystemExit(0)

What happens, in the Trainer's own order (``Trainer._save_checkpoint`` writes the model,
optimizer, scheduler, scaler, ``rng_state*.pth`` and ``trainer_state.json`` into
``output_dir/checkpoint-N``, applies ``save_total_limit`` rotation, then fires ``on_save``):

- ``on_save``: every rank first meets at a barrier (``on_save`` runs on all ranks, and each
  rank writes its own ``rng_state_<rank>.pth`` and, with FSDP/DeepSpeed, its shards; the
  Trainer does not wait for them before ``on_save``). Then the world process zero
  hard-links the directory into its staging area (``CheckpointManager.save_dir``) and hands
  it to the background uploader. The links pin the bytes, so a later
  ``save_total_limit`` rotation deleting ``checkpoint-N`` cannot race the upload. Only the
  coordinator claims and commits; the other ranks never touch the store.
  Each checkpoint is recorded with the evaluation metrics the Trainer logged at its step
  (the ``eval_*`` numbers of ``state.log_history``) and, in its metadata, what the
  Trainer believed best then (``best_step``, ``best_metric``, ``metric_for_best_model``,
  ``greater_is_better``).
- ``on_train_begin``: with ``metric_for_best_model`` set (``load_best_model_at_end`` sets it
  to "loss"), the run keeps the best checkpoint by that metric in the store as well
  (``keep_best=1``, ``best_metric="eval_<name>"``, ``best_mode`` from
  ``greater_is_better``), beside ``keep_last``: ``save_total_limit`` spares the best
  checkpoint locally, and so must the store, or a resume on a fresh machine finds no best
  model (transformers then drops ``best_model_checkpoint``).
- ``on_step_end``: a save that failed (its upload or commit, after the store calls' own
  retries) is raised here, which stops training at once: a run whose checkpoints do not
  reach the store must not go on for days (a fenced writer stops the same way). Then, if
  a preemption notice arrived (``cloudckpt.preemption``; any rank's
  notice counts, the flag is all-reduced), it sets ``control.should_save`` and
  ``control.should_training_stop``: the Trainer saves at this step boundary and stops.
  ``on_save`` then waits for that checkpoint's commit until the notice's deadline (or
  ``emergency_timeout``).
- ``on_train_end``: waits for every pending upload; raises the earliest that failed (so
  ``trainer.train()`` raises and the script exits non-zero), including an emergency
  checkpoint that failed. Only a save still uploading at the preemption deadline is left
  to the next start on this host, which commits it from ``staging_dir``.

Resuming on a new host: ``resume(url, output_dir)`` (or ``callback.resume(output_dir)``)
claims the run (fencing a zombie predecessor), restores the newest *committed* checkpoint
(verified, falling back to an older one if damaged) into ``output_dir/checkpoint-<step>``,
rewrites the old host's paths inside ``trainer_state.json`` (``best_model_checkpoint``),
restores the best checkpoint too if it is retained, and returns the path to pass as
``resume_from_checkpoint``. Unlike ``resume_from_checkpoint=True``, which picks the
highest-numbered local directory whether or not it is complete, only a committed checkpoint
is ever resumed from.

Multi-node jobs need ``output_dir`` on a filesystem every node shares (the coordinator
uploads what it sees); a missing ``rng_state_<rank>.pth`` is reported in the log.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from cloudckpt.attempts import CommitInfo
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    ConfigurationError,
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
from cloudckpt.retention import INHERIT, RetentionOptions, RetentionPolicy, logged_eval_metrics
from cloudckpt.savequeue import SaveHandle
from cloudckpt.stores import Store

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    from cloudckpt._install import install_hint

    raise ImportError(
        f"cloudckpt.integrations.hf needs transformers, which is not installed. "
        f"{install_hint('hf')}"
    ) from _exc

__all__ = ["CheckpointCallback", "fix_trainer_state", "resume"]

log = logging.getLogger("cloudckpt.hf")

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
TRAINER_STATE_NAME = "trainer_state.json"
STAGING_SUBDIR = ".cloudckpt-staging"
# TrainingArguments' own default for ``output_dir`` (typed optional; its __post_init__
# replaces None with this)
DEFAULT_OUTPUT_DIR = "trainer_output"
_CKPT_NAME = re.compile(rf"^{PREFIX}-(\d+)$")


# ------------------------------------------------------------------------------ ranks


def _dist() -> Any:
    """torch.distributed when a multi-process group is up, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _check_process_group(what: str) -> Any:
    dist = _dist()
    if dist is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigurationError(
            f"{what} runs in a {os.environ['WORLD_SIZE']}-process job but torch.distributed "
            "is not initialized yet",
            hint="Create the TrainingArguments first (that sets up the process group), then "
            "call resume() on every rank",
        )
    return dist


def _any_rank(flag: bool, device: Any) -> bool:
    dist = _dist()
    if dist is None:
        return flag
    import torch

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# ------------------------------------------------------------------------------ trainer_state.json


def fix_trainer_state(
    checkpoint_dir: str | os.PathLike[str], output_dir: str, old_output_dir: str | None = None
) -> int | None:
    """Rewrite paths of the old run inside ``checkpoint_dir/trainer_state.json``.

    ``best_model_checkpoint`` (``<old output_dir>/checkpoint-K``) becomes
    ``<output_dir>/checkpoint-K``; any other string that starts with ``old_output_dir``
    (e.g. in ``stateful_callbacks``) is moved the same way. The file is replaced
    atomically. Returns K (the best checkpoint's step), or None.
    """
    path = Path(checkpoint_dir) / TRAINER_STATE_NAME
    doc = json.loads(path.read_text())
    changed = False
    best_step = None

    def move(value: str) -> str:
        nonlocal changed
        if old_output_dir:
            for prefix in {old_output_dir.rstrip("/"), os.path.abspath(old_output_dir)}:
                if value.startswith(prefix + "/"):
                    changed = True
                    return os.path.join(output_dir, value[len(prefix) + 1 :])
        return value

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return move(node)
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    best = doc.get("best_model_checkpoint")
    if isinstance(best, str) and best:
        name = Path(best).name
        match = _CKPT_NAME.match(name)
        if match:
            best_step = int(match.group(1))
            new = os.path.join(output_dir, name)
            if new != best:
                doc["best_model_checkpoint"] = new
                changed = True
    if "stateful_callbacks" in doc:
        doc["stateful_callbacks"] = walk(doc["stateful_callbacks"])
    if changed:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    return best_step


# ------------------------------------------------------------------------------ resume


def _move_aside(path: Path, why: str) -> None:
    aside = path.with_name(
        f".{path.name}.{why}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(2)}"
    )
    os.rename(path, aside)
    log.warning("moved %s aside to %s (%s)", path, aside.name, why)


def _restore_here(
    mgr: CheckpointManager, output_dir: str, step: int | None, restore_best: bool, claim: bool
) -> tuple[str, int] | None:
    """Restore into output_dir/checkpoint-<step>; (path, step) or None for a new run."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".cloudckpt-restore-{secrets.token_hex(4)}"
    try:
        if claim:
            result = mgr.resume(into=tmp, step=step)
            if result is None:
                return None
        else:
            result = mgr.restore(into=tmp, step=step)
        if not (tmp / TRAINER_STATE_NAME).is_file():
            raise CloudCkptError(
                f"the checkpoint of step {result.step} in {mgr.url} has no {TRAINER_STATE_NAME}",
                hint="It was not written by a transformers Trainer; restore it with "
                "CheckpointManager.restore() instead",
            )
        name = str(result.metadata.get("checkpoint_dir") or f"{PREFIX}-{result.step}")
        if not _CKPT_NAME.match(name):
            name = f"{PREFIX}-{result.step}"
        target = out / name
        # Local checkpoints newer than the committed one were never committed (a crash
        # mid-upload): keep them, but out of the Trainer's sight.
        for local in sorted(out.iterdir()):
            m = _CKPT_NAME.match(local.name)
            if m and local.is_dir() and int(m.group(1)) > result.step:
                _move_aside(local, "uncommitted")
        best_step = fix_trainer_state(
            tmp, output_dir, old_output_dir=result.metadata.get("output_dir")
        )
        if restore_best and best_step is not None and best_step != result.step:
            _restore_best(mgr, out, best_step)
        if target.exists():
            _move_aside(target, "replaced")
        os.rename(tmp, target)
        # The Trainer's rotation orders checkpoints by mtime: the resumed one is the newest.
        os.utime(target)
        log.info("restored step %d from %s into %s", result.step, mgr.url, target)
        if result.skipped:
            log.info(  # each skip was warned about as it happened (reader.first_intact)
                "skipped damaged checkpoint(s) %s", ", ".join(str(s.step) for s in result.skipped)
            )
        return str(target), result.step
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _restore_best(mgr: CheckpointManager, out: Path, best_step: int) -> None:
    target = out / f"{PREFIX}-{best_step}"
    if (target / TRAINER_STATE_NAME).is_file():
        return
    try:
        mgr.restore(into=target, step=best_step, overwrite=True)
    except CheckpointNotFoundError:
        log.warning(
            "the best checkpoint (step %d) is no longer retained in %s; "
            "load_best_model_at_end will not find it (set metric_for_best_model so the "
            "callback keeps the best, or keep_best/best_metric; or pin it)",
            best_step,
            mgr.url,
        )
        return
    fix_trainer_state(target, str(out))


def _resume(
    make_manager: Any,
    output_dir: str | os.PathLike[str],
    step: int | None,
    restore_best: bool,
    close: bool,
) -> str | None:
    output_dir = os.fspath(output_dir)
    dist = _check_process_group("resume()")
    if dist is None:
        mgr = make_manager(output_dir, True)
        try:
            found = _restore_here(mgr, output_dir, step, restore_best, claim=True)
        finally:
            if close:
                mgr.close()
        return None if found is None else found[0]
    # Multi-process: rank 0 claims and restores; then each node that cannot see the files
    # (no shared filesystem) restores the same step read-only on its local rank 0.
    rank = dist.get_rank()
    box: list[Any] = [None]
    failure: BaseException | None = None
    if rank == 0:
        mgr = make_manager(output_dir, True)
        try:
            box[0] = ("ok", _restore_here(mgr, output_dir, step, restore_best, claim=True))
        except BaseException as exc:  # tell the other ranks, or they wait forever
            failure = exc
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
        finally:
            if close:
                mgr.close()
    dist.broadcast_object_list(box, src=0)
    status, found = box[0]
    if failure is not None:
        raise failure
    if status == "error":
        raise CloudCkptError(f"rank 0 could not resume: {found}")
    if found is None:
        return None
    path, found_step = found
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if rank != 0 and local_rank == 0 and not (Path(path) / TRAINER_STATE_NAME).is_file():
        reader = make_manager(output_dir, False)
        try:
            _restore_here(reader, output_dir, found_step, restore_best, claim=False)
        finally:
            reader.close()
    dist.barrier()
    return path


def resume(
    url: str | Store,
    output_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    restore_best: bool = True,
    **manager_kwargs: Any,
) -> str | None:
    """Restore the newest committed checkpoint of ``url`` into ``output_dir`` for the
    Trainer; return the path for ``trainer.train(resume_from_checkpoint=...)``, or None
    for a new run.

    Call it before ``trainer.train()``, on every rank (in multi-process jobs, after the
    ``TrainingArguments`` exist). Prefer ``CheckpointCallback.resume`` when you use the
    callback: it claims with the callback's own manager and settings. ``manager_kwargs``
    go to ``CheckpointManager`` (use the same ``keep_last``/``keep_every`` as the callback:
    the claim records them).

    Raises: NeedsRepairError, CorruptionError (nothing intact), StoreError, CloudCkptError
    (the checkpoint is not a Trainer checkpoint), ConfigurationError.
    """

    def make(out: str, coordinator: bool) -> CheckpointManager:
        kwargs = dict(manager_kwargs)
        if not coordinator:
            kwargs["staging_dir"] = None  # a private temporary directory
        return CheckpointManager(url, storage_options=storage_options, **kwargs)

    return _resume(make, output_dir, step, restore_best, close=True)


# ------------------------------------------------------------------------------ best model


def _eval_name(name: str) -> str:
    """The key of ``metric_for_best_model`` in the evaluation metrics (the Trainer's
    ``_determine_best_metric`` adds the ``eval_`` prefix)."""
    return name if name.startswith("eval_") else f"eval_{name}"


def _trainer_best(
    args: TrainingArguments,
    keep_best: int | str | None,
    best_metric: str | None,
    best_mode: str | None,
    run: RetentionPolicy,
) -> RetentionOptions | None:
    """The keep-best rule a callback configured with (keep_best, best_metric, best_mode)
    commits with under ``args``; None to leave the run's (or the constructor's).
    ``keep_best="auto"`` asks for the best one at least: never fewer than the run keeps by
    the same metric (``run``: its rules, the run's own once claimed by resume()).

    Raises: ConfigurationError (keep_best given, but no metric to rank by).
    """
    trainer_metric = args.metric_for_best_model and _eval_name(args.metric_for_best_model)
    if keep_best is None or (keep_best != "auto" and best_metric is not None):
        return None  # given whole to the constructor
    auto = keep_best == "auto"
    if auto:
        if not trainer_metric and best_metric is None:
            return None
        keep_best = 1
    metric = best_metric or trainer_metric or None
    mode = best_mode or ("max" if args.greater_is_better and metric == trainer_metric else "min")
    if auto and (run.best_metric, run.best_mode) == (metric, mode):
        keep_best = max(1, run.keep_best or 0)
    try:
        return RetentionOptions.parse(keep_best=keep_best, best_metric=metric, best_mode=mode)
    except ConfigurationError as exc:
        if metric is not None:
            raise
        # The rule is retention's; the words are the Trainer user's: where a metric comes from.
        raise ConfigurationError(
            f"{exc.message}: neither best_metric nor the TrainingArguments' "
            "metric_for_best_model is set",
            hint='Pass best_metric="eval_loss" (and best_mode), or set metric_for_best_model',
        ) from None


def _best_metadata(args: TrainingArguments, state: TrainerState) -> dict[str, Any]:
    """What the Trainer believes best when it saves: recorded in the metadata."""
    out: dict[str, Any] = {}
    if args.metric_for_best_model:
        out["metric_for_best_model"] = args.metric_for_best_model
        out["greater_is_better"] = bool(args.greater_is_better)
    best_step = getattr(state, "best_global_step", None)
    if isinstance(best_step, int) and best_step > 0:
        out["best_step"] = best_step
    if isinstance(state.best_metric, (int, float)) and math.isfinite(state.best_metric):
        out["best_metric"] = float(state.best_metric)
    return out


# ------------------------------------------------------------------------------ callback


class CheckpointCallback(TrainerCallback):
    """Upload and commit every checkpoint the Trainer saves; stop cleanly on preemption.

    Args:
        url: the run's location (``s3://``, ``gs://``, ``file://``...) or a ``Store``.
        storage_options: credentials and endpoint options for the store.
        staging_dir: local staging directory; default ``<output_dir>/.cloudckpt-staging``
            (same filesystem as the checkpoints, so snapshots are hard links, not copies).
        keep_last, keep_every: retention in the store (independent of
            ``save_total_limit``, which only governs local directories).
        keep_best, best_metric, best_mode: keep the best checkpoints by a metric in the
            store too (``CheckpointManager``). ``"auto"`` (default): with
            ``metric_for_best_model`` set in the ``TrainingArguments``, keep the best one
            by it (``eval_<name>``, direction from ``greater_is_better``), else leave the
            run's setting; an int: keep that many, by ``best_metric`` (default: the
            Trainer's metric); None: do not keep by metric.
        preemption: True (watch SIGTERM and the detected cloud's notices), False, or a
            ``PreemptionWatcher`` you configured (started here if it is not running).
        emergency_timeout: seconds after a notice to wait for the emergency checkpoint's
            commit; default: the notice's deadline when the source gives one (AWS, Azure,
            GCE), else 120 s.
        metadata: extra JSON metadata recorded with every checkpoint.
        **manager_kwargs: further ``CheckpointManager`` options (``transfer``,
            ``max_pending``, ``gc_grace``...).

    After ``trainer.train()`` returns, ``preempted`` says whether a notice stopped it and
    ``last_commit`` describes the newest committed checkpoint.
    """

    def __init__(
        self,
        url: str | Store,
        *,
        storage_options: Mapping[str, Any] | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        keep_best: int | Literal["auto"] | None = "auto",
        best_metric: str | None = None,
        best_mode: Literal["min", "max"] | None = None,
        preemption: bool | PreemptionWatcher = True,
        emergency_timeout: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        **manager_kwargs: Any,
    ) -> None:
        self.url = url
        self.storage_options = storage_options
        self.staging_dir = staging_dir
        rules = {"keep_periods": manager_kwargs.pop("keep_periods", INHERIT)}
        if keep_best != "auto" and (keep_best is None or best_metric is not None):
            # Known now: the claim records it (resume() claims before training starts).
            rules.update(
                keep_best=keep_best, best_metric=best_metric, best_mode=best_mode or INHERIT
            )
        #: The retention this callback sets (the rest of it at train begin: ``"auto"``).
        self.retention = RetentionOptions.parse(keep_last=keep_last, keep_every=keep_every, **rules)
        self.manager_kwargs = manager_kwargs
        self._best = (keep_best, best_metric, best_mode)
        self.emergency_timeout = emergency_timeout
        self.metadata = dict(metadata or {})
        # A watcher of our own is created at train begin (signal handlers need the main
        # thread, which runs the Trainer's callbacks).
        self._given_watcher = preemption if isinstance(preemption, PreemptionWatcher) else None
        self.watcher: PreemptionWatcher | None = self._given_watcher
        self._want_watcher = bool(preemption)
        self._started_watcher = False
        self._mgr: CheckpointManager | None = None
        #: Saves handed to the manager and not yet seen finished (newest last).
        self.pending_saves: list[SaveHandle] = []
        self._emergency_step: int | None = None
        self.last_commit: CommitInfo | None = None

    # ------------------------------------------------------------ public

    @property
    def manager(self) -> CheckpointManager | None:
        """The manager (world process zero only; created on first use)."""
        return self._mgr

    @property
    def preempted(self) -> bool:
        """True if a preemption notice stopped (or is stopping) training."""
        return self._emergency_step is not None

    def resume(
        self,
        output_dir: str | os.PathLike[str],
        *,
        step: int | None = None,
        restore_best: bool = True,
    ) -> str | None:
        """``resume()`` with this callback's store, options and manager (which then also
        makes the saves, so the run is claimed once). Returns the path for
        ``resume_from_checkpoint``, or None for a new run."""

        def make(out: str, coordinator: bool) -> CheckpointManager:
            if coordinator:
                return self._manager(out)
            return CheckpointManager(
                self.url, storage_options=self.storage_options, staging_dir=None
            )

        return _resume(make, output_dir, step, restore_best, close=False)

    # ------------------------------------------------------------ events

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._emergency_step = None
        if self._want_watcher:
            if self.watcher is None:
                self.watcher = PreemptionWatcher()
            if not self.watcher.running and not self.watcher.preempted:
                self.watcher.start()
                self._started_watcher = True
        if state.is_world_process_zero:
            mgr = self._manager(args.output_dir or DEFAULT_OUTPUT_DIR)
            best = _trainer_best(args, *self._best, run=mgr.settings.retention)
            if best is not None:
                mgr.set_retention(**best.given())

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._collect()
        if self.watcher is None or self._emergency_step is not None:
            return
        if _any_rank(self.watcher.preempted, args.device):
            self._emergency_step = state.global_step
            control.should_save = True
            control.should_training_stop = True
            reason = self.watcher.reason or "another rank received a preemption notice"
            log.warning("preemption (%s): saving step %d and stopping", reason, state.global_step)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        dist = _dist()
        if dist is not None:
            # Every rank has finished its part of _save_checkpoint once all are here.
            dist.barrier()
        if not state.is_world_process_zero:
            return
        step = state.global_step
        ckpt_dir = Path(args.output_dir or DEFAULT_OUTPUT_DIR) / f"{PREFIX}-{step}"
        if not ckpt_dir.is_dir():
            log.error(
                "on_save for step %d but %s does not exist (hyperparameter search runs are not "
                "supported); nothing uploaded",
                step,
                ckpt_dir,
            )
            return
        if args.world_size > 1 and not args.save_only_model:
            missing = [
                i for i in range(args.world_size) if not (ckpt_dir / f"rng_state_{i}.pth").exists()
            ]
            if missing:
                log.warning(
                    "%s lacks rng_state_%s.pth: output_dir is not shared by all nodes, so those "
                    "ranks' RNG state is not in the uploaded checkpoint",
                    ckpt_dir,
                    missing[0],
                )
        emergency = self._emergency_step is not None and step >= self._emergency_step
        metadata = {
            **self.metadata,
            "framework": "transformers",
            "checkpoint_dir": ckpt_dir.name,
            "output_dir": str(args.output_dir),
            "global_step": step,
            "emergency": emergency,
        }
        if state.epoch is not None and math.isfinite(state.epoch):
            metadata["epoch"] = state.epoch
        loss = next((h["loss"] for h in reversed(state.log_history) if "loss" in h), None)
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            metadata["loss"] = loss
        metadata.update(_best_metadata(args, state))
        metrics = logged_eval_metrics(state.log_history, step)
        handle = self._manager(args.output_dir or DEFAULT_OUTPUT_DIR).save_dir(
            step, ckpt_dir, metadata, metrics=metrics
        )
        self.pending_saves.append(handle)
        if emergency:
            self._wait_emergency(handle)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        try:
            if self._mgr is not None:
                timeout = None
                if self._emergency_step is not None and self.watcher is not None:
                    timeout = emergency_timeout(self.watcher.notice, self.emergency_timeout)
                self._finish(timeout)
        finally:
            if self.watcher is not None and self._started_watcher:
                self.watcher.stop()
                self._started_watcher = False
            if self._given_watcher is None:
                self.watcher = None

    # ------------------------------------------------------------ internals

    def _manager(self, output_dir: str) -> CheckpointManager:
        if self._mgr is None:
            staging = self.staging_dir
            if staging is None:
                staging = Path(output_dir) / STAGING_SUBDIR
            self._mgr = CheckpointManager(
                self.url,
                storage_options=self.storage_options,
                staging_dir=staging,
                **self.manager_kwargs,
                **self.retention.given(),
            )
        return self._mgr

    def _collect(self) -> None:
        """Note finished saves; a failed one is raised, which stops training."""
        collect_finished(self, log)

    def _wait_emergency(self, handle: SaveHandle) -> None:
        notice = self.watcher.notice if self.watcher is not None else None
        timeout = emergency_timeout(notice, self.emergency_timeout)
        info = wait_for_emergency(lambda t: handle.result(timeout=t), handle.step, timeout, log)
        if info is not None:
            self.last_commit = info

    def _finish(self, timeout: float | None) -> None:
        """Wait for pending saves and close the manager; raise the earliest failure."""
        mgr, self._mgr = self._mgr, None
        handles, self.pending_saves = self.pending_saves, []
        if mgr is not None:
            finish_pending(mgr, handles, timeout, self._record_commit)

    def _record_commit(self, info: CommitInfo) -> None:
        self.last_commit = info
