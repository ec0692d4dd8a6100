"""Waiting for an integration's pending saves at the end of training (HF and Lightning)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from cloudckpt.errors import CloudCkptError
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

    Raises: the newest save's error (older failures were superseded and are logged).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    newest_error: BaseException | None = None
    timed_out = False
    for i, handle in enumerate(handles):
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            on_commit(handle.result(timeout=remaining))
        except TimeoutError:
            log.error("step %d is still uploading at the deadline; not waiting", handle.step)
            timed_out = True
        except CloudCkptError as exc:
            if i == len(handles) - 1:
                newest_error = exc
            else:
                log.error("upload of step %d failed (a newer one followed): %s", handle.step, exc)
    if not timed_out:
        with contextlib.suppress(CloudCkptError):  # failures were handled above
            mgr.close()
    if newest_error is not None:
        raise newest_error
