"""What the catalog's commands share: where they read or write (a run URL or an open
``Store``), opened for the length of a command, and a transfer engine for its bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from cloudckpt.stores import RunURL, Store, open_store
from cloudckpt.transfer import TransferConfig, TransferEngine

#: A run URL (with ``storage_options``) or an open ``Store``: what every command takes.
Where = str | RunURL | Store


@contextlib.contextmanager
def opened(
    where: Where, options: Mapping[str, Any] | None, *, writable: bool = False
) -> Iterator[Store]:
    """``where`` as a store: an open one as it is (the caller closes it), a URL opened for
    the block. Raises ConfigurationError (a bad URL), StoreError."""
    if isinstance(where, Store):
        yield where
        return
    store = open_store(where, options, writable=writable)
    try:
        yield store
    finally:
        store.close()


@contextlib.contextmanager
def transfer_engine(transfer: TransferConfig | None) -> Iterator[TransferEngine]:
    """A transfer engine with ``transfer``'s settings, shut down when the block ends."""
    with TransferEngine(transfer) as engine:
        yield engine
