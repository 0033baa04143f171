"""Group-relative advantages. Pure functions over flat tensors.

Samples are flat ``(N,)`` tensors with a ``group_index`` ``(N,)`` in ``[0, K)`` naming the prompt
group each sample belongs to, so groups may have different sizes (a receiver's own G samples plus
pooled peer samples under PRP). Standard deviations are *population* std (divide by n), matching
TRL: rewards [0, 1, 1, 0] give advantages [-1, 1, 1, -1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

EPS = 1e-4  # as TRL: keeps a near-constant group from exploding; exact zero std is masked anyway


@dataclass(frozen=True)
class GroupMoments:
    count: Tensor  # (K,) samples per group
    mean: Tensor   # (K,)
    std: Tensor    # (K,) population std


def group_moments(values: Tensor, group_index: Tensor, num_groups: int) -> GroupMoments:
    """Per-group count, mean and population std of ``values`` (N,) grouped by ``group_index`` (N,)."""
    values = values.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(values))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, values)
    mean = total / count.clamp(min=1)
    dev2 = (values - mean[group_index]) ** 2
    m2 = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, dev2)
    std = (m2 / count.clamp(min=1)).sqrt()
    return GroupMoments(count=count, mean=mean, std=std)


def within_group_ranks(values: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """Ranks in [0, 1] within each group (ties share their average rank); a singleton gets 0.5.

    (N,) -> (N,). Rank advantages are invariant to any monotone rescaling of the reward, which is
    what makes them useful when policies' verifiers are on different scales.
    """
    n = values.shape[0]
    # sort by (group, value) so each group's values are contiguous and ascending
    span = values.abs().max() * 4 + 4 if n else 4     # max() of no values raises; nothing to sort
    order = torch.argsort(group_index.to(torch.float64) * span + values.to(torch.float64), stable=True)
    ranks = torch.empty(n, dtype=torch.float64)
    g_sorted, v_sorted = group_index[order], values[order].to(torch.float64)
    new_run = torch.ones(n, dtype=torch.bool)
    new_run[1:] = (g_sorted[1:] != g_sorted[:-1]) | (v_sorted[1:] != v_sorted[:-1])
    run_id = torch.cumsum(new_run.long(), 0) - 1                      # (N,) tie-run of each sorted item
    first_of_group = torch.ones(n, dtype=torch.bool)
    first_of_group[1:] = g_sorted[1:] != g_sorted[:-1]
    pos = torch.arange(n, dtype=torch.float64)
    group_start = torch.cummax(torch.where(first_of_group, pos, torch.zeros_like(pos)), 0).values
    pos_in_group = pos - group_start                                  # 0-based position in group
    runs = int(run_id[-1]) + 1 if n else 0
    run_sum = torch.zeros(runs, dtype=torch.float64).index_add_(0, run_id, pos_in_group)
    run_len = torch.zeros(runs, dtype=torch.float64).index_add_(0, run_id, torch.ones(n, dtype=torch.float64))
    avg_rank = (run_sum / run_len)[run_id]
    size = group_moments(values, group_index, num_groups).count[g_sorted]
    ranks[order] = torch.where(size > 1, avg_rank / (size - 1).clamp(min=1), torch.full_like(avg_rank, 0.5))
    return ranks.to(values.dtype)


def normalize(values: Tensor, mean: Tensor, std: Tensor, scale: str) -> Tensor:
    """Advantages from per-sample baselines: (N,), (N,), (N,) -> (N,).

    scale: "group" divides by the group std, "batch" by the std over all N values, "none"
    subtracts the mean only (Dr. GRPO: no std division, which removes the difficulty bias).
    """
    centered = values.to(torch.float64) - mean
    if scale == "group":
        return (centered / (std + EPS)).to(values.dtype)
    if scale == "batch":
        return (centered / (values.to(torch.float64).std(unbiased=False) + EPS)).to(values.dtype)
    if scale == "none":
        return centered.to(values.dtype)
    raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")


@dataclass(frozen=True)
class Advantages:
    advantages: Tensor     # (N,)
    zero_std: Tensor       # (N,) bool: the sample's group had identical rewards (no signal)
    moments: GroupMoments  # of the values the baseline was computed on


def group_advantages(rewards: Tensor, group_index: Tensor, num_groups: int, *,
                     scale: str = "group", estimator: str = "zscore") -> Advantages:
    """GRPO advantages per prompt group. rewards (N,), group_index (N,) -> Advantages.

    estimator "zscore" uses rewards as they are; "rank" replaces them by within-group ranks
    first. ``scale`` then chooses z-score ("group"/"batch") or mean-only ("none").
    """
    if estimator == "rank":
        values = within_group_ranks(rewards, group_index, num_groups)
    elif estimator == "zscore":
        values = rewards
    else:
        raise ValueError(f"estimator must be 'zscore' or 'rank', got {estimator!r}")
    m = group_moments(values, group_index, num_groups)
    adv = normalize(values, m.mean[group_index], m.std[group_index], scale)
    zero = m.std[group_index] == 0
    adv = torch.where(zero, torch.zeros_like(adv), adv)  # exact zeros, not eps-sized noise
    return Advantages(advantages=adv, zero_std=zero, moments=m)
