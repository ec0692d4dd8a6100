"""The catalog (issue 25 items 2, 4, 6): run discovery, single files, plain exports, the
digest a user can compute, and diffs. Against every backend's real test server where the
store matters (runs: delimiter listings), moto and fake-gcs-server through the CLI, and
memory/file:// otherwise."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloudckpt import CheckpointManager, CheckpointNotFoundError, CorruptionError, protocol
from cloudckpt.catalog import (
    diff_checkpoints,
    export_checkpoint,
    file_digest,
    get_file,
    list_runs,
)
from cloudckpt.cli import cli
from cloudckpt.digest import CHUNK_SIZE
from cloudckpt.errors import DestinationNotEmptyError
from cloudckpt.stores import open_store
from cloudckpt.testing.faults import flip_bit

MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent


def _tree(root: Path, seed: int, big: bool = True) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {
        "model.safetensors": rng.randbytes(2 * CHUNK_SIZE + 11 if big else 5000),
        "config.json": b'{"seed": %d}' % seed,
        "tokenizer/vocab.txt": rng.randbytes(3000),
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _push(
    url: str, options: dict, tmp_path: Path, step: int, seed: int, big: bool = True, **kw
) -> dict:
    src = tmp_path / f"src-{step}-{seed}"
    files = _tree(src, seed, big)
    mgr = CheckpointManager(
        url,
        storage_options=options,
        staging_dir=tmp_path / f"st-{step}-{seed}",
        auto_gc=False,
        **kw,
    )
    mgr.save_dir(step, src).result()
    mgr.close()
    return files


def _sub(url: str, path: str) -> str:
    return url.rstrip("/") + "/" + path


# --------------------------------------------------------------------------- runs


def test_runs_finds_every_run_below_a_prefix(target, tmp_path):
    """17 runs at various depths under one prefix (the issue's case), an empty run, a run
    whose LATEST was lost, and a user directory named ckpt/: each backend's delimiter
    listing (S3, GCS, Azure) or walk (file, memory) finds exactly the runs."""
    base = target.url
    names = [f"exp{i:02d}" for i in range(14)] + ["team/a", "team/b", "team/deep/c"]
    for i, name in enumerate(names):
        _push(_sub(base, name), target.storage_options, tmp_path, step=i + 1, seed=i, big=False)
    store = open_store(base, target.storage_options)
    # An empty run (claimed, nothing committed) and one that lost its LATEST.
    empty = CheckpointManager(
        _sub(base, "empty"), storage_options=target.storage_options, staging_dir=tmp_path / "e"
    )
    empty.attempts.claim()
    empty.close()
    _push(_sub(base, "lost"), target.storage_options, tmp_path, step=3, seed=99, big=False)
    store.delete("lost/LATEST")
    # Not runs: a file beside them, and a user's directory that happens to be called ckpt.
    store.put("notes.txt", b"hello")
    store.put("data/ckpt/weights.bin", b"not a checkpoint")

    runs = list_runs(store)
    by_path = {r.path: r for r in runs}
    assert sorted(by_path) == sorted([*names, "empty", "lost"])
    exp3 = by_path["exp03"]
    assert (exp3.status, exp3.step, exp3.retained, exp3.writer_epoch) == ("ok", 4, 1, 1)
    assert exp3.total_bytes == sum(len(v) for v in _tree(tmp_path / "t", 3, big=False).values())
    assert exp3.url == store.url + "exp03/" and exp3.age_seconds is not None
    assert exp3.age_seconds >= 0 and exp3.updated_at is not None
    assert by_path["team/deep/c"].step == 17
    assert by_path["empty"].status == "empty" and by_path["empty"].step is None
    assert by_path["lost"].status == "needs-repair" and "repair" in by_path["lost"].problem
    # --depth bounds the walk.
    assert {r.path for r in list_runs(store, depth=1)} == {*names[:14], "empty", "lost"}
    assert list_runs(store, depth=0) == []
    # The prefix itself, when it is a run.
    assert [
        r.path for r in list_runs(_sub(base, "exp01"), storage_options=target.storage_options)
    ] == [""]
    store.close()


@pytest.fixture(params=["s3", "gcs"])
def cloud(request):
    return request.getfixturevalue(f"{request.param}_target")


def _flags(target) -> list[str]:
    so = target.storage_options
    if target.backend == "s3":
        return ["--endpoint-url", so["endpoint_url"], "--region", "us-east-1",
                "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]  # fmt: skip
    return ["--endpoint-url", so["endpoint_url"], "-o", "token=anon", "-o", "project=test"]


def run(*args, target=None):
    argv = [str(a) for a in args] + (_flags(target) if target is not None else [])
    return CliRunner().invoke(cli, argv)


def ok_json(result):
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}"
    return json.loads(result.stdout)


def test_runs_command(cloud, tmp_path):
    base = cloud.url
    for i, name in enumerate(["a", "b/c"]):
        _push(
            _sub(base, name), cloud.storage_options, tmp_path, step=10 * (i + 1), seed=i, big=False
        )
    doc = ok_json(run("runs", base, "--json", target=cloud))
    assert [(r["path"], r["step"], r["status"]) for r in doc["runs"]] == [
        ("a", 10, "ok"),
        ("b/c", 20, "ok"),
    ]
    assert set(doc["runs"][0]) == {
        "url", "path", "status", "step", "commit_id", "committed_at", "total_bytes",
        "num_files", "retained", "stored_bytes", "updated_at", "age_seconds",
        "writer_epoch", "problem",
    }  # fmt: skip
    table = run("runs", base, target=cloud)
    assert table.exit_code == 0 and re.search(r"b/c\s.*\s20\s", table.stdout), table.stdout
    # ls on a prefix of runs says where they are.
    ls = run("ls", base, target=cloud)
    assert ls.exit_code == 0 and "cloudckpt runs" in ls.output, ls.output
    none = run("runs", _sub(base, "nothing"), target=cloud)
    assert none.exit_code == 0 and "no runs" in none.output


# --------------------------------------------------------------------------- get


def test_get_one_file_verified(memory_target, tmp_path):
    url = memory_target.url
    first = _push(url, {}, tmp_path, step=1, seed=1)
    second = _push(url, {}, tmp_path, step=2, seed=2)
    out = tmp_path / "out"
    out.mkdir()
    got = get_file(url, "config.json", out)
    assert got.dest == out / "config.json" and got.step == 2
    assert (out / "config.json").read_bytes() == second["config.json"]
    got = get_file(url, "tokenizer/vocab.txt", out / "v.txt", step=1)
    assert (out / "v.txt").read_bytes() == first["tokenizer/vocab.txt"]
    assert got.digest == file_digest(out / "v.txt")
    pieces: list[bytes] = []
    get_file(url, "model.safetensors", write=pieces.append)
    assert b"".join(pieces) == second["model.safetensors"]
    # Nothing but the file: no temporary directory left beside it.
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "v.txt"]
    with pytest.raises(DestinationNotEmptyError):
        get_file(url, "config.json", out)
    get_file(url, "config.json", out, step=1, overwrite=True)
    assert (out / "config.json").read_bytes() == first["config.json"]
    with pytest.raises(CheckpointNotFoundError, match=r"no file 'nope\.bin'"):
        get_file(url, "nope.bin", out)
    with pytest.raises(CheckpointNotFoundError, match="step 7"):
        get_file(url, "config.json", out, step=7)


def test_get_falls_back_when_the_file_is_damaged(memory_target, tmp_path):
    """A damaged copy of the file is skipped for the next older checkpoint (reported);
    the damaged bytes never reach the destination."""
    url = memory_target.url
    first = _push(url, {}, tmp_path, step=1, seed=1, chunking="off")
    _push(url, {}, tmp_path, step=2, seed=2, chunking="off")
    store = open_store(url)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    flip_bit(store, latest.current.ckpt + "files/config.json", seed=3)
    got = get_file(store, "config.json", tmp_path / "c.json")
    assert got.step == 1 and [s.step for s in got.skipped] == [2]
    assert (tmp_path / "c.json").read_bytes() == first["config.json"]
    with pytest.raises(CorruptionError):
        get_file(store, "config.json", tmp_path / "d.json", step=2)
    assert not (tmp_path / "d.json").exists()


def test_get_command(cloud, tmp_path):
    files = _push(cloud.url, cloud.storage_options, tmp_path, step=3, seed=3)
    doc = ok_json(run("get", cloud.url, "tokenizer/vocab.txt", tmp_path, "--json", target=cloud))
    assert doc["dest"] == str(tmp_path / "vocab.txt") and doc["step"] == 3
    assert (tmp_path / "vocab.txt").read_bytes() == files["tokenizer/vocab.txt"]
    assert doc["digest"] == file_digest(tmp_path / "vocab.txt") and doc["size"] == 3000
    piped = run("get", cloud.url, "config.json", "-", target=cloud)
    assert piped.exit_code == 0 and piped.stdout_bytes == files["config.json"]
    again = run("get", cloud.url, "config.json", tmp_path / "vocab.txt", target=cloud)
    assert again.exit_code == 7, again.output
    missing = run("get", cloud.url, "nope", tmp_path, target=cloud)
    assert missing.exit_code == 3 and "config.json" in missing.output  # lists the files


# --------------------------------------------------------------------------- export


def test_export_to_a_local_directory_and_to_a_bucket(s3_target, moto_server, tmp_path):
    files = _push(s3_target.url, s3_target.storage_options, tmp_path, step=4, seed=4)
    so = s3_target.storage_options
    # A local directory: what from_pretrained reads.
    result = export_checkpoint(s3_target.url, tmp_path / "plain", storage_options=so)
    got = {p.relative_to(tmp_path / "plain").as_posix(): p.read_bytes()
           for p in (tmp_path / "plain").rglob("*") if p.is_file()}  # fmt: skip
    assert got == files and result.step == 4 and result.num_files == 3
    # A bucket prefix: plain objects under their own paths, nothing else.
    moto_server.create_bucket("plain-out")
    dest = "s3://plain-out/models/m1"
    result = export_checkpoint(s3_target.url, dest, storage_options=so, dest_options=so)
    out = open_store(dest, so)
    assert {o.key: out.get(o.key)[0] for o in out.list()} == files
    assert result.dest == out.url
    # Not over what is there (unless asked), and never into a run.
    with pytest.raises(DestinationNotEmptyError, match="not empty"):
        export_checkpoint(s3_target.url, dest, storage_options=so, dest_options=so)
    export_checkpoint(s3_target.url, dest, storage_options=so, dest_options=so, overwrite=True)
    with pytest.raises(DestinationNotEmptyError, match="is a cloudckpt run"):
        export_checkpoint(
            s3_target.url, s3_target.url, storage_options=so, dest_options=so, overwrite=True
        )
    out.close()


def test_export_command_to_a_bucket_is_readable_by_plain_tools(gcs_target, tmp_path):
    files = _push(gcs_target.url, gcs_target.storage_options, tmp_path, step=5, seed=5)
    dest = gcs_target.url.rsplit("/", 1)[0] + "/exported"
    doc = ok_json(run("export", gcs_target.url, dest, "--json", target=gcs_target))
    assert doc["num_files"] == 3 and doc["step"] == 5
    # Read back with gcsfs itself, as any fsspec tool (or from_pretrained via fsspec) would.
    import gcsfs

    so = gcs_target.storage_options
    fs = gcsfs.GCSFileSystem(endpoint_url=so["endpoint_url"], token="anon", project="test")
    bucket = dest.split("://")[1]
    found = {p[len(bucket) + 1 :]: fs.cat(p) for p in fs.find(bucket)}
    assert found == files


def test_export_stops_at_damage_and_says_what_was_written(memory_target, tmp_path):
    """Damage found in the middle of an export to a store stops it (no fallback: the
    files written so far are of this checkpoint), and says how many were written."""
    _push(memory_target.url, {}, tmp_path, step=1, seed=1)
    store = open_store(memory_target.url)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    manifest = protocol.parse_manifest(store.get(latest.current.manifest_key)[0])
    last = manifest.files[-1]  # tokenizer/vocab.txt, exported last
    flip_bit(store, last.chunks[0].key, seed=1)
    dest = memory_target.url.rsplit("/", 1)[0] + "/out"
    with pytest.raises(CorruptionError, match="2 of 3 files of step 1 were exported"):
        export_checkpoint(store, dest)
    assert last.path not in {o.key for o in open_store(dest).list()}


# --------------------------------------------------------------------------- digest


def test_digest_matches_the_manifest_and_the_documented_recipes(file_target, tmp_path):
    """`cloudckpt digest` prints what the manifest records, and so do the recipes in
    docs/cli.md (Python with hashlib only, and sha256sum in a shell)."""
    files = _push(file_target.url, {}, tmp_path, step=1, seed=8)
    shown = ok_json(run("show", file_target.url, "--json"))["manifest"]["files"]
    recorded = {f["path"]: f["digest"] for f in shown}
    src = tmp_path / "src-1-8"
    doc = ok_json(run("digest", src / "model.safetensors", src / "config.json", "--json"))
    assert {Path(f["path"]).name: f["digest"] for f in doc["files"]} == {
        "model.safetensors": recorded["model.safetensors"],
        "config.json": recorded["config.json"],
    }
    text = run("digest", src / "config.json")
    assert text.stdout == f"{recorded['config.json']}  {src / 'config.json'}\n"
    (tmp_path / "empty").write_bytes(b"")
    assert (
        file_digest(tmp_path / "empty")
        == ok_json(run("digest", tmp_path / "empty", "--json"))["files"][0]["digest"]
    )

    page = (ROOT / "docs" / "cli.md").read_text()
    section = page[page.index("### `digest FILE...`") :]
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shell = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    for name in ("model.safetensors", "config.json", "empty"):
        path = src / name if name != "empty" else tmp_path / "empty"
        expected = recorded.get(name) or file_digest(path)
        out = subprocess.run(
            [sys.executable, "-c", python, str(path)], capture_output=True, text=True, check=True
        ).stdout.split()[0]
        assert out == expected, name
        out = subprocess.run(
            ["sh", "-c", shell, "sh", str(path)], capture_output=True, text=True, check=True
        ).stdout.split()[0]
        assert out == expected, name
    assert files  # (the push above)


def test_digest_of_a_missing_file_is_a_usage_error(tmp_path):
    result = run("digest", tmp_path / "nope")
    assert result.exit_code == 2


# --------------------------------------------------------------------------- diff


def test_diff_files_chunks_and_modes(memory_target, tmp_path):
    url = memory_target.url
    src = tmp_path / "src"
    files = _tree(src, 1)
    mgr = CheckpointManager(url, staging_dir=tmp_path / "st", auto_gc=False, keep_last=5)
    mgr.save_dir(1, src).result()
    big = bytearray(files["model.safetensors"])
    big[CHUNK_SIZE + 5] ^= 1  # one leaf of three changes
    (src / "model.safetensors").write_bytes(bytes(big))
    (src / "tokenizer/vocab.txt").unlink()
    (src / "new.txt").write_bytes(b"new")
    os.chmod(src / "config.json", 0o600)
    mgr.save_dir(2, src).result()
    mgr.close()

    diff = diff_checkpoints(url, 1, 2)
    changes = {f.path: f.change for f in diff.files}
    assert changes == {
        "model.safetensors": "modified",
        "tokenizer/vocab.txt": "removed",
        "new.txt": "added",
        "config.json": "mode",
    }
    model = next(f for f in diff.files if f.path == "model.safetensors")
    assert (model.new_chunks, model.new_bytes) == (1, CHUNK_SIZE)
    assert diff.bytes_only_in_b == CHUNK_SIZE + 3 and diff.chunks_only_in_b == 2
    assert diff.shared_bytes == CHUNK_SIZE + 11 + len(files["config.json"])

    doc = ok_json(run("diff", url, 1, 2, "--json"))
    assert doc["summary"]["modified"] == 1 and doc["summary"]["added"] == 1
    assert doc["summary"]["bytes_only_in_b"] == CHUNK_SIZE + 3
    assert doc["a"]["step"] == 1 and doc["b"]["step"] == 2
    text = run("diff", url, 1, 2)
    assert text.exit_code == 0 and "M model.safetensors" in text.stdout
    assert "m config.json  mode 644 -> 600" in text.stdout
    unknown = run("diff", url, 1, 9)
    assert unknown.exit_code == 3 and "Retained steps: 2, 1" in unknown.output


def test_restore_and_get_keep_modes_but_never_special_bits(memory_target, tmp_path):
    src = tmp_path / "src"
    _tree(src, 2)
    os.chmod(src / "config.json", 0o750)
    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "st", auto_gc=False)
    mgr.save_dir(1, src).result()
    mgr.close()
    old = os.umask(0o022)
    try:
        got = get_file(memory_target.url, "config.json", tmp_path / "c")
    finally:
        os.umask(old)
    assert got.mode == 0o750 and stat.S_IMODE((tmp_path / "c").stat().st_mode) == 0o750
    assert hashlib.sha256((tmp_path / "c").read_bytes()).digest()
