"""A GRPO batch that exercises every kind of row the update engine handles, for tests of it."""

from __future__ import annotations

import torch

from mutualrl.policies.batch import SFTExample, TrainBatch, TrainSequence
from mutualrl.policies.policy import Policy


def mixed_batch(
    p: Policy,
    *,
    rows: int = 7,
    sft_examples: int = 3,
    sft_coef: float = 0.5,
    diagnose: bool = False,
) -> TrainBatch:
    """Own rows with behaviour log-probs, peer rows with importance weights and none, rows of
    different prompt and completion lengths, a truncated row; plus SFT examples. Seeded."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(rows):
        n = 2 + i % 3
        ids = tuple(int(t) for t in torch.randint(100, 30000, (n,), generator=g))
        own = i % 3 != 0
        old = tuple(float(x) for x in -10 + 0.5 * torch.randn(n, generator=g)) if own else None
        seqs.append(
            TrainSequence(
                p.encode_prompt("first: cat dog" + " sun" * (i % 4) + " ="),
                ids,
                advantage=float(torch.randn((), generator=g)),
                old_logprobs=old,
                weight=1.0 if own else 0.3 + 0.2 * i,
                truncated=i == 4,
                source="" if own else "peer",
            )
        )
    sft = tuple(
        SFTExample(
            p.encode_prompt("last: a b" + " c" * i + " ="), p.encode_completion(" b" * (i + 1))
        )
        for i in range(sft_examples)
    )
    return TrainBatch(sequences=tuple(seqs), sft=sft, sft_coef=sft_coef, diagnose_sources=diagnose)
