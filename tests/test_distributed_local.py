"""Local copies at N ranks (issue 30 item 3): a restart of the same host reads nothing from
the bucket, and a kept copy is used only where it proves to be the committed checkpoint.

The fast tests here run one rank in-process (no process group: the same save and restore
code, one node of one rank); the bytes the store served are counted by a wrapper around
the store (``Served``), never from the manager's own report. The multi-rank version, with
2 real ranks under torchrun where the node's leader reads the other rank's kept copy, is
``test_a_restarted_2_rank_job_reads_nothing_from_the_bucket`` (tests/scripts/dist_ckpt.py,
scenarios ``local-save`` and ``local-resume``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from distrun import Launch
from served import Served

from cloudckpt.committer import read_latest
from cloudckpt.distributed import DistributedCheckpointManager, rank_dir
from cloudckpt.stores import open_store

MORE = Path(__file__).parent / "scripts" / "dist_more.py"


def payload(step: int, name: str) -> bytes:
    return f"step {step} {name} ".encode() * 3000


def total(step: int) -> int:
    return sum(len(payload(step, name)) for name in ("a.bin", "b.bin", "c"))


def save(mgr, step: int) -> None:
    with mgr.save(step) as d:
        for name in ("a.bin", "b.bin"):
            (d / name).write_bytes(payload(step, name))
        (d / "sub").mkdir()
        (d / "sub" / "c.bin").write_bytes(payload(step, "c"))
    mgr.wait()


def check_exact(root: Path, step: int) -> None:
    mine = root / rank_dir(0)
    assert (mine / "a.bin").read_bytes() == payload(step, "a.bin")
    assert (mine / "b.bin").read_bytes() == payload(step, "b.bin")
    assert (mine / "sub" / "c.bin").read_bytes() == payload(step, "c")


@pytest.fixture
def saved(memory_target, tmp_path):
    """Steps 1 and 2 saved by one job (keep_local: default, the newest one kept), closed;
    then a restarted job on the same staging directory, over a counting store."""
    first = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    save(first, 1)
    save(first, 2)
    first.close()
    served = Served(open_store(memory_target.url))
    mgr = DistributedCheckpointManager(served, staging_dir=tmp_path / "s")
    yield mgr, served, tmp_path
    mgr.close()


def kept_file(tmp_path: Path, step: int, name: str) -> Path:
    (copy,) = (tmp_path / "s" / rank_dir(0) / "committed").glob(f"{step:012d}-*")
    return copy / "files" / name


def test_a_restart_resumes_from_the_kept_copy_reading_nothing_of_the_checkpoint(saved):
    mgr, served, tmp_path = saved
    res = mgr.resume(tmp_path / "r")
    assert res.step == 2
    check_exact(res.path, 2)
    assert served.checkpoint_bytes() == 0  # not even the manifest
    assert set(served.by_key) <= {"LATEST"}
    assert res.bytes_downloaded == 0 and res.bytes_local == total(2)


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "manifest"])
def test_a_damaged_kept_copy_is_read_from_the_store(saved, damage):
    mgr, served, tmp_path = saved
    target = kept_file(tmp_path, 2, "b.bin")
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[100] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    elif damage == "missing":
        target.unlink()
    else:  # the kept manifest itself: read from the store instead; the files still serve
        manifest = target.parent.parent / "MANIFEST.json"
        body = json.loads(manifest.read_bytes())
        manifest.write_text(json.dumps(body, indent=1))
    res = mgr.restore(tmp_path / "r")
    check_exact(res.path, 2)
    record = read_latest(served.inner).latest.current
    if damage == "manifest":
        assert served.checkpoint_bytes() == record.manifest_size
        assert res.bytes_local == total(2)
    else:  # exactly the damaged file's bytes (the kept manifest matched LATEST's digest)
        assert served.checkpoint_bytes() == len(payload(2, "b.bin"))
        assert res.bytes_downloaded == len(payload(2, "b.bin"))


def test_a_kept_copy_of_another_step_is_never_used(saved):
    """The copy kept is step 2's (keep_local=1); restoring step 1 takes nothing from it,
    though its files have the same names."""
    mgr, served, tmp_path = saved
    res = mgr.restore(tmp_path / "r", step=1)
    check_exact(res.path, 1)
    assert res.bytes_local == 0
    record = next(r for r in read_latest(served.inner).latest.retained() if r.step == 1)
    assert served.checkpoint_bytes() == record.manifest_size + total(1)


def test_restored_files_are_independent_of_the_kept_copy(saved):
    """Editing a restored file in place changes neither the kept copy nor a later restore
    (which still reads nothing from the store); hard links only with ``link_local``."""
    mgr, served, tmp_path = saved
    first = mgr.restore(tmp_path / "r1")
    edited = first.path / rank_dir(0) / "a.bin"
    with open(edited, "r+b") as f:
        f.write(b"EDITED")
    second = mgr.restore(tmp_path / "r2")
    check_exact(second.path, 2)
    assert served.checkpoint_bytes() == 0
    linked = mgr.restore(tmp_path / "r3", link_local=True)
    check_exact(linked.path, 2)
    assert os.path.samefile(linked.path / rank_dir(0) / "a.bin", kept_file(tmp_path, 2, "a.bin"))
    assert not os.path.samefile(
        second.path / rank_dir(0) / "a.bin", kept_file(tmp_path, 2, "a.bin")
    )


def test_keep_local_0_keeps_no_copy(memory_target, tmp_path):
    mgr = DistributedCheckpointManager(memory_target.url, staging_dir=tmp_path / "s", keep_local=0)
    save(mgr, 1)
    assert not list((tmp_path / "s" / rank_dir(0)).glob("committed/*"))
    res = mgr.restore(tmp_path / "r")
    check_exact(res.path, 1)
    assert res.bytes_local == 0 and res.bytes_downloaded == total(1)
    mgr.close()


# ------------------------------------------------------------------------------ 2 real ranks


def test_a_restarted_2_rank_job_reads_nothing_from_the_bucket(moto_server, tmp_path):
    """2 ranks under torchrun (one node) save steps 1 and 2; a new 2-rank job on the same
    staging directory resumes step 2 with every rank counting what the store served it
    (``Served``): nothing of the checkpoint. Then rank 1's kept shard is flipped and rank
    0's kept extra.pt deleted: a restore reads exactly those two files from the store.
    Then step 1 (the kept copies are step 2's): everything from the store. Every restore
    is compared byte for byte with what was saved, on both ranks."""
    bucket = f"local-{os.urandom(3).hex()}"
    moto_server.create_bucket(bucket)
    url, options = f"s3://{bucket}/run", moto_server.storage_options()
    first = Launch(
        "local-save",
        url,
        tmp_path / "save",
        options,
        extra=("--staging", str(tmp_path / "staging")),
        script=MORE,
    )
    assert first.wait(120) == 0, first.log_tail()
    again = Launch(
        "local-resume",
        url,
        tmp_path / "resume",
        options,
        extra=("--staging", str(tmp_path / "staging")),
        script=MORE,
    )
    assert again.wait(120) == 0, again.log_tail()

    store = open_store(url, options)
    try:
        records = {r.step: r for r in read_latest(store).latest.retained()}
    finally:
        store.close()
    sizes = {r: again.one(r, "sizes")["sizes"] for r in (0, 1)}
    for rank in (0, 1):
        resumed = again.one(rank, "restored", what="resume")
        assert resumed["step"] == 2 and resumed["exact"]
        assert resumed["served_checkpoint"] == 0, resumed["served"]  # nothing of the checkpoint
        assert set(resumed["served"]) <= {"LATEST"}
    assert again.one(1, "restored", what="resume")["served"] == {}  # rank 1 read nothing at all

    damaged = [again.one(r, "restored", what="damaged") for r in (0, 1)]
    assert all(d["exact"] for d in damaged)
    assert sum(d["served_checkpoint"] for d in damaged) == (
        sizes[1]["shard.bin"] + sizes[0]["extra.bin"]
    )
    stale = [again.one(r, "restored", what="step-1") for r in (0, 1)]
    assert all(s["exact"] and s["step"] == 1 for s in stale)
    assert sum(s["served_checkpoint"] for s in stale) == (
        records[1].manifest_size + records[1].total_bytes
    )


def test_user_paths_are_taken_from_the_copy_that_holds_them(memory_target, tmp_path):
    """``per_rank_dirs=False``: the checkpoint's paths are the ranks' own; a restart takes
    them from the copy holding them, reading nothing of the checkpoint."""
    first = DistributedCheckpointManager(
        memory_target.url, staging_dir=tmp_path / "s", per_rank_dirs=False
    )
    with first.save(1) as d:
        (d / "config.json").write_bytes(b'{"layers": 2}')
        (d / "model.bin").write_bytes(payload(1, "model"))
    first.close()
    served = Served(open_store(memory_target.url))
    mgr = DistributedCheckpointManager(served, staging_dir=tmp_path / "s", per_rank_dirs=False)
    res = mgr.resume(tmp_path / "r")
    assert (res.path / "model.bin").read_bytes() == payload(1, "model")
    assert (res.path / "config.json").read_bytes() == b'{"layers": 2}'
    assert served.checkpoint_bytes() == 0 and res.bytes_downloaded == 0
    mgr.close()


# ------------------------------------------------------------------------------ fan-out


def test_data_parallel_replicas_on_2_nodes_read_each_chunk_once(moto_server, tmp_path):
    """Read once, fan out (issue 30 item 5): 2 simulated nodes (``node_id``) of one rank
    each, data-parallel replicas saving the same files. A restore reads every chunk from
    the store exactly once over both nodes (counted on the store's side, ``Served``): one
    node reads it and sends it to the other. When the sender flips a byte of each chunk it
    sends, the receiver's check refuses them and it reads exactly those from the store;
    every file is still exact. When the sender cannot read the chunks it is to send, it
    says so and both nodes read them. With ``fanout=False`` each node reads every chunk."""
    bucket = f"fanout-{os.urandom(3).hex()}"
    moto_server.create_bucket(bucket)
    url, options = f"s3://{bucket}/run", moto_server.storage_options()
    job = Launch("fanout", url, tmp_path / "fanout", options, script=MORE)
    assert job.wait(180) == 0, job.log_tail()

    runs = {
        w: [job.one(r, "restored", what=w) for r in (0, 1)]
        for w in ("fanout", "corrupt", "unreadable", "off")
    }
    assert all(run["exact"] for both in runs.values() for run in both)

    def served(what: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for run in runs[what]:
            for key, n in run["chunks"].items():
                out[key] = out.get(key, 0) + n
        return out

    off = served("off")  # every node reads every chunk: twice each
    assert len(off) >= 4
    size = {key: n // 2 for key, n in off.items()}
    assert all(runs["off"][r]["chunks"] == size for r in (0, 1))
    assert all(run["sent"] == 0 for run in runs["off"])

    assert served("fanout") == size  # each chunk read once, by one of the nodes
    assert runs["fanout"][0]["sent"] + runs["fanout"][1]["sent"] == sum(size.values())
    assert runs["fanout"][0]["sent"] > 0 and runs["fanout"][1]["sent"] > 0  # spread
    # What each node took from the other, as the result reports it: what the other sent.
    assert [run["bytes_from_peers"] for run in runs["fanout"]] == [
        runs["fanout"][1]["sent"],
        runs["fanout"][0]["sent"],
    ]
    assert all(run["bytes_from_peers"] == 0 for run in runs["off"])
    assert runs["corrupt"][0]["bytes_from_peers"] == 0  # every chunk rank 1 sent was refused

    flipped = runs["corrupt"][1]["sent"]  # what rank 1 sent, every chunk flipped
    assert flipped > 0
    assert sum(served("corrupt").values()) == sum(size.values()) + flipped

    # Rank 1 cannot read what it is to send: it says so, and both nodes read those chunks.
    unread = runs["unreadable"][1]["sent"]
    assert unread > 0 and runs["unreadable"][0]["sent"] == sum(size.values()) - unread
    assert sum(served("unreadable").values()) == sum(size.values()) + unread
