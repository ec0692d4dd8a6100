"""Measure what an S3 endpoint honours: conditional writes, checksums, ETags, races.

cloudckpt's safety rests on two S3 primitives being real: create-only
(``If-None-Match: *``) and compare-and-swap (``If-Match: <etag>``). S3-compatible servers
(moto, SeaweedFS, MinIO, Ceph, R2, ...) differ in which of them they check, whether the
check and the write are atomic, and whether they verify checksums. This probe asks the
server directly, through a plain botocore client (not through cloudckpt's adapter), and
prints what it saw next to what AWS S3 answers::

    python -m cloudckpt.testing.s3_probe --server seaweedfs     # starts its own server
    python -m cloudckpt.testing.s3_probe --server moto
    python -m cloudckpt.testing.s3_probe --server moto-unserialized
    python -m cloudckpt.testing.s3_probe --endpoint-url https://... --bucket my-bucket

With ``--endpoint-url`` the credentials come from the usual AWS environment (or ``--key``
and ``--secret``); the probe writes only under ``cloudckpt-probe/<random>/`` in the bucket
and deletes what it wrote. ``--json`` prints the results as JSON.

The races: ``--creators`` threads (16) race a create-only PutObject of one new key,
``--rounds`` times (20): exactly one may win each round. ``--cas-writers`` threads (8) each
make ``--increments`` (25) compare-and-swap increments of one counter (GET, then PutObject
with ``If-Match``, retried on 412/409): the final count must be writers x increments.
Each thread has its own client (its own connection pool).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import google_crc32c

from cloudckpt.testing import races

__all__ = [
    "Finding",
    "ProbeReport",
    "RaceFigures",
    "client_factory",
    "probe_endpoint",
    "race_cas",
    "race_creates",
]

MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Finding:
    """One probed behaviour: what AWS S3 answers, what this server answered, and whether
    they agree (``honoured``)."""

    name: str
    aws: str
    observed: str
    honoured: bool


@dataclasses.dataclass(frozen=True)
class RaceFigures:
    """The outcome of the two races."""

    creators: int
    rounds: int
    winners_per_round: list[int]  # exactly one each round on a correct server
    loser_answers: dict[str, int]  # e.g. {"412 PreconditionFailed": 300}
    slowest_create: float  # seconds, the slowest single answer to a racing create
    rounds_with_wrong_bytes: int  # stored bytes not the single winner's (0 on a correct server)
    cas_writers: int
    increments: int
    final_count: int  # cas_writers * increments on a correct server
    acknowledged_increments: int  # PutObjects that answered 200
    cas_retries: int
    create_seconds: float
    cas_seconds: float

    @property
    def creates_ok(self) -> bool:
        return all(w == 1 for w in self.winners_per_round) and not self.rounds_with_wrong_bytes

    @property
    def cas_ok(self) -> bool:
        return self.final_count == self.cas_writers * self.increments

    @property
    def lost_updates(self) -> int:
        return self.acknowledged_increments - self.final_count


@dataclasses.dataclass(frozen=True)
class ProbeReport:
    """Everything one run of the probe measured."""

    endpoint: str
    server: str  # the Server header, when the endpoint sends one
    findings: list[Finding]
    races: RaceFigures | None

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.races is not None:
            out["races"].update(
                creates_ok=self.races.creates_ok,
                cas_ok=self.races.cas_ok,
                lost_updates=self.races.lost_updates,
            )
        return out

    def table(self) -> str:
        """A Markdown table of the findings and the race figures."""
        lines = [
            f"Endpoint: {self.endpoint} (Server: {self.server or 'not sent'})",
            "",
            "| probe | AWS S3 | observed | |",
            "|---|---|---|---|",
        ]
        for f in self.findings:
            lines.append(
                f"| {f.name} | {f.aws} | {f.observed} | {'ok' if f.honoured else 'DIFFERS'} |"
            )
        r = self.races
        if r is not None:
            rounds = ", ".join(str(w) for w in r.winners_per_round)
            losers = ", ".join(f"{k} x{v}" for k, v in sorted(r.loser_answers.items()))
            lines += [
                "",
                f"- racing creates: {r.creators} threads x {r.rounds} rounds; winners per "
                f"round: {rounds} -> {'exactly one each time' if r.creates_ok else 'NOT ATOMIC'}"
                f"; losers got: {losers or 'nothing'}; rounds whose stored bytes are not the "
                f"winner's: {r.rounds_with_wrong_bytes}; slowest answer {r.slowest_create:.2f} s",
                f"- compare-and-swap: {r.cas_writers} writers x {r.increments} increments: "
                f"final count {r.final_count} (expected {r.cas_writers * r.increments}), "
                f"{r.acknowledged_increments} acknowledged, {r.lost_updates} lost, "
                f"{r.cas_retries} retries -> {'no lost update' if r.cas_ok else 'LOST UPDATES'}",
                f"- the creates took {r.create_seconds:.1f} s, the increments "
                f"{r.cas_seconds:.1f} s",
            ]
        return "\n".join(lines)


def _crc32c(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode("ascii")


def _answer(fn: Callable[[], Any]) -> tuple[str, Any]:
    """Run one request; return ("200", response) or ("<status> <code>", None)."""
    import botocore.exceptions as bce

    try:
        return "200", fn()
    except bce.ClientError as exc:
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        return f"{status} {err.get('Code') or ''}".strip(), None


class _Probe:
    def __init__(self, make_client: Callable[[], Any], bucket: str, prefix: str) -> None:
        self.make_client = make_client
        self.client = make_client()
        self.bucket = bucket
        self.prefix = prefix
        self.findings: list[Finding] = []

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}-{uuid.uuid4().hex[:8]}"

    def note(self, name: str, aws: str, observed: str, honoured: bool | None = None) -> None:
        if honoured is None:
            honoured = observed.split()[0] == aws.split()[0]
        self.findings.append(Finding(name, aws, observed, honoured))

    def put(self, key: str, body: bytes, **extra: Any) -> tuple[str, Any]:
        return _answer(
            lambda: self.client.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=body,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=extra.pop("crc", None) or _crc32c(body),
                **extra,
            )
        )

    def etag(self, key: str) -> str:
        return self.client.head_object(Bucket=self.bucket, Key=key)["ETag"]

    def body(self, key: str) -> bytes | None:
        _, resp = _answer(lambda: self.client.get_object(Bucket=self.bucket, Key=key))
        return resp["Body"].read() if resp else None

    def multipart(self, key: str, parts: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
        upload = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32C"
        )["UploadId"]
        done = []
        for n, data in enumerate(parts, start=1):
            resp = self.client.upload_part(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload,
                PartNumber=n,
                Body=data,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=_crc32c(data),
            )
            done.append({"PartNumber": n, "ETag": resp["ETag"], "ChecksumCRC32C": _crc32c(data)})
        return upload, done

    def complete(self, key: str, body_parts: list[bytes], **extra: Any) -> str:
        upload, parts = self.multipart(key, body_parts)
        answer, _ = _answer(
            lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
                **extra,
            )
        )
        if answer != "200":
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        return answer

    # --- the probes -----------------------------------------------------------------

    def put_object_conditions(self) -> None:
        key = self.key("put")
        answer, _ = self.put(key, b"first", IfNoneMatch="*")
        self.note("PutObject If-None-Match: * (key absent)", "200", answer)
        answer, _ = self.put(key, b"second", IfNoneMatch="*")
        self.note(
            "PutObject If-None-Match: * (key exists)",
            "412 PreconditionFailed",
            f"{answer}{self._kept(key, b'first')}",
        )
        old = self.etag(key)
        answer, _ = self.put(key, b"third", IfMatch=old)
        self.note("PutObject If-Match: current ETag", "200", answer)
        answer, _ = self.put(key, b"fourth", IfMatch=old)
        self.note(
            "PutObject If-Match: stale ETag",
            "412 PreconditionFailed",
            f"{answer}{self._kept(key, b'third')}",
        )
        missing = self.key("put-missing")
        answer, _ = self.put(missing, b"x", IfMatch=old)
        self.note(
            "PutObject If-Match: key absent",
            "404 NoSuchKey",
            f"{answer}{self._created(missing)}",
            honoured=answer.startswith(("404", "412")) and self.body(missing) is None,
        )

    def complete_conditions(self) -> None:
        parts = [b"a" * (5 * MiB), b"tail"]
        key = self.key("mpu")
        answer = self.complete(key, parts, IfNoneMatch="*")
        self.note("CompleteMultipartUpload If-None-Match: * (key absent)", "200", answer)
        original = self.body(key)
        answer = self.complete(key, [b"b" * (5 * MiB), b"tail"], IfNoneMatch="*")
        self.note(
            "CompleteMultipartUpload If-None-Match: * (key exists)",
            "412 PreconditionFailed",
            f"{answer}{self._kept(key, original)}",
        )
        old = self.etag(key)
        answer = self.complete(key, [b"c" * (5 * MiB), b"tail"], IfMatch=old)
        self.note("CompleteMultipartUpload If-Match: current ETag", "200", answer)
        current = self.body(key)
        answer = self.complete(key, [b"d" * (5 * MiB), b"tail"], IfMatch=old)
        self.note(
            "CompleteMultipartUpload If-Match: stale ETag",
            "412 PreconditionFailed",
            f"{answer}{self._kept(key, current)}",
        )
        missing = self.key("mpu-missing")
        answer = self.complete(missing, [b"e" * (5 * MiB), b"tail"], IfMatch=old)
        self.note(
            "CompleteMultipartUpload If-Match: key absent",
            "404 NoSuchKey",
            f"{answer}{self._created(missing)}",
            honoured=answer.startswith(("404", "412")) and self.body(missing) is None,
        )

    def checksums(self) -> None:
        key = self.key("crc")
        upload = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32C"
        )["UploadId"]
        try:
            answer, _ = _answer(
                lambda: self.client.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload,
                    PartNumber=1,
                    Body=b"x" * MiB,
                    ChecksumAlgorithm="CRC32C",
                    ChecksumCRC32C=_crc32c(b"other bytes"),
                )
            )
        finally:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        self.note("UploadPart with a wrong CRC32C", "400 BadDigest", answer, answer != "200")
        answer, _ = self.put(key, b"payload", crc=_crc32c(b"other bytes"))
        self.note(
            "PutObject with a wrong CRC32C",
            "400 BadDigest",
            f"{answer}{self._created(key)}",
            answer != "200",
        )
        good = self.key("crc-good")
        self.put(good, b"payload")
        resp = self.client.get_object(Bucket=self.bucket, Key=good, ChecksumMode="ENABLED")
        resp["Body"].read()
        got = resp.get("ChecksumCRC32C")
        self.note(
            "GetObject returns the stored CRC32C",
            "yes",
            "yes" if got == _crc32c(b"payload") else f"no ({got!r})",
        )

    def etags(self) -> None:
        key = self.key("etag")
        self.put(key, b"same bytes")
        first = self.etag(key)
        self.put(key, b"same bytes")
        second = self.etag(key)
        self.note(
            "ETag after an identical rewrite",
            "unchanged (MD5 of the bytes)",
            "unchanged" if first == second else "changed",
        )
        self.put(key, b"other bytes")
        self.note(
            "ETag after a different write",
            "changed",
            "changed" if self.etag(key) != second else "unchanged",
        )

    def missing_bucket(self) -> None:
        bucket = f"{self.bucket[:40]}-absent-{uuid.uuid4().hex[:8]}"
        answer, _ = _answer(
            lambda: self.client.put_object(Bucket=bucket, Key=f"{self.prefix}x", Body=b"x")
        )
        if answer == "200":  # the server created the bucket: remove it again
            with contextlib.suppress(Exception):
                self.client.delete_object(Bucket=bucket, Key=f"{self.prefix}x")
                self.client.delete_bucket(Bucket=bucket)
        self.note(
            "PutObject into a missing bucket",
            "404 NoSuchBucket",
            answer + (", bucket CREATED" if answer == "200" else ""),
            answer != "200",
        )

    def multipart_listing(self) -> None:
        key = self.key("pending")
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            listed = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=key)
            found = [u for u in listed.get("Uploads", []) if u["UploadId"] == upload]
            if not found:
                observed = "not listed"
            else:
                skew = abs(time.time() - found[0]["Initiated"].timestamp())
                observed = "yes" if skew < 300 else f"listed, {skew / 86400:.0f} days off"
        finally:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        self.note("ListMultipartUploads: Initiated is the start time", "yes", observed)

    def _kept(self, key: str, expected: bytes | None) -> str:
        return "" if self.body(key) == expected else ", OVERWRITTEN"

    def _created(self, key: str) -> str:
        return ", object CREATED" if self.body(key) is not None else ""

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for obj in page.get("Contents", []):
                    self.client.delete_object(Bucket=self.bucket, Key=obj["Key"])
        self.client.close()


def _put(client: Any, bucket: str, key: str, body: bytes, **condition: str) -> str:
    answer, _ = _answer(
        lambda: client.put_object(
            Bucket=bucket,
            Key=key,
            Body=body,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=_crc32c(body),
            **condition,
        )
    )
    return answer


def race_creates(
    make_client: Callable[[], Any], bucket: str, prefix: str, creators: int, rounds: int
) -> tuple[list[int], dict[str, int], float, int]:
    """``rounds`` times, ``creators`` threads race a create-only PutObject of one new key
    (see ``races.race_creates`` for what it returns)."""
    keys = (f"{prefix}race-create-{r}-{uuid.uuid4().hex[:8]}" for r in range(rounds))
    with races.clients_of(make_client, creators) as clients:
        return races.race_creates(
            clients,
            keys,
            lambda c, key, body: _put(c, bucket, key, body, IfNoneMatch="*"),
            lambda c, key: c.get_object(Bucket=bucket, Key=key)["Body"].read(),
            ok="200",
        )


def race_cas(
    make_client: Callable[[], Any], bucket: str, prefix: str, writers: int, increments: int
) -> tuple[int, int, int]:
    """``writers`` threads each make ``increments`` compare-and-swap increments of one
    counter; return (final count, acknowledged increments, retries)."""
    key = f"{prefix}race-cas-{uuid.uuid4().hex[:8]}"
    setup = make_client()
    setup.put_object(Bucket=bucket, Key=key, Body=b"0")

    def read(client: Any) -> tuple[bytes, str]:
        resp = client.get_object(Bucket=bucket, Key=key)
        return resp["Body"].read(), resp["ETag"]

    with races.clients_of(make_client, writers) as clients:
        acknowledged, retries = races.race_cas(
            clients,
            read,
            lambda c, body, etag: _put(c, bucket, key, body, IfMatch=etag),
            ok="200",
            increments=increments,
        )
    final = int(setup.get_object(Bucket=bucket, Key=key)["Body"].read())
    setup.close()
    return final, acknowledged, retries


def probe_endpoint(
    make_client: Callable[[], Any],
    bucket: str,
    *,
    creators: int = 16,
    rounds: int = 20,
    cas_writers: int = 8,
    increments: int = 25,
    races: bool = True,
) -> ProbeReport:
    """Run every probe against ``bucket`` through clients from ``make_client`` (a
    zero-argument callable returning a new botocore S3 client)."""
    prefix = f"cloudckpt-probe/{uuid.uuid4().hex[:12]}/"
    probe = _Probe(make_client, bucket, prefix)
    try:
        resp = probe.client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
        headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        probe.put_object_conditions()
        probe.complete_conditions()
        probe.checksums()
        probe.etags()
        probe.multipart_listing()
        probe.missing_bucket()
        figures = None
        if races:
            start = time.monotonic()
            winners, losers, slowest, wrong = race_creates(
                make_client, bucket, prefix, creators, rounds
            )
            middle = time.monotonic()
            final, acked, retries = race_cas(make_client, bucket, prefix, cas_writers, increments)
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
        return ProbeReport(
            probe.client.meta.endpoint_url, headers.get("server", ""), probe.findings, figures
        )
    finally:
        probe.cleanup()


# --- command line ---------------------------------------------------------------------


def client_factory(
    endpoint_url: str | None,
    key: str | None = None,
    secret: str | None = None,
    region: str = "us-east-1",
) -> Callable[[], Any]:
    """A callable returning a new botocore S3 client for the probe: one attempt per request
    (no SDK retries), reads without client-side checksum checks. Credentials default to
    the AWS environment."""
    import botocore.config
    import botocore.session

    session = botocore.session.get_session()  # one session: its models load once

    def make() -> Any:
        kwargs: dict[str, Any] = {"region_name": region}
        if endpoint_url:
            kwargs["endpoint_url"] = endpoint_url
        if key and secret:
            kwargs.update(aws_access_key_id=key, aws_secret_access_key=secret)
        # One attempt: a retried conditional write can trip over its own first attempt.
        # Reads return the stored bytes as they are (no client-side checksum check, unless
        # asked for with ChecksumMode), so a server that stored a wrong CRC32C shows it.
        config = botocore.config.Config(
            retries={"max_attempts": 1},
            max_pool_connections=4,
            response_checksum_validation="when_required",
        )
        return session.create_client("s3", config=config, **kwargs)

    return make


@contextlib.contextmanager
def _server(kind: str) -> Iterator[tuple[str, str, str]]:
    """Start a test server; yield (endpoint_url, key, secret)."""
    if kind == "seaweedfs":
        from cloudckpt.testing.seaweedfs_server import SeaweedFSServer

        with SeaweedFSServer() as server:
            opts = server.storage_options()
            yield server.endpoint_url, opts["key"], opts["secret"]
    else:
        from cloudckpt.testing.moto_server import MotoServer

        with MotoServer(serialize=kind == "moto") as server:
            opts = server.storage_options()
            yield server.endpoint_url, opts["key"], opts["secret"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cloudckpt.testing.s3_probe",
        description="Measure which S3 conditional writes, checksums and races an endpoint honours.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--server",
        choices=["seaweedfs", "moto", "moto-unserialized"],
        help="start this test server on 127.0.0.1 and probe it",
    )
    where.add_argument("--endpoint-url", help="probe this S3 endpoint (needs --bucket)")
    parser.add_argument("--bucket", help="an existing bucket (with --endpoint-url)")
    parser.add_argument("--key", help="access key id (default: the AWS environment)")
    parser.add_argument("--secret", help="secret access key (default: the AWS environment)")
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--creators", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cas-writers", type=int, default=8)
    parser.add_argument("--increments", type=int, default=25)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.endpoint_url and not args.bucket:
        parser.error("--endpoint-url needs --bucket")

    def run(make_client: Callable[[], Any], bucket: str) -> ProbeReport:
        return probe_endpoint(
            make_client,
            bucket,
            creators=args.creators,
            rounds=args.rounds,
            cas_writers=args.cas_writers,
            increments=args.increments,
        )

    if args.server:
        with _server(args.server) as (url, key, secret):
            make = client_factory(url, key, secret, args.region)
            bucket = f"probe-{uuid.uuid4().hex[:12]}"
            admin = make()
            admin.create_bucket(Bucket=bucket)
            admin.close()
            report = run(make, bucket)
    else:
        make = client_factory(args.endpoint_url, args.key, args.secret, args.region)
        report = run(make, args.bucket)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(f"({args.server or 'endpoint'})")
        print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
