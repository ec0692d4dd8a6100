"""The lean ranged GET of ``S3Store.get_range_into`` (``cloudckpt/stores/_s3_fast_get.py``).

Against real servers: moto, SeaweedFS (which checks signatures) and, for the answers no
real server gives on demand, a loopback HTTP stub in front of moto that forwards every
request and spoils chosen answers (a 200 for a ranged GET, a Content-Range that starts
elsewhere, a body cut mid-way, a Content-Range mismatch on a kept-alive connection).
Each test asserts which path served the reads (``read_paths``: "lean", "fallback", and
botocore's "direct"/"copy") and that the bytes or errors are botocore's.
"""

from __future__ import annotations

import http.client
import http.server
import logging
import os
import threading
import time
import uuid

import botocore.credentials
import botocore.exceptions
import pytest

from cloudckpt.errors import ObjectNotFoundError, StoreError
from cloudckpt.stores import _s3_client
from cloudckpt.stores._s3_fast_get import MAX_FALLBACKS
from cloudckpt.stores.s3 import S3Store
from cloudckpt.testing.proxy import FaultProxy, ProxyRule

KEY = "obj"
DATA = os.urandom(300_000)


def _store(server, bucket, prefix="run", **options):
    return S3Store(bucket, prefix, **{**server.storage_options(), **options})


def _bucket(server):
    name = "fast-" + uuid.uuid4().hex[:12]
    server.create_bucket(name)
    return name


def _read(store, key, start, length):
    buf = memoryview(bytearray(length))
    got = store.get_range_into(key, start, buf)
    return bytes(buf[:got])


def _learned(store, key=KEY):
    """The first read (botocore's), which teaches the fast path."""
    assert not store._fast.ready
    assert _read(store, key, 0, 10) == DATA[:10] if key == KEY else True
    assert store.read_paths["lean"] == 0 and store.read_paths["direct"] == 1
    assert store._fast.ready, store._fast.refused


# --- the happy path on real servers ----------------------------------------------------


@pytest.mark.parametrize("server", ["moto_server", "seaweedfs_server"])
def test_reads_after_the_first_take_the_lean_path_and_are_botocores_bytes(server, request):
    server = request.getfixturevalue(server)
    store = _store(server, _bucket(server))
    store.put(KEY, DATA)
    _learned(store)
    for start, length in [(0, 300_000), (1, 4096), (123_456, 70_000), (299_999, 1)]:
        assert _read(store, KEY, start, length) == DATA[start : start + length]
    # A range reaching past the end: the 206 says where the object ends; fewer bytes.
    assert _read(store, KEY, 299_000, 5000) == DATA[299_000:]
    assert store.read_paths["lean"] == 5 and store.read_paths["fallback"] == 0


@pytest.mark.parametrize("key", ["a b+c~d", "ü/ñ é", "x%20y&z=1?q", "dir/sub dir/k+~"])
def test_keys_that_need_quoting_take_the_lean_path(moto_server, key):
    store = _store(moto_server, _bucket(moto_server))
    store.put(key, DATA)
    other = key + "2"
    store.put(other, DATA[::-1])
    assert _read(store, key, 5, 100) == DATA[5:105]  # botocore, learning from this key
    assert store._fast.ready
    assert _read(store, other, 7, 1000) == DATA[::-1][7:1007]
    assert _read(store, key, 0, 10) == DATA[:10]
    assert store.read_paths["lean"] == 2 and store.read_paths["fallback"] == 0


def test_a_wrong_secret_falls_back_and_botocore_raises_its_error(seaweedfs_server):
    """SeaweedFS checks signatures: the lean request with credentials that turned wrong
    (credentials are taken per request) is refused, and botocore's answer is the error
    a store built with that secret gets."""
    bucket = _bucket(seaweedfs_server)
    store = _store(seaweedfs_server, bucket)
    store.put(KEY, DATA)
    _learned(store)
    opts = seaweedfs_server.storage_options()
    wrong = _store(seaweedfs_server, bucket, secret="x" * 20)
    with pytest.raises(StoreError) as expected:
        _read(wrong, KEY, 0, 10)
    assert not wrong._fast.ready and wrong.read_paths["lean"] == 0
    signer = store._client._request_signer
    signer._credentials = botocore.credentials.Credentials(opts["key"], "x" * 20)
    with pytest.raises(StoreError) as got:
        _read(store, KEY, 0, 10)
    assert type(got.value) is type(expected.value)
    assert store.read_paths["fallback"] == 1 and store.read_paths["lean"] == 0
    # The right secret again (as a refreshed credential would be): lean again.
    signer._credentials = botocore.credentials.Credentials(opts["key"], opts["secret"])
    assert _read(store, KEY, 100, 50) == DATA[100:150]
    assert store.read_paths["lean"] == 1


def test_nothing_is_learned_from_a_get_that_failed(moto_server):
    store = _store(moto_server, _bucket(moto_server))
    store.put(KEY, DATA)
    with pytest.raises(ObjectNotFoundError):
        _read(store, "missing", 0, 10)
    assert not store._fast.ready  # botocore sent a GetObject, but it did not succeed
    _learned(store)


# --- fallbacks -------------------------------------------------------------------------


def test_a_missing_key_and_a_range_past_the_end_fall_back_to_botocores_answers(moto_server):
    store = _store(moto_server, _bucket(moto_server))
    store.put(KEY, DATA)
    _learned(store)
    with pytest.raises(ObjectNotFoundError):
        _read(store, "missing", 0, 10)
    assert store.read_paths["fallback"] == 1
    assert _read(store, KEY, len(DATA), 10) == b""  # 416: botocore's empty read
    assert store.read_paths["fallback"] == 2 and store._fast.ready
    assert _read(store, KEY, 3, 3) == DATA[3:6]  # a success resets the count
    assert store.read_paths["lean"] == 1 and store._fast._fallbacks == 0


def test_answers_every_client_gets_do_not_turn_the_path_off(moto_server):
    """A missing key and a range past the end are answered to botocore too: they say
    nothing about the lean path, however many come in a row."""
    store = _store(moto_server, _bucket(moto_server))
    store.put(KEY, DATA)
    _learned(store)
    for _ in range(MAX_FALLBACKS + 2):
        with pytest.raises(ObjectNotFoundError):
            _read(store, "missing", 0, 10)
        assert _read(store, KEY, len(DATA), 10) == b""
    assert store.read_paths["fallback"] == 2 * (MAX_FALLBACKS + 2)
    assert store._fast.ready and store._fast.refused is None
    assert _read(store, KEY, 0, 10) == DATA[:10] and store.read_paths["lean"] == 1


def test_a_burst_of_throttling_does_not_turn_the_path_off(seaweedfs_server):
    """503s that botocore's retries ride out, more than MAX_FALLBACKS of them: every read
    gets its bytes, and the lean path stays on."""
    bucket = _bucket(seaweedfs_server)
    with FaultProxy(seaweedfs_server.endpoint_url) as proxy:
        store = _store(seaweedfs_server, bucket, endpoint_url=proxy.endpoint_url)
        store.put(KEY, DATA)
        _learned(store)
        for i in range(MAX_FALLBACKS + 2):
            rule = proxy.add(ProxyRule("503", methods={"GET"}, times=1))
            assert _read(store, KEY, i, 10) == DATA[i : i + 10]
            assert rule.fired == 1
        assert store.read_paths["fallback"] == MAX_FALLBACKS + 2
        assert store._fast.ready and store._fast.refused is None
        assert _read(store, KEY, 0, 10) == DATA[:10] and store.read_paths["lean"] == 1


def test_a_store_that_fails_every_read_costs_one_lean_request_in_all(seaweedfs_server):
    """503 for every GET: the first lean try rests the path, and the reads after it are
    botocore's alone (its attempts), not a lean try besides each; once the store
    answers, botocore's read wakes the path and the next read is lean again."""
    bucket = _bucket(seaweedfs_server)
    retries = {"config_kwargs": {"retries": {"mode": "standard", "max_attempts": 1}}}
    with FaultProxy(seaweedfs_server.endpoint_url) as proxy:
        store = _store(seaweedfs_server, bucket, endpoint_url=proxy.endpoint_url, **retries)
        store.put(KEY, DATA)
        _learned(store)
        rule = proxy.add(ProxyRule("503", methods={"GET"}))
        sent = []  # GETs each read sent
        for i in range(3):
            before = rule.fired
            with pytest.raises(StoreError):
                _read(store, KEY, i, 10)
            sent.append(rule.fired - before)
        attempts = sent[1]  # botocore's alone
        assert attempts >= 1 and sent == [attempts + 1, attempts, attempts], sent
        assert store.read_paths["fallback"] == 1 and store.read_paths["lean"] == 0
        assert not store._fast.ready and store._fast.refused is None  # resting, not off
        rule.times = 0  # the store answers again
        assert _read(store, KEY, 5, 10) == DATA[5:15]  # botocore's, which wakes the path
        assert store._fast.ready and store.read_paths["lean"] == 0
        assert _read(store, KEY, 6, 10) == DATA[6:16] and store.read_paths["lean"] == 1


def test_bodies_cut_short_do_not_turn_the_path_off(stub_store):
    """A connection closed mid-body is the network's doing, as a reset is: botocore's read
    gets the bytes, and the lean path stays on however many come in a row."""
    stub, store = stub_store
    stub.faults = ["cut", ""] * (MAX_FALLBACKS + 1)  # each lean try cut, botocore's not
    for i in range(MAX_FALLBACKS + 1):
        assert _read(store, KEY, i, 50_000) == DATA[i : i + 50_000]
    assert stub.faults == []
    assert store.read_paths["fallback"] == MAX_FALLBACKS + 1
    assert store._fast.ready and store._fast.refused is None
    assert _read(store, KEY, 0, 10) == DATA[:10] and store.read_paths["lean"] == 1


def test_the_path_turns_itself_off_after_refused_answers_in_a_row(stub_store, caplog):
    """2xx answers the path cannot take (here a 200 for a ranged GET), MAX_FALLBACKS in a
    row: the store's answers do not fit the path; off for good, said once at INFO."""
    stub, store = stub_store
    caplog.set_level(logging.INFO, logger="cloudckpt.stores.s3")
    stub.faults = ["200", ""] * MAX_FALLBACKS  # each lean try spoiled, botocore's not
    for i in range(MAX_FALLBACKS):
        assert _read(store, KEY, i, 10) == DATA[i : i + 10]
    assert stub.faults == []
    assert store.read_paths["fallback"] == MAX_FALLBACKS
    assert not store._fast.ready and "fallbacks in a row" in store._fast.refused
    offs = [r for r in caplog.records if "lean ranged GETs off" in r.getMessage()]
    assert len(offs) == 1 and offs[0].levelno == logging.INFO
    assert _read(store, KEY, 0, 10) == DATA[:10]
    assert store._fast.ready is False and store.read_paths["lean"] == 0


class _Stub:
    """A loopback HTTP/1.1 server that forwards every request to ``upstream`` and, for the
    ranged GETs of ``KEY`` while ``faults`` holds some, spoils the answer (one fault a
    request). ``seen`` lists (connection number, method, path, fault) per request."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.faults: list[str] = []
        self.seen: list[tuple[int, str, str, str]] = []
        self._conns = 0
        self._lock = threading.Lock()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with stub._lock:
                    stub._conns += 1
                    self.conn_no = stub._conns

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                fault = ""
                rng = headers.get("Range")
                if self.command == "GET" and rng and self.path.endswith("/" + KEY):
                    with stub._lock:
                        fault = stub.faults.pop(0) if stub.faults else ""
                if fault == "200":
                    del headers["Range"]
                elif fault == "shifted":  # the same length, one byte later
                    a, b = rng.split("=")[1].split("-")
                    headers["Range"] = f"bytes={int(a) + 1}-{int(b) + 1}"
                stub.seen.append((self.conn_no, self.command, self.path, fault))
                conn = http.client.HTTPConnection(stub.upstream, timeout=30)
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() in ("content-length", "transfer-encoding", "connection"):
                        continue
                    if k.lower() == "content-range" and fault == "late":
                        a, rest = v.split(" ", 1)[1].split("-", 1)
                        v = f"bytes {int(a) + 1}-{rest}"
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault == "cut":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if fault == "late":  # the head now, the body once the client gave up
                    self.wfile.flush()
                    time.sleep(0.3)
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub_store(moto_server):
    bucket = _bucket(moto_server)
    stub = _Stub(moto_server.endpoint_url)
    store = _store(moto_server, bucket, endpoint_url=stub.url)
    store.put(KEY, DATA)
    _learned(store)
    yield stub, store
    store.close()
    stub.close()


@pytest.mark.parametrize("fault", ["200", "shifted", "cut", "late"])
def test_a_spoiled_answer_falls_back_to_botocores_bytes(stub_store, fault):
    """200 (the whole object), a 206 one byte later than asked (same length), a body cut
    mid-way, a Content-Range that does not match: refused, botocore's bytes returned."""
    stub, store = stub_store
    stub.faults = [fault]
    assert _read(store, KEY, 1000, 50_000) == DATA[1000:51_000]
    assert stub.faults == []  # the fault fired, on the lean request
    assert store.read_paths["fallback"] == 1 and store.read_paths["lean"] == 0
    assert [s[3] for s in stub.seen[-2:]] == [fault, ""]  # then botocore's, unspoiled
    assert _read(store, KEY, 7, 10) == DATA[7:17]
    assert store.read_paths["lean"] == 1


def test_a_refused_answers_connection_is_never_used_again(stub_store):
    """The head of a mismatched answer arrives, its body later: that connection holds
    unread bytes, so no later request may go over it."""
    stub, store = stub_store
    stub.faults = ["late"]
    assert _read(store, KEY, 1000, 4096) == DATA[1000:5096]
    assert _read(store, KEY, 0, 4096) == DATA[:4096]
    spoiled = next(i for i, s in enumerate(stub.seen) if s[3] == "late")
    conn = stub.seen[spoiled][0]
    assert [s for s in stub.seen[spoiled + 1 :] if s[0] == conn] == []


# --- eligibility -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"requester_pays": True},
        {"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256",
                                  "SSECustomerKey": "k" * 32}},
        {"s3_additional_kwargs": {"ExpectedBucketOwner": "123456789012"}},
    ],
)  # fmt: skip
def test_extra_get_object_arguments_keep_the_store_on_botocore(moto_server, options):
    store = _store(moto_server, _bucket(moto_server), **options)
    assert store._fast.refused and "s3_additional_kwargs" in store._fast.refused
    assert not store._fast.ready


def test_extra_arguments_for_other_calls_only_leave_the_fast_path_on(moto_server):
    store = _store(moto_server, _bucket(moto_server), s3_additional_kwargs={"ACL": "private"})
    store.put(KEY, DATA)
    _learned(store)
    assert _read(store, KEY, 0, 5) == DATA[:5] and store.read_paths["lean"] == 1


def test_a_proxy_keeps_the_store_on_botocore(moto_server, monkeypatch):
    """HTTP_PROXY names a proxy for the endpoint (NO_PROXY does not exempt it): botocore
    sends through it, so the lean path refuses. (The proxy is the stub: it forwards.)"""
    stub = _Stub(moto_server.endpoint_url)
    try:
        monkeypatch.setenv("HTTP_PROXY", stub.url)
        monkeypatch.setenv("NO_PROXY", "example.invalid")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("http_proxy", raising=False)
        store = _store(moto_server, _bucket(moto_server))
        store.put(KEY, DATA)
        assert _read(store, KEY, 0, 10) == DATA[:10]
        assert stub.seen  # botocore really went through the proxy
        assert not store._fast.ready and "proxy" in store._fast.refused
        assert _read(store, KEY, 0, 10) == DATA[:10] and store.read_paths["lean"] == 0
    finally:
        stub.close()


def test_checksum_mode_on_every_get_keeps_the_store_on_botocore(moto_server):
    store = _store(
        moto_server,
        _bucket(moto_server),
        config_kwargs={"response_checksum_validation": "when_supported"},
    )
    store.put(KEY, DATA)
    assert _read(store, KEY, 0, 10) == DATA[:10]
    assert not store._fast.ready and "x-amz-checksum-mode" in store._fast.refused


def test_anonymous_and_sigv2_stores_stay_on_botocore(moto_server):
    anon = S3Store(_bucket(moto_server), "run", endpoint_url=moto_server.endpoint_url, anon=True)
    assert anon._fast.refused  # UNSIGNED
    v2 = _store(moto_server, _bucket(moto_server), config_kwargs={"signature_version": "s3"})
    assert v2._fast.refused and "signature version" in v2._fast.refused


def test_the_switch_off_keeps_new_stores_on_botocore(moto_server, monkeypatch):
    monkeypatch.setitem(_s3_client.SAVINGS, "lean_get", False)
    store = _store(moto_server, _bucket(moto_server))
    store.put(KEY, DATA)
    for _ in range(3):
        assert _read(store, KEY, 0, 10) == DATA[:10]
    assert store.read_paths["lean"] == 0 and not store._fast.ready


def test_an_answer_that_never_went_over_the_network_teaches_nothing(monkeypatch, tmp_path):
    """moto's in-process ``mock_aws`` answers botocore from a before-send handler: nothing
    was sent, so nothing may be learned (the lean path would then send real requests to
    AWS's endpoint). Every real send is refused here, so a failing run contacts nothing."""
    import botocore.httpsession
    import moto

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    sent = []

    def refuse(self, request):
        sent.append(request.url)
        raise botocore.exceptions.EndpointConnectionError(endpoint_url=request.url)

    monkeypatch.setattr(botocore.httpsession.URLLib3Session, "send", refuse)
    with moto.mock_aws():
        store = S3Store("mock-bucket", "run")
        store._client.create_bucket(Bucket="mock-bucket")
        store.put(KEY, DATA)
        for i in range(MAX_FALLBACKS + 2):
            assert _read(store, KEY, i, 10) == DATA[i : i + 10]
    assert sent == [] and not store._fast.ready and store._fast.refused is None
    assert store.read_paths["lean"] == 0 and store.read_paths["fallback"] == 0


# --- end to end --------------------------------------------------------------------------


def test_load_state_from_seaweedfs_through_the_lean_path(seaweedfs_server, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from torch_states import tied_state

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import load_state, save_state

    bucket = _bucket(seaweedfs_server)
    state = tied_state(3)
    mgr = CheckpointManager(
        f"s3://{bucket}/run",
        storage_options=seaweedfs_server.storage_options(),
        staging_dir=tmp_path / "staging",
        chunking="tensor",
    )
    try:
        save_state(mgr, 3, state).result(timeout=60)
    finally:
        mgr.close()
    store = _store(seaweedfs_server, bucket)
    got = load_state(store, weights_only=True)
    for k, v in state["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["step"] == state["step"]
    assert store.read_paths["lean"] >= 2, store.read_paths
    assert store.read_paths["fallback"] == 0
