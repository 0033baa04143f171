"""Group-relative advantages. Pure functions over flat tensors.

Samples are flat ``(N,)`` tensors with a ``group_index`` ``(N,)`` in ``[0, K)`` naming the prompt
group each sample belongs to, so groups may have different sizes (a receiver's own G samples plus
pooled peer samples under PRP). The standard deviation is chosen by ``advantage_std`` (one entry
of ``STD_DDOF``): "population" (divide by n; the default, as the GRPO references compute it):
rewards [0, 1, 1, 0] give advantages [-1, 1, 1, -1]; "sample" (divide by n - 1, Bessel's
correction, as TRL's ``GRPOTrainer`` does): they give [-0.866, 0.866, 0.866, -0.866]. Either way
the advantage is ``(r - mean) / (std + 1e-4)``, the epsilon added to the std as TRL adds it.

The two choices a researcher varies are registries (``registry.Registry``), open to plug-ins
through entry points, each entry a small pure function:

* ``ADVANTAGE_ESTIMATORS`` (``grpo.advantage_estimator``): what the baseline is taken over, the
  rewards as they are (``zscore``) or their within-group ranks (``rank``):
  ``(rewards (N,), group_index (N,), num_groups) -> values (N,)``;
* ``REWARD_SCALINGS`` (``grpo.scale_rewards``): what the centred values are divided by, the group
  std (``group``), the std over the batch (``batch``) or nothing (``none``, Dr. GRPO):
  ``(values (N,), group_std (N,), advantage_std) -> divisor (N,) or ()``.

Third-party packages add theirs through the ``mutualrl.advantage_estimators`` and
``mutualrl.reward_scalings`` entry point groups; the run checks the names before it starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from mutualrl.registry import Registry

EPS = 1e-4  # as TRL: keeps a near-constant group from exploding; exact zero std is masked anyway

# advantage_std -> the degrees of freedom taken off the count before dividing the sum of squared
# deviations (``torch.std``'s ``correction``). Read-only, filled here once.
STD_DDOF: Mapping[str, int] = MappingProxyType({"population": 0, "sample": 1})


def std_ddof(advantage_std: str) -> int:
    """The correction of ``advantage_std``; an unknown one fails naming the allowed values."""
    try:
        return STD_DDOF[advantage_std]
    except KeyError:
        raise ValueError(
            f"advantage_std must be one of {tuple(STD_DDOF)}, got {advantage_std!r}"
        ) from None


def std_from_m2(m2: Tensor, count: Tensor, advantage_std: str = "population") -> Tensor:
    """Standard deviation from the sum of squared deviations: (K,), (K,) -> (K,).

    A group too small for its correction (empty; one sample under "sample", where TRL's std is
    NaN and its advantage then 0) gets std 0, so its advantages are 0 as well."""
    return (m2 / (count - std_ddof(advantage_std)).clamp(min=1)).sqrt()


@dataclass(frozen=True)
class GroupMoments:
    count: Tensor  # (K,) samples per group
    mean: Tensor  # (K,)
    std: Tensor  # (K,) population or sample std (``advantage_std``)


def group_moments(
    values: Tensor, group_index: Tensor, num_groups: int, advantage_std: str = "population"
) -> GroupMoments:
    """Per-group count, mean and std of ``values`` (N,) grouped by ``group_index`` (N,)."""
    values = values.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, group_index, torch.ones_like(values)
    )
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, values)
    mean = total / count.clamp(min=1)
    dev2 = (values - mean[group_index]) ** 2
    m2 = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, dev2)
    return GroupMoments(count=count, mean=mean, std=std_from_m2(m2, count, advantage_std))


def within_group_ranks(values: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """Ranks in [0, 1] within each group (ties share their average rank); a singleton gets 0.5.

    (N,) -> (N,). Rank advantages are invariant to any monotone rescaling of the reward, which is
    what makes them useful when policies' verifiers are on different scales.
    """
    n = values.shape[0]
    # sort by (group, value) so each group's values are contiguous and ascending
    span = values.abs().max() * 4 + 4 if n else 4  # max() of no values raises; nothing to sort
    order = torch.argsort(
        group_index.to(torch.float64) * span + values.to(torch.float64), stable=True
    )
    ranks = torch.empty(n, dtype=torch.float64)
    g_sorted, v_sorted = group_index[order], values[order].to(torch.float64)
    new_run = torch.ones(n, dtype=torch.bool)
    new_run[1:] = (g_sorted[1:] != g_sorted[:-1]) | (v_sorted[1:] != v_sorted[:-1])
    run_id = torch.cumsum(new_run.long(), 0) - 1  # (N,) tie-run of each sorted item
    first_of_group = torch.ones(n, dtype=torch.bool)
    first_of_group[1:] = g_sorted[1:] != g_sorted[:-1]
    pos = torch.arange(n, dtype=torch.float64)
    group_start = torch.cummax(torch.where(first_of_group, pos, torch.zeros_like(pos)), 0).values
    pos_in_group = pos - group_start  # 0-based position in group
    runs = int(run_id[-1]) + 1 if n else 0
    run_sum = torch.zeros(runs, dtype=torch.float64).index_add_(0, run_id, pos_in_group)
    run_len = torch.zeros(runs, dtype=torch.float64).index_add_(
        0, run_id, torch.ones(n, dtype=torch.float64)
    )
    avg_rank = (run_sum / run_len)[run_id]
    size = group_moments(values, group_index, num_groups).count[g_sorted]
    ranks[order] = torch.where(
        size > 1, avg_rank / (size - 1).clamp(min=1), torch.full_like(avg_rank, 0.5)
    )
    return ranks.to(values.dtype)


def _batch_std(values: Tensor, advantage_std: str) -> Tensor:
    """The std of all N values (N,) -> (); 0 for a single value (as for a singleton group)."""
    if values.numel() < 2:
        return torch.zeros((), dtype=torch.float64)
    return values.to(torch.float64).std(correction=std_ddof(advantage_std))


Scaling = Callable[[Tensor, Tensor, str], Tensor]
REWARD_SCALINGS: Registry[Scaling] = Registry(
    "reward scaling", entry_point_group="mutualrl.reward_scalings"
)


@REWARD_SCALINGS.register("group")
def _by_group_std(values: Tensor, std: Tensor, advantage_std: str) -> Tensor:
    return std + EPS


@REWARD_SCALINGS.register("batch")
def _by_batch_std(values: Tensor, std: Tensor, advantage_std: str) -> Tensor:
    return _batch_std(values, advantage_std) + EPS


@REWARD_SCALINGS.register("none")
def _unscaled(values: Tensor, std: Tensor, advantage_std: str) -> Tensor:
    return torch.ones((), dtype=torch.float64)  # x / 1.0 is x exactly


def normalize(
    values: Tensor, mean: Tensor, std: Tensor, scale: str, advantage_std: str = "population"
) -> Tensor:
    """Advantages from per-sample baselines: (N,), (N,), (N,) -> (N,): the centred values over
    the divisor ``REWARD_SCALINGS[scale]`` gives (``std``: the group std, already of the
    ``advantage_std`` kind)."""
    centered = values.to(torch.float64) - mean
    return (centered / REWARD_SCALINGS.get(scale)(values, std, advantage_std)).to(values.dtype)


Estimator = Callable[[Tensor, Tensor, int], Tensor]
ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry(
    "advantage estimator", entry_point_group="mutualrl.advantage_estimators"
)


@ADVANTAGE_ESTIMATORS.register("zscore")
def _rewards_as_they_are(rewards: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    return rewards


ADVANTAGE_ESTIMATORS.register("rank", within_group_ranks)


@dataclass(frozen=True)
class Advantages:
    advantages: Tensor  # (N,)
    zero_std: Tensor  # (N,) bool: the sample's group had identical rewards (no signal)
    moments: GroupMoments  # of the values the baseline was computed on


def group_advantages(
    rewards: Tensor,
    group_index: Tensor,
    num_groups: int,
    *,
    scale: str = "group",
    estimator: str = "zscore",
    advantage_std: str = "population",
) -> Advantages:
    """GRPO advantages per prompt group. rewards (N,), group_index (N,) -> Advantages.

    ``estimator`` (``ADVANTAGE_ESTIMATORS``) gives the values the baseline is taken over;
    ``scale`` (``REWARD_SCALINGS``) what they are divided by once centred, with the
    ``advantage_std`` standard deviation ("population" or "sample": ``STD_DDOF``).
    """
    values = ADVANTAGE_ESTIMATORS.get(estimator)(rewards, group_index, num_groups)
    m = group_moments(values, group_index, num_groups, advantage_std)
    adv = normalize(values, m.mean[group_index], m.std[group_index], scale, advantage_std)
    zero = m.std[group_index] == 0
    adv = torch.where(zero, torch.zeros_like(adv), adv)  # exact zeros, not eps-sized noise
    return Advantages(advantages=adv, zero_std=zero, moments=m)
