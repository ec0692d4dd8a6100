"""What every group of one ``python -m benchmarks`` run shares (``Bench``): the parsed
arguments, the work directory, the results so far (written out after every group), the
managers and test data the groups set up, and which peers they run."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import Group, MiB, _rm, _write_files
from benchmarks.rounds import run_group


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.workdir:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-", dir=args.workdir))
        self.profile_dir = Path(args.profile) if args.profile else None
        self.results: list[dict[str, Any]] = []
        self.limits: dict[str, Any] | None = None
        #: Called after every group with the results so far (the JSON is written as it goes).
        self.on_result: Callable[[], None] | None = None

    def close(self) -> None:
        _rm(self.work)

    def run(self, group: Group) -> None:
        self.results.append(run_group(group, self.args.pairs, self.args.warmup, self.profile_dir))
        self.record()

    def record(self) -> None:
        if self.on_result is not None:
            self.on_result()

    # -- helpers ----------------------------------------------------------------------

    def manager(self, url: str, options: dict[str, Any], name: str) -> Any:
        from cloudckpt import CheckpointManager

        return CheckpointManager(
            url,
            storage_options=options,
            staging_dir=self.work / f"staging-{name}",
            keep_last=1,
            auto_gc=False,
            # These groups save the same bytes every round: chunked, every round after the
            # first would upload nothing. Chunked saves: python -m benchmarks.incremental.
            chunking="off",
        )

    def peer_rows(self, peers: Any) -> list[tuple[str, Any, Any, str]]:
        """The peers to run: all of them, or ``--peers``' comma list."""
        if peers.s3.kind == "moto":  # moto measures moto: the realism check keeps two clients
            return []
        rows = peers.rows()
        if self.args.peers != "all":
            wanted = {p.strip() for p in self.args.peers.split(",") if p.strip()}
            rows = [r for r in rows if r[0] in wanted]
        return rows

    def _torch_state(self, seed: int) -> tuple[dict[str, Any], int, int]:
        """The torch groups' state dict: ``--state-mib`` of fp32 in ``--tensors`` tensors."""
        import torch

        n = max(1, self.args.tensors)
        numel = self.args.state_mib * MiB // 4 // n
        torch.manual_seed(seed)
        state = {f"layer{i}.weight": torch.randn(numel) for i in range(n)}
        return state, n, sum(t.numel() * t.element_size() for t in state.values())

    def source(self, mib: int, files: int) -> Path:
        src = self.work / f"src-{mib}x{files}"
        if not src.exists():
            _write_files(src, mib * MiB, files)
            os.sync()
        return src
