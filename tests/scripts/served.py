"""``Served``: a store wrapper counting the bytes the store served, by key (the store's side
of every read), for tests that prove what a restore read (tests/test_distributed_local.py
and the ranks of tests/scripts/dist_more.py)."""

from __future__ import annotations

import threading

from cloudckpt import attempt_layout
from cloudckpt.testing.wrappers import ForwardingStore


class Served(ForwardingStore):
    """Counts the bytes the store served, by key (the store's side of every read)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.by_key: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, key: str, n: int) -> None:
        with self._lock:
            self.by_key[key] = self.by_key.get(key, 0) + n

    def get(self, key):
        data, info = self.inner.get(key)
        self._count(key, len(data))
        return data, info

    def get_range(self, key, start, length):
        data = self.inner.get_range(key, start, length)
        self._count(key, len(data))
        return data

    def get_range_into(self, key, start, buf):
        n = self.inner.get_range_into(key, start, buf)
        self._count(key, n)
        return n

    def checkpoint_bytes(self) -> int:
        """Bytes served of checkpoint objects (manifests, chunks, files): all but LATEST
        and the commit records."""
        return sum(n for k, n in self.by_key.items() if k.startswith(attempt_layout.CKPT_PREFIX))

    def reset(self) -> None:
        self.by_key.clear()
