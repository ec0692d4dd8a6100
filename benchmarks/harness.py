"""What every benchmark group shares: the contenders, comparisons and groups the harness
(``benchmarks/rounds.py``, for ``benchmarks/run.py``) runs, the S3 and GCS targets they
write to, and test data. The groups in other modules (``torch_group``, ``s3_groups``,
``resume``, ``dcp_restore``, ``cpu_cost``, ...) import from here, never from ``run``, so no
import runs back up (issue 29 item 6)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.peers import Peers

MiB = 1 << 20
GiB = 1 << 30
TEST_KEY, TEST_SECRET, REGION = "bench", "bench-secret", "us-east-1"


def _write_files(root: Path, total: int, count: int, seed: int = 0) -> list[Path]:
    """``count`` files of random bytes totalling ``total`` bytes (incompressible)."""
    root.mkdir(parents=True, exist_ok=True)
    each = total // count
    paths = []
    block = os.urandom(min(each, 64 * MiB) or 1)
    for i in range(count):
        path = root / f"shard-{i:02d}.bin"
        with open(path, "wb") as f:
            left = each
            f.write(i.to_bytes(8, "big") + seed.to_bytes(8, "big"))  # files differ
            left -= 16
            while left > 0:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
        paths.append(path)
    return paths


def whole_file_upload(s3: S3Target, work: Path, mib: int, files: int, **manager: Any) -> Any:
    """The client-CPU drivers' setup: ``files`` random files of ``mib`` MiB in all under
    ``work/src``, and a manager saving them whole (``chunking="off"``) to the bench
    endpoint, unsigned, staged under ``work/staging``. Returns (files, GiB, manager)."""
    from cloudckpt import CheckpointManager

    paths = _write_files(work / "src", mib * MiB, files)
    mgr = CheckpointManager(
        s3.url("ck/"),
        storage_options=s3.storage_options("unsigned"),
        staging_dir=work / "staging",
        keep_last=1,
        auto_gc=False,
        chunking="off",
        **manager,
    )
    return paths, sum(f.stat().st_size for f in paths) / GiB, mgr


def _rm(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@dataclasses.dataclass
class Contender:
    """One side of a comparison. ``run(round)`` does the measured work and returns its
    metrics in seconds (at least ``"s"``, the wall time the harness also takes itself when
    the contender does not report it); ``after(round)`` tidies up, unmeasured."""

    name: str
    run: Callable[[int], dict[str, float] | None]
    after: Callable[[int], None] | None = None
    cloudckpt: bool = False
    note: str = ""


@dataclasses.dataclass
class Comparison:
    metric: str  # the metric compared ("s", "stall", "commit")
    baseline: str  # contender name
    target: float | None  # baseline / cloudckpt must be >= target
    cloudckpt: str = "cloudckpt"
    label: str = ""


@dataclasses.dataclass
class Group:
    name: str
    title: str
    nbytes: int
    contenders: list[Contender]
    comparisons: list[Comparison]
    servers: dict[str, int | None] = dataclasses.field(default_factory=dict)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class S3Target:
    """Where the S3 groups write: the benchmark endpoint, moto, or a real bucket."""

    def __init__(self, kind: str, url: str | None = None) -> None:
        self.kind = kind  # "bench", "moto" or "real"
        self.server: Any = None
        self.pid: int | None = None
        if kind == "bench":
            from benchmarks.s3_endpoint import S3Endpoint

            # Two doors: the scale group gives each simulated host its own (accounted apart).
            self.server = S3Endpoint(buckets=("bench",), doors=2).start()
            self.pid = self.server.pid
            self.endpoint_url: str | None = self.server.endpoint_url
            self.bucket, self.root = "bench", f"run-{uuid.uuid4().hex[:8]}/"
            self.creds: dict[str, Any] = {"key": TEST_KEY, "secret": TEST_SECRET}
        elif kind == "moto":
            from cloudckpt.testing.moto_server import MotoServer

            self.server = MotoServer().start()
            self.server.create_bucket("bench")
            self.pid = self.server._proc.pid if self.server._proc else None
            self.endpoint_url = self.server.endpoint_url
            self.bucket, self.root = "bench", f"run-{uuid.uuid4().hex[:8]}/"
            self.creds = {"key": TEST_KEY, "secret": TEST_SECRET}
        else:
            assert url and url.startswith("s3://")
            bucket, _, prefix = url[5:].partition("/")
            self.bucket = bucket
            self.root = (prefix.strip("/") + "/" if prefix.strip("/") else "") + (
                f"cloudckpt-bench-{uuid.uuid4().hex[:8]}/"
            )
            self.endpoint_url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
                "AWS_ENDPOINT_URL"
            )
            self.creds = {}
        self._admin: Any = None

    def config(self, signing: str) -> dict[str, Any]:
        return {"s3": {"payload_signing_enabled": signing == "signed"}}

    def storage_options(self, signing: str) -> dict[str, Any]:
        opts: dict[str, Any] = dict(self.creds)
        if self.endpoint_url:
            opts["endpoint_url"] = self.endpoint_url
        if self.kind != "real":
            opts["client_kwargs"] = {"region_name": REGION}
        opts["config_kwargs"] = self.config(signing)
        return opts

    def url(self, sub: str) -> str:
        return f"s3://{self.bucket}/{self.root}{sub}"

    def boto3_client(self, signing: str) -> Any:
        import boto3
        from botocore.config import Config

        kwargs: dict[str, Any] = {"config": Config(**self.config(signing))}
        if self.endpoint_url:
            kwargs["endpoint_url"] = self.endpoint_url
        if self.kind != "real":
            kwargs.update(
                aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET, region_name=REGION
            )
        return boto3.client("s3", **kwargs)

    def s3fs(self, signing: str) -> Any:
        import s3fs

        kwargs: dict[str, Any] = dict(self.creds)
        if self.endpoint_url:
            kwargs["endpoint_url"] = self.endpoint_url
        if self.kind != "real":
            kwargs["client_kwargs"] = {"region_name": REGION}
        return s3fs.S3FileSystem(
            config_kwargs=self.config(signing), skip_instance_cache=True, **kwargs
        )

    def drop(self, sub: str) -> None:
        """Delete everything under ``root + sub`` (unmeasured)."""
        prefix = self.root + sub
        if self.kind == "bench":
            self.server.reset(f"{self.bucket}/{prefix}")
            return
        if self._admin is None:
            self._admin = self.boto3_client("unsigned")
        paginator = self._admin.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self._admin.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})
        for page in self._admin.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            for u in page.get("Uploads", []):
                with contextlib.suppress(Exception):
                    self._admin.abort_multipart_upload(
                        Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]
                    )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.drop("")
        if self.server is not None:
            self.server.stop()


class GCSTarget:
    """fake-gcs-server, or a real bucket (``--gcs-url``)."""

    def __init__(self, url: str | None = None) -> None:
        self.server: Any = None
        self.pid: int | None = None
        if url is None:
            from cloudckpt.testing.gcs_server import FakeGCSServer

            self.server = FakeGCSServer()
            self.server.start()
            self.server.create_bucket("bench")
            self.pid = self.server._proc.pid if self.server._proc else None
            self.options: dict[str, Any] = self.server.storage_options()
            self.bucket, self.root = "bench", f"run-{uuid.uuid4().hex[:8]}/"
        else:
            bucket, _, prefix = url[5:].partition("/")
            self.bucket = bucket
            self.root = (prefix.strip("/") + "/" if prefix.strip("/") else "") + (
                f"cloudckpt-bench-{uuid.uuid4().hex[:8]}/"
            )
            self.options = {}
        self._fs: Any = None

    def url(self, sub: str) -> str:
        return f"gs://{self.bucket}/{self.root}{sub}"

    def gcsfs(self) -> Any:
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True, **self.options)

    def drop(self, sub: str) -> None:
        if self._fs is None:
            self._fs = self.gcsfs()
        path = f"{self.bucket}/{self.root}{sub}"
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(path, recursive=True)
        self._fs.invalidate_cache()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.drop("")
        if self.server is not None:
            self.server.stop()


# ----------------------------------------------------------------------------- groups


def _limit(s3: S3Target, name: str) -> dict[str, str]:
    """The limit a group's figures are set against: the loopback HTTP ceiling, for the
    benchmark endpoint only (moto and real buckets have ceilings of their own)."""
    return {"limit": name} if s3.kind == "bench" else {}


def _dcp_endpoint(fs: Any, s3: S3Target, signing: str) -> None:
    """s3torchconnector's S3StorageWriter/Reader take no endpoint: their S3FileSystem builds
    its S3Client with ``endpoint=None`` (AWS only). Give it one for this endpoint."""
    from s3torchconnector._s3client import S3Client

    if s3.endpoint_url:
        fs._client = S3Client(
            REGION, endpoint=s3.endpoint_url, s3client_config=Peers(s3, signing).config()
        )
