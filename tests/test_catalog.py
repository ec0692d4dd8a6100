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

from cloudckpt import (
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptionError,
    attempt_layout,
    manifests,
    protocol,
)
from cloudckpt.catalog import (
    diff_checkpoints,
    export_checkpoint,
    file_digest,
    get_file,
    get_files,
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
    if target.backend in ("s3", "seaweedfs"):
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
        "num_files", "retained", "stored_bytes", "stored_objects", "unreferenced_bytes",
        "unreferenced_attempts", "updated_at", "age_seconds", "writer_epoch", "problem",
    }  # fmt: skip
    table = run("runs", base, target=cloud)
    assert table.exit_code == 0 and re.search(r"b/c\s.*\s20\s", table.stdout), table.stdout
    # ls on a prefix of runs says where they are.
    ls = run("ls", base, target=cloud)
    assert ls.exit_code == 0 and "cloudckpt runs" in ls.output, ls.output
    none = run("runs", _sub(base, "nothing"), target=cloud)
    assert none.exit_code == 0 and "no runs" in none.output


@pytest.fixture(params=["seaweedfs", "s3"])
def s3_like(request):
    return request.getfixturevalue(f"{request.param}_target")


def test_runs_reports_every_byte_a_run_stores_and_what_awaits_gc(s3_like, tmp_path):
    """The issue's case: a run whose current checkpoint names every chunk in a dropped
    checkpoint's prefix (pushed again unchanged with keep_last 1), and an interrupted
    push's chunks. `runs` reported 0 B (the bytes the retained checkpoints own); it must
    report every byte of the run, and apart what no retained checkpoint references."""
    target = s3_like
    url = _sub(target.url, "exp")
    for step in (1, 2):  # the same files: step 2 names step 1's chunks
        _push(url, target.storage_options, tmp_path, step=step, seed=7, keep_last=1)
    store = open_store(url, target.storage_options)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    (dropped,) = [t.record for t in latest.tombstones]
    assert latest.current.owned_bytes == 0  # what `runs` used to sum
    # An interrupted push: its ATTEMPT.json and one chunk, referenced by nothing.
    orphan = attempt_layout.ckpt_prefix(3, 1, "20300101T000000000Z-0badc0de")
    store.put(orphan + "ATTEMPT.json", b"{}")
    blob = os.urandom(512 * 1024)
    store.put(orphan + "chunks/" + hashlib.sha256(blob).hexdigest(), blob)
    every = list(store.list(""))
    expected_unref = sum(
        o.size
        for o in every
        if o.key.startswith(orphan)
        or o.key in (dropped.ckpt + "ATTEMPT.json", dropped.manifest_key)
    )
    store.close()

    doc = ok_json(run("runs", target.url, "--json", target=target))
    (exp,) = doc["runs"]
    assert exp["stored_bytes"] == sum(o.size for o in every) > 2 * CHUNK_SIZE + len(blob)
    assert exp["stored_objects"] == len(every)
    assert exp["unreferenced_bytes"] == expected_unref > len(blob)
    assert exp["unreferenced_attempts"] == 2  # step 1's prefix (less its chunks) and the orphan
    table = run("runs", target.url, target=target)
    assert table.exit_code == 0 and "awaiting gc" in table.stdout, table.output
    assert f"({exp['unreferenced_attempts']})" in table.stdout


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


def test_get_into_a_directory_named_with_a_trailing_slash_creates_it(cloud, tmp_path):
    """`get FILE DIR/` with DIR missing writes DIR/FILE (it used to write a file named
    DIR); without the slash a missing parent is refused and nothing is created."""
    files = _push(cloud.url, cloud.storage_options, tmp_path, step=3, seed=3, big=False)
    ok_json(run("get", cloud.url, "config.json", f"{tmp_path}/weights/", "--json", target=cloud))
    assert (tmp_path / "weights" / "config.json").read_bytes() == files["config.json"]
    out = tmp_path / "new" / "deeper"
    got = run("get", cloud.url, "config.json", f"{out}/", "--json", target=cloud)
    doc = ok_json(got)
    assert out.is_dir() and (out / "config.json").read_bytes() == files["config.json"]
    assert doc["dest"] == str(out / "config.json") and doc["num_files"] == 1
    refused = run("get", cloud.url, "config.json", tmp_path / "nope" / "c.json", target=cloud)
    assert refused.exit_code == 7 and "end the destination with '/'" in refused.output
    assert not (tmp_path / "nope").exists()
    (tmp_path / "afile").write_text("x")
    assert run("get", cloud.url, "config.json", f"{tmp_path}/afile/", target=cloud).exit_code == 7
    # A file the checkpoint lacks: exit 3 before the directory is created.
    assert run("get", cloud.url, "nope", f"{tmp_path}/made/", target=cloud).exit_code == 3
    assert not (tmp_path / "made").exists()


def test_get_several_files_and_globs(seaweedfs_target, tmp_path):
    """`get URL PATH... DEST`: exact paths and globs, each file under its own path in
    DEST (created), verified; only they are read (damage elsewhere goes unnoticed, and
    costs no fallback); files that exist are refused unless --force, before anything is
    written."""
    t = seaweedfs_target
    _push(t.url, t.storage_options, tmp_path, step=1, seed=1, big=False)
    files = _push(t.url, t.storage_options, tmp_path, step=2, seed=2, big=False)
    store = open_store(t.url, t.storage_options)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    manifest = manifests.parse_manifest(store.get(latest.current.manifest_key)[0])
    (model,) = [f for f in manifest.files if f.path == "model.safetensors"]
    flip_bit(store, model.chunks[0].key, seed=5)  # not selected: never read
    store.close()
    out = tmp_path / "out"
    doc = ok_json(run("get", t.url, "*.json", "tokenizer/", out, "--json", target=t))
    assert (doc["step"], doc["skipped"], doc["num_files"]) == (2, [], 2)
    assert [(f["path"], f["dest"]) for f in doc["files"]] == [
        ("config.json", str(out / "config.json")),
        ("tokenizer/vocab.txt", str(out / "tokenizer" / "vocab.txt")),
    ]
    assert doc["dest"] == str(out) and "size" not in doc
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} == {
        "config.json", "tokenizer/vocab.txt"
    }  # fmt: skip
    assert (out / "tokenizer" / "vocab.txt").read_bytes() == files["tokenizer/vocab.txt"]
    assert all(f["digest"] == file_digest(f["dest"]) for f in doc["files"])
    # Two exact paths into the current directory's stand-in, then refused: they exist.
    again = run("get", t.url, "config.json", "tokenizer/vocab.txt", out, target=t)
    assert again.exit_code == 7, again.output
    forced = run("get", t.url, "config.json", "tokenizer/vocab.txt", out, "--step", 1,
                 "--force", target=t)  # fmt: skip
    assert forced.exit_code == 0 and "2 files of step 1" in forced.stdout, forced.output
    assert (out / "config.json").read_bytes() == b'{"seed": 1}'
    missing = run("get", t.url, "config.json", "*.bin", tmp_path / "x", target=t)
    assert missing.exit_code == 3 and "'*.bin'" in missing.output
    assert not (tmp_path / "x").exists()
    piped = run("get", t.url, "*.json", "-", target=t)
    assert piped.exit_code == 2


def test_get_files_falls_back_when_a_selected_file_is_damaged(memory_target, tmp_path):
    url = memory_target.url
    first = _push(url, {}, tmp_path, step=1, seed=1, chunking="off")
    _push(url, {}, tmp_path, step=2, seed=2, chunking="off")
    store = open_store(url)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    flip_bit(store, latest.current.ckpt + "files/tokenizer/vocab.txt", seed=3)
    got = get_files(store, ["tokenizer/", "config.json"], tmp_path / "o")
    assert got.step == 1 and [s.step for s in got.skipped] == [2]
    assert (tmp_path / "o" / "tokenizer" / "vocab.txt").read_bytes() == first["tokenizer/vocab.txt"]
    with pytest.raises(CorruptionError):
        get_files(store, ["tokenizer/vocab.txt"], tmp_path / "p", step=2)
    assert not list((tmp_path / "p").rglob("vocab.txt"))  # damaged bytes never land
    store.close()


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
    manifest = manifests.parse_manifest(store.get(latest.current.manifest_key)[0])
    last = manifest.files[-1]  # tokenizer/vocab.txt, exported last
    flip_bit(store, last.chunks[0].key, seed=1)
    dest = memory_target.url.rsplit("/", 1)[0] + "/out"
    with pytest.raises(CorruptionError, match="2 of 3 files of step 1 were exported"):
        export_checkpoint(store, dest)
    assert last.path not in {o.key for o in open_store(dest).list()}


# --------------------------------------------------------------------------- digest


def test_digest_matches_the_manifest_and_the_documented_recipes(file_target, tmp_path):
    """`cloudckpt digest` prints what the manifest records (BLAKE3), and so do the recipes
    in docs/cli.md (Python with blake3 for blake3-tree, sha256sum in a shell for
    `--algorithm sha256-tree`)."""
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
        expected = ok_json(run("digest", path, "--algorithm", "sha256-tree", "--json"))
        assert expected["algorithm"] == "sha256-tree"
        expected = expected["files"][0]["digest"]
        assert expected == file_digest(path, "sha256-tree") != out
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


def test_the_examples_of_the_new_flags_in_docs_cli_run(tmp_path, monkeypatch):
    """The page's examples of `restore --include/--exclude`, `get` with globs, `cp
    --keep-settings` and `show --commit`, run as written against a file:// run (its URL,
    the archive's and the commit id substituted)."""
    import shlex

    page = (ROOT / "docs" / "cli.md").read_text()
    flags = ("--include", "--exclude", "--keep-settings", "--commit", "'*.safetensors'")
    examples = [
        line
        for line in re.findall(r"^ *\$ (cloudckpt .*)$", page, flags=re.MULTILINE)
        if any(f in line for f in flags)
    ]
    assert len(examples) == 5, examples
    src = tmp_path / "ckpt"
    for rel in ("model.safetensors", "optimizer.pt", "rng_state.pth", "config.json",
                "tokenizer/vocab.txt"):  # fmt: skip
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(rel.encode())
    run_url, archive = f"file://{tmp_path}/runs/exp42", f"file://{tmp_path}/archive/exp42"
    pushed = ok_json(run("push", src, run_url, "--step", 4500, "--json"))
    monkeypatch.chdir(tmp_path)
    for line in examples:
        line = line.replace("s3://bucket/runs/exp42", run_url).replace(
            "s3://archive/exp42", archive
        )
        line = re.sub(r"--commit \S+", f"--commit {pushed['commit_id']}", line)
        done = run(*shlex.split(line)[1:])
        assert done.exit_code == 0, (line, done.output)
    weights = sorted(p.name for p in (tmp_path / "weights").rglob("*") if p.is_file())
    assert weights == ["config.json", "model.safetensors"]
    assert not (tmp_path / "no-optimizer" / "optimizer.pt").exists()
    assert (tmp_path / "no-optimizer" / "config.json").exists()
    assert (tmp_path / "for-inference" / "tokenizer" / "vocab.txt").exists()
    assert (tmp_path / "archive" / "exp42" / "LATEST").exists()
