"""``CheckpointManager``: stage locally, upload in the background, commit through LATEST.

One background thread takes staged saves in order and runs each through the save pipeline
(``cloudckpt.attempts``: upload, write its manifest, commit it with a fenced
compare-and-swap of LATEST). This module is the queue in front of it: handles,
backpressure, crash recovery of staged saves, and reporting failures. The training loop
blocks only to create the staging directory (``save()``) or to hard-link a directory
(``save_dir()``).

Backpressure: at most ``max_pending`` saves wait behind the one uploading. A further save
either blocks until a slot frees (``backpressure="block"``, the default: nothing is lost)
or drops the oldest waiting save with a warning (``"drop_oldest"``: newest state wins; the
dropped save's handle raises ``SaveDroppedError``).

``close()`` waits for every pending save to commit or fail: a save that ``save()``
accepted is never silently discarded. ``close(timeout=...)`` bounds the wait.

Failures are never silent. A save that fails after ``save()`` returned (its upload or commit
on the background thread, or a background writer such as ``save_state`` failing to write its
files) is raised once, by whichever comes first:

- the save's own ``handle.result()`` / ``handle.exception()`` (the caller then owns it);
- the next ``save()`` / ``save_dir()`` (so a training loop learns at its next checkpoint,
  not at the end of the run: that call raises the earlier save's exception and starts
  nothing; the loop may catch it and save again);
- ``wait()`` or ``close()``, which raise it after waiting (``close()`` after releasing
  everything).

An exception raised by your own ``with mgr.save(...)`` block has already reached you: it
is not raised again. Nor is a save that ``backpressure="drop_oldest"`` dropped by design
(its handle still raises ``SaveDroppedError``). ``DistributedCheckpointManager.save()``
does not raise earlier failures (the ranks learn of them at slightly different moments,
and a save refused on one rank only would misalign the collectives); its ``wait()`` and
``close()`` do.
"""

from __future__ import annotations

import builtins
import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import datetime as dt
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from cloudckpt import chunks, protocol, retention
from cloudckpt.attempts import AttemptWriter, BegunAttempt, CommitInfo
from cloudckpt.committer import Committer
from cloudckpt.errors import (
    CloudCkptError,
    ConfigurationError,
    SaveDroppedError,
)
from cloudckpt.gc import GCReport, collect_garbage
from cloudckpt.localcopy import LocalCopies, adopt_leftover
from cloudckpt.protocol import INHERIT, CheckpointRecord, Latest, Manifest, Settings
from cloudckpt.reader import load_latest_for_reading
from cloudckpt.restore import RestoreResult, prepare_destination, restore
from cloudckpt.staging import (
    COMMITTED,
    DURABLE,
    FAILED,
    STAGED,
    Attempt,
    StagingArea,
    holds_files,
)
from cloudckpt.stores import Store, open_store
from cloudckpt.transfer import MemoryFile, ProgressCallback, TransferConfig, TransferEngine

log = logging.getLogger("cloudckpt")

Backpressure = Literal["block", "drop_oldest"]


def _run_in_thread(fn: Callable[[], None], name: str) -> cf.Future[None]:
    """Run ``fn`` on a new daemon thread; the future carries its outcome."""
    future: cf.Future[None] = cf.Future()

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A retained checkpoint, as ``list()`` reports it."""

    step: int
    commit_id: str
    ckpt: str
    epoch: int
    committed_at: str
    num_files: int
    total_bytes: int
    metadata: Mapping[str, Any]
    current: bool
    pins: tuple[str, ...] = ()
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, latest: Latest, record: CheckpointRecord) -> CheckpointInfo:
        return cls(
            step=record.step,
            commit_id=record.commit_id,
            ckpt=record.ckpt,
            epoch=record.epoch,
            committed_at=record.committed_at,
            num_files=record.num_files,
            total_bytes=record.total_bytes,
            metadata=dict(record.metadata),
            current=latest.current is not None and latest.current.commit_id == record.commit_id,
            pins=tuple(p.label for p in latest.pins if p.commit_id == record.commit_id),
            metrics=dict(record.metrics),
        )


class SaveHandle:
    """A save in progress. ``save()`` returns it as a context manager yielding the staging
    directory; ``save_dir()`` returns it already handed over.

    ``result(timeout)`` waits for the commit and returns ``CommitInfo``, or raises what the
    save raised (``FencedError``, ``StoreError``, ``StagingError``, ``SaveDroppedError``...).
    Once ``result()`` or ``exception()`` has handed a failure to the caller, the manager's
    ``save()``, ``wait()`` and ``close()`` do not raise it again (module docstring).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        step: int,
        metadata: Mapping[str, Any],
        metrics: Mapping[str, Any] | None = None,
    ):
        self._manager = manager
        self.step = step
        self.metadata = dict(metadata)
        self.metrics = dict(metrics or {})
        self._future: cf.Future[CommitInfo] = cf.Future()
        self._attempt: Attempt | None = None
        self.blocking_seconds = 0.0  # time spent in save()'s enter and exit, not the caller's
        # Whether a failure of this save has reached someone (result(), exception(), an
        # exception out of the caller's own block, or a raise by save()/wait()/close()).
        self._reported = False
        # Set by a writer that runs the block on a thread of its own (save_state): an
        # exception there reaches no caller, so the manager reports it instead.
        self._background = False
        self.handed_over_at = 0.0
        # Set by save_state: the files as in-memory buffers, uploaded from memory while the
        # staged copy (crash recovery only) is written beside the upload (``_save``).
        self._memory_files: list[tuple[str, MemoryFile]] | None = None
        # Set (before the commit is reported) when the staged copy of in-memory files is
        # still being written after the commit, to be kept as the local tier: done once
        # nothing reads the in-memory buffers any more.
        self._local_copy: cf.Future[None] | None = None

    # -- for writers that produce a save's files themselves (save_state) --

    def set_background(self, background: bool) -> None:
        """Whether this save's block runs on a thread of the writer's own, where a failure
        reaches no caller: the manager then reports it (from the next ``save()``,
        ``wait()`` or ``close()``). Set it back to False before leaving the block with an
        exception the writer raises to its caller itself."""
        self._background = background

    def mark_reported(self) -> None:
        """The writer has raised this save's failure to its caller: the manager does not
        raise it again."""
        self._reported = True

    def upload_from_memory(self, files: list[tuple[str, MemoryFile]] | None) -> None:
        """Upload these in-memory files (path, buffer) instead of reading the staged files
        back; the staged copy is still written beside the upload (crash recovery, the
        local tier). Call inside the block; the buffers must not change until
        ``release_memory()`` returns."""
        self._memory_files = files

    def release_memory(self) -> None:
        """Wait until nothing reads the in-memory files any more (the upload, and the
        staged copy kept as the local tier), then forget them. Never raises."""
        self._wait_until_buffers_free()
        self._memory_files = None

    # -- context manager (save()) --

    def __enter__(self) -> Path:
        if self._attempt is not None:
            raise RuntimeError("a SaveHandle can be entered only once")
        started = time.perf_counter()
        self._attempt = self._manager._open_attempt(self)
        self.blocking_seconds = time.perf_counter() - started
        return self._attempt.files_dir

    def _staged_attempt(self) -> Attempt:
        """The attempt ``__enter__`` opened. Raises RuntimeError if it was never entered."""
        if self._attempt is None:
            raise RuntimeError(f"the save of step {self.step} has not begun: enter its handle")
        return self._attempt

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self._manager._abandon(self, exc)
            return
        started = time.perf_counter()
        self._manager._hand_over(self)
        self.blocking_seconds += time.perf_counter() - started

    # -- future-like --

    def result(self, timeout: float | None = None) -> CommitInfo:
        """Wait for the commit. Raises TimeoutError if it is not done within ``timeout``."""
        if not _wait_interruptibly([self._future], timeout):
            raise TimeoutError(f"the save of step {self.step} is not committed yet")
        self._reported = True  # the caller has the outcome: save()/wait()/close() won't raise it
        return self._future.result()

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the outcome; the save's exception, or None if it committed. A failure
        returned here is the caller's to handle: the manager does not raise it again."""
        exc = self._future.exception(timeout)
        if exc is not None:
            self._reported = True
        return exc

    def _wait_until_buffers_free(self) -> None:
        """Wait until the manager no longer reads this save's in-memory files (its upload
        is done, and so is the staged copy kept as the local tier). Never raises."""
        cf.wait([self._future])
        if self._local_copy is not None:
            cf.wait([self._local_copy])

    def _unreported_failure(self) -> BaseException | None:
        """The save's failure if it is done, failed, and no one has been told yet; a save
        dropped by ``backpressure="drop_oldest"`` is policy, not a failure."""
        if self._reported or not self._future.done():
            return None
        exc = self._future.exception()
        return None if isinstance(exc, SaveDroppedError) else exc

    def _take_failure(self) -> BaseException | None:
        """``_unreported_failure``, marked reported (at most one caller gets it)."""
        with _REPORT_LOCK:
            exc = self._unreported_failure()
            if exc is not None:
                self._reported = True
            return exc

    def __repr__(self) -> str:
        if not self.done():
            state = "pending"
        else:
            state = "failed" if self._future.exception() else "committed"
        return f"<SaveHandle step={self.step} {state}>"


_REPORT_LOCK = threading.Lock()  # one reporter per failure (SaveHandle._take_failure)


def _abandoned_error(handle: SaveHandle, exc: BaseException) -> CloudCkptError:
    """The error a save abandoned before its upload fails with (``exc`` is its cause)."""
    where = "writing its files" if handle._background else "the block"
    error = CloudCkptError(
        f"the save of step {handle.step} was abandoned before its upload: {where} raised "
        f"{type(exc).__name__}: {exc}",
        hint="Nothing of this step was stored. Fix the cause (chained: a traceback prints "
        "it first) and save again",
    )
    error.__cause__ = exc
    return error


def _wait_interruptibly(futures: list[cf.Future], timeout: float | None) -> bool:
    """Wait for ``futures``; True when all are done. Waits in short slices: a signal
    (Ctrl-C, SIGTERM) delivered to one of the transfer threads does not wake a main thread
    blocked on a lock, so one long wait would delay its handler until the save finished."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return all(f.done() for f in futures)
        _, pending = cf.wait(futures, 0.2 if remaining is None else min(remaining, 0.2))
        if not pending:
            return True


@dataclasses.dataclass
class QueuedSave:
    """A save handed over to the queue: what the worker gives ``_save``."""

    handle: SaveHandle
    attempt: Attempt
    recovered: bool = False


def _check_options(
    chunking: chunks.ChunkingMode | bool, backpressure: str, max_pending: int, gc_grace: float
) -> chunks.ChunkingMode:
    """The chunking mode ``chunking`` names (True: "tensor", False: "off").
    Raises ConfigurationError for an option out of range."""
    if chunking is False or chunking is True:
        chunking = "tensor" if chunking else "off"
    if chunking not in chunks.MODES:
        raise ConfigurationError(f"chunking must be one of {chunks.MODES}, not {chunking!r}")
    if backpressure not in ("block", "drop_oldest"):
        raise ConfigurationError(
            f"backpressure must be 'block' or 'drop_oldest', not {backpressure!r}"
        )
    if max_pending < 0:
        raise ConfigurationError("max_pending must be >= 0")
    if gc_grace is not INHERIT and gc_grace < 1:
        raise ConfigurationError("gc_grace must be at least 1 second")
    return chunking


def _best_settings(keep_best: Any, best_metric: Any, best_mode: Any) -> dict[str, Any]:
    """keep_best, best_metric and best_mode as one unit: all inherited ({}), or all set.

    Raises: ConfigurationError (a metric or mode without keep_best, keep_best without a
    metric).
    """
    if keep_best is INHERIT:
        if best_metric is not INHERIT or best_mode is not INHERIT:
            raise ConfigurationError(
                "best_metric and best_mode need keep_best (how many best checkpoints to keep)",
                hint='E.g. keep_best=1, best_metric="eval_loss", best_mode="min"',
            )
        return {}
    if keep_best is None:
        return {"keep_best": None, "best_metric": None, "best_mode": "min"}
    if best_metric is INHERIT or best_metric is None:
        raise ConfigurationError(
            f"keep_best={keep_best!r} needs best_metric: which metric ranks the checkpoints",
            hint='E.g. keep_best=1, best_metric="eval_loss", best_mode="min" (lower is '
            "better); record it with save(..., metrics={...})",
        )
    mode = "min" if best_mode is INHERIT else best_mode
    return {"keep_best": keep_best, "best_metric": best_metric, "best_mode": mode}


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
    given: dict[str, Any] = {
        "keep_last": keep_last,
        "keep_every": keep_every,
        "gc_grace_s": gc_grace if gc_grace is INHERIT else int(gc_grace),
        "keep_periods": (
            keep_periods if keep_periods is INHERIT else retention.periods(keep_periods)
        ),
        "keep_best": INHERIT,
        "best_metric": INHERIT,
        "best_mode": INHERIT,
    }
    given.update(_best_settings(keep_best, best_metric, best_mode))
    explicit = {k: v for k, v in given.items() if v is not INHERIT}
    settings = dataclasses.replace(Settings(), **explicit)  # validates
    return settings, set(given) - set(explicit)


class CheckpointManager:
    """Checkpoints of one training run, stored under ``url``.

    Args:
        url: ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``file:///path``,
            ``memory://name/prefix`` or a local path; or a ``Store`` object.
        staging_dir: a local directory for staging (fast local disk; ideally on the same
            filesystem as directories passed to ``save_dir`` so snapshots are hard links).
            Default: a fresh temporary directory (no crash recovery across restarts).
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
        max_pending / backpressure: see the module docstring.
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
        ConfigurationError, UnsupportedBackendError: bad URL or options.
    """

    # Long by its signature (every option of the manager); the code is ~45 lines.
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
        settings, inherit = _run_settings(
            keep_last, keep_every, gc_grace, keep_best, best_metric, best_mode, keep_periods
        )
        self._tmp_staging = None
        if staging_dir is None:
            self._tmp_staging = tempfile.TemporaryDirectory(prefix="cloudckpt-staging-")
            staging_dir = self._tmp_staging.name
        self.staging = StagingArea(staging_dir)
        self._leftovers = list(self.staging.journaled())
        if keep_local is None:
            keep_local = 0 if self._tmp_staging is not None else 1
        #: The local tier: staged copies of committed checkpoints (``cloudckpt.localcopy``).
        self.local = LocalCopies(self.staging.root, keep_local, local_budget_bytes)
        self.local.prune()
        self.writer_id = protocol.new_writer_id()
        self.committer = Committer(self.store, self.writer_id, settings, inherit=inherit)
        #: Called with byte counts as uploads and downloads advance (the argument).
        self.progress = progress
        #: The save pipeline (``cloudckpt.attempts``); the DCP writer drives it directly.
        self.attempts = AttemptWriter(
            self.store,
            TransferEngine(transfer),
            self.committer,
            chunking=chunking,
            progress=progress,
            prepare=self._claim_for_save,
        )
        self._auto_gc = auto_gc
        self._gc_interval = gc_interval
        self._last_gc = time.monotonic()
        self._init_queue(max_pending, backpressure)

    def _init_queue(self, max_pending: int, backpressure: Backpressure) -> None:
        """The save queue in front of the pipeline; ``_cv`` guards all of it."""
        self._max_pending = max_pending
        self._backpressure = backpressure
        self._cv = threading.Condition()
        self._queue: collections.deque[QueuedSave] = collections.deque()
        self._reserved = 0  # saves inside their with-block, holding a queue slot
        self._open: dict[SaveHandle, int] = {}  # those saves -> the thread that entered them
        self._inflight: QueuedSave | None = None
        self._handles: list[SaveHandle] = []
        self._keeping: list[cf.Future[None]] = []  # local copies still being finished
        self._worker: threading.Thread | None = None
        self._closing = False
        self._closed = False
        # Test hook (cloudckpt.testing.simulation): run each save in the thread that hands
        # it over instead of on the background thread, so a seeded scheduler can
        # interleave managers deterministically.
        self._synchronous = False

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
        settings, inherit = _run_settings(
            keep_last, keep_every, INHERIT, keep_best, best_metric, best_mode, keep_periods
        )
        changes = {
            f.name: getattr(settings, f.name)
            for f in dataclasses.fields(Settings)
            if f.name not in inherit
        }
        with self.attempts.commit_lock:
            self.committer.update_settings(**changes)

    # ---------------------------------------------------------------- public API

    def resume(
        self, into: str | os.PathLike[str], *, step: int | None = None, overwrite: bool = False
    ) -> RestoreResult | None:
        """Claim the run (fencing any older writer) and restore the newest committed
        checkpoint (or ``step``) into ``into``. Returns None for a new, empty run.

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
        return self._restore_into(into, step, overwrite)

    def claim(self) -> CheckpointInfo | None:
        """What ``resume()`` does before it restores: claim the run (fencing any older
        writer) and commit the saves a crashed process staged in ``staging_dir`` that are
        newer than the committed checkpoint. Returns the committed checkpoint, or None
        for a new, empty run. Restore it with ``restore()``, or into memory with
        ``cloudckpt.integrations.torch.resume_state`` (which calls this).

        Raises: NeedsRepairError, StoreError, CommitConflictError.
        """
        self.check_open()
        with self.attempts.commit_lock:
            recovered = self._recover(self.committer.claim())
        self._drain()
        for job in recovered:
            try:
                job.handle.result()
            except CloudCkptError as exc:
                log.warning("could not commit recovered step %d: %s", job.handle.step, exc)
        latest = self.committer.latest
        if latest is None or latest.current is None:
            return None
        return CheckpointInfo.of(latest, latest.current)

    def _restore_into(
        self, into: str | os.PathLike[str], step: int | None, overwrite: bool
    ) -> RestoreResult:
        """``restore`` of this run with the manager's engine, progress and local tier."""
        return restore(
            self.store,
            into,
            self.engine,
            step=step,
            overwrite=overwrite,
            progress=self.progress,
            local=self.local,
        )

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
        and that no one has been told of yet (module docstring; this call then starts
        nothing); ConfigurationError (bad step, metadata or metrics). On entering:
        FencedError (a newer writer owns the run), StagingError (staging disk).
        """
        self.check_open()
        self._raise_earlier_failure()
        metadata = dict(metadata or {})
        protocol.ckpt_prefix(step, 0, "x-0")  # validates step early
        protocol.canonical_json(metadata)  # validates metadata early
        return SaveHandle(self, step, metadata, retention.clean_metrics(metrics))

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
        handle.__enter__()
        try:
            self.staging.snapshot(src, handle._staged_attempt())
        except BaseException as exc:
            handle.__exit__(type(exc), exc, exc.__traceback__)
            raise
        handle.__exit__(None, None, None)
        handle.blocking_seconds = time.perf_counter() - started
        return handle

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save handed over so far has committed or failed.

        Saves that other threads are still writing (inside ``save()``'s block, e.g. a
        background serializer) are waited for too, so ``close()`` never loses them.

        Raises: the exception of the earliest failed save that no one has been told of
        (module docstring); a further such failure stays for the next ``wait()`` or
        ``close()``. TimeoutError.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.get_ident()
        with self._cv:
            while any(thread != me for thread in self._open.values()):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"saves still being written after {timeout}s")
                self._cv.wait(remaining)
            handles = list(self._handles)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not _wait_interruptibly([h._future for h in handles], remaining):
            pending = sum(not h.done() for h in handles)
            raise TimeoutError(f"{pending} save(s) still pending after {timeout}s")
        failure = next((exc for h in handles if (exc := h._take_failure()) is not None), None)
        waited = set(handles)
        with self._cv:
            # Forget what was waited for, except failures not yet raised (the next call's).
            self._handles = [
                h for h in self._handles if h not in waited or h._unreported_failure() is not None
            ]
        if failure is not None:
            raise failure

    def _raise_earlier_failure(self) -> None:
        """Raise the earliest save that failed in the background and that no one has been
        told of (the next ``save()`` reports it); forget saves that are done and reported."""
        with self._cv:
            failure = next(
                (exc for h in self._handles if (exc := h._take_failure()) is not None), None
            )
            self._handles = [
                h for h in self._handles if not h.done() or h._unreported_failure() is not None
            ]
        if failure is not None:
            raise failure

    def _take_unreported(self) -> list[tuple[SaveHandle, BaseException]]:
        with self._cv:
            taken = [(h, exc) for h in self._handles if (exc := h._take_failure()) is not None]
            self._handles = [h for h in self._handles if not h.done()]
        return taken

    def latest(self) -> CheckpointInfo | None:
        """The current committed checkpoint (a fresh read of the store), or None."""
        latest, _ = load_latest_for_reading(self.store)
        if latest is None or latest.current is None:
            return None
        return CheckpointInfo.of(latest, latest.current)

    def list(self) -> list[CheckpointInfo]:
        """Every retained checkpoint, newest first."""
        latest, _ = load_latest_for_reading(self.store)
        return [] if latest is None else [CheckpointInfo.of(latest, r) for r in latest.retained()]

    def restore(
        self,
        into: str | os.PathLike[str],
        *,
        step: int | None = None,
        overwrite: bool = False,
    ) -> RestoreResult:
        """Restore without claiming the run (read-only; safe beside a running writer).

        Raises: CheckpointNotFoundError, CorruptionError, DestinationNotEmptyError,
        StagingError, StoreError (see ``cloudckpt.restore.restore``).
        """
        self.check_open()
        return self._restore_into(into, step, overwrite)

    def pin(self, step: int, label: str = "pinned") -> None:
        """Keep the retained checkpoint of ``step`` regardless of retention.

        Raises: CheckpointNotFoundError, NeedsRepairError, CommitConflictError.
        """
        from cloudckpt.admin import pin

        pin(self.store, step, label)

    def unpin(self, step: int) -> None:
        """Remove the pins of ``step``; retention then decides whether it stays."""
        from cloudckpt.admin import unpin

        unpin(self.store, step)

    def gc(self, *, dry_run: bool = False, grace: float | None = None) -> GCReport:
        """Run garbage collection now (see ``cloudckpt.gc``)."""
        return collect_garbage(self.store, grace_seconds=grace, dry_run=dry_run)

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending saves (see ``wait``), then release threads, staging and store.

        Raises, after everything is released: the exception of the earliest failed save
        that no one has been told of (module docstring; any further ones are logged, as
        nothing can raise them later); TimeoutError.
        """
        if self._closed:
            return
        try:
            self.wait(timeout)
        except BaseException:
            self._shutdown()
            for h, exc in self._take_unreported():
                log.error("the save of step %d also failed: %r", h.step, exc)
            raise
        self._shutdown()
        # Saves started by other threads after wait() returned are done now too.
        failures = self._take_unreported()
        for h, exc in failures[1:]:
            log.error("the save of step %d also failed: %r", h.step, exc)
        if failures:
            raise failures[0][1]

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # do not mask the exception already propagating
            self.close()
        except BaseException as close_exc:
            log.error("while closing after an error: %s", close_exc)

    # ---------------------------------------------------------------- internals
    # DistributedCheckpointManager (cloudckpt.distributed) is the one subclass. It
    # overrides _save (what a queued save does), _hand_over and _abandon (a failed rank
    # still takes part), _raise_earlier_failure and _check_not_fenced (no refusal on one
    # rank only), gc_if_due and _shutdown; it calls _enqueue, _fail and _wait_idle.

    def check_open(self) -> None:
        """Raises ConfigurationError once ``close()`` has begun (for integrations that
        drive the manager's parts themselves, like the DCP writer)."""
        if self._closing or self._closed:
            raise ConfigurationError("this CheckpointManager is closed")

    def _check_not_fenced(self) -> None:
        """Before a save's block is entered: a writer fenced by a newer one refuses at
        once (its commit could never land)."""
        self.attempts.check_fenced()

    def _shutdown(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join()
        cf.wait(self._keeping)  # local copies being finished write into staging
        self.engine.close()
        self.staging.close()
        if self._owns_store:
            self.store.close()
        if self._tmp_staging is not None:
            self._tmp_staging.cleanup()
        self._closed = True

    def _open_attempt(self, handle: SaveHandle) -> Attempt:
        with self._cv:
            self._check_not_fenced()
            while len(self._queue) + self._reserved >= self._max_pending and (
                self._inflight is not None or self._queue
            ):
                if self._backpressure == "drop_oldest" and self._queue:
                    self._drop(self._queue.popleft())
                    continue
                self._cv.wait()
            self._reserved += 1
            self._open[handle] = threading.get_ident()
        try:
            attempt_id = protocol.new_attempt_id(dt.datetime.now(dt.timezone.utc))
            return self.staging.new_attempt(
                attempt_id, handle.step, handle.metadata, handle.metrics
            )
        except BaseException:
            with self._cv:
                self._reserved -= 1
                self._open.pop(handle, None)
                self._cv.notify_all()
            raise

    def _drop(self, job: QueuedSave) -> None:
        log.warning(
            "dropping queued save of step %d: a newer save arrived (drop_oldest)", job.handle.step
        )
        job.attempt.remove()
        job.handle._future.set_exception(
            SaveDroppedError(f"the save of step {job.handle.step} was dropped for a newer one")
        )

    def _abandon(self, handle: SaveHandle, exc: BaseException) -> None:
        """The save's block raised ``exc`` (or its hand-over failed): nothing of it is
        stored. ``exc`` propagates to the caller of the block, who is thereby told; a
        block run in the background (``save_state``) tells no one, so its failure is kept
        for the next ``save()``, ``wait()`` or ``close()`` to raise."""
        if handle._attempt is not None:
            handle._attempt.remove()
        handle._reported = not handle._background
        handle._future.set_exception(_abandoned_error(handle, exc))
        with self._cv:
            self._reserved -= 1
            self._open.pop(handle, None)
            if handle._background:
                self._handles.append(handle)
            self._cv.notify_all()

    def _hand_over(self, handle: SaveHandle) -> None:
        try:
            handle._staged_attempt().set_state(STAGED, sync=False)
        except BaseException as exc:  # e.g. a full staging disk: release the queue slot
            self._abandon(handle, exc)
            raise
        self._enqueue(handle)

    def _enqueue(self, handle: SaveHandle) -> None:
        """Queue a save whose block has ended for the background worker."""
        job = QueuedSave(handle, handle._staged_attempt())
        handle.handed_over_at = time.perf_counter()
        with self._cv:
            self._reserved -= 1
            self._open.pop(handle, None)
            self._queue.append(job)
            self._handles.append(handle)
            self._ensure_worker()
            self._cv.notify_all()
        self._drain()

    def _wait_idle(self) -> None:
        """Wait until no save is queued or in flight (without raising their failures)."""
        with self._cv:
            while self._queue or self._inflight is not None:
                self._cv.wait(0.2)

    def _ensure_worker(self) -> None:
        if self._worker is None and not self._synchronous:
            self._worker = threading.Thread(target=self._run, name="cloudckpt-saver", daemon=True)
            self._worker.start()

    def _drain(self) -> None:
        """Synchronous mode: run every queued save now, in this thread."""
        if not self._synchronous:
            return
        self._worker = threading.current_thread()
        try:
            self._run(until_idle=True)
        finally:
            self._worker = None

    def _run(self, until_idle: bool = False) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing and not until_idle:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._inflight = self._queue.popleft()
                self._cv.notify_all()
            try:
                job.handle._future.set_result(self._save(job))
            except Exception as exc:
                job.handle._future.set_exception(exc)
            except BaseException as exc:  # a simulated crash: stop like a dead process
                job.handle._future.set_exception(exc)
                with self._cv:
                    self._inflight = None
                    for queued in self._queue:
                        queued.handle._future.set_exception(exc)
                    self._queue.clear()
                    self._cv.notify_all()
                return
            finally:
                with self._cv:
                    self._inflight = None
                    self._cv.notify_all()
            self.gc_if_due()

    def gc_if_due(self) -> None:
        """Collect garbage now if ``auto_gc`` is on and ``gc_interval`` has passed since
        the last collection (after each save; the DCP writer after each commit). A
        failure is logged, not raised."""
        if not self._auto_gc or time.monotonic() - self._last_gc < self._gc_interval:
            return
        self._last_gc = time.monotonic()
        try:
            collect_garbage(self.store)
        except CloudCkptError as exc:
            log.warning("background garbage collection failed: %s", exc)

    def _claim_for_save(self) -> None:
        """The save pipeline's ``prepare`` hook, before every attempt: claim the run if
        ``resume()`` did not, and commit the saves a crashed process staged first (they
        are older). Each recovered save reports to its own handle."""
        with self.attempts.commit_lock:
            recovered = self._claim_if_needed()
        for earlier in recovered:  # staged by a crashed process; older, so first
            try:
                earlier.handle._future.set_result(self._save(earlier))
            except Exception as exc:
                earlier.handle._future.set_exception(exc)
                log.warning("could not commit recovered step %d: %s", earlier.handle.step, exc)

    def _claim_if_needed(self) -> builtins.list[QueuedSave]:
        """Claim on the first save if resume() did not; return recovered jobs to run."""
        if self.committer.latest is not None:
            return []
        return self._recover(self.committer.claim())

    def _recover(self, latest: Latest) -> builtins.list[QueuedSave]:
        """Decide about attempts a crashed process left in staging (module doc of staging)."""
        committed_step = latest.current.step if latest.current else -1
        jobs = []
        for attempt in self._leftovers:
            if attempt.state == DURABLE and attempt.step > committed_step:
                log.warning("recovering step %d staged by a crashed process", attempt.step)
                handle = SaveHandle(self, attempt.step, attempt.metadata, attempt.metrics)
                handle.handed_over_at = time.perf_counter()
                job = QueuedSave(handle, attempt, recovered=True)
                jobs.append(job)
            elif attempt.state in (STAGED, DURABLE, COMMITTED) and attempt.step == committed_step:
                # Committed, then the process died before keeping it as a local copy (or
                # before the journal said so): a candidate copy, proven by content on use
                # (a staged copy may be incomplete: what does not verify is downloaded).
                adopt_leftover(self.local, attempt)
            else:
                if attempt.state != COMMITTED:
                    log.info("abandoning step %d left in staging (%s)", attempt.step, attempt.state)
                attempt.remove()
        self._leftovers = []
        if jobs and threading.current_thread() is not self._worker:
            # resume(): the worker commits them first, resume() waits for their handles.
            with self._cv:
                self._queue.extendleft(reversed(jobs))
                self._handles.extend(j.handle for j in jobs)
                self._ensure_worker()
                self._cv.notify_all()
        return jobs

    def _save(self, job: QueuedSave) -> CommitInfo:
        """Upload, write the manifest, commit (runs on the worker thread)."""
        if job.handle._memory_files is not None and not job.recovered:
            return self._save_from_memory(job, job.handle._memory_files)
        attempt, handle = job.attempt, job.handle

        def make_durable() -> None:
            attempt.fsync_files()
            attempt.set_state(DURABLE)

        # Flushing the staged files to disk (for crash recovery) runs beside the upload,
        # which reads them from the page cache: the two overlap instead of adding up
        # (docs/performance.md). The commit waits for both.
        flushed = _run_in_thread(make_durable, f"cloudckpt-fsync-{handle.step}")
        try:
            try:
                begun, latest, manifest = self.attempts.save(
                    handle.step,
                    attempt.list_files(),
                    handle.metadata,
                    flushed.result,
                    metrics=handle.metrics,
                )
            finally:
                cf.wait([flushed])  # never remove or reuse files still being flushed
        except Exception:
            self._fail(attempt)
            raise
        # (A BaseException such as SimulatedCrash leaves everything as a dead process would.)
        attempt.set_state(COMMITTED)
        self.local.adopt(attempt, begun.commit_id, manifest.to_bytes())
        return self._committed(handle, begun, latest, manifest)

    # Long by its docstring and its two thread bodies (``stage``, ``keep``), which are read
    # beside the upload and the commit they run alongside.
    def _save_from_memory(
        self, job: QueuedSave, files: builtins.list[tuple[str, MemoryFile]]
    ) -> CommitInfo:
        """``_save`` for files held in memory (``save_state``'s host buffers): upload them
        straight from memory, no round trip through the staging file system. The staged
        copy, which only a crash before the commit would need, is written and fsynced on a
        thread of its own beside the upload; the commit does not wait for it. Once the
        commit lands, the copy is kept as the local tier (``keep_local``): it is finished
        in the background (``handle._local_copy``; the host buffers are not reused until
        then, ``close()`` waits for it); with ``keep_local=0`` it is cut short and removed
        (the store holds the checkpoint). A failure to write it (a full staging disk) is
        logged, not fatal: there is then no local copy."""
        attempt, handle = job.attempt, job.handle
        cancelled = threading.Event()

        def stage() -> None:
            # The upload is what the commit waits for: this thread yields the CPU to it
            # (a per-thread nice value on Linux; elsewhere a no-op).
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            try:
                if attempt.write_files(files, cancelled) and not cancelled.is_set():
                    attempt.fsync_files()
                    attempt.set_state(DURABLE)
            except CloudCkptError as exc:
                if not cancelled.is_set():
                    log.warning(
                        "step %d: no local copy for crash recovery: %s", job.handle.step, exc
                    )

        staged = _run_in_thread(stage, f"cloudckpt-stage-{handle.step}")
        try:
            begun, latest, manifest = self.attempts.save(
                handle.step, files, handle.metadata, metrics=handle.metrics
            )
        except Exception:
            cancelled.set()
            cf.wait([staged])  # never remove files still being written
            self._fail(attempt)
            raise
        if self.local.keep == 0:
            cancelled.set()  # no local copy is kept: cut the staged write short
            cf.wait([staged])
            attempt.remove()
            return self._committed(handle, begun, latest, manifest)
        body = manifest.to_bytes()

        def keep() -> None:
            cf.wait([staged])
            if attempt.state != DURABLE:  # the staged write failed (logged): no local copy
                attempt.remove()
                return
            with contextlib.suppress(CloudCkptError):  # a journal write failing: no copy
                attempt.set_state(COMMITTED)
                self.local.adopt(attempt, begun.commit_id, body)
                return
            attempt.remove()

        handle._local_copy = _run_in_thread(keep, f"cloudckpt-keep-{handle.step}")
        with self._cv:
            self._keeping = [f for f in self._keeping if not f.done()] + [handle._local_copy]
        return self._committed(handle, begun, latest, manifest)

    def _committed(
        self, handle: SaveHandle, begun: BegunAttempt, latest: Latest, manifest: Manifest
    ) -> CommitInfo:
        """The ``CommitInfo`` of a committed save (and the log line saying so)."""
        info = CommitInfo.of(
            begun,
            latest,
            manifest,
            blocking_seconds=handle.blocking_seconds,
            commit_seconds=time.perf_counter() - handle.handed_over_at,
            metadata=handle.metadata,
            stats=self.attempts.last_upload,
        )
        log.info(
            "committed step %d (%d files, %d bytes) in %.2fs",
            info.step,
            info.num_files,
            info.total_bytes,
            info.commit_seconds,
        )
        return info

    def _fail(self, attempt: Attempt) -> None:
        # Only the local copy goes; what reached the store stays for GC (docs/design.md §6.7).
        with contextlib.suppress(CloudCkptError):
            attempt.set_state(FAILED)
        attempt.remove()
