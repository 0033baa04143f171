"""The GRPO objective: per-token clipped surrogate and k3 KL. Pure functions.

Per token, with ratio ``r`` (token or sequence level), sampler weight ``rho`` (the mismatch
correction), sample weight ``w`` (per-sequence off-policy weights, ours) and k3 estimate ``k``:

    loss_t = w * ( -min(r A, clip(r) A) * rho  +  beta * k * (r if use_bias_correction_kl else 1) )

as TRL's ``GRPOTrainer._compute_loss`` computes it, where ``w`` = 1 (TRL has no pooled samples).

Its reduction to a scalar (one normaliser per ``loss_type``, whole batch or micro-batch share)
is ``normalise``'s.

Shapes: B sequences, T completion positions, V vocabulary. ``mask`` (B, T) is 1 on completion
tokens that count (not padding; optionally not truncated completions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mutualrl.grpo.normalise import WHOLE_BATCH, LossShare, loss_normaliser


def selective_log_softmax(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per position: (B, T, V), (B, T) -> (B, T), without keeping a (B,T,V)
    log-softmax.

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


# Values per pass of the entropy (1 MB of fp32): 8 positions of a 32k vocabulary, 2 of a
# 129k one. A buffer this size the allocator reuses from pass to pass and the cache holds, where
# one (B, T, V) ``exp`` is a fresh 131 MB mapping, page-faulted on every step (4x slower on the
# default workload).
ENTROPY_VALUES = 1 << 18


def _entropy_rows(vocab: int) -> int:
    return max(1, ENTROPY_VALUES // vocab)


@torch.no_grad()
def entropy_from_logprobs(logp_all: Tensor, rows: int | None = None) -> Tensor:
    """Entropy per position from a log-softmax: (..., V) -> (...), ``rows`` positions at a time
    (default: about ``ENTROPY_VALUES`` values). A statistic: no gradient flows through it."""
    flat = logp_all.reshape(-1, logp_all.shape[-1])
    rows = rows or _entropy_rows(flat.shape[1])
    out = torch.empty(flat.shape[0], dtype=flat.dtype, device=flat.device)
    for lo in range(0, flat.shape[0], rows):
        part = flat[lo : lo + rows]
        out[lo : lo + rows] = part.exp().mul_(part).sum(-1).neg_()
    return out.view(logp_all.shape[:-1])


@torch.no_grad()
def sampled_entropy(logp_all: Tensor, mask: Tensor, size: int | None) -> Tensor:
    """Entropy at ``size`` of the ``mask``ed positions, evenly spaced over them in row-major
    order (all of them when ``size`` is None or not smaller): (B, T, V), (B, T) -> (B, T), NaN
    where not computed. Their mean estimates the mean over every masked position at a fraction
    of the cost of a pass over the whole (B, T, V) log-softmax."""
    V = logp_all.shape[-1]
    where = mask.reshape(-1).nonzero().squeeze(1)
    if size is not None and where.numel() > size:
        where = where[
            torch.linspace(0, where.numel() - 1, size, device=where.device).round().long()
        ]
    out = torch.full((mask.numel(),), float("nan"), dtype=logp_all.dtype, device=logp_all.device)
    flat, rows = logp_all.reshape(-1, V), _entropy_rows(V)
    for lo in range(0, where.numel(), rows):
        part = flat.index_select(0, where[lo : lo + rows].to(flat.device))
        out[where[lo : lo + rows]] = part.exp().mul_(part).sum(-1).neg_()
    return out.view(mask.shape)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy per position: (B, T, V) -> (B, T)."""
    return entropy_from_logprobs(torch.log_softmax(logits, dim=-1))


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token, unbiased and >= 0: (B,T),(B,T)->(B,T)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


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
    loss: Tensor  # scalar
    clip_low_frac: Tensor  # scalar: share of masked tokens clipped at 1 - epsilon (A < 0)
    clip_high_frac: Tensor  # scalar: share clipped at 1 + epsilon_high (A > 0)
    kl: Tensor  # scalar: mean k3 estimate over masked tokens (0 when no reference)


@dataclass(frozen=True)
class SurrogateSettings:
    """The clipped objective's settings, constant for a run.

    The caller builds it from its own configuration (``grpo/`` takes numbers and names, never a
    config object). The loss_type is checked here, so a bad one fails before any forward pass.
    """

    epsilon: float  # ratio clipped below at 1 - epsilon
    epsilon_high: float | None  # ... and above at 1 + epsilon_high; None: epsilon
    loss_type: str  # a key of ``normalise.NORMALISERS``
    max_completion_length: int  # dr_grpo's constant normaliser
    beta: float = 0.0  # k3 KL coefficient; 0: no KL term
    importance_sampling_level: str = "token"  # "token" (GRPO) or "sequence" (GSPO, TRL's name)
    # The KL term times the (differentiable) importance ratio, TRL's default: the unbiased
    # reverse-KL gradient (DeepSeek-V3.2); it changes the gradient even where the ratio is 1.
    use_bias_correction_kl: bool = True

    def __post_init__(self) -> None:
        loss_normaliser(self.loss_type)

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: SurrogateSettings,
    *,
    ref_logp: Tensor | None = None,
    sample_weight: Tensor | None = None,
    sampler_weight: Tensor | None = None,
    share: LossShare = WHOLE_BATCH,
) -> LossOutput:
    """GRPO/PPO clipped objective (the formula in the module docstring).

    logp, old_logp, mask: (B, T); advantages: (B,); ref_logp: (B, T) or None (no KL term);
    sample_weight: (B,) detached per-sequence weights (e.g. a truncated off-policy ratio for
    pooled peer samples) or (B, T) per-token ones; they multiply the whole per-token loss, the
    KL term included: they re-weight a sample for every term estimated on it, so a row of
    weight 0 contributes exactly 0 (PRP leaves such rows out). None means 1.
    sampler_weight: (B, T) or (B, 1) detached sampler/trainer mismatch weights
    (``mismatch.importance_weights``); they multiply the policy term only, as TRL's
    ``importance_sampling_ratio``. None: no correction.
    share: where these rows sit in the batch's normaliser (``normalise.LossShare``): by default
    they are the whole batch; with a ``row_scale`` they are a micro-batch of it and the loss is
    their share of the batch loss. The statistics stay over these rows.
    """
    epsilon, eps_high = settings.epsilon, settings.clip_high
    ratio = importance_ratio(logp, old_logp, mask, settings.importance_sampling_level)  # (B, T)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
    per_token = -torch.min(unclipped, clipped)  # (B, T)
    if sampler_weight is not None:
        per_token = per_token * sampler_weight.detach()
    kl = torch.zeros_like(logp)
    if ref_logp is not None and settings.beta > 0:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + settings.beta * (
            kl * ratio if settings.use_bias_correction_kl else kl
        )
    if sample_weight is not None:
        w = sample_weight.detach()
        per_token = per_token * (w.unsqueeze(-1) if w.dim() == 1 else w)
    loss = share.loss(per_token, mask, settings.loss_type, settings.max_completion_length)
    m = mask.to(logp.dtype)
    n = m.sum().clamp(min=1)
    with torch.no_grad():
        low = ((ratio < 1 - epsilon) & (adv < 0)).to(logp.dtype)
        high = ((ratio > 1 + eps_high) & (adv > 0)).to(logp.dtype)
        return LossOutput(
            loss=loss,
            clip_low_frac=(low * m).sum() / n,
            clip_high_frac=(high * m).sum() / n,
            kl=(kl.detach() * m).sum() / n,
        )


def completion_mask(
    completion_ids: Tensor,
    lengths: Tensor,
    truncated: Tensor | None = None,
    mask_truncated: bool = False,
) -> Tensor:
    """(B, T) mask of real completion tokens; rows of truncated completions zeroed if asked.

    completion_ids: (B, T); lengths: (B,) tokens generated incl. EOS; truncated: (B,) bool.
    """
    positions = torch.arange(completion_ids.shape[1], device=lengths.device).unsqueeze(0)  # (1, T)
    mask = positions < lengths.unsqueeze(-1)  # (B, T)
    if mask_truncated and truncated is not None:
        mask = mask & ~truncated.unsqueeze(-1)
    return mask
