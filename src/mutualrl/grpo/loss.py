"""The GRPO objective: per-token clipped surrogate, k3 KL, and loss aggregation. Pure functions.

Shapes: B sequences, T completion positions, V vocabulary. ``mask`` (B, T) is 1 on completion
tokens that count (not padding; optionally not truncated completions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mutualrl.grpo.normalise import scaled_sum


def selective_log_softmax(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per position: (B, T, V), (B, T) -> (B, T), without keeping a (B,T,V) log-softmax.

    For log-probs that are not differentiated (behaviour, reference, off-policy ratios)."""
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_logprobs(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """log p(target) per position, and the whole log-softmax: (B,T,V), (B,T) -> (B,T), (B,T,V).

    For a loss that is back-propagated. One fused log-softmax serves the picked log-probs, their
    gradient (its backward is one fused kernel as well) and the entropy. ``selective_log_softmax``
    keeps no (B,T,V) result, but with a 129k vocabulary on CPU its backward (through logsumexp)
    made a GRPO step about 1.7x slower.
    """
    logp_all = torch.log_softmax(logits, dim=-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), logp_all


def entropy_from_logprobs(logp_all: Tensor) -> Tensor:
    """Entropy per position from a log-softmax: (B, T, V) -> (B, T)."""
    return -torch.einsum("btv,btv->bt", logp_all.exp(), logp_all)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy per position: (B, T, V) -> (B, T)."""
    return entropy_from_logprobs(torch.log_softmax(logits, dim=-1))


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token, unbiased and >= 0: (B,T),(B,T)->(B,T)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def aggregate(per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int,
              skipped_rows: int = 0, skipped_tokens: int = 0) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    grpo:    mean over each sequence's tokens, then mean over sequences (the original GRPO; longer
             sequences get smaller per-token weight).
    dr_grpo: sum over all tokens / (B * max_completion_length): a constant normaliser, no length bias.
    dapo:    mean over all tokens in the batch (token-level, DAPO).

    ``skipped_rows`` / ``skipped_tokens``: rows left out of the batch because their per-token
    loss is exactly 0 (see ``TrainBatch.skipped_rows``); they still count in the normaliser, so
    the result equals that of the full batch.
    """
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        # mean() when nothing was skipped keeps results bit-identical to the unskipped path
        return per_seq.sum() / (per_seq.shape[0] + skipped_rows) if skipped_rows else per_seq.mean()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / ((per_token.shape[0] + skipped_rows) * max_completion_length)
    if loss_type == "dapo":
        return (per_token * mask).sum() / (mask.sum() + skipped_tokens).clamp(min=1)
    raise ValueError(f"loss_type must be 'grpo', 'dr_grpo' or 'dapo', got {loss_type!r}")


def importance_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """Importance ratio per position: (B, T), (B, T), (B, T) -> (B, T).

    token:    exp(logp_t - old_t), one ratio per token (GRPO, PPO).
    sequence: exp(mean over the sequence's masked tokens of (logp_t - old_t)) for every token of
              the sequence (GSPO): the length-normalised sequence likelihood ratio, so clipping
              keeps or drops whole sequences. A fully masked row gets ratio 1.
    """
    log_ratio = logp - old_logp
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        m = mask.to(logp.dtype)
        seq = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
        return torch.exp(seq).expand_as(logp)
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")


@dataclass(frozen=True)
class LossOutput:
    loss: Tensor                # scalar
    clip_low_frac: Tensor       # scalar: share of masked tokens clipped at 1 - epsilon (A < 0)
    clip_high_frac: Tensor      # scalar: share clipped at 1 + epsilon_high (A > 0)
    kl: Tensor                  # scalar: mean k3 KL over masked tokens (0 when no reference)


def clipped_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                      epsilon: float, epsilon_high: float | None, loss_type: str,
                      max_completion_length: int, ref_logp: Tensor | None = None, beta: float = 0.0,
                      sample_weight: Tensor | None = None, row_scale: Tensor | None = None,
                      importance_sampling_level: str = "token", skipped_rows: int = 0,
                      skipped_tokens: int = 0) -> LossOutput:
    """GRPO/PPO clipped objective.

    logp, old_logp, mask: (B, T); advantages: (B,); ref_logp: (B, T) or None;
    sample_weight: (B,) detached per-sequence weights (e.g. a truncated off-policy ratio for
    pooled peer samples), multiplying each sequence's per-token loss, or (B, T) per-token weights
    (the sampler/trainer mismatch correction); None means 1.
    importance_sampling_level: "token" (GRPO) or "sequence" (GSPO, as TRL names it).
    row_scale: (B,) the whole batch's normaliser per row (``normalise.row_scales``) when these
    rows are a micro-batch of it: the loss is then this micro-batch's share of the batch loss
    instead of ``aggregate`` over these rows alone. The statistics stay over these rows.
    skipped_rows, skipped_tokens: zero-loss rows left out, counted in the normaliser (``aggregate``;
    with ``row_scale`` they are already in it).
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = importance_ratio(logp, old_logp, mask, importance_sampling_level)   # (B, T)
    adv = advantages.unsqueeze(-1)                                       # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
    per_token = -torch.min(unclipped, clipped)                           # (B, T)
    kl = torch.zeros_like(logp)
    if ref_logp is not None and beta > 0:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + beta * kl
    if sample_weight is not None:
        w = sample_weight.detach()
        per_token = per_token * (w.unsqueeze(-1) if w.dim() == 1 else w)
    if row_scale is None:
        loss = aggregate(per_token, mask, loss_type, max_completion_length, skipped_rows,
                         skipped_tokens)
    else:
        loss = scaled_sum(per_token, mask, row_scale)
    m = mask.to(logp.dtype)
    n = m.sum().clamp(min=1)
    with torch.no_grad():
        low = ((ratio < 1 - epsilon) & (adv < 0)).to(logp.dtype)
        high = ((ratio > 1 + eps_high) & (adv > 0)).to(logp.dtype)
        return LossOutput(loss=loss, clip_low_frac=(low * m).sum() / n,
                          clip_high_frac=(high * m).sum() / n, kl=(kl.detach() * m).sum() / n)


def completion_mask(completion_ids: Tensor, lengths: Tensor, truncated: Tensor | None = None,
                    mask_truncated: bool = False) -> Tensor:
    """(B, T) mask of real completion tokens; rows of truncated completions zeroed if asked.

    completion_ids: (B, T); lengths: (B,) tokens generated incl. EOS; truncated: (B,) bool.
    """
    positions = torch.arange(completion_ids.shape[1]).unsqueeze(0)       # (1, T)
    mask = positions < lengths.unsqueeze(-1)                             # (B, T)
    if mask_truncated and truncated is not None:
        mask = mask & ~truncated.unsqueeze(-1)
    return mask
