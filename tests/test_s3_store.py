"""S3-specific behaviour of S3Store against a real moto server (tests/conftest.py).

The shared contract is in test_store_conformance.py; here: storage options and AWS
environment, checksums on the wire, error normalisation, secrets kept out of messages and
logs, and the MotoServer helper itself.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import botocore.exceptions as bce
import pytest

from cloudckpt.errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    ConfigurationError,
    CredentialsError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreConflictError,
    StoreError,
    TransientStoreError,
)
from cloudckpt.stores import CREATE, Update, crc32c_b64, open_store
from cloudckpt.stores._s3_client import ACCEPTED_OPTIONS
from cloudckpt.stores.s3 import S3Store
from cloudckpt.testing.moto_server import MotoServer, MotoServerError

MiB = 1024 * 1024
SECRET = "SECRETdistinct0123456789abcdefghijklmnop"
TOKEN = "TOKENdistinct0123456789abcdefghijklmnopqrstuvwxyz"
AWS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No AWS settings from the environment (conftest already hides the AWS files)."""
    for var in AWS_ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _roundtrip(store) -> None:
    info = store.put("probe", b"hello", mode=CREATE)
    assert store.get("probe") == (b"hello", store.head("probe"))
    assert info.version == store.head("probe").version


# --- storage options and the AWS environment ------------------------------------------


def test_endpoint_via_endpoint_url(s3_target, open_target):
    store = open_target(s3_target)
    _roundtrip(store)
    assert store.url == s3_target.url + "/"


def test_endpoint_and_region_via_client_kwargs(moto_server, s3_target):
    bucket = s3_target.url.split("/")[2]
    opts = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": moto_server.endpoint_url, "region_name": "us-east-1"},
        "config_kwargs": {"read_timeout": 30},
    }
    with open_store(f"s3://{bucket}", opts) as store:  # no prefix: the bucket root
        _roundtrip(store)
        assert [o.key for o in store.list()] == ["probe"]


@pytest.mark.parametrize("var", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_endpoint_and_credentials_from_environment(moto_server, s3_target, clean_env, var):
    clean_env.setenv(var, moto_server.endpoint_url)
    clean_env.setenv("AWS_ACCESS_KEY_ID", "testing")
    clean_env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with open_store(s3_target.url, {}) as store:
        _roundtrip(store)


def test_region_from_environment_and_default(clean_env):
    endpoint = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}
    with S3Store("bkt", **endpoint) as store:
        assert store._client.meta.region_name == "us-east-1"
    clean_env.setenv("AWS_REGION", "eu-west-3")
    with S3Store("bkt", **endpoint) as store:
        assert store._client.meta.region_name == "eu-west-3"
    clean_env.setenv("AWS_DEFAULT_REGION", "ap-south-1")  # botocore's own variable wins
    with S3Store("bkt", **endpoint) as store:
        assert store._client.meta.region_name == "ap-south-1"


def test_profile_from_config_files(moto_server, s3_target, clean_env, tmp_path):
    config = tmp_path / "config"
    config.write_text(
        "[profile ckpt]\n"
        "region = us-east-1\n"
        f"endpoint_url = {moto_server.endpoint_url}\n"
        "[profile other]\n"
        "region = eu-west-1\n"
    )
    credentials = tmp_path / "credentials"
    credentials.write_text("[ckpt]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    clean_env.setenv("AWS_CONFIG_FILE", str(config))
    clean_env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    with open_store(s3_target.url, {"profile": "ckpt"}) as store:
        _roundtrip(store)
    clean_env.setenv("AWS_PROFILE", "ckpt")
    with open_store(s3_target.url, {}) as store:
        assert store.get("probe")[0] == b"hello"
    with pytest.raises(CredentialsError, match="'nope'"):
        S3Store("bkt", profile="nope")


def test_s3_additional_kwargs_reach_the_request(moto_server, s3_target):
    opts = {**s3_target.storage_options, "s3_additional_kwargs": {"ContentType": "text/x-ckpt"}}
    with open_store(s3_target.url, opts) as store:
        store.put("typed", b"x")
        store.get("typed")  # GetObject has no ContentType member: not sent there
    bucket = s3_target.url.split("/")[2]
    client = moto_server.client()
    assert client.head_object(Bucket=bucket, Key="run/typed")["ContentType"] == "text/x-ckpt"
    client.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"nonsense": 1}, "nonsense"),
        ({"client_kwargs": {"bogus": 1}}, "bogus"),
        ({"key": "only-a-key"}, "together"),
        ({"config_kwargs": {"no_such_setting": 1}}, "config_kwargs"),
    ],
)
def test_bad_options_raise_configuration_error(options, match):
    with pytest.raises(ConfigurationError, match=match) as info:
        S3Store("bkt", "run", endpoint_url="http://127.0.0.1:9", **options)
    if "nonsense" in options:
        assert all(name in str(info.value) for name in ACCEPTED_OPTIONS)


def test_ignored_s3fs_options_are_accepted():
    with S3Store("bkt", endpoint_url="http://127.0.0.1:9", use_listings_cache=False) as store:
        assert store.url == "s3://bkt/"


# --- checksums ------------------------------------------------------------------------


def test_checksums_reach_the_server(moto_server, s3_target, open_target):
    store = open_target(s3_target)
    bucket = s3_target.url.split("/")[2]
    client = moto_server.client()

    store.put("single", b"payload")
    head = client.head_object(Bucket=bucket, Key="run/single", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == crc32c_b64(b"payload")

    # moto stores part checksums without checking them, and echoes the header it received
    # in its answer: a wrong one proves that the server got the value we sent (real S3
    # would answer BadDigest).
    echoed = []
    store._client.meta.events.register(
        "after-call.s3.UploadPart",
        lambda http_response, **_: echoed.append(
            http_response.headers.get("x-amz-checksum-crc32c")
        ),
    )
    first, last = os.urandom(5 * MiB), b"tail bytes"
    upload = store.create_multipart("multi")
    p1 = store.upload_part(upload, 1, first, crc32c=crc32c_b64(first))
    p2 = store.upload_part(upload, 2, last, crc32c=crc32c_b64(b"not the tail"))
    assert echoed == [crc32c_b64(first), crc32c_b64(b"not the tail")]
    p3 = store.upload_part(upload, 2, last)  # no checksum given: the store computes one
    assert echoed[-1] == p3.crc32c == crc32c_b64(last)
    store.complete_multipart(upload, [p1, p3], mode=CREATE)
    assert store.get("multi")[0] == first + last
    # The upload was declared CRC32C. (moto computes the object's COMPOSITE value itself,
    # with CRC32 instead of CRC32C unless the `crc32c` package is installed: not comparable.)
    head = client.head_object(Bucket=bucket, Key="run/multi", ChecksumMode="ENABLED")
    assert "ChecksumCRC32C" in head
    del p2
    client.close()


def test_get_verifies_full_object_crc32c(moto_server, s3_target, open_target):
    store = open_target(s3_target)
    bucket = s3_target.url.split("/")[2]
    client = moto_server.client()
    client.put_object(
        Bucket=bucket,
        Key="run/damaged",
        Body=b"real bytes",
        ChecksumAlgorithm="CRC32C",
        ChecksumCRC32C=crc32c_b64(b"other bytes"),
    )
    client.close()
    with pytest.raises(ChecksumMismatchError):
        store.get("damaged")
    assert store.get_range("damaged", 0, 4) == b"real"  # ranges carry no checksum


# --- reads, multipart details ---------------------------------------------------------


def test_ranges_listing_and_multipart_details(s3_target, open_target):
    store = open_target(s3_target)
    store.put("obj", b"0123456789")
    store.put("empty", b"")
    store.put(".cloudckpt/lock", b"internal")
    assert store.get_range("obj", 8, 100) == b"89"
    assert store.get_range("obj", 10, 5) == b""  # S3 answers 416 here
    assert store.get_range("empty", 0, 5) == b""
    assert store.get_range("obj", 3, 0) == b""
    with pytest.raises(ObjectNotFoundError):
        store.get_range("nope", 0, 1)
    with pytest.raises(ObjectNotFoundError):
        store.get_range("nope", 0, 0)
    assert [o.key for o in store.list()] == ["empty", "obj"]

    upload = store.create_multipart("mp")
    (pending,) = store.list_multipart()
    assert pending.upload_id == upload.upload_id and pending.key == "mp"
    assert pending.initiated.utcoffset().total_seconds() == 0  # moto says 2010
    part = store.upload_part(upload, 1, b"abc")
    assert part.crc32c == crc32c_b64(b"abc") and part.size == 3
    with pytest.raises(StoreError, match="compare-and-swap"):
        store.complete_multipart(upload, [part], mode=Update('"x"'))
    assert not store.exists("mp")
    store.abort_multipart(upload)
    store.abort_multipart(upload)  # unknown upload: fine
    assert store.list_multipart() == []


def test_delete_many_batches(s3_target, open_target):
    store = open_target(s3_target)
    store._delete_batch = 3  # S3 takes 1000 a call; three batches of three here
    keys = [f"many/{i}" for i in range(8)]
    for key in keys:
        store.put(key, b"")
    store.put("other", b"")
    store.delete_many([*keys, "many/missing"])
    assert [o.key for o in store.list()] == ["other"]


def test_now_is_the_servers_clock(s3_target, open_target):
    store = open_target(s3_target)
    now = store.now()
    assert now.utcoffset().total_seconds() == 0
    assert abs(time.time() - now.timestamp()) < 60


# --- errors ---------------------------------------------------------------------------


def test_missing_bucket_is_never_a_missing_object(moto_server):
    bucket = f"absent-{uuid.uuid4().hex[:12]}"
    store = open_store(f"s3://{bucket}/run", moto_server.storage_options())
    calls = [
        lambda: store.head("LATEST"),
        lambda: store.exists("LATEST"),
        lambda: store.get("LATEST"),
        lambda: store.get_range("LATEST", 0, 10),
        lambda: store.put("LATEST", b"x", mode=CREATE),
        lambda: store.put("LATEST", b"x", mode=Update('"abc"')),
        lambda: list(store.list()),
        lambda: store.list_multipart(),
        lambda: store.create_multipart("big"),
        lambda: store.delete("LATEST"),
        store.now,
    ]
    for call in calls:
        with pytest.raises(BucketNotFoundError) as info:
            call()
        assert bucket in str(info.value) and "create the bucket" in str(info.value)
        assert not isinstance(info.value, ObjectNotFoundError)
    store.close()


def test_update_of_missing_key_is_a_lost_compare_and_swap(s3_target, open_target):
    store = open_target(s3_target)
    with pytest.raises(PreconditionFailedError):  # S3 and moto answer 404 NoSuchKey
        store.put("absent", b"x", mode=Update('"0cc175b9c0f1b6a831c399e269772661"'))


def test_no_credentials_at_all(moto_server, clean_env):
    store = S3Store("bkt", "run", endpoint_url=moto_server.endpoint_url)
    with pytest.raises(CredentialsError, match="no AWS credentials") as info:
        store.get("LATEST")
    assert "AWS_PROFILE" in info.value.hint and "Azure" not in info.value.hint
    store.close()


def test_unreachable_endpoint_is_transient_and_names_it(caplog):
    caplog.set_level(logging.DEBUG)
    port = _closed_port()
    opts = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "AKIAEXAMPLEKEY",
        "secret": SECRET,
        "token": TOKEN,
        "config_kwargs": {"connect_timeout": 1, "retries": {"mode": "standard", "max_attempts": 1}},
    }
    store = S3Store("bkt", "run", **opts)
    started = time.monotonic()
    for call in (lambda: store.get("k"), lambda: store.put("k", b"x", mode=CREATE)):
        with pytest.raises(TransientStoreError) as info:
            call()
        message = str(info.value)
        assert f"127.0.0.1:{port}" in message
        assert not isinstance(info.value, (CredentialsError, OutcomeUnknownError))
        assert SECRET not in message and TOKEN not in message and "AKIAEXAMPLEKEY" not in message
    assert time.monotonic() - started < 10
    assert SECRET not in caplog.text and TOKEN not in caplog.text
    store.close()


def test_token_never_reaches_debug_logs(s3_target, caplog):
    caplog.set_level(logging.DEBUG)
    opts = {**s3_target.storage_options, "secret": SECRET, "token": TOKEN}
    with open_store(s3_target.url, opts) as store:
        store.put("k", b"x")
        store.get("k")
    assert "security-token" in caplog.text.lower()  # the header is logged ...
    assert TOKEN not in caplog.text and SECRET not in caplog.text  # ... its value is not


@pytest.fixture(scope="module")
def auth_server():
    """A second moto server that checks signatures and IAM policies, with two users:
    ``allowed`` (s3:*) and ``denied`` (no policy)."""
    with MotoServer() as server:
        server.create_bucket("authbucket")
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=server.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        keys = {}
        for user in ("allowed", "denied"):
            iam.create_user(UserName=user)
            keys[user] = iam.create_access_key(UserName=user)["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="allowed", PolicyName="s3", PolicyDocument=json.dumps(policy))
        iam.close()
        server.enforce_auth()
        yield server, keys


def _auth_store(server, key_id: str, secret: str) -> S3Store:
    return S3Store("authbucket", "run", endpoint_url=server.endpoint_url, key=key_id, secret=secret)


def test_rejected_and_denied_credentials(auth_server, caplog):
    caplog.set_level(logging.DEBUG)
    server, keys = auth_server
    allowed, denied = keys["allowed"], keys["denied"]
    with _auth_store(server, allowed["AccessKeyId"], allowed["SecretAccessKey"]) as store:
        _roundtrip(store)
    cases = [
        (_auth_store(server, "AKIAUNKNOWNUNKNOWN00", SECRET), CredentialsError, "InvalidAccessKey"),
        (_auth_store(server, allowed["AccessKeyId"], SECRET), CredentialsError, "SignatureDoes"),
        (
            _auth_store(server, denied["AccessKeyId"], denied["SecretAccessKey"]),
            PermissionDeniedError,
            "AccessDenied",
        ),
    ]
    for store, error, code in cases:
        # head/exists too: a HEAD 403 has no body, the adapter asks again with a GET.
        calls = [
            lambda s=store: s.get("probe"),
            lambda s=store: s.head("probe"),
            lambda s=store: s.exists("probe"),
            lambda s=store: s.put("probe", b"x", mode=CREATE),
            lambda s=store: list(s.list()),
        ]
        for call in calls:
            with pytest.raises(error, match=code) as info:
                call()
            assert SECRET not in str(info.value)
            if error is CredentialsError:  # what to do: S3's own flags and variables
                assert "--profile NAME" in info.value.hint and "AWS_PROFILE" in info.value.hint
        store.close()
    assert SECRET not in caplog.text


def _client_error(code: str, status: int, retries: int = 0) -> bce.ClientError:
    return bce.ClientError(
        {
            "Error": {"Code": code, "Message": f"message for {code}"},
            "ResponseMetadata": {"HTTPStatusCode": status, "RetryAttempts": retries},
        },
        "PutObject",
    )


@pytest.mark.parametrize(
    ("exc", "write", "expected"),
    [
        (_client_error("PreconditionFailed", 412), True, PreconditionFailedError),
        (_client_error("PreconditionFailed", 412, retries=2), True, OutcomeUnknownError),
        (_client_error("ConditionalRequestConflict", 409), True, StoreConflictError),
        (_client_error("NoSuchKey", 404), False, ObjectNotFoundError),
        (_client_error("NoSuchBucket", 404), False, BucketNotFoundError),
        (_client_error("AccessDenied", 403), False, PermissionDeniedError),
        (_client_error("InvalidAccessKeyId", 403), False, CredentialsError),
        (_client_error("SignatureDoesNotMatch", 403), True, CredentialsError),
        (_client_error("ExpiredToken", 400), False, CredentialsError),
        (_client_error("BadDigest", 400), False, ChecksumMismatchError),
        (_client_error("InvalidDigest", 400), False, ChecksumMismatchError),
        (_client_error("InternalError", 500), False, TransientStoreError),
        (_client_error("InternalError", 500), True, OutcomeUnknownError),
        (_client_error("SlowDown", 503), True, TransientStoreError),
        (_client_error("InvalidArgument", 400), False, StoreError),
        (bce.NoCredentialsError(), False, CredentialsError),
        (bce.EndpointConnectionError(endpoint_url="http://x"), True, TransientStoreError),
        (bce.ConnectTimeoutError(endpoint_url="http://x"), True, TransientStoreError),
        (bce.ReadTimeoutError(endpoint_url="http://x"), False, TransientStoreError),
        (bce.ReadTimeoutError(endpoint_url="http://x"), True, OutcomeUnknownError),
        (bce.ConnectionClosedError(endpoint_url="http://x"), True, OutcomeUnknownError),
        (bce.FlexibleChecksumError(error_msg="bad"), False, ChecksumMismatchError),
    ],
    ids=lambda v: getattr(v, "__name__", None) or type(v).__name__,
)
def test_error_mapping(exc, write, expected):
    store = S3Store("bkt", "run", endpoint_url="http://127.0.0.1:9", key="AKIAX", secret=SECRET)
    with pytest.raises(expected) as info, store._errors("put_object", "k", write=write):
        raise exc
    assert type(info.value) is expected  # not merely a subclass
    assert info.value.key == "k" and "s3://bkt/run/k" in str(info.value)
    assert SECRET not in str(info.value)
    store.close()


# --- the MotoServer helper ------------------------------------------------------------


def test_moto_server_lifecycle():
    server = MotoServer()
    with pytest.raises(MotoServerError):
        _ = server.endpoint_url
    with server:
        proc = server._proc
        assert server.running and server.endpoint_url.startswith("http://127.0.0.1:")
        server.create_bucket("lifecycle")
        server.reset()
    assert proc.poll() is not None and not server.running


def test_moto_server_port_in_use_is_a_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(MotoServerError, match=f"port {port}"):
            MotoServer(port=port, startup_timeout=20).start()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process state from /proc")
def test_moto_server_dies_with_its_parent():
    script = textwrap.dedent(
        """
        import os, signal, sys
        from cloudckpt.testing.moto_server import MotoServer
        server = MotoServer().start()
        print(server._proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all
        """
    )
    parent = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return  # dead, waiting to be reaped
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the moto server outlived its parent")


def test_anonymous_access_sends_no_credentials(moto_server, s3_target, open_target, clean_env):
    bucket = s3_target.url.split("/")[2]
    client = moto_server.client()
    client.put_object(Bucket=bucket, Key="run/public", Body=b"open data", ACL="public-read")
    client.close()
    open_target(s3_target).put("private", b"secret data")
    opts = {"endpoint_url": moto_server.endpoint_url, "anon": True}
    with open_store(s3_target.url, opts) as store:  # no credentials anywhere: unsigned
        assert store.get("public")[0] == b"open data"
        with pytest.raises(PermissionDeniedError):
            store.get("private")


def test_signed_payloads_reuse_the_parts_digest_even_with_awscrt(s3_target, open_target):
    # With awscrt installed botocore signs with the CRT's SigV4, which hashes every payload
    # again; the store swaps in botocore's own signer that takes the known digest.
    import hashlib

    from cloudckpt import digest
    from cloudckpt.stores import _s3_client

    opts = {**s3_target.storage_options, "config_kwargs": {"s3": {"payload_signing_enabled": True}}}
    store = open_target(s3_target._replace(storage_options=opts))
    seen = []
    real = _s3_client._PrehashedS3SigV4Auth.payload

    def payload(self, request):
        seen.append(digest.sha256_if_known(request.body) is not None)
        return real(self, request)

    _s3_client._PrehashedS3SigV4Auth.payload = payload
    try:
        upload = store.create_multipart("k")
        data = os.urandom(5 * 1024 * 1024)
        with digest.known_sha256(data, hashlib.sha256(data).digest()):
            part = store.upload_part(upload, 1, data)
        store.complete_multipart(upload, [part])
    finally:
        _s3_client._PrehashedS3SigV4Auth.payload = real
    assert True in seen  # the part was signed with its known digest
    assert store.get("k")[0] == data


# --- per-request savings (issue 31 item 5): the same requests and results, less CPU ------


def _sent_headers(store) -> list[dict[str, str]]:
    """Record the headers of every request the store's client sends from now on."""
    sent: list[dict[str, str]] = []

    def record(request, **kwargs):
        sent.append(
            {
                k.lower(): v.decode() if isinstance(v, bytes) else v
                for k, v in request.headers.items()
            }
        )

    store._client.meta.events.register("before-send.s3", record)
    return sent


def test_ranged_reads_ask_for_no_checksum_unless_the_user_does(s3_target, open_target, clean_env):
    store = open_target(s3_target)
    store.put("k", b"0123456789")
    assert store._client.meta.config.response_checksum_validation == "when_required"
    sent = _sent_headers(store)
    buf = memoryview(bytearray(4))
    assert store.get_range_into("k", 2, buf) == 4 and bytes(buf) == b"2345"
    assert store.get_range("k", 0, 3) == b"012"
    assert "x-amz-checksum-mode" not in sent[0] and "x-amz-checksum-mode" not in sent[1]
    assert store.read_paths["direct"] == 1
    # get() still asks for the full-object checksum itself, and checks it.
    assert store.get("k")[0] == b"0123456789"
    assert sent[2].get("x-amz-checksum-mode") == "ENABLED"

    # The user's choice wins: config_kwargs, a Config in client_kwargs, the environment.
    import botocore.config

    chosen = [
        {"config_kwargs": {"response_checksum_validation": "when_supported"}},
        {
            "client_kwargs": {
                "config": botocore.config.Config(response_checksum_validation="when_supported")
            }
        },
    ]
    for extra in chosen:
        opts = {**s3_target.storage_options}
        for name, value in extra.items():
            opts[name] = {**opts.get(name, {}), **value}
        user = open_target(s3_target._replace(storage_options=opts))
        assert user._client.meta.config.response_checksum_validation == "when_supported"
        sent = _sent_headers(user)
        user.get_range("k", 0, 3)
        assert sent[-1].get("x-amz-checksum-mode") == "ENABLED", extra
    clean_env.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_supported")
    user = open_target(s3_target)
    sent = _sent_headers(user)
    user.get_range("k", 0, 3)
    assert sent[-1].get("x-amz-checksum-mode") == "ENABLED"


def test_responses_parse_as_botocore_parses_them(moto_server, s3_target, open_target):
    # The store's client parses timestamps without dateutil: every parsed field must
    # equal a plain client's.
    store = open_target(s3_target)
    bucket = s3_target.url.split("/")[2]
    plain = moto_server.client()
    plain.put_object(
        Bucket=bucket, Key="run/m", Body=b"abcdef", Metadata={"Mixed-Case": "v"}, ContentType="a/b"
    )
    try:
        for op, params in [
            ("head_object", {}),
            ("get_object", {"Range": "bytes=1-3", "ChecksumMode": "ENABLED"}),
            ("list_objects_v2", {"Prefix": "run/"}),
        ]:
            params = {
                "Bucket": bucket,
                **({} if op.startswith("list") else {"Key": "run/m"}),
                **params,
            }
            ours = getattr(store._client, op)(**params)
            theirs = getattr(plain, op)(**params)
            for resp in (ours, theirs):
                resp.pop("ResponseMetadata")
                if "Body" in resp:
                    resp["Body"] = resp["Body"].read()
            assert ours == theirs, op
            assert ours.get("LastModified", ours.get("Contents", [{}])[0].get("LastModified"))
    finally:
        plain.close()


def test_timestamps_parse_exactly_as_botocore_parses_them():
    import botocore.utils

    from cloudckpt.stores._s3_client import parse_timestamp

    for value in [
        "Sun, 06 Dec 2026 18:23:42 GMT",
        "Mon, 06 Dec 2026 18:23:42 GMT",  # a wrong weekday: ignored by both
        "Thu, 01 Jan 1970 00:00:00 GMT",
        "Tue, 29 Feb 2028 23:59:59 GMT",
        "2026-12-06T18:23:42.000Z",
        "2026-12-06T18:23:42Z",
        "2026-12-06T18:23:42.123456Z",
        "2026-12-06T18:23:42.5Z",
        "2026-12-06T18:23:42+00:00",
        "1700000000",
        1700000000,
    ]:
        ours, theirs = parse_timestamp(value), botocore.utils.parse_timestamp(value)
        # The same instant and offset (dateutil names UTC tzlocal() on a machine whose
        # local zone is UTC; ours says tzutc() for both of S3's forms).
        assert ours == theirs and ours.utcoffset() == theirs.utcoffset(), value
        assert ours.tzinfo is not None
    for bad in ["Fri, 29 Feb 2027 00:00:00 GMT", "2026-12-06T24:00:00Z", "Sun, 06 Foo 2026"]:
        with pytest.raises(ValueError):
            botocore.utils.parse_timestamp(bad)
        with pytest.raises(ValueError):
            parse_timestamp(bad)
