"""Building blocks strategies share: advantages over own samples, GRPO sequences from samples."""

from __future__ import annotations

import numpy as np
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


def peer_rollouts(ctx, receiver: str, prompt_ids: set[str] | None = None) -> list:
    """Deliveries of other producers' rollouts (live peers or replayed logs), optionally for some prompts."""
    return [d for d in ctx.peer_experience
            if d.kind == "rollout" and d.producer != receiver
            and (prompt_ids is None or d.record.prompt_id in prompt_ids)]


def adapt_to_receiver(ctx, receiver: str, deliveries: list) -> list[tuple[object, object]]:
    """Retokenize peer rollouts into the receiver's tokenizer through THL.

    Returns (delivery, RetokenizedTrajectory) pairs in input order and logs the THL residuals of
    what was moved under ``thl/<residual>``. Rollouts from a tokenizer this run does not know
    (a replayed log of other tokenizers) are re-encoded from their text alone.
    """
    from mutualrl.retokenize import aggregate_residuals

    if not deliveries:
        return []
    rt = ctx.retokenizers[receiver]
    by_source: dict[str, list[int]] = {}
    for i, d in enumerate(deliveries):
        by_source.setdefault(d.record.tokenizer_id, []).append(i)
    out: list = [None] * len(deliveries)
    for fp, idx in by_source.items():
        recs = [deliveries[i].record for i in idx]
        source = ctx.tokenizers.get(fp)
        results = rt.retokenize_batch(
            [r.completion for r in recs], source=source,
            source_ids=[r.token_array for r in recs] if source else None,
            source_logprobs=[r.logprob_array for r in recs] if source else None,
            ends_with_eos=[r.finish_reason == "stop" for r in recs])
        for i, res in zip(idx, results):
            out[i] = (deliveries[i], res)
    for k, v in aggregate_residuals([res.residuals for _, res in out]).items():
        ctx.log(receiver, f"thl/{k}", v)
    if ctx.publish is not None:  # the residual record is an experience type of its own
        for _, res in out:
            ctx.publish(res.residuals, receiver)
    return out


def peer_logprob_totals(adapted: list) -> tuple[torch.Tensor, torch.Tensor]:
    """log p_peer of the text each receiver sees, and how many peer tokens it spans: (B,), (B,).

    When THL cut a completion, only the kept alignment groups count (whole groups are kept or
    dropped); a rollout without per-group sums (unknown tokenizer) counts whole.
    """
    totals, counts = [], []
    for d, res in adapted:
        if res.group_logprob_sums is not None:
            totals.append(float(np.sum(res.group_logprob_sums)))
            counts.append(int(np.sum(res.groups.source_sizes())))
        else:
            totals.append(float(np.sum(d.record.logprob_array, dtype=np.float64)))
            counts.append(len(d.record.token_array))
    return (torch.tensor(totals, dtype=torch.float64),
            torch.tensor(counts, dtype=torch.float64).clamp(min=1))


def select_peers(ctx, receiver: str, own, max_per_group: int | None) -> tuple[dict[str, int], list]:
    """(prompt id -> the receiver's group index, peer rollouts for those prompts), at most
    ``max_per_group`` per prompt (None: all). A prompt sampled twice in a step: its peers join
    the first group."""
    pid_group: dict[str, int] = {}
    for s in own:
        pid_group.setdefault(s.prompt.id, s.group)
    peers = peer_rollouts(ctx, receiver, set(pid_group))
    if max_per_group is not None:
        kept, count = [], {}
        for d in peers:
            pid = d.record.prompt_id
            if count.get(pid, 0) < max_per_group:
                kept.append(d)
                count[pid] = count.get(pid, 0) + 1
        peers = kept
    return pid_group, peers
