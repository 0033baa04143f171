"""``codistill`` — CoDistill-GRPO (outcome and data level).

After Kwon et al., "CoDistill-GRPO: A Co-Distillation Recipe for Efficient Group Relative Policy
Optimization" (arXiv 2605.08873). A large and a small model train at once and learn from each
other:

* the **smaller** policy ``S`` runs GRPO on a shaped reward: its verified reward plus an
  on-policy distillation reward from the larger policy ``L``,
  ``r'_i = r_i + kd_coef * kd_i``, where ``kd_i`` scores ``S``'s own completion ``y_i`` by
  ``L``'s likelihood of it, taken in ``L``'s tokenization (``y_i`` moved there through THL) and
  normalised by ``L``'s token count ``n_i``:
  ``kd_reward = "mean_prob"``: ``kd_i = exp(log p_L(y_i | x) / n_i)``, the geometric-mean token
  probability, in (0, 1] like the verifiers' rewards; ``"mean_logprob"``: ``log p_L(y_i|x) / n_i``.
* the **larger** policy trains on ``S``'s rollouts (moved into ``L``'s tokens through THL), each
  prompt's ``G`` samples one GRPO group on their verified rewards, with the sequence-level
  truncated importance weight ``w_i = min(exp(log p_L(y_i) - log p_S(y_i)), ratio_cap)``
  (sequence level because token ratios do not exist across tokenizations, as in ``prp``).
  ``larger_trains_on = "peer"`` (the source: ``L`` learns from ``S``'s rollouts instead of its
  own, which is where its rollout saving comes from) or ``"both"`` (its own groups as well).

Our choices where the source is silent or unavailable to us: "larger" is the policy with the
most parameters (exact counts on the meta device; ``larger`` names it explicitly), ties go to
the one listed first; with more than two policies the largest teaches every other one and
trains on all their rollouts. The KD normalisation (per-token mean, as a probability) and
``kd_coef = 0.5`` are ours. Our loop still samples ``L``'s own groups (they are evaluated and
published), so ``"peer"`` saves no generation time here, only update time.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

from mutualrl.config import ConfigError
from mutualrl.grpo import truncated_ratio
from mutualrl.policies.batch import TrainBatch, TrainSequence
from mutualrl.strategies.base import StrategyContext, register_strategy
from mutualrl.strategies.common import (
    batch_of,
    group_count,
    grpo_advantages,
    log_residuals,
    own_sequences,
    peer_rollouts,
    receive_peers,
    sequences_from_samples,
)


class CoDistillParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kd_coef: float = 0.5  # weight of the distillation reward
    kd_reward: Literal["mean_prob", "mean_logprob"] = (
        "mean_prob"  # per-token mean prob or log-prob under L
    )
    ratio_cap: float = 2.0  # truncation of the larger's IS weight
    larger_trains_on: Literal["peer", "both"] = (
        "peer"  # the larger learns from S's rollouts, or also its own
    )
    larger: str | None = None  # None: by parameter count

    def __post_init__(self) -> None:
        if self.kd_coef < 0:
            raise ValueError("kd_coef must be >= 0")
        if self.ratio_cap <= 0:
            raise ValueError("ratio_cap must be > 0")


def kd_rewards(total_logprob: torch.Tensor, lengths: torch.Tensor, kind: str) -> torch.Tensor:
    """Distillation rewards (B,), (B,) -> (B,): the larger's log p per its token, or its exp."""
    mean = total_logprob.to(torch.float64) / lengths.to(torch.float64).clamp(min=1)
    if kind == "mean_logprob":
        return mean
    if kind == "mean_prob":
        return torch.exp(mean)
    raise ValueError(f"kd_reward must be 'mean_prob' or 'mean_logprob', got {kind!r}")


class CoDistill:
    name = "codistill"

    def __init__(self, params: CoDistillParams, policies: list) -> None:
        self.params = params
        self.policy_cfgs = {p.name: p for p in policies}
        self.larger: str | None = params.larger
        self.parameter_counts: dict[str, int] = {}

    def _resolve(self, ctx: StrategyContext) -> str | None:
        """The larger policy, by parameter count (first listed on ties); None when alone."""
        if len(ctx.policy_names) < 2:
            return None
        if self.larger is None:
            from mutualrl.policies.models import count_parameters

            for n in ctx.policy_names:
                cfg, rt = self.policy_cfgs.get(n), ctx.retokenizers.get(n)
                if cfg is not None and rt is not None:
                    self.parameter_counts[n] = count_parameters(cfg, rt.target.vocab_size)
            order = [n for n in ctx.policy_names if n in self.parameter_counts]
            self.larger = max(order, key=lambda n: (self.parameter_counts[n], -order.index(n)))
        return self.larger if self.larger in ctx.policy_names else None

    def observe(self, ctx: StrategyContext, samples) -> None:
        return None

    def build_batches(self, ctx: StrategyContext, receiver: str, own) -> list[TrainBatch]:
        larger = self._resolve(ctx)
        if larger is None:
            seqs = own_sequences(own, ctx.grpo)
        elif receiver == larger:
            ctx.log(receiver, "codistill/is_larger", 1)
            seqs = self._larger_sequences(ctx, receiver, own)
        else:
            ctx.log(receiver, "codistill/is_larger", 0)
            seqs = self._smaller_sequences(ctx, receiver, larger, own)
        return batch_of(seqs)

    # ---- the smaller policy: GRPO on verified + distillation reward ----------------------
    def _smaller_sequences(self, ctx, receiver, larger, own) -> list[TrainSequence]:
        if not own:
            return []
        rt = ctx.retokenizers[larger]
        moved = rt.retokenize_batch(
            [s.text for s in own],
            source=ctx.retokenizers[receiver].target,
            source_ids=[list(s.completion_ids) for s in own],
            source_logprobs=[list(s.logprobs) for s in own],
            ends_with_eos=[s.finish_reason == "stop" for s in own],
        )
        # what moving the completions cost, which the distillation reward rests on
        log_residuals(ctx, receiver, [res.residuals for res in moved], prefix="codistill/thl/")
        completions = [tuple(int(t) for t in res.target_ids) for res in moved]
        prompts = [ctx.encode_prompt[larger](s.prompt.text) for s in own]
        total = ctx.sequence_logprobs[larger](prompts, completions).to(torch.float64)
        kd = kd_rewards(total, torch.tensor([len(c) for c in completions]), self.params.kd_reward)
        verified = torch.tensor([s.reward for s in own], dtype=torch.float64)
        shaped = (verified + self.params.kd_coef * kd).to(torch.float32)
        groups = torch.tensor([s.group for s in own])
        adv = grpo_advantages(shaped, groups, group_count(own), ctx.grpo)
        ctx.log(receiver, "codistill/kd_reward_mean", float(kd.mean()))
        ctx.log(receiver, "codistill/kd_reward_std", float(kd.std(unbiased=False)))
        ctx.log(receiver, "codistill/shaped_reward_mean", float(shaped.double().mean()))
        ctx.log(receiver, "codistill/frac_zero_std_shaped", float(adv.zero_std.double().mean()))
        return sequences_from_samples(own, adv.advantages, adv.zero_std, ctx.grpo)

    # ---- the larger policy: GRPO on the smaller ones' rollouts, importance reweighted -----
    def _larger_sequences(self, ctx, receiver, own) -> list[TrainSequence]:
        seqs: list[TrainSequence] = []
        if self.params.larger_trains_on == "both":
            seqs += own_sequences(own, ctx.grpo)
        peers = receive_peers(ctx, receiver, peer_rollouts(ctx, receiver))
        ctx.log(receiver, "codistill/peer_samples", len(peers))
        if not len(peers):
            return seqs
        recv = ctx.sequence_logprobs[receiver](peers.prompts, peers.completions).to(torch.float64)
        peer_total, _ = peers.logprob_totals()
        w = truncated_ratio(recv, peer_total, self.params.ratio_cap)
        # each (producer, prompt) is a group of its own: the smaller policy's G samples
        index: dict[tuple[str, str], int] = {}
        groups = torch.tensor(
            [
                index.setdefault((d.producer, d.record.prompt_id), len(index))
                for d, _ in peers.adapted
            ]
        )
        rewards = torch.tensor([d.record.reward for d, _ in peers.adapted], dtype=torch.float32)
        adv = grpo_advantages(rewards, groups, len(index), ctx.grpo)
        seqs += peers.sequences(adv.advantages, w, adv.zero_std, ctx.grpo)
        ctx.log(receiver, "codistill/is_weight_mean", float(w.mean()))
        ctx.log(receiver, "codistill/is_weight_var", float(w.var(unbiased=False)))
        ctx.log(
            receiver,
            "codistill/truncated_frac",
            float((torch.exp(recv - peer_total) > self.params.ratio_cap).double().mean()),
        )
        return seqs

    def after_update(self, ctx: StrategyContext, receiver: str) -> None:
        return None


@register_strategy(
    "codistill",
    CoDistillParams,
    "co-distillation: the smaller policy gets a KD reward, the larger trains on its rollouts",
)
def _make_codistill(params: CoDistillParams, cfg) -> CoDistill:
    policies = list(cfg.policies) if cfg is not None else []
    if params.larger is not None and policies and params.larger not in {p.name for p in policies}:
        raise ConfigError(
            f"strategies.codistill.larger: {params.larger!r} is not a policy of this run "
            f"({[p.name for p in policies]}) - at `$.strategies.codistill.larger`"
        )
    return CoDistill(params, policies)
