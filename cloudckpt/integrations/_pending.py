"""Waiting for an integration's saves (HF and Lightning): the emergency checkpoint on a
preemption notice, until the notice's deadline, and the pending saves at the end of
training."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from cloudckpt.attempts import CommitInfo
from cloudckpt.errors import CloudCkptError
from cloudckpt.manager import CheckpointManager
from cloudckpt.preemption import PreemptionNotice
from cloudckpt.savequeue import SaveHandle

log = logging.getLogger("cloudckpt")

DEFAULT_EMERGENCY_TIMEOUT = 120.0  # when neither the user nor the notice says


class SaveTracker(Protocol):
    """An integration's bookkeeping of its saves (HF's callback, Lightning's plugin)."""

    last_commit: CommitInfo | None
    pending_saves: list[SaveHandle]


def collect_finished(tracker: SaveTracker, logger: logging.Logger) -> None:
    """Note ``tracker``'s finished saves: keep the pending handles, record the newest
    commit. A failed save (fenced, or any other failure) is logged and raised, which stops
    training; it and the handles after it are no longer tracked (the manager still raises
    any later failure from ``wait()``/``close()``).

    Raises: the failed save's exception."""
    pending = []
    for handle in tracker.pending_saves:
        if not handle.done():
            pending.append(handle)
            continue
        exc = handle.exception()
        if exc is None:
            tracker.last_commit = handle.result()
            continue
        tracker.pending_saves = pending
        committed = tracker.last_commit.step if tracker.last_commit is not None else None
        logger.error(
            "the save of step %d failed; stopping training (newest committed "
            "checkpoint: step %s): %s",
            handle.step,
            committed,
            exc,
        )
        raise exc
    tracker.pending_saves = pending


def emergency_timeout(
    notice: PreemptionNotice | None, override: float | None, *, now: float | None = None
) -> float:
    """Seconds still left to wait for the emergency checkpoint's commit (never negative).

    The wait ends ``override`` seconds after the notice was received if given, else at the
    notice's deadline (AWS, Azure, GCE, a signal with ``signal_grace``), else
    ``DEFAULT_EMERGENCY_TIMEOUT`` seconds after the notice. Every call counts from the
    notice, so the wait for the commit and the wait at teardown end at the same moment.
    Without a notice (another rank's), the whole ``override`` or default.
    """
    now = time.time() if now is None else now
    if notice is None:
        return override if override is not None else DEFAULT_EMERGENCY_TIMEOUT
    if override is not None:
        return max(0.0, notice.received_at + override - now)
    left = notice.seconds_left(now)
    if left is not None:
        return left
    return max(0.0, notice.received_at + DEFAULT_EMERGENCY_TIMEOUT - now)


def wait_for_emergency(
    wait: Callable[[float], CommitInfo | None],
    step: int,
    timeout: float,
    logger: logging.Logger,
) -> CommitInfo | None:
    """``wait(timeout)`` for the emergency checkpoint of ``step``; its ``CommitInfo``.

    A save that did not commit in time, or failed with a ``CloudCkptError``, is logged as
    an error on ``logger`` and gives None: training stops either way, and the newest
    committed checkpoint is an older one. Anything else ``wait`` raises propagates.
    """
    try:
        info = wait(timeout)
    except TimeoutError:
        logger.error(
            "the emergency checkpoint of step %d did not commit within %.0fs; the "
            "newest committed checkpoint is older",
            step,
            timeout,
        )
        return None
    except CloudCkptError as exc:
        logger.error("the emergency checkpoint of step %d failed: %s", step, exc)
        return None
    if info is not None:
        logger.warning(
            "emergency checkpoint of step %d committed (%.1fs after hand-over)",
            info.step,
            info.commit_seconds,
        )
    return info


def finish_pending(
    mgr: CheckpointManager,
    handles: Sequence[SaveHandle],
    timeout: float | None,
    on_commit: Callable[[CommitInfo], None],
) -> None:
    """Wait for ``handles`` in order (until ``timeout`` seconds in all, if given), call
    ``on_commit`` for each commit, then close ``mgr``, unless a save was still uploading
    at the deadline: then the machine is going away, the staged files stay in staging_dir,
    and a restart on this host commits those already durable there (docs/design.md §12).

    Raises: the exception of the earliest save that failed (any later failures are
    logged), else what ``mgr.close()`` raises (a failed save no handle here covered; also
    when it timed out, the manager left unclosed, as nothing would raise it later).
    Every handle is waited for, and the manager closed, before anything is raised.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    failures: list[tuple[int | None, BaseException]] = []
    timed_out = False
    for handle in handles:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            info = handle.result(timeout=remaining)
        except TimeoutError as exc:
            if handle.done():  # the save itself failed with a TimeoutError
                failures.append((handle.step, exc))
                continue
            log.error("step %d is still uploading at the deadline; not waiting", handle.step)
            timed_out = True
        except Exception as exc:
            failures.append((handle.step, exc))
        else:
            on_commit(info)
    if not timed_out:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            # Bounded too: a save no handle here covers may still be uploading.
            mgr.close(remaining)
        except TimeoutError as exc:
            if mgr.closed:  # a save's own failure, everything released
                failures.append((None, exc))
            else:  # still uploading at the deadline: as above, not a failure
                log.error("not closing the manager: %s", exc)
                failures.extend(_untold(mgr))
        except Exception as exc:
            failures.append((None, exc))
    for step, error in failures[1:]:
        log.error("the save of step %s also failed: %s", step, error)
    if failures:
        raise failures[0][1]


def _untold(mgr: CheckpointManager) -> list[tuple[int | None, BaseException]]:
    """The failures of saves no handle here covered and no one was told of, taken from a
    manager left unclosed: nothing raises them later (the caller drops the manager)."""
    return [(h.step, exc) for h, exc in mgr.queue.take_unreported()]
