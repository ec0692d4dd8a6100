"""cloudckpt's restore contenders as the S3 and GCS restore groups run them: as shipped,
and with fsync switched off by the benchmark (like the peers), with the like-for-like
comparison."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness import Comparison, Contender, _rm


def restore_contenders(mgr: Any, dest: Path) -> list[Contender]:
    """cloudckpt's restore as shipped, and with fsync switched off (as the peers run)."""
    import cloudckpt.download as download

    def restore(r: int) -> None:
        mgr.restore(dest / f"ck-{r}")

    def restore_without_fsync(r: int) -> None:
        with _no_fsync(download):
            mgr.restore(dest / f"cknf-{r}")

    return [
        Contender(
            "cloudckpt",
            restore,
            lambda r: _rm(dest),
            cloudckpt=True,
            note="restore: LATEST, manifest, listing, parallel ranged GETs, every "
            "digest verified, files fsynced, directory renamed into place",
        ),
        Contender(
            "cloudckpt (no fsync)",
            restore_without_fsync,
            lambda r: _rm(dest),
            cloudckpt=True,
            note="the same with fsync switched off by the benchmark (like the peers)",
        ),
    ]


def without_fsync(peer: str, target: float = 2.0) -> Comparison:
    """``peer`` against cloudckpt's restore with fsync off: like with like."""
    return Comparison(
        "s", peer, target, cloudckpt="cloudckpt (no fsync)", label="s (both without fsync)"
    )


@contextlib.contextmanager
def _no_fsync(download: Any) -> Iterator[None]:
    """Benchmark-only: restore without fsyncing the files, as boto3/s3fs/gcsfs do."""
    saved = download._fsync_path
    download._fsync_path = lambda path: None
    try:
        yield
    finally:
        download._fsync_path = saved
