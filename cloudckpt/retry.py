"""Retries with exponential backoff and jitter, on transient store errors only (tenacity).

Only errors that prove nothing was applied (``TransientStoreError``, including checksum
mismatches, and ``StoreConflictError``) are retried blindly. ``OutcomeUnknownError`` is
retried only for idempotent calls (uploading a part, overwriting a file in a fresh attempt
prefix); conditional writes resolve it by reading back (see ``committer``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import tenacity

from cloudckpt.errors import OutcomeUnknownError, StoreConflictError, TransientStoreError

T = TypeVar("T")
log = logging.getLogger("cloudckpt.retry")

SAFE_TO_RETRY = (TransientStoreError, StoreConflictError)
IDEMPOTENT_RETRY = (*SAFE_TO_RETRY, OutcomeUnknownError)


def call_with_retries(
    fn: Callable[[], T],
    *,
    retry_on: tuple[type[BaseException], ...] = SAFE_TO_RETRY,
    attempts: int = 6,
    initial: float = 0.1,
    maximum: float = 10.0,
    what: str = "store call",
) -> T:
    """Call ``fn``; on ``retry_on`` errors back off (jittered exponential) and try again,
    up to ``attempts`` calls in all. The last error is re-raised unchanged."""

    def log_retry(state: tenacity.RetryCallState) -> None:
        # before_sleep runs after a failed call, so the outcome is always set
        error = state.outcome.exception() if state.outcome else None
        log.info(
            "%s failed (%s), retry %d of %d",
            what,
            type(error).__name__,
            state.attempt_number,
            attempts - 1,
        )

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(retry_on),
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_random_exponential(multiplier=initial, max=maximum),
        reraise=True,
        before_sleep=log_retry,
    )
    return retrying(fn)
