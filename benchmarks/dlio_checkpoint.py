"""MLPerf Storage's checkpointing workload (DLIO), reproduced: ``python -m benchmarks --groups dlio``.

``dlio-benchmark`` itself does not install here (docs/performance.md, "An external
benchmark"), so this module builds the tensors DLIO's checkpoint workload builds and writes
them the ways DLIO writes them, beside cloudckpt and DCP + s3torchconnector, on one S3
endpoint. The state is what DLIO's ``BaseCheckpointing`` allocates for a transformer
(``model.type: transformer``) with ZeRO stage 3, tensor and pipeline parallelism 1 (MLPerf
Storage's ``llama3_8b.yaml``), for every one of ``ranks`` data-parallel ranks:

- model (``layer_state``, ``model_datatype`` fp16): layers ``0 .. num_layers + 2``:
  layer 0 the embedding and ``num_layers + 1`` the lm_head (``hidden * vocab`` each), the
  last one a norm weight (``hidden``), and every transformer layer six tensors: input norm
  (``hidden``), QKV (``hidden * (hidden + 2 * kv_dim)``), dense (``hidden^2``), post norm
  (``hidden``), MLP up+gate (``2 * hidden * ffn``) and down (``hidden * ffn``); ZeRO-3
  divides every one of them by the number of ranks;
- optimizer (``optimization_state``, ``optimizer_datatype`` fp32): six tensors,
  ``[P, 5h, P, 5h, P, 5h]`` with ``P = num_parameters // ranks``.

Each rank writes its model state and its optimizer state as two files per checkpoint,
``global_epoch{e}_step{s}/zero_pp_rank_{r}_mp_rank_0_{model,optim}_states.pt``. DLIO
builds the tensors once and writes the same ones at every checkpoint; here every write gets
fresh random bytes (refilled between measurements, unmeasured), or cloudckpt's chunk reuse
would upload only the first checkpoint.

One process stands for one client (a host) running the ``ranks`` ranks: the peers write and
read each rank's files from a thread per rank, all at once, as DLIO's MPI processes do;
cloudckpt saves the client's ranks as one ``save_state`` and loads them with one
``load_state``; DCP saves and loads them in one ``dcp.save``/``dcp.load`` with
``thread_count = ranks``.

Groups: ``dlio-save`` (until every byte is durable: committed, uploaded, or fsynced) and
``dlio-restore`` (a new host: every byte back into memory; and the time to the first
training step: the restored state in the model's tensors and one in-place update of every
tensor). Figures per client; DLIO's ``GB`` is 2^30 bytes, so its GB/s is the harness's
``gib_per_s``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    REGION,
    Comparison,
    Contender,
    GiB,
    Group,
    _dcp_endpoint,
    _rm,
)
from benchmarks.peers import Peers, _env_creds

#: MLPerf Storage's llama3_8b.yaml (configs/dlio/workload/), as DLIO reads it.
LLAMA3_8B = {
    "num_layers": 32,
    "hidden_size": 4096,
    "ffn_hidden_size": 14336,
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_kv_heads": 8,
    "model_datatype": "fp16",
    "optimizer_datatype": "fp32",
    "zero_stage": 3,
    "tensor": 1,
    "pipeline": 1,
    "ranks": 8,  # MLPerf Storage runs llama3-8b with 8 processes
}
DTYPE_BYTES = {"fp16": 2, "fp32": 4}


@dataclasses.dataclass(frozen=True)
class Workload:
    """The DLIO config fields the checkpoint workload reads (``model.*`` of the YAML)."""

    num_layers: int = LLAMA3_8B["num_layers"]
    hidden_size: int = LLAMA3_8B["hidden_size"]
    ffn_hidden_size: int = LLAMA3_8B["ffn_hidden_size"]
    vocab_size: int = LLAMA3_8B["vocab_size"]
    num_attention_heads: int = LLAMA3_8B["num_attention_heads"]
    num_kv_heads: int = LLAMA3_8B["num_kv_heads"]
    ranks: int = LLAMA3_8B["ranks"]
    model_datatype: str = "fp16"
    optimizer_datatype: str = "fp32"

    @classmethod
    def scaled(cls, hidden_size: int, num_layers: int, ranks: int) -> Workload:
        """llama3-8b with every width scaled by ``hidden_size / 4096`` (FFN and vocabulary
        with it; heads, KV heads, dtypes, ZeRO stage kept). Raises ValueError for a width
        the 32 attention heads do not divide, or no layers or ranks."""
        base = LLAMA3_8B["hidden_size"]
        if hidden_size <= 0 or hidden_size % LLAMA3_8B["num_attention_heads"]:
            raise ValueError(
                f"--dlio-hidden {hidden_size}: must be a positive multiple of "
                f"{LLAMA3_8B['num_attention_heads']} (the attention heads), e.g. 352"
            )
        if num_layers < 1 or ranks < 1:
            raise ValueError("--dlio-layers and --dlio-ranks must be at least 1")
        return cls(
            num_layers=num_layers,
            hidden_size=hidden_size,
            ffn_hidden_size=LLAMA3_8B["ffn_hidden_size"] * hidden_size // base,
            vocab_size=LLAMA3_8B["vocab_size"] * hidden_size // base,
            ranks=ranks,
        )

    @property
    def kv_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads * self.num_kv_heads

    def num_parameters(self) -> int:
        """DLIO's ``get_num_parameters``: embedding, layers, final norm, lm_head."""
        h, f = self.hidden_size, self.ffn_hidden_size
        per_layer = h + h * (h + 2 * self.kv_dim) + h * h + h + 2 * f * h + f * h
        return self.vocab_size * h + per_layer * self.num_layers + h + self.vocab_size * h

    def layer_parameters(self, layer: int) -> list[int]:
        """DLIO's ``get_layer_parameters`` at ZeRO-3 (sharded over the ranks), TP = 1."""
        h, f, w = self.hidden_size, self.ffn_hidden_size, self.ranks
        if layer in (0, self.num_layers + 1):
            return [h * self.vocab_size // w]  # embedding, lm_head
        if layer == self.num_layers + 2:
            return [h // w]  # final norm
        return [h // w, h * (h + 2 * self.kv_dim) // w, h * h // w, h // w,
                h * 2 * f // w, h * f // w]  # fmt: skip

    def optimizer_groups(self) -> list[int]:
        """DLIO's ``get_optimization_groups`` at ZeRO >= 1 (TP = PP = 1)."""
        p, h5 = self.num_parameters() // self.ranks, self.hidden_size * 5
        return [p, h5, p, h5, p, h5]

    def rank_bytes(self) -> tuple[int, int]:
        """(model, optimizer) bytes of one rank's checkpoint."""
        layers = range(self.num_layers + 3)
        model = sum(n for i in layers for n in self.layer_parameters(i) if n > 0)
        optim = sum(n for n in self.optimizer_groups() if n > 0)
        return (
            model * DTYPE_BYTES[self.model_datatype],
            optim * DTYPE_BYTES[self.optimizer_datatype],
        )

    def total_bytes(self) -> int:
        return sum(self.rank_bytes()) * self.ranks


def rank_state(w: Workload) -> dict[str, Any]:
    """One rank's state as DLIO's PyTorch checkpointing allocates it (``torch.rand``)."""
    import torch

    dtypes = {"fp16": torch.float16, "fp32": torch.float32}

    def tensor(n: int, dtype: str) -> Any:
        return torch.rand(n, dtype=dtypes[dtype])

    model = {
        str(i): {
            str(j): tensor(n, w.model_datatype)
            for j, n in enumerate(w.layer_parameters(i))
            if n > 0
        }
        for i in range(w.num_layers + 3)
    }
    optim = {
        str(j): tensor(n, w.optimizer_datatype) for j, n in enumerate(w.optimizer_groups()) if n > 0
    }
    return {"model": model, "optim": optim}


def client_state(w: Workload) -> dict[str, Any]:
    """Every rank's state of one client: ``{"rank<r>": {"model": ..., "optim": ...}}``."""
    return {f"rank{r}": rank_state(w) for r in range(w.ranks)}


def tensors(state: Any) -> Iterator[Any]:
    """Every tensor of a nested state, in a fixed order."""
    if isinstance(state, dict):
        for k in sorted(state):
            yield from tensors(state[k])
    else:
        yield state


def refill(state: Any) -> None:
    """Fresh random bytes in every tensor (in place): no chunk of any earlier write recurs.
    Random integers through an integer view (5x faster than ``uniform_`` here)."""
    import torch

    for t in tensors(state):
        t.view(torch.int16 if t.element_size() == 2 else torch.int32).random_()


def file_name(rank: int, kind: str, step: int, epoch: int = 1) -> str:
    """DLIO's name of a rank's file (ZeRO-3, ``mp_rank`` 0)."""
    return f"global_epoch{epoch}_step{step}/zero_pp_rank_{rank}_mp_rank_0_{kind}_states.pt"


def files(w: Workload, step: int) -> list[tuple[int, str, str]]:
    """(rank, "model"|"optim", name) of every file of one checkpoint."""
    return [(r, k, file_name(r, k, step)) for r in range(w.ranks) for k in ("model", "optim")]


def _per_rank(w: Workload, pool: cf.ThreadPoolExecutor, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for every rank at once (DLIO's ranks are concurrent processes)."""
    return list(pool.map(fn, range(w.ranks)))


def _drop_cache(path: Path) -> None:
    """Evict a written, fsynced file from the page cache: a restore reads the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- groups


def dlio_groups(bench: Any, s3: Any, signing: str, w: Workload) -> None:
    """``dlio-save`` and ``dlio-restore`` (module docstring), on ``s3`` (an ``S3Target``)."""
    pool = cf.ThreadPoolExecutor(w.ranks, thread_name_prefix="rank")
    try:
        save_group(bench, s3, signing, w, pool)
        restore_group(bench, s3, signing, w, pool)
    finally:
        pool.shutdown()


def _info(w: Workload, s3: Any, signing: str) -> dict[str, Any]:
    model, optim = w.rank_bytes()
    full = Workload()
    return {
        "signing": signing,
        "endpoint": s3.kind,
        "workload": {
            "dlio_config": "llama3_8b.yaml (MLPerf Storage), ZeRO stage 3, TP 1, PP 1",
            **dataclasses.asdict(w),
            "num_parameters": w.num_parameters(),
            "rank_model_bytes": model,
            "rank_optimizer_bytes": optim,
            "files_per_checkpoint": 2 * w.ranks,
            "full_size_bytes": full.total_bytes(),
            "full_num_parameters": full.num_parameters(),
        },
    }


def _title(kind: str, w: Workload, nbytes: int, s3: Any, signing: str) -> str:
    return (
        f"DLIO checkpoint workload, {kind}: llama3-8b scaled to hidden {w.hidden_size}, "
        f"{w.num_layers} layers, {w.ranks} ranks (ZeRO-3), {nbytes / GiB:.2f} GiB in "
        f"{2 * w.ranks} files (S3 endpoint: {s3.kind}, {signing} payload)"
    )


def _s3_checkpoint(s3: Any) -> Any:
    """s3torchconnector's ``S3Checkpoint`` as DLIO's ``PyTorchS3Checkpointing`` makes it
    (``S3ClientConfig(force_path_style=...)``, its other settings default)."""
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    config = S3ClientConfig(force_path_style=bool(s3.endpoint_url))
    return S3Checkpoint(region=REGION, endpoint=s3.endpoint_url, s3client_config=config)


def save_group(bench: Any, s3: Any, signing: str, w: Workload, pool: cf.ThreadPoolExecutor) -> None:
    """Every byte of one checkpoint durable: cloudckpt vs DLIO's two writers vs DCP."""
    import torch
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageWriter

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import reserve_host_memory, save_state

    state = client_state(w)
    nbytes = sum(t.numel() * t.element_size() for t in tensors(state))
    disk = bench.work / "dlio-save"
    disk.mkdir()
    options = s3.storage_options(signing)
    ck = _s3_checkpoint(s3)
    peers = Peers(s3, signing)
    # One manager for every round, as a training job keeps one: the shipped defaults
    # (chunking on, local copy kept) but no automatic GC; its host buffers reserved up
    # front, as the docs advise (reserve_host_memory), not inside the first stall.
    mgr = CheckpointManager(
        s3.url("dlio-ck/"),
        storage_options=options,
        staging_dir=disk / "staging",
        keep_last=1,
        auto_gc=False,
    )
    reserve_host_memory(mgr, state)
    last: dict[str, str] = {}
    kept: list[str] = []

    def cloudckpt(r: int) -> dict[str, float]:
        t0 = time.perf_counter()
        handle = save_state(mgr, r, state)
        t1 = time.perf_counter()
        last["ckpt"] = handle.result().ckpt
        t2 = time.perf_counter()
        return {"stall": t1 - t0, "commit": t2 - t0, "s": t2 - t0}

    def cloudckpt_after(r: int) -> None:
        # The first checkpoint stays: every tensor is refilled with fresh bytes each round,
        # but state.json is the same every round and each save names the first upload of
        # it; deleting that behind the manager's back made every round's save pay a second
        # attempt to upload it again (until 2026-12-06). Each later checkpoint is dropped
        # once a newer one is committed (only the newest and the first are kept, so the
        # in-memory endpoint holds two checkpoints, not one per round).
        kept.append(last.pop("ckpt"))
        if len(kept) > 2:
            s3.drop(f"dlio-ck/{kept.pop(1)}")
        refill(state)

    def dlio_s3(r: int) -> dict[str, float]:
        def rank(i: int) -> None:
            for _, kind, name in files(w, r)[2 * i : 2 * i + 2]:
                uri = f"s3://{s3.bucket}/{s3.root}dlio-s3/{name}"
                with ck.writer(uri) as writer:
                    torch.save(state[f"rank{i}"][kind], writer)

        t0 = time.perf_counter()
        with _env_creds(s3):
            _per_rank(w, pool, rank)
        s = time.perf_counter() - t0
        return {"stall": s, "commit": s, "s": s}

    def dlio_file(r: int) -> dict[str, float]:
        def rank(i: int) -> None:
            for _, kind, name in files(w, r)[2 * i : 2 * i + 2]:
                path = disk / "dlio-file" / name
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as f:  # DLIO's save_state, fsync: True
                    torch.save(state[f"rank{i}"][kind], f)
                    os.fsync(f.fileno())

        t0 = time.perf_counter()
        _per_rank(w, pool, rank)
        s = time.perf_counter() - t0
        return {"stall": s, "commit": s, "s": s}

    def dcp_s3(r: int) -> dict[str, float]:
        writer = S3StorageWriter(
            region=REGION,
            path=f"s3://{s3.bucket}/{s3.root}dlio-dcp/{r}/",
            s3client_config=peers.config(),
            thread_count=w.ranks,
        )
        _dcp_endpoint(writer.fs, s3, signing)
        with warnings.catch_warnings(), _env_creds(s3):
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=writer)
            s = time.perf_counter() - t0
        return {"stall": s, "commit": s, "s": s}

    def after(prefix: str) -> Callable[[int], None]:
        def tidy(r: int) -> None:
            s3.drop(prefix)
            refill(state)

        return tidy

    def file_after(r: int) -> None:
        _rm(disk / "dlio-file")
        refill(state)

    s3_name, local_name, dcp_name = (
        "DLIO pt_s3_save (S3Checkpoint)",
        "DLIO pt_save (local file, fsync)",
        "DCP save S3StorageWriter",
    )
    group = Group(
        name="dlio-save",
        title=_title("save", w, nbytes, s3, signing),
        nbytes=nbytes,
        contenders=[
            Contender(
                "cloudckpt",
                cloudckpt,
                cloudckpt_after,
                cloudckpt=True,
                note="one save_state of the client's ranks until LATEST names it (staged, "
                "uploaded, every digest computed); stall = until save_state returns; one "
                "manager for all rounds, host memory reserved before them",
            ),
            Contender(
                s3_name,
                dlio_s3,
                after("dlio-s3/"),
                note="DLIO's PyTorchS3Checkpointing: torch.save into s3torchconnector's "
                "S3Checkpoint.writer, a thread per rank, two objects each",
            ),
            Contender(
                dcp_name,
                dcp_s3,
                after("dlio-dcp/"),
                note=f"dcp.save with s3torchconnector's S3StorageWriter, "
                f"thread_count={w.ranks}; blocking",
            ),
            Contender(
                local_name,
                dlio_file,
                file_after,
                note="DLIO's PyTorchCheckpointing (checkpoint.fsync: True): torch.save to a "
                "local file and fsync, a thread per rank: local disk, no network",
            ),
        ],
        comparisons=[
            *(Comparison("s", n, None, label="save") for n in (s3_name, dcp_name, local_name)),
            *(Comparison("stall", n, None, label=f"stall vs {n}") for n in (s3_name, local_name)),
        ],
        servers={"server": s3.pid},
        info=_info(w, s3, signing),
    )
    try:
        bench.run(group)
    finally:
        mgr.close()
        peers.close()
        s3.drop("dlio-")
        _rm(disk)
        state.clear()


def _probe(rank: Any) -> Any:
    """What the restore check compares of a rank: both ends of its largest optimizer tensor."""
    import torch

    t = rank["optim"]["0"]
    return torch.cat([t[:65536], t[-65536:]])


class _FirstStep:
    """Times a restore and the first step after it, into the model's own tensors; checks
    (unmeasured) that what came back is what was saved: both ends of every rank's largest
    tensor, kept before any restore."""

    def __init__(self, model_state: dict[str, Any]) -> None:
        self.model = list(tensors(model_state))
        self.expected = {rank: _probe(s).clone() for rank, s in model_state.items()}

    def check(self, loaded: Any) -> None:
        import torch

        for rank, t in self.expected.items():
            if not torch.equal(_probe(loaded[rank]), t):
                raise AssertionError(f"restored {rank} differs")

    def timed(self, restore: Callable[[], Any], in_place: bool = False) -> dict[str, float]:
        """``s``: ``restore()`` until it returns the state; ``first_step``: that plus the
        copy into the model (``load_state_dict``'s part; none when ``in_place``) and one
        step."""
        t0 = time.perf_counter()
        loaded = restore()
        t1 = time.perf_counter()
        self.check(loaded)  # before the step changes the model
        t2 = time.perf_counter()
        if not in_place:
            _into(self.model, loaded)
        _step(self.model)
        t3 = time.perf_counter()
        return {"s": t1 - t0, "first_step": (t1 - t0) + (t3 - t2), "into_model": t3 - t2}


def _step(model: list[Any]) -> None:
    """The first training step: every tensor updated in place (weights and moments)."""
    import torch

    with torch.no_grad():
        for t in model:
            t.mul_(0.999)


def _into(model: list[Any], loaded: Any) -> None:
    """``load_state_dict``'s part: the restored tensors copied into the model's."""
    for dst, src in zip(model, tensors(loaded), strict=True):
        dst.copy_(src)


def _write_sources(
    s3: Any,
    signing: str,
    w: Workload,
    state: dict[str, Any],
    url: str,
    dcp_path: str,
    local: Path,
    ck: Any,
    peers: Peers,
) -> None:
    """The checkpoints the restore group reads, each written once the way its contender
    writes it (unmeasured): cloudckpt's run at ``url``, DCP's at ``dcp_path``, DLIO's
    objects under ``dlio-restore-s3/`` and its fsynced files under ``local``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageWriter

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import save_state

    options = s3.storage_options(signing)
    writer = CheckpointManager(
        url, storage_options=options, staging_dir=local.parent / "w", keep_local=0
    )
    save_state(writer, 1, state).result()
    writer.close()
    dcp_writer = S3StorageWriter(region=REGION, path=dcp_path, s3client_config=peers.config())
    _dcp_endpoint(dcp_writer.fs, s3, signing)
    with warnings.catch_warnings(), _env_creds(s3):
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp_writer)
        for i, kind, name in files(w, 1):
            with ck.writer(f"s3://{s3.bucket}/{s3.root}dlio-restore-s3/{name}") as out:
                torch.save(state[f"rank{i}"][kind], out)
    for i, kind, name in files(w, 1):
        path = local / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            torch.save(state[f"rank{i}"][kind], f)
            os.fsync(f.fileno())


def restore_group(
    bench: Any, s3: Any, signing: str, w: Workload, pool: cf.ThreadPoolExecutor
) -> None:
    """A new host: every byte back into memory, then the first step."""
    import torch
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageReader

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import LoadReport, load_state

    state = client_state(w)
    nbytes = sum(t.numel() * t.element_size() for t in tensors(state))
    disk = bench.work / "dlio-restore"
    disk.mkdir()
    url = s3.url("dlio-restore-ck/")
    options = s3.storage_options(signing)
    ck = _s3_checkpoint(s3)
    peers = Peers(s3, signing)
    dcp_path = f"s3://{s3.bucket}/{s3.root}dlio-restore-dcp/"
    local = disk / "dlio-file"
    _write_sources(s3, signing, w, state, url, dcp_path, local, ck, peers)
    model_state = state  # the model's tensors: DCP loads into them, the others copy
    fs = _FirstStep(model_state)
    reader = CheckpointManager(url, storage_options=options, staging_dir=disk / "r", keep_local=0)
    timed = fs.timed
    ranks = list(model_state)

    def cloudckpt(r: int) -> dict[str, float]:
        report = LoadReport()
        out = timed(lambda: load_state(reader, report=report))
        out.update(transfer_s=report.transfer_s, verify_s=report.verify_s)
        return out

    def cloudckpt_in_place(r: int) -> dict[str, float]:
        report = LoadReport()
        out = timed(lambda: load_state(reader, into=model_state, report=report), in_place=True)
        out.update(transfer_s=report.transfer_s, verify_s=report.verify_s)
        return out

    def dlio_s3(r: int) -> dict[str, float]:
        def rank(i: int) -> dict[str, Any]:
            got = {}
            for _, kind, name in files(w, 1)[2 * i : 2 * i + 2]:
                with ck.reader(f"s3://{s3.bucket}/{s3.root}dlio-restore-s3/{name}") as src:
                    got[kind] = torch.load(src)  # DLIO's load_state
            return got

        with _env_creds(s3):
            return timed(lambda: dict(zip(ranks, _per_rank(w, pool, rank), strict=True)))

    def dlio_file(r: int) -> dict[str, float]:
        def rank(i: int) -> dict[str, Any]:
            return {
                kind: torch.load(local / name) for _, kind, name in files(w, 1)[2 * i : 2 * i + 2]
            }

        return timed(lambda: dict(zip(ranks, _per_rank(w, pool, rank), strict=True)))

    def drop_file_cache(r: int = -1) -> None:
        for *_, name in files(w, 1):
            _drop_cache(local / name)

    def dcp_load(r: int) -> dict[str, float]:
        dcp_reader = S3StorageReader(region=REGION, path=dcp_path, s3client_config=peers.config())
        _dcp_endpoint(dcp_reader.fs, s3, signing)

        def load() -> Any:
            dcp.load(model_state, storage_reader=dcp_reader)
            return model_state

        with warnings.catch_warnings(), _env_creds(s3):
            warnings.simplefilter("ignore")
            return timed(load, in_place=True)

    drop_file_cache()
    s3_name, local_name, dcp_name = (
        "DLIO pt_s3_save (S3Checkpoint)",
        "DLIO pt_save (local file)",
        "DCP load S3StorageReader",
    )
    group = Group(
        name="dlio-restore",
        title=_title("restore on a new host", w, nbytes, s3, signing),
        nbytes=nbytes,
        contenders=[
            Contender(
                "cloudckpt",
                cloudckpt,
                cloudckpt=True,
                note="load_state from the store (an empty staging directory): every byte "
                "verified; first_step = that, copied into the model, one step",
            ),
            Contender(
                "cloudckpt into the model",
                cloudckpt_in_place,
                cloudckpt=True,
                note="load_state(into=the model's state) from the store: every byte "
                "verified, landed in the model's own tensors as DCP's load does (no copy "
                "after); first_step = that and one step",
            ),
            Contender(
                s3_name,
                dlio_s3,
                note="DLIO's load_state on S3: torch.load from S3Checkpoint.reader, a thread "
                "per rank; nothing verified",
            ),
            Contender(
                dcp_name,
                dcp_load,
                note="dcp.load with s3torchconnector's S3StorageReader straight into the "
                "model's tensors (no copy after); nothing verified",
            ),
            Contender(
                local_name,
                dlio_file,
                drop_file_cache,
                note="DLIO's load_state: torch.load of the local files (evicted from the "
                "page cache before each round), a thread per rank; nothing verified",
            ),
        ],
        comparisons=[
            *(Comparison("s", n, None, label="restore") for n in (s3_name, dcp_name, local_name)),
            *(
                Comparison("first_step", n, None, label="time to first step")
                for n in (s3_name, dcp_name, local_name)
            ),
            *(
                Comparison(
                    "first_step",
                    n,
                    None,
                    cloudckpt="cloudckpt into the model",
                    label="time to first step, in place",
                )
                for n in (s3_name, dcp_name, local_name)
            ),
        ],
        servers={"server": s3.pid},
        info=_info(w, s3, signing),
    )
    try:
        bench.run(group)
    finally:
        reader.close()
        peers.close()
        s3.drop("dlio-")
        _rm(disk)
        state.clear()
        fs.model.clear()
