"""Loss normalisers of a whole batch, so micro-batches add up to exactly the batch's loss. Pure.

``aggregate`` reduces a (B, T) per-token loss with a normaliser that depends on the *whole* batch
(its row count, each row's token count, its total token count). A micro-batch sees only some
rows, so it cannot normalise itself; instead the normaliser is computed once per optimizer step
as a per-row scale, and every micro-batch contributes ``sum_t loss[i, t] * mask[i, t] * scale[i]``
over its rows. Summed over micro-batches (in any cut) this is the whole batch's ``aggregate``
up to float rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor


def row_scales(mask: Tensor, loss_type: str, max_completion_length: int, skipped_rows: int = 0,
               skipped_tokens: int = 0) -> Tensor:
    """Per-row factor turning masked token sums into the batch loss: (B, T) mask -> (B,) fp32.

    grpo:    1 / (B * n_i)  (n_i: tokens of row i, at least 1) -- mean of per-sequence means;
    dr_grpo: 1 / (B * max_completion_length);
    dapo:    1 / N          (N: tokens of the whole batch, at least 1).
    ``skipped_rows``/``skipped_tokens``: zero-loss rows a strategy left out of the batch
    (``TrainBatch.skipped_rows``); they count in B and N as they would in the full batch.
    """
    m = mask.to(torch.float32)
    B = m.shape[0]
    rows = B + skipped_rows
    if loss_type == "grpo":
        return 1.0 / (rows * m.sum(-1).clamp(min=1))
    if loss_type == "dr_grpo":
        return torch.full((B,), 1.0 / (rows * max_completion_length))
    if loss_type == "dapo":
        return torch.full((B,), 1.0) / (m.sum() + skipped_tokens).clamp(min=1)
    raise ValueError(f"loss_type must be 'grpo', 'dr_grpo' or 'dapo', got {loss_type!r}")


def scaled_sum(per_token: Tensor, mask: Tensor, scale: Tensor) -> Tensor:
    """A micro-batch's share of the batch loss: (B, T), (B, T), (B,) -> scalar."""
    mask = mask.to(per_token.dtype)
    return ((per_token * mask).sum(-1) * scale.to(per_token.dtype)).sum()


def token_mean_scale(mask: Tensor) -> Tensor:
    """1 / (masked tokens of the whole batch, at least 1): the factor of a token mean
    (SFT's mean NLL, KL and clip-fraction statistics) split over micro-batches. (B, T) -> ()."""
    return 1.0 / mask.to(torch.float32).sum().clamp(min=1)
