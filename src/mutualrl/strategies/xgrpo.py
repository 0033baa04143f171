"""``xgrpo`` — cross-policy advantage sharing (value level).

Only scalar statistics cross: each policy's baseline for a prompt is computed over the union of
all policies' rewards for it, and each policy still updates only on its own samples. For the
z-score the union's moments are the exact merge of every producer's published ``GroupStats``
(count, mean, M2); the rank estimator needs the rewards themselves and reads peers' rollouts.
Both take the run's ``grpo.advantage_std`` (population or sample std of the union).
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

from mutualrl.exchange import GroupStats, merge
from mutualrl.grpo import group_moments, std_from_m2, within_group_ranks
from mutualrl.policies.batch import TrainBatch
from mutualrl.strategies.base import StrategyContext, register_strategy
from mutualrl.strategies.common import (
    baseline_advantages,
    batch_of,
    group_count,
    sequences_from_samples,
)


class XGRPOParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    estimator: Literal["zscore", "rank"] = (
        "zscore"  # baseline over the union: z-score or within-group ranks
    )


def pooled_stats(deliveries, prompt_ids: set[str]) -> dict[str, GroupStats]:
    """prompt id -> the exact merge of every producer's latest GroupStats for it."""
    out: dict[str, GroupStats] = {}
    for d in deliveries:
        if d.kind == "group_stats" and d.record.prompt_id in prompt_ids:
            pid = d.record.prompt_id
            out[pid] = d.record if pid not in out else merge(out[pid], d.record, producer="pooled")
    return out


def pooled_std(stats, advantage_std: str) -> float:
    """The ``advantage_std`` std of a merged ``GroupStats`` (its count and M2)."""
    m2 = torch.tensor(stats.m2, dtype=torch.float64)
    return float(
        std_from_m2(m2, torch.tensor(float(stats.count), dtype=torch.float64), advantage_std)
    )


class CrossPolicyAdvantages:
    name = "xgrpo"
    # The diversity regulariser shapes the receiver's own rewards, and this strategy's baselines
    # pool them with the peers' verified rewards: refused (``strategies.diversity``).
    no_diversity = (
        "its baselines pool the receiver's rewards with the peers' verified ones, so "
        "a shaped reward would be centred on verified ones (a success could fall below "
        'the baseline) or, under estimator = "rank", not be found among them'
    )

    def __init__(self, params: XGRPOParams) -> None:
        self.params = params

    def observe(self, ctx: StrategyContext, samples) -> None:
        return None

    def build_batches(self, ctx: StrategyContext, receiver: str, own) -> list[TrainBatch]:
        if not own:
            return []
        pids = [s.prompt.id for s in own]
        rewards = torch.tensor([s.reward for s in own], dtype=torch.float64)
        groups = torch.tensor([s.group for s in own])
        kind = ctx.grpo.advantage_std
        mine = group_moments(rewards, groups, group_count(own), kind)  # the receiver's own groups
        if self.params.estimator == "zscore":
            stats = pooled_stats(ctx.peer_experience, set(pids))
            missing = sum(p not in stats for p in set(pids))
            if missing:  # e.g. dropped by a bounded queue: fall back to the own group's moments
                ctx.log(receiver, "xgrpo/prompts_without_pooled_stats", missing)
            mean = torch.tensor(
                [
                    stats[p].mean if p in stats else float(mine.mean[s.group])
                    for p, s in zip(pids, own)
                ],
                dtype=torch.float64,
            )
            std = torch.tensor(
                [
                    pooled_std(stats[p], kind) if p in stats else float(mine.std[s.group])
                    for p, s in zip(pids, own)
                ],
                dtype=torch.float64,
            )
            adv = baseline_advantages(rewards, mean, std, ctx.grpo)
        else:
            adv, std = self._rank(ctx, pids, rewards)
        zero = std == 0
        adv = torch.where(zero, torch.zeros_like(adv), adv)
        # groups with no signal of their own that the pooled baseline gives one
        rescued = torch.unique(groups[(mine.std[groups] == 0) & ~zero]).numel()
        ctx.log(receiver, "xgrpo/frac_pooled_zero_std", float(zero.double().mean()))
        ctx.log(receiver, "xgrpo/groups_with_signal_from_peers", rescued)
        return batch_of(sequences_from_samples(own, adv, zero, ctx.grpo))

    def _rank(self, ctx, pids, rewards):
        """Ranks of own rewards within the union of all policies' rewards for each prompt."""
        index = {p: i for i, p in enumerate(dict.fromkeys(pids))}
        # The exchange carries every producer's rollouts, the receiver's own included, so these
        # are exactly the union of all policies' rewards for the step's prompts.
        peer = [
            (d.record.prompt_id, d.record.reward)
            for d in ctx.peer_experience
            if d.kind == "rollout" and d.record.prompt_id in index
        ]
        values = torch.tensor([r for _, r in peer], dtype=torch.float64)
        groups = torch.tensor([index[p] for p, _ in peer])
        ranks = within_group_ranks(values, groups, len(index))
        m = group_moments(ranks, groups, len(index), ctx.grpo.advantage_std)
        # each own reward takes the rank its value has in the union (ties share a rank)
        own_rank = torch.stack(
            [ranks[(groups == index[p]) & (values == r)][0] for p, r in zip(pids, rewards.tolist())]
        )
        g = torch.tensor([index[p] for p in pids])
        return baseline_advantages(own_rank, m.mean[g], m.std[g], ctx.grpo), m.std[g]

    def after_update(self, ctx: StrategyContext, receiver: str) -> None:
        return None


@register_strategy(
    "xgrpo", XGRPOParams, "cross-policy advantages: baselines over all policies' rewards"
)
def _make_xgrpo(params: XGRPOParams, cfg) -> CrossPolicyAdvantages:
    return CrossPolicyAdvantages(params)
