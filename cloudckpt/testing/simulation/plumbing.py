"""The simulation's plumbing: how the checker sees the store, and how actors transfer.

- ``Recorder``: sits right above the memory store and shows the checker every write as
  it is applied.
- ``inline_engine``: a transfer engine that runs every transfer in the caller's thread.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any

from cloudckpt import attempt_layout, protocol
from cloudckpt.failpoints import SimulatedCrash
from cloudckpt.stores.base import MultipartUpload, PutMode, Store
from cloudckpt.stores.memory import MemoryStore
from cloudckpt.testing.simulation.roles import RecordedWorld
from cloudckpt.testing.wrappers import ForwardingStore
from cloudckpt.transfer import TransferConfig, TransferEngine


class InlineExecutor(cf.Executor):
    """Runs every submitted call at once in the caller's thread (deterministic transfers).
    A ``SimulatedCrash`` propagates at once: the process is gone."""

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> cf.Future:
        future: cf.Future = cf.Future()
        try:
            result = fn(*args, **kwargs)
        except SimulatedCrash:
            raise
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


def inline_engine(config: TransferConfig) -> TransferEngine:
    return TransferEngine(config, executor=InlineExecutor())


def transfer_config() -> TransferConfig:
    """One transfer at a time, multipart from 4 KiB: small files still take every path."""
    return TransferConfig(concurrency=1, multipart_threshold=4096, attempts=4)


def prefix_of(key: str) -> str | None:
    parts = key.split("/", 2)
    if len(parts) >= 2 and parts[0] == "ckpt":
        prefix = f"ckpt/{parts[1]}/"
        return prefix if attempt_layout.parse_ckpt_prefix(prefix) else None
    return None


class Recorder(ForwardingStore):
    """Sits right above the memory store: sees every write as it is applied, in order, and
    checks each one (LATEST transitions, GC deletions) against the invariants."""

    def __init__(self, sim: RecordedWorld, memory: MemoryStore, inner: Store | None) -> None:
        super().__init__(inner or memory)
        self.sim = sim
        self.memory = memory

    def _touch(self, key: str) -> None:
        prefix = prefix_of(key)
        if prefix is not None:
            self.sim.checker.touched(prefix, self.memory.now())

    def put(self, key: str, data, *, mode: PutMode | None = None) -> Any:
        kw = {} if mode is None else {"mode": mode}
        with self.sim.clock_stepped_back(key):
            info = self.inner.put(key, data, **kw)
            self._touch(key)
        if key == protocol.LATEST_KEY:
            self.sim.checker.latest_written(bytes(data), mode, self.sim.current)
        return info

    def delete(self, key: str) -> None:
        self.sim.checker.before_delete(key, self.sim.current)
        self.inner.delete(key)
        self._touch(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.delete(key)

    def create_multipart(self, key: str) -> MultipartUpload:
        upload = self.inner.create_multipart(key)
        self._touch(key)
        self.sim.checker.upload_created(upload, self.sim.current)
        return upload

    def complete_multipart(self, upload, parts, *, mode=None):
        kw = {} if mode is None else {"mode": mode}
        with self.sim.clock_stepped_back(upload.key):
            info = self.inner.complete_multipart(upload, parts, **kw)
            self._touch(upload.key)
        return info

    def abort_multipart(self, upload: MultipartUpload) -> None:
        self.sim.checker.before_abort(upload, self.sim.current)
        self.inner.abort_multipart(upload)
