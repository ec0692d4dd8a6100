"""The pure protocol: canonical records, self-checks, retention, hostile manifests."""

from __future__ import annotations

import datetime as dt
import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloudckpt import attempt_layout, canonical, digest, manifests, protocol
from cloudckpt.errors import ConfigurationError, UnsafePathError
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import CorruptRecordError, Settings

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)


def _record(step: int, epoch: int = 1) -> protocol.CheckpointRecord:
    attempt = f"20300101T000000000Z-{step:08x}"
    m = Manifest(
        ckpt=attempt_layout.ckpt_prefix(step, epoch, attempt),
        step=step,
        epoch=epoch,
        commit_id=attempt,
        writer_id="w",
        created_at="t",
        files=(FileEntry("model.bin", 3, digest.tree_digest(b"abc")),),
    )
    return m.record(m.to_bytes(), NOW)


KEEP_TWO = Settings(keep_last=2)


def _run(steps, settings=KEEP_TWO):
    latest = protocol.initial(protocol.Writer(1, "w", "t"), settings, NOW)
    for s in steps:
        latest = protocol.commit(latest, _record(s), settings, NOW)
    return latest


def test_latest_round_trips_and_every_body_is_unique():
    latest = _run([1, 2, 3])
    again = protocol.parse_latest(latest.to_bytes())
    assert again == latest
    # Same logical change twice gives different bytes (S3 ETags are content hashes).
    a = protocol.commit(latest, _record(4), latest.settings, NOW).to_bytes()
    b = protocol.commit(latest, _record(4), latest.settings, NOW).to_bytes()
    assert a != b


def test_every_single_bit_flip_of_latest_is_detected():
    body = _run([1, 2]).to_bytes()
    for bit in range(len(body) * 8):
        damaged = bytearray(body)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptRecordError):
            protocol.parse_latest(bytes(damaged))


def test_every_single_bit_flip_of_a_manifest_is_detected():
    m = Manifest(
        ckpt=attempt_layout.ckpt_prefix(5, 1, "20300101T000000000Z-00000005"),
        step=5,
        epoch=1,
        commit_id="20300101T000000000Z-00000005",
        writer_id="w",
        created_at="t",
        files=(FileEntry("a/b.bin", 10, "0" * 64),),
    )
    data = m.to_bytes()
    record = m.record(data, NOW)
    assert manifests.parse_manifest(data, record) == m
    for bit in range(len(data) * 8):
        damaged = bytearray(data)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptRecordError):
            manifests.parse_manifest(bytes(damaged), record)


def test_seq_chain_and_epochs():
    latest = _run([1])
    claimed = protocol.claim(latest, "w2", latest.settings, NOW)
    assert claimed.seq == latest.seq + 1 and claimed.parent_seq == latest.seq
    assert claimed.writer.epoch == latest.writer.epoch + 1
    assert claimed.current == latest.current


def test_keep_last_moves_the_rest_to_tombstones():
    latest = _run([1, 2, 3, 4], Settings(keep_last=2))
    assert [r.step for r in latest.retained()] == [4, 3]
    assert [t.record.step for t in latest.tombstones] == [1, 2]
    assert all(t.state == "pending" for t in latest.tombstones)


def test_keep_every_and_pins_survive_retention():
    settings = Settings(keep_last=1, keep_every=10)
    latest = protocol.initial(protocol.Writer(1, "w", "t"), settings, NOW)
    for s in (5, 10, 15):
        latest = protocol.commit(latest, _record(s), settings, NOW)
    latest = protocol.pin(latest, latest.current.commit_id, "best", NOW)  # step 15
    for s in (20, 25):
        latest = protocol.commit(latest, _record(s), settings, NOW)
    assert [r.step for r in latest.retained()] == [25, 20, 15, 10]
    assert sorted(t.record.step for t in latest.tombstones) == [5]
    pinned = latest.pins[0].commit_id
    latest = protocol.unpin(latest, pinned, NOW)
    assert [r.step for r in latest.retained()] == [25, 20, 10]
    assert sorted(t.record.step for t in latest.tombstones) == [5, 15]


def test_keep_last_none_keeps_everything():
    latest = _run(range(10), Settings(keep_last=None))
    assert len(latest.retained()) == 10 and not latest.tombstones


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "../evil", "a/../../evil", "a/./b", "a//b", "C:/x", "a\\b", "x\x00y", "", "."],
)
def test_hostile_paths_are_refused(path):
    with pytest.raises(UnsafePathError):
        manifests.safe_relpath(path)


def test_file_and_directory_of_the_same_name_is_refused():
    entries = [FileEntry("a", 1, "0" * 64), FileEntry("a/b", 1, "0" * 64)]
    with pytest.raises(UnsafePathError):
        manifests.validate_file_entries(entries)


def test_manifest_must_match_its_record():
    m = _record(1)
    other = _record(2)
    data = Manifest(
        ckpt=other.ckpt,
        step=2,
        epoch=1,
        commit_id=other.commit_id,
        writer_id="w",
        created_at="t",
        files=(),
    ).to_bytes()
    with pytest.raises(CorruptRecordError):
        manifests.parse_manifest(data, m)


def test_oversized_or_wrong_typed_fields_are_corrupt():
    body = json.loads(_run([1]).to_bytes())
    body["current"]["manifest_size"] = "12"
    del body["self_sha256"]
    sealed = canonical.seal(body)
    with pytest.raises(CorruptRecordError):
        protocol.parse_latest(sealed)


def test_metadata_must_be_json():
    with pytest.raises(ConfigurationError):
        canonical.canonical_json({"x": float("nan")})
    with pytest.raises(ConfigurationError):
        canonical.canonical_json({"x": object()})


@given(st.binary(max_size=3 * 64), st.sampled_from([16, 64, 100]))
def test_tree_digest_is_chunk_parallel(data, chunk):
    # Hashing parts independently (aligned to chunks) gives the same digest as one pass.
    whole = digest.tree_digest(data, chunk)
    leaves = []
    for start in range(0, len(data), chunk * 2):
        leaves += digest.leaves_of(data[start : start + chunk * 2], chunk)
    assert digest.root(leaves, len(data), chunk) == whole
    if data:
        damaged = bytearray(data)
        damaged[0] ^= 1
        assert digest.tree_digest(bytes(damaged), chunk) != whole


def test_tree_digest_binds_size_and_chunking():
    assert digest.tree_digest(b"") != digest.tree_digest(b"\x00")
    assert digest.tree_digest(b"ab", 1) != digest.tree_digest(b"ab", 2)
    assert len(digest.tree_digest(b"x")) == 64
    assert digest.tree_digest(b"x") != hashlib.sha256(b"x").hexdigest()
