"""Which micro-batches of an optimizer step a learner rank runs, and how ranks agree on the rest.

A learner is one rank (``OneRank``: every micro-batch here, nothing to agree on) or one of the
ranks of a sharded learner (``policies.sharded.share.GroupShare``). The update
(``policies.update``) cuts each batch into micro-batches exactly as for one rank, with their
count rounded up to a multiple of the ranks, and every rank takes a contiguous block of them:
its *passes*. The loss of every
micro-batch is already its share of the whole batch's loss (``grpo.normalise``), so the sum over
ranks of their gradients is the one-rank gradient; the sharded model's reduction sums
(``policies.sharded.fsdp``).

Every rank must run the same sequence of forward and backward passes (each is a collective of
the sharded model), so a rank with fewer micro-batches than the others (a batch with fewer rows
than ranks, or an SFT batch of one) runs a *padding pass*: a real micro-batch of the batch whose
loss is multiplied by 0, contributing no gradient and no statistic.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

# One pass: (index of the micro-batch it runs, whether it counts: False for a padding pass).
Pass = tuple[int, bool]


class RankShare(Protocol):
    """A learner rank's share of each optimizer step's micro-batches."""

    world: int  # ranks of the learner
    stops_early: bool  # a non-finite micro-batch loss may end the step at once

    def passes(self, micro_batches: int) -> list[Pass]:
        """The passes this rank runs over ``micro_batches`` micro-batches, in order."""
        ...

    def all_finite(self, finite: bool) -> bool:
        """True when every rank's losses were finite."""
        ...

    def any(self, flag: bool) -> bool:
        """True when any rank's ``flag`` is."""
        ...

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``values`` (a 1-D float64 tensor) over the ranks."""
        ...


class OneRank:
    """The whole learner in one process: every micro-batch is its own, nothing crosses."""

    world = 1
    stops_early = True

    def passes(self, micro_batches: int) -> list[Pass]:
        return [(k, True) for k in range(micro_batches)]

    def all_finite(self, finite: bool) -> bool:
        return finite

    def any(self, flag: bool) -> bool:
        return flag

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values


ONE_RANK = OneRank()


def rank_passes(micro_batches: int, rank: int, world: int) -> list[Pass]:
    """Rank ``rank``'s contiguous block of ``ceil(micro_batches / world)`` passes; where the
    block runs past the last micro-batch, padding passes over micro-batch 0."""
    per_rank = math.ceil(micro_batches / world)
    first = rank * per_rank
    return [(first + j, True) if first + j < micro_batches else (0, False) for j in range(per_rank)]
