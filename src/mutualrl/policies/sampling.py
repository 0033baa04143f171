"""Drawing tokens from a categorical distribution over a large vocabulary, fast on CPU.

``torch.multinomial(p, 1)`` draws one exponential variate per vocabulary entry (an
exponential-race sampler): with 129k tokens and 512 rows that is 66M random numbers per decoding
step, which made sampled evaluation of the DeepSeek-vocabulary policy spend 56% of its time in
``exponential_``. Inverse-CDF sampling needs one uniform per row. Done in two levels, it also
avoids a full-vocabulary cumulative sum: the row's mass is summed in blocks, a block is chosen by
the cumulative block masses, and a token inside it by the block's own cumulative sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 1024


def sample_tokens(logp: Tensor, generator: torch.Generator, block: int = BLOCK) -> Tensor:
    """One token per row drawn from ``exp(logp)``: (B, V) log-probabilities -> (B,) token ids.

    Exact up to floating-point rounding of the masses (accumulated in float64); a token of
    probability 0 is never drawn. Draws ``B`` uniforms from ``generator`` (on the CPU).
    """
    B, V = logp.shape
    block = min(block, V)
    probs = logp.exp()  # (B, V)
    full = V // block
    parts = [probs[:, : full * block].view(B, full, block).sum(-1)] if full else []
    if full * block < V:
        parts.append(probs[:, full * block :].sum(-1, keepdim=True))
    mass = torch.cat(parts, 1).double()  # (B, nb)
    cdf = mass.cumsum(-1)  # (B, nb)
    u = torch.rand(B, 1, generator=generator, dtype=torch.float64).to(logp.device) * cdf[:, -1:]
    b = torch.searchsorted(cdf, u, right=True).clamp(max=mass.shape[1] - 1)  # (B, 1) block
    u = u - (cdf.gather(1, b) - mass.gather(1, b))  # what is left inside it
    idx = b * block + torch.arange(block, device=logp.device)  # (B, block)
    inside = probs.gather(1, idx.clamp(max=V - 1)).double() * (idx < V)  # (B, block)
    cum = inside.cumsum(-1)
    j = torch.searchsorted(cum, u, right=True)  # (B, 1)
    # Rounding can put u at or past the block's last cumulative mass: take its last likely token.
    last = (inside > 0).long().cumsum(-1).argmax(-1, keepdim=True)
    return idx.gather(1, torch.minimum(j, last)).squeeze(-1)


def truncates(top_k: int, top_p: float) -> bool:
    """Whether ``truncate_logits`` with these settings changes anything (0 and 1 switch off)."""
    return top_k > 0 or top_p < 1


def truncate_logits(
    logits: Tensor, top_k: int = 0, top_p: float = 1.0, keep: Tensor | None = None
) -> Tensor:
    """Top-k, then top-p (nucleus) truncation, as vLLM's sampler orders them: (..., V) -> (..., V).

    Tokens left out get the dtype's lowest finite value rather than -inf, so their probability
    after a softmax is exactly 0 while ``p * log p`` stays 0 (an entropy over -inf gives NaN).
    Top-k keeps the tokens whose logit is at least the k-th largest (ties kept); top-p keeps the
    smallest prefix of the descending order whose mass reaches ``top_p`` (the most likely token
    always). ``keep`` (...,) names one token per row that is never removed: the trainer passes
    the sampled tokens, so a token sampled under an older policy's support keeps a finite
    log-prob (on-policy it is inside the support anyway and nothing changes).
    """
    drop = torch.zeros_like(logits, dtype=torch.bool)  # (..., V)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (..., 1)
        drop = logits < kth
    if top_p < 1:
        ordered, order = logits.masked_fill(drop, float("-inf")).sort(-1, descending=True)
        probs = ordered.softmax(-1)  # (..., V) descending
        before = probs.cumsum(-1) - probs  # mass ahead of each token
        drop = drop | torch.zeros_like(drop).scatter(-1, order, before >= top_p)
    if keep is not None:
        drop = drop.scatter(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill(drop, torch.finfo(logits.dtype).min)
