"""The training process of ``cloudckpt demo`` (run as ``python -m cloudckpt._demo_train CFG``).

A toy model in pure Python, so the demo needs nothing beyond cloudckpt: ``size`` bytes of
weights; each step XORs a 1 MiB window with a keystream derived from the step (a real,
deterministic update: resuming from step k and training on gives exactly the weights of a
run that was never interrupted) and then sleeps ``step_seconds`` to stand in for the GPU
work of a real step. Every step is checkpointed with ``CheckpointManager.save`` and uploaded
in the background.

Events go, one JSON object per line, to the file named in the config (flushed at once), so
the parent can watch progress and kill this process mid-upload.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

WINDOW = 1024 * 1024


def initial_weights(size: int, seed: int) -> bytearray:
    return bytearray(random.Random(seed).randbytes(size))


def train_step(weights: bytearray, step: int, seed: int) -> float:
    """One deterministic update in place; returns the step's (toy) loss."""
    span = len(weights) - WINDOW
    offset = (step * 7919 * 4096) % span if span > 0 else 0
    window = min(WINDOW, len(weights))
    key = random.Random(seed * 1_000_003 + step).randbytes(window)
    old = int.from_bytes(weights[offset : offset + window], "little")
    weights[offset : offset + window] = (old ^ int.from_bytes(key, "little")).to_bytes(
        window, "little"
    )
    return round(2.5 / (1.0 + 0.35 * step), 6)


def final_digest(size: int, seed: int, steps: int) -> str:
    """The weights' digest after ``steps`` uninterrupted steps (what the demo compares)."""
    weights = initial_weights(size, seed)
    for step in range(1, steps + 1):
        train_step(weights, step, seed)
    return hashlib.sha256(weights).hexdigest()


class _Events:
    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "t": time.time(), **fields})
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()


class _Uploads:
    """The uploads as the parent sees them: the bytes sent of the step being uploaded
    (``progress``), and each save reported as it commits (``put``; they commit in order)
    by a reporter thread."""

    def __init__(self, emit: _Events) -> None:
        self._emit = emit
        self._lock = threading.Lock()
        self._total = 0
        self._at_last_commit = 0
        self._inflight: list[int] = []  # steps handed over, not yet committed
        self._handles: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._report, daemon=True)

    def progress(self, n: int) -> None:
        """The manager's progress callback: ``n`` more bytes sent."""
        with self._lock:
            self._total += n
            step = self._inflight[0] if self._inflight else None
            step_bytes = self._total - self._at_last_commit
        self._emit("progress", step=step, step_bytes=step_bytes, total_bytes=self._total)

    def start(self) -> None:
        self._thread.start()

    def handed_over(self, step: int) -> None:
        """``step``'s files are staged: its upload starts (after those before it)."""
        with self._lock:
            self._inflight.append(step)

    def put(self, step: int, handle: Any) -> None:
        """Report ``handle`` (the save of ``step``) when it commits or fails."""
        self._handles.put((step, handle))

    def stop(self) -> None:
        """No more saves: the reporter ends after the ones queued."""
        self._handles.put(None)

    def join(self) -> None:
        self._thread.join()

    def _report(self) -> None:
        """Waits for each save in order (they commit in order) and reports it."""
        while (item := self._handles.get()) is not None:
            step, handle = item
            try:
                info = handle.result()
            except Exception as exc:
                info, error = None, str(exc)
            with self._lock:
                if step in self._inflight:
                    self._inflight.remove(step)
                self._at_last_commit = self._total
            if info is None:
                self._emit("failed", step=step, error=error)
                continue
            self._emit(
                "committed",
                step=step,
                seq=info.seq,
                epoch=info.epoch,
                ckpt=info.ckpt,
                bytes=info.total_bytes,
                blocking_seconds=info.blocking_seconds,
                commit_seconds=info.commit_seconds,
            )


def main(config_path: str) -> int:
    """Resume (or start) the run, train to ``steps`` saving every step, then wait for the
    uploads. Returns the exit code: 0, or 4 if the restored weights fail their digest."""
    cfg = json.loads(Path(config_path).read_text())
    from cloudckpt import CheckpointManager, TransferConfig

    emit = _Events(cfg["events"])
    uploads = _Uploads(emit)
    mgr = CheckpointManager(
        cfg["url"],
        storage_options=cfg["storage_options"],
        staging_dir=cfg["staging_dir"],
        keep_last=3,
        auto_gc=False,
        progress=uploads.progress,
        transfer=TransferConfig(concurrency=4),
    )
    emit("started", pid=os.getpid(), writer_id=mgr.writer_id)
    ready = time.time()  # the interpreter, the imports and the manager: process start
    resumed = _resume(mgr, cfg, emit, ready)
    if resumed is None:
        return 4
    weights, first, restored = resumed
    uploads.start()
    _train(mgr, cfg, emit, uploads, weights, first, ready if restored else None)
    uploads.stop()
    mgr.close()
    uploads.join()
    emit("finished", step=cfg["steps"])
    return 0


def _resume(
    mgr: Any, cfg: dict[str, Any], emit: _Events, ready: float
) -> tuple[bytearray, int, bool] | None:
    """The weights to train on, the first step to train, and whether they were restored:
    from the run's newest checkpoint, else fresh. None if the restored weights fail their
    digest. ``ready``: when the process was ready (``time.time()``), for the time to first
    step."""
    started = time.perf_counter()
    result = mgr.resume(into=cfg["restore_dir"])
    resumed_at = time.perf_counter()
    if result is None:
        weights = initial_weights(cfg["size"], cfg["seed"])
        emit("claimed", epoch=mgr.committer.epoch, new_run=True)
        return weights, 1, False
    data = (result.path / "model.bin").read_bytes()
    digest_ok = hashlib.sha256(data).hexdigest() == result.metadata.get("weights_sha256")
    weights, first = bytearray(data), result.step + 1
    timings = result.timings
    spawned = cfg.get("spawned_at", ready)
    emit(
        "resumed",
        epoch=mgr.committer.epoch,
        step=result.step,
        seconds=time.perf_counter() - started,
        bytes=result.total_bytes,
        bytes_downloaded=result.bytes_downloaded,
        bytes_local=result.bytes_local,
        digest_ok=digest_ok,
        skipped=[s.step for s in result.skipped],
        # Time to first step, split (the step itself follows in "first-step").
        startup_s=ready - spawned,
        claim_s=(resumed_at - started) - timings.get("total_s", 0.0),
        listing_s=timings.get("listing_s", 0.0),
        transfer_s=timings.get("transfer_s", 0.0),
        verify_s=timings.get("verify_s", 0.0) + timings.get("place_s", 0.0),
        load_s=time.perf_counter() - resumed_at,
    )
    return (weights, first, True) if digest_ok else None


def _train(
    mgr: Any,
    cfg: dict[str, Any],
    emit: _Events,
    uploads: _Uploads,
    weights: bytearray,
    first: int,
    ready: float | None,
) -> None:
    """Train from step ``first`` to ``steps``, saving after every step (in the background).
    ``ready``: when the process was ready, if it resumed (its first step is reported)."""
    seed = cfg["seed"]
    for step in range(first, cfg["steps"] + 1):
        t0 = time.perf_counter()
        loss = train_step(weights, step, seed)
        compute = time.perf_counter() - t0
        if step == first and ready is not None:
            spawned = cfg.get("spawned_at", ready)
            emit("first-step", step=step, step_s=compute, since_spawn_s=time.time() - spawned)
        time.sleep(max(0.0, cfg["step_seconds"] - compute))
        metadata = {"loss": loss, "weights_sha256": hashlib.sha256(weights).hexdigest()}
        handle = mgr.save(step=step, metadata=metadata)
        t1 = time.perf_counter()
        with handle as d:
            t2 = time.perf_counter()
            (d / "model.bin").write_bytes(weights)
            (d / "trainer_state.json").write_text(json.dumps({"step": step, "loss": loss}))
            t3 = time.perf_counter()
            uploads.handed_over(step)
        t4 = time.perf_counter()
        emit(
            "saved",
            step=step,
            loss=loss,
            blocking_seconds=(t2 - t1) + (t4 - t3),
            write_seconds=t3 - t2,
        )
        uploads.put(step, handle)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
