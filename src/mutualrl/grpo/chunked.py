"""Log-probs and entropy of target tokens from final hidden states, the LM head applied in chunks.

With a 129k vocabulary the (N, V) logits of N completion positions dominate an update's memory:
forward keeps them for backward, and their log-softmax and its gradient are as large again.
``chunked_token_logprobs`` applies the LM head and an fp32 log-softmax to ``chunk_size``
positions at a time and keeps only the (N, H) hidden states; backward recomputes each chunk's
logits and turns them into gradients at once, so at most one chunk's (chunk, V) tensors exist
in forward and in backward. Pure: tensors in, tensors out.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the LM head's matmul would run in: autocast's when it is on, else the weight's."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


def _chunk_logprobs(
    h: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, temperature: float
) -> Tensor:
    """fp32 log-softmax of one chunk's logits: (n, H) -> (n, V)."""
    with torch.autocast(h.device.type, enabled=False):
        logits = torch.nn.functional.linear(
            h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        ).float()
    if temperature != 1:
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=-1)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        # hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) -> logp (N,), entropy (N,)
        dtype = _compute_dtype(hidden, weight)
        N = hidden.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(N, dtype=torch.float32, device=hidden.device)
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            lsm = _chunk_logprobs(hidden[s:e], weight, bias, dtype, temperature)  # (n, V)
            logp[s:e] = lsm.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1)
            ent[s:e] = -lsm.exp().mul_(lsm).sum(-1)  # in place: two (n, V) at most
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.dtype, ctx.temperature, ctx.chunk_size = dtype, temperature, chunk_size
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, bias, targets = ctx.saved_tensors
        dtype, N = ctx.dtype, hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.zeros_like(hidden) if need_h else None
        gw = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        gb = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if need_b
            else None
        )
        for s in range(0, N, ctx.chunk_size):
            e = min(s + ctx.chunk_size, N)
            with torch.no_grad():
                p = _chunk_logprobs(hidden[s:e], weight, bias, dtype, ctx.temperature).exp_()
                g = grad_logp[s:e].float().unsqueeze(-1)  # (n, 1)
                # d log p(target) / d logits = onehot(target) - softmax, through 1/temperature
                glog = p.mul_(-g).scatter_add_(-1, targets[s:e].unsqueeze(-1), g)
                if ctx.temperature != 1:
                    glog.div_(ctx.temperature)
                if gh is not None:
                    gh[s:e] = (glog.to(dtype) @ weight.to(dtype)).to(gh.dtype)
                if gw is not None:
                    gw += (glog.to(dtype).T @ hidden[s:e].to(dtype)).float()
                if gb is not None:
                    gb += glog.sum(0)
        return (
            gh,
            None if gw is None else gw.to(weight.dtype),
            None if gb is None else gb.to(bias.dtype),
            None,
            None,
            None,
        )


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor]:
    """log p(target) and entropy per position: (..., H), (V, H), (V,)|None, (...) -> (...), (...).

    Logits are ``hidden @ weight.T + bias`` divided by ``temperature``, as a causal LM's head
    computes them; the log-softmax is fp32 whatever the weights' dtype. The log-probs are
    differentiable (into ``hidden``, ``weight`` and ``bias``); the entropy is a statistic and
    is not. Equal to ``token_logprobs`` on the full logits within float tolerance.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = targets.shape
    logp, ent = _ChunkedLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        targets.reshape(-1),
        float(temperature),
        int(chunk_size),
    )
    return logp.view(shape), ent.view(shape)
