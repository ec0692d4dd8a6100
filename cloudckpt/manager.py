"""``CheckpointManager``: stage locally, upload in the background, commit through LATEST.

A manager is composed of parts, each a module of its own: the save queue
(``cloudckpt.savequeue``: handles, backpressure, the background worker, and how failures
are reported, once), one host's save through the save pipeline (``cloudckpt.localsave``
over ``cloudckpt.attempts``: upload, manifest, the fenced compare-and-swap of LATEST, the
local copy kept), crash recovery (``cloudckpt.recovery``), automatic GC
(``cloudckpt.autogc``) and the read API (``cloudckpt.runview``). ``ManagerBase`` composes
them behind the public API both managers share; ``CheckpointManager`` is one host's, and
``cloudckpt.distributed.DistributedCheckpointManager`` the same parts on every rank. The
training loop blocks only to create the staging directory (``save()``) or to hard-link a
directory (``save_dir()``).
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, TypeVar

from cloudckpt import admin, attempt_layout, canonical, chunks, protocol, retention
from cloudckpt.attempts import AttemptWriter
from cloudckpt.autogc import AutoGC
from cloudckpt.committer import Committer, check_grace
from cloudckpt.errors import CloudCkptError, ConfigurationError
from cloudckpt.gc import GCReport, collect_garbage
from cloudckpt.localcopy import LocalCopies, check_dedicated
from cloudckpt.localsave import LocalSave
from cloudckpt.protocol import Settings
from cloudckpt.recovery import Recovery
from cloudckpt.restore import RestoreResult, prepare_destination
from cloudckpt.retention import INHERIT, RetentionOptions
from cloudckpt.runview import CheckpointInfo, RunView
from cloudckpt.savequeue import Backpressure, Pipeline, SaveHandle, SaveQueue, check_queue_options
from cloudckpt.staging import Attempt, StagingArea, holds_files
from cloudckpt.stores import Store, open_store
from cloudckpt.transfer import ProgressCallback, TransferConfig, TransferEngine

log = logging.getLogger("cloudckpt")

#: How long past its timeout ``close()`` waits for the save worker to end once its last
#: save is done (it only has to wake up).
CLOSE_SLACK_S = 1.0


def _left(deadline: float | None, slack: float = 0.0) -> float | None:
    """Seconds left until ``deadline`` (None: no deadline), plus ``slack``; at least 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic()) + slack


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(str(s) for s in steps)


def close_call(timeout: float | None) -> str:
    """``close(timeout=...)`` as a message names it (a caller's remaining time, such as
    ``finish_pending``'s, is a long float: three figures say enough)."""
    return "close()" if timeout is None else f"close(timeout={timeout:.3g})"


Self = TypeVar("Self", bound="ManagerBase")


def _check_options(
    chunking: chunks.ChunkingMode | bool, backpressure: str, max_pending: int, gc_grace: float
) -> chunks.ChunkingMode:
    """The chunking mode ``chunking`` names (True: "tensor", False: "off").
    Raises ConfigurationError for an option out of range."""
    if chunking is False or chunking is True:
        chunking = "tensor" if chunking else "off"
    if chunking not in chunks.MODES:
        raise ConfigurationError(f"chunking must be one of {chunks.MODES}, not {chunking!r}")
    check_queue_options(backpressure, max_pending)
    if gc_grace is not INHERIT and gc_grace < 1:
        raise ConfigurationError("gc_grace must be at least 1 second")
    return chunking


def _run_settings(
    keep_last: Any = INHERIT,
    keep_every: Any = INHERIT,
    gc_grace: Any = INHERIT,
    keep_best: Any = INHERIT,
    best_metric: Any = INHERIT,
    best_mode: Any = INHERIT,
    keep_periods: Any = INHERIT,
) -> tuple[Settings, set[str]]:
    """The run settings a writer commits with, and the names of those left unset (which
    keep the run's current values). Raises ConfigurationError (a bad retention policy)."""
    options = RetentionOptions.parse(
        keep_last=keep_last,
        keep_every=keep_every,
        keep_best=keep_best,
        best_metric=best_metric,
        best_mode=best_mode,
        keep_periods=keep_periods,
    )
    given: dict[str, Any] = options.given()
    if gc_grace is not INHERIT:
        given["gc_grace_s"] = int(gc_grace)
    settings = dataclasses.replace(Settings(), **given)
    return settings, set(protocol.SETTING_FIELDS) - set(given)


@dataclasses.dataclass(frozen=True)
class SaveMode:
    """How a manager class's saves run (``ManagerBase.save_mode``): ``pipeline`` builds
    what the queue runs for each save from the manager being built (``attempts``,
    ``local`` and ``progress`` set); ``collective``: ranks save together (the queue's
    collective mode, GC on its own thread, ``save()`` refuses neither an earlier failure
    nor a fenced writer)."""

    pipeline: Callable[[ManagerBase], Pipeline]
    collective: bool = False


class ManagerBase:
    """The public face every manager shares, composed of its parts: the ``store``, the
    ``staging`` area and its ``local`` tier, the ``committer`` and save pipeline
    (``attempts``), crash ``recovery``, the save ``queue``, ``auto_gc`` and the read API
    (``view``). Args and Raises: as ``CheckpointManager`` (one host's manager)."""

    #: How this manager's saves run (``SaveMode``): each manager class sets its own.
    save_mode: ClassVar[SaveMode]

    def __init__(
        self,
        url: str | Store,
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        keep_last: int | None = INHERIT,
        keep_every: int | None = INHERIT,
        keep_best: int | None = INHERIT,
        best_metric: str | None = INHERIT,
        best_mode: retention.BestMode = INHERIT,
        keep_periods: Sequence[tuple[float | str, float | str]] | None = INHERIT,
        storage_options: Mapping[str, Any] | None = None,
        gc_grace: float = INHERIT,
        auto_gc: bool = True,
        gc_interval: float = 600,
        max_pending: int = 1,
        backpressure: Backpressure = "block",
        transfer: TransferConfig | None = None,
        progress: ProgressCallback | None = None,
        unsafe_single_writer: bool = False,
        chunking: chunks.ChunkingMode | bool = "tensor",
        keep_local: int | None = None,
        local_budget_bytes: int | None = None,
    ) -> None:
        chunking = _check_options(chunking, backpressure, max_pending, gc_grace)
        if (keep_local is not None and keep_local < 0) or (
            local_budget_bytes is not None and local_budget_bytes < 0
        ):
            raise ConfigurationError("keep_local and local_budget_bytes must be >= 0")
        self._owns_store = not isinstance(url, Store)
        self.store: Store = (
            url
            if isinstance(url, Store)
            else open_store(url, storage_options, unsafe_single_writer=unsafe_single_writer)
        )
        self.url = self.store.url
        try:
            settings, inherit = _run_settings(
                keep_last, keep_every, gc_grace, keep_best, best_metric, best_mode, keep_periods
            )
            if gc_grace is not INHERIT:  # here, not at the first save (a run's: at each)
                check_grace(settings.gc_grace_s, self.store)
            leftovers = self._open_staging(staging_dir, keep_local, local_budget_bytes)
        except CloudCkptError:
            if self._owns_store:
                self.store.close()
            raise
        self.writer_id = protocol.new_writer_id()
        self.committer = Committer(self.store, self.writer_id, settings, inherit=inherit)
        #: Called with byte counts as uploads and downloads advance (the argument).
        self.progress = progress
        #: The save pipeline (``cloudckpt.attempts``); the DCP writer drives it directly.
        self.attempts: AttemptWriter = AttemptWriter(
            self.store,
            TransferEngine(transfer),
            self.committer,
            chunking=chunking,
            progress=progress,
            prepare=lambda: self.recovery.claim_if_needed(),
        )
        mode = self.save_mode
        # GC on a thread of its own: a hung one never holds up a save (cloudckpt.autogc).
        self.auto_gc = AutoGC(
            self.store, auto_gc, gc_interval, on_crash=lambda exc: self.queue.halt(exc)
        )
        self._pipeline = mode.pipeline(self)
        #: The save queue (``cloudckpt.savequeue``).
        self.queue = SaveQueue(
            self.staging,
            self._pipeline,
            self.gc_if_due,
            max_pending=max_pending,
            backpressure=backpressure,
            # Ranks: a fenced coordinator refusing would strand the others (begin() raises).
            before_open=None if mode.collective else self.attempts.check_fenced,
            collective=mode.collective,
        )
        #: Saves a crashed process left in staging (``cloudckpt.recovery``).
        self.recovery = Recovery(
            leftovers, self.local, self.committer, self.attempts.commit_lock, self.queue
        )
        self.view = RunView(self.store, lambda: self.engine, progress, self.local)  # the read API
        self._closed = False

    def _open_staging(
        self, staging_dir: str | os.PathLike[str] | None, keep: int | None, budget: int | None
    ) -> list[Attempt]:
        """Open the staging area (a temporary one without ``staging_dir``) and its local
        tier; returns the attempts a crashed process left there. Raises
        ConfigurationError, StagingError, UnknownFormatError (a newer version's staged
        save; left as it is)."""
        self._tmp_staging = None
        if staging_dir is None:
            self._tmp_staging = tempfile.TemporaryDirectory(prefix="cloudckpt-staging-")
            staging_dir = self._tmp_staging.name
        self.staging = StagingArea(staging_dir)
        check_dedicated(self.staging)  # before anything in it is deleted
        leftovers = list(self.staging.journaled())
        if keep is None:
            keep = 0 if self._tmp_staging is not None else 1
        #: The local tier: staged copies of committed checkpoints (``cloudckpt.localcopy``).
        self.local: LocalCopies = LocalCopies(self.staging.root, keep, budget)
        self.local.prune()
        return leftovers

    @property
    def engine(self) -> TransferEngine:
        """The transfer engine of uploads and restores (the save pipeline's own)."""
        return self.attempts.engine

    @engine.setter
    def engine(self, engine: TransferEngine) -> None:
        self.attempts.engine = engine

    @property
    def last_upload(self) -> chunks.UploadStats | None:
        """What the last chunked upload sent and reused (``chunks.UploadStats``)."""
        return self.attempts.last_upload

    @property
    def settings(self) -> Settings:
        """The run settings this writer commits with (the run's own once it has claimed)."""
        return self.committer.settings

    def set_retention(
        self,
        *,
        keep_last: int | None = INHERIT,
        keep_every: int | None = INHERIT,
        keep_best: int | None = INHERIT,
        best_metric: str | None = INHERIT,
        best_mode: retention.BestMode = INHERIT,
        keep_periods: Sequence[tuple[float | str, float | str]] | None = INHERIT,
    ) -> None:
        """Change the run's retention from this writer's next commit on (the options as in
        the constructor; those not given stay as they are). Nothing is dropped until a
        commit applies it, and what is dropped waits out the GC grace period.

        Raises: ConfigurationError (an invalid policy; nothing changes).
        """
        options = RetentionOptions.parse(
            keep_last=keep_last,
            keep_every=keep_every,
            keep_best=keep_best,
            best_metric=best_metric,
            best_mode=best_mode,
            keep_periods=keep_periods,
        )
        with self.attempts.commit_lock:
            self.committer.update_settings(**options.given())

    def claim(self) -> CheckpointInfo | None:
        """What ``resume()`` does before it restores: claim the run (fencing any older
        writer) and commit the saves a crashed process staged in ``staging_dir`` that are
        newer than the committed checkpoint. Returns the committed checkpoint, or None
        for a new, empty run. Restore it with ``restore()``, or into memory with
        ``cloudckpt.integrations.torch.resume_state`` (which calls this).

        Raises: NeedsRepairError, StoreError, CommitConflictError.
        """
        self.check_open()
        return CheckpointInfo.current_of(self.recovery.claim())

    # ---------------------------------------------------------------- saves

    def save(
        self,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Start a save. Use as a context manager; write the checkpoint's files into the
        directory it yields. Leaving the block hands them to the background uploader::

            with mgr.save(step=100, metadata={"note": "lr 3e-4"}, metrics={"loss": 0.3}) as d:
                (d / "model.safetensors").write_bytes(...)

        ``metrics``: numbers recorded with the checkpoint (``keep_best`` ranks by them;
        ``list()`` and ``cloudckpt ls --json`` show them); NaN and infinities are recorded
        as "nan"/"inf" and never rank as best.

        Raises (at once): the exception of an earlier save that failed in the background
        and that no one has been told of yet (``cloudckpt.savequeue``; this call then
        starts nothing); SaverStoppedError once the background saver has stopped for good
        (restart the process; not a save to retry); ConfigurationError (bad step, metadata
        or metrics). On entering: FencedError (a newer writer owns the run), StagingError
        (staging disk).
        """
        self.check_open()
        # A stopped worker refuses every later save: this process's only (with many ranks,
        # the others' next collectives then time out, as if this rank had died).
        self.queue.check_running()
        if not self.queue.collective:  # ranks would learn of it at different moments
            self.queue.raise_earlier_failure()
        metadata, cleaned = self.check_save_args(step, metadata, metrics)
        self._warn_if_older(step)
        return self.queue.handle(step, metadata, cleaned)

    def check_save_args(
        self,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, float | str]]:
        """What ``save()`` checks of its arguments, and nothing else (no earlier failure,
        no state): the metadata as a dict and the cleaned metrics. ``save_state`` asks
        before it cuts the previous save's local copy short for a save that would be
        refused anyway.

        Raises: ConfigurationError (bad step, metadata or metrics).
        """
        metadata = dict(metadata or {})
        attempt_layout.ckpt_prefix(step, 0, "x-0")  # validates step early
        canonical.canonical_json(metadata)  # validates metadata early
        return metadata, retention.clean_metrics(metrics)

    def _warn_if_older(self, step: int) -> None:
        """Warn (as ``cloudckpt push`` does) when ``step`` is older than the run's current
        checkpoint as this writer last read it (after ``resume()``, say): once committed it
        becomes the checkpoint restores pick, so a step counter that restarted at 0 would
        quietly send the next resume back in time."""
        latest = self.committer.latest
        current = latest.current if latest is not None else None
        if current is not None and step < current.step:
            log.warning(
                "step %d is older than the run's current step %d; once committed it "
                "becomes the current checkpoint that restores pick (did the step counter "
                "restart after resume()?)",
                step,
                current.step,
            )

    def save_dir(
        self,
        step: int,
        src: str | os.PathLike[str],
        metadata: Mapping[str, Any] | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Save an existing directory (e.g. a Trainer's ``checkpoint-N``). Its files are
        hard-linked into staging (copied across filesystems) before this returns, so the
        caller may delete or rotate ``src`` at once.

        A directory without files is saved as an empty checkpoint, with a warning (a
        rank may legitimately contribute nothing to a distributed save, and refusing on
        one rank would leave the others waiting); ``cloudckpt push`` refuses one.

        Raises: as ``save()`` (including an earlier save's unreported failure), plus
        ConfigurationError if ``src`` is not a directory.
        """
        started = time.perf_counter()
        if Path(src).is_dir() and not holds_files(src):
            log.warning("save_dir: %s holds no files; step %d is saved empty", src, step)
        handle = self.save(step, metadata, metrics=metrics)
        with handle:
            self.staging.snapshot(src, self.queue.staged(handle).attempt)
        handle.blocking_seconds = time.perf_counter() - started
        return handle

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save handed over so far has committed or failed.

        Saves that other threads are still writing (inside ``save()``'s block, e.g. a
        background serializer) are waited for too, so ``close()`` never loses them.

        Raises: the exception of the earliest failed save that no one has been told of
        (``cloudckpt.savequeue``); a further such failure stays for the next ``wait()`` or
        ``close()``. TimeoutError.
        """
        self.queue.wait(timeout)

    def gc_if_due(self) -> None:
        """Start a collection on its own thread if ``auto_gc`` is on and ``gc_interval``
        has passed since the last one started (after each save; the DCP writer after each
        commit); never waits for one (``cloudckpt.autogc``). A failure is logged, not
        raised."""
        self.auto_gc.if_due()

    def latest(self) -> CheckpointInfo | None:
        """The current committed checkpoint (a fresh read of the store), or None."""
        return self.view.latest()

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every retained checkpoint, newest first."""
        return self.view.list()

    def pin(self, step: int, label: str = "pinned") -> None:
        """Keep the retained checkpoint of ``step`` regardless of retention.

        Raises: CheckpointNotFoundError, NeedsRepairError, CommitConflictError.
        """
        admin.pin(self.store, step, label)

    def unpin(self, step: int) -> None:
        """Remove the pins of ``step``; retention then decides whether it stays."""
        admin.unpin(self.store, step)

    def gc(self, *, dry_run: bool = False, grace: float | None = None) -> GCReport:
        """Run garbage collection now (see ``cloudckpt.gc``)."""
        return collect_garbage(self.store, grace_seconds=grace, dry_run=dry_run)

    # ---------------------------------------------------------------- closing

    def check_open(self) -> None:
        """Raises ConfigurationError once ``close()`` has stopped the save worker (not after
        one that timed out with saves still running: the manager stays open), for
        integrations that drive the manager's parts themselves, like the DCP writer."""
        if self.queue.closing or self._closed:
            raise ConfigurationError("this CheckpointManager is closed")

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has released everything (not after one that timed out)."""
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending saves (see ``wait``), then release threads, staging and store.

        ``timeout`` bounds the whole call (plus ``CLOSE_SLACK_S``, 1 s, for the save worker
        to end): the wait for pending saves and for local copies still being finished; a
        running automatic GC and the transfer workers get what is left of it (GC never more
        than ``autogc.CLOSE_WAIT_S``, 60 s, the bound without a timeout): both are safe to
        leave running once no save is.

        If it expires while saves are still being written, **nothing is released** (their
        staging, the store, the worker stay; ``closed`` stays False) and a TimeoutError says
        how many, which steps, and what then: they go on in the background; ``close()``
        again waits for them (with its own ``timeout``) and releases everything once they
        are done; or exit, and a restart with the same ``staging_dir`` commits those already
        durable in staging (docs/design.md §12). Likewise, nothing is released while a local
        copy of a committed save is still being written into staging.

        Raises, after everything is released: the exception of the earliest failed save
        that no one has been told of (``cloudckpt.savequeue``; any further ones are logged, as
        nothing can raise them later). TimeoutError (above; nothing is then taken: a later
        ``close()`` still raises such a failure).
        """
        if self._closed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = self.queue.settle(timeout)
        # Saves other threads began meanwhile: wait for them too, within the deadline.
        while pending and deadline is not None and time.monotonic() < deadline:
            pending = self.queue.settle(_left(deadline))
        # The worker ends within moments of its last save: a little slack past the deadline.
        # (It may not: a save another thread began meanwhile, which the worker waits for
        # and runs; new saves are then refused, as close() has begun.) Without a timeout,
        # such saves are waited for there.
        if (pending and deadline is not None) or not self.queue.stop(
            _left(deadline, CLOSE_SLACK_S)
        ):
            raise TimeoutError(self._still_saving(pending or self.queue.unfinished(), timeout))
        if not self._pipeline.close(_left(deadline)):  # they write into staging
            raise TimeoutError(
                f"{close_call(timeout)} timed out: local copies of committed saves are still "
                "being written into staging (the saves are committed); nothing was released. "
                "Call close() again to keep waiting"
            )
        # A running GC gets what is left of close()'s timeout (at most CLOSE_WAIT_S).
        self.auto_gc.close(_left(deadline))
        if not self.engine.close(timeout=_left(deadline)):
            log.warning("close(): transfer workers still running at the deadline; not waited for")
        self.staging.close()
        if self._owns_store:
            self.store.close()
        if self._tmp_staging is not None:
            self._tmp_staging.cleanup()
        self._closed = True
        # Every save is done: raise the earliest failure no one was told of.
        failures = self.queue.take_unreported()
        for h, exc in failures[1:]:
            log.error("the save of step %d also failed: %r", h.step, exc)
        if failures:
            raise failures[0][1]

    def _still_saving(self, pending: builtins.list[SaveHandle], timeout: float | None) -> str:
        """What a ``close()`` that timed out with ``pending`` saves still running says: how
        many, which steps, and what becomes of each if the process exits now."""
        if not pending:  # every save is done, but the worker had not ended within the slack
            return (
                f"{close_call(timeout)} timed out: the save worker had not ended "
                f"{CLOSE_SLACK_S:g} s after its last save; nothing was released. Call close() "
                "again to keep waiting"
            )
        steps = [h.step for h in pending]
        durable = [h.step for h in pending if self.queue.durable(h)]
        others = [s for s in steps if s not in durable]
        message = (
            f"{close_call(timeout)} timed out: {len(pending)} save(s) still being written "
            f"(steps {_steps(steps)}); they go on in the background and nothing was released. "
            "Call close() again to keep waiting (it releases everything once they are done). "
        )
        if self.save_mode.collective:
            return message + (
                "Exiting now loses them: a multi-rank manager recovers no staged save; a "
                "restart resumes from LATEST"
            )
        if self._tmp_staging is not None:
            return message + (
                "Exiting now loses them: staging is a temporary directory (no staging_dir); "
                "a restart resumes from LATEST"
            )
        message += (
            "Or exit (a normal exit waits for the transfer threads, as long as the store "
            "does not answer: os._exit() or the job's kill does not): a restart with the "
            "same staging_dir resumes from LATEST"
        )
        if durable:
            message += (
                f" and commits the saves already durable in staging (steps {_steps(durable)}) first"
            )
        if others:
            message += (
                f"; steps {_steps(others)} are lost (their staged files were not yet flushed "
                "to disk, or are still being written)"
            )
        return message

    def __enter__(self: Self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except BaseException as close_exc:
            if exc is None:
                raise
            log.error("while closing after an error: %s", close_exc)  # do not mask ``exc``


class CheckpointManager(ManagerBase):
    """Checkpoints of one training run, stored under ``url``.

    Args:
        url: ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``file:///path``,
            ``memory://name/prefix`` or a local path; or a ``Store`` object.
        staging_dir: a local directory for staging (fast local disk; ideally on the same
            filesystem as directories passed to ``save_dir`` so snapshots are hard links).
            Default: a fresh temporary directory (no crash recovery across restarts).
            cloudckpt keeps ``attempts/``, ``committed/`` and ``dcp/`` in it and deletes
            only its own entries there; one holding anything else there is refused.
        keep_last: keep the newest N committed checkpoints (None: keep all).
        keep_every: also keep every checkpoint whose step is a multiple of K.
        keep_best, best_metric, best_mode: also keep the best K checkpoints by the metric
            ``best_metric`` recorded with each save (``save(..., metrics={...})``),
            ``best_mode="min"`` (default: lower is better) or ``"max"``. A checkpoint
            without that metric, or with NaN/inf, is never among the best; ties keep the
            older one. Set together (``keep_best=None`` turns it off).
        keep_periods: also keep one checkpoint per period for a window of time, e.g.
            ``[("1h", "1d"), ("1d", "30d")]``: the newest of each hour for the last day
            and of each day for the last 30 days (seconds or ``s/m/h/d/w`` strings),
            on the store's clock (docs/design.md §8). ``None`` or ``[]`` turns it off.
            The retention options and gc_grace are run settings stored in LATEST: left
            unset, they keep the run's current values (defaults for a new run: keep_last=3,
            nothing else, gc_grace=2 h), so restarting a job with default arguments never
            changes how much of its history is kept. Retention keeps the union of what
            each rule keeps, plus the current checkpoint and pins.
        storage_options: passed to the store as fsspec users pass them (credentials,
            ``endpoint_url``, ``client_kwargs``, ``profile``, ``token``...).
        gc_grace: seconds before unreferenced data may be deleted; also the longest a save
            may take to commit (minus a margin). Stored in LATEST for every GC to honour.
        auto_gc: run garbage collection in the background after commits, at most every
            ``gc_interval`` seconds.
        max_pending / backpressure: see ``cloudckpt.savequeue``.
        transfer: concurrency and part sizes (``TransferConfig``).
        progress: called with a byte count as uploads and downloads advance.
        unsafe_single_writer: allow writing to stores without conditional writes.
        chunking: ``"tensor"`` (default): files are stored as content-addressed chunks
            shared with the previous checkpoint, so a save uploads only what changed, with
            extra cut points at tensor boundaries of safetensors and ``torch.save`` files;
            ``"fixed"``: 8 MiB chunks only; ``"off"`` (or False): whole files, as before
            (``cloudckpt.chunks``, docs/design.md).
        keep_local: how many committed checkpoints keep their staged copy in
            ``staging_dir`` (the local tier, ``cloudckpt.localcopy``), so a restart on this
            host restores them with no download once they verify. Default: 1 with a
            ``staging_dir``, 0 with a temporary one (removed by ``close()``).
        local_budget_bytes: the most bytes the kept copies may take (default: no limit
            beyond ``keep_local``); a copy larger than this on its own is not kept.

    Raises:
        ConfigurationError, UnsupportedBackendError: bad URL or options; a staging
            directory in use by another manager, or holding files cloudckpt did not write
            where it keeps its own (nothing is deleted).
        StagingError: the staging directory cannot be created or listed.
    """

    save_mode = SaveMode(lambda manager: LocalSave(manager.attempts, manager.local))

    def resume(
        self,
        into: str | os.PathLike[str],
        *,
        step: int | None = None,
        overwrite: bool = False,
        link_local: bool = False,
    ) -> RestoreResult | None:
        """Claim the run (fencing any older writer) and restore the newest committed
        checkpoint (or ``step``) into ``into``. Returns None for a new, empty run.
        ``link_local``: as for ``restore``.

        Staged saves left by a crashed process in ``staging_dir`` that are newer than the
        committed checkpoint are uploaded and committed first (see ``staging``).

        Raises:
            NeedsRepairError: checkpoints exist but LATEST is missing or corrupt.
            CorruptionError: no retained checkpoint verifies (``exc.skipped`` says why).
            DestinationNotEmptyError, StoreError, CommitConflictError.
        """
        self.check_open()
        # Check the destination before claiming: a bad argument must not fence the writer.
        prepare_destination(Path(into).expanduser().absolute(), overwrite)
        if self.claim() is None:
            return None
        return self.view.restore(into, step, overwrite, link_local=link_local)

    def restore(
        self,
        into: str | os.PathLike[str],
        *,
        step: int | None = None,
        overwrite: bool = False,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        link_local: bool = False,
    ) -> RestoreResult:
        """Restore without claiming the run (read-only; safe beside a running writer).

        On the host that saved, the files of the kept local copy (``keep_local``) that
        verify are taken from it, not downloaded: reflinked where the filesystem can
        (btrfs, XFS), else copied, so each restored directory is independent of the copy
        and of other restores. ``link_local=True`` hard-links them instead (no bytes
        written: the fastest same-host restore), with a caveat: a restored file then IS
        the kept copy, so editing it in place (``open(p, "r+b")``, ``np.memmap``) changes
        the copy and every other directory restored with ``link_local``; replacing a file
        (write a new one, rename it over) is safe. A changed copy is never used: it no
        longer verifies, so the next restore downloads those files.

        ``include`` / ``exclude``: glob patterns for a partial restore ("weights only"):
        ``include=["*.safetensors", "config.json"]``, ``exclude=["optimizer*"]``; a
        pattern ending in ``/`` is a directory. Only the selected files are read, each
        verified against its recorded digest as in a whole restore; the rest are listed
        in ``RestoreResult.excluded``.

        Raises: CheckpointNotFoundError (also: the patterns select no file),
        ConfigurationError (a bad pattern), CorruptionError, DestinationNotEmptyError,
        StagingError, StoreError (see ``cloudckpt.restore.restore``).
        """
        self.check_open()
        return self.view.restore(into, step, overwrite, include, exclude, link_local=link_local)
