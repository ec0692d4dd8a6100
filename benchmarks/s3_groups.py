"""The S3 throughput groups (``s3-upload``, ``s3-restore``, and ``moto-*`` against moto):
a checkpoint of ``--files`` files on local disk, cloudckpt's ``save_dir`` and ``restore``
against boto3, s3fs and the peers of ``benchmarks/peers.py``."""

from __future__ import annotations

from typing import Any

from benchmarks.bench import Bench
from benchmarks.harness import Comparison, Contender, GiB, Group, S3Target, _limit, _rm
from benchmarks.peers import Peers
from benchmarks.restore_contenders import restore_contenders, without_fsync


def s3_upload_group(bench: Bench, s3: S3Target, signing: str, mib: int, name: str) -> None:
    src = bench.source(mib, bench.args.files)
    files = sorted(src.iterdir())
    nbytes = sum(f.stat().st_size for f in files)
    mgr = bench.manager(s3.url("up-ck/"), s3.storage_options(signing), name)
    client = s3.boto3_client(signing)
    fs = s3.s3fs(signing)
    last: dict[str, Any] = {}

    def cloudckpt(r: int) -> None:
        last["ckpt"] = mgr.save_dir(r, src).result().ckpt

    def boto3_upload(r: int) -> None:
        for f in files:
            client.upload_file(str(f), s3.bucket, f"{s3.root}up-boto3/{r}/{f.name}")

    def s3fs_put(r: int) -> None:
        fs.put(f"{src}/", f"{s3.bucket}/{s3.root}up-s3fs/{r}/", recursive=True)

    peers = Peers(s3, signing)
    peer_rows = bench.peer_rows(peers)

    def peer_contender(tag: str, name: str, upload: Any, note: str) -> Contender:
        return Contender(
            name,
            lambda r: upload(files, f"{s3.root}up-{tag}/{r}/"),
            lambda r: s3.drop(f"up-{tag}/"),
            note=note,
        )

    group = Group(
        name=name,
        title=f"upload {nbytes / GiB:.2f} GiB in {len(files)} files from local disk "
        f"(S3 endpoint: {s3.kind}, {signing} payload)",
        nbytes=nbytes,
        contenders=[
            Contender(
                "cloudckpt",
                cloudckpt,
                lambda r: s3.drop(f"up-ck/{last.pop('ckpt')}"),
                cloudckpt=True,
                note="save_dir until committed (hard links, ATTEMPT.json, parallel "
                "multipart with CRC32C and SHA-256 tree digests, listing check, "
                "manifest, LATEST)",
            ),
            Contender(
                "boto3 upload_file",
                boto3_upload,
                lambda r: s3.drop("up-boto3/"),
                note="one upload_file per file, default TransferConfig",
            ),
            Contender("s3fs put", s3fs_put, lambda r: s3.drop("up-s3fs/"), note="recursive"),
            *(
                peer_contender(f"p{i}", name, up, note)
                for i, (name, up, _, note) in enumerate(peer_rows)
            ),
        ],
        comparisons=[
            Comparison("s", "boto3 upload_file", 1.5),
            Comparison("s", "s3fs put", 1.5),
            *(Comparison("s", name, 1.0) for name, *_ in peer_rows),
            *(
                # CPU-s per GiB, hashing included, at most 1.5x obstore's (issue 31).
                Comparison("cpu_client_s", name, 0.67, label="client CPU")
                for name, *_ in peer_rows
                if name == "obstore"
            ),
        ],
        servers={"server": s3.pid},
        info={"signing": signing, "endpoint": s3.kind, **_limit(s3, "http put (sink)")},
    )
    try:
        bench.run(group)
    finally:
        mgr.close()
        peers.close()


# -- restore ------------------------------------------------------------------------


def s3_restore_group(bench: Bench, s3: S3Target, signing: str, mib: int, name: str) -> None:

    src = bench.source(mib, bench.args.files)
    files = sorted(src.iterdir())
    nbytes = sum(f.stat().st_size for f in files)
    mgr = bench.manager(s3.url("down-ck/"), s3.storage_options(signing), name)
    mgr.save_dir(0, src).result()
    client = s3.boto3_client(signing)
    for f in files:
        client.upload_file(str(f), s3.bucket, f"{s3.root}down-peer/{f.name}")
    fs = s3.s3fs(signing)
    dest = bench.work / "restore"

    def boto3_download(r: int) -> None:
        out = dest / f"boto3-{r}"
        out.mkdir(parents=True)
        for f in files:
            client.download_file(s3.bucket, f"{s3.root}down-peer/{f.name}", str(out / f.name))

    def s3fs_get(r: int) -> None:
        out = dest / f"s3fs-{r}"
        out.mkdir(parents=True)
        fs.get(f"{s3.bucket}/{s3.root}down-peer/", f"{out}/", recursive=True)

    peers = Peers(s3, signing)
    peer_rows = bench.peer_rows(peers)
    names = [f.name for f in files]

    def peer_contender(tag: str, name: str, download: Any, note: str) -> Contender:
        def run(r: int) -> None:
            out = dest / f"{tag}-{r}"
            out.mkdir(parents=True)
            download(f"{s3.root}down-peer/", names, out)

        return Contender(name, run, lambda r: _rm(dest), note=note)

    group = Group(
        name=name,
        title=f"restore {nbytes / GiB:.2f} GiB in {len(files)} files to local disk "
        f"(S3 endpoint: {s3.kind}, {signing} payload)",
        nbytes=nbytes,
        contenders=[
            *restore_contenders(mgr, dest),
            Contender(
                "boto3 download_file",
                boto3_download,
                lambda r: _rm(dest),
                note="one download_file per file, default TransferConfig",
            ),
            Contender("s3fs get", s3fs_get, lambda r: _rm(dest), note="recursive"),
            *(
                peer_contender(f"p{i}", name, down, note)
                for i, (name, _, down, note) in enumerate(peer_rows)
            ),
        ],
        comparisons=[
            Comparison("s", "boto3 download_file", 2.0),
            Comparison("s", "s3fs get", None),
            without_fsync("boto3 download_file"),
            *(Comparison("s", name, 1.0) for name, *_ in peer_rows),
            *(without_fsync(name, 1.0) for name, *_ in peer_rows),
        ],
        servers={"server": s3.pid},
        info={"signing": signing, "endpoint": s3.kind, **_limit(s3, "http get (source)")},
    )
    try:
        bench.run(group)
    finally:
        mgr.close()
        peers.close()
        s3.drop("down-")
