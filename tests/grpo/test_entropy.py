"""The logged entropy: in passes of a few positions, at every masked token or an even sample."""

from __future__ import annotations

import math

import pytest
import torch

from mutualrl.grpo import entropy_from_logprobs, sampled_entropy


def _logp(B=3, T=5, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(B, T, V, generator=g), -1)


def test_chunked_entropy_is_the_definition():
    lp = _logp()
    want = -(lp.exp() * lp).sum(-1)
    for rows in (1, 2, 32):
        torch.testing.assert_close(entropy_from_logprobs(lp, rows=rows), want)
    uniform = torch.full((1, 1, 8), -math.log(8))
    assert entropy_from_logprobs(uniform).item() == pytest.approx(math.log(8))


def test_sampled_entropy_at_every_masked_token_or_an_even_sample():
    lp = _logp()
    want = -(lp.exp() * lp).sum(-1)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False  # a row that ended early
    full = sampled_entropy(lp, mask, None)
    assert torch.isnan(full[0, 3:]).all()
    torch.testing.assert_close(full[mask], want[mask])
    some = sampled_entropy(lp, mask, 4)  # 13 masked positions, 4 evenly spaced
    picked = ~torch.isnan(some)
    assert int(picked.sum()) == 4 and bool((picked <= mask).all())
    flat = mask.reshape(-1).nonzero().squeeze(1)
    assert picked.reshape(-1).nonzero().squeeze(1).tolist() == flat[[0, 4, 8, 12]].tolist()
    torch.testing.assert_close(some[picked], want[picked])
    assert sampled_entropy(lp, mask, 100)[mask].isnan().sum() == 0  # more than there are: all


def test_the_update_logs_the_sampled_entropy(tokenizer_handles):
    """With every token sampled the logged entropy is the mean over the loss's tokens; with
    fewer it stays an estimate of the same mean."""
    from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig
    from mutualrl.policies.batch import TrainBatch, TrainSequence
    from mutualrl.policies.policy import Policy

    seqs = tuple(
        TrainSequence(
            prompt_ids=(1, 5, 9), completion_ids=tuple(range(20 + i, 28 + i)), advantage=(-1.0) ** i
        )
        for i in range(8)
    )
    logged = {}
    for size in (None, 16):
        pol = Policy(
            PolicyConfig(name="p", hidden_size=32, num_layers=1, num_heads=4),
            GRPOConfig(learning_rate=1e-3),
            seed=0,
            handle=tokenizer_handles["mistral-v1"],
            training=TrainingConfig(entropy_sample_size=size),
        )
        logged[size] = pol.train_step(TrainBatch(sequences=seqs))["entropy"]
    assert logged[None] == pytest.approx(logged[16], rel=0.01)
    assert logged[None] != logged[16]
