"""The ``save_state`` state the in-memory load tests share (``test_resume_state``,
``test_load_into``): big tensors (chunks of their own), small packed ones, a bf16, a tie,
a 0-d and an empty tensor, and plain values; its values follow ``seed``."""

from __future__ import annotations

import collections

import torch


def tied_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(700, 1024, generator=g)  # 2.7 MiB: spans digest leaves
    return {
        "model": collections.OrderedDict(
            w=w,
            tied=w,
            emb=torch.randn(2100, 1000, generator=g).to(torch.bfloat16),  # 4 MiB
            b=torch.arange(7, dtype=torch.int64) + seed,
            mask=torch.tensor([True, False, True]),
            scalar=torch.tensor(float(seed)),
            empty=torch.zeros(0, 3),
        ),
        "step": seed,
    }
