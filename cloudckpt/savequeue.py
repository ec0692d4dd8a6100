"""The save queue: handles, backpressure, the background worker, reporting failures.

A save is opened (``SaveQueue.open``: a staging directory, once a queue slot is free),
written by its caller, handed over (``hand_over``) and run in order by one background
thread through the queue's pipeline (one host's: ``cloudckpt.localsave``).

Backpressure: at most ``max_pending`` saves wait behind the one uploading. A further save
either blocks until a slot frees (``backpressure="block"``, the default: nothing is lost)
or drops the oldest waiting save with a warning (``"drop_oldest"``: newest state wins; the
dropped save's handle raises ``SaveDroppedError``).

``close()`` waits for every pending save to commit or fail: a save that ``save()``
accepted is never silently discarded. ``close(timeout=...)`` bounds the wait (``settle``);
saves still running then are left running, nothing released (``ManagerBase.close``).

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

A ``BaseException`` on the worker (a simulated crash, or ``KeyboardInterrupt`` /
``SystemExit`` raised on that thread; or on automatic GC's thread, ``halt``) stops it for
good, as if the process had died there: the save running and those queued fail with it,
and from then on every new save is refused at once, loudly (``save()``, entering a save,
its hand-over, ``save_state``): a ``SaverStoppedError`` that says the background saver
stopped, why (chained), and that the process must be restarted (it resumes from LATEST);
its own class, so a loop that retries failed saves can tell it apart and stop.
It is not restarted in place: that exception means the process was asked to stop, or is
as dead; what the interrupted save left half done (its commit's outcome, the pipeline's
state) is for a fresh process to sort out from LATEST and the staging journal, its tested
path (docs/design.md §12).

``collective=True`` is the mode of ranks saving together: a save whose block failed on
this rank still runs (``QueuedSave.error`` says why), so that every rank fails it at once
instead of the others waiting for this one. ``BackgroundWrite`` is the writer interface of
a save whose files are produced on a thread of the writer's own (``save_state``).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol

from cloudckpt import attempt_layout
from cloudckpt.attempts import CommitInfo
from cloudckpt.errors import (
    CloudCkptError,
    ConfigurationError,
    SaveDroppedError,
    SaverStoppedError,
)
from cloudckpt.staging import DURABLE, STAGED, Attempt, StagingArea
from cloudckpt.transfer import MemoryFile

log = logging.getLogger("cloudckpt")

Backpressure = Literal["block", "drop_oldest"]


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
        queue: SaveQueue,
        step: int,
        metadata: Mapping[str, Any],
        metrics: Mapping[str, Any] | None = None,
    ):
        self._queue = queue
        self.step = step
        self.metadata = dict(metadata)
        self.metrics = dict(metrics or {})
        self._future: cf.Future[CommitInfo] = cf.Future()
        self._job: QueuedSave | None = None  # once entered: its staged attempt
        self.blocking_seconds = 0.0  # time spent in save()'s enter and exit, not the caller's
        # Whether a failure of this save has reached someone (result(), exception(), an
        # exception out of the caller's own block, or a raise by save()/wait()/close()).
        self._reported = False
        # Whether the block runs on a thread of a writer's own (``BackgroundWrite``): an
        # exception there reaches no caller, so the manager reports it instead.
        self._background = False
        self.handed_over_at = 0.0

    def mark_reported(self) -> None:
        """The caller takes charge of this save's outcome (a sidecar that retries it):
        the manager does not raise its failure."""
        self._reported = True

    # -- context manager (save()) --

    def __enter__(self) -> Path:
        started = time.perf_counter()
        files_dir = self._queue.open(self)
        self.blocking_seconds = time.perf_counter() - started
        return files_dir

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self._queue.abandon(self, exc)
            return
        started = time.perf_counter()
        self._queue.hand_over(self)
        self.blocking_seconds += time.perf_counter() - started

    # -- future-like --

    def result(self, timeout: float | None = None) -> CommitInfo:
        """Wait for the commit. Raises TimeoutError if it is not done within ``timeout``."""
        if not wait_interruptibly([self._future], timeout):
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


@dataclasses.dataclass(eq=False)
class QueuedSave:
    """A save with its staged attempt: what the queue's ``run`` is given."""

    handle: SaveHandle
    attempt: Attempt
    #: Staged by a crashed process (``cloudckpt.recovery``): its files are on disk only.
    recovered: bool = False
    #: The files as in-memory buffers (``BackgroundWrite.upload_from_memory``), uploaded
    #: from memory while the staged copy is written beside the upload.
    memory_files: list[tuple[str, MemoryFile]] | None = None
    #: Set (before the commit is reported) while the staged copy of in-memory files is
    #: still being written after the commit, to be kept as the local tier.
    local_copy: cf.Future[None] | None = None
    #: The pipeline's switch that cuts the staged copy of ``memory_files`` short: once it
    #: is set, that copy is not kept, whatever it has written (it may have read buffers
    #: already reused).
    stop_local_copy: threading.Event | None = None
    #: ``collective``: why this rank's block failed; it takes part in the save with it.
    error: BaseException | None = None

    def wait_until_buffers_free(self, wanted: cf.Future[None] | None = None) -> None:
        """Wait until nothing whose output is kept reads ``memory_files`` any more: the
        upload (until the save's outcome), then the staged copy kept as the local tier,
        unless ``wanted`` completes first (the next save needs the buffers): that copy is
        then cut short and not kept; the store holds the checkpoint. Never raises."""
        cf.wait([self.handle._future])
        copy = self.local_copy
        if copy is not None:
            cf.wait([copy] if wanted is None else [copy, wanted], return_when=cf.FIRST_COMPLETED)
            if copy.done():
                return
            log.info(
                "step %d: its local copy was still being written when the next save needed "
                "the host buffers; cut short, not kept (a restart reads this step from the "
                "store)",
                self.handle.step,
            )
        if self.stop_local_copy is not None:  # anything still reading them keeps nothing
            self.stop_local_copy.set()


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


def _stopped_error(cause: BaseException) -> SaverStoppedError:
    """The error every save fails with once the worker has stopped on ``cause``."""
    error = SaverStoppedError(
        f"the background saver stopped on {cause!r}: no further save can run in this process"
    )
    error.__cause__ = cause
    return error


def check_queue_options(backpressure: str, max_pending: int) -> None:
    """Raises ConfigurationError for a backpressure or max_pending out of range."""
    if backpressure not in ("block", "drop_oldest"):
        raise ConfigurationError(
            f"backpressure must be 'block' or 'drop_oldest', not {backpressure!r}"
        )
    if max_pending < 0:
        raise ConfigurationError("max_pending must be >= 0")


def wait_interruptibly(futures: list[cf.Future], timeout: float | None) -> bool:
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


class Pipeline(Protocol):
    """What a queue runs for each save (``run``): one host's (``cloudckpt.localsave``) or
    one rank's part of a multi-rank save (``cloudckpt.distributed``)."""

    def __call__(self, job: QueuedSave) -> CommitInfo:
        """Run the save to its commit; returns its ``CommitInfo`` or raises its failure."""

    def close(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``) for work the pipeline still does after its saves
        returned; whether none is left."""


class SaveQueue:
    """Saves in order on one background thread (module docstring); ``_cv`` guards it all.

    Args:
        staging: where each save's attempt is staged.
        run: what a queued save does (the save pipeline); returns its ``CommitInfo``.
        after_each: called on the worker after each save (automatic GC, which only starts
            a collection on a thread of its own); its failure is logged, never the save's,
            and never stops the worker (``_after_save``).
        max_pending, backpressure: as ``CheckpointManager`` takes them.
        before_open: called before a save is opened (a fenced writer refuses there).
        collective: ranks save together (module docstring).
    """

    def __init__(
        self,
        staging: StagingArea,
        run: Callable[[QueuedSave], CommitInfo],
        after_each: Callable[[], None],
        *,
        max_pending: int,
        backpressure: Backpressure,
        before_open: Callable[[], None] | None = None,
        collective: bool = False,
    ) -> None:
        self.staging = staging
        self._run_save = run
        self._after_each = after_each
        self._max_pending = max_pending
        self._backpressure = backpressure
        self._before_open = before_open
        self.collective = collective
        self._cv = threading.Condition()
        self._queue: collections.deque[QueuedSave] = collections.deque()
        self._reserved = 0  # saves inside their with-block, holding a queue slot
        self._open: dict[SaveHandle, int] = {}  # those saves -> the thread that entered them
        self._inflight: QueuedSave | None = None
        self._handles: list[SaveHandle] = []
        self._worker: threading.Thread | None = None
        #: Set by ``stop()``: the worker ends once the queue is empty.
        self.closing = False
        self._closer: int | None = None  # the thread that called stop()
        #: Why the worker stopped for good (``_fail_queued``): every new save is refused.
        self.stopped: BaseException | None = None
        #: Test hook (cloudckpt.testing.simulation): run each save in the thread that
        #: hands it over instead of on the background thread, so a seeded scheduler can
        #: interleave managers deterministically.
        self.synchronous = False

    def handle(
        self, step: int, metadata: Mapping[str, Any], metrics: Mapping[str, Any]
    ) -> SaveHandle:
        """A new save's handle, not yet opened."""
        return SaveHandle(self, step, metadata, metrics)

    # -- a save's life: open, hand over (or abandon), run --

    def open(self, handle: SaveHandle) -> Path:
        """Wait for a queue slot (backpressure), then stage a new attempt for ``handle``;
        returns its files directory. Raises what ``before_open`` raises (FencedError),
        StagingError; RuntimeError if ``handle`` was opened before."""
        if handle._job is not None:
            raise RuntimeError("a SaveHandle can be entered only once")
        with self._cv:
            self.check_running()
            if self._before_open is not None:
                self._before_open()
            while len(self._queue) + self._reserved >= self._max_pending and (
                self._inflight is not None or self._queue
            ):
                if self._backpressure == "drop_oldest" and self._queue:
                    self._drop(self._queue.popleft())
                    continue
                self._cv.wait()
            self.check_running()  # it may have stopped while this save waited for a slot
            if self.closing:  # the worker may end any moment: it would never run this save
                raise ConfigurationError("this CheckpointManager is closed")
            self._reserved += 1
            self._open[handle] = threading.get_ident()
        try:
            attempt_id = attempt_layout.new_attempt_id(dt.datetime.now(dt.timezone.utc))
            attempt = self.staging.new_attempt(
                attempt_id, handle.step, handle.metadata, handle.metrics
            )
        except BaseException:
            with self._cv:
                self._reserved -= 1
                self._open.pop(handle, None)
                self._cv.notify_all()
            raise
        handle._job = QueuedSave(handle, attempt)
        return attempt.files_dir

    def staged(self, handle: SaveHandle) -> QueuedSave:
        """The save ``open`` staged for ``handle``. Raises RuntimeError if never opened."""
        if handle._job is None:
            raise RuntimeError(f"the save of step {handle.step} has not begun: enter its handle")
        return handle._job

    def _drop(self, job: QueuedSave) -> None:
        log.warning(
            "dropping queued save of step %d: a newer save arrived (drop_oldest)", job.handle.step
        )
        job.attempt.remove()
        job.handle._future.set_exception(
            SaveDroppedError(f"the save of step {job.handle.step} was dropped for a newer one")
        )

    def abandon(self, handle: SaveHandle, exc: BaseException) -> None:
        """The save's block raised ``exc`` (or its hand-over failed): nothing of it is
        stored. ``exc`` propagates to the caller of the block, who is thereby told; a
        block run in the background (``save_state``) tells no one, so its failure is kept
        for the next ``save()``, ``wait()`` or ``close()`` to raise. ``collective``: the
        save still runs, failing on every rank (``QueuedSave.error``)."""
        job = handle._job
        if self.collective and job is not None:
            handle._reported = not handle._background  # ``exc`` reaches the block's caller
            job.error = CloudCkptError(f"its save() block raised {type(exc).__name__}: {exc}")
            self._enqueue(job)
            return
        if job is not None:
            job.attempt.remove()
        handle._reported = not handle._background
        handle._future.set_exception(_abandoned_error(handle, exc))
        with self._cv:
            self._reserved -= 1
            self._open.pop(handle, None)
            if handle._background:
                self._handles.append(handle)
            self._cv.notify_all()

    def hand_over(self, handle: SaveHandle) -> None:
        """The block has ended: queue the save for the worker. Raises StagingError (its
        journal cannot be written; the save is abandoned), except in ``collective`` mode,
        where the save runs with that error; SaverStoppedError if the worker has stopped
        (``stopped``: the save is refused, its handle fails with it too)."""
        job = self.staged(handle)
        try:
            job.attempt.set_state(STAGED, sync=False)
        except BaseException as exc:  # e.g. a full staging disk: release the queue slot
            if not (self.collective and isinstance(exc, Exception)):
                self.abandon(handle, exc)
                raise
            job.error = exc  # still take part in the save, reporting the failure
        if not self._enqueue(job):
            handle._reported = not handle._background  # raised to the block's caller here
            refused = handle._future.exception()
            assert refused is not None
            raise refused

    def _enqueue(self, job: QueuedSave) -> bool:
        """Queue a save whose block has ended for the background worker; False if the
        worker has stopped: the save is refused (removed; its handle fails). Kept, it would
        not be recovered: a restart commits only saves made durable on the worker
        (``recovery.decide``), and a refused one never reached it."""
        job.handle.handed_over_at = time.perf_counter()
        with self._cv:
            self._reserved -= 1
            self._open.pop(job.handle, None)
            stopped = self.stopped  # checked with the append: _fail_queued takes the rest
            if stopped is None:
                self._queue.append(job)
                self._ensure_worker()
            self._handles.append(job.handle)
            self._cv.notify_all()
        if stopped is not None:
            job.attempt.remove()
            job.handle._future.set_exception(_stopped_error(stopped))
            return False
        self.drain()
        return True

    # -- saves a crashed process staged (``cloudckpt.recovery``) --

    def recovered(self, attempt: Attempt) -> QueuedSave:
        """A save for ``attempt``, staged by a crashed process, as handed over now."""
        handle = SaveHandle(self, attempt.step, attempt.metadata, attempt.metrics)
        handle.handed_over_at = time.perf_counter()
        handle._job = QueuedSave(handle, attempt, recovered=True)
        return handle._job

    def on_worker(self) -> bool:
        """Whether the calling thread is the one running saves."""
        return threading.current_thread() is self._worker

    def put_first(self, jobs: list[QueuedSave]) -> None:
        """Queue ``jobs`` ahead of every waiting save (older saves commit first). Once the
        worker has stopped each fails at once (its staged files stay for a restart)."""
        with self._cv:
            stopped = self.stopped
            if stopped is None:
                self._queue.extendleft(reversed(jobs))
                self._ensure_worker()
            self._handles.extend(j.handle for j in jobs)
            self._cv.notify_all()
        if stopped is not None:
            for job in jobs:
                job.handle._future.set_exception(_stopped_error(stopped))

    def run_now(self, jobs: list[QueuedSave]) -> None:
        """Run ``jobs`` in this thread; each reports to its own handle (a failure is
        also logged)."""
        for job in jobs:
            try:
                job.handle._future.set_result(self._run_save(job))
            except Exception as exc:
                job.handle._future.set_exception(exc)
                log.warning("could not commit recovered step %d: %s", job.handle.step, exc)

    # -- the worker --

    def wait_idle(self) -> None:
        """Wait until no save is queued or in flight (without raising their failures)."""
        with self._cv:
            while self._queue or self._inflight is not None:
                self._cv.wait(0.2)

    def _ensure_worker(self) -> None:
        if self._worker is None and not self.synchronous:
            self._worker = threading.Thread(target=self._run, name="cloudckpt-saver", daemon=True)
            self._worker.start()

    def drain(self) -> None:
        """Synchronous mode: run every queued save now, in this thread."""
        if not self.synchronous:
            return
        self._worker = threading.current_thread()
        try:
            self._run(until_idle=True)
        finally:
            self._worker = None

    def _run(self, until_idle: bool = False) -> None:
        while True:
            with self._cv:
                # Closing, it still waits for the blocks other threads have open: their
                # saves, handed over, are for it to run (close() waits for them).
                while (
                    not self._queue
                    and not until_idle
                    and not (self.closing and not self._writing())
                ):
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._inflight = self._queue.popleft()
                self._cv.notify_all()
            try:
                job.handle._future.set_result(self._run_save(job))
            except Exception as exc:
                job.handle._future.set_exception(exc)
            except BaseException as exc:  # a simulated crash: stop like a dead process
                job.handle._future.set_exception(exc)
                self._fail_queued(exc)
                return
            finally:
                with self._cv:
                    self._inflight = None
                    self._cv.notify_all()
            if not self._after_save(job):
                return

    def _after_save(self, job: QueuedSave) -> bool:
        """Run ``after_each`` once ``job`` is done; False if the worker must stop. Its
        failure is logged, never ``job``'s (whose outcome is already out) nor the worker's:
        raised here, it would end the thread, and every later save would never run, its
        handle never resolve, a blocked ``save()`` and ``close()`` wait forever. Once the
        queue has stopped for good (``halt``: a crash on GC's thread while ``job`` ran) it
        starts nothing more: the process is as dead."""
        if self.stopped is not None:
            return False
        try:
            self._after_each()
        except Exception as exc:
            log.error(
                "background garbage collection failed after the save of step %d: %r",
                job.handle.step,
                exc,
                exc_info=True,
            )
        except BaseException as exc:  # a simulated crash: stop like a dead process
            self._fail_queued(exc)
            return False
        return True

    def _fail_queued(self, exc: BaseException) -> None:
        """The worker stops for good (a simulated crash, Ctrl-C or SystemExit on it): every
        queued save fails with ``exc``, and every later one is refused (``stopped``)."""
        log.critical(
            "the save worker stopped: %r; queued saves fail with it and every later save is "
            "refused (restart the process: it resumes from LATEST)",
            exc,
        )
        with self._cv:
            self.stopped = exc
            for queued in self._queue:
                queued.handle._future.set_exception(exc)
            self._queue.clear()
            self._cv.notify_all()

    def halt(self, exc: BaseException) -> None:
        """Stop for good on ``exc``, raised on a thread beside the worker (automatic GC's:
        a simulated crash there is the process's death too); a save in flight ends as it
        would, nothing after it runs."""
        self._fail_queued(exc)

    def check_running(self) -> None:
        """Raises SaverStoppedError once the worker has stopped for good (``stopped``)."""
        if self.stopped is not None:
            raise _stopped_error(self.stopped)

    def stop(self, timeout: float | None = None) -> bool:
        """End the worker once the queue is empty, and wait for it (at most ``timeout``);
        whether it has ended."""
        with self._cv:
            self.closing = True
            self._closer = threading.get_ident()
            self._cv.notify_all()
        worker = self._worker
        if worker is None or worker is threading.current_thread():
            return True
        worker.join(None if timeout is None else max(0.0, timeout))
        return not worker.is_alive()

    def _writing(self) -> bool:
        """Whether a thread other than the one closing has a save's block open (under
        ``_cv``)."""
        return any(thread != self._closer for thread in self._open.values())

    def settle(self, timeout: float | None = None) -> list[SaveHandle]:
        """Wait, at most ``timeout``, as ``wait`` does (every save handed over so far, and
        those other threads are still writing), but take no failure; the saves still not
        done (none: settled). ``close()`` waits here before it releases anything."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handles, _ = self._handed_over(deadline)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        wait_interruptibly([h._future for h in handles], remaining)
        return self.unfinished()

    def _handed_over(self, deadline: float | None) -> tuple[list[SaveHandle], bool]:
        """Wait until no other thread has a save's block open (or ``deadline``); the saves
        handed over by then, and whether the blocks all closed in time."""
        me = threading.get_ident()
        with self._cv:
            while any(thread != me for thread in self._open.values()):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return list(self._handles), False
                self._cv.wait(remaining)
            return list(self._handles), True

    @staticmethod
    def durable(handle: SaveHandle) -> bool:
        """Whether ``handle``'s save is durable in staging: a restart on the same
        ``staging_dir`` would commit it (``recovery.decide``) if this process died now."""
        job = handle._job
        return job is not None and job.attempt.state == DURABLE

    def unfinished(self) -> list[SaveHandle]:
        """The saves not done yet: those other threads are still writing (inside their
        block), then those handed over, in order."""
        me = threading.get_ident()
        with self._cv:
            writing = [h for h, thread in self._open.items() if thread != me]
            return writing + [h for h in self._handles if not h.done()]

    # -- reporting failures --

    def wait(self, timeout: float | None = None) -> None:
        """``CheckpointManager.wait``: every save handed over so far, and those other
        threads are still writing, committed or failed. Raises the earliest unreported
        failure; TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handles, in_time = self._handed_over(deadline)
        if not in_time:
            raise TimeoutError(f"saves still being written after {timeout}s")
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not wait_interruptibly([h._future for h in handles], remaining):
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

    def raise_earlier_failure(self) -> None:
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

    def take_unreported(self) -> list[tuple[SaveHandle, BaseException]]:
        """Every unreported failure, marked reported (``close()`` raises the first)."""
        with self._cv:
            taken = [(h, exc) for h in self._handles if (exc := h._take_failure()) is not None]
            self._handles = [h for h in self._handles if not h.done()]
        return taken

    def background(self, handle: SaveHandle) -> BackgroundWrite:
        """The writer interface of ``handle``'s save, whose files a writer produces on a
        thread of its own (``BackgroundWrite``)."""
        if handle._queue is not self:
            raise ValueError("the handle belongs to another manager")
        return BackgroundWrite(self, handle)


class BackgroundWrite:
    """A save whose files a writer produces on a thread of its own (``save_state``). A
    failure there reaches no caller, so the manager reports it (from the next ``save()``,
    ``wait()`` or ``close()``), unless the writer says it told its caller itself.

    On the writer's thread: ``open()``, then ``upload_from_memory(files)`` (optional),
    then ``finish()`` or ``fail(exc)``; ``release_memory()`` once the save no longer
    needs the buffers. On the caller's thread: ``told()`` when it raised the failure;
    ``take_failure()`` to raise one the manager has not; ``reclaim_memory()`` when the
    next save wants the buffers.
    """

    def __init__(self, queue: SaveQueue, handle: SaveHandle) -> None:
        self._queue = queue
        self.handle = handle
        handle._background = True
        self._wanted: cf.Future[None] = cf.Future()  # done: the next save wants the buffers

    def open(self) -> Path:
        """Wait for a queue slot and stage the save; its files directory. Raises as
        ``save()``'s block does on entering (FencedError, StagingError)."""
        return self.handle.__enter__()

    def upload_from_memory(self, files: list[tuple[str, MemoryFile]] | None) -> None:
        """Upload these in-memory files (path, buffer) instead of reading the staged
        files back; the staged copy is still written beside the upload (crash recovery,
        the local tier). The buffers must not change until ``release_memory()`` returns."""
        self._queue.staged(self.handle).memory_files = files

    def finish(self) -> None:
        """Hand the save over: its upload starts. Raises StagingError (the hand-over
        failed; the handle has the failure)."""
        self.handle.__exit__(None, None, None)

    def fail(self, exc: BaseException, told: bool = False) -> None:
        """Writing the files raised ``exc``: the save fails. ``told``: the writer raises
        it to its caller itself (the manager does not)."""
        if told:
            self.handle._background = False
        self.handle.__exit__(type(exc), exc, exc.__traceback__)

    def told(self) -> None:
        """The writer has raised this save's failure to its caller: the manager does
        not raise it again."""
        self.handle._reported = True

    def take_failure(self) -> BaseException | None:
        """The save's failure if it is done and no one has been told of it; it is then
        told (the manager does not raise it again)."""
        return self.handle._take_failure()

    def release_memory(self) -> None:
        """Wait until nothing whose output is kept reads the in-memory files any more (the
        upload; the staged copy kept as the local tier, unless ``reclaim_memory()`` cuts
        it short), then forget them. Never raises."""
        job = self.handle._job
        if job is not None:
            job.wait_until_buffers_free(self._wanted)
            job.memory_files = None

    def reclaim_memory(self) -> None:
        """The next save wants the buffers: ``release_memory()`` still waits for the
        upload (its bytes are the checkpoint's), but no longer for the staged copy being
        written after the commit, which is cut short and not kept (that step then has no
        local copy; the store has it). Written at a low priority, on a busy host that copy
        could hold the next save's stall for a minute (docs/performance.md)."""
        with contextlib.suppress(cf.InvalidStateError):  # reclaimed already
            self._wanted.set_result(None)
