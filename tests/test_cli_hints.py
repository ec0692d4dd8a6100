"""Errors and warnings that say what to do (issue 25 item 9), reproduced against a real moto
server on 127.0.0.1 and a real ``cloudckpt`` process: S3 without credentials names
``--profile``/``AWS_PROFILE``; an endpoint without a scheme, or ``https://`` to a plain-HTTP
server, says which URL to write instead and fails at once (not "can be retried"); and a
restore that falls back warns once per event, whoever reads (CLI or Python; a restore of a
checkpoint collected under it: tests/test_cli.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloudckpt import protocol
from cloudckpt.cli import cli
from cloudckpt.errors import BucketNotFoundError, ConfigurationError
from cloudckpt.restore import restore
from cloudckpt.stores import open_store
from cloudckpt.stores.s3 import S3Store
from cloudckpt.testing.faults import flip_bit
from cloudckpt.testing.layout import data_key
from cloudckpt.transfer import TransferEngine

#: What conftest sets for every test (no metadata service, no real config files).
_KEPT = {"AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"}


def cloudckpt(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real command, in its own process, with no AWS settings but ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k in _KEPT}
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt.cli", *map(str, args)],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def test_s3_without_credentials_names_the_profile_flag_and_variable(s3_target, moto_server):
    result = cloudckpt("ls", s3_target.url, "--endpoint-url", moto_server.endpoint_url)
    assert result.returncode == 8, result.stderr
    hint = result.stderr.split("hint: ", 1)[1]
    assert "--profile NAME" in hint and "AWS_PROFILE" in hint and "AWS_ACCESS_KEY_ID" in hint
    # Not the other stores' settings, nor Python's options first.
    for other in ("GCS", "Azure", "AZURE_", "token"):
        assert other not in hint, hint


@pytest.mark.parametrize("written", ["{host}", "htp://{host}", "localhost:{port}"])
def test_an_endpoint_without_http_or_https_says_which_url_to_write(s3_target, moto_server, written):
    host = moto_server.endpoint_url.split("://", 1)[1]
    endpoint = written.format(host=host, port=host.rsplit(":", 1)[1])
    result = cloudckpt("ls", s3_target.url, "--endpoint-url", endpoint, env=KEYS)
    assert result.returncode == 2, result.stderr  # usage: nothing to retry
    assert f"the S3 endpoint '{endpoint}'" in result.stderr
    bare = endpoint.split("://", 1)[-1]
    assert f"hint: Write it with its scheme: http://{bare} " in result.stderr
    assert f"or https://{bare}" in result.stderr
    assert "Invalid endpoint" not in result.stderr and "retried" not in result.stderr


def test_an_endpoint_from_the_environment_is_named_as_such(s3_target, moto_server, monkeypatch):
    host = moto_server.endpoint_url.split("://", 1)[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", host)
    with pytest.raises(ConfigurationError) as info:
        S3Store(s3_target.url.split("/")[2], key="testing", secret="testing")
    assert "AWS_ENDPOINT_URL" in info.value.message
    assert f"http://{host}" in info.value.hint


def test_https_to_a_plain_http_server_says_use_http_and_is_not_retried(s3_target, moto_server):
    plain = moto_server.endpoint_url
    tls = plain.replace("http://", "https://")
    result = cloudckpt("ls", s3_target.url, "--endpoint-url", tls, env=KEYS)
    assert result.returncode == 2, result.stderr
    assert f"the S3 endpoint {tls} answered in plain HTTP, not TLS" in result.stderr
    assert f"use --endpoint-url {plain}" in result.stderr
    assert "retried" not in result.stderr

    # One attempt, not botocore's five (each after a backoff) times ours.
    store = S3Store(s3_target.url.split("/")[2], endpoint_url=tls, key="k", secret="s")
    sent: list[str] = []
    store._client.meta.events.register("before-send.s3", lambda **kw: sent.append("x"))
    with pytest.raises(ConfigurationError, match="answered in plain HTTP"):
        store.get("LATEST")
    assert sent == ["x"]
    store.close()

    # The same server over http:// works: the hint's URL is the one to use.
    ok = cloudckpt("ls", s3_target.url, "--endpoint-url", plain, "--json", env=KEYS)
    assert ok.returncode == 0 and json.loads(ok.stdout)["checkpoints"] == []


# --------------------------------------------------------------------------- one warning


def _warnings(stderr: str) -> list[str]:
    """The warning lines a command printed: ours (``warning: ``) and the library's logs
    (``cloudckpt: WARNING: ``)."""
    return [line for line in stderr.splitlines() if re.search(r"(?i)\bwarning\b", line)]


@pytest.fixture
def run_with_two(s3_target, manager_factory):
    """An S3 run with steps 1 and 2 committed. Yields (target, store, LATEST)."""
    writer = manager_factory(s3_target, auto_gc=False)
    for step in (1, 2):
        with writer.save(step=step) as d:
            (d / "w.bin").write_bytes(bytes([step]) * 50_000)
        writer.wait()
    store = open_store(s3_target.url, s3_target.storage_options)
    yield s3_target, store, protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])
    store.close()


def _cli(target, *args: str):
    so = target.storage_options
    flags = ["--endpoint-url", so["endpoint_url"], "-o", f"key={so['key']}"]
    flags += ["-o", f"secret={so['secret']}"]
    return CliRunner().invoke(cli, [*args, *flags])


def _cli_restore(target, dest: Path, *more: str):
    return _cli(target, "restore", target.url, str(dest), *more)


def test_a_restore_that_skips_a_damaged_checkpoint_warns_once(run_with_two, tmp_path, caplog):
    target, store, latest = run_with_two
    flip_bit(store, data_key(store, latest.current, "w.bin"), seed=1)

    result = _cli_restore(target, tmp_path / "cli")
    assert result.exit_code == 0, result.output
    (warning,) = _warnings(result.stderr)
    assert "step 2" in warning and latest.current.commit_id in warning
    assert "does not match its digest" in warning and "trying step 1" in warning
    assert "restored step 1" in result.stdout and "after skipping 1 damaged" in result.stdout

    # The library says it once too (a trainer's resume() goes through restore()).
    caplog.set_level(logging.INFO, logger="cloudckpt")
    with TransferEngine() as engine:
        restored = restore(store, tmp_path / "py", engine)
    assert restored.step == 1 and [s.step for s in restored.skipped] == [2]
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_restore_without_a_readable_latest_warns_once(run_with_two, tmp_path, damage):
    target, store, _ = run_with_two
    if damage == "missing":
        store.delete(protocol.LATEST_KEY)
    else:
        flip_bit(store, protocol.LATEST_KEY, seed=2)
    result = _cli_restore(target, tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["from_commit_records"] is True
    (warning,) = _warnings(result.stderr)
    assert "newest commit record that verifies" in warning and "cloudckpt repair" in warning
    # ls says it once as well.
    listing = _cli(target, "ls", target.url)
    assert listing.exit_code == 0, listing.output
    assert len(_warnings(listing.stderr)) == 1, listing.stderr


@pytest.fixture
def tls_server(tmp_path):
    """An https server on 127.0.0.1 with a self-signed certificate, answering 404 to
    everything. Yields (its URL, the certificate's path)."""
    import datetime as dt
    import http.server
    import ipaddress
    import ssl
    import threading

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}", cert_file
    server.shutdown()
    server.server_close()


def test_an_untrusted_certificate_names_the_ca_bundle_and_is_not_retried(tls_server):
    url, cert = tls_server
    store = S3Store("bkt", endpoint_url=url, key="k", secret="s")
    sent: list[str] = []
    store._client.meta.events.register("before-send.s3", lambda **kw: sent.append("x"))
    with pytest.raises(ConfigurationError, match=r"certificate .* is not trusted") as info:
        store.get("LATEST")
    assert "AWS_CA_BUNDLE" in info.value.hint and sent == ["x"]
    store.close()
    # What the hint says works: trusting the certificate reaches the server, whose 404
    # (it is no S3 server) reads as a missing bucket.
    trusted = S3Store(
        "bkt", endpoint_url=url, key="k", secret="s", client_kwargs={"verify": str(cert)}
    )
    with pytest.raises(BucketNotFoundError):
        trusted.exists("LATEST")
    trusted.close()
