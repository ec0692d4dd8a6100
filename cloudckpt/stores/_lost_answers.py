"""The one rule every cloud adapter's error mapping shares: a request that went out and got
no usable answer (no answer at all, a cut one, a timeout, a server failure) leaves a write's
outcome unknown, while a read can simply be sent again.
"""

from __future__ import annotations

from cloudckpt.errors import OutcomeUnknownError, StoreError, TransientStoreError


def lost_answer(
    message: str, key: str | None, *, write: bool, on_write: str | None = None
) -> StoreError:
    """The error for a request without a usable answer: ``OutcomeUnknownError`` for a
    ``write`` (its effect may or may not have happened: the caller must look before it
    retries), else ``TransientStoreError`` (safe to retry). ``on_write`` is the message for
    a write when it should say more than ``message``."""
    if write:
        return OutcomeUnknownError(message if on_write is None else on_write, key=key)
    return TransientStoreError(message, key=key)
