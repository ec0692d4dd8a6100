"""Waiting for an integration's pending saves at the end of training (HF and Lightning)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from cloudckpt.manager import CheckpointManager, CommitInfo, SaveHandle

log = logging.getLogger("cloudckpt")


def finish_pending(
    mgr: CheckpointManager,
    handles: Sequence[SaveHandle],
    timeout: float | None,
    on_commit: Callable[[CommitInfo], None],
) -> None:
    """Wait for ``handles`` in order (until ``timeout`` seconds in all, if given), call
    ``on_commit`` for each commit, then close ``mgr``, unless a save was still uploading
    at the deadline: then the machine is going away, the staged files stay in staging_dir,
    and a restart on this host commits them.

    Raises: the exception of the earliest save that failed (any later failures are
    logged), else what ``mgr.close()`` raises (a failed save no handle here covered).
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
        try:
            mgr.close()
        except Exception as exc:
            failures.append((None, exc))
    for step, exc in failures[1:]:
        log.error("the save of step %s also failed: %s", step, exc)
    if failures:
        raise failures[0][1]
