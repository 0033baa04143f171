"""The trainer's side of the mismatch correction, called once per update by the update's objective
(``policies.update``).

For a backend whose behaviour log-probs are not the trainer's (``exact_logprobs`` False), the
trainer recomputes the log-probs of the sampled tokens before updating; they become the GRPO
ratio's denominator, and the importance weights ``pi_trainer / pi_sampler`` (grpo/mismatch.py)
become the batch's ``sampler_weights``: ``clipped_surrogate`` multiplies them into the policy
term only, as TRL's ``importance_sampling_ratio`` (the KL term and the per-sequence weights of
pooled samples are not corrected by them).
"""

from __future__ import annotations

import time

import torch

from mutualrl.grpo import completion_mask
from mutualrl.grpo.mismatch import importance_weights


def correct_mismatch(c, g, batch_logprobs) -> dict[str, float]:
    """Rewrite ``c.seq``'s old log-probs, set its sampler weights; the mismatch statistics out.

    ``g``: the run's GRPO settings; ``batch_logprobs``: the trainer's (B, T) log-probs of a
    collated batch. Called only for inexact samplers; a no-op with the correction switched off."""
    if not g.vllm_importance_sampling_correction:
        return {}
    cols = c.seq
    has = cols.has_old  # (B,)
    if not bool(has.any()):
        return {}
    t0 = time.perf_counter()
    trainer = batch_logprobs(c).float().cpu()  # (B, T), micro-batched
    recompute_s = time.perf_counter() - t0  # the pass an exact sampler never needs
    sampler = cols.old_logprobs  # (B, T), NaN for peers
    mask = completion_mask(c.completion_ids, c.lengths) & has.unsqueeze(-1)
    weights, stats = importance_weights(
        trainer,
        sampler,
        mask,
        g.vllm_importance_sampling_mode,
        g.vllm_importance_sampling_clip_max,
        g.vllm_importance_sampling_clip_min,
        sequence_ratio=g.vllm_importance_sampling_sequence_ratio,
    )
    cols.old_logprobs = torch.where(has.unsqueeze(-1), trainer, sampler)
    cols.sampler_weights = weights  # (B, T); 1 off the mask
    return {**stats, "mismatch/recompute_time_s": recompute_s}
