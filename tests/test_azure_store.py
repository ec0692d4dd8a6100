"""Azure Blob Storage (``az://``, ``abfs://``, ``abfss://``) on Azurite: URL forms,
credentials, error mapping, blocks, the probe's measurements that docs/stores.md reports,
the test server itself, and the CLI as a new user types it.

The conformance suite, the manager tests and the racing writers run on Azurite through the
``azurite`` backend of tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
import urllib.parse
from pathlib import Path

import pytest

from cloudckpt import CheckpointManager
from cloudckpt.errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    ConfigurationError,
    CredentialsError,
    MissingDependencyError,
    ObjectNotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientStoreError,
)
from cloudckpt.stores import CREATE, OVERWRITE, Update, open_store
from cloudckpt.testing.azurite_server import ACCOUNT_KEY, ACCOUNT_NAME, AzuriteServer

ENV_VARS = (
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
)


@pytest.fixture
def no_azure_env(monkeypatch):
    """No Azure variables, and azure-identity not importable (whether installed or not)."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "azure.identity", None)
    return monkeypatch


def _container(target) -> str:
    return urllib.parse.urlsplit(target.url).netloc


# --- URLs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected_url", "endpoint"),
    [
        ("az://box/runs/a", "az://box/runs/a/", "https://acct.blob.core.windows.net/"),
        ("abfs://box/runs/a", "abfs://box/runs/a/", "https://acct.blob.core.windows.net/"),
        (
            "abfss://box@other.dfs.core.windows.net/runs/a",
            "abfss://box/runs/a/",
            "https://other.blob.core.windows.net/",
        ),
    ],
)
def test_url_forms(no_azure_env, url, expected_url, endpoint):
    key = "a2V5" * 16
    opts = {"account_key": key} | ({} if "@" in url else {"account_name": "acct"})
    store = open_store(url, opts)  # builds a client; sends nothing
    try:
        assert store.url == expected_url
        assert store._service.primary_endpoint == endpoint
        assert store._container.container_name == "box"
    finally:
        store.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("az:///run", "no container name"),
        ("az://Upper_Case/run", "invalid Azure container name"),
        ("az://a/run", "invalid Azure container name"),
        ("abfss://box@nohost/run", "not an Azure storage account host"),
        ("az://box/run?sig=s3cr3t", "query strings"),
    ],
)
def test_wrong_urls_are_configuration_errors(no_azure_env, url, message):
    with pytest.raises(ConfigurationError, match=message) as info:
        open_store(url, {"account_name": "acct", "account_key": "a2V5" * 16})
    assert "s3cr3t" not in str(info.value)


def test_account_in_url_and_options_must_agree(no_azure_env):
    with pytest.raises(ConfigurationError, match="names account"):
        open_store("abfss://box@one.dfs.core.windows.net/r", {"account_name": "two"})


def test_unknown_option_is_refused(no_azure_env):
    with pytest.raises(ConfigurationError, match="'acount_key'"):
        open_store("az://box/r", {"account_name": "acct", "acount_key": "x"})


def test_missing_sdk_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("azure") else real(name, *a),
    )
    for scheme in ("az", "abfs", "abfss"):
        with pytest.raises(MissingDependencyError) as info:
            open_store(f"{scheme}://box/run")
        assert info.value.extra == "azure"
        # Both install lines work as written: the package from the index, the extra
        # from a clone (cloudckpt itself is not on the index).
        assert "pip install 'azure-storage-blob>=12.19'" in str(info.value)
        assert "pip install '.[azure]'" in str(info.value)


# --- credentials -----------------------------------------------------------------------


def test_no_credentials_says_what_to_set(no_azure_env):
    with pytest.raises(CredentialsError) as info:
        open_store("az://box/run")
    text = str(info.value)
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY", "azure-identity"):
        assert name in text
    with pytest.raises(CredentialsError, match="AZURE_STORAGE_ACCOUNT_KEY"):
        open_store("az://box/run", {"account_name": "acct"})  # an account, no credential


def test_default_azure_credential_is_used_lazily(no_azure_env):
    """With azure-identity installed and nothing else set, DefaultAzureCredential is created
    (which contacts nothing); no request is made while opening the store."""
    made = []

    class FakeCredential:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def get_token(self, *scopes, **kwargs):  # pragma: no cover - never asked here
            raise AssertionError("a token was requested")

    no_azure_env.setitem(
        sys.modules, "azure.identity", types.SimpleNamespace(DefaultAzureCredential=FakeCredential)
    )
    no_azure_env.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    store = open_store("az://box/run")
    assert made == [{}]
    assert store._service.credential.__class__ is FakeCredential
    store.close()


def test_environment_connection_string(no_azure_env, azurite_server, azurite_target):
    no_azure_env.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_server.connection_string)
    with open_store(azurite_target.url) as store:
        store.put("k", b"from env")
        assert store.get("k")[0] == b"from env"


def test_environment_account_key(no_azure_env, azurite_server, azurite_target):
    no_azure_env.setenv("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT_NAME)
    no_azure_env.setenv("AZURE_STORAGE_ACCOUNT_KEY", ACCOUNT_KEY)
    opts = {"account_url": azurite_server.blob_endpoint}
    with open_store(azurite_target.url, opts) as store:
        store.put("k", b"key from env")
        assert store.get("k")[0] == b"key from env"


def test_sas_tokens(no_azure_env, azurite_server, azurite_target):
    """A read-write SAS works; a read-only one reads, and a write is refused (403)."""
    import datetime as dt

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    container = _container(azurite_target)
    expiry = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)

    def sas(**perms):
        return generate_container_sas(
            ACCOUNT_NAME,
            container,
            account_key=ACCOUNT_KEY,
            permission=ContainerSasPermissions(**perms),
            expiry=expiry,
        )

    base = {"account_name": ACCOUNT_NAME, "account_url": azurite_server.blob_endpoint}
    rw = sas(read=True, write=True, create=True, list=True, delete=True)
    with open_store(azurite_target.url, {**base, "sas_token": "?" + rw}) as store:
        store.put("k", b"sas", mode=CREATE)
        assert [o.key for o in store.list()] == ["k"]
    ro = sas(read=True, list=True)
    with open_store(azurite_target.url, {**base, "sas_token": ro}) as store:
        assert store.get("k")[0] == b"sas"
        with pytest.raises(PermissionDeniedError) as info:
            store.put("k2", b"x")
        assert ro.split("sig=")[1][:10] not in str(info.value)


def test_wrong_key_is_refused_and_not_echoed(no_azure_env, azurite_server, azurite_target):
    """Azure answers 403 AuthenticationFailed (CredentialsError); Azurite answers 403
    AuthorizationFailure, which is PermissionDeniedError. Either way the key never shows."""
    wrong = "d3Jvbmc=" * 11
    opts = {
        "account_name": ACCOUNT_NAME,
        "account_key": wrong,
        "account_url": azurite_server.blob_endpoint,
    }
    with (
        open_store(azurite_target.url, opts) as store,
        pytest.raises((CredentialsError, PermissionDeniedError)) as info,
    ):
        store.get("k")
    assert wrong not in str(info.value) and ACCOUNT_KEY not in str(info.value)


# --- errors and blocks -----------------------------------------------------------------


def test_missing_container_is_not_a_missing_blob(azurite_server, tmp_path):
    opts = azurite_server.storage_options()
    with open_store("az://no-such-container/run", opts) as store:
        for call in (
            lambda: store.get("k"),
            lambda: store.head("k"),
            lambda: store.put("k", b"x", mode=CREATE),
            lambda: list(store.list()),
            lambda: store.delete("k"),
            store.now,
        ):
            with pytest.raises(BucketNotFoundError, match="no-such-container"):
                call()
    mgr = CheckpointManager(
        "az://no-such-container/run", storage_options=opts, staging_dir=tmp_path / "s"
    )
    with pytest.raises(BucketNotFoundError):
        mgr.resume(into=tmp_path / "restore")
    mgr.close(timeout=30)


def test_conditional_puts_map_to_precondition_failed(azurite_target, open_target):
    store = open_target(azurite_target)
    first = store.put("k", b"1", mode=CREATE)
    with pytest.raises(PreconditionFailedError, match="already exists"):
        store.put("k", b"2", mode=CREATE)  # Azure: 409 BlobAlreadyExists
    with pytest.raises(PreconditionFailedError):
        store.put("missing", b"2", mode=Update(first.version))
    for bogus in ("", "*"):  # no condition at all / any blob: must not be sent
        with pytest.raises(PreconditionFailedError):
            store.put("k", b"3", mode=Update(bogus))
    assert store.get("k")[0] == b"1" and not store.exists("missing")


def test_md5_mismatch_is_a_checksum_error(azurite_target, open_target, monkeypatch):
    """The service checks the Content-MD5 of every Put Blob and Put Block."""
    import cloudckpt.stores.azure as azure_store

    store = open_target(azurite_target)
    upload = store.create_multipart("big")
    monkeypatch.setattr(azure_store, "_md5_b64", lambda data: "AAAAAAAAAAAAAAAAAAAAAA==")
    with pytest.raises(ChecksumMismatchError, match="Md5Mismatch"):
        store.put("k", b"payload")
    with pytest.raises(ChecksumMismatchError, match="Md5Mismatch"):
        store.upload_part(upload, 1, b"part")
    monkeypatch.undo()
    assert not store.exists("k")
    assert store.uncommitted_blocks("big") == []
    store.abort_multipart(upload)


def test_uncommitted_blocks_after_abort_and_competing_uploads(azurite_target, open_target):
    """Abort drops the upload's marker (so GC stops listing it); its blocks stay staged until
    the service discards them or the blob's next commit does. Two uploads of one blob: the
    first commit discards the other's blocks, whose commit then fails loudly."""
    store = open_target(azurite_target)
    aborted = store.create_multipart("k")
    store.upload_part(aborted, 1, b"left behind")
    store.abort_multipart(aborted)
    assert store.list_multipart() == []
    assert [size for _, size in store.uncommitted_blocks("k")] == [len(b"left behind")]
    with pytest.raises(ObjectNotFoundError):
        store.get("k")  # uncommitted blocks are not an object

    a, b = store.create_multipart("k"), store.create_multipart("k")
    pa = store.upload_part(a, 1, b"from a")
    pb = store.upload_part(b, 1, b"from b")
    assert {p.upload_id for p in store.list_multipart("k")} == {a.upload_id, b.upload_id}
    store.complete_multipart(a, [pa])
    assert store.uncommitted_blocks("k") == []  # the commit discarded b's (and the aborted)
    with pytest.raises(PreconditionFailedError):
        store.complete_multipart(b, [pb])  # CREATE: the blob exists now
    with pytest.raises(StoreError, match="not staged"):
        store.complete_multipart(b, [pb], mode=OVERWRITE)
    assert store.get("k")[0] == b"from a"
    store.abort_multipart(b)
    with pytest.raises(ObjectNotFoundError):
        store.complete_multipart(b, [pb])  # an aborted upload is gone
    assert store.list_multipart() == []


def test_connection_refused_is_transient(no_azure_env):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = {
        "account_name": ACCOUNT_NAME,
        "account_key": ACCOUNT_KEY,
        "account_url": f"http://127.0.0.1:{port}/{ACCOUNT_NAME}",
        "connection_timeout": 2,
    }
    with open_store("az://box/run", opts) as store:
        with pytest.raises(TransientStoreError, match=f"127.0.0.1:{port}"):
            store.get("k")
        with pytest.raises(TransientStoreError):  # nothing was sent: not "outcome unknown"
            store.put("k", b"x", mode=CREATE)


# --- the probe (docs/stores.md's Azurite row) -------------------------------------------


def test_probe_on_azurite_matches_the_documented_row(azurite_server):
    """Smaller races than the documented run (16 x 20, 8 x 25); the answers must match."""
    from cloudckpt.testing.azure_probe import probe_container, service_factory

    container = "probe-azurite"
    azurite_server.create_container(container)
    report = probe_container(
        service_factory(azurite_server.connection_string),
        container,
        creators=8,
        rounds=5,
        cas_writers=4,
        increments=10,
    )
    observed = {f.name: f.observed for f in report.findings}
    assert all(f.honoured for f in report.findings), report.table()
    assert observed["Put Blob If-None-Match: * (exists)"] == "409 BlobAlreadyExists"
    assert observed["Put Blob If-Match: blob absent"] == "412 ConditionNotMet"
    assert observed["Put Block List If-Match: stale ETag"] == "412 ConditionNotMet"
    assert observed["Put Block with a wrong Content-MD5"] == "400 Md5Mismatch"
    assert observed["ETag after an identical rewrite"] == "changed"
    races = report.races
    assert races is not None and races.creates_ok and races.cas_ok, report.table()
    assert set(races.loser_answers) == {"409 BlobAlreadyExists"}


# --- the test server -------------------------------------------------------------------


def test_server_listens_on_loopback_and_stops_cleanly():
    server = AzuriteServer()
    with server:
        proc = server._proc
        assert server.blob_endpoint.startswith("http://127.0.0.1:")
        assert server.running
    assert proc.poll() is not None and not server.running


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_server_dies_with_its_parent(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        from cloudckpt.testing.azurite_server import AzuriteServer
        server = AzuriteServer().start()
        print(server._proc.pid, flush=True)
        time.sleep(120)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(child.stdout.readline())
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists():
            state = (
                Path(f"/proc/{pid}/stat").read_text().split()[2]
                if Path(f"/proc/{pid}/stat").exists()
                else "X"
            )
            if state == "Z":  # reaped by init soon; it is dead
                break
            assert time.monotonic() < deadline, "Azurite outlived the process that started it"
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait()


# --- the CLI, as a new user types it ---------------------------------------------------


def _cli(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_cli_push_ls_restore_verify(azurite_server, azurite_target, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AZURE_")}
    env["AZURE_STORAGE_CONNECTION_STRING"] = azurite_server.connection_string
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    files = {"model.bin": os.urandom(3 * 1024 * 1024), "sub/opt.json": b'{"lr": 0.1}'}
    for name, data in files.items():
        (src / name).write_bytes(data)
    url = azurite_target.url

    pushed = _cli("push", src, url, "--step", 100, "--json", env=env)
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["step"] == 100
    listed = _cli("ls", url, "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert [c["step"] for c in json.loads(listed.stdout)["checkpoints"]] == [100]
    dest = tmp_path / "restored"
    restored = _cli("restore", url, dest, env=env)
    assert restored.returncode == 0, restored.stderr
    for name, data in files.items():
        assert (dest / name).read_bytes() == data
    verified = _cli("verify", url, "--read-data", env=env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert ACCOUNT_KEY not in pushed.stderr + listed.stderr + restored.stderr


def test_cli_bad_input(azurite_server, tmp_path):
    from click.testing import CliRunner

    from cloudckpt.cli import cli

    def run(*args, **env):
        base = {v: None for v in ENV_VARS}
        return CliRunner().invoke(cli, [str(a) for a in args], env={**base, **env})

    conn = azurite_server.connection_string
    missing = run("ls", "az://no-such-container/run", AZURE_STORAGE_CONNECTION_STRING=conn)
    assert missing.exit_code == 3 and "no-such-container" in missing.stderr, missing.output
    no_creds = run("ls", "az://box-name/run")
    assert no_creds.exit_code == 8, no_creds.output
    assert "AZURE_STORAGE_CONNECTION_STRING" in no_creds.stderr
    bad_url = run("ls", "az:///run", AZURE_STORAGE_CONNECTION_STRING=conn)
    assert bad_url.exit_code == 2 and "no container name" in bad_url.stderr
    bad_name = run("ls", "az://Bad_Name/run", AZURE_STORAGE_CONNECTION_STRING=conn)
    assert bad_name.exit_code == 2 and "container name" in bad_name.stderr
    typo = run(
        "ls", "az://box-name/run", "-o", "acount_key=x", AZURE_STORAGE_CONNECTION_STRING=conn
    )
    assert typo.exit_code == 2 and "acount_key" in typo.stderr
    assert ACCOUNT_KEY not in missing.output + no_creds.output + bad_url.output


def test_explicit_endpoint_wins_over_the_connection_string(azurite_server, azurite_target):
    """``--endpoint-url`` (storage option ``endpoint_url``) with a connection string in the
    environment: the explicit endpoint is used, with the connection string's credentials."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = {**azurite_target.storage_options, "endpoint_url": f"http://127.0.0.1:{port}/x"}
    with (
        open_store(azurite_target.url, opts) as store,
        pytest.raises(TransientStoreError, match=f"127.0.0.1:{port}"),
    ):
        store.get("k")
    opts["endpoint_url"] = azurite_server.blob_endpoint
    with open_store(azurite_target.url, opts) as store:
        store.put("k", b"v")
        assert store.get("k")[0] == b"v"
