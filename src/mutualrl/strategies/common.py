"""The strategy kit: building blocks every strategy shares, each written once.

* advantages: ``grpo_advantages``, the run's GRPO settings applied to any group, and
  ``baseline_advantages``, the same scaling against baselines a strategy computes itself (pooled
  over policies, capability-weighted): every strategy's advantages go through one of the two;
* own experience:  ``own_advantages``, ``sequences_from_samples``, ``own_sequences``;
* which rows train: ``kept_rows``, the one place ``grpo.skip_zero_std_groups`` is applied;
* peer experience: ``peer_rollouts``, ``select_peers``, ``adapt_to_receiver`` (THL) and
  ``receive_peers`` (the receiver's view of them: ``ReceivedPeers``), ``peer_logprob_totals``;
* the mixed own-plus-peer group: ``mixed_group`` -> ``MixedGroup``;
* ``batch_of``: one GRPO update, or none when nothing trains.

Strategy-specific math (advantages over a mixed group, importance weights) stays in the
strategies; the kit moves, encodes and assembles.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mutualrl.config import GRPOConfig
from mutualrl.exchange import Delivery
from mutualrl.grpo import Advantages, group_advantages, normalize
from mutualrl.policies.batch import SFTExample, TrainBatch, TrainSequence
from mutualrl.policies.policy import Sample
from mutualrl.retokenize import RetokenizedTrajectory


# ---- own experience -----------------------------------------------------------------------------
def group_count(samples: list[Sample]) -> int:
    """K: the number of prompt groups of a receiver's samples (group indices are 0..K-1)."""
    return max((s.group for s in samples), default=-1) + 1


def grpo_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, num_groups: int, grpo: GRPOConfig
) -> Advantages:
    """Advantages of rewards (N,) in groups (N,) under the run's ``scale_rewards``,
    ``advantage_estimator`` and ``advantage_std``."""
    return group_advantages(
        rewards,
        groups,
        num_groups,
        scale=grpo.scale_rewards,
        estimator=grpo.advantage_estimator,
        advantage_std=grpo.advantage_std,
    )


def baseline_advantages(
    values: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, grpo: GRPOConfig
) -> torch.Tensor:
    """Advantages of values (N,) against baselines given per sample: mean (N,), and the std (N,)
    a ``group`` scaling divides by; the run's ``scale_rewards`` and ``advantage_std``, as
    ``grpo_advantages`` applies them to a policy's own groups."""
    return normalize(values, mean, std, grpo.scale_rewards, grpo.advantage_std)


def own_advantages(samples: list[Sample], grpo: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) advantages and (N,) zero-std flags over each prompt group of ``samples``."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    adv = grpo_advantages(rewards, groups, group_count(samples), grpo)
    return adv.advantages, adv.zero_std


def kept_rows(zero_std: torch.Tensor, grpo: GRPOConfig) -> list[bool]:
    """(N,) zero-std flags -> whether each row trains.

    The one place ``grpo.skip_zero_std_groups`` is applied: a group of equal rewards has
    advantage 0 on every row, so under the flag its rows are dropped (no forward or backward);
    without it they stay (they count in the normaliser and carry the KL term when beta > 0).
    """
    skip = grpo.skip_zero_std_groups
    return [not (z and skip) for z in zero_std.tolist()]


def sequences_from_samples(
    samples: list[Sample], advantages: torch.Tensor, zero_std: torch.Tensor, grpo: GRPOConfig
) -> list[TrainSequence]:
    """A policy's own samples (N) with (N,) advantages and zero-std flags as GRPO sequences:
    its own behaviour log-probs, weight 1; rows of zero-std groups as ``kept_rows`` decides."""
    return [
        TrainSequence(
            prompt_ids=s.prompt_ids,
            completion_ids=s.completion_ids,
            advantage=a,
            old_logprobs=s.logprobs,
            truncated=s.finish_reason == "length",
            behaviour_version=s.policy_version,
        )
        for s, a, keep in zip(samples, advantages.tolist(), kept_rows(zero_std, grpo))
        if keep
    ]


def own_sequences(samples: list[Sample], grpo: GRPOConfig) -> list[TrainSequence]:
    """Plain GRPO on a policy's own samples: advantages over its own groups, as sequences."""
    if not samples:  # nothing to train; and the rank estimator needs at least one value
        return []
    return sequences_from_samples(samples, *own_advantages(samples, grpo), grpo)


def batch_of(sequences: list[TrainSequence], **fields) -> list[TrainBatch]:
    """One update on ``sequences`` (``fields``: further ``TrainBatch`` fields); none if empty."""
    return [TrainBatch(sequences=tuple(sequences), **fields)] if sequences else []


# ---- peer experience ----------------------------------------------------------------------------
def peer_rollouts(ctx, receiver: str, prompt_ids: set[str] | None = None) -> list:
    """Deliveries of other producers' rollouts (live peers or replayed logs), optionally for some
    prompts."""
    return [
        d
        for d in ctx.peer_experience
        if d.kind == "rollout"
        and d.producer != receiver
        and (prompt_ids is None or d.record.prompt_id in prompt_ids)
    ]


def select_peers(ctx, receiver: str, own, max_per_group: int | None) -> tuple[dict[str, int], list]:
    """(prompt id -> the receiver's group index, peer rollouts for those prompts), at most
    ``max_per_group`` per prompt (None: all). A prompt sampled twice in a step: its peers join
    the first group."""
    pid_group: dict[str, int] = {}
    for s in own:
        pid_group.setdefault(s.prompt.id, s.group)
    peers = peer_rollouts(ctx, receiver, set(pid_group))
    if max_per_group is not None:
        kept, count = [], dict[str, int]()
        for d in peers:
            pid = d.record.prompt_id
            if count.get(pid, 0) < max_per_group:
                kept.append(d)
                count[pid] = count.get(pid, 0) + 1
        peers = kept
    return pid_group, peers


def adapt_to_receiver(
    ctx, receiver: str, deliveries: list
) -> list[tuple[Delivery, RetokenizedTrajectory]]:
    """Retokenize peer rollouts into the receiver's tokenizer through THL.

    Returns (delivery, RetokenizedTrajectory) pairs in input order and logs the THL residuals of
    what was moved under ``thl/<residual>``. Rollouts from a tokenizer this run does not know
    (a replayed log of other tokenizers) are re-encoded from their text alone.
    """
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
            [r.completion for r in recs],
            source=source,
            source_ids=[r.token_array for r in recs] if source else None,
            source_logprobs=[r.logprob_array for r in recs] if source else None,
            ends_with_eos=[r.finish_reason == "stop" for r in recs],
        )
        for i, res in zip(idx, results):
            out[i] = (deliveries[i], res)
    log_residuals(ctx, receiver, [res.residuals for _, res in out])
    return out


def log_residuals(ctx, receiver: str, residuals: list, prefix: str = "thl/") -> None:
    """Log ``prefix<residual>`` over every trajectory moved for ``receiver`` under that prefix
    this step, these included (a strategy may move several batches a step: SGT's SFT-only
    steps), and publish each residual record (an experience type of its own)."""
    from mutualrl.retokenize import aggregate_residuals

    moved = ctx.moved.setdefault((receiver, prefix), [])
    moved.extend(residuals)
    for k, v in aggregate_residuals(moved).items():
        ctx.log(receiver, f"{prefix}{k}", v)
    if ctx.publish is not None:
        for r in residuals:
            ctx.publish(r, receiver)


def peer_logprob_totals(adapted: list) -> tuple[torch.Tensor, torch.Tensor]:
    """log p_peer of the text each receiver sees, and how many peer tokens it spans: (B,), (B,)
    fp64.

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
    return (
        torch.tensor(totals, dtype=torch.float64),
        torch.tensor(counts, dtype=torch.float64).clamp(min=1),
    )


@dataclass(frozen=True)
class ReceivedPeers:
    """P peer rollouts as the receiver sees them: moved into its tokens through THL and put
    under its own prompt format. Lists are parallel, in delivery order."""

    adapted: list  # P (delivery, RetokenizedTrajectory) pairs
    prompts: list[tuple[int, ...]]  # P prompts in the receiver's format and tokens
    completions: list[tuple[int, ...]]  # P completions in the receiver's tokens

    def __len__(self) -> int:
        return len(self.adapted)

    @property
    def sources(self) -> list[str]:
        """P producing policies."""
        return [d.producer for d, _ in self.adapted]

    def logprob_totals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(P,) log p_peer of the moved text and (P,) peer tokens it spans
        (``peer_logprob_totals``)."""
        return peer_logprob_totals(self.adapted)

    def sequences(
        self,
        advantages: torch.Tensor,
        weights: torch.Tensor,
        zero_std: torch.Tensor,
        grpo: GRPOConfig,
        select: torch.Tensor | None = None,
    ) -> list[TrainSequence]:
        """(P,) advantages, (P,) detached loss weights, (P,) zero-std flags -> GRPO sequences.

        No behaviour log-probs: the receiver's current ones stand in (ratio 1 on the first
        pass) and the off-policy correction travels in the weight. ``select`` (P,) bool picks
        rows (None: all); zero-std rows as ``kept_rows`` decides.
        """
        picked = [True] * len(self) if select is None else select.tolist()
        return [
            TrainSequence(
                p,
                c,
                float(a),
                None,
                weight=float(w),
                source=d.producer,
                truncated=d.record.finish_reason == "length",
            )
            for (d, _), p, c, a, w, keep, pick in zip(
                self.adapted,
                self.prompts,
                self.completions,
                advantages.tolist(),
                weights.tolist(),
                kept_rows(zero_std, grpo),
                picked,
            )
            if keep and pick
        ]

    def sft_examples(self) -> tuple[SFTExample, ...]:
        """The moved rollouts as SFT examples (imitation of the peers' text)."""
        return tuple(
            SFTExample(p, c, d.producer)
            for (d, _), p, c in zip(self.adapted, self.prompts, self.completions)
        )


def receive_peers(ctx, receiver: str, deliveries: list) -> ReceivedPeers:
    """Peer rollout deliveries moved into the receiver (THL, ``adapt_to_receiver``) and encoded
    with its prompt format."""
    adapted = adapt_to_receiver(ctx, receiver, deliveries)
    return ReceivedPeers(
        adapted=adapted,
        prompts=[ctx.encode_prompt[receiver](d.record.prompt) for d, _ in adapted],
        completions=[tuple(int(t) for t in res.target_ids) for _, res in adapted],
    )


# ---- the mixed own-plus-peer group --------------------------------------------------------------
@dataclass(frozen=True)
class MixedGroup:
    """A receiver's own samples and the peers' rollouts of the same prompts, as one set of
    prompt groups: N = n own rows first, then P peer rows, each in the receiver's group of its
    prompt. Advantages over it are the strategy's to compute (over ``rewards``, ``groups``)."""

    own: list[Sample]  # n
    peers: ReceivedPeers  # P
    rewards: torch.Tensor  # (N,) fp32 verified rewards, own then peers
    groups: torch.Tensor  # (N,) int64 group index in [0, K)
    num_groups: int  # K: the receiver's own groups (peers join them)

    @property
    def n_own(self) -> int:
        return len(self.own)

    def own_sequences(
        self, advantages: torch.Tensor, zero_std: torch.Tensor, grpo: GRPOConfig
    ) -> list[TrainSequence]:
        """(N,) advantages and zero-std flags -> the own rows' GRPO sequences."""
        n = self.n_own
        return sequences_from_samples(self.own, advantages[:n], zero_std[:n], grpo)

    def peer_sequences(
        self,
        advantages: torch.Tensor,
        zero_std: torch.Tensor,
        weights: torch.Tensor,
        grpo: GRPOConfig,
        select: torch.Tensor | None = None,
    ) -> list[TrainSequence]:
        """(N,) advantages and zero-std flags, (P,) weights -> the peer rows' GRPO sequences
        (``ReceivedPeers.sequences``; ``select`` (P,) bool picks rows)."""
        n = self.n_own
        return self.peers.sequences(advantages[n:], weights, zero_std[n:], grpo, select)


def mixed_group(ctx, receiver: str, own: list[Sample], max_per_group: int | None) -> MixedGroup:
    """The receiver's own samples plus the peers' rollouts of its prompts (at most
    ``max_per_group`` per prompt, None: all), moved into its tokens: one ``MixedGroup``."""
    pid_group, deliveries = select_peers(ctx, receiver, own, max_per_group)
    peers = receive_peers(ctx, receiver, deliveries)
    rewards = torch.tensor(
        [s.reward for s in own] + [d.record.reward for d, _ in peers.adapted], dtype=torch.float32
    )
    groups = torch.tensor(
        [s.group for s in own] + [pid_group[d.record.prompt_id] for d, _ in peers.adapted],
        dtype=torch.long,
    )
    return MixedGroup(
        own=list(own), peers=peers, rewards=rewards, groups=groups, num_groups=group_count(own)
    )
