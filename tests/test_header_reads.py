"""``load_state`` judges a checkpoint only by verified bytes (issue 28, item 6).

Its first read of the safetensors header (a local read of the kept copy, or one ranged
GET) is a guess: a damaged local copy is not a damaged checkpoint, and a garbled response
is not a damaged object. Before the newest checkpoint counts as damaged, its header is
read again from the store and verified against the manifest.
"""

from __future__ import annotations

import collections
import json
import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from cloudckpt import CheckpointManager  # noqa: E402
from cloudckpt.committer import read_latest  # noqa: E402
from cloudckpt.integrations.torch import LoadReport, load_state, resume_state, save_state  # noqa: E402
from cloudckpt.localcopy import COMMITTED_DIR  # noqa: E402
from cloudckpt.reader import fetch_manifest  # noqa: E402
from cloudckpt.testing.faults import Fault, FaultInjectingStore, Rule, flip_bit  # noqa: E402

TENSORS = "tensors.safetensors"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": collections.OrderedDict(
            w=torch.randn(700, 1024, generator=g),  # 2.7 MiB
            b=torch.arange(7, dtype=torch.int64) + seed,
        ),
        "step": seed,
    }


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(
        torch.equal(a["model"][k], b["model"][k]) for k in b["model"]
    )


def _damage_header(data: bytes, how: str) -> bytes:
    """``data`` (a safetensors file) with its header damaged ``how``."""
    (n,) = struct.unpack("<Q", data[:8])
    if how == "length":  # an impossible header length
        return struct.pack("<Q", n + (1 << 40)) + data[8:]
    if how == "json":  # a header that does not parse
        return data[:8] + b"[" + data[9:]
    # A sane header that is not the file's: its metadata changed, its length kept.
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = {"format": "xx"}
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    return data[:8] + new.ljust(n) + data[8 + n :]


@pytest.mark.parametrize("how", ["length", "json", "other-header"])
def test_a_damaged_header_in_the_local_copy_is_read_from_the_store(memory_target, tmp_path, how):
    """On main the newest checkpoint counted as damaged: step 1 came back, and with a
    single checkpoint the resume failed."""
    staging = tmp_path / "staging"
    first = CheckpointManager(memory_target.url, staging_dir=staging)
    for step in (1, 2):
        save_state(first, step, _state(step)).result(timeout=60)
    first.close()
    (copy,) = (staging / COMMITTED_DIR).iterdir()
    kept = copy / "files" / TENSORS
    kept.write_bytes(_damage_header(kept.read_bytes(), how))

    again = CheckpointManager(memory_target.url, staging_dir=staging)
    report = LoadReport()
    state = resume_state(again, weights_only=False, report=report)
    assert _same(state, _state(2))
    assert report.step == 2 and report.skipped == ()
    assert report.bytes_local > 0 and report.bytes_downloaded > 0  # the rest stayed local
    again.close()


class _Garbled(Fault):
    """The response arrives with its header damaged ``how`` (a bad proxy)."""

    name = "garble"

    def __init__(self, how: str) -> None:
        self.how = how

    def run(self, call, op, key, store):
        data = bytes(call())
        return _damage_header(data, self.how) if len(data) >= 8 else data


@pytest.mark.parametrize("chunking", ["tensor", "off"])
@pytest.mark.parametrize("how", ["length", "json"])
def test_a_garbled_header_response_is_read_again_before_judging(
    memory_target, manager_factory, chunking, how
):
    """On main one garbled reply to the header probe made the newest checkpoint count as
    damaged (step 1 loaded)."""
    mgr = manager_factory(memory_target, chunking=chunking)
    for step in (1, 2):
        save_state(mgr, step, _state(step)).result(timeout=60)
    current = read_latest(mgr.store).latest.current
    entry = next(f for f in fetch_manifest(mgr.store, current).files if f.path == TENSORS)
    key = entry.chunks[0].key if entry.chunks else current.ckpt + "files/" + TENSORS
    faulty = FaultInjectingStore(mgr.store)
    rule = faulty.add(Rule(_Garbled(how), ops={"get_range"}, key=key, times=1))
    report = LoadReport()
    state = load_state(faulty, weights_only=False, report=report)
    assert rule.fired == 1  # the probe was garbled
    assert _same(state, _state(2)) and report.step == 2 and report.skipped == ()


def test_a_header_damaged_in_the_store_still_falls_back(memory_target, manager_factory):
    """The verified read decides: a header damaged in the store is damage."""
    mgr = manager_factory(memory_target, chunking="off")
    for step in (1, 2):
        save_state(mgr, step, _state(step)).result(timeout=60)
    current = read_latest(mgr.store).latest.current
    flip_bit(mgr.store, current.ckpt + "files/" + TENSORS, bit=8 * 5)  # an impossible length
    report = LoadReport()
    state = load_state(mgr.store, weights_only=False, report=report)
    assert _same(state, _state(1)) and [s.step for s in report.skipped] == [2]
