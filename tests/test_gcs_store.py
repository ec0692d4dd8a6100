"""GCS-specific behaviour of ``GCSStore`` against the real fake-gcs-server binary."""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import json
import logging
import socket
import threading
import time
import urllib.parse
import urllib.request

import pytest

from cloudckpt.errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    CloudCkptError,
    ConfigurationError,
    ObjectNotFoundError,
    PreconditionFailedError,
    TransientStoreError,
)
from cloudckpt.stores import CREATE, OVERWRITE, Update, crc32c_b64, gcs, open_store
from cloudckpt.stores.gcs import GCSStore

SECRET = "ya29.SECRET-token-must-never-leak-0123456789"


def _raw_names(server, bucket: str, prefix: str) -> list[str]:
    """Object names straight from the emulator's JSON API (no adapter involved)."""
    query = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{server.endpoint_url}/storage/v1/b/{bucket}/o?{query}") as r:
        return [item["name"] for item in json.loads(r.read()).get("items", [])]


def _bucket(target) -> str:
    return urllib.parse.urlsplit(target.url).netloc


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_storage_options_reach_gcsfs(gcs_server, gcs_target, open_target):
    opts = {**gcs_target.storage_options, "requests_timeout": 30, "min_part_size": 1234}
    store = open_target(gcs_target._replace(storage_options=opts))
    assert isinstance(store, GCSStore)
    assert store.url == f"gs://{_bucket(gcs_target)}/run/"
    assert store._fs.requests_timeout == 30
    assert store._fs.project == "test"
    assert store._fs._location == gcs_server.endpoint_url
    assert store.capabilities.min_part_size == 1234  # ours, not passed on to gcsfs
    store.put("k", b"v")
    assert store.get("k")[0] == b"v"


def test_two_stores_share_no_cache(gcs_target, open_target):
    a, b = open_target(gcs_target), open_target(gcs_target)
    assert a._fs is not b._fs
    a.put("k", b"1")
    assert [o.key for o in b.list("")] == ["k"]
    info = b.put("k", b"2")
    assert a.head("k").version == info.version
    assert [o.version for o in a.list("")] == [info.version]


def test_storage_emulator_host_is_honoured(gcs_server, gcs_target, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint_url)
    opts = {k: v for k, v in gcs_target.storage_options.items() if k != "endpoint_url"}
    with open_store(gcs_target.url, opts) as store:
        store.put("k", b"via env")
        assert store.get("k")[0] == b"via env"


def test_bad_storage_option_is_a_configuration_error(gcs_target):
    with pytest.raises(ConfigurationError):
        open_store(gcs_target.url, {**gcs_target.storage_options, "access": "everything"})


def test_preconditions_on_single_puts(gcs_target, open_target):
    store = open_target(gcs_target)
    first = store.put("k", b"1", mode=CREATE)
    assert first.version.isdigit()
    with pytest.raises(PreconditionFailedError):
        store.put("k", b"2", mode=CREATE)
    for bogus in ("0", "", "not-a-generation", "-1"):
        with pytest.raises(PreconditionFailedError):
            store.put("k", b"3", mode=Update(bogus))
    with pytest.raises(PreconditionFailedError):
        store.put("absent", b"x", mode=Update(first.version))
    assert not store.exists("absent")
    data, info = store.get("k")
    assert data == b"1" and info.version == first.version


def test_get_returns_the_version_of_the_bytes_it_read(gcs_target, open_target):
    writer, reader = open_target(gcs_target), open_target(gcs_target)
    bodies = {writer.put("k", b"body-0").version: b"body-0"}
    stop = threading.Event()

    def write() -> None:
        i = 1
        while not stop.is_set():
            body = b"body-%d" % i
            bodies[writer.put("k", body).version] = body
            i += 1

    thread = threading.Thread(target=write)
    thread.start()
    try:
        reads = [reader.get("k") for _ in range(200)]
    finally:
        stop.set()
        thread.join()
    for data, info in reads:
        assert bodies[info.version] == data
        assert info.size == len(data) and info.last_modified is not None


def test_wrong_crc32c_is_rejected_and_not_kept(gcs_server, gcs_target, open_target):
    store = open_target(gcs_target)
    upload = store.create_multipart("big")
    with pytest.raises(ChecksumMismatchError, match="CRC32C"):
        store.upload_part(upload, 1, b"real bytes", crc32c=crc32c_b64(b"other bytes"))
    scratch = f"run/.cloudckpt/uploads/{upload.upload_id}/"
    assert _raw_names(gcs_server, _bucket(gcs_target), scratch) == [scratch + "target"]
    part = store.upload_part(upload, 1, b"real bytes", crc32c=crc32c_b64(b"real bytes"))
    assert part.crc32c == crc32c_b64(b"real bytes")
    store.complete_multipart(upload, [part])
    assert store.get("big")[0] == b"real bytes"


@pytest.mark.parametrize("limit, count", [(32, 70), (4, 70)], ids=["gcs-limit", "deep-tree"])
def test_compose_more_parts_than_one_compose_takes(
    gcs_server, gcs_target, open_target, monkeypatch, limit, count
):
    # 70 parts at GCS's real 32-source limit need one intermediate level; a limit of 4
    # needs three, which exercises the tree as 10,000 parts would (fast on the emulator).
    monkeypatch.setattr(gcs, "_MAX_COMPOSE_SOURCES", limit)
    opts = {**gcs_target.storage_options, "min_part_size": 1}
    store = open_target(gcs_target._replace(storage_options=opts))
    chunks = [b"part-%04d|" % n for n in range(1, count + 1)]
    upload = store.create_multipart("ckpt/model.bin")
    with cf.ThreadPoolExecutor(8) as pool:
        parts = list(
            pool.map(lambda n: store.upload_part(upload, n, chunks[n - 1]), range(1, count + 1))
        )
    info = store.complete_multipart(upload, parts, mode=CREATE)
    data, got = store.get("ckpt/model.bin")
    assert data == b"".join(chunks) and got.version == info.version and info.size == len(data)
    assert _raw_names(gcs_server, _bucket(gcs_target), "run/.cloudckpt/") == []
    assert store.list_multipart() == []


def test_completion_onto_an_existing_key(gcs_target, open_target):
    opts = {**gcs_target.storage_options, "min_part_size": 1}
    store = open_target(gcs_target._replace(storage_options=opts))
    first = store.put("k", b"original")
    upload = store.create_multipart("k")
    parts = [store.upload_part(upload, n, b"new%d" % n) for n in range(1, 40)]
    with pytest.raises(PreconditionFailedError):
        store.complete_multipart(upload, parts, mode=CREATE)
    assert store.get("k")[0] == b"original"
    # The emulator's compose ignores preconditions and keeps the old generation; the
    # adapter measured that and does not compose onto user keys there.
    assert store._compose_trusted is False
    replaced = store.complete_multipart(upload, parts, mode=OVERWRITE)
    assert store.get("k")[0] == b"".join(b"new%d" % n for n in range(1, 40))
    assert replaced.version != first.version
    with pytest.raises(PreconditionFailedError):
        store.put("k", b"stale", mode=Update(first.version))


def test_complete_checks_the_parts(gcs_target, open_target):
    store = open_target(gcs_target)
    upload = store.create_multipart("k")
    part = store.upload_part(upload, 1, b"a")
    store.upload_part(upload, 1, b"b")  # replaced: the old etag is stale
    with pytest.raises(CloudCkptError, match="replaced"):
        store.complete_multipart(upload, [part])
    store.abort_multipart(upload)
    with pytest.raises(ObjectNotFoundError):
        store.complete_multipart(upload, [part])
    store.abort_multipart(upload)  # aborting an unknown upload is fine


@pytest.mark.parametrize("bad", [[], "unordered"], ids=["no-parts", "unordered"])
def test_complete_refuses_a_bad_part_list(gcs_target, open_target, bad):
    """A StoreError naming the key (it used to be a TypeError: the key went in positionally)."""
    from cloudckpt.errors import StoreError

    store = open_target(gcs_target)
    upload = store.create_multipart("k")
    if bad == "unordered":
        bad = [store.upload_part(upload, n, b"x") for n in (2, 1)]
    with pytest.raises(StoreError, match="ascending order") as info:
        store.complete_multipart(upload, bad)
    assert info.value.key == "k"
    store.abort_multipart(upload)


def test_orphaned_parts_are_listed_for_gc(gcs_target, open_target):
    store = open_target(gcs_target)
    upload = store.create_multipart("k")
    store.abort_multipart(upload)
    store.upload_part(upload, 3, b"late part")  # an abort raced an upload
    pending = store.list_multipart()
    assert [(p.key, p.upload_id) for p in pending] == [("", upload.upload_id)]
    assert pending[0].initiated is not None
    assert store.list_multipart("k") == []
    store.abort_multipart(upload)
    assert store.list_multipart() == []


def test_missing_bucket_is_not_a_missing_object(gcs_server, open_target, gcs_target):
    store = open_target(gcs_target._replace(url="gs://no-such-bucket-here/run"))
    calls = [
        lambda: store.head("k"),
        lambda: store.get("k"),
        lambda: store.get_range("k", 0, 10),
        lambda: list(store.list("")),
        lambda: store.put("k", b"x", mode=CREATE),
        lambda: store.delete("k"),
        lambda: store.now(),
        lambda: store.list_multipart(),
    ]
    for call in calls:
        with pytest.raises(BucketNotFoundError, match="no-such-bucket-here"):
            call()
    # And in an existing bucket a missing key is just that.
    real = open_target(gcs_target)
    with pytest.raises(ObjectNotFoundError):
        real.head("k")
    real.delete("k")


def test_connection_refused_names_the_endpoint(gcs_target, open_target):
    port = _unused_port()
    opts = {**gcs_target.storage_options, "endpoint_url": f"http://user:pw@127.0.0.1:{port}"}
    store = open_target(gcs_target._replace(storage_options=opts))
    started = time.monotonic()
    for call in (lambda: store.head("k"), lambda: store.put("k", b"x", mode=CREATE)):
        with pytest.raises(TransientStoreError) as info:  # nothing was sent: safe to retry
            call()
        assert f"127.0.0.1:{port}" in str(info.value)
        assert "pw" not in str(info.value)
    assert time.monotonic() - started < 10, "no retry loop on a refused connection"


def test_tokens_never_reach_messages_or_logs(gcs_server, gcs_target, caplog):
    from google.oauth2.credentials import Credentials

    caplog.set_level(logging.DEBUG)
    opts = {**gcs_target.storage_options, "token": Credentials(token=SECRET)}
    texts = []
    with open_store(gcs_target.url, opts) as store:
        texts.append(repr(store))
        store.put("k", b"v", mode=CREATE)
        for call in (
            lambda: store.put("k", b"v", mode=CREATE),
            lambda: store.get("missing"),
            lambda: store.put("k", b"v", mode=Update("1")),
        ):
            with pytest.raises(CloudCkptError) as info:
                call()
            texts.append(str(info.value))
    missing = {**opts, "endpoint_url": f"http://127.0.0.1:{_unused_port()}"}
    with open_store(gcs_target.url, missing) as store, pytest.raises(CloudCkptError) as info:
        store.head("k")
    texts.append(str(info.value))
    assert SECRET not in caplog.text
    assert not [t for t in texts if SECRET in t]


def test_now_agrees_with_object_times(gcs_target, open_target):
    store = open_target(gcs_target)
    before = store.now()
    written = store.put("clock", b"t").last_modified
    after = store.now()
    assert before.tzinfo is not None and written is not None
    # Date headers have one-second resolution.
    assert before - dt.timedelta(seconds=1) <= written <= after + dt.timedelta(seconds=1)
    assert abs((store.head("clock").last_modified - written).total_seconds()) < 1e-3
    assert [o.key for o in store.list("")] == ["clock"]  # the clock leaves no objects


def test_unknown_storage_option_is_refused(gcs_target):
    from cloudckpt import ConfigurationError
    from cloudckpt.stores import open_store

    with pytest.raises(ConfigurationError, match="endpont_url"):
        open_store(gcs_target.url, {**gcs_target.storage_options, "endpont_url": "x"})


def test_ranges_are_read_straight_into_the_callers_buffer(gcs_target, open_target):
    # get_range_into: the transfer engine's download path (plain http.client per thread,
    # not gcsfs's event loop), with the same answers as get_range.
    store = open_target(gcs_target)
    store.put("obj", b"0123456789")
    buf = bytearray(4)
    assert store.get_range_into("obj", 3, memoryview(buf)) == 4 and buf == b"3456"
    buf = bytearray(8)
    assert store.get_range_into("obj", 6, memoryview(buf)) == 4 and buf[:4] == b"6789"
    assert store.get_range_into("obj", 10, memoryview(bytearray(5))) == 0
    assert store.get_range_into("obj", 0, memoryview(bytearray(0))) == 0
    with pytest.raises(ObjectNotFoundError):
        store.get_range_into("nope", 0, memoryview(bytearray(1)))
    # The connection stays usable after an error answer.
    buf = bytearray(2)
    assert store.get_range_into("obj", 0, memoryview(buf)) == 2 and buf == b"01"
