"""Building blocks strategies share: advantages over own samples, GRPO sequences from samples."""

from __future__ import annotations

import torch

from mutualrl.config import GRPOConfig
from mutualrl.grpo import group_advantages
from mutualrl.policies.batch import TrainSequence
from mutualrl.policies.policy import Sample


def own_advantages(samples: list[Sample], grpo: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) advantages and (N,) zero-std flags over each prompt group of ``samples``."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    num_groups = int(groups.max()) + 1 if len(samples) else 0
    adv = group_advantages(rewards, groups, num_groups, scale=grpo.scale_rewards,
                           estimator=grpo.advantage_estimator)
    return adv.advantages, adv.zero_std


def sequences_from_samples(samples: list[Sample], advantages: torch.Tensor, zero_std: torch.Tensor,
                           grpo: GRPOConfig) -> list[TrainSequence]:
    """A policy's own samples as GRPO training sequences (zero-std groups dropped if configured)."""
    out = []
    for s, a, z in zip(samples, advantages.tolist(), zero_std.tolist()):
        if z and grpo.skip_zero_std_groups:
            continue
        out.append(TrainSequence(prompt_ids=s.prompt_ids, completion_ids=s.completion_ids,
                                 advantage=a, old_logprobs=s.logprobs,
                                 truncated=s.finish_reason == "length"))
    return out
