"""Sampler/trainer mismatch: truncated (or masked) importance weights. Pure functions.

An inexact sampler (vLLM: other kernels, other precision) gives behaviour log-probs that differ
from the trainer's. The GRPO ratio is taken against the trainer's own recomputed log-probs, and
the loss is weighted by ``rho = pi_trainer / pi_sampler`` so the gradient stays that of the
trainer's policy. Shapes: B sequences, T completion positions; ``mask`` (B, T) marks the tokens
that carry behaviour log-probs.
"""

from __future__ import annotations

import torch
from torch import Tensor

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, mode: str,
                       cap: float) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights (B, T) and the mismatch statistics.

    token_*:    rho_t = exp(trainer_t - sampler_t) per token.
    sequence_*: rho = exp(mean_t (trainer_t - sampler_t)) over the row's masked tokens (a mean of
                token log-ratios, not a sum, so long completions are not crushed), on every token.
    *_truncate: min(rho, cap);   *_mask: rho where rho <= cap, else 0.
    Unmasked positions (padding, rows without behaviour log-probs) get weight 1.
    """
    if mode not in MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {MODES}, got {mode!r}")
    m = mask.to(trainer_logp.dtype)                                      # (B, T)
    delta = (trainer_logp - sampler_logp).nan_to_num(0.0) * m            # (B, T) log-ratios
    if mode.startswith("sequence"):
        n = m.sum(-1, keepdim=True)                                      # (B, 1)
        log_rho = (delta.sum(-1, keepdim=True) / n.clamp(min=1)).expand_as(delta)
    else:
        log_rho = delta
    rho = torch.exp(log_rho)                                             # (B, T)
    weights = rho.clamp(max=cap) if mode.endswith("truncate") else rho * (rho <= cap)
    weights = torch.where(m > 0, weights, torch.ones_like(weights))
    return weights, mismatch_stats(delta, rho, weights, m, cap)


def mismatch_stats(delta: Tensor, rho: Tensor, weights: Tensor, m: Tensor, cap: float) -> dict[str, float]:
    """Mean/max |delta log p| over masked tokens, the ratio's min/mean/max and the capped share."""
    sel = m > 0
    if not bool(sel.any()):
        return {}
    d, r = delta[sel].abs(), rho[sel]
    return {"mismatch/logp_abs_diff_mean": float(d.mean()), "mismatch/logp_abs_diff_max": float(d.max()),
            "mismatch/is_ratio_min": float(r.min()), "mismatch/is_ratio_mean": float(r.mean()),
            "mismatch/is_ratio_max": float(r.max()),
            "mismatch/is_capped_frac": float((r > cap).float().mean()),
            "mismatch/is_weight_mean": float(weights[sel].mean())}
