"""What a seed decides up front (``Profile``): settings, fault rates, scheduling weights,
and the content of every save."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import struct
from collections.abc import Callable

from cloudckpt import digest
from cloudckpt.errors import OutcomeUnknownError, PreconditionFailedError
from cloudckpt.testing.faults import (
    Conflict,
    DeliverTwice,
    FailBefore,
    Latency,
    LoseResponse,
    Rule,
    ShortRead,
    Truncate,
)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Everything a seed decides up front: settings, fault rates, scheduling weights."""

    keep_last: int | None
    keep_every: int | None
    grace: int
    p_fail_before: float
    p_unknown_before: float
    p_lose_write: float
    p_lose_read: float
    p_twice: float
    p_conflict: float
    p_lie_412: float
    p_latency: float
    p_truncate: float
    p_crash_call: float
    p_crash_failpoint: float
    p_clock_jump: float
    big_files: bool
    weights: dict[str, float]
    # A host suspended (VM hibernated or paused): the store's clock jumps, the host's
    # monotonic clock does not, and the host makes no call while it sleeps.
    p_suspend: float = 0.0
    # Deterministic training: what a writer saves at a step depends on the step only, so
    # a writer restarted after a crash saves the same files again and resumes the chunks
    # its interrupted save uploaded (docs/design.md §11, "Resuming an interrupted save").
    deterministic: bool = False
    # Retention by metric and by time (``cloudckpt.retention``), drawn from a generator of
    # their own (``draw_retention``) so that every other draw of a seed stays as it was.
    keep_best: int | None = None
    # (metric, mode) of writer A and of writer B: they differ in some seeds (the metric
    # changes with every claim); B may also leave them unset (inheriting the run's).
    best: tuple[tuple[str, str], tuple[str, str] | None] = (("loss", "min"), ("loss", "min"))
    keep_periods: tuple[tuple[int, int], ...] = ()
    # Ranged reads of data (files, chunks) that come back short with no error (a response
    # cut short that the transport missed): readers must read again, never judge the
    # object truncated on one answer. Drawn by ``draw_short_reads`` (a generator of its own).
    p_short_read: float = 0.0
    # The share of saves that hold a safetensors file (``model.safetensors``) whose tensors
    # start and end inside 1 MiB blocks: a writer chunking by tensor cuts its chunks there
    # (``chunks.plan``, ``digest.blocks_as_read``). Drawn by ``draw_tensors``.
    p_safetensors: float = 0.0
    # Sticky short reads: the share of data keys (files, chunks) whose ranged answers are
    # all cut short for a while from their first ranged read (a bad cache node, a proxy
    # with a body limit), so that every retry of a read answers short. That is a store
    # failure, not damage: a restore fails (and is tried again later), it never judges the
    # checkpoint damaged or falls back. Drawn by ``draw_sticky_short`` (a generator of its
    # own); the world keeps each key's window (``Simulation.cut_short``).
    p_sticky_short: float = 0.0

    @classmethod
    def draw(
        cls,
        rng: random.Random,
        retention_rng: random.Random | None = None,
        reads_rng: random.Random | None = None,
        tensors_rng: random.Random | None = None,
        sticky_rng: random.Random | None = None,
    ) -> Profile:
        profile = cls._draw(rng)
        if sticky_rng is not None:
            profile = profile.draw_sticky_short(sticky_rng)
        if retention_rng is not None:
            profile = profile.draw_retention(retention_rng)
        if tensors_rng is not None:
            profile = profile.draw_tensors(tensors_rng)
        return profile.draw_short_reads(reads_rng) if reads_rng is not None else profile

    def draw_tensors(self, rng: random.Random) -> Profile:
        """The share of saves with a safetensors file (none in three seeds of four)."""
        return dataclasses.replace(self, p_safetensors=rng.choice([0, 0, 0, 0.6]))

    def draw_short_reads(self, rng: random.Random) -> Profile:
        """The rate of short ranged reads of data (none in half the seeds)."""
        return dataclasses.replace(self, p_short_read=rng.choice([0, 0, 0.02, 0.05, 0.15]))

    def draw_sticky_short(self, rng: random.Random) -> Profile:
        """The share of data keys whose answers are all cut short for a while (none in
        half the seeds)."""
        return dataclasses.replace(self, p_sticky_short=rng.choice([0, 0, 0.1, 0.3]))

    def draw_retention(self, rng: random.Random) -> Profile:
        """The retention rules by metric and by time: keep-best of 1-3 by "loss" (min) or
        "acc" (max), sometimes a different one per writer; one per period for a window, in
        periods from seconds to the grace period (time passes 0.5 s a tick, and jumps)."""
        g = self.grace
        a = rng.choice([("loss", "min"), ("acc", "max")])
        b: tuple[str, str] | None = rng.choice([a, a, ("acc", "max"), ("loss", "min"), None])
        return dataclasses.replace(
            self,
            keep_best=rng.choice([None, None, 1, 2, 3]),
            best=(a, b),
            keep_periods=rng.choice(
                [(), (), ((5, 30),), ((g // 4, g),), ((g, 4 * g),), ((5, 20), (g // 2, 3 * g))]
            ),
        )

    def retention_options(self, writer: str) -> dict[str, object]:
        """The manager options of writer ``writer`` for the rules by metric and by time."""
        options: dict[str, object] = {"keep_periods": self.keep_periods}
        best = self.best[0] if writer == "A" else self.best[1]
        if best is not None:
            metric, mode = best
            options.update(keep_best=self.keep_best, best_metric=metric, best_mode=mode)
            if self.keep_best is None:
                options.update(best_metric=None)
        return options

    def metrics(self, key: str) -> dict[str, float]:
        """The metrics recorded with save ``key``: few distinct values (ties), NaN, an
        infinity, or missing."""
        rng = random.Random(f"{key}/metrics")
        out = {}
        for name in ("loss", "acc"):
            value = rng.choice([0.1, 0.2, 0.3, 0.3, 0.5, 0.8, float("nan"), float("inf"), None])
            if value is not None:
                out[name] = value if rng.random() < 0.9 else -value
        return out

    @classmethod
    def _draw(cls, rng: random.Random) -> Profile:
        def rate(*choices: float) -> float:
            return rng.choice(choices)

        return cls(
            keep_last=rng.choice([1, 2, 3, None]),
            keep_every=rng.choice([None, None, 2, 3]),
            grace=rng.choice([60, 600, 7200]),
            p_fail_before=rate(0, 0.01, 0.05),
            p_unknown_before=rate(0, 0.01, 0.04),
            p_lose_write=rate(0, 0.02, 0.08),
            p_lose_read=rate(0, 0.01, 0.04),
            p_twice=rate(0, 0.02, 0.08),
            p_conflict=rate(0, 0.05, 0.2),
            p_lie_412=rate(0, 0, 0.05),
            p_latency=rate(0, 0.02, 0.05),
            p_truncate=rate(0, 0, 0.01, 0.03),
            p_crash_call=rate(0, 0.002, 0.005),
            p_crash_failpoint=rate(0, 0.01, 0.03, 0.08),
            p_clock_jump=rate(0.005, 0.02, 0.05),
            big_files=rng.random() < 0.03,
            weights={n: rng.uniform(0.2, 1.0) for n in ("A", "B", "gc", "restorer", "pinner")},
            p_suspend=rate(0, 0.002, 0.005, 0.01),
            deterministic=rng.random() < 0.5,
        )

    def rules(
        self, rng: random.Random, cut_short: Callable[[str], bool] | None = None
    ) -> list[Rule]:
        """Fault rules for one actor's store (probabilities from the seed). ``cut_short``:
        whether a ranged answer of a key is cut short now (the sticky short reads, last, so
        that the other rules draw as they did without them)."""
        writes = {"put", "delete", "upload_part", "complete_multipart", "create_multipart"}
        reads = {"get", "get_range", "head", "list", "list_multipart"}
        rules = [
            Rule(FailBefore(), ops=writes | reads, times=None, probability=self.p_fail_before),
            Rule(
                FailBefore(OutcomeUnknownError),
                ops=writes,
                times=None,
                probability=self.p_unknown_before,
            ),
            Rule(LoseResponse(), ops=writes, times=None, probability=self.p_lose_write),
            Rule(LoseResponse(), ops=reads, times=None, probability=self.p_lose_read),
            Rule(DeliverTwice(), ops=writes, times=None, probability=self.p_twice),
            Rule(Conflict(), ops={"put"}, key="LATEST", times=None, probability=self.p_conflict),
            Rule(
                FailBefore(PreconditionFailedError),
                ops={"put"},
                key="LATEST",
                modes={"update"},
                times=None,
                probability=self.p_lie_412,
            ),
            Rule(
                Latency(rng.uniform(1, self.grace * 0.7)),
                ops=writes | reads,
                times=None,
                probability=self.p_latency,
            ),
            Rule(
                Truncate(rng.randrange(0, 64)),
                ops={"put", "upload_part"},
                key=lambda k: "/files/" in k or "/chunks/" in k,
                times=None,
                probability=self.p_truncate,
            ),
            Rule(
                ShortRead(),
                ops={"get_range"},
                key=lambda k: "/files/" in k or "/chunks/" in k,
                times=None,
                probability=self.p_short_read,
            ),
        ]
        if self.p_sticky_short and cut_short is not None:
            rules.append(Rule(StickyShortRead(), ops={"get_range"}, key=cut_short, times=None))
        return [r for r in rules if r.probability > 0]

    def content(self, key: str) -> dict[str, bytes]:
        """The files of save ``key`` (derived from the key, so any copy can be checked).
        A writer's save ``<writer>.<incarnation>.<step>.<i>`` of a deterministic profile
        depends on the writer and the step only."""
        parts = key.split(".")
        same = self.deterministic and len(parts) == 4 and all(p.isdigit() for p in parts[1:])
        basis = f"{parts[0]}@{parts[2]}" if same else key
        rng = random.Random(basis)
        names = rng.sample(["model.bin", "optim/state.bin", "rng.pt", "meta/trainer.json"], rng.randint(1, 3))  # fmt: skip
        files = {}
        for name in sorted(names):
            size = rng.choice([0, rng.randint(1, 300), rng.randint(300, 6000)])
            files[name] = rng.randbytes(size)
        if self.big_files and rng.random() < 0.3:
            files["big.bin"] = rng.randbytes(digest.CHUNK_SIZE + rng.randint(1, 5000))
        if rng.random() < 0.8:
            # Frozen weights shared by most saves: chunks that later checkpoints reuse. The
            # base changes every few steps (a new stage of training), so a chunk can end up
            # named by dropped checkpoints only, which GC must keep while a pin could still
            # bring one of them back.
            parts = key.split(".")
            stage = int(parts[2]) // 4 if len(parts) > 2 and parts[2].isdigit() else 0
            files["base/frozen.bin"] = random.Random(f"base{stage % 3}").randbytes(3000)
        # From a generator of its own, after every other draw: a seed without safetensors
        # saves exactly what it saved before they were added.
        tensors = random.Random(f"{basis}/tensors")
        if self.p_safetensors and tensors.random() < self.p_safetensors:
            stage = int(parts[2]) // 4 if len(parts) > 2 and parts[2].isdigit() else 0
            files["model.safetensors"] = _safetensors(tensors, stage % 3)
        return files


@dataclasses.dataclass
class StickyShortRead(ShortRead):
    """``ShortRead`` on every ranged answer of a key for a while (counted apart)."""

    name = "sticky_short_read"


@functools.lru_cache(maxsize=3)
def _frozen_tensor(stage: int) -> bytes:
    """A frozen tensor shared by the saves of a stage: over 1 MiB (``chunks.MIN_PIECE``),
    so that a writer chunking by tensor gives it chunks of its own, reused by later saves."""
    rng = random.Random(f"tensor{stage}")
    return rng.randbytes(1024 * 1024 + rng.randint(1, 300_000))


def _safetensors(rng: random.Random, stage: int) -> bytes:
    """A small safetensors file (LoRA-like): a changing adapter, the stage's frozen tensor,
    and (in half of them) a changing head. The header's length (padded by metadata) and
    the adapter's size put the cuts (the header's end, the frozen tensor's start and end)
    inside 1 MiB blocks, never on a block's edge: the chunks between them are hashed from
    parts of blocks."""
    tensors = [("adapter", rng.randbytes(rng.randint(1, 5000))), ("frozen", _frozen_tensor(stage))]
    if rng.random() < 0.5:
        tensors.append(("head", rng.randbytes(rng.randint(1, 3000))))
    header: dict[str, object] = {"__metadata__": {"pad": "x" * rng.randint(0, 200)}}
    at = 0
    for name, data in tensors:
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [at, at + len(data)]}
        at += len(data)
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(data for _, data in tensors)
