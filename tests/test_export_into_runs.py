"""`export` never writes into a cloudckpt run, nor over one, `--force` or not (issue 28
item 10): a destination inside a run (a LATEST at a prefix or directory above it), the run
itself, or one holding a run (a LATEST anywhere below) is refused with exit 7 and nothing
written; `--force` still overwrites plain files. Through the CLI, on file:// (a local
directory) and on a real S3 server (moto)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloudckpt import CheckpointManager, attempt_layout, protocol
from cloudckpt.cli import cli
from cloudckpt.stores import open_store

DEST_NOT_EMPTY = 7


def _push(url: str, options: dict, tmp_path: Path, files: dict[str, bytes], step: int = 1):
    src = tmp_path / f"src-{hashlib.sha256(url.encode()).hexdigest()[:8]}-{step}"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    # Whole files (chunking off): a run's committed files lie under ckpt/<attempt>/files/,
    # under the very names an export of a checkpoint with the same paths would write.
    mgr = CheckpointManager(
        url, storage_options=options, staging_dir=tmp_path / f"st-{src.name}", chunking="off"
    )
    mgr.save_dir(step, src).result()
    mgr.close()


def _files_prefix(url: str, options: dict) -> str:
    """``ckpt/<attempt>/files/`` of the run's current checkpoint."""
    store = open_store(url, options)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    store.close()
    return latest.current.ckpt + attempt_layout.FILES_DIR


def _verify(url: str, flags: list[str]) -> None:
    result = CliRunner().invoke(cli, ["verify", url, "--all", "--read-data", *flags])
    assert result.exit_code == 0, result.output


def _export(src: str, dest: str, flags: list[str], *extra: str):
    return CliRunner().invoke(cli, ["export", src, dest, *flags, *extra])


SOURCE = {"model.bin": b"the source's weights" * 100, "config.json": b'{"source": 1}'}
THEIRS = {"model.bin": b"the other run's weights" * 100, "config.json": b'{"theirs": 1}'}


def test_export_into_or_over_a_local_run_is_refused(tmp_path):
    src = f"file://{tmp_path}/src-run"
    _push(src, {}, tmp_path, SOURCE)
    theirs = tmp_path / "runs" / "theirs"
    _push(f"file://{theirs}", {}, tmp_path, THEIRS)
    inside = theirs / _files_prefix(f"file://{theirs}", {})
    for dest, what in [
        (inside, "is inside the cloudckpt run"),  # would replace its committed files
        (theirs / "exports" / "new", "is inside the cloudckpt run"),
        (theirs, "is the cloudckpt run"),
        (tmp_path / "runs", "holds the cloudckpt run"),  # would replace the whole run
    ]:
        for as_url in (False, True):
            where = f"file://{dest}" if as_url else str(dest)
            result = _export(src, where, [], "--force")
            assert result.exit_code == DEST_NOT_EMPTY, (where, result.output)
            assert what in result.stderr and "hint: Export to a prefix outside" in result.stderr
    assert not (theirs / "exports").exists()
    assert (inside / "model.bin").read_bytes() == THEIRS["model.bin"]
    _verify(f"file://{theirs}", [])
    # --force still replaces a plain directory's files.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "old.txt").write_bytes(b"old")
    result = _export(src, str(plain), [], "--force")
    assert result.exit_code == 0, result.output
    assert (plain / "model.bin").read_bytes() == SOURCE["model.bin"]


def test_export_into_or_over_a_run_on_s3_is_refused(s3_target, moto_server, tmp_path):
    so = s3_target.storage_options
    flags = ["--endpoint-url", so["endpoint_url"], "--region", "us-east-1",
             "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]  # fmt: skip
    bucket = s3_target.url.split("/")[2]
    src = f"s3://{bucket}/src-run"
    _push(src, so, tmp_path, SOURCE)
    theirs = f"s3://{bucket}/team/theirs"
    _push(theirs, so, tmp_path, THEIRS)
    files = _files_prefix(theirs, so)
    store = open_store(f"s3://{bucket}", so)
    before = {o.key: (o.version, o.last_modified) for o in store.list("team/")}
    for dest, what in [
        (f"{theirs}/{files}", "is inside the cloudckpt run"),  # its committed files
        (f"{theirs}/exports/new", "is inside the cloudckpt run"),
        (theirs, "is a cloudckpt run"),
        (f"s3://{bucket}/team", "holds the cloudckpt run"),
        (f"s3://{bucket}", "holds the cloudckpt run"),
    ]:
        for extra in (["--force"], ["--force", "--json"], []):
            result = _export(src, dest, flags, *extra)
            assert result.exit_code == DEST_NOT_EMPTY, (dest, extra, result.output)
            if "--json" in extra:
                assert what in result.stdout and "Export to a prefix outside" in result.stdout
            elif extra:
                assert what in result.stderr, (dest, result.stderr)
    assert {
        o.key: (o.version, o.last_modified) for o in store.list("team/")
    } == before  # nothing written
    _verify(theirs, flags)
    # --force still overwrites plain objects (and only writes its own keys).
    store.put("plain/model.bin", b"an older export")
    store.put("plain/notes.txt", b"kept")
    result = _export(src, f"s3://{bucket}/plain", flags, "--force")
    assert result.exit_code == 0, result.output
    assert store.get("plain/model.bin")[0] == SOURCE["model.bin"]
    assert store.get("plain/notes.txt")[0] == b"kept"
    store.close()


@pytest.mark.parametrize("depth", [1, 3])
def test_the_python_api_refuses_a_prefix_inside_a_run(memory_target, tmp_path, depth):
    from cloudckpt.catalog import export_checkpoint
    from cloudckpt.errors import DestinationNotEmptyError

    _push(memory_target.url, {}, tmp_path, SOURCE)
    base = memory_target.url.rsplit("/", 1)[0]
    theirs = f"{base}/theirs"
    _push(theirs, {}, tmp_path, THEIRS)
    dest = theirs + "".join(f"/d{i}" for i in range(depth))
    with pytest.raises(DestinationNotEmptyError, match="is inside the cloudckpt run"):
        export_checkpoint(memory_target.url, dest)
    assert not list(open_store(theirs).list("d0/"))
