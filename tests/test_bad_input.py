"""Bad input: hostile manifests, malformed LATEST, wrong credentials, a missing bucket,
permission denied, a full staging disk, unsupported URLs, a destination that is not empty.
Each gets a clear error (its message and hint say what to do) and loses nothing: the
store and the destination are left exactly as they were.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pytest

from cloudckpt import (
    BucketNotFoundError,
    CheckpointManager,
    ConfigurationError,
    CorruptionError,
    CredentialsError,
    DestinationNotEmptyError,
    NeedsRepairError,
    NotARunError,
    PermissionDeniedError,
    StagingError,
    TransientStoreError,
    UnsupportedBackendError,
    attempt_layout,
    canonical,
    digest,
    formats,
    protocol,
)
from cloudckpt.gc import collect_garbage
from cloudckpt.stores import open_store
from cloudckpt.testing.layout import data_key


def _snapshot(store) -> dict[str, tuple[str, bytes]]:
    return {o.key: (o.version, store.get(o.key)[0]) for o in store.list("")}


def _save(mgr, step: int, data: bytes) -> None:
    handle = mgr.save(step=step)
    with handle as d:
        (d / "f").write_bytes(data)
    handle.result()


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# --- hostile manifests -----------------------------------------------------------------


def _commit_manifest(store, body: bytes, files: dict[str, bytes], step: int = 9, **record):
    """Commit a hand-made manifest ``body`` as a hostile bucket writer could."""
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    manifest = json.loads(body)
    prefix = manifest["ckpt"]
    for rel, data in files.items():
        store.put(prefix + attempt_layout.FILES_DIR + rel, data)
    store.put(prefix + attempt_layout.MANIFEST_NAME, body)
    fields = dict(
        ckpt=prefix,
        step=step,
        epoch=1,
        commit_id=manifest["commit_id"],
        manifest_sha256=hashlib.sha256(body).hexdigest(),
        manifest_size=len(body),
        committed_at="2030-01-01T00:00:00.000Z",
        total_bytes=0,
        num_files=len(manifest["files"]),
        metadata={},
    )
    fields.update(record)
    new = protocol.commit(
        latest,
        protocol.CheckpointRecord(**fields),
        latest.settings,
        canonical.parse_iso(fields["committed_at"]),
    )
    store.put(protocol.LATEST_KEY, new.to_bytes())


def _manifest(entries: list[dict], step: int = 9, **extra) -> bytes:
    attempt = "20300101T000000000Z-0badf00d"
    body = {
        "format": formats.MANIFEST_FORMAT,
        "ckpt": attempt_layout.ckpt_prefix(step, 1, attempt),
        "step": step,
        "epoch": 1,
        "commit_id": attempt,
        "writer_id": "evil",
        "created_at": "t",
        "metadata": {},
        # A /1 manifest, as cloudckpt wrote before BLAKE3.
        "digest": {"algorithm": digest.SHA256_TREE, "chunk_size": digest.CHUNK_SIZE},
        "files": entries,
        "total_bytes": sum(e["size"] for e in entries),
        **extra,
    }
    return canonical.seal(body)


def _entry(path: str, data: bytes, **override) -> dict:
    tree = digest.tree_digest(data, algorithm=digest.SHA256_TREE)
    return {"path": path, "size": len(data), "digest": tree, **override}


PWNED = b"pwned"
HOSTILE = {
    "absolute path": ([_entry("/tmp/cloudckpt-evil", PWNED)], {}, "absolute"),
    "dot-dot": ([_entry("../escape", PWNED)], {}, "'..'"),
    "dot-dot inside": ([_entry("a/../../b", PWNED)], {}, "'..'"),
    "backslash": ([_entry("..\\evil", PWNED)], {}, "illegal"),
    "huge size": ([_entry("f", PWNED, size=1 << 60)], {}, "out of range"),
    "size beyond the object": ([_entry("f", PWNED, size=10**9)], {"f": PWNED}, "bytes"),
    "wrong digest": ([_entry("f", b"other")], {"f": PWNED}, "digest"),
    "duplicate path": ([_entry("f", PWNED), _entry("f", PWNED)], {"f": PWNED}, "twice"),
    "file is a directory": ([_entry("a", PWNED), _entry("a/b", PWNED)], {}, "directory"),
    "missing file": ([_entry("f", PWNED)], {}, "missing"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_falls_back_and_writes_nothing_outside(memory_target, tmp_path, case):
    entries, files, reason = HOSTILE[case]
    store = open_store(memory_target.url)
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s")
    _save(mgr, 1, b"good")
    _commit_manifest(store, _manifest(entries), files)
    before = _snapshot(store)
    dest = tmp_path / "deep" / "dest"
    res = mgr.restore(into=dest)
    assert res.step == 1 and _tree(dest) == {"f": b"good"}
    assert [s.step for s in res.skipped] == [9] and reason in res.skipped[0].reason
    outside = [p for p in tmp_path.rglob("*") if p.is_file() and p.read_bytes() == PWNED]
    assert outside == [] and not Path("/tmp/cloudckpt-evil").exists()
    assert _snapshot(store) == before  # a restore writes nothing
    mgr.close()


def test_manifest_that_does_not_match_its_record_is_refused(memory_target, tmp_path):
    store = open_store(memory_target.url)
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s")
    _save(mgr, 1, b"good")
    body = _manifest([_entry("f", PWNED)])
    # LATEST records another size and digest than the manifest that is stored.
    _commit_manifest(store, body, {"f": PWNED}, manifest_sha256="0" * 64)
    res = mgr.restore(into=tmp_path / "d")
    assert res.step == 1 and "digest LATEST recorded" in res.skipped[0].reason
    mgr.close()


def test_nothing_intact_raises_with_every_reason(memory_target, tmp_path):
    store = open_store(memory_target.url)
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s")
    mgr.resume(into=tmp_path / "empty")
    _commit_manifest(store, _manifest([_entry("../x", PWNED)]), {})
    with pytest.raises(CorruptionError) as err:
        mgr.restore(into=tmp_path / "d")
    assert "'..'" in str(err.value) and "cloudckpt verify" in str(err.value)
    assert err.value.skipped and not (tmp_path / "d").exists()
    mgr.close()


# --- malformed LATEST ------------------------------------------------------------------


def _reseal(data: bytes, **changes) -> bytes:
    body = json.loads(data)
    body.update(changes)
    return canonical.seal(body)


BAD_LATEST = {
    "truncated": lambda d: d[: len(d) // 2],
    "empty": lambda d: b"",
    "not json": lambda d: b"\x00\xffnot json",
    "a json list": lambda d: b"[1, 2]",
    "edited without resealing": lambda d: d.replace(b'"seq":2', b'"seq":3'),
    # A sealed LATEST in a format this version does not read is a newer version's, not
    # damage: refused with no fallback (tests/test_newer_format.py).
    "broken seq chain": lambda d: _reseal(d, parent_seq=7),
    "field of the wrong type": lambda d: _reseal(d, seq="2"),
    "hostile checkpoint prefix": lambda d: _reseal(
        d, current={**json.loads(d)["current"], "ckpt": "../../etc/"}
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LATEST))
def test_malformed_latest_needs_repair_and_nothing_changes(memory_target, tmp_path, case):
    store = open_store(memory_target.url)
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s", auto_gc=False)
    _save(mgr, 1, b"one")
    mgr.close()
    good, _ = store.get(protocol.LATEST_KEY)
    assert b'"seq":2' in good
    store.put(protocol.LATEST_KEY, BAD_LATEST[case](good))
    before = _snapshot(store)
    # A writer refuses (resume, or the claim of a first save), and GC refuses.
    writer = CheckpointManager(store, staging_dir=tmp_path / "w")
    with pytest.raises(NeedsRepairError, match="cloudckpt repair"):
        writer.resume(into=tmp_path / "r")
    handle = writer.save(step=2)
    with handle as d:
        (d / "f").write_bytes(b"two")
    with pytest.raises(NeedsRepairError):
        handle.result()
    with pytest.raises(NeedsRepairError):
        collect_garbage(store)
    assert _snapshot(store) == before
    # A reader falls back to the commit records, loudly.
    res = writer.restore(into=tmp_path / "read")
    assert res.from_commit_records and res.step == 1 and _tree(res.path) == {"f": b"one"}
    assert _snapshot(store) == before
    # The failed save's error already reached its caller through handle.result(), so
    # close() does not raise it a second time; it still leaves the store untouched.
    writer.close()
    assert _snapshot(store) == before


# --- a full staging disk ---------------------------------------------------------------


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["fsync", "journal", "mkdir"])
def test_full_staging_disk_fails_the_save_cleanly(memory_target, tmp_path, monkeypatch, where):
    store = open_store(memory_target.url)
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s")
    _save(mgr, 1, b"one")
    before = _snapshot(store)
    with monkeypatch.context() as m:
        if where == "fsync":  # the disk fills while the staged files are flushed
            m.setattr(os, "fsync", _enospc)
        elif where == "journal":
            m.setattr(os, "replace", _enospc)
        else:
            m.setattr(Path, "mkdir", _enospc)
        with pytest.raises(StagingError, match="staging disk is full") as err:
            _save(mgr, 2, b"two")
    assert "Free space" in str(err.value)
    snapshot = _snapshot(store)
    assert snapshot[protocol.LATEST_KEY] == before[protocol.LATEST_KEY]
    assert {k for k in snapshot if not k.startswith("ckpt/")} == {
        k for k in before if not k.startswith("ckpt/")
    }
    _save(mgr, 3, b"three")  # space again: saving works
    assert mgr.latest().step == 3
    with contextlib.suppress(StagingError):  # close() may report the failed save again
        mgr.close()


def test_restore_that_does_not_fit_fails_before_writing(memory_target, tmp_path, monkeypatch):
    import shutil

    import cloudckpt.restore as restore_mod

    # keep_local=0: a new host (a kept local copy would be linked, needing no space).
    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s", keep_local=0)
    _save(mgr, 1, b"x" * 1000)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(restore_mod.shutil, "disk_usage", lambda p: usage._replace(free=10))
    with pytest.raises(StagingError, match="needs 1000 bytes") as err:
        mgr.restore(into=tmp_path / "d")
    assert "Free space" in str(err.value) and not (tmp_path / "d").exists()
    assert not list(tmp_path.glob(".d.cloudckpt-tmp-*"))
    mgr.close()


# --- URLs, buckets, destinations -------------------------------------------------------


@pytest.mark.parametrize(
    "url, error, hint",
    [
        ("ftp://ftp.invalid/run", UnsupportedBackendError, "unsafe_single_writer"),
        ("http://example.invalid/run", UnsupportedBackendError, "compare-and-swap"),
        ("zip://nothing", UnsupportedBackendError, "create-only"),
        ("nosuchscheme://x/y", ConfigurationError, "Install the fsspec implementation"),
        ("s3://", ConfigurationError, "s3://BUCKET/prefix"),
        ("s3://bucket/run?versionId=1", ConfigurationError, "storage_options"),
        ("", ConfigurationError, "s3://bucket"),
        ("file://remotehost/x", ConfigurationError, "file:///absolute/path"),
    ],
)
def test_unsupported_urls_are_refused_before_any_io(url, error, hint, tmp_path):
    with pytest.raises(error) as err:
        CheckpointManager(url, staging_dir=tmp_path / "s")
    assert hint in str(err.value)


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("s3:/ckpts/runs/x", "s3://ckpts/runs/x"),
        ("s3//ckpts/runs/x", "s3://ckpts/runs/x"),
        ("s3:ckpts/runs/x", "s3://ckpts/runs/x"),
        ("gs:/bucket/run", "gs://bucket/run"),
        ("az:container/run", "az://container/run"),
        ("memory:/b/run", "memory://b/run"),
        ("https:/host/run", "https://host/run"),
        ("file:relrun", "file://{cwd}/relrun"),
        ("file:/abs/run", "file:///abs/run"),
    ],
)
def test_mistyped_urls_are_refused_naming_the_url_meant(typed, meant, tmp_path, monkeypatch):
    """A URL whose "://" is mistyped is not a local directory (./s3:/ckpts/...): writers
    and readers refuse it, say which URL it probably meant, and create nothing."""
    monkeypatch.chdir(tmp_path)
    meant = meant.format(cwd=tmp_path)
    calls = (
        lambda: open_store(typed),
        lambda: open_store(typed, writable=False),
        lambda: CheckpointManager(typed, staging_dir=tmp_path / "s"),
    )
    for call in calls:
        with pytest.raises(ConfigurationError) as err:
            call()
        assert f"did you mean {meant}" in str(err.value), str(err.value)
        assert f"./{typed}" in err.value.hint  # how to say "a local directory" on purpose
    assert list(tmp_path.iterdir()) == []


def test_local_paths_that_only_look_odd_still_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in ("relrun", "./s3:/explicitly-local", str(tmp_path / "abs:run"), "s3/bucket"):
        mgr = CheckpointManager(path, staging_dir=tmp_path / "s")
        _save(mgr, 1, path.encode())
        mgr.close()
        assert (tmp_path / path / protocol.LATEST_KEY).is_file()


def _user_checkpoint(root: Path) -> dict[str, bytes]:
    files = {"config.json": b"{}", "model.safetensors": os.urandom(4096)}
    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return files


def test_a_writer_refuses_a_directory_that_is_not_a_run(tmp_path):
    """A trainer (or push with swapped arguments) pointed at a user's checkpoint directory
    must not write LATEST, ckpt/ and commits/ into it."""
    target = tmp_path / "checkpoint-500"
    files = _user_checkpoint(target)
    mgr = CheckpointManager(str(target), staging_dir=tmp_path / "s")
    with pytest.raises(NotARunError) as err:
        mgr.resume(into=tmp_path / "r")
    assert "holds 'config.json'" in str(err.value) and "Nothing was written" in str(err.value)
    handle = mgr.save(step=1)
    with handle as d:
        (d / "f").write_bytes(b"x")
    with pytest.raises(NotARunError):
        handle.result()
    mgr.close()
    assert sorted(os.listdir(target)) == sorted(files)  # no LATEST, ckpt/, .cloudckpt/
    assert _tree(target) == files
    # An empty directory, or one holding only empty directories, is a fine new run.
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    mgr = CheckpointManager(str(tmp_path / "empty"), staging_dir=tmp_path / "s2")
    assert mgr.resume(into=tmp_path / "r2") is None
    _save(mgr, 1, b"one")
    mgr.close()


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_a_writer_refuses_a_prefix_that_holds_other_objects(backend, request, tmp_path):
    """The same on object stores: a prefix holding objects cloudckpt did not write (another
    tool's files, or other runs below it) is not started as a run."""
    target = request.getfixturevalue(f"{backend}_target")
    runs = target.url.rsplit("/", 1)[0] + "/runs"
    mgr = CheckpointManager(
        runs + "/exp1", storage_options=target.storage_options, staging_dir=tmp_path / "s"
    )
    _save(mgr, 1, b"one")
    mgr.close()
    other = target.url + "-other"
    open_store(other, target.storage_options).put("data/model.bin", b"theirs")
    for url, named in ((runs, "exp1/LATEST"), (other, "data/model.bin")):
        store = open_store(url, target.storage_options)
        before = _snapshot(store)
        mgr = CheckpointManager(store, staging_dir=tmp_path / "s")
        with pytest.raises(NotARunError) as err:
            mgr.resume(into=tmp_path / "r")
        assert f"holds {named!r}" in str(err.value)
        mgr.close()
        assert _snapshot(store) == before


def test_save_dir_of_an_empty_directory_saves_an_empty_checkpoint_loudly(
    memory_target, tmp_path, caplog
):
    """save_dir() of a directory without files commits an empty checkpoint (a rank of a
    distributed save may have nothing to add), with a warning; `cloudckpt push` refuses."""
    (tmp_path / "src" / "sub").mkdir(parents=True)
    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        mgr.save_dir(3, tmp_path / "src").result()
    assert any("holds no files" in r.getMessage() for r in caplog.records)
    assert mgr.restore(into=tmp_path / "r").num_files == 0
    mgr.close()


def test_an_unreachable_server_is_an_error_not_an_empty_run(refused_url, tmp_path):
    """fsspec's HTTP backend reports a refused connection as FileNotFoundError; read as
    "no LATEST", a job that starts fresh when no checkpoint exists would throw away its
    training. Every read must fail instead, saying the server could not be reached."""
    mgr = CheckpointManager(refused_url, staging_dir=tmp_path / "s", unsafe_single_writer=True)
    calls = {
        "latest": mgr.latest,
        "list": mgr.list,
        "restore": lambda: mgr.restore(into=tmp_path / "r"),
        "resume": lambda: mgr.resume(into=tmp_path / "r"),
        "store.list": lambda: list(open_store(refused_url, writable=False).list("")),
        "store.get": lambda: open_store(refused_url, writable=False).get("LATEST"),
    }
    for name, call in calls.items():
        with pytest.raises(TransientStoreError) as err:
            call()
        text = str(err.value)
        assert "could not reach the server" in text and "Connect call failed" in text, name
        assert "Check the host and port" in text, name
    mgr.close()
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_missing_bucket_is_not_an_empty_run(backend, moto_server, gcs_server, tmp_path):
    server = moto_server if backend == "s3" else gcs_server
    scheme = "s3" if backend == "s3" else "gs"
    url = f"{scheme}://no-such-bucket-cloudckpt/run"
    mgr = CheckpointManager(
        url, storage_options=server.storage_options(), staging_dir=tmp_path / "s"
    )
    with pytest.raises(BucketNotFoundError) as err:
        mgr.resume(into=tmp_path / "r")
    assert "no-such-bucket-cloudckpt" in str(err.value) and "create the bucket" in str(err.value)
    with pytest.raises(BucketNotFoundError):
        mgr.restore(into=tmp_path / "r")
    assert not (tmp_path / "r").exists()
    mgr.close()


def test_destination_not_empty_is_refused_and_left_alone(memory_target, tmp_path):
    store = open_store(memory_target.url)
    mgr = CheckpointManager(store, staging_dir=tmp_path / "s")
    _save(mgr, 1, b"one")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_bytes(b"precious")
    latest_before = store.get(protocol.LATEST_KEY)
    for call in (mgr.restore, CheckpointManager(store, staging_dir=tmp_path / "w").resume):
        with pytest.raises(DestinationNotEmptyError) as err:
            call(into=dest)
        assert "overwrite=True" in str(err.value)
        assert _tree(dest) == {"mine.txt": b"precious"}
        assert not list(tmp_path.glob(".dest.cloudckpt-*"))
    # resume() refused before claiming: the writer was not fenced by a bad argument.
    assert store.get(protocol.LATEST_KEY) == latest_before
    _save(mgr, 2, b"two")
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"x")
    with pytest.raises(DestinationNotEmptyError, match="not a directory"):
        mgr.restore(into=a_file)
    res = mgr.restore(into=dest, overwrite=True)  # explicit: replaces it
    assert res.step == 2 and _tree(dest) == {"f": b"two"}
    mgr.close()


# --- credentials and permissions (a moto server that checks signatures and IAM) --------


@pytest.fixture(scope="module")
def iam_moto():
    from cloudckpt.testing.moto_server import MotoServer

    with MotoServer() as server:
        iam = server.client().__class__
        import boto3

        kw = dict(
            endpoint_url=server.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="trainer")
        deny_delete = {
            "Version": "2012-10-17",
            "Statement": [
                {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
                {"Effect": "Deny", "Action": "s3:DeleteObject", "Resource": "*"},
            ],
        }
        iam.put_user_policy(
            UserName="trainer", PolicyName="no-delete", PolicyDocument=json.dumps(deny_delete)
        )
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        server.create_bucket("iam-bucket")
        server.enforce_auth()
        options = {
            "endpoint_url": server.endpoint_url,
            "key": key["AccessKeyId"],
            "secret": key["SecretAccessKey"],
            "client_kwargs": {"region_name": "us-east-1"},
        }
        yield server, options


def test_wrong_credentials_are_reported_as_such(iam_moto, tmp_path):
    _server, options = iam_moto
    wrong = {**options, "key": "AKIAWRONGWRONGWRONG1", "secret": "WrongSecretWrongSecret"}
    mgr = CheckpointManager(
        "s3://iam-bucket/wrong", storage_options=wrong, staging_dir=tmp_path / "s"
    )
    with pytest.raises(CredentialsError) as err:
        mgr.resume(into=tmp_path / "r")
    assert "rejected the credentials" in str(err.value) and "storage_options" in str(err.value)
    assert "WrongSecretWrongSecret" not in str(err.value) + repr(err.value)
    mgr.close()


def test_permission_denied_on_delete_stops_gc_and_loses_nothing(iam_moto, tmp_path):
    _server, options = iam_moto
    url = "s3://iam-bucket/denied"
    mgr = CheckpointManager(
        url,
        storage_options=options,
        staging_dir=tmp_path / "s",
        keep_last=1,
        gc_grace=5,  # the shortest S3's whole-second clock allows a few seconds of upload
        auto_gc=False,
    )
    _save(mgr, 1, b"one")
    _save(mgr, 2, b"two")  # step 1 becomes a tombstone
    time.sleep(6.2)  # past grace on the store's (1 s resolution) clock
    with pytest.raises(PermissionDeniedError) as err:
        mgr.gc()
    assert "access denied" in str(err.value) and "permissions listed in" in str(err.value)
    store = open_store(url, options)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert latest.current.step == 2
    res = mgr.restore(into=tmp_path / "r")
    assert res.step == 2 and _tree(res.path) == {"f": b"two"}
    # The manifest of the tombstone could not be deleted, so neither could its data.
    (tomb,) = latest.tombstones
    assert store.exists(tomb.record.manifest_key)
    assert store.exists(data_key(store, tomb.record, "f"))
    mgr.close()


# --- destinations behind symbolic links; a disk that fills during the restore ----------


def _leftovers(*dirs: Path) -> list[str]:
    return sorted(p.name for d in dirs for p in d.iterdir() if ".cloudckpt-" in p.name)


@pytest.mark.parametrize("through", ["restore", "resume", "cli"])
@pytest.mark.parametrize("existing", [False, True], ids=["empty", "overwrite"])
@pytest.mark.parametrize("link", ["destination", "parent"])
def test_restore_into_a_symlinked_directory_writes_through_the_link(
    memory_target, tmp_path, through, existing, link
):
    """``/ckpt -> /mnt/nvme/ckpt``: the files land in the link's target, the link stays
    a link, and nothing is left beside either (with and without overwrite)."""
    from click.testing import CliRunner

    from cloudckpt.cli import cli

    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    _save(mgr, 1, b"one")
    mgr.close()
    real = tmp_path / "mnt" / "nvme" / "ckpt"
    real.mkdir(parents=True)
    if existing:
        (real / "old.txt").write_bytes(b"old")
    if link == "destination":
        into = tmp_path / "ckpt"
        into.symlink_to(real, target_is_directory=True)
        links = {into: real}
    else:  # a link higher up: /data -> /mnt/nvme, restoring into /data/ckpt
        (tmp_path / "data").symlink_to(real.parent, target_is_directory=True)
        into = tmp_path / "data" / "ckpt"
        links = {tmp_path / "data": real.parent}

    if through == "cli":
        argv = ["restore", memory_target.url, str(into)] + (["--force"] if existing else [])
        result = CliRunner().invoke(cli, argv)
        assert result.exit_code == 0, result.output
    else:
        reader = CheckpointManager(memory_target.url, staging_dir=tmp_path / "r")
        call = reader.restore if through == "restore" else reader.resume
        res = call(into=into, overwrite=existing)
        assert res.step == 1 and res.path == into
        reader.close()
    assert _tree(real) == {"f": b"one"}
    for path, target in links.items():
        assert path.is_symlink() and Path(os.readlink(path)) == target
    assert _leftovers(tmp_path, real.parent) == []


def test_restore_into_an_unusable_link_is_refused_clearly(memory_target, tmp_path):
    """A link to nothing (an unmounted volume, say), a link to a file, a link higher up
    to nothing: refused before anything is written (CLI: exit 7; a link to a file is
    already refused as bad usage, exit 2, by the argument's type)."""
    from click.testing import CliRunner

    from cloudckpt.cli import cli

    mgr = CheckpointManager(memory_target.url, staging_dir=tmp_path / "s")
    _save(mgr, 1, b"one")
    (tmp_path / "dangling").symlink_to(tmp_path / "unmounted" / "ckpt")
    (tmp_path / "a-file").write_bytes(b"x")
    (tmp_path / "to-a-file").symlink_to(tmp_path / "a-file")
    (tmp_path / "gone").symlink_to(tmp_path / "unmounted")
    cases = {
        tmp_path / "dangling": "which does not exist",
        tmp_path / "to-a-file": "is not a directory",
        tmp_path / "gone" / "ckpt": "which does not exist",
    }
    for into, reason in cases.items():
        for overwrite in (False, True):
            with pytest.raises(DestinationNotEmptyError, match=reason) as err:
                mgr.restore(into=into, overwrite=overwrite)
            assert "--force" not in err.value.hint or "directory" in err.value.hint
        result = CliRunner().invoke(cli, ["restore", memory_target.url, str(into), "--force"])
        if into.name == "to-a-file":
            assert result.exit_code == 2 and "is a file" in result.stderr, result.output
        else:
            assert result.exit_code == 7 and reason in result.stderr, result.output
        assert "this is a bug" not in result.output
    assert not (tmp_path / "unmounted").exists()
    assert (tmp_path / "a-file").read_bytes() == b"x"
    assert _leftovers(tmp_path) == []
    mgr.close()


@pytest.mark.parametrize("chunking", ["tensor", "off"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_disk_that_fills_during_a_restore_is_a_staging_error(
    memory_target, tmp_path, monkeypatch, chunking, code
):
    """The free-space check passed, then the disk filled (another process, a quota): the
    write fails. Injected at the write call (os.pwrite) here; for real on a tmpfs in
    ``test_a_full_tmpfs_during_a_restore``. The destination keeps what it held."""
    from click.testing import CliRunner

    from cloudckpt.cli import cli

    mgr = CheckpointManager(
        memory_target.url, staging_dir=tmp_path / "s", chunking=chunking, keep_local=0
    )
    _save(mgr, 1, b"x" * 300_000)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_bytes(b"precious")
    writes = []

    def full(*args, **kwargs):
        writes.append(args[0])
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(StagingError) as err:
        mgr.restore(into=dest, overwrite=True)
    assert writes  # the fault fired
    message = str(err.value)
    assert "needs 300000 bytes in " + str(tmp_path) in message
    assert ("filled up" if code == errno.ENOSPC else "quota") in message
    assert "destination is as it was" in message
    assert _tree(dest) == {"mine.txt": b"precious"} and _leftovers(tmp_path) == []

    result = CliRunner().invoke(cli, ["restore", memory_target.url, str(dest), "--force"])
    assert result.exit_code == 1, result.output
    assert "cloudckpt: error: restoring step 1 needs 300000 bytes" in result.stderr
    assert "this is a bug" not in result.output and "Traceback" not in result.output
    assert _tree(dest) == {"mine.txt": b"precious"} and _leftovers(tmp_path) == []
    mgr.close()


def test_a_full_tmpfs_during_a_restore(tmp_path):
    """For real: a 4 MiB tmpfs, mounted in a private mount namespace (needs root, as in
    this project's sandbox and CI), fills up after the free-space check when another file
    takes the space. And the mount point itself is refused as a destination: a finished
    restore is renamed into place, which cannot replace a mount point."""
    import subprocess
    import sys

    url = f"file://{tmp_path / 'store'}"
    mgr = CheckpointManager(url, staging_dir=tmp_path / "s")
    _save(mgr, 1, os.urandom(2 * 1024 * 1024))
    mgr.close()
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    script = Path(__file__).parent / "scripts" / "restore_on_tmpfs.py"
    shell = 'mount -t tmpfs -o size=4m tmpfs "$1" && exec "$2" "$3" "$4" "$1"'
    namespace = ["unshare", "--mount", "--propagation", "private"]
    proc = subprocess.run(
        [*namespace, "sh", "-c", shell, "_", str(mount), sys.executable, str(script), url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["statvfs_blocks"] > 0  # the script ran on the tmpfs
    assert out["mount point"]["error"] == "DestinationNotEmptyError"
    assert "is a mount point" in out["mount point"]["message"]
    assert out["fired"] == 1
    assert out["disk full"]["error"] == "StagingError", out
    assert f"needs {2 * 1024 * 1024} bytes in {mount}" in out["disk full"]["message"]
    assert "filled up" in out["disk full"]["message"]
    assert out["dest"] == ["mine.txt"] and out["left"] == ["dest", "filler"]
    assert list(mount.iterdir()) == []  # the tmpfs was never visible outside
