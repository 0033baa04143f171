"""The two-level inverse-CDF sampler draws from the distribution it is given."""

from __future__ import annotations

import pytest
import torch

from mutualrl.policies.sampling import sample_tokens


@pytest.mark.parametrize(
    "V,block",
    [(5, 1024), (10, 4), (12, 4), (200, 16)],
    ids=["one-partial-block", "tail-block", "whole-blocks", "many-blocks"],
)
def test_frequencies_match_the_probabilities(V, block):
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(V, generator=gen) ** 3  # uneven, with some near-zero entries
    probs[V // 3] = 0.0  # never to be drawn
    probs /= probs.sum()
    n = 100_000
    logp = probs.log().expand(n, V)
    tokens = sample_tokens(logp, torch.Generator().manual_seed(1), block=block)
    freq = torch.bincount(tokens, minlength=V).double() / n
    assert freq[V // 3] == 0
    # 5 standard errors of a binomial proportion, per token
    tol = 5 * (probs.double() * (1 - probs.double()) / n).sqrt() + 1e-6
    assert ((freq - probs.double()).abs() <= tol).all(), (freq - probs).abs().max()


def test_a_certain_token_is_always_drawn_and_rows_are_independent():
    logp = torch.full((3, 50), -float("inf"))
    logp[0, 7] = logp[1, 49] = logp[2, 0] = 0.0
    for seed in range(20):
        assert sample_tokens(logp, torch.Generator().manual_seed(seed), block=16).tolist() == [
            7,
            49,
            0,
        ]


def test_same_generator_state_same_tokens_and_one_uniform_per_row():
    logp = torch.log_softmax(torch.randn(4, 300, generator=torch.Generator().manual_seed(0)), -1)
    a, b, c = (torch.Generator().manual_seed(3) for _ in range(3))
    assert torch.equal(sample_tokens(logp, a), sample_tokens(logp, b))
    torch.rand(4, 1, generator=c, dtype=torch.float64)
    assert torch.equal(a.get_state(), c.get_state())
