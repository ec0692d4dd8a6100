"""Every ``cloudckpt`` command against moto (S3) and fake-gcs-server (GCS): normal use, the
``--json`` shapes, exit codes, bad input, damage and repair."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloudckpt import FencedError, protocol
from cloudckpt.cli import EXIT_CODE_TABLE, cli, exit_code_for
from cloudckpt.stores import open_store
from cloudckpt.testing.faults import flip_bit
from cloudckpt.testing.layout import data_key
from cloudckpt.testing.proxy import FaultProxy, ProxyRule

MiB = 1024 * 1024


@pytest.fixture(params=["s3", "gcs"])
def cloud(request):
    return request.getfixturevalue(f"{request.param}_target")


def as_typed_at_a_terminal() -> None:
    """``preexec_fn`` of a CLI process a test interrupts with SIGINT, as Ctrl-C would: its
    SIGINT at the default action. A shell that runs the tests in the background (``cmd &``
    without job control, as ``nohup ... &`` does) starts them with SIGINT ignored, which a
    child inherits; Ctrl-C never reaches such a process, and the CLI rightly leaves an
    ignored SIGINT ignored (the test would wait for an interrupt that cannot come)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def flags(target) -> list[str]:
    """Storage flags that reach the test server (what a user would type)."""
    so = target.storage_options
    if target.backend == "s3":
        return [
            "--endpoint-url",
            so["endpoint_url"],
            "--region",
            "us-east-1",
            "-o",
            f"key={so['key']}",
            "-o",
            f"secret={so['secret']}",
        ]
    return ["--endpoint-url", so["endpoint_url"], "-o", "token=anon", "-o", "project=test"]


def run(*args, target=None):
    argv = [str(a) for a in args] + (flags(target) if target is not None else [])
    return CliRunner().invoke(cli, argv)


def ok_json(result):
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}"
    return json.loads(result.stdout)


def make_tree(root: Path, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {
        "model.bin": rng.randbytes(3 * MiB + 17),
        "optimizer/state.bin": rng.randbytes(50_000),
        "optimizer/empty": b"",
        "trainer_state.json": b'{"global_step": %d}' % seed,
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("mode", ["tensor", "off"])
def test_push_chunking_flag(file_target, tmp_path, mode):
    """push --chunking: by default a second push of the same files uploads nothing new and
    names the first push's chunks; --chunking off stores whole files every time."""
    files = make_tree(tmp_path / "ck", 7)
    url = file_target.url
    for step in (1, 2):
        args = ["push", tmp_path / "ck", url, "--step", step, "--chunking", mode, "--force"]
        ok_json(run(*args, "--json"))
    second = ok_json(run("ls", url, "--json"))["checkpoints"][0]
    assert second["step"] == 2 and second["total_bytes"] == sum(map(len, files.values()))
    shown = ok_json(run("show", url, "--step", 2, "--json"))["manifest"]
    if mode == "off":
        assert second["shared_bytes"] == 0 and not shown["chunked"]
    else:
        assert second["shared_bytes"] == second["total_bytes"] and shown["chunked"]
    bad = run("push", tmp_path / "ck", url, "--step", 3, "--chunking", "sometimes")
    assert bad.exit_code == 2 and "sometimes" in bad.output


def test_chunking_flag_offers_every_mode():
    from cloudckpt.chunks import MODES
    from cloudckpt.cli._common import chunking_option

    @chunking_option
    def command(chunking):  # pragma: no cover - only the option is inspected
        pass

    assert tuple(command.__click_params__[0].type.choices) == MODES


def test_push_ls_show_restore_verify_pin_gc(cloud, tmp_path):
    url = cloud.url
    empty = ok_json(run("ls", url, "--json", target=cloud))
    assert empty["checkpoints"] == [] and empty["writer"] is None

    first = make_tree(tmp_path / "ck10", 10)
    doc = ok_json(
        run(
            "push",
            tmp_path / "ck10",
            url,
            "--step",
            10,
            "-m",
            "loss:=0.5",
            "-m",
            "note=first",
            "--json",
            target=cloud,
        )
    )
    assert doc["step"] == 10 and doc["num_files"] == 4 and doc["epoch"] == 1
    assert doc["metadata"] == {"loss": 0.5, "note": "first"} and doc["fenced_writer"] is None
    assert doc["total_bytes"] == sum(map(len, first.values()))

    # The run now has a writer that wrote LATEST seconds ago (this very process): a second
    # push would fence it, so it needs --force.
    second = make_tree(tmp_path / "ck20", 20)
    refused = run("push", tmp_path / "ck20", url, "--step", 20, target=cloud)
    assert refused.exit_code == 5, refused.output
    assert "fences that writer" in refused.stderr and "--force" in refused.stderr
    doc = ok_json(run("push", tmp_path / "ck20", url, "--step", 20, "--force", "--json",
                      target=cloud))  # fmt: skip
    assert doc["epoch"] == 2 and doc["fenced_writer"]["epoch"] == 1
    assert doc["fenced_writer"]["active"] is True

    listing = ok_json(run("ls", url, "--json", target=cloud))
    assert set(listing) == {
        "url", "seq", "writer", "settings", "from_commit_records", "warnings", "checkpoints",
        "tombstones",
    }  # fmt: skip
    assert [c["step"] for c in listing["checkpoints"]] == [20, 10]
    assert [c["current"] for c in listing["checkpoints"]] == [True, False]
    assert listing["writer"]["epoch"] == 2 and listing["from_commit_records"] is False
    assert set(listing["checkpoints"][0]) == {
        "step", "commit_id", "ckpt", "epoch", "committed_at", "num_files", "total_bytes",
        "owned_bytes", "shared_bytes", "current", "pins", "metadata", "metrics", "kept_because",
    }  # fmt: skip
    for c in listing["checkpoints"]:  # chunked by default: what it stores + what it names
        assert c["owned_bytes"] + c["shared_bytes"] == c["total_bytes"]
    assert listing["checkpoints"][1]["shared_bytes"] == 0  # the first shares nothing
    human = run("ls", url, target=cloud)
    assert human.exit_code == 0 and "current" in human.stdout and "writer epoch 2" in human.stdout

    shown = ok_json(run("show", url, "--step", 10, "--json", target=cloud))
    assert shown["step"] == 10 and shown["metadata"]["note"] == "first"
    assert {f["path"]: f["size"] for f in shown["manifest"]["files"]} == {
        k: len(v) for k, v in first.items()
    }
    assert shown["manifest"]["chunked"] and shown["manifest"]["shared_bytes"] == 0
    assert all(f["shared_chunks"] == 0 for f in shown["manifest"]["files"])
    human = run("show", url, target=cloud).stdout
    assert "model.bin" in human and "owns" in human and "shares" in human

    dest = tmp_path / "restored"
    restored = ok_json(run("restore", url, dest, "--json", target=cloud))
    assert restored["step"] == 20 and restored["skipped"] == [] and restored["path"] == str(dest)
    assert read_tree(dest) == second

    again = run("restore", url, dest, "--step", 10, target=cloud)
    assert again.exit_code == 7 and "--force" in again.stderr
    assert read_tree(dest) == second, "a refused restore touched DEST"
    assert run("restore", url, tmp_path / "x", "--step", 99, target=cloud).exit_code == 3
    assert run("restore", url, dest, "--step", 10, "--force", target=cloud).exit_code == 0
    assert read_tree(dest) == first
    assert not [p for p in tmp_path.iterdir() if "cloudckpt-tmp" in p.name]

    verified = ok_json(run("verify", url, "--all", "--read-data", "--json", target=cloud))
    assert verified["ok"] and verified["exit_code"] == 0
    assert [c["status"] for c in verified["checkpoints"]] == ["ok", "ok"]
    assert verified["checkpoints"][1]["bytes_read"] == sum(map(len, first.values()))

    pinned = ok_json(run("pin", url, 10, "--label", "best", "--json", target=cloud))
    assert [(p["step"], p["label"]) for p in pinned["pins"]] == [(10, "best")]
    listing = ok_json(run("ls", url, "--json", target=cloud))
    assert listing["checkpoints"][1]["pins"] == ["best"]
    assert run("pin", url, 99, target=cloud).exit_code == 3
    assert ok_json(run("unpin", url, 10, "--json", target=cloud))["pins"] == []

    gc = ok_json(run("gc", url, "--dry-run", "--json", target=cloud))
    assert gc["dry_run"] and gc["deleted_objects"] == 0 and not gc["deleted_orphans"]
    assert run("repair", url, target=cloud).stdout.count("nothing to repair") == 1


def test_bad_input_exit_codes(cloud, tmp_path):
    url = cloud.url
    scheme = url.split("://")[0]
    bad_url = run("ls", f"{scheme}://", target=cloud)
    assert bad_url.exit_code == 2 and "no bucket name" in bad_url.stderr
    other_bucket = url.replace("://", "://no-such-bucket-", 1)
    missing = run("ls", other_bucket, target=cloud)
    assert missing.exit_code == 3, missing.output
    assert run("show", url, target=cloud).exit_code == 3  # empty run
    assert run("restore", url, tmp_path / "d", target=cloud).exit_code == 3
    assert not (tmp_path / "d").exists()
    assert run("verify", url, target=cloud).exit_code == 3
    assert run("push", tmp_path / "nope", url, "--step", 1, target=cloud).exit_code == 2
    assert run("push", tmp_path, url, target=cloud).exit_code == 2  # --step is required
    assert run("ls", url, "-o", "novalue", target=cloud).exit_code == 2
    assert run("ls", url, "-o", "x:={bad json", target=cloud).exit_code == 2
    if cloud.backend == "s3":  # (gcsfs accepts any keyword, so GCS cannot refuse one)
        unknown = run("ls", url, "-o", "bogus_option=1", target=cloud)
        assert unknown.exit_code == 2 and "bogus_option" in unknown.stderr
    else:
        assert run("ls", url, "--profile", "p", target=cloud).exit_code == 2
    assert run("frobnicate").exit_code == 2

    # --json errors are machine-readable too.
    err = run("show", url, "--step", 5, "--json", target=cloud)
    assert err.exit_code == 3
    assert json.loads(err.stdout)["error"]["type"] == "CheckpointNotFoundError"
    assert json.loads(err.stdout)["error"]["exit_code"] == 3
    assert "Traceback" not in err.output


def test_push_refuses_mistyped_urls_locations_that_are_not_runs_and_empty_dirs(
    tmp_path, monkeypatch
):
    """Each of these used to exit 0 having written somewhere the user did not mean: a
    mistyped URL became a local directory (./s3:/ckpts/...), swapped arguments wrote a run
    into the user's checkpoint, an empty directory became the current checkpoint."""
    monkeypatch.chdir(tmp_path)
    ck = tmp_path / "out" / "checkpoint-500"
    ck.mkdir(parents=True)
    files = make_tree(ck, 5)
    for typed, meant in (
        ("s3:/ckpts/runs/x", "s3://ckpts/runs/x"),
        ("s3//ckpts/runs/x", "s3://ckpts/runs/x"),
        ("s3:ckpts/runs/x", "s3://ckpts/runs/x"),
        ("file:relrun", f"file://{tmp_path}/relrun"),
    ):
        for argv in (
            ["push", ck, typed, "--step", 500],
            ["ls", typed],
            ["restore", typed, tmp_path / "dest"],
            ["watch", tmp_path / "out", typed, "--once"],
        ):
            result = run(*argv)
            assert result.exit_code == 2, (argv, result.output)
            assert f"did you mean {meant}" in result.stderr, (argv, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing was created

    # A real run, then push with its arguments swapped: into the user's checkpoint.
    ok_json(run("push", ck, "run", "--step", 500, "--json"))
    swapped = run("push", "run", ck, "--step", 500)
    assert swapped.exit_code == 2, swapped.output
    assert "is not empty and is not a cloudckpt run" in swapped.stderr
    assert "takes the local checkpoint directory first" in swapped.stderr
    assert read_tree(ck) == files and not (ck / ".cloudckpt").exists()
    # watch refuses such a location at once, not at its first upload.
    watched = run("watch", tmp_path / "out", ck, "--once")
    assert watched.exit_code == 2 and "not a cloudckpt run" in watched.stderr, watched.output

    (tmp_path / "empty" / "sub").mkdir(parents=True)
    empty = run("push", tmp_path / "empty", "run", "--step", 600)
    assert empty.exit_code == 2 and "holds no files" in empty.stderr, empty.output
    assert [c["step"] for c in ok_json(run("ls", "run", "--json"))["checkpoints"]] == [500]
    fresh = run("push", tmp_path / "empty", "new-run", "--step", 1)
    assert fresh.exit_code == 2 and not (tmp_path / "new-run").exists()


def test_every_command_parses_its_url_once(monkeypatch, tmp_path):
    """The URL argument is split and checked once, when the command line is read; the
    store is opened from that parsed URL (ls used to split it twice, watch three times)."""
    import cloudckpt.stores

    make_tree(tmp_path / "src", 3)
    make_tree(tmp_path / "out" / "checkpoint-9", 9)
    (tmp_path / "out" / "checkpoint-9" / ".complete").touch()
    url = f"file://{tmp_path}/run"
    ok_json(run("push", tmp_path / "src", url, "--step", 3, "--json"))
    calls: list[str] = []
    split_url = cloudckpt.stores.split_url

    def counted(text: str) -> tuple[str, str, str]:
        calls.append(text)
        return split_url(text)

    monkeypatch.setattr(cloudckpt.stores, "split_url", counted)
    for argv in (
        ["ls", url],
        ["show", url],
        ["restore", url, tmp_path / "dest"],
        ["verify", url],
        ["pin", url, 3],
        ["unpin", url, 3],
        ["gc", url, "--dry-run"],
        ["repair", url, "--dry-run"],
        ["push", tmp_path / "src", url, "--step", 4, "--force"],
        ["watch", tmp_path / "out", url, "--once", "--settle", "0"],
    ):
        calls.clear()
        result = run(*argv)
        assert result.exit_code == 0, (argv, result.output)
        assert calls == [url], argv
    assert [c["step"] for c in ok_json(run("ls", url, "--json"))["checkpoints"]] == [9, 4, 3]


def test_watch_opens_its_store_with_every_storage_flag(refused_url, tmp_path):
    """watch opens its one store with every storage flag, --unsafe-single-writer included:
    on http:// (no conditional writes) the flag gets it as far as the server (refused here:
    exit 9). The flag used to be dropped on the way to the watcher, so the backend was
    refused as unsafe (exit 2) whatever the flag said."""
    (tmp_path / "out").mkdir()
    refused = run("watch", tmp_path / "out", refused_url, "--once", "--unsafe-single-writer")
    assert refused.exit_code == 9, refused.output
    assert "could not reach the server" in refused.stderr
    unsafe = run("watch", tmp_path / "out", refused_url, "--once")
    assert unsafe.exit_code == 2 and "--unsafe-single-writer" in unsafe.stderr, unsafe.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_unreachable_server_exits_9_and_a_served_run_reads_over_http(refused_url, tmp_path):
    """ls/show/restore/verify through fsspec's HTTP backend: a refused connection is "the
    store is unreachable" (exit 9), never an empty run; a 404 is an empty run; a run served
    by a web server lists, shows, restores and verifies."""
    from cloudckpt.testing.static_http import StaticHTTPServer

    for argv in (
        ["ls", refused_url],
        ["show", refused_url],
        ["restore", refused_url, tmp_path / "dest"],
        ["verify", refused_url],
    ):
        result = run(*argv, "--json")
        assert result.exit_code == 9, (argv, result.output)
        assert "could not reach the server" in result.stderr, (argv, result.stderr)
        assert "Connect call failed" in result.stderr
        assert json.loads(result.stdout)["error"]["type"] == "TransientStoreError"
    assert not (tmp_path / "dest").exists()

    files = make_tree(tmp_path / "src", 9)
    ok_json(run("push", tmp_path / "src", tmp_path / "www" / "run", "--step", 7, "--json"))
    with StaticHTTPServer(tmp_path / "www") as server:
        url = f"{server.url}/run"
        listed = ok_json(run("ls", url, "--json"))
        assert [c["step"] for c in listed["checkpoints"]] == [7]
        assert ok_json(run("show", url, "--json"))["num_files"] == len(files)
        restored = ok_json(run("restore", url, tmp_path / "dest", "--json"))
        assert restored["step"] == 7 and read_tree(tmp_path / "dest") == files
        verified = ok_json(run("verify", url, "--all", "--read-data", "--json"))
        assert verified["exit_code"] == 0
        assert 206 in server.statuses  # ranged reads were served as ranges
        seen = len(server.statuses)
        nothing = ok_json(run("ls", f"{server.url}/no-run-here", "--json"))
        assert nothing["checkpoints"] == [] and 404 in server.statuses[seen:]


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_damage_fallback_and_repair(cloud, manager_factory, tmp_path, damage):
    url = cloud.url
    store = open_store(url, cloud.storage_options)
    writer = manager_factory(cloud, auto_gc=False)
    for step in (1, 2):
        with writer.save(step=step) as d:
            (d / "w.bin").write_bytes(bytes([step]) * 100_000)
        writer.wait()
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    step2 = latest.current

    # A bit flip in step 2's data: only --read-data sees it; restore falls back to step 1.
    flip_bit(store, data_key(store, step2, "w.bin"), seed=1)
    assert run("verify", url, target=cloud).exit_code == 0
    bad = run("verify", url, "--read-data", "--json", target=cloud)
    assert bad.exit_code == 4
    doc = json.loads(bad.stdout)
    assert not doc["ok"] and doc["checkpoints"][0]["status"] == "damaged"
    assert "does not match its digest" in doc["checkpoints"][0]["reasons"][0]
    human = run("verify", url, "--read-data", target=cloud)
    assert human.exit_code == 4 and "damaged" in human.stdout
    fallback = ok_json(run("restore", url, tmp_path / "r", "--json", target=cloud))
    assert fallback["step"] == 1 and [s["step"] for s in fallback["skipped"]] == [2]
    assert (
        "skipping the checkpoint of step 2"
        in run("restore", url, tmp_path / "r2", target=cloud).stderr
    )

    # LATEST lost or damaged: reads fall back loudly, writes stop with "needs repair".
    if damage == "missing":
        store.delete(protocol.LATEST_KEY)
    else:
        flip_bit(store, protocol.LATEST_KEY, seed=2)
    listing = run("ls", url, "--json", target=cloud)
    assert listing.exit_code == 0 and json.loads(listing.stdout)["from_commit_records"] is True
    assert "cloudckpt repair" in listing.stderr
    make_tree(tmp_path / "src", 3)
    for args in (
        ("push", tmp_path / "src", url, "--step", 3),
        ("pin", url, 1),
        ("gc", url, "--dry-run"),
        ("verify", url),
    ):
        result = run(*args, target=cloud)
        assert result.exit_code == 6, (args, result.output)
        assert "cloudckpt repair" in result.stderr + result.stdout

    dry = ok_json(run("repair", url, "--dry-run", "--json", target=cloud))
    assert dry["action"] == "would-rebuild"
    fixed = ok_json(run("repair", url, "--json", target=cloud))
    assert fixed["action"] == "rebuilt" and fixed["current_step"] == 2
    assert fixed["epoch"] > latest.writer.epoch and fixed["seq"] > latest.seq
    assert fixed["latest_state"] == {"missing": "missing", "corrupt": "damaged"}[damage]
    assert ok_json(run("repair", url, "--json", target=cloud))["action"] == "healthy"

    # The writer from before is fenced; the CLI may write again without --force (the
    # run's writer is now `repair`, which is not a process that keeps committing).
    with pytest.raises(FencedError):
        with writer.save(step=3) as d:
            (d / "w.bin").write_bytes(b"zombie")
        writer.wait()
    pushed = ok_json(run("push", tmp_path / "src", url, "--step", 3, "--json", target=cloud))
    assert pushed["epoch"] == fixed["epoch"] + 1
    assert [c["step"] for c in ok_json(run("ls", url, "--json", target=cloud))["checkpoints"]] == [
        3, 2, 1,
    ]  # fmt: skip
    store.close()


def test_exit_code_table_is_what_the_code_does():
    from cloudckpt import errors

    codes = dict(EXIT_CODE_TABLE)
    assert exit_code_for(errors.DestinationNotEmptyError("x")) == 7 and 7 in codes
    assert exit_code_for(errors.NeedsRepairError("x")) == 6 and 6 in codes
    assert exit_code_for(errors.FencedError("x")) == 5
    assert exit_code_for(errors.CorruptionError("x")) == 4
    assert exit_code_for(errors.CheckpointNotFoundError("x")) == 3
    assert exit_code_for(errors.BucketNotFoundError("x")) == 3
    assert exit_code_for(errors.ConfigurationError("x")) == 2
    assert exit_code_for(errors.CredentialsError("x")) == 8
    assert exit_code_for(errors.OutcomeUnknownError("x")) == 9
    assert exit_code_for(errors.StagingError("x")) == 1
    assert exit_code_for(RuntimeError("x")) == 1
    documented = Path(__file__).parent.parent / "docs" / "cli.md"
    text = documented.read_text()
    for code, _ in EXIT_CODE_TABLE:
        assert f"| {code} " in text, f"exit code {code} is not documented in docs/cli.md"


# --- as a real process: environment variables, secrets, interrupts ------------------------


def cloudckpt(*args, env=None, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt.cli", *map(str, args)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


def test_environment_configures_stores_and_secrets_are_never_printed(
    s3_target, gcs_target, tmp_path
):
    secret = "Sup3rS3cretValue-do-not-print"
    aws = {
        "AWS_ENDPOINT_URL": s3_target.storage_options["endpoint_url"],
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID0000",
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": "us-east-1",
    }
    make_tree(tmp_path / "src", 1)
    pushed = cloudckpt("push", tmp_path / "src", s3_target.url, "--step", 1, env=aws)
    assert pushed.returncode == 0, pushed.stderr
    # That push's process has exited, so a second push needs no --force.
    pushed = cloudckpt("push", tmp_path / "src", s3_target.url, "--step", 2, "--json", env=aws)
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["fenced_writer"]["active"] is False
    listed = cloudckpt("ls", s3_target.url, "--json", env=aws)
    assert [c["step"] for c in json.loads(listed.stdout)["checkpoints"]] == [2, 1]

    gcs = {"STORAGE_EMULATOR_HOST": gcs_target.storage_options["endpoint_url"]}
    listed = cloudckpt("ls", gcs_target.url, "-o", "token=anon", "--json", env=gcs)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["checkpoints"] == []

    failures = [
        cloudckpt("-vv", "ls", s3_target.url.replace("://", "://missing-"), env=aws),
        cloudckpt(
            "ls",
            s3_target.url.replace("://", "://missing-"),
            "-o",
            f"secret={secret}",
            "-o",
            "key=AKIAEXAMPLEKEYID0000",
            "--json",
            env=aws,
        ),
    ]
    for failed in failures:
        assert failed.returncode == 3, failed.stderr
        assert "cloudckpt: error: bucket 'missing-" in failed.stderr
        assert secret not in failed.stdout + failed.stderr
    assert "Traceback" in failures[0].stderr  # -vv shows it (and still no secret)
    assert "Traceback" not in failures[1].stderr
    assert json.loads(failures[1].stdout)["error"]["exit_code"] == 3


def _data_put(target: str) -> bool:
    """A PUT of checkpoint data: a multipart part, or a chunk (the default layout)."""
    return "partNumber=" in target or "/chunks/" in target


def test_interrupted_restore_leaves_dest_as_it_was(s3_target, manager_factory, tmp_path):
    from cloudckpt import TransferConfig

    mgr = manager_factory(s3_target, auto_gc=False, transfer=TransferConfig(concurrency=4))
    with mgr.save(step=1) as d:
        (d / "big.bin").write_bytes(random.Random(1).randbytes(64 * MiB))
        (d / "small.txt").write_bytes(b"new")
    mgr.wait()
    env = {"AWS_EC2_METADATA_DISABLED": "true"}
    parent = tmp_path / "area"
    dest = parent / "dest"
    dest.mkdir(parents=True)
    (dest / "old.txt").write_bytes(b"the previous contents")

    def interrupted(sig) -> tuple[int, str]:
        # Every GET of big.bin is held on its way to moto for longer than the test, so the
        # signal always lands while the download is in progress, however fast or loaded
        # this machine is (a request still held when the proxy stops never reaches moto).
        with FaultProxy(s3_target.storage_options["endpoint_url"], stall_seconds=600) as proxy:
            # (big.bin is stored as chunks: hold every chunk's GET, not the listings.)
            rule = proxy.add(
                ProxyRule(
                    "stall",
                    methods={"GET"},
                    path=lambda t: "big.bin" in t or ("/chunks/" in t and "prefix=" not in t),
                )
            )
            args = flags(s3_target)
            args[args.index("--endpoint-url") + 1] = proxy.endpoint_url
            proc = subprocess.Popen(
                [sys.executable, "-m", "cloudckpt.cli", "restore", s3_target.url, str(dest),
                 "--force", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, **env},
                preexec_fn=as_typed_at_a_terminal,
            )  # fmt: skip
            # Interrupt once the temporary directory beside DEST holds the preallocated file
            # and big.bin's first range request is held.
            while proc.poll() is None:
                tmps = [p for p in parent.iterdir() if "cloudckpt-tmp" in p.name]
                if tmps and (tmps[0] / "big.bin").exists() and rule.fired:
                    break
                time.sleep(0.01)
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
        return proc.returncode, err.decode(errors="replace")

    # Ctrl-C (and SIGTERM): DEST untouched, the temporary directory cleaned up.
    for sig, code in ((2, 130), (15, 130)):
        returncode, err = interrupted(sig)
        assert returncode == code, err
        # Cleanup finished by itself (the exit watchdog did not have to cut it short).
        assert "did not finish" not in err, err
        assert read_tree(dest) == {"old.txt": b"the previous contents"}
        assert sorted(p.name for p in parent.iterdir()) == ["dest"]

    # SIGKILL (no cleanup possible): DEST is still exactly as it was.
    returncode, _ = interrupted(9)
    assert returncode == -9
    assert read_tree(dest) == {"old.txt": b"the previous contents"}

    # And a restore that runs to the end replaces it.
    done = cloudckpt("restore", s3_target.url, dest, "--force", *flags(s3_target), env=env)
    assert done.returncode == 0, done.stderr
    assert read_tree(dest)["small.txt"] == b"new" and "old.txt" not in read_tree(dest)


def test_interrupted_push_flushes_once_and_abandons_on_the_second_signal(s3_target, tmp_path):
    store = open_store(s3_target.url, s3_target.storage_options)

    def push(step: int, signals: int, size: int, via: str) -> subprocess.CompletedProcess:
        src = tmp_path / f"src{step}"
        src.mkdir()
        (src / "big.bin").write_bytes(random.Random(step).randbytes(size))
        args = flags(s3_target)
        args[args.index("--endpoint-url") + 1] = via
        proc = subprocess.Popen(
            [sys.executable, "-m", "cloudckpt.cli", "push", str(src), s3_target.url,
             "--step", str(step), "--force", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=as_typed_at_a_terminal,
        )  # fmt: skip
        prefix = f"ckpt/{step:012d}-"
        while proc.poll() is None and not any(store.list(prefix)):
            time.sleep(0.01)  # until the attempt's ATTEMPT.json is in the bucket
        assert proc.poll() is None, "the push finished before it could be interrupted"
        seen = []
        for _ in range(signals):
            proc.send_signal(15)
            # Wait until the push has handled this signal before sending the next one: two
            # SIGTERMs that arrive before Python runs its handler coalesce into one.
            while proc.poll() is None:
                line = proc.stderr.readline()
                seen.append(line)
                if "interrupted" in line or not line:
                    break
        out, err = proc.communicate(timeout=120)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(seen) + err)

    # Every part upload is held on its way to moto, so no push can finish before its
    # signals arrive, however fast or loaded this machine is: for a few seconds where the
    # push must then commit, for longer than the test where it must not (a request still
    # held when the proxy stops never reaches moto).
    endpoint = s3_target.storage_options["endpoint_url"]
    with FaultProxy(endpoint, stall_seconds=4) as proxy:
        proxy.add(ProxyRule("stall", methods={"PUT"}, path=_data_put))
        flushed = push(1, signals=1, size=32 * MiB, via=proxy.endpoint_url)
    assert flushed.returncode == 0, flushed.stderr
    assert "waiting for the upload in progress to commit" in flushed.stderr
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert latest.current.step == 1

    with FaultProxy(endpoint, stall_seconds=600) as proxy:
        proxy.add(ProxyRule("stall", methods={"PUT"}, path=_data_put))
        abandoned = push(2, signals=2, size=32 * MiB, via=proxy.endpoint_url)
    assert abandoned.returncode == 130, abandoned.stderr
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    assert latest.current.step == 1 and [r.step for r in latest.retained()] == [1]
    assert any(store.list("ckpt/000000000002-")), "the abandoned attempt should stay for GC"
    store.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_ends_the_process_even_when_cleanup_hangs(tmp_path, sig):
    """Ctrl-C/SIGTERM always end a command: if its cleanup is stuck (here: forever), the
    exit watchdog ends the process after the grace period with 130 and the stacks of all
    threads, to show where it was stuck."""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import threading, time, click\n"
        "from cloudckpt.cli import _common, main\n"
        "from cloudckpt.cli._main import cli\n"
        "_common.CLEANUP_GRACE = 1.0\n"
        "@cli.command('stuck')\n"
        "def stuck():\n"
        "    try:\n"
        "        print('ready', flush=True)\n"
        "        time.sleep(600)\n"
        "    finally:\n"
        "        threading.Event().wait()  # a cleanup that never returns\n"
        "main()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script), "stuck"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=as_typed_at_a_terminal,
    )
    try:
        assert proc.stdout.readline() == b"ready\n"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    text = err.decode()
    assert "did not finish within 1 s; exiting now" in text
    assert "in stuck" in text  # the dump shows the stuck frame


# --- restore: a checkpoint collected under it, a linked destination, a full disk -------


@pytest.fixture
def slow_reader_run(tmp_path, monkeypatch):
    """A memory:// run whose writer commits step 2 (dropping step 1) and whose GC deletes
    step 1, past the grace period on the store's clock, just before the CLI's restore reads
    step 1's first chunk. Yields (url, the fault rule)."""
    import cloudckpt.stores
    from cloudckpt import CheckpointManager
    from cloudckpt.gc import collect_garbage
    from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket
    from cloudckpt.testing.faults import Callback, FaultInjectingStore, Rule

    clock, name = ManualClock(), f"cli-{random.getrandbits(32):08x}"
    store = MemoryStore(name, "run", clock=clock)
    mgr = CheckpointManager(
        store, staging_dir=tmp_path / "w", keep_last=1, gc_grace=60, auto_gc=False
    )
    with mgr.save(1) as d:
        (d / "w.bin").write_bytes(b"1" * 5000)
    mgr.wait()

    def train_and_collect() -> None:
        with mgr.save(2) as d:
            (d / "w.bin").write_bytes(b"2" * 5000)
        mgr.wait()
        clock.advance(120)
        assert [s for s, _ in collect_garbage(store).deleted_checkpoints] == [1]

    rule = Rule(Callback(before=train_and_collect), ops={"get_range"}, key="ckpt/*/chunks/*")
    opened = cloudckpt.stores.open_store
    monkeypatch.setattr(
        cloudckpt.stores, "open_store", lambda *a, **k: FaultInjectingStore(opened(*a, **k), [rule])
    )
    yield f"memory://{name}/run", rule
    mgr.close()
    drop_memory_bucket(name)


def test_restore_of_a_checkpoint_collected_under_it_restores_the_current_one(
    slow_reader_run, tmp_path
):
    url, rule = slow_reader_run
    result = run("restore", url, tmp_path / "out", "--json")
    assert rule.fired == 1
    doc = ok_json(result)  # not exit 4 ("damaged"): nothing is damaged
    assert doc["step"] == 2 and (tmp_path / "out" / "w.bin").read_bytes() == b"2" * 5000
    (skipped,) = doc["skipped"]
    assert skipped["step"] == 1 and skipped["dropped"] is True
    # One warning for the one event (it once took three: reader, restore and the CLI).
    (warning,) = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
    assert "step 1" in warning and "dropped by retention" in warning
    assert "restoring step 2" in warning


def test_restore_of_a_step_collected_under_it_is_not_found(slow_reader_run, tmp_path):
    url, rule = slow_reader_run
    result = run("restore", url, tmp_path / "out", "--step", 1)
    assert rule.fired == 1
    assert result.exit_code == 3, result.output
    assert "no longer retains step 1" in result.stderr and "this is a bug" not in result.output
    assert not (tmp_path / "out").exists()
