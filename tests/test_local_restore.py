"""Restores from the local tier (issue 28, item 8): what a restore takes from the kept copy
in ``staging_dir`` is its own file, and only a verified, regular file of the copy whose
manifest is the committed one is taken.

- Each restored file is independent of the kept copy and of every other restore (a
  reflink where the filesystem has it, else a copy); hard links only with
  ``link_local=True``.
- Only regular files are taken: a symbolic link or a FIFO planted in the copy is
  downloaded instead (never followed, never opened for reading).
- The copy is used only where its bytes verify against the manifest LATEST names, and its
  kept ``MANIFEST.json`` only if it is that manifest.
"""

from __future__ import annotations

import os
import random

import pytest

from cloudckpt import CheckpointManager, localcopy
from cloudckpt.localcopy import COMMITTED_DIR

MiB = 1024 * 1024


def _files(seed: int) -> dict[str, bytes]:
    rnd = random.Random(seed)
    return {"a.bin": rnd.randbytes(3 * MiB), "sub/b.bin": rnd.randbytes(MiB), "c.txt": b"c"}


def _save(url: str, staging, steps=(1,), keep_local: int = 1) -> None:
    mgr = CheckpointManager(url, staging_dir=staging, keep_local=keep_local)
    for step in steps:
        with mgr.save(step=step) as d:
            for name, blob in _files(step).items():
                (d / name).parent.mkdir(parents=True, exist_ok=True)
                (d / name).write_bytes(blob)
    mgr.close()


def _kept(staging, step: int):
    (copy,) = [p for p in (staging / COMMITTED_DIR).iterdir() if p.name.startswith(f"{step:012d}")]
    return copy


def _read(root) -> dict[str, bytes]:
    return {name: (root / name).read_bytes() for name in _files(1)}


def test_two_restores_from_the_local_tier_are_independent(memory_target, tmp_path):
    """On main both restores were hard links to the kept copy: editing one in place
    changed the other and the copy."""
    staging = tmp_path / "staging"
    _save(memory_target.url, staging)
    kept = _kept(staging, 1) / "files" / "a.bin"
    mgr = CheckpointManager(memory_target.url, staging_dir=staging)
    one = mgr.restore(tmp_path / "one")
    two = mgr.restore(tmp_path / "two")
    for res in (one, two):
        assert res.bytes_downloaded == 0 and res.bytes_local == sum(map(len, _files(1).values()))
        assert not os.path.samefile(res.path / "a.bin", kept)
    with open(one.path / "a.bin", "r+b") as f:  # an in-place edit (np.memmap, r+b)
        f.write(b"edited")
    assert _read(two.path) == _files(1)
    assert kept.read_bytes() == _files(1)["a.bin"]
    three = mgr.restore(tmp_path / "three")  # the kept copy still verifies: still local
    assert three.bytes_downloaded == 0 and _read(three.path) == _files(1)
    mgr.close()


def test_link_local_hard_links_on_request_and_an_edited_copy_is_downloaded(memory_target, tmp_path):
    """``link_local=True``: no bytes written, the restored file is the kept copy (the
    documented caveat); once edited, the copy no longer verifies and is not used."""
    staging = tmp_path / "staging"
    _save(memory_target.url, staging)
    kept = _kept(staging, 1) / "files" / "a.bin"
    mgr = CheckpointManager(memory_target.url, staging_dir=staging)
    linked = mgr.restore(tmp_path / "linked", link_local=True)
    assert linked.bytes_downloaded == 0 and os.path.samefile(linked.path / "a.bin", kept)
    with open(linked.path / "a.bin", "r+b") as f:
        f.write(b"edited")
    assert kept.read_bytes()[:6] == b"edited"  # the caveat: they are one file
    again = mgr.restore(tmp_path / "again")
    assert again.bytes_downloaded == 3 * MiB  # a.bin no longer verifies: downloaded
    assert _read(again.path) == _files(1)
    mgr.close()


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_only_regular_files_of_the_kept_copy_are_taken(memory_target, tmp_path, kind):
    """A symbolic link in the copy (even to the right bytes) or a FIFO is downloaded
    instead: never followed, never opened for reading (a FIFO would block the restore)."""
    staging = tmp_path / "staging"
    _save(memory_target.url, staging)
    kept = _kept(staging, 1) / "files" / "a.bin"
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(kept.read_bytes())
    kept.unlink()
    if kind == "symlink":
        kept.symlink_to(elsewhere)
    else:
        os.mkfifo(kept)
    mgr = CheckpointManager(memory_target.url, staging_dir=staging)
    res = mgr.restore(tmp_path / "r", link_local=kind == "symlink")
    assert res.bytes_downloaded == 3 * MiB and res.bytes_local == MiB + 1
    assert not (res.path / "a.bin").is_symlink() and _read(res.path) == _files(1)
    mgr.close()
    assert localcopy.place_file(kept, tmp_path / "x") is None and not (tmp_path / "x").exists()


def test_a_kept_file_that_does_not_verify_is_downloaded(memory_target, tmp_path):
    staging = tmp_path / "staging"
    _save(memory_target.url, staging)
    kept = _kept(staging, 1) / "files" / "sub" / "b.bin"
    data = bytearray(kept.read_bytes())
    data[12345] ^= 0x01
    kept.write_bytes(bytes(data))
    mgr = CheckpointManager(memory_target.url, staging_dir=staging)
    res = mgr.restore(tmp_path / "r")
    assert res.bytes_downloaded == MiB and _read(res.path) == _files(1)
    mgr.close()


def test_a_kept_manifest_of_another_checkpoint_is_not_used(memory_target, tmp_path):
    """Step 2's copy replaced by step 1's, manifest included: the manifest is not the one
    LATEST names, so the store's is read, and step 1's bytes do not verify against it."""
    staging = tmp_path / "staging"
    _save(memory_target.url, staging, steps=(1, 2), keep_local=2)
    old, new = _kept(staging, 1), _kept(staging, 2)
    (new / "MANIFEST.json").write_bytes((old / "MANIFEST.json").read_bytes())
    for name, blob in _files(1).items():
        (new / "files" / name).write_bytes(blob)
    mgr = CheckpointManager(memory_target.url, staging_dir=staging, keep_local=2)
    res = mgr.restore(tmp_path / "r")
    assert res.step == 2 and _read(res.path) == _files(2)
    assert res.bytes_downloaded == 4 * MiB  # the identical c.txt verifies and stays local
    mgr.close()


def test_place_file_copies_a_regular_file_it_does_not_link(tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"x" * (3 * MiB + 7))
    how = localcopy.place_file(src, tmp_path / "dst")
    assert how in ("reflink", "copy")
    assert (tmp_path / "dst").read_bytes() == src.read_bytes()
    assert not os.path.samefile(src, tmp_path / "dst")
    assert localcopy.place_file(src, tmp_path / "lnk", link=True) == "link"
    assert os.path.samefile(src, tmp_path / "lnk")
    assert localcopy.place_file(tmp_path / "missing", tmp_path / "m") is None


@pytest.mark.parametrize("cores", [2, 64])
def test_kept_copy_hashing_threads_and_a_flipped_byte_is_still_caught(
    memory_target, tmp_path, monkeypatch, cores
):
    """Issue 31, item 4: a read of at least one unit per core hashes each leaf on its
    worker's thread alone (no hand-off to BLAKE3's pool); fewer units hash on several
    cores. Either way every byte is checked: a flipped byte of the copy is downloaded."""
    from cloudckpt import digest, fetch

    staging = tmp_path / "staging"
    _save(memory_target.url, staging)
    kept = _kept(staging, 1) / "files" / "a.bin"
    data = bytearray(kept.read_bytes())
    data[2 * MiB + 7] ^= 0x10
    kept.write_bytes(bytes(data))
    hints: list[int] = []
    checking = []  # hints are recorded while the kept copy is checked (not the download)
    real, real_verify = digest.hasher, fetch.verify_local

    def spy(algorithm=None, size_hint=0):
        if checking:
            hints.append(size_hint)
        return real(algorithm, size_hint)

    def verify(*args, **kwargs):
        checking.append(1)
        try:
            return real_verify(*args, **kwargs)
        finally:
            checking.clear()

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(digest, "hasher", spy)
    monkeypatch.setattr(fetch, "verify_local", verify)
    mgr = CheckpointManager(memory_target.url, staging_dir=staging)
    res = mgr.restore(tmp_path / "r")
    mgr.close()
    assert res.bytes_downloaded == 3 * MiB and res.bytes_local == MiB + 1
    assert _read(res.path) == _files(1)
    big = [h for h in hints if h >= digest.THREADED_MIN]
    assert hints and (big if cores == 64 else not big)


def test_a_kept_copy_is_hashed_piece_by_piece_as_it_is_read(memory_target, tmp_path, monkeypatch):
    """Issue 31, items 4-5: with a unit per core, each unit of the kept copy is read
    ``HOT_PIECE`` bytes at a time and each piece hashed right after it landed, while it is
    in cache (no 8 MiB leaf hashed after it left L2); the restore is still exact."""
    from cloudckpt import digest, fetch

    staging = tmp_path / "staging"
    _save(memory_target.url, staging)
    sizes: list[int] = []
    real = digest.hasher

    class Spy:
        def __init__(self, inner: digest.Hasher) -> None:
            self.inner = inner

        def update(self, data: memoryview) -> None:
            sizes.append(memoryview(data).nbytes)
            self.inner.update(data)

        def digest(self) -> bytes:
            return self.inner.digest()

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(digest, "hasher", lambda *a, **k: Spy(real(*a, **k)))
    mgr = CheckpointManager(memory_target.url, staging_dir=staging)
    res = mgr.restore(tmp_path / "r")
    mgr.close()
    assert res.bytes_downloaded == 0 and _read(res.path) == _files(1)
    big = [n for n in sizes if n > 1024]
    assert big and max(big) <= fetch.HOT_PIECE
    assert sum(big) >= 4 * MiB  # a.bin and sub/b.bin, every byte hashed


def test_a_failed_unit_of_a_kept_copy_stops_the_other_workers(memory_target, tmp_path, monkeypatch):
    """The workers reading a kept copy take no further unit once one failed (as the
    transfer engine's queued units are cancelled): nothing keeps landing bytes after the
    restore raised."""
    import threading
    import time

    from cloudckpt import fetch

    staging = tmp_path / "staging"
    mgr = CheckpointManager(memory_target.url, staging_dir=staging)
    with mgr.save(step=1) as d:
        (d / "big.bin").write_bytes(random.Random(3).randbytes(12 * 8 * MiB))
    mgr.close()
    calls: list[int] = []
    lock = threading.Lock()
    real = fetch._local_unit

    def failing(reader, unit):
        with lock:
            calls.append(1)
            first = len(calls) == 1
        if first:
            raise RuntimeError("a sink failed")
        time.sleep(0.05)
        return real(reader, unit)

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(fetch, "_local_unit", failing)
    again = CheckpointManager(memory_target.url, staging_dir=staging)
    with pytest.raises(RuntimeError, match="a sink failed"):
        again.restore(tmp_path / "r")
    again.close()
    assert len(calls) <= fetch.LOCAL_WORKERS_MIN + 1 < 12
