"""``load_state(into=...)`` / ``resume_state(into=...)``: a checkpoint loaded into the
caller's own tensors, in place (DCP's ``load(state_dict)``), every byte verified; a
checkpoint that does not fit is refused before any byte is written; a damaged newest
checkpoint is overwritten by the older one loaded instead.

Against the in-memory store, a real staging directory (the same-host local copy), moto
(a real S3 server over HTTP) and a restored directory. The GPU path's staging is run on
the CPU with the device ops replaced; ``-m cuda`` runs it on a real GPU.
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from torch_states import tied_state  # noqa: E402

from cloudckpt import CheckpointManager  # noqa: E402
from cloudckpt.committer import read_latest  # noqa: E402
from cloudckpt.errors import ConfigurationError, CorruptionError  # noqa: E402
from cloudckpt.integrations import _torch_restore as tr  # noqa: E402
from cloudckpt.integrations.torch import (  # noqa: E402
    LoadReport,
    load_state,
    resume_state,
    save_state,
)
from cloudckpt.reader import fetch_manifest  # noqa: E402
from cloudckpt.stores import open_store  # noqa: E402
from cloudckpt.testing.faults import flip_bit  # noqa: E402

MiB = 1024 * 1024
SENTINEL = 7


def _state(seed: int) -> dict:
    """Big tensors (chunks of their own), small packed ones, a bf16, a tie, a 0-d and an
    empty tensor, plain values."""
    return tied_state(seed)


def _dest(**changes) -> dict:
    """What a restarted job holds: the same structure, built and touched (every byte
    ``SENTINEL``), tied as the model ties. ``changes`` replaces entries of the model."""
    model = collections.OrderedDict(
        w=torch.full((700, 1024), float(SENTINEL)),
        emb=torch.full((2100, 1000), float(SENTINEL), dtype=torch.bfloat16),
        b=torch.full((7,), SENTINEL, dtype=torch.int64),
        mask=torch.ones(3, dtype=torch.bool),
        scalar=torch.tensor(float(SENTINEL)),
        empty=torch.zeros(0, 3),
    )
    model["tied"] = model["w"]
    model.move_to_end("tied", last=False)
    model.move_to_end("w", last=False)  # w, tied, emb, ...: the saved order
    for k, v in changes.items():
        if v is None:
            del model[k]
        else:
            model[k] = v
    return {"model": model, "step": -1}


def _ptrs(dest: dict) -> dict:
    return {k: (v, v.data_ptr()) for k, v in dest["model"].items()}


def _filled_in_place(got: dict, dest: dict, ptrs: dict, expected: dict) -> None:
    """``got`` holds ``dest``'s tensor objects, at their memory, with ``expected``'s
    values; the tie is kept; plain values come from the checkpoint."""
    for k, (t, ptr) in ptrs.items():
        assert got["model"][k] is t, k
        assert t.data_ptr() == ptr, k
        assert torch.equal(t, expected["model"][k]), k
        assert t.dtype == expected["model"][k].dtype, k
    assert got["model"]["tied"] is got["model"]["w"]
    assert got["step"] == expected["step"] and dest["step"] == -1  # into's dict untouched


def _untouched(dest: dict) -> bool:
    return all(
        t.numel() == 0 or bool((t == SENTINEL).all()) or t.dtype == torch.bool
        for t in dest["model"].values()
    ) and bool(dest["model"]["mask"].all())


def _two_checkpoints(target, manager_factory, chunking="tensor", **kwargs):
    mgr = manager_factory(target, chunking=chunking, **kwargs)
    for step in (1, 2):
        save_state(mgr, step, _state(step)).result(timeout=60)
    return mgr


def _tensors_key(store, record) -> str:
    entry = next(f for f in fetch_manifest(store, record).files if f.path == "tensors.safetensors")
    if entry.chunks is None:
        return record.ckpt + "files/" + entry.path
    return [c for c in entry.chunks if c.owner == record.ckpt][-1].key


# ------------------------------------------------------------------------------ in place


@pytest.mark.parametrize("chunking", ["tensor", "off"])
def test_load_state_fills_the_callers_tensors_in_place(memory_target, manager_factory, chunking):
    mgr = _two_checkpoints(memory_target, manager_factory, chunking, keep_local=0)
    dest = _dest()
    ptrs = _ptrs(dest)
    report = LoadReport()
    got = load_state(mgr, into=dest, report=report)
    _filled_in_place(got, dest, ptrs, _state(2))
    assert report.step == 2 and report.bytes_downloaded >= report.total_bytes
    if chunking == "tensor":  # a chunk per big tensor: each lands straight in the caller's
        assert report.bytes_scratch < 1024


def test_a_state_dicts_tensors_are_the_parameters(memory_target, manager_factory):
    """into=model.state_dict(): the model holds the checkpoint, no load_state_dict."""
    mgr = manager_factory(memory_target)
    saved = torch.nn.Linear(64, 32)
    save_state(mgr, 1, {"model": saved.state_dict()}).result(timeout=60)
    model = torch.nn.Linear(64, 32)
    weight = model.weight
    load_state(mgr, into={"model": model.state_dict()})
    assert model.weight is weight
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)
    # Parameters themselves (requires_grad leaves) may be passed too.
    model2 = torch.nn.Linear(64, 32)
    got = load_state(mgr, into={"model": dict(model2.named_parameters())})
    assert got["model"]["weight"] is model2.weight and torch.equal(model2.weight, saved.weight)


def test_a_new_host_fills_in_place_from_s3(s3_target, manager_factory):
    _two_checkpoints(s3_target, manager_factory)
    dest = _dest()
    ptrs = _ptrs(dest)
    report = LoadReport()
    got = load_state(
        s3_target.url, into=dest, storage_options=s3_target.storage_options, report=report
    )
    _filled_in_place(got, dest, ptrs, _state(2))
    assert report.source == "store" and report.bytes_downloaded >= report.total_bytes


def test_resume_state_fills_in_place_from_the_local_copy(memory_target, tmp_path):
    """The same-host restart: the verified local copy in staging_dir, zero bytes
    downloaded, landed in the caller's tensors."""
    staging = tmp_path / "staging"
    first = CheckpointManager(memory_target.url, staging_dir=staging)
    for step in (1, 2):
        save_state(first, step, _state(step)).result(timeout=60)
    first.close()
    again = CheckpointManager(memory_target.url, staging_dir=staging)
    dest = _dest()
    ptrs = _ptrs(dest)
    report = LoadReport()
    got = resume_state(again, into=dest, report=report)
    _filled_in_place(got, dest, ptrs, _state(2))
    assert report.source == "local" and report.bytes_downloaded == 0
    assert read_latest(again.store).latest.writer.id == again.writer_id  # it claimed
    again.close()


def test_resume_state_of_an_empty_run_leaves_into_alone(memory_target, manager_factory):
    mgr = manager_factory(memory_target)
    dest = _dest()
    assert resume_state(mgr, into=dest) is None
    assert _untouched(dest)


def test_a_restored_directory_fills_in_place(memory_target, manager_factory, tmp_path):
    mgr = _two_checkpoints(memory_target, manager_factory)
    restored = mgr.restore(tmp_path / "r")
    dest = _dest()
    ptrs = _ptrs(dest)
    got = load_state(restored, into=dest)
    _filled_in_place(got, dest, ptrs, _state(2))
    with pytest.raises(ConfigurationError, match="'model/b'"):
        load_state(restored, into=_dest(b=torch.zeros(8, dtype=torch.int64)))


def test_a_non_contiguous_tensor_is_filled_once_verified(memory_target, manager_factory):
    """A layout the bytes cannot land in (a transposed view, channels_last) gets them
    through a new tensor, copied in after the checkpoint verified."""
    mgr = _two_checkpoints(memory_target, manager_factory)
    base = torch.full((1024, 700), float(SENTINEL))
    w = base.t()
    assert not w.is_contiguous()
    dest = _dest(w=w, tied=w)
    ptrs = _ptrs(dest)
    got = load_state(mgr, into=dest)
    _filled_in_place(got, dest, ptrs, _state(2))
    assert torch.equal(base.t(), _state(2)["model"]["w"])


def test_the_gpu_path_copies_into_the_callers_tensors_from_staging(
    memory_target, manager_factory, monkeypatch
):
    """CUDA destinations go through pinned staging and the copy stream (the device ops,
    replaced here so it runs on the CPU): only the bf16 tensor is "on the device", the
    others land straight from the store (mixed devices are handled)."""
    mgr = _two_checkpoints(memory_target, manager_factory, keep_local=0)
    copied: list[int] = []

    class Ops:
        device = torch.device("cpu")

        def empty(self, shape, dtype):
            raise AssertionError("into's tensors are not reallocated")

        def staging(self, nbytes):
            return torch.empty(nbytes, dtype=torch.uint8)

        def copy(self, dst, src):
            dst.copy_(src)
            copied.append(len(src))
            return lambda: None

        def finish(self):
            pass

    monkeypatch.setattr(tr, "via_device", lambda t: t.dtype == torch.bfloat16)
    monkeypatch.setattr(tr, "device_ops", lambda device: Ops())
    dest = _dest()
    ptrs = _ptrs(dest)
    got = load_state(mgr, into=dest)
    _filled_in_place(got, dest, ptrs, _state(2))
    assert sum(copied) == dest["model"]["emb"].numel() * 2  # every bf16 byte, no other


# ------------------------------------------------------------------------------ refusals


def test_a_shape_mismatch_raises_before_any_byte_is_written(memory_target, manager_factory):
    mgr = _two_checkpoints(memory_target, manager_factory)
    dest = _dest(w=torch.full((700, 1000), float(SENTINEL)), tied=None)
    dest["model"]["tied"] = dest["model"]["w"]
    with pytest.raises(ConfigurationError, match=r"'model/w' is float32\[700, 1000\]") as err:
        load_state(mgr, into=dest)
    assert "float32[700, 1024]" in str(err.value) and "nothing was written" in str(err.value)
    assert _untouched(dest)


def test_a_dtype_mismatch_raises_before_any_byte_is_written(memory_target, manager_factory):
    mgr = _two_checkpoints(memory_target, manager_factory)
    dest = _dest(emb=torch.full((2100, 1000), float(SENTINEL)))  # float32, saved bf16
    with pytest.raises(ConfigurationError, match=r"'model/emb' is float32.*bfloat16"):
        load_state(mgr, into=dest)
    assert _untouched(dest)


def test_names_the_checkpoint_has_and_into_lacks(memory_target, manager_factory):
    mgr = _two_checkpoints(memory_target, manager_factory)
    dest = _dest(b=None)
    with pytest.raises(ConfigurationError, match=r"holds 1 tensor.*into lacks: 'model/b'"):
        load_state(mgr, into=dest)
    assert _untouched(dest)
    # strict=False: the checkpoint's other tensors come back new.
    ptrs = _ptrs(dest)
    got = load_state(mgr, into=dest, strict=False)
    _filled_in_place(got, dest, ptrs, _state(2))
    assert torch.equal(got["model"]["b"], _state(2)["model"]["b"])


def test_names_into_has_and_the_checkpoint_lacks(memory_target, manager_factory):
    """Every tensor of into is filled or the call raises: strict=False does not relax it."""
    mgr = _two_checkpoints(memory_target, manager_factory)
    dest = _dest(extra=torch.full((3,), float(SENTINEL)))
    for strict in (True, False):
        with pytest.raises(ConfigurationError, match=r"into holds 1 tensor.*lacks: 'model/extra'"):
            load_state(mgr, into=dest, strict=strict)
        assert _untouched(dest)
    # An untied into against a tied checkpoint: the tie's second entry is extra.
    untied = _dest(tied=torch.full((700, 1024), float(SENTINEL)))
    with pytest.raises(ConfigurationError, match="'model/tied'"):
        load_state(mgr, into=untied)


def test_tensors_sharing_memory_are_refused(memory_target, manager_factory):
    mgr = manager_factory(memory_target)
    save_state(mgr, 1, {"a": torch.randn(10), "b": torch.randn(10)}).result(timeout=60)
    base = torch.zeros(15)
    with pytest.raises(ConfigurationError, match="'a' and 'b' share memory"):
        load_state(mgr, into={"a": base[:10], "b": base[5:]})
    assert not base.any()


def test_a_module_or_a_state_without_tensors_is_refused(memory_target, manager_factory):
    mgr = manager_factory(memory_target)
    save_state(mgr, 1, {"model": torch.nn.Linear(4, 2).state_dict()}).result(timeout=60)
    with pytest.raises(ConfigurationError, match="into is a module") as err:
        load_state(mgr, into=torch.nn.Linear(4, 2))
    assert "model.state_dict()" in str(err.value)
    with pytest.raises(ConfigurationError, match="holds no tensor"):
        resume_state(mgr, into={"step": 1})


def test_a_meta_tensor_cannot_be_filled(memory_target, manager_factory):
    mgr = _two_checkpoints(memory_target, manager_factory)
    dest = _dest(b=torch.empty(7, dtype=torch.int64, device="meta"))
    with pytest.raises(ConfigurationError, match="cannot be filled in place at 'model/b'"):
        load_state(mgr, into=dest)


# ------------------------------------------------------------------------------ damage


def test_a_damaged_newest_checkpoint_is_overwritten_by_the_older_one(
    memory_target, manager_factory, monkeypatch
):
    mgr = _two_checkpoints(memory_target, manager_factory, keep_local=0)
    current = read_latest(mgr.store).latest.current
    flip_bit(mgr.store, _tensors_key(mgr.store, current), seed=3)  # a chunk of model/w
    dest = _dest()
    ptrs = _ptrs(dest)
    after_attempt: dict[int, bool] = {}
    real = tr._Loader.try_one

    def watched(self, record):
        out = real(self, record)
        after_attempt[record.step] = torch.equal(
            dest["model"]["emb"], _state(record.step)["model"]["emb"]
        )
        return out

    monkeypatch.setattr(tr._Loader, "try_one", watched)
    report = LoadReport()
    got = load_state(mgr, into=dest, report=report)
    # Step 2's intact bytes had landed in the caller's tensors; step 1 overwrote them.
    assert after_attempt == {2: True, 1: True}
    _filled_in_place(got, dest, ptrs, _state(1))
    assert report.step == 1 and [s.step for s in report.skipped] == [2]


def test_a_fallback_that_does_not_fit_says_the_tensors_are_undefined(
    memory_target, manager_factory
):
    # Step 1 was saved before the model grew; step 2 fits and is damaged: its bytes land,
    # the damage is found, and the refusal of step 1 must not claim nothing was written.
    mgr = manager_factory(memory_target, chunking="tensor", keep_local=0)
    small = _state(1)
    small["model"]["b"] = torch.arange(5, dtype=torch.int64)
    save_state(mgr, 1, small).result(timeout=60)
    save_state(mgr, 2, _state(2)).result(timeout=60)
    current = read_latest(mgr.store).latest.current
    flip_bit(mgr.store, _tensors_key(mgr.store, current), seed=3)
    with pytest.raises(ConfigurationError) as err:
        load_state(mgr, into=_dest())
    message = str(err.value)
    assert "'model/b'" in message and "step 1" in message
    assert "step 2 (found damaged) had already landed" in message
    assert "nothing was written" not in message
    # Without a damaged newer one, the same refusal says nothing was written.
    with pytest.raises(ConfigurationError, match="nothing was written"):
        load_state(mgr, step=1, into=_dest())


def test_a_tensor_saved_as_an_object_is_refused_under_strict(memory_target, manager_factory):
    # complex128 is not a safetensors dtype: save_state pickles it, so it cannot be filled
    # in place; strict=True must not leave the caller's tensor silently stale.
    from cloudckpt.integrations._torch_format import _ST_DTYPES

    assert torch.complex128 not in _ST_DTYPES  # else it would be a safetensors tensor
    mgr = manager_factory(memory_target, chunking="tensor", keep_local=0)
    state = _state(1)
    state["model"]["phase"] = torch.full((4,), 1 + 2j, dtype=torch.complex128)
    save_state(mgr, 1, state).result(timeout=60)
    dest = _dest(phase=torch.zeros(4, dtype=torch.complex128))
    with pytest.raises(ConfigurationError, match="cannot be filled in place at 'model/phase'"):
        load_state(mgr, into=dest)
    assert not dest["model"]["phase"].any() and bool((dest["model"]["w"] == SENTINEL).all())
    got = load_state(mgr, into=dest, strict=False)
    assert torch.equal(got["model"]["phase"], state["model"]["phase"])
    assert torch.equal(dest["model"]["w"], state["model"]["w"])


def test_every_checkpoint_damaged_raises(s3_target, manager_factory):
    _two_checkpoints(s3_target, manager_factory)
    store = open_store(s3_target.url, s3_target.storage_options)
    for record in read_latest(store).latest.retained():
        flip_bit(store, _tensors_key(store, record))
    with pytest.raises(CorruptionError) as err:
        load_state(store, into=_dest())  # into's contents are undefined now
    assert [s.step for s in err.value.skipped] == [2, 1]
    store.close()


# ------------------------------------------------------------------------------ a real GPU


@pytest.mark.cuda
def test_load_into_cuda_tensors_in_place(memory_target, manager_factory):
    """Runs where CUDA is present (``pytest -m cuda``); CI deselects it (pyproject)."""
    assert torch.cuda.is_available(), "run the cuda-marked tests on a machine with a GPU"
    mgr = _two_checkpoints(memory_target, manager_factory, keep_local=0)
    dest = _dest()
    dest["model"] = collections.OrderedDict(
        (k, v.cuda() if k != "tied" else None) for k, v in dest["model"].items()
    )
    dest["model"]["tied"] = dest["model"]["w"]
    dest["model"]["mask"] = dest["model"]["mask"].cpu()  # mixed: one tensor on the CPU
    ptrs = _ptrs(dest)
    report = LoadReport()
    got = load_state(mgr, into=dest, report=report)
    torch.cuda.synchronize()
    assert report.device.startswith("cuda")
    expected = _state(2)
    for k, (t, ptr) in ptrs.items():
        assert got["model"][k] is t and t.data_ptr() == ptr, k
        assert torch.equal(t.cpu(), expected["model"][k]), k
    # A non-contiguous CUDA tensor goes through a new device tensor.
    w = torch.zeros(1024, 700, device="cuda").t()
    got = load_state(mgr, into=_dest_on_cuda_with(dest, w=w, tied=w))
    assert torch.equal(w.cpu(), expected["model"]["w"])
    if torch.cuda.device_count() > 1:  # two CUDA devices in one load: refused
        other = _dest_on_cuda_with(dest, b=dest["model"]["b"].to("cuda:1"))
        with pytest.raises(ConfigurationError, match="on 2 devices"):
            load_state(mgr, into=other)


@pytest.mark.cuda
def test_load_into_cuda_tensors_waits_for_work_queued_on_them(memory_target, manager_factory):
    """The copies must not overtake kernels the caller queued on its stream before the
    load (a model's init writing the same tensors)."""
    assert torch.cuda.is_available(), "run the cuda-marked tests on a machine with a GPU"
    mgr = _two_checkpoints(memory_target, manager_factory, keep_local=0)
    dest = _dest_on_cuda_with(
        {"model": {k: v.cuda() for k, v in _dest()["model"].items() if k != "tied"}}
    )
    dest["model"]["tied"] = dest["model"]["w"]
    torch.cuda._sleep(1_000_000_000)  # ~0.5-1 s of GPU time on the current stream
    for t in dest["model"].values():
        t.zero_()  # queued behind the sleep: "init" that must run before the load
    load_state(mgr, into=dest)
    torch.cuda.synchronize()
    assert torch.equal(dest["model"]["w"].cpu(), _state(2)["model"]["w"])


def _dest_on_cuda_with(dest: dict, **changes) -> dict:
    model = collections.OrderedDict(dest["model"])
    model.update(changes)
    return {"model": model, "step": -1}
