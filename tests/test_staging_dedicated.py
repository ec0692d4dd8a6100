"""A manager deletes only what cloudckpt wrote in its staging directory (issue 28 item 9).

The user's own directories under ``staging_dir/attempts/``, ``staging_dir/committed/`` or
``staging_dir/dcp/`` (no cloudckpt markers) are never deleted: the manager refuses the
staging directory with a clear error and touches nothing. Files of the user's beside
cloudckpt's (in the staging directory itself) are left alone and do not stop it. A
half-written attempt of cloudckpt's (its journal never landed) is cleaned up by recovery.
Real directories on the local disk; a real run on file://; the CLI as documented.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloudckpt import CheckpointManager, ConfigurationError, attempt_layout
from cloudckpt.cli import cli


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its SHA-256 (what must stay exactly as it was), but
    the manager's lock file (created empty by the manager that refuses)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != ".lock"
    }


def _users_files(staging: Path) -> dict[str, str]:
    """The user's files: in the staging directory itself, and in directories under
    ``attempts/`` and ``committed/`` that carry none of cloudckpt's markers."""
    files = {
        "notes.txt": b"my notes",
        "mydata/weights.bin": b"\x00" * 4096 + b"mine",
        "attempts/y/important.bin": b"the user's experiment",
        "attempts/y/journal.json": b'{"not": "cloudckpt"}',  # a journal that is not ours
        "committed/x/model.pt": b"a model the user keeps here",
        "committed/x/files/a": b"a files/ dir, as cloudckpt's would have",
    }
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}


def _half_written_attempt(staging: Path) -> Path:
    """An attempt a crashed cloudckpt left before its journal landed: its directory (named
    by an attempt id) with an empty ``files/`` and the journal's temporary file."""
    attempt_id = attempt_layout.new_attempt_id(dt.datetime.now(dt.timezone.utc))
    half = staging / "attempts" / attempt_id
    (half / "files").mkdir(parents=True)
    (half / "journal.json.tmp").write_bytes(b'{"id": "' + attempt_id.encode())
    return half


def _save(mgr: CheckpointManager, step: int, tmp_path: Path) -> None:
    with mgr.save(step=step) as d:
        (d / "model.bin").write_bytes(b"step %d" % step * 1000)
    mgr.wait()


def test_a_staging_directory_with_the_users_directories_is_refused_and_nothing_deleted(
    file_target, tmp_path
):
    staging = tmp_path / "staging"
    first = CheckpointManager(file_target.url, staging_dir=staging)
    _save(first, 1, tmp_path)
    first.close()
    assert list((staging / "committed").iterdir())  # cloudckpt's own local copy

    mine = _users_files(staging)
    half = _half_written_attempt(staging)
    before = _tree(staging)
    with pytest.raises(ConfigurationError) as err:
        CheckpointManager(file_target.url, staging_dir=staging)
    message = str(err.value)
    assert "attempts/y" in message and "committed/x" in message, message
    assert "nothing was deleted" in message
    assert "dedicated staging directory" in err.value.hint
    assert _tree(staging) == before  # not one file touched, cloudckpt's included
    assert half.is_dir()

    # The refusal released the lock: with the user's directories moved out, a manager
    # starts, cleans the half-written attempt up, and restores from its local copy.
    for rel in ("attempts/y", "committed/x"):
        (staging / rel).rename(tmp_path / rel.replace("/", "-"))
    again = CheckpointManager(file_target.url, staging_dir=staging)
    assert not half.exists()
    assert again.restore(into=tmp_path / "out").step == 1
    _save(again, 2, tmp_path)
    again.close()
    left = _tree(staging)
    for rel in ("notes.txt", "mydata/weights.bin"):  # the user's files beside cloudckpt's
        assert left[rel] == mine[rel]
    moved = _tree(tmp_path / "attempts-y") | _tree(tmp_path / "committed-x")
    assert sorted(moved.values()) == sorted(
        mine[r] for r in mine if r.startswith(("attempts/", "committed/"))
    )


@pytest.mark.parametrize(
    "where",
    ["attempts/plain-file", "committed/link", "dcp/mine/a.distcp", "attempts/{id}/mine.txt"],
)
def test_any_entry_cloudckpt_did_not_write_is_refused(file_target, tmp_path, where):
    """A file (not a directory), a link, a directory under dcp/ not named by a DCP writer's
    token, and even an attempt-named directory holding a file cloudckpt never writes."""
    staging = tmp_path / "staging"
    rel = where.format(id=attempt_layout.new_attempt_id(dt.datetime.now(dt.timezone.utc)))
    target = staging / rel
    target.parent.mkdir(parents=True)
    if where.startswith("committed/link"):
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "data").write_bytes(b"linked")
        target.symlink_to(tmp_path / "elsewhere")
    else:
        target.write_bytes(b"the user's")
    before = _tree(staging) | _tree(tmp_path / "elsewhere" if "link" in where else staging)
    with pytest.raises(ConfigurationError, match="did not write"):
        CheckpointManager(file_target.url, staging_dir=staging)
    after = _tree(staging) | _tree(tmp_path / "elsewhere" if "link" in where else staging)
    assert after == before


def test_the_users_files_beside_cloudckpts_do_not_stop_a_manager(file_target, tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "README").write_bytes(b"the user's")
    (staging / "results").mkdir()
    (staging / "results" / "metrics.csv").write_bytes(b"step,loss\n1,0.5\n")
    before = _tree(staging)
    mgr = CheckpointManager(file_target.url, staging_dir=staging)
    _save(mgr, 1, tmp_path)
    mgr.close()
    mgr = CheckpointManager(file_target.url, staging_dir=staging)  # recovery ran again
    mgr.close()
    after = _tree(staging)
    assert {k: after[k] for k in before} == before


def test_push_refuses_such_a_staging_directory_with_a_hint(file_target, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(b"weights")
    staging = tmp_path / "staging"
    (staging / "attempts" / "experiment-7").mkdir(parents=True)
    (staging / "attempts" / "experiment-7" / "log.txt").write_bytes(b"the user's log")
    result = CliRunner().invoke(
        cli, ["push", str(src), file_target.url, "--step", "1", "--staging-dir", str(staging)]
    )
    assert result.exit_code == 2, result.output
    assert "attempts/experiment-7" in result.stderr
    assert "hint: Choose a dedicated staging directory" in result.stderr
    assert (staging / "attempts" / "experiment-7" / "log.txt").read_bytes() == b"the user's log"


def test_the_attempt_name_form_is_protocols():
    """Start-up recognises cloudckpt's attempts by the form attempt_layout.new_attempt_id gives."""
    from cloudckpt.staging import ATTEMPT_ID

    for _ in range(50):
        assert ATTEMPT_ID.fullmatch(attempt_layout.new_attempt_id(dt.datetime.now(dt.timezone.utc)))
