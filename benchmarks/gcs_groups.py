"""The GCS groups (``gcs-upload``, ``gcs-restore``): cloudckpt against gcsfs, on
fake-gcs-server or the bucket of ``--gcs-url``."""

from __future__ import annotations

from typing import Any

from benchmarks.bench import Bench
from benchmarks.harness import Comparison, Contender, GCSTarget, GiB, Group, _rm
from benchmarks.restore_contenders import restore_contenders, without_fsync


def gcs_groups(bench: Bench, gcs: GCSTarget, mib: int) -> None:

    src = bench.source(mib, bench.args.files)
    files = sorted(src.iterdir())
    nbytes = sum(f.stat().st_size for f in files)
    server = {"server": gcs.pid}
    kind = "fake-gcs-server" if gcs.server else "GCS"

    mgr = bench.manager(gcs.url("up-ck/"), gcs.options, "gcs-up")
    fs = gcs.gcsfs()
    last: dict[str, Any] = {}

    def up_ck(r: int) -> None:
        last["ckpt"] = mgr.save_dir(r, src).result().ckpt

    def up_gcsfs(r: int) -> None:
        fs.put(f"{src}/", f"{gcs.bucket}/{gcs.root}up-gcsfs/{r}/", recursive=True)

    up = Group(
        name="gcs-upload",
        title=f"upload {nbytes / GiB:.2f} GiB in {len(files)} files ({kind})",
        nbytes=nbytes,
        contenders=[
            Contender(
                "cloudckpt",
                up_ck,
                lambda r: gcs.drop(f"up-ck/{last.pop('ckpt')}"),
                cloudckpt=True,
                note="save_dir until committed (parallel composite upload)",
            ),
            Contender("gcsfs put", up_gcsfs, lambda r: gcs.drop("up-gcsfs/")),
        ],
        comparisons=[Comparison("s", "gcsfs put", 1.5)],
        servers=server,
        info={"endpoint": kind},
    )
    try:
        bench.run(up)
    finally:
        mgr.close()

    mgr = bench.manager(gcs.url("down-ck/"), gcs.options, "gcs-down")
    mgr.save_dir(0, src).result()
    fs.put(f"{src}/", f"{gcs.bucket}/{gcs.root}down-peer/", recursive=True)
    dest = bench.work / "restore"

    def down_gcsfs(r: int) -> None:
        out = dest / f"gcsfs-{r}"
        out.mkdir(parents=True)
        fs.get(f"{gcs.bucket}/{gcs.root}down-peer/", f"{out}/", recursive=True)

    down = Group(
        name="gcs-restore",
        title=f"restore {nbytes / GiB:.2f} GiB in {len(files)} files ({kind})",
        nbytes=nbytes,
        contenders=[
            *restore_contenders(mgr, dest),
            Contender("gcsfs get", down_gcsfs, lambda r: _rm(dest)),
        ],
        comparisons=[
            Comparison("s", "gcsfs get", 2.0),
            without_fsync("gcsfs get"),
        ],
        servers=server,
        info={"endpoint": kind},
    )
    try:
        bench.run(down)
    finally:
        mgr.close()
        gcs.drop("down-")
