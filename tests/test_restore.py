"""Restore: every file checked against its recorded digest, whatever path brought its bytes
(whole files, chunks, multi-rank); and a restore slower than the grace period, whose
checkpoint was dropped and collected under it, reads LATEST again and restores the current
checkpoint instead of reporting damage.

The hostile manifests here are consistent: the manifest is resealed and LATEST records its
new size and digest, so only the file digests can tell (``verify`` without ``--read-data``
passes them).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from cloudckpt import (
    CheckpointManager,
    CheckpointNotFoundError,
    attempt_layout,
    canonical,
    protocol,
)
from cloudckpt.chunks import MIN_PIECE
from cloudckpt.distributed import DistributedCheckpointManager
from cloudckpt.gc import collect_garbage
from cloudckpt.reader import MAX_LATEST_REREADS, fetch_manifest
from cloudckpt.restore import restore
from cloudckpt.stores import open_store
from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket
from cloudckpt.testing.faults import Callback, FaultInjectingStore, Rule
from cloudckpt.transfer import TransferEngine
from cloudckpt.verify import verify_run

MiB = 1024 * 1024


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _save(mgr: CheckpointManager, step: int, files: dict[str, bytes]) -> None:
    handle = mgr.save(step)
    with handle as d:
        for rel, data in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)
    handle.result()


def _safetensors(tensors: dict[str, bytes]) -> bytes:
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {
            "dtype": "U8",
            "shape": [len(data)],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())


def _rewrite_current_manifest(store, edit: Callable[[dict], None]) -> None:
    """Edit the current checkpoint's manifest as a hostile bucket writer could, keeping
    everything consistent: the manifest is resealed and LATEST records its new digest."""
    latest = json.loads(store.get(protocol.LATEST_KEY)[0])
    record = latest["current"]
    key = record["ckpt"] + attempt_layout.MANIFEST_NAME
    body = json.loads(store.get(key)[0])
    edit(body)
    manifest = canonical.seal(body)
    store.put(key, manifest)
    latest["current"] = {
        **record,
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        "manifest_size": len(manifest),
    }
    store.put(protocol.LATEST_KEY, canonical.seal(latest))


def _by_path(body: dict) -> dict[str, dict]:
    return {f["path"]: f for f in body["files"]}


def _swap_chunks_of_two_files(body: dict) -> None:
    a, b = _by_path(body)["a.bin"], _by_path(body)["b.bin"]
    a["chunks"], b["chunks"] = b["chunks"], a["chunks"]


def _swap_two_leaves(body: dict) -> None:
    chunks = _by_path(body)["big.bin"]["chunks"]
    assert [c[2] for c in chunks] == [8 * MiB, 8 * MiB]  # two whole leaves
    chunks.reverse()


def _swap_two_tensors_in_one_leaf(body: dict) -> None:
    chunks = _by_path(body)["model.safetensors"]["chunks"]
    # header, tensor x, tensor y: all within the first leaf
    assert len(chunks) == 3 and sum(c[2] for c in chunks) < 8 * MiB
    chunks[1], chunks[2] = chunks[2], chunks[1]


def _swap_digests_of_two_whole_files(body: dict) -> None:
    a, b = _by_path(body)["a.bin"], _by_path(body)["b.bin"]
    assert "chunks" not in a and a["size"] == b["size"]
    a["digest"], b["digest"] = b["digest"], a["digest"]


def _files(case: str, rng: random.Random) -> dict[str, bytes]:
    if case == "two whole leaves swapped":
        return {"big.bin": rng.randbytes(16 * MiB)}
    if case == "two chunks inside one leaf swapped":
        x, y = rng.randbytes(MIN_PIECE), rng.randbytes(MIN_PIECE + 4096)
        return {"model.safetensors": _safetensors({"x": x, "y": y})}
    return {"a.bin": rng.randbytes(3000), "b.bin": rng.randbytes(3000)}


WRONG_ORDER = {
    "chunks of two files swapped": ("tensor", _swap_chunks_of_two_files),
    "two whole leaves swapped": ("tensor", _swap_two_leaves),
    "two chunks inside one leaf swapped": ("tensor", _swap_two_tensors_in_one_leaf),
    "whole files' digests swapped": ("off", _swap_digests_of_two_whole_files),
}


@pytest.mark.parametrize("backend", ["memory", "s3"])
@pytest.mark.parametrize("case", sorted(WRONG_ORDER))
def test_valid_chunks_in_the_wrong_order_never_restore(request, backend, case, tmp_path):
    """Every chunk (every object) is intact and the manifest verifies against LATEST, but
    the bytes it assembles are not the files it records: the restore refuses the
    checkpoint and falls back, through every reader."""
    target = request.getfixturevalue(f"{backend}_target")
    store = open_store(target.url, target.storage_options)
    chunking, edit = WRONG_ORDER[case]
    rng = random.Random(case)
    good = {"a.bin": b"step one"}
    with CheckpointManager(store, staging_dir=tmp_path / "s", chunking=chunking) as mgr:
        _save(mgr, 1, good)
        _save(mgr, 2, _files(case, rng))
    _rewrite_current_manifest(store, edit)
    assert verify_run(store).ok  # consistent: only the file digests can tell
    assert not verify_run(store, read_data=True).ok

    with TransferEngine() as engine:
        res = restore(store, tmp_path / "out", engine)
    assert res.step == 1 and _tree(tmp_path / "out") == good
    assert [s.step for s in res.skipped] == [2]
    assert "does not match its digest" in res.skipped[0].reason
    assert not res.skipped[0].dropped
    assert not list(tmp_path.glob(".out.cloudckpt-*"))

    if backend == "memory":  # the multi-rank reader (world size 1) shares the check
        dist = DistributedCheckpointManager(store, staging_dir=tmp_path / "d", timeout=30)
        try:
            got = dist.restore(tmp_path / "dist")
        finally:
            dist.close()
        assert got.step == 1 and [s.step for s in got.skipped] == [2]
        assert _tree(tmp_path / "dist") == good
    store.close()


# --- a checkpoint dropped and collected while it is restored ----------------------------


@pytest.fixture
def mem():
    clock = ManualClock()
    name = f"restore-{random.getrandbits(32):08x}"
    yield MemoryStore(name, "run", clock=clock), clock
    drop_memory_bucket(name)


def _content(step: int) -> dict[str, bytes]:
    """Different bytes per step: no chunk is shared, so GC deletes a dropped step's."""
    return {"model.bin": random.Random(step).randbytes(20_000), "step.txt": b"%d" % step}


class _Trainer:
    """A writer that keeps training while a restore runs: each ``step()`` commits the next
    checkpoint (retention drops the previous one), lets the grace period pass on the store's
    clock, and runs GC, which deletes the dropped checkpoint."""

    def __init__(
        self,
        store,
        clock: ManualClock,
        tmp_path: Path,
        content: Callable[[int], dict[str, bytes]] = _content,
    ) -> None:
        self.store, self.clock, self.content = store, clock, content
        self.mgr = CheckpointManager(
            store, staging_dir=tmp_path / "trainer", keep_last=1, gc_grace=60, auto_gc=False
        )
        self.mgr.resume(tmp_path / "nothing")
        self.last = 0
        self.collected: list[int] = []

    def step(self) -> None:
        self.last += 1
        _save(self.mgr, self.last, self.content(self.last))
        self.clock.advance(120)
        report = collect_garbage(self.store)
        self.collected += [step for step, _ in report.deleted_checkpoints]


def _under_gc(store, trainer: _Trainer, key: str, times: int | None = 1):
    """The store as a slow reader sees it: ``trainer.step()`` runs just before it reads an
    object matching ``key`` (before the read, so that read already finds it gone)."""
    faulty = FaultInjectingStore(store)
    rule = faulty.add(Rule(Callback(before=trainer.step), ops={"get_range"}, key=key, times=times))
    return faulty, rule


@pytest.mark.parametrize("when", ["manifest", "chunk"])
def test_a_checkpoint_collected_under_a_slow_restore_restores_the_current_one(mem, tmp_path, when):
    store, clock = mem
    trainer = _Trainer(store, clock, tmp_path)
    trainer.step()
    trainer.step()  # step 2 is current; step 1 was dropped and collected
    key = f"ckpt/*/{attempt_layout.MANIFEST_NAME}" if when == "manifest" else "ckpt/*/chunks/*"
    faulty, rule = _under_gc(store, trainer, key)
    with TransferEngine() as engine:
        res = restore(faulty, tmp_path / "out", engine)
    assert rule.fired == 1 and trainer.collected == [1, 2]  # step 2 went while being read
    assert res.step == 3 and _tree(tmp_path / "out") == _content(3)
    (skip,) = res.skipped
    assert skip.step == 2 and skip.dropped
    assert "dropped by retention" in skip.reason and "missing" in skip.reason
    assert not list(tmp_path.glob(".out.cloudckpt-*"))
    trainer.mgr.close()


def test_a_requested_step_collected_under_the_restore_is_not_found(mem, tmp_path):
    store, clock = mem
    trainer = _Trainer(store, clock, tmp_path)
    trainer.step()
    trainer.step()
    faulty, rule = _under_gc(store, trainer, "ckpt/*/chunks/*")
    with TransferEngine() as engine, pytest.raises(CheckpointNotFoundError) as err:
        restore(faulty, tmp_path / "out", engine, step=2)
    assert rule.fired == 1 and 2 in trainer.collected
    assert "no longer retains step 2" in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.cloudckpt-*"))
    trainer.mgr.close()


def test_reading_latest_again_is_bounded(mem, tmp_path):
    """Every checkpoint is collected under the restore: it gives up after
    MAX_LATEST_REREADS fresh reads, saying the restore is slower than the grace period."""
    store, clock = mem
    # One chunk per checkpoint: each checkpoint tried is read (and collected) once.
    trainer = _Trainer(store, clock, tmp_path, lambda step: {"model.bin": b"%d" % step})
    trainer.step()
    faulty, rule = _under_gc(store, trainer, "ckpt/*/chunks/*", times=None)
    with TransferEngine() as engine, pytest.raises(CheckpointNotFoundError) as err:
        restore(faulty, tmp_path / "out", engine)
    assert rule.fired == MAX_LATEST_REREADS + 1
    assert "grace period (60s)" in str(err.value) and "gc_grace" in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.cloudckpt-*"))
    trainer.mgr.close()


def test_damage_in_a_checkpoint_still_retained_still_falls_back(mem, tmp_path):
    """Reading LATEST again changes nothing for real damage: the checkpoint is still
    retained, so the restore falls back to the older one as before."""
    store, _ = mem
    with CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False) as mgr:
        mgr.resume(tmp_path / "nothing")
        _save(mgr, 1, _content(1))
        _save(mgr, 2, _content(2))
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    manifest = fetch_manifest(store, latest.current)
    store.delete(manifest.files[0].chunks[0].key)
    with TransferEngine() as engine:
        res = restore(store, tmp_path / "out", engine)
    assert res.step == 1 and [(s.step, s.dropped) for s in res.skipped] == [(2, False)]


def test_the_multi_rank_reader_reads_latest_again_too(mem, tmp_path):
    store, clock = mem
    trainer = _Trainer(store, clock, tmp_path)
    trainer.step()
    trainer.step()
    faulty, rule = _under_gc(store, trainer, "ckpt/*/chunks/*")
    dist = DistributedCheckpointManager(faulty, staging_dir=tmp_path / "d", timeout=30)
    try:
        res = dist.restore(tmp_path / "out")
    finally:
        dist.close()
    assert rule.fired == 1 and 2 in trainer.collected
    assert res.step == 3 and _tree(tmp_path / "out") == _content(3)
    assert [(s.step, s.dropped) for s in res.skipped] == [(2, True)]
    trainer.mgr.close()


def test_a_slow_restore_from_s3_restores_the_current_checkpoint(s3_target, tmp_path):
    """Against moto: a new commit drops the checkpoint being restored and GC deletes it
    under the restore (GC looks from two grace periods ahead of the server's clock: no
    test waits out a grace period); the restore reads LATEST again."""
    store = open_store(s3_target.url, s3_target.storage_options)
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", keep_last=1, auto_gc=False)
    _save(mgr, 1, _content(1))
    grace = dt.timedelta(seconds=mgr.settings.gc_grace_s)
    collected: list[int] = []

    def train_and_collect() -> None:
        _save(mgr, 2, _content(2))
        ahead = store.now() + 2 * grace
        server_clock = store.now
        store.now = lambda: ahead
        try:
            report = collect_garbage(store)
        finally:
            store.now = server_clock
        collected.extend(step for step, _ in report.deleted_checkpoints)

    faulty = FaultInjectingStore(store)
    rule = faulty.add(
        Rule(Callback(before=train_and_collect), ops={"get_range"}, key="ckpt/*/chunks/*")
    )
    with TransferEngine() as engine:
        res = restore(faulty, tmp_path / "out", engine)
    assert rule.fired == 1 and collected == [1]
    assert res.step == 2 and _tree(tmp_path / "out") == _content(2)
    assert [(s.step, s.dropped) for s in res.skipped] == [(1, True)]
    mgr.close()
    store.close()


# --------------------------------------------------------------------------- partial restore

PARTIAL = {
    "model.safetensors": random.Random(1).randbytes(2 * MiB + 3),
    "optimizer.pt": random.Random(2).randbytes(MiB + 5),
    "config.json": b'{"a": 1}',
    "tokenizer/vocab.txt": b"a b c",
}


def _two_checkpoints(mgr: CheckpointManager) -> None:
    """Steps 1 and 2 of ``PARTIAL`` (step 2's config differs)."""
    _save(mgr, 1, PARTIAL)
    _save(mgr, 2, {**PARTIAL, "config.json": b'{"a": 2}'})


@pytest.mark.parametrize("chunking", ["tensor", "off"])
def test_a_partial_restore_reads_only_what_it_selects_and_verifies_it(
    seaweedfs_target, manager_factory, tmp_path, chunking
):
    """``restore(include=, exclude=)`` (the manager's, on SeaweedFS): only the selected
    files land, each verified (a damaged one falls back to the older checkpoint, its bytes
    never returned); a damaged file left out is never read, so it costs no fallback."""
    _two_checkpoints(manager_factory(seaweedfs_target, chunking=chunking))
    mgr = manager_factory(seaweedfs_target)  # another host: no local copy, all from the store
    got = mgr.restore(tmp_path / "w", include=["*.safetensors", "*.json"], exclude=["opt*"])
    assert _tree(tmp_path / "w") == {
        "model.safetensors": PARTIAL["model.safetensors"],
        "config.json": b'{"a": 2}',
    }
    assert got.step == 2 and got.skipped == () and got.num_files == 2
    assert got.excluded == ("optimizer.pt", "tokenizer/vocab.txt")
    assert got.total_bytes == len(PARTIAL["model.safetensors"]) + 8
    assert got.bytes_downloaded == got.total_bytes  # the rest was never read

    store = open_store(seaweedfs_target.url, seaweedfs_target.storage_options)
    current = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0]).current
    manifest = fetch_manifest(store, current)
    by_path = {f.path: f for f in manifest.files}

    def damage(path: str) -> None:
        entry = by_path[path]
        key = entry.chunks[0].key if entry.chunks else current.ckpt + "files/" + path
        data = bytearray(store.get(key)[0])
        data[0] ^= 1
        store.put(key, bytes(data))

    damage("optimizer.pt")  # left out: not read, no fallback
    got = mgr.restore(tmp_path / "x", exclude=["optimizer.pt"])
    assert got.step == 2 and got.skipped == () and got.excluded == ("optimizer.pt",)
    damage("config.json")  # selected: found, and step 1 restored instead
    got = mgr.restore(tmp_path / "y", include=["config.json"])
    assert got.step == 1 and [s.step for s in got.skipped] == [2]
    assert _tree(tmp_path / "y") == {"config.json": b'{"a": 1}'}
    with pytest.raises(CheckpointNotFoundError, match="no file of step 2 is selected"):
        mgr.restore(tmp_path / "z", include=["*.bin"], step=2)
    assert not (tmp_path / "z").exists() or not any((tmp_path / "z").iterdir())
    store.close()


def test_partial_restore_arguments_are_checked(memory_target, manager_factory, tmp_path):
    from cloudckpt.errors import ConfigurationError

    mgr = manager_factory(memory_target)
    _save(mgr, 1, PARTIAL)
    with pytest.raises(ConfigurationError, match=r"include=\['\*\.json'\]"):
        mgr.restore(tmp_path / "a", include="*.json")  # one string: a list was meant
    with pytest.raises(ConfigurationError):
        mgr.restore(tmp_path / "b", exclude=[""])
    # A directory pattern, and a whole restore (no pattern) excludes nothing.
    mgr.restore(tmp_path / "c", include=["tokenizer/"])
    assert _tree(tmp_path / "c") == {"tokenizer/vocab.txt": b"a b c"}
    assert mgr.restore(tmp_path / "d").excluded == ()


def test_restore_include_exclude_on_the_command_line(s3_target, manager_factory, tmp_path):
    from click.testing import CliRunner
    from test_cli import flags

    from cloudckpt.cli import cli

    mgr = manager_factory(s3_target)
    _two_checkpoints(mgr)
    argv = ["restore", s3_target.url, str(tmp_path / "w"), "--include", "*.safetensors",
            "--include", "tokenizer/", "--exclude", "*.txt", *flags(s3_target)]  # fmt: skip
    done = CliRunner().invoke(cli, [*argv, "--json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    assert sorted(doc["excluded"]) == ["config.json", "optimizer.pt", "tokenizer/vocab.txt"]
    assert doc["num_files"] == 1 and _tree(tmp_path / "w") == {
        "model.safetensors": PARTIAL["model.safetensors"]
    }
    human = CliRunner().invoke(cli, [*argv[:2], str(tmp_path / "h"), *argv[3:]])
    assert human.exit_code == 0, human.output
    assert "left out by --include/--exclude, not read: 3 file(s)" in human.stdout
    argv = ["restore", s3_target.url, str(tmp_path / "n"), "--include", "*.bin"]
    nothing = CliRunner().invoke(cli, argv + flags(s3_target))
    assert nothing.exit_code == 3 and "config.json" in nothing.output


def test_the_multi_rank_restore_takes_the_same_patterns(memory_target, tmp_path):
    mgr = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    handle = mgr.save(3)
    with handle as d:
        for rel, data in PARTIAL.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)
    handle.result(timeout=60)
    # Paths as the checkpoint holds them: each rank's files under rank-<N>/.
    got = mgr.restore(tmp_path / "r", include=["*.json", "*/tokenizer/"])
    assert _tree(got.rank_path) == {
        "config.json": PARTIAL["config.json"],
        "tokenizer/vocab.txt": PARTIAL["tokenizer/vocab.txt"],
    }
    mgr.close()


def test_restore_never_writes_into_or_over_a_local_run(tmp_path):
    """``restore --force`` replaces its destination: a destination that is, lies inside or
    holds a file:// run would replace or add to that run's committed objects. Refused
    (exit 7, DestinationNotEmptyError), by the CLI and the Python API, and the run still
    verifies."""
    from click.testing import CliRunner

    from cloudckpt.cli import cli
    from cloudckpt.errors import DestinationNotEmptyError

    run = tmp_path / "runs" / "mine"
    mgr = CheckpointManager(f"file://{run}", staging_dir=tmp_path / "staging")
    _save(mgr, 1, {"model.bin": b"weights" * 100})
    mgr.close()
    before = _tree(run)
    committed = max((p for p in run.rglob("*") if p.is_file()), key=lambda p: len(p.parts))
    for dest, what in [
        (run, "is the cloudckpt run"),
        (committed.parent, "is inside the cloudckpt run"),
        (run / "restored", "is inside the cloudckpt run"),
        (tmp_path / "runs", "holds the cloudckpt run"),
    ]:
        result = CliRunner().invoke(cli, ["restore", f"file://{run}", str(dest), "--force"])
        assert result.exit_code == 7, (dest, result.output)
        assert what in result.stderr and "a restore would" in result.stderr, result.stderr
        with pytest.raises(DestinationNotEmptyError, match=what):
            restore(open_store(f"file://{run}"), dest, TransferEngine(), overwrite=True)
    assert _tree(run) == before and not (run / "restored").exists()
    assert verify_run(open_store(f"file://{run}")).ok
    # A plain directory is still replaced with --force.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "old.txt").write_bytes(b"old")
    result = CliRunner().invoke(cli, ["restore", f"file://{run}", str(plain), "--force"])
    assert result.exit_code == 0, result.output
    assert _tree(plain) == {"model.bin": b"weights" * 100}
