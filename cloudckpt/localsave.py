"""One host's save of a queued save: through the save pipeline, and the local copy kept.

``LocalSave`` is what the single-host manager's queue runs for each save: the staged files
(or, from ``save_state``, the same files held in host memory) go through
``cloudckpt.attempts`` (upload, manifest, commit); the staged copy is made durable beside
the upload (crash recovery needs it until the commit lands) and kept afterwards as the
local tier (``cloudckpt.localcopy``). Whatever fails once the commit landed is a warning,
never the save's failure (invariant I6, ``after_commit``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from cloudckpt.attempts import AttemptWriter, BegunAttempt, CommitInfo
from cloudckpt.errors import CloudCkptError
from cloudckpt.localcopy import LocalCopies
from cloudckpt.manifests import Manifest
from cloudckpt.protocol import Latest
from cloudckpt.savequeue import QueuedSave, SaveHandle
from cloudckpt.staging import COMMITTED, DURABLE, FAILED, Attempt
from cloudckpt.transfer import MemoryFile

log = logging.getLogger("cloudckpt")


def run_in_thread(fn: Callable[[], None], name: str) -> cf.Future[None]:
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


def after_commit(step: int, what: str, fn: Callable[[], object], warnings: list[str]) -> bool:
    """Run ``fn``, bookkeeping after the commit of ``step`` landed: an ``Exception`` it
    raises (a full staging disk at the journal's ``committed`` write) is logged and added
    to ``warnings``, never raised: the save is committed (invariant I6). Returns whether
    ``fn`` succeeded."""
    try:
        fn()
    except Exception as exc:
        # The error's own message, not its hint: a StagingError's says "nothing was committed".
        reason = exc.message if isinstance(exc, CloudCkptError) else str(exc)
        message = f"step {step} is committed, but could not {what}: {reason}"
        log.warning("%s", message)
        warnings.append(message)
        return False
    return True


def fail_attempt(attempt: Attempt) -> None:
    """A save failed: only its local copy goes; what reached the store stays for GC
    (docs/design.md §6.7). Never raises a CloudCkptError."""
    with contextlib.suppress(CloudCkptError):
        attempt.set_state(FAILED)
    attempt.remove()


class LocalSave:
    """Runs one queued save on this host (module docstring); ``close()`` waits for the
    local copies still being finished after their commits."""

    def __init__(self, attempts: AttemptWriter, local: LocalCopies) -> None:
        self.attempts = attempts
        self.local = local
        self._lock = threading.Lock()
        self._keeping: list[cf.Future[None]] = []  # local copies still being finished

    def __call__(self, job: QueuedSave) -> CommitInfo:
        """Upload, write the manifest, commit (runs on the queue's worker). Raises what
        the pipeline raises (FencedError, StoreError, ...); the staged copy is then
        removed."""
        if job.memory_files is not None and not job.recovered:
            return self._from_memory(job, job.memory_files)
        attempt, handle = job.attempt, job.handle

        def make_durable() -> None:
            attempt.fsync_files()
            attempt.set_state(DURABLE)

        # Flushing the staged files to disk (for crash recovery) runs beside the upload,
        # which reads them from the page cache: the two overlap instead of adding up
        # (docs/performance.md). The commit waits for both.
        flushed = run_in_thread(make_durable, f"cloudckpt-fsync-{handle.step}")
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
            fail_attempt(attempt)
            raise
        # (A BaseException such as SimulatedCrash leaves everything as a dead process would.)
        # Committed from here on: nothing that fails now may fail the save (I6).
        warnings: list[str] = []

        def keep_copy() -> None:
            attempt.set_state(COMMITTED)
            self.local.adopt(attempt, begun.commit_id, manifest.to_bytes())

        if not after_commit(handle.step, "keep the local copy", keep_copy, warnings):
            attempt.remove()  # (its journal may not say committed: no copy is kept)
        return self._committed(handle, begun, latest, manifest, warnings)

    def _from_memory(self, job: QueuedSave, files: list[tuple[str, MemoryFile]]) -> CommitInfo:
        """The save of files held in memory (``save_state``'s host buffers): uploaded
        straight from memory, no round trip through the staging file system. The staged
        copy, which only a crash before the commit would need, is written and fsynced on a
        thread of its own beside the upload; the commit does not wait for it. Once the
        commit lands, the copy is kept as the local tier (``keep_local``): it is finished
        in the background (``job.local_copy``; the host buffers are not reused until
        then, ``close()`` waits for it), unless the next save wants the buffers first
        (``QueuedSave.wait_until_buffers_free``): it is then cut short and removed, as
        with ``keep_local=0`` (the store holds the checkpoint). A failure to write it (a
        full staging disk) is logged, not fatal: there is then no local copy."""
        attempt, handle = job.attempt, job.handle
        cancelled = threading.Event()
        job.stop_local_copy = cancelled  # the next save may cut the copy short
        staged = run_in_thread(
            lambda: _stage(job, files, cancelled), f"cloudckpt-stage-{handle.step}"
        )
        try:
            begun, latest, manifest = self.attempts.save(
                handle.step, files, handle.metadata, metrics=handle.metrics
            )
        except Exception:
            cancelled.set()
            cf.wait([staged])  # never remove files still being written
            fail_attempt(attempt)
            raise
        if self.local.keep == 0:
            cancelled.set()  # no local copy is kept: cut the staged write short
            cf.wait([staged])
            attempt.remove()
            return self._committed(handle, begun, latest, manifest)
        warnings: list[str] = []
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

        def start_keeping() -> None:
            job.local_copy = run_in_thread(keep, f"cloudckpt-keep-{handle.step}")
            with self._lock:
                self._keeping = [f for f in self._keeping if not f.done()] + [job.local_copy]

        after_commit(handle.step, "keep the local copy", start_keeping, warnings)
        return self._committed(handle, begun, latest, manifest, warnings)

    def _committed(
        self,
        handle: SaveHandle,
        begun: BegunAttempt,
        latest: Latest,
        manifest: Manifest,
        warnings: Sequence[str] = (),
    ) -> CommitInfo:
        """The ``CommitInfo`` of a committed save (and the log line saying so);
        ``warnings``: what failed after the commit landed (``after_commit``)."""
        info = CommitInfo.of(
            begun,
            latest,
            manifest,
            blocking_seconds=handle.blocking_seconds,
            commit_seconds=time.perf_counter() - handle.handed_over_at,
            metadata=handle.metadata,
            stats=self.attempts.last_upload,
        )
        info = dataclasses.replace(info, warnings=tuple(warnings))
        log.info(
            "committed step %d (%d files, %d bytes) in %.2fs",
            info.step,
            info.num_files,
            info.total_bytes,
            info.commit_seconds,
        )
        return info

    def close(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``) for the local copies still being finished (they write
        into staging); whether none is left."""
        with self._lock:
            keeping = list(self._keeping)
        _, left = cf.wait(keeping, None if timeout is None else max(0.0, timeout))
        return not left


def _stage(
    job: QueuedSave, files: list[tuple[str, MemoryFile]], cancelled: threading.Event
) -> None:
    """Write the staged copy of in-memory files and make it durable (a thread beside the
    upload); a failure is logged: there is then no copy for crash recovery."""
    # The upload is what the commit waits for: this thread yields the CPU to it (a
    # per-thread nice value on Linux; elsewhere a no-op).
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    attempt = job.attempt
    try:
        # Cancelled while writing (``keep_local=0``, a failed upload, or the next save
        # wanting the buffers: ``QueuedSave.wait_until_buffers_free``): nothing is kept,
        # even if every write returned, since the buffers may have been reused under them.
        if attempt.write_files(files, cancelled) and not cancelled.is_set():
            attempt.fsync_files()
            attempt.set_state(DURABLE)
    except CloudCkptError as exc:
        if not cancelled.is_set():
            log.warning("step %d: no local copy for crash recovery: %s", job.handle.step, exc)
