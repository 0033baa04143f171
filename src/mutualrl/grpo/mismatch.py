"""Sampler/trainer mismatch: truncated (or masked) importance weights. Pure functions.

An inexact sampler (vLLM: other kernels, other precision) gives behaviour log-probs that differ
from the trainer's. The GRPO ratio is taken against the trainer's own recomputed log-probs, and
the policy term of the loss is weighted by ``rho = pi_trainer / pi_sampler`` so the gradient
stays that of the trainer's policy (TRL's ``vllm_importance_sampling_*``). Shapes: B sequences,
T completion positions; ``mask`` (B, T) marks the tokens that carry behaviour log-probs.

``truncated_ratio`` is the same correction for whole sequences another policy sampled (a peer's
rollout trained on by a receiver: ``prp``, ``codistill``), capped above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import Tensor


def _token_log_ratio(delta: Tensor, m: Tensor) -> Tensor:
    return delta


def _sequence_mean(delta: Tensor, m: Tensor) -> Tensor:
    # the length-normalised sequence ratio: long completions are not crushed towards 0 or inf
    return (delta.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(delta)


def _sequence_sum(delta: Tensor, m: Tensor) -> Tensor:
    # TRL's: the ratio of the whole sequences' likelihoods
    return delta.sum(-1, keepdim=True).expand_as(delta)


def _truncate(rho: Tensor, low: float, high: float) -> Tensor:
    return rho.clamp(min=low, max=high)


def _mask(rho: Tensor, low: float, high: float) -> Tensor:
    return rho.masked_fill((rho < low) | (rho > high), 0.0)


# vllm_importance_sampling_mode -> (level, what a ratio outside [clip_min, clip_max] becomes)
MODES: Mapping[str, tuple[str, Callable[[Tensor, float, float], Tensor]]] = MappingProxyType(
    {
        "token_truncate": ("token", _truncate),
        "token_mask": ("token", _mask),
        "sequence_truncate": ("sequence", _truncate),
        "sequence_mask": ("sequence", _mask),
    }
)

# vllm_importance_sampling_sequence_ratio -> how a sequence_* mode combines its token log-ratios
SEQUENCE_LOG_RATIOS: Mapping[str, Callable[[Tensor, Tensor], Tensor]] = MappingProxyType(
    {"mean": _sequence_mean, "sum": _sequence_sum}
)


def importance_weights(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    mode: str,
    clip_max: float | None,
    clip_min: float | None = None,
    *,
    sequence_ratio: str = "mean",
) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights (B, T) and the mismatch statistics.

    token_*:    rho_t = exp(trainer_t - sampler_t) per token.
    sequence_*: rho = exp(mean_t (trainer_t - sampler_t)) over the row's masked tokens
                (``sequence_ratio="mean"``), or exp of their sum (``"sum"``, TRL's), on every token.
    *_truncate: clamp(rho, clip_min, clip_max);  *_mask: rho inside [clip_min, clip_max], else 0.
    A bound of None is no bound. Unmasked positions (padding, rows without behaviour log-probs)
    get weight 1.
    """
    if mode not in MODES:
        raise ValueError(
            f"vllm_importance_sampling_mode must be one of {tuple(MODES)}, got {mode!r}"
        )
    if sequence_ratio not in SEQUENCE_LOG_RATIOS:
        raise ValueError(
            f"vllm_importance_sampling_sequence_ratio must be one of "
            f"{tuple(SEQUENCE_LOG_RATIOS)}, got {sequence_ratio!r}"
        )
    level, outside = MODES[mode]
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    m = mask.to(trainer_logp.dtype)  # (B, T)
    delta = (trainer_logp - sampler_logp).nan_to_num(0.0) * m  # (B, T) log-ratios
    combine = _token_log_ratio if level == "token" else SEQUENCE_LOG_RATIOS[sequence_ratio]
    rho = torch.exp(combine(delta, m))  # (B, T)
    weights = torch.where(m > 0, outside(rho, low, high), torch.ones_like(rho))
    return weights, mismatch_stats(delta, rho, weights, m, low, high)


def mismatch_stats(
    delta: Tensor, rho: Tensor, weights: Tensor, m: Tensor, low: float, high: float
) -> dict[str, float]:
    """Mean/max |delta log p| over masked tokens, the ratio's min/mean/max, the share outside
    [low, high] (truncated or masked) and the mean weight."""
    sel = m > 0
    if not bool(sel.any()):
        return {}
    d, r = delta[sel].abs(), rho[sel]
    return {
        "mismatch/logp_abs_diff_mean": float(d.mean()),
        "mismatch/logp_abs_diff_max": float(d.max()),
        "mismatch/is_ratio_min": float(r.min()),
        "mismatch/is_ratio_mean": float(r.mean()),
        "mismatch/is_ratio_max": float(r.max()),
        "mismatch/is_capped_frac": float(((r > high) | (r < low)).float().mean()),
        "mismatch/is_weight_mean": float(weights[sel].mean()),
    }


def truncated_ratio(logp_receiver: Tensor, logp_peer: Tensor, cap: float) -> Tensor:
    """Sequence-level importance weights (B,), (B,) -> (B,): min(exp(recv - peer), cap)."""
    return torch.exp(logp_receiver - logp_peer).clamp(max=cap)
