"""Measure what an Azure Blob endpoint honours: conditional writes, checksums, ETags, races.

The Azure counterpart of ``cloudckpt.testing.s3_probe``. It asks the service directly,
through plain ``azure-storage-blob`` clients (not cloudckpt's adapter; SDK retries off),
and prints what it saw next to what Azure Blob Storage documents::

    python -m cloudckpt.testing.azure_probe                      # starts its own Azurite
    python -m cloudckpt.testing.azure_probe --container my-container   # the environment's
                                                                       # credentials

Without ``--container`` it starts Azurite (``cloudckpt.testing.azurite_server``). With
``--container`` the connection comes from ``--connection-string`` or
``AZURE_STORAGE_CONNECTION_STRING``; the probe writes only under
``cloudckpt-probe/<random>/`` and deletes what it wrote. ``--json`` prints JSON.

The races: ``--creators`` threads (16) race a create-only Put Blob (``If-None-Match: *``) of
one new blob, ``--rounds`` times (20): exactly one may win each round. ``--cas-writers``
threads (8) each make ``--increments`` (25) compare-and-swap increments of one counter (GET,
then Put Blob with ``If-Match``, retried on 412/409). Each thread has its own client.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from cloudckpt.stores._azure_errors import error_code
from cloudckpt.testing import races
from cloudckpt.testing.s3_probe import Finding, ProbeReport, RaceFigures

__all__ = ["probe_container", "service_factory"]

MiB = 1024 * 1024


def _md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode("ascii")


def _answer(fn: Callable[[], Any]) -> tuple[str, Any]:
    """Run one request; return ("ok", result) or ("<status> <ErrorCode>", None)."""
    from azure.core.exceptions import HttpResponseError

    try:
        return "ok", fn()
    except HttpResponseError as exc:
        return f"{exc.status_code} {error_code(exc)}".strip(), None


def _block(n: int) -> str:
    return base64.b64encode(f"probe-block-{n:06d}".encode()).decode("ascii")


class _Probe:
    def __init__(self, make_service: Callable[[], Any], container: str, prefix: str) -> None:
        self.service = make_service()
        self.container = self.service.get_container_client(container)
        self.prefix = prefix
        self.findings: list[Finding] = []

    def blob(self, name: str) -> Any:
        return self.container.get_blob_client(f"{self.prefix}{name}-{uuid.uuid4().hex[:8]}")

    def note(self, name: str, azure: str, observed: str, honoured: bool | None = None) -> None:
        if honoured is None:
            honoured = observed.split()[0] == azure.split()[0]
        self.findings.append(Finding(name, azure, observed, honoured))

    def body(self, blob: Any) -> bytes | None:
        _, data = _answer(lambda: blob.download_blob().readall())
        return data

    def kept(self, blob: Any, expected: bytes | None) -> str:
        return "" if self.body(blob) == expected else ", OVERWRITTEN"

    def created(self, blob: Any) -> str:
        return ", blob CREATED" if self.body(blob) is not None else ""

    def put(self, blob: Any, data: bytes, **conditions: str) -> str:
        answer, _ = _answer(
            lambda: blob.upload_blob(
                data, overwrite=True, headers={"Content-MD5": _md5(data)}, **conditions
            )
        )
        return answer

    def commit(self, blob: Any, data: bytes, n: int, **conditions: str) -> str:
        blob.stage_block(_block(n), data, headers={"Content-MD5": _md5(data)})
        answer, _ = _answer(lambda: blob.commit_block_list([_block(n)], **conditions))
        return answer

    # --- the probes -----------------------------------------------------------------

    def put_blob_conditions(self) -> None:
        b = self.blob("put")
        self.note(
            "Put Blob If-None-Match: * (absent)",
            "ok (201)",
            self.put(b, b"first", if_none_match="*"),
        )
        self.note(
            "Put Blob If-None-Match: * (exists)",
            "409 BlobAlreadyExists",
            self.put(b, b"second", if_none_match="*") + self.kept(b, b"first"),
        )
        old = b.get_blob_properties().etag
        self.note(
            "Put Blob If-Match: current ETag", "ok (201)", self.put(b, b"third", if_match=old)
        )
        self.note(
            "Put Blob If-Match: stale ETag",
            "412 ConditionNotMet",
            self.put(b, b"fourth", if_match=old) + self.kept(b, b"third"),
        )
        missing = self.blob("put-missing")
        answer = self.put(missing, b"x", if_match=old)
        self.note(
            "Put Blob If-Match: blob absent",
            "412 ConditionNotMet (or 404)",
            answer + self.created(missing),
            honoured=answer.startswith(("404", "412")) and self.body(missing) is None,
        )

    def block_list_conditions(self) -> None:
        b = self.blob("blocks")
        answer = self.commit(b, b"a" * MiB, 1, if_none_match="*")
        self.note("Put Block List If-None-Match: * (absent)", "ok (201)", answer)
        original = self.body(b)
        self.note(
            "Put Block List If-None-Match: * (exists)",
            "409 BlobAlreadyExists",
            self.commit(b, b"b" * MiB, 2, if_none_match="*") + self.kept(b, original),
        )
        old = b.get_blob_properties().etag
        answer = self.commit(b, b"c" * MiB, 3, if_match=old)
        self.note("Put Block List If-Match: current ETag", "ok (201)", answer)
        current = self.body(b)
        self.note(
            "Put Block List If-Match: stale ETag",
            "412 ConditionNotMet",
            self.commit(b, b"d" * MiB, 4, if_match=old) + self.kept(b, current),
        )
        missing = self.blob("blocks-missing")
        answer = self.commit(missing, b"e", 5, if_match=old)
        self.note(
            "Put Block List If-Match: blob absent",
            "412 ConditionNotMet (or 404)",
            answer + self.created(missing),
            honoured=answer.startswith(("404", "412")) and self.body(missing) is None,
        )

    def checksums(self) -> None:
        wrong = _md5(b"other bytes")
        b = self.blob("md5")
        answer, _ = _answer(
            lambda: b.stage_block(_block(1), b"x" * MiB, headers={"Content-MD5": wrong})
        )
        self.note("Put Block with a wrong Content-MD5", "400 Md5Mismatch", answer)
        answer, _ = _answer(
            lambda: b.upload_blob(b"payload", overwrite=True, headers={"Content-MD5": wrong})
        )
        self.note("Put Blob with a wrong Content-MD5", "400 Md5Mismatch", answer + self.created(b))
        good = self.blob("md5-good")
        self.put(good, b"payload")
        stored = good.get_blob_properties().content_settings.content_md5
        got = base64.b64encode(bytes(stored)).decode() if stored else None
        self.note(
            "Put Blob stores the blob's Content-MD5",
            "yes",
            "yes" if got == _md5(b"payload") else f"no ({got!r})",
        )

    def etags(self) -> None:
        b = self.blob("etag")
        self.put(b, b"same bytes")
        first = b.get_blob_properties().etag
        self.put(b, b"same bytes")
        second = b.get_blob_properties().etag
        self.note(
            "ETag after an identical rewrite",
            "changed",
            "changed" if first != second else "unchanged",
        )

    def uncommitted(self) -> None:
        b = self.blob("uncommitted")
        b.stage_block(_block(1), b"u" * 100)
        _, (_, pending) = _answer(lambda: b.get_block_list("uncommitted"))
        self.note(
            "Get Block List shows uncommitted blocks",
            "yes",
            "yes" if [x.id for x in pending] == [_block(1)] else f"no ({pending})",
        )
        listed = [
            x.name
            for x in self.container.list_blobs(
                name_starts_with=b.blob_name, include=["uncommittedblobs"]
            )
        ]
        self.note(
            "List Blobs include=uncommittedblobs lists a blob with only uncommitted blocks",
            "yes",
            "yes" if listed == [b.blob_name] else f"no ({listed})",
        )
        answer, _ = _answer(b.get_blob_properties)
        self.note(
            "Get Blob Properties of a blob with only uncommitted blocks", "404 BlobNotFound", answer
        )

    def missing_container(self) -> None:
        name = f"absent-{uuid.uuid4().hex[:12]}"
        blob = self.service.get_blob_client(name, "x")
        answer, _ = _answer(lambda: blob.upload_blob(b"x"))
        self.note("Put Blob into a missing container", "404 ContainerNotFound", answer)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            for b in self.container.list_blobs(name_starts_with=self.prefix):
                with contextlib.suppress(Exception):
                    self.container.delete_blob(b.name)
        self.service.close()


def _put(service: Any, container: str, name: str, body: bytes, **condition: str) -> str:
    blob = service.get_blob_client(container, name)
    answer, _ = _answer(
        lambda: blob.upload_blob(
            body, overwrite=True, headers={"Content-MD5": _md5(body)}, **condition
        )
    )
    return answer


def race_creates(
    make_service: Callable[[], Any], container: str, prefix: str, creators: int, rounds: int
) -> tuple[list[int], dict[str, int], float, int]:
    """``rounds`` times, ``creators`` threads race a create-only Put Blob of one new blob
    (see ``races.race_creates`` for what it returns)."""
    names = (f"{prefix}race-create-{r}-{uuid.uuid4().hex[:8]}" for r in range(rounds))
    with races.clients_of(make_service, creators) as services:
        return races.race_creates(
            services,
            names,
            lambda s, name, body: _put(s, container, name, body, if_none_match="*"),
            lambda s, name: s.get_blob_client(container, name).download_blob().readall(),
            ok="ok",
        )


def race_cas(
    make_service: Callable[[], Any], container: str, prefix: str, writers: int, increments: int
) -> tuple[int, int, int]:
    """``writers`` threads each make ``increments`` If-Match increments of one counter;
    return (final count, acknowledged increments, retries)."""
    name = f"{prefix}race-cas-{uuid.uuid4().hex[:8]}"
    setup = make_service()
    setup.get_blob_client(container, name).upload_blob(b"0")

    def read(service: Any) -> tuple[bytes, str]:
        downloader = service.get_blob_client(container, name).download_blob()
        return downloader.readall(), downloader.properties.etag

    with races.clients_of(make_service, writers) as services:
        acknowledged, retries = races.race_cas(
            services,
            read,
            lambda s, body, etag: _put(s, container, name, body, if_match=etag),
            ok="ok",
            increments=increments,
        )
    final = int(setup.get_blob_client(container, name).download_blob().readall())
    setup.close()
    return final, acknowledged, retries


def probe_container(
    make_service: Callable[[], Any],
    container: str,
    *,
    creators: int = 16,
    rounds: int = 20,
    cas_writers: int = 8,
    increments: int = 25,
    races: bool = True,
) -> ProbeReport:
    """Run every probe against ``container`` through ``BlobServiceClient``s from
    ``make_service``. Findings compare with Azure Blob Storage's documented answers."""
    prefix = f"cloudckpt-probe/{uuid.uuid4().hex[:12]}/"
    probe = _Probe(make_service, container, prefix)
    server = ""
    try:
        seen: list[str] = []
        probe.container.get_container_properties(
            raw_response_hook=lambda r: seen.append(r.http_response.headers.get("Server", ""))
        )
        server = seen[-1] if seen else ""
        probe.put_blob_conditions()
        probe.block_list_conditions()
        probe.checksums()
        probe.etags()
        probe.uncommitted()
        probe.missing_container()
        figures = None
        if races:
            start = time.monotonic()
            winners, losers, slowest, wrong = race_creates(
                make_service, container, prefix, creators, rounds
            )
            middle = time.monotonic()
            final, acked, retries = race_cas(
                make_service, container, prefix, cas_writers, increments
            )
            figures = RaceFigures(
                creators,
                rounds,
                winners,
                losers,
                slowest,
                wrong,
                cas_writers,
                increments,
                final,
                acked,
                retries,
                middle - start,
                time.monotonic() - middle,
            )
        endpoint = probe.service.primary_endpoint.split("?", 1)[0]
        return ProbeReport(endpoint, server, probe.findings, figures)
    finally:
        probe.cleanup()


def service_factory(connection_string: str) -> Callable[[], Any]:
    """A callable returning a new ``BlobServiceClient`` (no SDK retries)."""
    from azure.storage.blob import BlobServiceClient

    def make() -> Any:
        return BlobServiceClient.from_connection_string(connection_string, retry_total=0)

    return make


def main(argv: list[str] | None = None) -> int:
    import os

    parser = argparse.ArgumentParser(
        prog="python -m cloudckpt.testing.azure_probe",
        description="Measure which Azure Blob conditional writes, checksums and races an "
        "endpoint honours (default: a fresh Azurite).",
    )
    parser.add_argument("--container", help="probe this existing container instead of Azurite")
    parser.add_argument(
        "--connection-string", help="with --container (default: AZURE_STORAGE_CONNECTION_STRING)"
    )
    parser.add_argument("--creators", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cas-writers", type=int, default=8)
    parser.add_argument("--increments", type=int, default=25)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    def run(make: Callable[[], Any], container: str) -> ProbeReport:
        return probe_container(
            make,
            container,
            creators=args.creators,
            rounds=args.rounds,
            cas_writers=args.cas_writers,
            increments=args.increments,
        )

    if args.container:
        conn = args.connection_string or os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        if not conn:
            parser.error("--container needs --connection-string or AZURE_STORAGE_CONNECTION_STRING")
        report = run(service_factory(conn), args.container)
        label = "endpoint"
    else:
        from cloudckpt.testing.azurite_server import AzuriteServer

        with AzuriteServer() as server:
            container = f"probe-{uuid.uuid4().hex[:12]}"
            server.create_container(container)
            report = run(service_factory(server.connection_string), container)
        label = "azurite"
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(f"({label})")
        print(report.table().replace("| AWS S3 |", "| Azure |"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
