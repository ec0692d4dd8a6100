"""A resumed save names an interrupted attempt's chunk only once its content checks (issue
28 item 2): a listing shows a name and a size, not the bytes. A chunk with the right name
and size but other bytes is uploaded again, the save restores exactly, and with
``keep_last=1`` nothing in the run is lost. On S3 (moto, SeaweedFS) the check is the CRC32C
S3 recorded at the put, on GCS the one it keeps; elsewhere (Azure included: its Content-MD5
is a claim, not a checksum) the chunk is read back and hashed."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from cloudckpt import CheckpointManager, attempt_layout, manifests, protocol
from cloudckpt.catalog import copy_checkpoint
from cloudckpt.failpoints import SimulatedCrash, arm, disarm
from cloudckpt.stores import OVERWRITE, crc32c_b64, open_store
from cloudckpt.verify import verify_run

MiB = 1024 * 1024


def _source(tmp_path: Path, name: str, seed: int) -> Path:
    src = tmp_path / name
    src.mkdir()
    (src / "weights.bin").write_bytes(random.Random(seed).randbytes(2 * 8 * MiB + 5))
    (src / "config.json").write_bytes(b'{"layers": %d}' % seed)
    return src


def _manager(target, tmp_path: Path, name: str) -> CheckpointManager:
    return CheckpointManager(
        target.url,
        storage_options=target.storage_options,
        staging_dir=tmp_path / name,
        auto_gc=False,
        keep_last=1,
    )


def _poison_interrupted_chunk(store, prefix: str) -> str:
    """Overwrite the first chunk of the attempt at ``prefix`` with other bytes of the same
    size (the name and size a listing shows stay right). Returns its key."""
    chunk = next(o for o in store.list(prefix + attempt_layout.CHUNKS_DIR) if o.size > 1000)
    data, _ = store.get(chunk.key)
    store.put(chunk.key, bytes(b ^ 0xFF for b in data), mode=OVERWRITE)
    return chunk.key


@pytest.fixture(params=["memory", "seaweedfs", "moto", "gcs"])
def target(request):
    name = {
        "memory": "memory_target",
        "seaweedfs": "seaweedfs_target",
        "moto": "s3_target",
        "gcs": "gcs_target",
    }
    return request.getfixturevalue(name[request.param])


def test_a_resumed_push_never_names_a_chunk_whose_bytes_differ(target, tmp_path):
    store, bad = _resumed_push(target, tmp_path, _poison_interrupted_chunk)
    if target.backend != "memory":  # the cheap check: S3 and GCS keep the object's CRC32C
        assert store.stored_crc32c(bad) == crc32c_b64(store.get(bad)[0])


def test_on_azure_a_resumed_chunk_is_read_back_its_content_md5_being_only_a_claim(
    azurite_server, azurite_target, tmp_path
):
    """Azure keeps no whole-blob checksum the service vouches for: a block blob's
    Content-MD5 is what Put Block List's ``x-ms-blob-content-md5`` (or Set Blob
    Properties) said, unchecked (docs/design.md §11). Here an interrupted attempt's chunk
    holds other bytes under a Content-MD5 of the right ones: it is still uploaded again."""
    from azure.storage.blob import BlobBlock, ContentSettings

    container = azurite_server.service_client().get_container_client(
        azurite_target.url.split("/")[2]
    )

    def poison(store, prefix: str) -> str:
        chunk = next(o for o in store.list(prefix + attempt_layout.CHUNKS_DIR) if o.size > 1000)
        right = store.get(chunk.key)[0]
        md5 = hashlib.md5(right).digest()
        blob = container.get_blob_client("run/" + chunk.key)
        blob.stage_block("other", bytes(b ^ 0xFF for b in right))
        blob.commit_block_list(
            [BlobBlock(block_id="other")], content_settings=ContentSettings(content_md5=md5)
        )
        claimed = blob.get_blob_properties().content_settings.content_md5
        assert bytes(claimed) == md5 and store.get(chunk.key)[0] != right  # a false claim
        return chunk.key

    store, bad = _resumed_push(azurite_target, tmp_path, poison)
    assert store.stored_crc32c(bad) is None  # nothing to compare: it was read back


def _resumed_push(target, tmp_path, poison):
    """Step 6 saved; step 7 uploaded but never committed; ``poison(store, prefix)`` gives
    one of its chunks other bytes (returns its key); step 7 saved again resumes. Checks the
    poisoned chunk was not named and everything restores; returns (store, its key)."""
    store = open_store(target.url, target.storage_options)
    good = _source(tmp_path, "good", seed=1)
    first = _manager(target, tmp_path, "first")
    first.save_dir(6, good).result(timeout=120)
    first.close()

    # Step 7's upload finished, its commit never came (a push stopped with Ctrl-C).
    src = _source(tmp_path, "src", seed=2)
    crashing = _manager(target, tmp_path, "crashing")
    arm("save.after_upload")  # SimulatedCrash: the process dies there
    try:
        with pytest.raises(SimulatedCrash):
            crashing.save_dir(7, src).result(timeout=120)
    finally:
        disarm()
    [interrupted] = [
        p for p in store.list_dirs(attempt_layout.CKPT_PREFIX) if p.startswith(f"{7:012d}-")
    ]
    bad = poison(store, attempt_layout.CKPT_PREFIX + interrupted)

    again = _manager(target, tmp_path, "again")
    info = again.save_dir(7, src).result(timeout=120)
    assert info.bytes_resumed and info.bytes_uploaded  # the rest resumed, the bad one sent
    again.close()
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    manifest = manifests.parse_manifest(store.get(latest.current.manifest_key)[0])
    assert bad not in {c.key for f in manifest.files for c in f.chunks or ()}
    assert [r.step for r in latest.retained()] == [7]  # keep_last=1: step 6 dropped

    reader = _manager(target, tmp_path, "reader")
    restored = reader.restore(tmp_path / "out")
    assert restored.step == 7 and restored.skipped == ()
    for name in ("weights.bin", "config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()
    assert verify_run(store, all=True, read_data=True).ok
    reader.close()
    return store, bad


def test_a_resumed_copy_never_names_a_chunk_whose_bytes_differ(memory_target, tmp_path):
    src_url = memory_target.url
    dst_url = src_url.rsplit("/", 1)[0] + "/copy"
    src = _source(tmp_path, "src", seed=3)
    mgr = CheckpointManager(src_url, staging_dir=tmp_path / "s", auto_gc=False)
    mgr.save_dir(3, src).result(timeout=120)
    mgr.close()
    arm("save.after_upload")
    try:
        with pytest.raises(SimulatedCrash):
            copy_checkpoint(src_url, dst_url)
    finally:
        disarm()
    dst = open_store(dst_url)
    [interrupted] = list(dst.list_dirs(attempt_layout.CKPT_PREFIX))
    bad = _poison_interrupted_chunk(dst, attempt_layout.CKPT_PREFIX + interrupted)

    result = copy_checkpoint(src_url, dst_url)
    assert result.bytes_resumed and result.bytes_uploaded
    latest = protocol.parse_latest(dst.get(protocol.LATEST_KEY)[0])
    manifest = manifests.parse_manifest(dst.get(latest.current.manifest_key)[0])
    assert bad not in {c.key for f in manifest.files for c in f.chunks or ()}
    assert verify_run(dst, all=True, read_data=True).ok
    reader = CheckpointManager(dst_url, staging_dir=tmp_path / "r", auto_gc=False)
    reader.restore(tmp_path / "out")
    assert (tmp_path / "out" / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()
    reader.close()
