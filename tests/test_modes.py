"""Restore keeps file modes, safely: a save records each file's permission bits, a restore
applies them less the umask, never setuid, setgid or sticky (docs/design.md §7, "File
modes"), and a manifest that records modes is still read as before."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from cloudckpt import CheckpointManager, canonical, formats, manifests, protocol
from cloudckpt.restore import restore
from cloudckpt.stores import open_store
from cloudckpt.transfer import TransferEngine

MODES = {"run.sh": 0o755, "secret.txt": 0o600, "weights.bin": 0o644, "ro.json": 0o444}


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _save(target, tmp_path: Path, chunking: str) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name, mode in MODES.items():
        (src / name).write_bytes(name.encode() * 100)
        os.chmod(src / name, mode)
    mgr = CheckpointManager(
        target.url,
        storage_options=target.storage_options,
        staging_dir=tmp_path / "staging",
        auto_gc=False,
        chunking=chunking,
    )
    mgr.save_dir(1, src).result()
    mgr.close()
    return src


def _modes(root: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in root.iterdir()}


@pytest.mark.parametrize("chunking", ["tensor", "off"])
@pytest.mark.parametrize("backend", ["memory", "file", "s3"])
def test_restore_keeps_file_modes(backend, chunking, request, tmp_path, umask_022):
    target = request.getfixturevalue(f"{backend}_target")
    _save(target, tmp_path, chunking)
    store = open_store(target.url, target.storage_options)
    with TransferEngine() as engine:
        restore(store, tmp_path / "out", engine)
    store.close()
    assert _modes(tmp_path / "out") == MODES


def _rewrite_modes(store, mode: int) -> None:
    """A hostile (or buggy) writer: every file's mode replaced, the manifest re-sealed and
    LATEST's record of it re-sealed too, so every check but the mode's own passes."""
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    record = latest.current
    manifest = manifests.parse_manifest(store.get(record.manifest_key)[0], record)
    files = tuple(dataclasses.replace(f, mode=mode) for f in manifest.files)
    body = dataclasses.replace(manifest, files=files).to_bytes()
    store.put(record.manifest_key, body)
    forged = dataclasses.replace(
        record, manifest_sha256=hashlib.sha256(body).hexdigest(), manifest_size=len(body)
    )
    store.put(protocol.LATEST_KEY, dataclasses.replace(latest, current=forged).to_bytes())


def test_a_manifest_cannot_set_special_bits_or_defeat_the_umask(memory_target, tmp_path, umask_022):
    """The guard of the mode rule: a manifest recording setuid, setgid, sticky and
    world-writable bits restores files with at most rwxr-xr-x (umask 022)."""
    _save(memory_target, tmp_path, "tensor")
    store = open_store(memory_target.url)
    _rewrite_modes(store, 0o7777)
    with TransferEngine() as engine:
        restore(store, tmp_path / "out", engine)
    got = _modes(tmp_path / "out")
    assert got == dict.fromkeys(MODES, 0o755), {k: oct(v) for k, v in got.items()}


def test_a_mode_out_of_range_is_damage(memory_target, tmp_path):
    """A mode that is not a file mode at all is a damaged manifest: the checkpoint is
    skipped like any other damage (here the only one, so nothing restores)."""
    from cloudckpt.errors import CorruptionError

    _save(memory_target, tmp_path, "tensor")
    store = open_store(memory_target.url)
    _rewrite_modes(store, 0o10000)
    with TransferEngine() as engine, pytest.raises(CorruptionError, match="not a file mode"):
        restore(store, tmp_path / "out", engine)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_modes_need_no_new_manifest_format(memory_target, tmp_path):
    """``mode`` is an optional field: a manifest with modes keeps its format (an older
    reader, which ignores fields it does not know, restores it with default modes), and
    a manifest without any still parses, with no modes."""
    _save(memory_target, tmp_path, "off")
    store = open_store(memory_target.url)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    data = store.get(latest.current.manifest_key)[0]
    body = json.loads(data)
    assert body["format"] == formats.MANIFEST_FORMAT_DIGEST  # BLAKE3 (the mode adds none)
    assert {f["path"]: f["mode"] for f in body["files"]} == MODES
    for f in body["files"]:
        del f["mode"]
    old = manifests.parse_manifest(canonical.seal(body))
    assert [f.mode for f in old.files] == [None] * len(MODES)
