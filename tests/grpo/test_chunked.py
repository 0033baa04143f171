"""Chunked LM-head log-probs equal the full (B, T, V) computation, forward and backward."""

import pytest
import torch

from mutualrl.grpo import chunked_token_logprobs, entropy_from_logprobs, token_logprobs


def inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(97, 16, generator=g)).requires_grad_()
    b = torch.randn(97, generator=g).requires_grad_() if bias else None
    return h, w, b, torch.randint(0, 97, (3, 5), generator=g)


@pytest.mark.parametrize("chunk_size", [1, 4, 15, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_logprobs_entropy_and_gradients(chunk_size, temperature):
    h, w, b, t = inputs()
    upstream = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    logp, ent = chunked_token_logprobs(h, w, b, t, temperature, chunk_size)
    (logp * upstream).sum().backward()
    got = [x.grad.clone() for x in (h, w, b)]
    for x in (h, w, b):
        x.grad = None
    full_logp, full_all = token_logprobs((h @ w.T + b) / temperature, t)
    (full_logp * upstream).sum().backward()
    torch.testing.assert_close(logp, full_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, entropy_from_logprobs(full_all).detach(), atol=1e-5, rtol=1e-5)
    for a, x in zip(got, (h, w, b)):
        torch.testing.assert_close(a, x.grad, atol=1e-5, rtol=1e-4)
    assert not ent.requires_grad


def test_bf16_autocast_keeps_fp32_log_softmax():
    h, w, _, t = inputs(bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = chunked_token_logprobs(h, w, None, t, 1.0, 4)
    assert logp.dtype == ent.dtype == torch.float32
    logp.sum().backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32
    full, _ = token_logprobs((h @ w.T).detach(), t)
    assert not torch.equal(logp.detach(), full)  # the matmul ran in bf16
    torch.testing.assert_close(logp.detach(), full, atol=0.1, rtol=0.02)


def test_chunk_size_must_be_positive():
    h, w, b, t = inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(h, w, b, t, 1.0, 0)
