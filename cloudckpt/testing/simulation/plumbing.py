"""The simulation's plumbing: how actors reach the store, and how the checker sees it.

- ``Port``: an actor's connection to the store; every call is a scheduling point (the
  actor hands the baton back) and may crash the actor before or after it is applied.
- ``Recorder``: sits right above the memory store and shows the checker every write as
  it is applied.
- ``inline_engine``: a transfer engine that runs every transfer in the caller's thread.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cloudckpt import protocol
from cloudckpt.failpoints import SimulatedCrash
from cloudckpt.stores.base import MultipartUpload, PutMode, Store
from cloudckpt.stores.memory import MemoryStore
from cloudckpt.testing.wrappers import ForwardingStore
from cloudckpt.transfer import TransferConfig, TransferEngine

if TYPE_CHECKING:
    from cloudckpt.testing.simulation.actor import Actor
    from cloudckpt.testing.simulation.world import Simulation


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
    engine = TransferEngine(config)
    engine._pool.shutdown()
    engine._pool = InlineExecutor()
    return engine


def transfer_config() -> TransferConfig:
    """One transfer at a time, multipart from 4 KiB: small files still take every path."""
    return TransferConfig(concurrency=1, multipart_threshold=4096, attempts=4)


class Port(ForwardingStore):
    """An actor's connection to the store: every call is a scheduling point, and may crash
    the actor before it is sent or after it was applied."""

    def __init__(self, sim: Simulation, actor: Actor, inner: Store) -> None:
        super().__init__(inner)
        self.sim, self.actor = sim, actor

    def _do(self, op: str, key: str, call: Callable[[], Any]) -> Any:
        actor, sim = self.actor, self.sim
        actor.check_alive()
        sim.yield_(actor, f"{op} {key}")
        actor.check_alive()
        crash = sim.crash_rng.random() < sim.crash_rate(actor)
        after = crash and sim.crash_rng.random() < 0.5
        if crash and not after:
            raise actor.die(f"before-{op}")
        result = call()
        if crash:
            raise actor.die(f"after-{op}")
        return result

    def head(self, key):
        return self._do("head", key, lambda: self.inner.head(key))

    def now(self):
        # A scheduling point too: a host may sleep between reading the clock and writing.
        return self._do("now", "", lambda: self.inner.now())

    def get(self, key):
        return self._do("get", key, lambda: self.inner.get(key))

    def get_range(self, key, start, length):
        return self._do("get_range", key, lambda: self.inner.get_range(key, start, length))

    def put(self, key, data, *, mode=None):
        kw = {} if mode is None else {"mode": mode}
        return self._do("put", key, lambda: self.inner.put(key, data, **kw))

    def delete(self, key):
        return self._do("delete", key, lambda: self.inner.delete(key))

    def list(self, prefix=""):
        return iter(self._do("list", prefix, lambda: list(self.inner.list(prefix))))

    def create_multipart(self, key):
        return self._do("create_multipart", key, lambda: self.inner.create_multipart(key))

    def upload_part(self, upload, part_number, data, *, crc32c=None):
        return self._do(
            "upload_part",
            upload.key,
            lambda: self.inner.upload_part(upload, part_number, data, crc32c=crc32c),
        )

    def complete_multipart(self, upload, parts, *, mode=None):
        kw = {} if mode is None else {"mode": mode}
        return self._do(
            "complete_multipart",
            upload.key,
            lambda: self.inner.complete_multipart(upload, parts, **kw),
        )

    def abort_multipart(self, upload):
        return self._do("abort_multipart", upload.key, lambda: self.inner.abort_multipart(upload))

    def list_multipart(self, prefix=""):
        return self._do("list_multipart", prefix, lambda: self.inner.list_multipart(prefix))


def prefix_of(key: str) -> str | None:
    parts = key.split("/", 2)
    if len(parts) >= 2 and parts[0] == "ckpt":
        prefix = f"ckpt/{parts[1]}/"
        return prefix if protocol.parse_ckpt_prefix(prefix) else None
    return None


class Recorder(ForwardingStore):
    """Sits right above the memory store: sees every write as it is applied, in order, and
    checks each one (LATEST transitions, GC deletions) against the invariants."""

    def __init__(self, sim: Simulation, memory: MemoryStore, inner: Store | None) -> None:
        super().__init__(inner or memory)
        self.sim = sim
        self.memory = memory

    def _touch(self, key: str) -> None:
        prefix = prefix_of(key)
        if prefix is not None:
            self.sim.checker.touched(prefix, self.memory.now())

    def put(self, key: str, data, *, mode: PutMode | None = None) -> Any:
        kw = {} if mode is None else {"mode": mode}
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
        return upload

    def complete_multipart(self, upload, parts, *, mode=None):
        kw = {} if mode is None else {"mode": mode}
        info = self.inner.complete_multipart(upload, parts, **kw)
        self._touch(upload.key)
        return info

    def abort_multipart(self, upload: MultipartUpload) -> None:
        self.sim.checker.before_abort(upload, self.sim.current)
        self.inner.abort_multipart(upload)
