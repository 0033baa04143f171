"""A sharded learner rank's share of each step, and what the ranks agree on (``policies.ranks``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mutualrl.policies.ranks import Pass, rank_passes


class GroupShare:
    """Rank ``rank`` of ``world``: a contiguous block of each step's micro-batches; finiteness,
    flags and statistics reduced over the default process group (tensors on ``device``, as NCCL
    needs them on the GPU)."""

    stops_early = False  # every rank runs every pass: each is a collective

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device

    def passes(self, micro_batches: int) -> list[Pass]:
        return rank_passes(micro_batches, self.rank, self.world)

    def _reduce(self, value: float, op) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return float(t.item())

    def all_finite(self, finite: bool) -> bool:
        return self._reduce(1.0 if finite else 0.0, dist.ReduceOp.MIN) > 0

    def any(self, flag: bool) -> bool:
        return self._reduce(1.0 if flag else 0.0, dist.ReduceOp.MAX) > 0

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        t = values.detach().to(device=self.device, dtype=torch.float64).clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()
