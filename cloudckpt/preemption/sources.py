"""The cloud sources of preemption notices, polled over HTTP: AWS spot ``instance-action``
(IMDSv2), the GCE ``preempted`` flag and Azure Scheduled Events; which of them ``"auto"``
picks (``detect_clouds``, from DMI data); and how a list of names becomes sources.

Every endpoint is configurable (an argument, else an environment variable, else the real
metadata service), so tests and rehearsals point them at a local fake. Requests go
straight to the endpoint with ``http.client``, never through an HTTP proxy.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import http.client
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cloudckpt.errors import ConfigurationError
from cloudckpt.preemption.notice import PreemptionNotice, PreemptionSource

log = logging.getLogger("cloudckpt.preemption")

DEFAULT_TIMEOUT = 1.0
GCE_NOTICE_SECONDS = 30.0  # GCE's documented preemption notice
_MAX_BODY = 64 * 1024

AWS_DEFAULT_URL = "http://169.254.169.254"
GCE_DEFAULT_URL = "http://metadata.google.internal"
AZURE_DEFAULT_URL = "http://169.254.169.254"
AZURE_API_VERSION = "2020-07-01"
AZURE_COMPUTE_API_VERSION = "2021-02-01"
_AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"


# ------------------------------------------------------------------------------ HTTP


def _base_url(url: str, what: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(
            f"{what} endpoint {url!r} is not an http(s)://host[:port] URL",
            hint="Pass e.g. http://169.254.169.254 or http://127.0.0.1:8080",
        )
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def _request(
    method: str, url: str, headers: Mapping[str, str], timeout: float
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request with ``http.client`` (never through an HTTP proxy: metadata
    services are link-local). Returns (status, lower-cased headers, body)."""
    parts = urlsplit(url)
    if not parts.hostname:  # every configured URL went through _base_url
        raise ConfigurationError(
            f"metadata URL {url!r} has no host", hint="Pass e.g. http://169.254.169.254"
        )
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=timeout)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(method, target, headers=dict(headers))
        resp = conn.getresponse()
        body = resp.read(_MAX_BODY)
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


# ------------------------------------------------------------------------------ sources


class AWSSpotSource(PreemptionSource):
    """EC2 spot interruption notices through IMDSv2.

    A session token (``PUT /latest/api/token``) is fetched once and reused until shortly
    before it expires, or sooner if the service answers 401. If no token can be had (IMDS
    hop limit in a container, a service that only speaks IMDSv1), the GET is sent without
    one; IMDSv1-only hosts then still work.
    """

    name = "aws"
    TOKEN_PATH = "/latest/api/token"
    NOTICE_PATH = "/latest/meta-data/spot/instance-action"

    def __init__(
        self, url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT, token_ttl: int = 21600
    ) -> None:
        raw = (
            url
            or _env("CLOUDCKPT_AWS_METADATA_URL", "AWS_EC2_METADATA_SERVICE_ENDPOINT")
            or AWS_DEFAULT_URL
        )
        self.url = _base_url(raw, "AWS metadata")
        self.timeout = timeout
        self.token_ttl = int(token_ttl)
        self._token: str | None = None
        self._token_expires = 0.0

    def _get_token(self) -> str | None:
        if self._token and time.monotonic() < self._token_expires:
            return self._token
        self._token = None
        try:
            status, _, body = _request(
                "PUT",
                self.url + self.TOKEN_PATH,
                {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)},
                self.timeout,
            )
        except OSError as exc:
            log.debug("aws: no IMDSv2 token from %s: %s", self.url, exc)
            return None
        if status != 200 or not body:
            log.debug("aws: IMDSv2 token request answered %d", status)
            return None
        self._token = body.decode("ascii", "replace").strip()
        # Refresh a minute early (or halfway, for very short TTLs).
        self._token_expires = time.monotonic() + max(
            1.0, min(self.token_ttl - 60, self.token_ttl / 2)
        )
        return self._token

    def poll(self) -> PreemptionNotice | None:
        for _ in range(2):  # a second round after a 401 (expired or revoked token)
            token = self._get_token()
            headers = {"X-aws-ec2-metadata-token": token} if token else {}
            status, _, body = _request("GET", self.url + self.NOTICE_PATH, headers, self.timeout)
            if status == 401 and token:
                self._token = None
                continue
            break
        if status == 404:
            return None
        if status != 200:
            log.debug("aws: instance-action answered %d", status)
            return None
        doc = json.loads(body)
        action = str(doc.get("action", "terminate"))
        deadline = _parse_iso(doc.get("time"))
        when = f" at {doc['time']}" if doc.get("time") else ""
        return PreemptionNotice(
            source=self.name,
            reason=f"AWS spot interruption: {action}{when}",
            received_at=time.time(),
            deadline=deadline,
            detail=doc,
        )

    def __repr__(self) -> str:
        return f"<AWSSpotSource {self.url}>"


class GCEPreemptedSource(PreemptionSource):
    """GCE preemptible/spot VMs: ``instance/preempted`` turns ``TRUE``.

    The answer must carry ``Metadata-Flavor: Google`` (as the real service's does), so a
    captive portal or another service answering on that address is never mistaken for it.
    """

    name = "gce"
    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        notice_seconds: float = GCE_NOTICE_SECONDS,
    ) -> None:
        raw = url or _env("CLOUDCKPT_GCE_METADATA_URL")
        if raw is None and _env("GCE_METADATA_HOST"):
            raw = "http://" + os.environ["GCE_METADATA_HOST"].strip()
        self.url = _base_url(raw or GCE_DEFAULT_URL, "GCE metadata")
        self.timeout = timeout
        self.notice_seconds = notice_seconds

    def poll(self) -> PreemptionNotice | None:
        status, headers, body = _request(
            "GET", self.url + self.PATH, {"Metadata-Flavor": "Google"}, self.timeout
        )
        if status != 200:
            log.debug("gce: preempted answered %d", status)
            return None
        if headers.get("metadata-flavor", "").lower() != "google":
            log.debug("gce: answer without Metadata-Flavor: Google; not a GCE metadata server")
            return None
        if body.strip().upper() != b"TRUE":
            return None
        now = time.time()
        return PreemptionNotice(
            source=self.name,
            reason="GCE preemption (instance/preempted is TRUE)",
            received_at=now,
            deadline=now + self.notice_seconds,
            detail={"preempted": True},
        )

    def __repr__(self) -> str:
        return f"<GCEPreemptedSource {self.url}>"


class AzureScheduledEventsSource(PreemptionSource):
    """Azure Scheduled Events: an event of type ``Preempt`` (spot eviction) for this VM.

    Events are delivered to every VM of an availability set or scale-set placement group,
    so an event counts only if its ``Resources`` name this VM (its compute name, read once
    from ``/metadata/instance/compute/name``). If the name cannot be read, every matching
    event counts (logged once). Add ``"Terminate"`` to ``event_types`` to treat scale-in
    terminate notifications as preemption too.
    """

    name = "azure"
    EVENTS_PATH = "/metadata/scheduledevents"
    NAME_PATH = "/metadata/instance/compute/name"

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout: float = 3.0,
        event_types: Iterable[str] = ("Preempt",),
        api_version: str = AZURE_API_VERSION,
        vm_name: str | None = None,
    ) -> None:
        raw = url or _env("CLOUDCKPT_AZURE_METADATA_URL") or AZURE_DEFAULT_URL
        self.url = _base_url(raw, "Azure metadata")
        self.timeout = timeout
        self.event_types = frozenset(event_types)
        self.api_version = api_version
        self._vm_name = vm_name
        self._name_tried = vm_name is not None
        self._warned_no_name = False

    def _name(self) -> str | None:
        if self._name_tried:
            return self._vm_name
        status, _, body = _request(
            "GET",
            f"{self.url}{self.NAME_PATH}?api-version={AZURE_COMPUTE_API_VERSION}&format=text",
            {"Metadata": "true"},
            self.timeout,
        )
        if status == 200 and body.strip():
            self._vm_name = body.decode("utf-8", "replace").strip()
        self._name_tried = True
        return self._vm_name

    def poll(self) -> PreemptionNotice | None:
        status, _, body = _request(
            "GET",
            f"{self.url}{self.EVENTS_PATH}?api-version={self.api_version}",
            {"Metadata": "true"},
            self.timeout,
        )
        if status != 200:
            log.debug("azure: scheduledevents answered %d", status)
            return None
        doc = json.loads(body)
        events = [e for e in doc.get("Events") or [] if e.get("EventType") in self.event_types]
        if not events:
            return None
        try:
            name = self._name()
        except OSError as exc:
            log.debug("azure: cannot read the VM name: %s", exc)
            self._name_tried = True
            name = None
        for event in events:
            resources = [str(r).lower() for r in event.get("Resources") or []]
            if name is not None and resources and name.lower() not in resources:
                continue
            if name is None and not self._warned_no_name:
                log.warning(
                    "azure: VM name unknown; acting on %s events for any VM", event["EventType"]
                )
                self._warned_no_name = True
            now = time.time()
            deadline = _parse_http_date(event.get("NotBefore")) or now
            return PreemptionNotice(
                source=self.name,
                reason=(
                    f"Azure scheduled event {event.get('EventType')} "
                    f"(not before {event.get('NotBefore') or 'now'})"
                ),
                received_at=now,
                deadline=deadline,
                detail=event,
            )
        return None

    def __repr__(self) -> str:
        return f"<AzureScheduledEventsSource {self.url}>"


def _parse_iso(value: Any) -> float | None:
    if not value or not isinstance(value, str):
        return None
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def _parse_http_date(value: Any) -> float | None:
    if not value or not isinstance(value, str):
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------ detection


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def detect_clouds(dmi_dir: str | os.PathLike[str] = "/sys/class/dmi/id") -> list[str]:
    """The clouds this host appears to run on (``"aws"``, ``"gce"``, ``"azure"``), from
    DMI data only: no network request is made."""
    root = Path(dmi_dir)
    vendor = _read(root / "sys_vendor")
    board = _read(root / "board_vendor")
    product = _read(root / "product_name")
    bios = _read(root / "bios_vendor")
    uuid = _read(root / "product_uuid").lower()
    asset = _read(root / "chassis_asset_tag")
    found = []
    if "Amazon EC2" in (vendor, board) or bios.startswith("Amazon") or uuid.startswith("ec2"):
        found.append("aws")
    if product.startswith("Google Compute Engine") or vendor == "Google":
        found.append("gce")
    if asset == _AZURE_ASSET_TAG:
        found.append("azure")
    return found


_SOURCE_CLASSES: dict[str, Callable[..., PreemptionSource]] = {
    "aws": AWSSpotSource,
    "gce": GCEPreemptedSource,
    "azure": AzureScheduledEventsSource,
}
_ENDPOINT_ENV = {
    "aws": "CLOUDCKPT_AWS_METADATA_URL",
    "gce": "CLOUDCKPT_GCE_METADATA_URL",
    "azure": "CLOUDCKPT_AZURE_METADATA_URL",
}


def _auto_sources(dmi_dir: str | os.PathLike[str]) -> list[str]:
    override = os.environ.get("CLOUDCKPT_PREEMPTION_SOURCES", "").strip()
    if override:
        return [s.strip() for s in override.split(",") if s.strip()]
    names = ["signal"]
    clouds = detect_clouds(dmi_dir)
    for cloud, var in _ENDPOINT_ENV.items():
        if os.environ.get(var) and cloud not in clouds:
            clouds.append(cloud)
    aws_off = os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() in ("1", "true", "yes")
    if aws_off and "aws" in clouds and not os.environ.get(_ENDPOINT_ENV["aws"]):
        log.info("AWS_EC2_METADATA_DISABLED is set: not polling AWS spot notices")
        clouds.remove("aws")
    return names + clouds


def resolve(
    sources: str | Sequence[str | PreemptionSource],
    *,
    urls: Mapping[str, str | None],
    timeout: float | None,
    dmi_dir: str | os.PathLike[str],
) -> tuple[bool, list[PreemptionSource]]:
    """What a watcher's ``sources=`` asks for: whether to watch signals, and the polled
    sources (built with ``urls[name]`` and ``timeout``, each source's own when None).

    Raises:
        ConfigurationError: a name that is not ``signal``, ``aws``, ``gce`` or ``azure``,
            or an endpoint that is not an http(s) URL.
    """
    if isinstance(sources, str):
        if sources != "auto":
            sources = [s.strip() for s in sources.split(",") if s.strip()]
        else:
            sources = _auto_sources(dmi_dir)
    watch_signals = False
    polled: list[PreemptionSource] = []
    for src in sources:
        if isinstance(src, PreemptionSource):
            polled.append(src)
        elif src == "signal":
            watch_signals = True
        elif src in _SOURCE_CLASSES:
            kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
            polled.append(_SOURCE_CLASSES[src](urls[src], **kwargs))
        else:
            raise ConfigurationError(
                f"unknown preemption source {src!r}",
                hint="Use 'signal', 'aws', 'gce', 'azure' or a PreemptionSource object",
            )
    return watch_signals, polled
