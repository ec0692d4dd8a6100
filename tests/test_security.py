"""Credentials never appear in logs (DEBUG, every logger, botocore's included), in error
messages, or in reprs: distinctive secrets go through the S3 and GCS stores, through
successful calls and failing ones, and are searched for in everything that was printed.
"""

from __future__ import annotations

import json
import logging

import pytest

from cloudckpt import CheckpointManager, CloudCkptError, open_store

S3_KEY = "AKIACLOUDCKPTKEYID42"
S3_SECRET = "SECRETcloudckptS3xyzzy/+plugh"
S3_TOKEN = "TOKENcloudckptSessionQQQ"
GCS_TOKEN = "ya29.SECRETcloudckptGCStoken"
URL_PASSWORD = "PASSWORDcloudckptInURL"
SECRETS = (S3_KEY, S3_SECRET, S3_TOKEN, GCS_TOKEN, URL_PASSWORD)


def _exercise(url: str, options: dict, missing_url: str, tmp_path) -> list[str]:
    """Save, restore and fail in a few ways; return every error's str and repr."""
    if url.startswith("s3://"):  # no SDK retries: the unreachable endpoint fails fast
        options = {**options, "config_kwargs": {"retries": {"max_attempts": 1}}}
    seen: list[str] = []
    mgr = CheckpointManager(url, storage_options=options, staging_dir=tmp_path / "s")
    seen.append(repr(mgr.store))
    with mgr.save(step=1) as d:
        (d / "f").write_bytes(b"x" * 1000)
    mgr.wait()
    mgr.restore(into=tmp_path / "r")
    failing = [
        lambda: CheckpointManager(missing_url, storage_options=options).resume(into=tmp_path / "x"),
        lambda: open_store(url, options).get("no/such/key"),
        lambda: open_store(url, {**options, "endpoint_url": "http://127.0.0.1:9"}).get("LATEST"),
        lambda: mgr.restore(into=tmp_path / "r"),  # not empty
    ]
    if url.startswith("s3://"):  # (gcsfs accepts unknown options silently)
        failing.append(lambda: CheckpointManager(url, storage_options={**options, "x": 1}))
    for call in failing:
        with pytest.raises(CloudCkptError) as err:
            call()
        seen += [str(err.value), repr(err.value), repr(err.value.__cause__ or "")]
    mgr.close()
    return seen


def _assert_clean(texts: list[str], caplog) -> None:
    everything = "\n".join(texts) + "\n" + caplog.text
    everything += "\n".join(str(r.__dict__) for r in caplog.records)
    assert caplog.records, "nothing was logged: the test would prove nothing"
    for secret in SECRETS:
        assert secret not in everything, f"{secret} leaked"


@pytest.fixture
def debug_logs(caplog):
    caplog.set_level(logging.DEBUG)  # the root logger: botocore, urllib3, gcsfs, aiohttp...
    return caplog


def test_s3_credentials_never_leak(moto_server, s3_target, tmp_path, debug_logs):
    options = {
        **s3_target.storage_options,
        "key": S3_KEY,
        "secret": S3_SECRET,
        "token": S3_TOKEN,
    }
    texts = _exercise(s3_target.url, options, "s3://no-such-bucket-sec/run", tmp_path)
    bad_url = f"s3://user:{URL_PASSWORD}@bucket/run"
    with pytest.raises(CloudCkptError) as err:
        CheckpointManager(bad_url, storage_options=options)
    assert "credentials in the URL" in str(err.value)
    texts += [str(err.value), repr(err.value)]
    assert any("Authorization" in r.getMessage() for r in debug_logs.records)
    _assert_clean(texts, debug_logs)


def test_s3_credentials_from_the_environment_never_leak(
    moto_server, s3_target, tmp_path, debug_logs, monkeypatch
):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", S3_TOKEN)
    options = {k: v for k, v in s3_target.storage_options.items() if k not in ("key", "secret")}
    texts = _exercise(s3_target.url, options, "s3://no-such-bucket-env/run", tmp_path)
    _assert_clean(texts, debug_logs)


def test_gcs_token_never_leaks(gcs_server, gcs_target, tmp_path, debug_logs):
    from google.oauth2.credentials import Credentials

    credentials = Credentials(token=GCS_TOKEN)  # sent as a bearer token on every request
    options = {**gcs_target.storage_options, "token": credentials}
    texts = _exercise(gcs_target.url, options, "gs://no-such-bucket-sec/run", tmp_path)
    bad_url = f"gs://user:{URL_PASSWORD}@bucket/run"
    with pytest.raises(CloudCkptError):
        CheckpointManager(bad_url, storage_options=options)
    _assert_clean(texts, debug_logs)


@pytest.mark.parametrize("how", ["sas_token", "connection_string"])
def test_azure_credentials_never_leak(azurite_server, azurite_target, tmp_path, debug_logs, how):
    """A SAS token's signature and the account key (in a connection string) appear nowhere."""
    import datetime as dt
    from urllib.parse import parse_qs, quote, urlsplit

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from cloudckpt.testing.azurite_server import ACCOUNT_KEY, ACCOUNT_NAME

    container = urlsplit(azurite_target.url).netloc
    if how == "sas_token":
        sas = generate_container_sas(
            ACCOUNT_NAME,
            container,
            account_key=ACCOUNT_KEY,
            permission=ContainerSasPermissions(read=True, write=True, list=True, delete=True),
            expiry=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        )
        secret = parse_qs(sas)["sig"][0]
        options = {
            "account_name": ACCOUNT_NAME,
            "endpoint_url": azurite_server.blob_endpoint,
            "sas_token": sas,
        }
    else:
        secret = ACCOUNT_KEY
        options = azurite_target.storage_options
    texts = _exercise(azurite_target.url, options, "az://no-such-container-sec/run", tmp_path)
    everything = "\n".join(texts) + "\n" + debug_logs.text
    everything += "\n".join(str(r.__dict__) for r in debug_logs.records)
    assert debug_logs.records, "nothing was logged: the test would prove nothing"
    # Also URL-encoded (a SAS travels in the query string) and by its first 16 characters.
    forms = {secret, quote(secret, safe=""), secret[:16], quote(secret, safe="")[:16]}
    for text in forms:
        assert text not in everything, f"the {how} leaked"


def test_passwords_in_file_memory_and_fsspec_urls_never_leak(tmp_path, debug_logs):
    """A user:password in a file://, memory:// or other fsspec URL is masked wherever the
    URL shows up: errors, `ls` (table and JSON), logs. Over http:// the password still
    authenticates (HTTP Basic), and a wrong one is "permission denied"."""
    from click.testing import CliRunner

    from cloudckpt.cli import cli
    from cloudckpt.testing.static_http import StaticHTTPServer, refused_port

    mgr = CheckpointManager(str(tmp_path / "www" / "run"), staging_dir=tmp_path / "s")
    with mgr.save(step=4) as d:
        (d / "f").write_bytes(b"x" * 1000)
    mgr.close()
    texts: list[str] = []
    with StaticHTTPServer(tmp_path / "www", auth=("user", URL_PASSWORD)) as server:
        host = server.url.split("://")[1]
        good = f"http://user:{URL_PASSWORD}@{host}/run"
        wrong = f"http://user:{URL_PASSWORD}-wrong@{host}/run"
        with refused_port() as port:
            refused = f"http://user:{URL_PASSWORD}@127.0.0.1:{port}/run"
            runs = {
                "file": (f"file://user:{URL_PASSWORD}@remotehost/run", 2),
                "memory": (f"memory://user:{URL_PASSWORD}@bucket/run", 2),
                "good": (good, 0),
                "wrong": (wrong, 8),
                "refused": (refused, 9),
            }
            for name, (url, code) in runs.items():
                for extra in ([], ["--json"]):
                    result = CliRunner().invoke(cli, ["-vv", "ls", url, *extra])
                    assert result.exit_code == code, (name, result.output)
                    texts.append(result.output)
            listed = CliRunner().invoke(cli, ["ls", good, "--json"])
            assert [c["step"] for c in json.loads(listed.stdout)["checkpoints"]] == [4]
            assert json.loads(listed.stdout)["url"] == f"http://***@{host}/run/"
            for url in (good, wrong, refused):
                opened = CheckpointManager(
                    url, staging_dir=tmp_path / "s2", unsafe_single_writer=True
                )
                texts.append(repr(opened.store))
                with pytest.raises(CloudCkptError) as err:
                    opened.restore(into=tmp_path / "www")  # not empty, or no server
                texts += [str(err.value), repr(err.value), repr(err.value.__cause__ or "")]
                opened.close()
        assert server.authorized > 0 and 401 in server.statuses  # the password was sent
    assert sum("://***@" in t for t in texts) >= 10  # the URLs are shown, masked
    _assert_clean(texts, debug_logs)


FRAGMENT_SECRET = "FRAGMENTcloudckptTOKEN"


def test_secrets_in_url_fragments_and_queries_are_never_printed(s3_target, tmp_path, debug_logs):
    """``s3://b/run#TOKEN`` (or ``?token=...``) given to `runs`, `ls`, `cp` (either side),
    `export` (either side), `diff`, `show`, `verify` and `get`: refused, human and --json
    output alike, with the URL shown masked (``#***``) and the secret nowhere (issue 28
    item 11). A file:// URL's fragment is refused too, not silently dropped."""
    from click.testing import CliRunner

    from cloudckpt.cli import cli

    so = s3_target.storage_options
    flags = ["--endpoint-url", so["endpoint_url"], "--region", "us-east-1",
             "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]  # fmt: skip
    mgr = CheckpointManager(s3_target.url, storage_options=so, staging_dir=tmp_path / "s")
    with mgr.save(step=1) as d:
        (d / "f").write_bytes(b"x" * 1000)
    mgr.close()
    good = s3_target.url
    texts: list[str] = []
    for tail in (f"#{FRAGMENT_SECRET}", f"?token={FRAGMENT_SECRET}", f"?a=1#{FRAGMENT_SECRET}"):
        for bad in (good + tail, f"file://{tmp_path}/run{tail}", f"memory://b/run{tail}"):
            commands = [
                ["runs", bad], ["ls", bad], ["diff", bad, "1", "1"], ["show", bad],
                ["verify", bad], ["get", bad, "f", str(tmp_path / "got")],
                ["cp", bad, f"file://{tmp_path}/copy"], ["cp", good, bad],
                ["export", bad, str(tmp_path / "exported")], ["export", good, bad],
            ]  # fmt: skip
            for args in commands:
                for extra in ([], ["--json"]):
                    result = CliRunner().invoke(cli, ["-vv", *args, *flags, *extra])
                    assert result.exit_code == 2, (args, result.output)
                    assert "not supported" in result.output, result.output
                    if extra:  # one JSON document on stdout, the error in it
                        doc = json.loads(result.stdout)
                        assert "***" in doc["error"]["message"]
                    texts.append(result.output)
    assert sum("#***" in t for t in texts) >= 20  # the URLs are shown, masked
    assert all(FRAGMENT_SECRET not in t for t in texts)
    assert FRAGMENT_SECRET not in debug_logs.text
