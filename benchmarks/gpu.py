"""Checkpoints of a model training on one accelerator: cloudckpt beside torch.save and DCP.

    python -m benchmarks gpu                        # on a CUDA machine: ~5 min on one H200
    python -m benchmarks gpu --device cpu --small   # the smoke run CI runs (seconds)
    python -m benchmarks.gpu --help                 # the same module

Needs only torch, numpy, safetensors and cloudckpt's own dependencies (fsspec, botocore,
google-crc32c, tenacity, click, rich): no network, no transformers, no boto3. The model is
a GPT-2-style transformer built here from a config (``--model``: gpt2, gpt2-medium,
gpt2-large; ``--small``: a tiny one), trained with AdamW under bf16 autocast on random
tokens. Everything is written to local disk: cloudckpt to a ``file://`` store (or, with
``--store s3``, the benchmark S3 endpoint in a child process, ``benchmarks/s3_endpoint.py``,
which keeps objects in memory), the peers to files. The JSON (``--json``) is rewritten
after every measurement, so a run that is killed keeps what it measured.

Sections, in order, each side by side in one process:

1. ``limits``: pinned device-to-host and host-to-device bandwidth (one contiguous buffer of
   the state's size into / from pinned memory), pageable ``.cpu()`` of the same bytes, and
   the pinned device-to-host copy of the state's own tensors into preallocated pinned
   buffers (the floor for any save's stall).
2. ``save``: per round (rotating order, one training step between rounds so every weight
   changes), for each contender: the stall (until the training loop may modify the state
   again), the time to durable (fsynced on local disk / committed), the client CPU-seconds
   per GiB, and host memory:
   - ``cloudckpt``: ``save_state``, stall until it returns, durable at the commit;
     ``pinned_bytes / state_bytes`` from ``host_memory_stats``;
   - ``torch.save``: to a file, then fsync (blocking: stall = durable);
   - ``DCP async_save``: ``torch.distributed.checkpoint.async_save`` with a reused
     ``DefaultStager`` (the options that ran are in the JSON: pinned memory, non-blocking
     copies on a staging stream, asynchronous staging; no shared memory, which only the
     process-based executor needs) and a ``FileSystemWriter`` (fsync on, ``thread_count``
     in the JSON); stall until ``staging_completion`` (before it the loop must not step
     the optimizer), durable at ``upload_completion``;
   - ``DCP save``: synchronous (stall = durable).
   The first cloudckpt save (which allocates and pins its host memory) is reported apart,
   and so is ``reserve_host_memory`` (which moves that out of the first stall).
3. ``restore``: the last checkpoint back onto the device, each from local disk (page cache
   warm): cloudckpt ``load_state(mgr, device=...)`` on a fresh manager (straight from the
   store into the tensors through pinned staging buffers, every byte verified, no local
   file), ``torch.load(map_location=...)``, DCP ``load`` into preallocated tensors on the
   device.
4. ``training``: median step time without checkpoints, and while a checkpoint of each
   background saver (cloudckpt, DCP async_save) is being written; slowdown = steps during
   the write over steps without, minus one.

Goals (issue 24, on a GPU): stall <= 1.1x the pinned device-to-host copy of the state and
<= 0.5x DCP ``async_save``'s; pinned bytes <= 1.05x the state; training steps <= 3% slower
while uploading; restore >= 1.3x DCP ``load``. ``--budget-s`` caps the measured rounds (a
section always runs at least one); what was cut is in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SCHEMA = "cloudckpt.bench-gpu/1"
GiB = 1 << 30
MiB = 1 << 20


# ----------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int
    ctx: int
    d: int
    layers: int
    heads: int
    batch: int
    seq: int


PRESETS = {
    "small": GPTConfig(vocab=512, ctx=64, d=64, layers=2, heads=2, batch=2, seq=32),
    "gpt2": GPTConfig(vocab=50257, ctx=1024, d=768, layers=12, heads=12, batch=16, seq=1024),
    "gpt2-medium": GPTConfig(vocab=50257, ctx=1024, d=1024, layers=24, heads=16, batch=8, seq=1024),
    "gpt2-large": GPTConfig(vocab=50257, ctx=1024, d=1280, layers=36, heads=20, batch=4, seq=1024),
}


def build_model(cfg: GPTConfig, device: Any) -> Any:
    """A GPT-2-style decoder (pre-norm blocks, causal attention, GELU MLP, tied head)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(cfg.d)
            self.c_attn = nn.Linear(cfg.d, 3 * cfg.d)
            self.c_proj = nn.Linear(cfg.d, cfg.d)
            self.ln_2 = nn.LayerNorm(cfg.d)
            self.c_fc = nn.Linear(cfg.d, 4 * cfg.d)
            self.mlp_proj = nn.Linear(4 * cfg.d, cfg.d)

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            shape = (b, t, cfg.heads, d // cfg.heads)
            q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab, cfg.d)
            self.wpe = nn.Embedding(cfg.ctx, cfg.d)
            self.h = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.d)
            self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as GPT-2

        def forward(self, idx: Any, targets: Any) -> Any:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    torch.manual_seed(0)
    return GPT().to(device)


class Trainer:
    """The model, AdamW and a batch of random tokens; ``step()`` is one training step."""

    def __init__(self, cfg: GPTConfig, device: Any) -> None:
        import torch

        self.torch, self.device = torch, device
        self.model = build_model(cfg, device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        gen = torch.Generator(device="cpu").manual_seed(1)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        self.x, self.y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        self.steps = 0

    def step(self) -> None:
        with self.torch.autocast(device_type=self.device.type, dtype=self.torch.bfloat16):
            loss = self.model(self.x, self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1

    def timed_step(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.step()
        self.sync()
        return time.perf_counter() - t0

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.steps,
        }


def _tensors(node: Any) -> Iterator[Any]:
    """Every tensor in a nested state (dicts, lists, tuples), in order, repeats included."""
    import torch

    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _tensors(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _tensors(v)


def state_bytes(state: Any) -> int:
    """Bytes of the distinct tensors in ``state`` (tied weights once)."""
    seen = {
        (str(t.device), t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
        for t in _tensors(state)
    }
    return sum(seen.values())


# ----------------------------------------------------------------------------- harness


class Recorder:
    """The JSON document, rewritten (atomically) after every change."""

    def __init__(self, path: Path, doc: dict[str, Any]) -> None:
        self.path, self.doc = path, doc
        self.flush()

    def put(self, *keys_and_value: Any) -> None:
        *keys, value = keys_and_value
        node = self.doc
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
        self.flush()

    def append(self, *keys_and_value: Any) -> None:
        *keys, value = keys_and_value
        node = self.doc
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node.setdefault(keys[-1], []).append(value)
        self.flush()

    def flush(self) -> None:
        self.doc["updated_at"] = dt.datetime.now(dt.timezone.utc).isoformat()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, allow_nan=True, default=str) + "\n")
        os.replace(tmp, self.path)


class Budget:
    """Seconds left for measured rounds (each section runs at least one round)."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _quiesce(device: Any) -> None:
    """Between measurements: garbage, the GPU's idle, dirty pages written back."""
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    os.sync()


def _host_memory_stats(device: Any) -> dict[str, int]:
    """torch's caching host allocator (pinned memory from ``pin_memory=True``)."""
    if device.type != "cuda":
        return {}
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", dict)()
    return {k: int(v) for k, v in stats.items() if "bytes" in k and ("current" in k or "peak" in k)}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ----------------------------------------------------------------------------- limits


def measure_limits(state: dict[str, Any], device: Any, reps: int) -> dict[str, Any]:
    """The machine's own ceilings for the state's bytes (medians of ``reps``)."""
    import torch

    from cloudckpt.integrations._host_memory import HostArena, host_buffer

    nbytes = state_bytes(state)
    tensors = _unique_tensors(state)
    out: dict[str, Any] = {"bytes": nbytes, "reps": reps}

    def timed(fn: Callable[[], Any]) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    def record(name: str, samples: list[float]) -> None:
        s = _median(samples)
        out[name] = {"median_s": s, "samples": samples, "gib_per_s": nbytes / GiB / s}

    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        pinned = host_buffer(nbytes, pin=True)
        record(
            "d2h_pinned", [timed(lambda: pinned.copy_(src, non_blocking=True)) for _ in range(reps)]
        )
        record(
            "h2d_pinned", [timed(lambda: src.copy_(pinned, non_blocking=True)) for _ in range(reps)]
        )
        del pinned
        record("d2h_pageable_cpu", [timed(lambda: src.cpu()) for _ in range(reps)])
        del src
        arena = HostArena()
        slots = arena.carve([t.numel() * t.element_size() for t in tensors], pin=True)
        bufs = [s.view(t.dtype).view(t.shape) for s, t in zip(slots, tensors, strict=True)]

        def per_tensor() -> None:
            for b, t in zip(bufs, tensors, strict=True):
                b.copy_(t, non_blocking=True)

        record("d2h_pinned_state_tensors", [timed(per_tensor) for _ in range(reps)])
        out["note"] = (
            "pinned memory: page-aligned host memory registered with cudaHostRegister (what "
            "cloudckpt and DCP's stager use; torch's pin_memory=True would round the buffer up "
            "to a power of two). d2h_pinned: one contiguous buffer of the state's size; "
            "d2h_pinned_state_tensors: the state's own tensors into preallocated pinned slots, "
            "non-blocking, one synchronisation (the floor for a save's stall)"
        )
        del bufs, slots
        arena.release()
        torch.cuda.empty_cache()
    else:
        src = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        dst = host_buffer(nbytes, pin=False)
        record("memcpy", [timed(lambda: dst.copy_(src)) for _ in range(reps)])
        record("clone", [timed(lambda: src.clone()) for _ in range(reps)])
        out["note"] = "CPU mode: no device; memcpy into reused memory and clone (fresh memory)"
    return out


def _empty_like_tree(node: Any) -> Any:
    """The same structure with every tensor replaced by an uninitialised one like it."""
    import torch

    if isinstance(node, torch.Tensor):
        return torch.empty_like(node)
    if isinstance(node, dict):
        return {k: _empty_like_tree(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_empty_like_tree(v) for v in node]
    return node


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _unique_tensors(state: Any) -> list[Any]:
    out: dict[tuple[str, int, int], Any] = {}
    for t in _tensors(state):
        out.setdefault((str(t.device), t.data_ptr(), t.numel()), t)
    return list(out.values())


# ----------------------------------------------------------------------------- savers


class Saver:
    """One contender of the save section. ``save(r)`` returns seconds: ``stall`` and
    ``durable`` (and anything else worth keeping); ``after(r)`` tidies up, unmeasured."""

    name = ""
    note = ""

    def save(self, r: int) -> dict[str, float]:
        raise NotImplementedError

    def after(self, r: int) -> None:
        pass

    def close(self) -> None:
        pass


class CloudckptSaver(Saver):
    name = "cloudckpt"

    def __init__(self, bench: GPUBench) -> None:
        from cloudckpt import CheckpointManager

        self.bench = bench
        self.mgr = CheckpointManager(
            bench.store_url("ck"),
            storage_options=bench.store_options,
            staging_dir=bench.work / "staging-ck",
            keep_last=1,
            auto_gc=False,
            # Every round changes every weight: chunks would all be new anyway, and the
            # benchmark drops each round's checkpoint to keep the disk from filling up.
            chunking="off",
        )
        self.note = (
            f"save_state to {bench.store_kind} (chunking off); stall = until it returns; "
            "durable = committed (every byte hashed, fsynced in the store)"
        )
        self.last: str | None = None
        self.previous: str | None = None

    def save(self, r: int) -> dict[str, float]:
        from cloudckpt.integrations.torch import save_state

        t0 = time.perf_counter()
        handle = save_state(self.mgr, 1000 + r, self.bench.state)
        t1 = time.perf_counter()
        info = handle.result()
        t2 = time.perf_counter()
        self.last = info.ckpt
        return {"stall": t1 - t0, "durable": t2 - t0}

    def after(self, r: int) -> None:
        # Keep the newest checkpoint (the restores read it), drop the one before.
        if self.previous is not None:
            self.bench.drop("ck", self.previous)
        self.previous = self.last

    def host_memory(self) -> dict[str, Any]:
        from cloudckpt.integrations.torch import host_memory_stats

        return dataclasses.asdict(host_memory_stats(self.mgr))

    def close(self) -> None:
        self.mgr.close()


class TorchSaver(Saver):
    name = "torch.save"
    note = "torch.save to a local file, then fsync (blocking: stall = durable)"

    def __init__(self, bench: GPUBench) -> None:
        self.bench = bench

    def path(self, r: int) -> Path:
        return self.bench.work / f"torch-{r}.pt"

    def save(self, r: int) -> dict[str, float]:
        import torch

        t0 = time.perf_counter()
        torch.save(self.bench.state, self.path(r))
        with open(self.path(r), "rb+") as f:
            os.fsync(f.fileno())
        t1 = time.perf_counter()
        return {"stall": t1 - t0, "durable": t1 - t0}

    def after(self, r: int) -> None:
        os.replace(self.path(r), self.bench.work / "torch-last.pt")  # the restores read it


def _dcp_options(device: Any) -> dict[str, Any]:
    """The fastest staging DCP documents (torch.distributed.checkpoint.staging): pinned
    memory and non-blocking copies need an accelerator, so the CPU mode runs without."""
    on_gpu = device.type == "cuda"
    return {
        "use_pinned_memory": on_gpu,
        "use_shared_memory": False,  # only the process-based executor needs it
        "use_async_staging": True,
        "use_non_blocking_copy": on_gpu,
    }


class DCPAsyncSaver(Saver):
    name = "DCP async_save"

    def __init__(self, bench: GPUBench) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.bench = bench
        self.options = _dcp_options(bench.device)
        self.stager = DefaultStager(StagingOptions(**self.options))
        self.note = (
            f"dcp.async_save, DefaultStager(StagingOptions({self.options})) reused across saves, "
            f"FileSystemWriter(sync_files=True, thread_count={bench.writer_threads}); stall = "
            "until staging_completion; durable = upload_completion"
        )

    def dir(self, r: int) -> Path:
        return self.bench.work / f"dcp-async-{r}"

    def save(self, r: int) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        writer = FileSystemWriter(self.dir(r), thread_count=self.bench.writer_threads)
        with _quiet():
            t0 = time.perf_counter()
            resp = dcp.async_save(self.bench.state, storage_writer=writer, async_stager=self.stager)
            t1 = time.perf_counter()
            staging = getattr(resp, "staging_completion", None)
            upload = getattr(resp, "upload_completion", resp)
            if staging is not None:
                staging.result()
            t2 = time.perf_counter()
            upload.result()
            t3 = time.perf_counter()
        return {"returned": t1 - t0, "stall": t2 - t0, "durable": t3 - t0}

    def after(self, r: int) -> None:
        shutil.rmtree(self.bench.work / "dcp-last", ignore_errors=True)
        os.replace(self.dir(r), self.bench.work / "dcp-last")  # the restores read it

    def host_memory(self) -> dict[str, Any]:
        """What the stager keeps between saves (its cached, pinned storages)."""
        cache = getattr(
            getattr(self.stager, "_state_dict_stager", None), "_cached_storage_mapping", None
        )
        if cache is None:
            return {}
        return {
            "staged_bytes": int(sum(s.nbytes() for s in cache.values())),
            "storages": len(cache),
        }

    def close(self) -> None:
        self.stager.close()


class DCPSaver(Saver):
    name = "DCP save"

    def __init__(self, bench: GPUBench) -> None:
        self.bench = bench
        self.note = (
            f"dcp.save, FileSystemWriter(sync_files=True, thread_count={bench.writer_threads}) "
            "(blocking: stall = durable)"
        )

    def dir(self, r: int) -> Path:
        return self.bench.work / f"dcp-{r}"

    def save(self, r: int) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        writer = FileSystemWriter(self.dir(r), thread_count=self.bench.writer_threads)
        with _quiet():
            t0 = time.perf_counter()
            dcp.save(self.bench.state, storage_writer=writer)
            t1 = time.perf_counter()
        return {"stall": t1 - t0, "durable": t1 - t0}

    def after(self, r: int) -> None:
        shutil.rmtree(self.dir(r), ignore_errors=True)


# ----------------------------------------------------------------------------- the run


class GPUBench:
    def __init__(self, args: argparse.Namespace, rec: Recorder) -> None:
        import torch

        self.args, self.rec = args, rec
        self.device = torch.device(args.device)
        self.budget = Budget(args.budget_s)
        if args.workdir:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="cloudckpt-gpu-bench-", dir=args.workdir))
        self.writer_threads = args.writer_threads
        self.endpoint: Any = None
        self.store_kind = args.store
        if args.store == "s3":
            from benchmarks.s3_endpoint import S3Endpoint

            self.endpoint = S3Endpoint(buckets=("bench",)).start()
            self.store_options: dict[str, Any] = {
                "key": "bench",
                "secret": "bench-secret",
                "endpoint_url": self.endpoint.endpoint_url,
                "client_kwargs": {"region_name": "us-east-1"},
                "config_kwargs": {"s3": {"payload_signing_enabled": False}},
            }
            self.store_kind = "the benchmark S3 endpoint (in memory, loopback)"
        else:
            self.store_options = {}
            self.store_kind = "a file:// store on local disk"
        self.trainer = Trainer(PRESETS[args.model], self.device)
        for _ in range(2):  # AdamW's state exists from the first step on
            self.trainer.step()
        self.trainer.sync()
        self.state = self.trainer.state()
        self.nbytes = state_bytes(self.state)

    def store_url(self, name: str) -> str:
        if self.endpoint is not None:
            return f"s3://bench/{name}/"
        return f"file://{self.work / ('store-' + name)}"

    def drop(self, name: str, ckpt: str) -> None:
        """Delete one committed checkpoint's objects (``ckpt``: its prefix, ``ckpt/<id>/``;
        unmeasured; the CPU groups' ``after`` steps do the same)."""
        if self.endpoint is not None:
            self.endpoint.reset(f"bench/{name}/{ckpt}")
        else:
            shutil.rmtree(self.work / f"store-{name}" / ckpt)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    # -- sections ---------------------------------------------------------------------

    def limits(self) -> None:
        self.rec.put("limits", measure_limits(self.state, self.device, self.args.limit_reps))

    def saves(self) -> None:
        savers: list[Saver] = [
            CloudckptSaver(self),
            TorchSaver(self),
            DCPAsyncSaver(self),
            DCPSaver(self),
        ]
        self.savers = {s.name: s for s in savers}
        for s in savers:
            self.rec.put("save", "contenders", s.name, "note", s.note)
        self.rec.put("save", "dcp_staging_options", _dcp_options(self.device))
        total = self.args.warmup + self.args.rounds
        for r in range(total):
            measured = r >= self.args.warmup
            if measured and r > self.args.warmup and self.budget.left() < 0:
                self.rec.append("save", "cut", f"rounds {r - self.args.warmup + 1}+ (budget)")
                break
            self.trainer.step()  # every weight and moment changes between checkpoints
            self.trainer.sync()
            k = r % len(savers)
            for s in savers[k:] + savers[:k]:
                _quiesce(self.device)
                cpu0 = time.process_time()
                m = s.save(r)
                m["cpu_s"] = time.process_time() - cpu0
                m["cpu_s_per_gib"] = m["cpu_s"] / (self.nbytes / GiB)
                m["host_memory_caching_allocator"] = _host_memory_stats(self.device)
                if isinstance(s, (CloudckptSaver, DCPAsyncSaver)):
                    m["host_memory"] = s.host_memory()
                key = "rounds" if measured else "warmup"
                if r == 0 and isinstance(s, CloudckptSaver):
                    self.rec.put("save", "cloudckpt_first_save", m)
                self.rec.append("save", "contenders", s.name, key, m)
                s.after(r)
                print(
                    f"   save round {r}: {s.name}: stall {m['stall']:.3f}s durable {m['durable']:.3f}s",
                    flush=True,
                )
        self.rec.put("save", "summary", self._save_summary())

    def _save_summary(self) -> dict[str, Any]:
        doc = self.rec.doc["save"]["contenders"]
        med = {
            n: {
                m: _median([x[m] for x in c.get("rounds", [])])
                for m in ("stall", "durable", "cpu_s_per_gib")
            }
            for n, c in doc.items()
        }
        limits = self.rec.doc.get("limits", {})
        floor = limits.get("d2h_pinned_state_tensors", limits.get("memcpy", {})).get("median_s")
        ck = doc.get("cloudckpt", {}).get("rounds", [])
        pinned = ck[-1]["host_memory"].get("pinned_bytes", 0) if ck else 0
        dcp_async = doc.get("DCP async_save", {}).get("rounds", [])
        out: dict[str, Any] = {"medians": med, "state_bytes": self.nbytes}
        ratios: dict[str, Any] = {}
        if floor:
            ratios["stall_over_pinned_d2h_copy"] = {
                "value": med["cloudckpt"]["stall"] / floor,
                "goal": "<= 1.1",
            }
        if dcp_async:
            ratios["stall_over_dcp_async_save_stall"] = {
                "value": med["cloudckpt"]["stall"] / med["DCP async_save"]["stall"],
                "goal": "<= 0.5",
            }
        if self.device.type == "cuda":
            ratios["pinned_bytes_over_state_bytes"] = {
                "value": pinned / self.nbytes,
                "goal": "<= 1.05",
            }
            staged = dcp_async[-1]["host_memory"].get("staged_bytes") if dcp_async else None
            if staged:
                ratios["dcp_staged_bytes_over_state_bytes"] = {"value": staged / self.nbytes}
        for peer in ("torch.save", "DCP async_save", "DCP save"):
            ratios[f"durable_{peer}_over_cloudckpt"] = {
                "value": med[peer]["durable"] / med["cloudckpt"]["durable"]
            }
        out["ratios"] = ratios
        return out

    def reserve(self) -> None:
        """reserve_host_memory on a fresh manager: what it takes out of the first stall."""
        from cloudckpt import CheckpointManager
        from cloudckpt.integrations.torch import reserve_host_memory, save_state

        mgr = CheckpointManager(
            self.store_url("reserve"),
            storage_options=self.store_options,
            staging_dir=self.work / "staging-reserve",
            keep_last=1,
            auto_gc=False,
            chunking="off",
        )
        try:
            _quiesce(self.device)
            t0 = time.perf_counter()
            held = reserve_host_memory(mgr, self.state)
            t1 = time.perf_counter()
            handle = save_state(mgr, 1, self.state)
            t2 = time.perf_counter()
            handle.result()
            self.rec.put(
                "save",
                "cloudckpt_reserved",
                {
                    "reserve_s": t1 - t0,
                    "first_save_stall_after_reserve_s": t2 - t1,
                    "host_memory": dataclasses.asdict(held),
                },
            )
        finally:
            mgr.close()

    def restores(self) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        from cloudckpt import CheckpointManager
        from cloudckpt.integrations.torch import load_state

        dev = self.device
        expected = _unique_tensors(self.state["model"])[0].detach().cpu()
        first_name = next(iter(self.state["model"]))

        def check(model_state: dict[str, Any]) -> None:
            if not torch.equal(model_state[first_name].detach().cpu(), expected):
                raise AssertionError(f"restored {first_name} differs")

        def cloudckpt(r: int) -> None:
            mgr = CheckpointManager(
                self.store_url("ck"),
                storage_options=self.store_options,
                staging_dir=self.work / f"staging-restore-{r}",
            )
            try:
                # The one call that brings the checkpoint onto the device: straight from
                # the store into the tensors (through pinned staging buffers, host-to-device
                # copies overlapped with the reads), every byte verified, no local file.
                loaded = load_state(mgr, device=dev)
                _sync(dev)
            finally:
                mgr.close()
            check(loaded["model"])

        def torch_load(r: int) -> None:
            loaded = torch.load(self.work / "torch-last.pt", map_location=dev, weights_only=True)
            _sync(dev)
            check(loaded["model"])

        target = _empty_like_tree(self.state)  # DCP loads in place: allocated, unmeasured

        def dcp_load(r: int) -> None:
            with _quiet():
                dcp.load(target, storage_reader=FileSystemReader(self.work / "dcp-last"))
            _sync(dev)
            check(target["model"])

        contenders: list[tuple[str, Callable[[int], None], str]] = [
            (
                "cloudckpt",
                cloudckpt,
                "load_state(mgr, device=...) on a new manager with an empty staging directory (a new host): LATEST, manifest, ranged reads into pinned staging buffers, every byte verified, host-to-device copies overlapped; no local file",
            ),
            (
                "torch.load",
                torch_load,
                "torch.load(map_location=device, weights_only=True) of the torch.save file",
            ),
            (
                "DCP load",
                dcp_load,
                "dcp.load into preallocated tensors on the device (model and optimizer), FileSystemReader",
            ),
        ]
        for name, _, note in contenders:
            self.rec.put("restore", "contenders", name, "note", note)
        self.rec.put(
            "restore", "note", "from local disk with the page cache warm (no root to drop it)"
        )
        rounds = max(1, self.args.rounds)
        for r in range(rounds):
            if r > 0 and self.budget.left() < 0:
                self.rec.append("restore", "cut", f"rounds {r + 1}+ (budget)")
                break
            k = r % len(contenders)
            for name, fn, _ in contenders[k:] + contenders[:k]:
                _quiesce(dev)
                cpu0 = time.process_time()
                t0 = time.perf_counter()
                fn(r)
                s = time.perf_counter() - t0
                self.rec.append(
                    "restore",
                    "contenders",
                    name,
                    "rounds",
                    {"s": s, "cpu_s": time.process_time() - cpu0},
                )
                shutil.rmtree(self.work / f"restored-{r}", ignore_errors=True)
                shutil.rmtree(self.work / f"staging-restore-{r}", ignore_errors=True)
                print(f"   restore round {r}: {name}: {s:.3f}s", flush=True)
        doc = self.rec.doc["restore"]["contenders"]
        med = {n: _median([x["s"] for x in c.get("rounds", [])]) for n, c in doc.items()}
        self.rec.put(
            "restore",
            "summary",
            {
                "medians_s": med,
                "dcp_load_over_cloudckpt": {
                    "value": med["DCP load"] / med["cloudckpt"],
                    "goal": ">= 1.3",
                },
                "torch_load_over_cloudckpt": {"value": med["torch.load"] / med["cloudckpt"]},
            },
        )

    def training(self) -> None:
        """Step times without checkpoints and while each background saver writes one."""
        from cloudckpt.integrations.torch import save_state

        ck: CloudckptSaver = self.savers["cloudckpt"]  # type: ignore[assignment]
        dcp_saver: DCPAsyncSaver = self.savers["DCP async_save"]  # type: ignore[assignment]
        t = self.trainer
        n = self.args.steps

        def baseline() -> dict[str, Any]:
            return {"steps_s": [t.timed_step() for _ in range(n)]}

        def during(
            start: Callable[[int], tuple[Callable[[], bool], float, Callable[[], None]]],
        ) -> dict[str, Any]:
            """Start a save, then step until it is durable; again until ``n`` steps."""
            steps: list[float] = []
            stalls: list[float] = []
            saves = 0
            while len(steps) < n and saves < 5:
                t.sync()
                done, stall, tidy = start(saves)
                stalls.append(stall)
                saves += 1
                while not done():
                    steps.append(t.timed_step())
                    if len(steps) >= 4 * n:
                        break
                while not done():  # (unmeasured) the write ends before the next one starts
                    time.sleep(0.01)
                tidy()
            return {"steps_s": steps, "stalls_s": stalls, "saves": saves}

        def cloudckpt_start(i: int) -> tuple[Callable[[], bool], float, Callable[[], None]]:
            t0 = time.perf_counter()
            handle = save_state(ck.mgr, 5000 + i, t.state())
            stall = time.perf_counter() - t0
            return handle.done, stall, lambda: self.drop("ck", handle.result().ckpt)

        def dcp_start(i: int) -> tuple[Callable[[], bool], float, Callable[[], None]]:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter

            path = self.work / f"dcp-train-{i}"
            shutil.rmtree(path, ignore_errors=True)
            writer = FileSystemWriter(path, thread_count=self.writer_threads)
            with _quiet():
                t0 = time.perf_counter()
                resp = dcp.async_save(
                    t.state(), storage_writer=writer, async_stager=dcp_saver.stager
                )
                staging = getattr(resp, "staging_completion", None)
                if staging is not None:
                    staging.result()  # the optimizer may not step before staging is done
                stall = time.perf_counter() - t0
            upload = getattr(resp, "upload_completion", resp)
            return upload.done, stall, lambda: shutil.rmtree(path, ignore_errors=True)

        phases = [
            ("baseline", lambda: baseline()),
            ("cloudckpt", lambda: during(cloudckpt_start)),
            ("DCP async_save", lambda: during(dcp_start)),
            ("baseline again", lambda: baseline()),
        ]
        for name, fn in phases:
            if name != "baseline" and self.budget.left() < -60:
                self.rec.append("training", "cut", f"{name} (budget)")
                continue
            _quiesce(self.device)
            result = fn()
            result["median_step_s"] = _median(result["steps_s"])
            self.rec.put("training", "phases", name, result)
            print(
                f"   training: {name}: median step {result['median_step_s'] * 1000:.1f} ms over {len(result['steps_s'])} steps",
                flush=True,
            )
        ck.mgr.wait()
        phases_doc = self.rec.doc["training"]["phases"]
        base = _median(
            [
                phases_doc[p]["median_step_s"]
                for p in ("baseline", "baseline again")
                if p in phases_doc
            ]
        )
        summary: dict[str, Any] = {
            "baseline_median_step_s": base,
            "goal": "<= 3% slower while uploading",
        }
        for p in ("cloudckpt", "DCP async_save"):
            if p in phases_doc:
                summary[f"slowdown_{p}"] = phases_doc[p]["median_step_s"] / base - 1
        self.rec.put("training", "summary", summary)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in ("cloudckpt", "torch", "numpy", "safetensors", "botocore"):
        with contextlib.suppress(Exception):
            out[mod] = __import__(mod).__version__
    return out


def _machine(device: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu"] = next(x for x in cpuinfo if x.startswith("model name")).split(":")[1].strip()
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        info["mem_gib"] = round(
            int(next(x for x in meminfo if x.startswith("MemTotal")).split()[1]) / 2**20, 1
        )
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        info["device"] = torch.cuda.get_device_name(device)
        info["device_memory_gib"] = round(props.total_memory / GiB, 1)
        info["cuda"] = torch.version.cuda
    else:
        info["device"] = "cpu"
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu")
    p.add_argument("--small", action="store_true", help="a tiny model, one round each (CI)")
    p.add_argument("--model", default="gpt2-medium", choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=3, help="measured save rounds per contender")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds (the first save)")
    p.add_argument("--steps", type=int, default=30, help="training steps per phase")
    p.add_argument("--limit-reps", type=int, default=5)
    p.add_argument("--store", choices=("file", "s3"), default="file")
    p.add_argument("--writer-threads", type=int, default=8, help="DCP FileSystemWriter threads")
    p.add_argument("--budget-s", type=float, default=240.0, help="seconds for measured rounds")
    p.add_argument("--workdir", help="local directory for files and stores (default: tmp)")
    p.add_argument("--json", default="cloudckpt-bench-gpu.json")
    args = p.parse_args(argv)
    if args.small:
        args.model = "small"
        args.rounds = min(args.rounds, 1)
        args.steps = min(args.steps, 3)
        args.limit_reps = min(args.limit_reps, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "no CUDA device here: run with --device cpu (e.g. --device cpu --small)",
            file=sys.stderr,
        )
        return 2
    started = time.time()
    rec = Recorder(
        Path(args.json),
        {
            "schema": SCHEMA,
            "command": " ".join(
                ["python -m benchmarks gpu", *(argv if argv is not None else sys.argv[1:])]
            ),
            "started_at": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(),
            "config": {**vars(args), "model_config": dataclasses.asdict(PRESETS[args.model])},
            "machine": _machine(device),
            "versions": _versions(),
            "complete": False,
        },
    )
    bench = GPUBench(args, rec)
    rec.put(
        "state",
        {
            "bytes": bench.nbytes,
            "gib": bench.nbytes / GiB,
            "tensors": len(_unique_tensors(bench.state)),
            "parameters": sum(p.numel() for p in bench.trainer.model.parameters()),
        },
    )
    print(
        f"cloudckpt GPU benchmark: {rec.doc['machine']['device']}, model {args.model}, state {bench.nbytes / GiB:.2f} GiB, store: {bench.store_kind}",
        flush=True,
    )
    try:
        for section in ("limits", "saves", "reserve", "restores", "training"):
            t0 = time.monotonic()
            print(f"== {section}", flush=True)
            getattr(bench, section)()
            rec.put("section_seconds", section, time.monotonic() - t0)
    finally:
        for s in getattr(bench, "savers", {}).values():
            with contextlib.suppress(Exception):
                s.close()
        bench.close()
    rec.put("duration_s", time.time() - started)
    rec.put("complete", True)
    print(summary(rec.doc))
    print(f"\nresults: {args.json}  ({time.time() - started:.0f} s)")
    return 0


def summary(doc: dict[str, Any]) -> str:
    """The side-by-side table of a (possibly partial) result document."""
    lines = []
    lim = doc.get("limits", {})
    for k, v in lim.items():
        if isinstance(v, dict) and "gib_per_s" in v:
            lines.append(f"  limit {k:<28} {v['median_s']:8.3f} s  {v['gib_per_s']:7.2f} GiB/s")
    save = doc.get("save", {}).get("summary", {})
    for name, m in save.get("medians", {}).items():
        lines.append(
            f"  save  {name:<28} stall {m['stall']:8.3f} s  durable {m['durable']:8.3f} s  CPU {m['cpu_s_per_gib']:6.2f} s/GiB"
        )
    for name, r in save.get("ratios", {}).items():
        goal = f"  (goal {r['goal']})" if "goal" in r else ""
        lines.append(f"  ratio {name:<44} {r['value']:7.3f}{goal}")
    res = doc.get("restore", {}).get("summary", {})
    for name, s in res.get("medians_s", {}).items():
        lines.append(f"  restore {name:<26} {s:8.3f} s")
    tr = doc.get("training", {}).get("summary", {})
    for k, v in tr.items():
        if isinstance(v, float) and math.isfinite(v):
            lines.append(f"  training {k:<30} {v:8.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
