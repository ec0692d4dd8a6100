"""Every command's ``--json`` output against the schema docs/cli.md writes for it (issue 25
item 7), so that the page and the code cannot drift: each command runs against a real store
(moto S3; a memory:// run on a manual clock where GC needs ages), in the states that fill
its optional parts (empty run, pins, tombstones, chunks, damage, a rebuilt LATEST, GC that
deletes; the catalog commands with and without a skipped checkpoint, `cp` into a second
bucket new and then fencing, `runs` of a healthy and a needs-repair run), and each document must have exactly the fields its block lists, of their types.
Watch events are checked here for a real ``cloudckpt watch`` process (and in
tests/test_watch.py for every event its tests see); the demo's report in tests/test_demo.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from cli_schema import assert_matches, check, parse
from click.testing import CliRunner

from cloudckpt import CheckpointManager, protocol
from cloudckpt.cli import cli
from cloudckpt.stores import open_store
from cloudckpt.testing.faults import flip_bit
from cloudckpt.testing.layout import data_key

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = parse()


def _json_commands() -> set[str]:
    return {
        name
        for name, command in cli.commands.items()
        if any(getattr(p, "name", None) == "as_json" for p in command.params)
    }


def _event_kinds_in_code() -> set[str]:
    text = (ROOT / "cloudckpt" / "watch.py").read_text()
    text += (ROOT / "cloudckpt" / "cli" / "_watch.py").read_text()
    return set(re.findall(r'"event": "([a-z_]+)"', text))


def test_every_command_with_json_has_a_schema_block_and_every_block_a_command():
    documented = {name.split()[0] for name in SCHEMAS} - {"error"}
    assert _json_commands() == documented, "docs/cli.md, JSON output: one block per command"
    events = {n.split("=", 1)[1] for n in SCHEMAS if n.startswith("watch event=")}
    assert events == _event_kinds_in_code(), "docs/cli.md: one block per watch event"
    assert "error" in SCHEMAS


def test_the_checker_reports_undocumented_missing_and_mistyped_fields():
    """The check itself, on a block written as the docs say blocks are written."""
    schema = parse(
        "<!-- json: x -->\n"
        "- `a` integer: a number\n"
        "- `b` object|null: an object\n"
        "  - `c` array[string]: strings,\n"
        "    continued on a second line\n"
        "- `d`? string: optional\n"
        "- `m` object*: anything\n"
    )["x"]
    good = {"a": 1, "b": {"c": ["x"]}, "m": {"any": [1]}}
    assert check(good, schema) == [] and check({**good, "b": None, "d": "s"}, schema) == []
    assert check({**good, "e": 1}, schema) == ["$.e: not documented"]
    assert check({"b": None, "m": {}}, schema) == ["$.a: documented but missing"]
    assert check({**good, "a": True}, schema) == ["$.a: True is not integer"]
    assert check({**good, "b": {"c": [1]}}, schema) == ["$.b.c[0]: 1 is not string"]


# --------------------------------------------------------------------------- commands


class Runner:
    """Runs commands against one target with its storage flags; checks every JSON
    document printed, and remembers which commands it checked."""

    def __init__(self, target: Any) -> None:
        self.target = target
        so = target.storage_options
        self.flags = ["--endpoint-url", so["endpoint_url"], "-o", f"key={so['key']}"]
        self.flags += ["-o", f"secret={so['secret']}"]
        self.checked: set[str] = set()

    def json(
        self, *args: Any, code: int = 0, schema: str | None = None, store: bool = True
    ) -> dict[str, Any]:
        """Run ``args --json`` (with the storage flags unless not ``store``: ``digest``
        opens no store), expecting exit ``code``; the document, checked."""
        argv = [str(a) for a in args]
        result = CliRunner().invoke(cli, [*argv, "--json", *(self.flags if store else [])])
        assert result.exit_code == code, (argv, result.output)
        doc = json.loads(result.stdout)
        name = schema or ("error" if "error" in doc and len(doc) == 1 else argv[0])
        assert_matches(doc, name, SCHEMAS)
        self.checked.add(name)
        return doc


def _tree(root: Path, seed: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.safetensors").write_bytes(bytes([seed]) * 300_000)
    (root / "config.json").write_text(json.dumps({"seed": seed}))
    return root


def test_each_command_prints_what_its_schema_block_says(s3_target, moto_server, tmp_path):
    r = Runner(s3_target)
    url = s3_target.url
    bucket = url.removeprefix("s3://").split("/")[0]
    # cp's destination: another bucket on the same server
    copy_bucket = f"s3-copy-{uuid.uuid4().hex[:12]}"
    moto_server.create_bucket(copy_bucket)
    copy_url = f"s3://{copy_bucket}/copy"
    empty = r.json("ls", url)
    assert empty["writer"] is None and empty["checkpoints"] == []

    metrics = 'metrics:={"eval_loss": 0.31, "eval_accuracy": 0.9}'
    first = r.json("push", _tree(tmp_path / "s1", 1), url, "--step", 1, "-m", metrics)
    assert first["fenced_writer"] is None
    # --force: the first push's writer is this (live) process, so it counts as active.
    second = r.json(
        "push", _tree(tmp_path / "s2", 2), url, "--step", 2, "-m", "loss:=0.2", "--force"
    )
    assert second["fenced_writer"]["epoch"] == first["epoch"]
    r.json("push", _tree(tmp_path / "s3", 3), url, "--step", 3, "--keep-last", 2,
           "--chunking", "off", "--force")  # fmt: skip
    r.json("pin", url, 2, "--label", "best")
    listing = r.json("ls", url)
    assert [c["step"] for c in listing["checkpoints"]] == [3, 2]
    assert listing["tombstones"][0]["step"] == 1 and listing["checkpoints"][1]["pins"]
    assert r.json("show", url, "--step", 2)["manifest"]["chunked"] is True
    assert r.json("show", url)["manifest"]["chunked"] is False
    assert r.json("verify", url, "--all", "--read-data")["ok"] is True
    r.json("unpin", url, 2)
    _catalog_commands(r, url, bucket, copy_url, tmp_path)
    r.json("gc", url, "--dry-run")
    assert r.json("repair", url)["action"] == "healthy"
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    error = r.json("restore", url, tmp_path / "busy", code=7)
    assert error["error"]["type"] == "DestinationNotEmptyError"

    # Damage: the newest checkpoint's data, then LATEST itself.
    store = open_store(url, s3_target.storage_options)
    latest = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    flip_bit(store, data_key(store, latest.current, "model.safetensors"), seed=3)
    damaged = r.json("verify", url, "--read-data", code=4)
    assert damaged["checkpoints"][0]["status"] == "damaged"
    restored = r.json("restore", url, tmp_path / "out")
    assert restored["step"] == 2 and restored["skipped"][0]["step"] == 3
    _catalog_commands_past_damage(r, url, copy_url, tmp_path)
    flip_bit(store, protocol.LATEST_KEY, seed=4)
    assert r.json("ls", url)["from_commit_records"] is True
    got = r.json("get", url, "config.json", tmp_path / "from-records.json")
    assert got["from_commit_records"] is True and got["step"] == 3  # its data is intact
    broken = r.json("runs", f"s3://{bucket}/")["runs"]
    assert [(x["path"], x["status"]) for x in broken] == [("run", "needs-repair")]
    assert broken[0]["step"] is None and broken[0]["problem"]
    assert r.json("verify", url, code=6)["needs_repair"] is True
    plan = r.json("repair", url, "--dry-run")
    assert plan["writes"][0]["mode"] == "compare-and-swap" and "version" in plan["writes"][0]
    assert r.json("repair", url)["action"] == "rebuilt"
    store.close()
    assert r.checked >= _json_commands() - {"gc", "watch", "demo"} | {"error"}


def _catalog_commands(r: Runner, url: str, bucket: str, copy_url: str, tmp_path: Path) -> None:
    """runs, diff, digest, get, export and cp on the intact run (steps 3 and 2 retained;
    2 chunked, 3 stored whole), each document checked against its block."""
    found = r.json("runs", f"s3://{bucket}/", "--depth", 2)
    assert [(x["path"], x["status"], x["step"]) for x in found["runs"]] == [("run", "ok", 3)]
    assert found["runs"][0]["retained"] == 2 and found["runs"][0]["problem"] is None
    diff = r.json("diff", url, 2, 3)
    assert diff["summary"]["modified"] == 2 and diff["summary"]["chunks_only_in_b"] == 0
    assert {f["new_chunks"] for f in diff["files"]} == {None}  # step 3 stores files whole
    back = r.json("diff", url, 3, 2)  # step 2 is chunked: each file's new chunks
    assert all(f["new_chunks"] and f["new_bytes"] == f["size_b"] for f in back["files"])
    digest = r.json("digest", tmp_path / "s2" / "model.safetensors", store=False)
    manifest = r.json("show", url, "--step", 2)["manifest"]
    recorded = {f["path"]: f["digest"] for f in manifest["files"]}
    assert digest["files"][0]["digest"] == recorded["model.safetensors"]
    got = r.json("get", url, "config.json", tmp_path / "got.json", "--step", 2)
    assert (tmp_path / "got.json").read_text() == json.dumps({"seed": 2})
    assert got["step"] == 2 and got["skipped"] == [] and got["digest"] == recorded["config.json"]
    exported = r.json("export", url, tmp_path / "exported")
    assert exported["step"] == 3
    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    assert r.json("export", url, f"s3://{bucket}/plain", "--step", 2)["num_files"] == 2
    copied = r.json("cp", url, copy_url, "--step", 2)
    assert copied["fenced_writer"] is None and copied["bytes_uploaded"] == copied["total_bytes"]


def _catalog_commands_past_damage(r: Runner, url: str, copy_url: str, tmp_path: Path) -> None:
    """get, export and cp with step 3's data damaged: each skips it for step 2; cp fences
    the copy before it; a file the checkpoint lacks is an error document."""
    (tmp_path / "gets").mkdir()
    got = r.json("get", url, "model.safetensors", tmp_path / "gets")
    assert got["step"] == 2 and got["skipped"][0]["step"] == 3
    assert (tmp_path / "gets" / "model.safetensors").read_bytes() == bytes([2]) * 300_000
    exported = r.json("export", url, tmp_path / "exported-2")
    assert exported["step"] == 2 and exported["skipped"][0]["step"] == 3
    copied = r.json("cp", url, copy_url, "--to-step", 4)
    assert copied["skipped"][0]["step"] == 3 and copied["fenced_writer"]["active"] is False
    assert copied["bytes_reused"] == copied["total_bytes"]  # the first copy sent them
    missing = r.json("get", url, "nope.bin", tmp_path / "nope.bin", code=3)
    assert missing["error"]["type"] == "CheckpointNotFoundError"


def test_gc_that_deletes_prints_what_its_schema_block_says(tmp_path):
    """GC deletes only what is older than the run's grace on the store's clock: a memory://
    run on a manual clock, read by the CLI in this process."""
    from cloudckpt.stores.memory import ManualClock, MemoryStore, drop_memory_bucket

    clock, name = ManualClock(), f"json-gc-{os.getpid()}"
    store = MemoryStore(name, "run", clock=clock)
    mgr = CheckpointManager(
        store, staging_dir=tmp_path / "w", keep_last=1, gc_grace=60, auto_gc=False
    )
    try:
        for step in (1, 2):
            with mgr.save(step) as d:
                (d / "w.bin").write_bytes(bytes([step]) * 5000)
            mgr.wait()
        dropped = protocol.parse_latest(store.get(protocol.LATEST_KEY)[0]).tombstones[0]
        store.create_multipart(dropped.record.ckpt + "files/late.bin")  # never completed
        orphan = "ckpt/000000000009-e1-20300101T000000000Z-0badc0de/"
        store.put(orphan + "ATTEMPT.json", b"{}")
        clock.advance(3600)
        result = CliRunner().invoke(cli, ["gc", f"memory://{name}/run", "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert_matches(doc, "gc", SCHEMAS)
        assert [c["step"] for c in doc["deleted_checkpoints"]] == [1]
        assert doc["aborted_uploads"] and doc["deleted_orphans"] == [orphan]
    finally:
        mgr.close()
        drop_memory_bucket(name)


# --------------------------------------------------------------------------- watch


def test_a_watch_process_prints_json_lines_its_schema_blocks_describe(s3_target, tmp_path):
    """A real `cloudckpt watch --json` process: every line one event, each matching its
    block (started, ignored, queued, committed, flushing, incomplete, stopped; run again:
    skipped)."""
    out = tmp_path / "out"
    (out / "run-1").mkdir(parents=True)
    (out / "run-1" / "weights.bin").write_bytes(b"w" * 10_000)
    (out / "run-1" / ".complete").write_text("1")
    (out / "checkpoint-9").mkdir()  # an HF checkpoint still being written
    (out / "checkpoint-9" / "model.safetensors").write_bytes(b"partial")
    (out / "logs").mkdir()
    (out / "logs" / "events.out").write_text("tensorboard")
    so = s3_target.storage_options
    argv = [sys.executable, "-m", "cloudckpt.cli", "watch", str(out), s3_target.url, "--once",
            "--settle", "0", "--json", "--endpoint-url", so["endpoint_url"],
            "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]  # fmt: skip
    kinds: list[str] = []
    for _ in range(2):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for line in proc.stdout.splitlines():
            event = json.loads(line)  # every line is one JSON document
            assert_matches(event, "watch", SCHEMAS)
            kinds.append(event["event"])
    assert {"started", "ignored", "queued", "committed", "flushing", "incomplete",
            "stopped", "skipped"} <= set(kinds), kinds  # fmt: skip


def test_a_fenced_watcher_reports_what_its_schema_block_says(tmp_path, memory_target):
    from cloudckpt.watch import Watcher

    out = tmp_path / "out"
    events: list[dict[str, Any]] = []
    watcher = Watcher(out, memory_target.url, on_event=events.append, settle=0,
                      staging_dir=tmp_path / "staging")  # fmt: skip
    for step in (1, 2):
        (out / f"ckpt-{step}").mkdir(parents=True)
        (out / f"ckpt-{step}" / "w.bin").write_bytes(b"w" * 1000)
        (out / f"ckpt-{step}" / ".complete").write_text(str(step))
        if step == 2:  # another writer claims the run in between
            other = CheckpointManager(memory_target.url, staging_dir=tmp_path / "other")
            other.resume(into=tmp_path / "restored")
            other.close()
        watcher.run(0.05, once=True) if step == 2 else _poll_until_committed(watcher)
    fenced = [e for e in events if e["event"] == "fenced"]
    assert fenced and watcher.fenced is not None
    for event in events:
        assert_matches(event, "watch", SCHEMAS)


def _poll_until_committed(watcher: Any) -> None:
    import time

    for _ in range(2000):
        watcher.poll()
        if watcher.committed:
            return
        time.sleep(0.01)
    raise AssertionError("the watcher committed nothing")
