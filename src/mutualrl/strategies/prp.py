"""``prp`` — Peer Rollout Pooling (data level).

Peers' rollouts for the same prompt are retokenized into the receiver's tokenizer (THL) and join
its group as extra trajectories; advantages are computed over the mixed group. The behaviour
policy of a pooled sample is the peer, so its ratio is off-policy:

* ``truncated_is``: sequence-level ``w = min(exp(log p_recv(text) - log p_peer(text)), ratio_cap)``,
  detached, multiplying that sequence's loss. Sequence level because per-token ratios do not exist
  across tokenizations; the text's total log-prob is the one quantity both sides define.
* ``on_receiver``: ``w = 1`` (advantage-weighted imitation of the peer's text).

Peer rows whose loss is exactly 0 (weight 0 after truncation, or advantage 0 without KL) skip the
update's forward and backward but keep their place in the normaliser (``drop_inert_peers``).

Inside the clipped objective a pooled sample's token ratio is taken against the receiver's own
current log-probs (ratio 1 at the first iteration), so clipping acts only on later iterations.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np
import torch

from mutualrl.grpo import truncated_ratio
from mutualrl.policies.batch import TrainBatch, TrainSequence
from mutualrl.strategies.base import StrategyContext, register_strategy
from mutualrl.strategies.common import (
    ReceivedPeers,
    batch_of,
    grpo_advantages,
    mixed_group,
)


class PRPParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    peer_ratio: Literal["truncated_is", "on_receiver"] = (
        "truncated_is"  # peer weight: truncated ratio, or 1
    )
    ratio_cap: float = 2.0  # truncation of the sequence-level ratio
    max_peer_per_group: int | None = None  # None: every peer sample for the prompt
    grad_diagnostic: bool = False  # per-source gradient norms and cosine (2 extra backwards)

    def __post_init__(self) -> None:
        if self.ratio_cap <= 0:
            raise ValueError("ratio_cap must be > 0")
        if self.max_peer_per_group is not None and self.max_peer_per_group < 0:
            raise ValueError("max_peer_per_group must be >= 0")


def drop_inert_peers(
    seqs: list[TrainSequence], n_own: int, grpo
) -> tuple[list[TrainSequence], int, int]:
    """Peer rows (after the first ``n_own``) whose loss terms are exactly 0, left out of the update.

    A row's per-token loss is ``weight * (surrogate + beta * kl)``, so it is exactly 0 when the
    float32 weight is 0 (a truncated ratio that underflowed: log-ratio below about -103), or when
    the advantage is 0 and there is no KL term (beta == 0). Such rows cost a forward and backward
    and add nothing; they still count in the normaliser (returned: rows, and the completion tokens
    the mask would have counted), so loss and gradient are unchanged. At least one row is kept.
    Returns (kept sequences, skipped rows, skipped tokens).
    """

    def inert(s: TrainSequence) -> bool:
        return float(np.float32(s.weight)) == 0.0 or (s.advantage == 0.0 and grpo.beta == 0.0)

    kept = seqs[:n_own] + [s for s in seqs[n_own:] if not inert(s)]
    if not kept:
        return seqs, 0, 0
    dropped = [s for s in seqs[n_own:] if inert(s)]
    tokens = sum(
        0 if (s.truncated and grpo.mask_truncated_completions) else len(s.completion_ids)
        for s in dropped
    )
    return kept, len(dropped), tokens


class PeerRolloutPooling:
    name = "prp"

    def __init__(self, params: PRPParams) -> None:
        self.params = params

    def observe(self, ctx: StrategyContext, samples) -> None:
        return None

    def build_batches(self, ctx: StrategyContext, receiver: str, own) -> list[TrainBatch]:
        mixed = mixed_group(ctx, receiver, own, self.params.max_peer_per_group)
        weights = self._weights(ctx, receiver, mixed.peers)
        adv = grpo_advantages(mixed.rewards, mixed.groups, mixed.num_groups, ctx.grpo)
        seqs = mixed.own_sequences(adv.advantages, adv.zero_std, ctx.grpo)
        seqs += mixed.peer_sequences(adv.advantages, adv.zero_std, weights, ctx.grpo)
        n, peers = mixed.n_own, len(mixed.peers)
        kept, rows, tokens = drop_inert_peers(seqs, n, ctx.grpo)
        ctx.log(receiver, "prp/peer_share", peers / max(n + peers, 1))
        ctx.log(receiver, "prp/peer_samples", peers)
        ctx.log(receiver, "prp/skipped_rows", rows)
        ctx.log(
            receiver,
            "prp/frac_reward_zero_std_mixed",
            float(adv.zero_std[:n].float().mean()) if n else 0.0,
        )
        return batch_of(
            kept,
            diagnose_sources=self.params.grad_diagnostic,
            skipped_rows=rows,
            skipped_tokens=tokens,
        )

    def _weights(self, ctx, receiver, peers: ReceivedPeers) -> torch.Tensor:
        """(P,) fp32 loss weights of the peer rows."""
        if not len(peers):
            return torch.zeros(0)
        if self.params.peer_ratio == "on_receiver":
            return torch.ones(len(peers))
        recv = ctx.sequence_logprobs[receiver](peers.prompts, peers.completions).to(torch.float64)
        # log p_peer of the text the receiver actually sees. Rounded to fp32 on purpose: PRP's
        # weights have always been taken against fp32 peer totals (HACPO and CoDistill keep fp64);
        # dropping the rounding would move every PRP weight by about 1e-7 relative.
        peer = peers.logprob_totals()[0].to(torch.float32)
        w = truncated_ratio(recv, peer, self.params.ratio_cap)
        raw = torch.exp(recv - peer)
        ctx.log(receiver, "prp/density_ratio_var", float(w.var(unbiased=False)))
        ctx.log(receiver, "prp/density_ratio_mean", float(w.mean()))
        ctx.log(receiver, "prp/log_ratio_mean", float((recv - peer).mean()))
        ctx.log(
            receiver, "prp/truncated_frac", float((raw > self.params.ratio_cap).double().mean())
        )
        return w.to(torch.float32)

    def after_update(self, ctx: StrategyContext, receiver: str) -> None:
        return None


@register_strategy(
    "prp", PRPParams, "peer rollout pooling: retokenized peer samples join the group"
)
def _make_prp(params: PRPParams, cfg) -> PeerRolloutPooling:
    return PeerRolloutPooling(params)
