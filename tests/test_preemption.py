"""PreemptionWatcher: fake AWS/GCE/Azure metadata servers on 127.0.0.1 and real signals.

No test here contacts a real metadata address: every cloud source gets a 127.0.0.1 URL, and
auto-detection reads a fake DMI directory.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from cloudckpt.errors import ConfigurationError
from cloudckpt.preemption import (
    AWSSpotSource,
    AzureScheduledEventsSource,
    GCEPreemptedSource,
    PreemptionNotice,
    PreemptionSource,
    PreemptionWatcher,
    detect_clouds,
)


@pytest.fixture(autouse=True)
def _no_endpoint_env(monkeypatch):
    for var in (
        "CLOUDCKPT_AWS_METADATA_URL",
        "CLOUDCKPT_GCE_METADATA_URL",
        "CLOUDCKPT_AZURE_METADATA_URL",
        "CLOUDCKPT_PREEMPTION_SOURCES",
        "AWS_EC2_METADATA_SERVICE_ENDPOINT",
        "GCE_METADATA_HOST",
    ):
        monkeypatch.delenv(var, raising=False)


class FakeMetadata:
    """A metadata server on 127.0.0.1: ``route(method, path, headers, query)`` returns
    (status, headers, body). Every request is recorded in ``requests``."""

    def __init__(self, route: Callable[..., tuple[int, dict[str, str], bytes]]) -> None:
        self.route = route
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                parts = urlsplit(self.path)
                headers = {k.lower(): v for k, v in self.headers.items()}
                fake.requests.append((self.command, parts.path, headers))
                status, out_headers, body = fake.route(
                    self.command, parts.path, headers, parse_qs(parts.query)
                )
                self.send_response(status)
                for k, v in out_headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = _serve

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_metadata():
    made: list[FakeMetadata] = []

    def make(route):
        server = FakeMetadata(route)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


class FakeIMDS:
    """EC2's IMDSv2: a token from PUT /latest/api/token is required on every GET."""

    def __init__(self) -> None:
        self.tokens = 0
        self.valid: set[str] = set()
        self.notice: dict[str, Any] | None = None

    def __call__(self, method, path, headers, query):
        if method == "PUT" and path == "/latest/api/token":
            if "x-aws-ec2-metadata-token-ttl-seconds" not in headers:
                return 400, {}, b"missing TTL"
            self.tokens += 1
            token = f"token-{self.tokens}"
            self.valid.add(token)
            return 200, {}, token.encode()
        if method == "GET" and path == "/latest/meta-data/spot/instance-action":
            if headers.get("x-aws-ec2-metadata-token") not in self.valid:
                return 401, {}, b""
            if self.notice is None:
                return 404, {}, b"Not Found"
            return 200, {"Content-Type": "text/plain"}, json.dumps(self.notice).encode()
        return 404, {}, b""


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------ AWS


def test_aws_uses_imdsv2_token_and_reads_instance_action(fake_metadata):
    imds = FakeIMDS()
    server = fake_metadata(imds)
    source = AWSSpotSource(server.url)

    assert source.poll() is None  # 404: no notice
    assert source.poll() is None
    methods = [(m, p) for m, p, _ in server.requests]
    assert methods == [
        ("PUT", "/latest/api/token"),
        ("GET", "/latest/meta-data/spot/instance-action"),
        ("GET", "/latest/meta-data/spot/instance-action"),  # the token is reused
    ]
    assert server.requests[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    assert server.requests[1][2]["x-aws-ec2-metadata-token"] == "token-1"

    when = time.time() + 120
    imds.notice = {"action": "terminate", "time": _iso(when)}
    notice = source.poll()
    assert notice is not None and notice.source == "aws"
    assert "terminate" in notice.reason
    assert notice.deadline == pytest.approx(when, abs=1.5)
    assert 100 < notice.seconds_left() <= 121


def test_aws_refreshes_a_revoked_token(fake_metadata):
    imds = FakeIMDS()
    server = fake_metadata(imds)
    source = AWSSpotSource(server.url)
    assert source.poll() is None
    imds.valid.clear()  # revoked / expired
    imds.notice = {"action": "stop", "time": _iso(time.time() + 60)}
    notice = source.poll()
    assert notice is not None and "stop" in notice.reason
    assert imds.tokens == 2
    assert [m for m, _, _ in server.requests].count("PUT") == 2


# ------------------------------------------------------------------------------ GCE


def test_gce_preempted_flag_with_metadata_flavor(fake_metadata):
    state = {"value": b"FALSE", "flavor": True}

    def route(method, path, headers, query):
        if path != "/computeMetadata/v1/instance/preempted":
            return 404, {}, b""
        if headers.get("metadata-flavor") != "Google":
            return 403, {}, b"Missing Metadata-Flavor:Google header."
        return 200, ({"Metadata-Flavor": "Google"} if state["flavor"] else {}), state["value"]

    server = fake_metadata(route)
    source = GCEPreemptedSource(server.url)
    assert source.poll() is None
    state["value"] = b"TRUE"
    state["flavor"] = False  # something else answering: not trusted
    assert source.poll() is None
    state["flavor"] = True
    notice = source.poll()
    assert notice is not None and notice.source == "gce"
    assert notice.seconds_left() == pytest.approx(30, abs=2)


# ------------------------------------------------------------------------------ Azure


def test_azure_preempt_event_for_this_vm_only(fake_metadata):
    not_before = time.time() + 30
    state: dict[str, Any] = {"events": []}

    def route(method, path, headers, query):
        if headers.get("metadata") != "true":
            return 400, {}, b"Bad request: Metadata header missing"
        if path == "/metadata/instance/compute/name":
            return 200, {}, b"vm-7"
        if path == "/metadata/scheduledevents":
            assert query["api-version"] == ["2020-07-01"]
            doc = {"DocumentIncarnation": len(state["events"]), "Events": state["events"]}
            return 200, {"Content-Type": "application/json"}, json.dumps(doc).encode()
        return 404, {}, b""

    server = fake_metadata(route)
    source = AzureScheduledEventsSource(server.url)
    assert source.poll() is None

    def event(kind, resources):
        stamp = dt.datetime.fromtimestamp(not_before, dt.timezone.utc)
        return {
            "EventId": f"id-{kind}-{resources[0]}",
            "EventType": kind,
            "ResourceType": "VirtualMachine",
            "Resources": resources,
            "EventStatus": "Scheduled",
            "NotBefore": stamp.strftime("%a, %d %b %Y %H:%M:%S GMT"),
            "Description": "",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }

    state["events"] = [event("Freeze", ["vm-7"]), event("Preempt", ["vm-3"])]
    assert source.poll() is None  # a freeze, and another VM's eviction
    state["events"].append(event("Preempt", ["vm-7"]))
    notice = source.poll()
    assert notice is not None and notice.source == "azure"
    assert notice.detail["EventId"] == "id-Preempt-vm-7"
    assert notice.deadline == pytest.approx(not_before, abs=1.5)


# ------------------------------------------------------------------------------ watcher


def test_watcher_polls_in_the_background_and_calls_back_once(fake_metadata):
    imds = FakeIMDS()
    server = fake_metadata(imds)
    seen: list[tuple[PreemptionNotice, str]] = []
    watcher = PreemptionWatcher(
        ["aws"],
        aws_url=server.url,
        interval=0.05,
        on_preempt=lambda n: seen.append((n, threading.current_thread().name)),
    )
    with watcher:
        assert watcher.running and not watcher.preempted
        assert not watcher.wait(0.3)
        imds.notice = {"action": "terminate", "time": _iso(time.time() + 100)}
        assert watcher.wait(5)
        assert watcher.reason.startswith("AWS spot interruption: terminate")
        assert 90 < watcher.seconds_left() <= 101
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        late: list[PreemptionNotice] = []
        watcher.add_callback(late.append)  # called at once: it already happened
        polls = len(server.requests)
        time.sleep(0.3)
        assert len(server.requests) == polls  # no polling after the notice
    assert len(seen) == 1 and seen[0][1] == "cloudckpt-preemption"
    assert late == [watcher.notice]
    assert not watcher.running


def test_metadata_failures_are_logged_at_debug_and_never_raise(fake_metadata, caplog):
    answers = iter([(500, b"oops"), (200, b"{not json"), (200, b"[1, 2]")])

    def route(method, path, headers, query):
        if method == "PUT":
            return 200, {}, b"tok"
        status, body = next(answers, (404, b""))
        return status, {}, body

    server = fake_metadata(route)

    class Exploding(PreemptionSource):
        name = "exploding"
        calls = 0

        def poll(self):
            Exploding.calls += 1
            raise RuntimeError("boom")

    refused = AWSSpotSource("http://127.0.0.1:9", timeout=0.2)  # discard port: refused
    caplog.set_level(logging.DEBUG, logger="cloudckpt.preemption")
    watcher = PreemptionWatcher(
        [AWSSpotSource(server.url, timeout=0.5), refused, Exploding()], signals=(), interval=0.02
    )
    with watcher:
        deadline = time.monotonic() + 10
        while Exploding.calls < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watcher.running and not watcher.preempted
    assert Exploding.calls >= 6
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("boom" in m for m in debug)
    assert any("instance-action answered 500" in m for m in debug)
    assert any("JSONDecodeError" in m or "AttributeError" in m for m in debug)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_sigterm_sets_the_flag_chains_and_restores_the_handler():
    calls: list[int] = []

    def previous(signum, frame):
        calls.append(signum)

    old = signal.signal(signal.SIGTERM, previous)
    try:
        got: list[PreemptionNotice] = []
        watcher = PreemptionWatcher(["signal"], on_preempt=got.append, signal_grace=25)
        with watcher:
            assert signal.getsignal(signal.SIGTERM) == watcher._trap.handle
            os.kill(os.getpid(), signal.SIGTERM)
            assert watcher.wait(5)
            assert watcher.preempted and watcher.reason == "received SIGTERM"
            assert watcher.notice.seconds_left() == pytest.approx(25, abs=2)
            assert calls == [signal.SIGTERM]  # the earlier Python handler still heard it
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [n.source for n in got] == ["signal"]
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, old)


_CHILD = """
import signal, sys, time
from cloudckpt.preemption import PreemptionWatcher
watcher = PreemptionWatcher(["signal"], signals=[signal.SIGTERM, signal.SIGUSR1]).start()
print("ready", flush=True)
assert watcher.wait(20)
print("preempted", watcher.reason, flush=True)
time.sleep(20)
print("still alive", flush=True)
"""


def test_a_second_signal_restores_the_default_action():
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        assert proc.stdout.readline().strip() == "preempted received SIGUSR1"
        proc.send_signal(signal.SIGTERM)  # first SIGTERM: only recorded (already preempted)
        time.sleep(0.3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # second: the default action, the process ends
        assert proc.wait(10) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_signals_are_not_touched_outside_the_main_thread(caplog):
    before = signal.getsignal(signal.SIGTERM)
    box: list[PreemptionWatcher] = []

    def run():
        box.append(PreemptionWatcher(["signal"]).start())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    try:
        assert signal.getsignal(signal.SIGTERM) is before
        assert any("main thread" in r.getMessage() for r in caplog.records)
        box[0].trigger("scheduler said so")
        assert box[0].preempted and box[0].notice.source == "manual"
    finally:
        box[0].stop()


def test_endpoints_and_sources_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CLOUDCKPT_AWS_METADATA_URL", "http://127.0.0.1:1/")
    monkeypatch.setenv("CLOUDCKPT_GCE_METADATA_URL", "127.0.0.1:2")
    monkeypatch.setenv("CLOUDCKPT_AZURE_METADATA_URL", "http://127.0.0.1:3")
    assert AWSSpotSource().url == "http://127.0.0.1:1"
    assert GCEPreemptedSource().url == "http://127.0.0.1:2"
    assert AzureScheduledEventsSource().url == "http://127.0.0.1:3"

    # "auto" adds every source whose endpoint is configured, beside signals.
    watcher = PreemptionWatcher(_dmi_dir=tmp_path)
    assert watcher.watch_signals and watcher.signals == (signal.SIGTERM,)
    assert sorted(s.name for s in watcher.sources) == ["aws", "azure", "gce"]

    monkeypatch.setenv("CLOUDCKPT_PREEMPTION_SOURCES", "gce")
    watcher = PreemptionWatcher(_dmi_dir=tmp_path)
    assert not watcher.watch_signals and [s.name for s in watcher.sources] == ["gce"]

    with pytest.raises(ConfigurationError, match="unknown preemption source"):
        PreemptionWatcher(["ibm"])
    with pytest.raises(ConfigurationError, match="not an http"):
        AWSSpotSource("ftp://169.254.169.254")


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, []),
        ({"sys_vendor": "Amazon EC2", "product_name": "m5.large"}, ["aws"]),
        ({"product_uuid": "EC2E1916-9099-7CAF-FD21-012345678901"}, ["aws"]),
        ({"sys_vendor": "Google", "product_name": "Google Compute Engine"}, ["gce"]),
        (
            {
                "sys_vendor": "Microsoft Corporation",
                "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77",
            },
            ["azure"],
        ),
        ({"sys_vendor": "QEMU", "product_name": "Standard PC"}, []),
    ],
)
def test_cloud_detection_reads_dmi_only(tmp_path, files, expected):
    for name, value in files.items():
        (tmp_path / name).write_text(value + "\n")
    assert detect_clouds(tmp_path) == expected


def test_auto_on_a_plain_host_watches_signals_only(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    (tmp_path / "sys_vendor").write_text("Amazon EC2\n")
    watcher = PreemptionWatcher(_dmi_dir=tmp_path)  # AWS detected, but IMDS disabled
    assert watcher.sources == [] and watcher.watch_signals
