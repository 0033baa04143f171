"""Whole-batch normalisers: micro-batch shares sum to ``aggregate`` of the whole batch."""

import pytest
import torch

from mutualrl.grpo import aggregate, row_scales, scaled_sum, token_mean_scale


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("cuts", [[0, 7], [0, 3, 7], [0, 1, 2, 5, 7]])
def test_micro_batch_shares_sum_to_the_batch_loss(loss_type, cuts):
    g = torch.Generator().manual_seed(1)
    per_token = torch.randn(7, 5, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 0, 3, 4, 2, 5])
    mask = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(-1)
    scales = row_scales(mask, loss_type, max_completion_length=6)
    shares = sum(scaled_sum(per_token[a:b], mask[a:b], scales[a:b]) for a, b in zip(cuts, cuts[1:]))
    assert float(shares) == pytest.approx(float(aggregate(per_token, mask, loss_type, 6)), rel=1e-6)


def test_token_mean_scale_and_empty_masks():
    mask = torch.zeros(3, 4, dtype=torch.bool)
    assert float(token_mean_scale(mask)) == 1.0
    assert torch.all(row_scales(mask, "grpo", 4) == 1 / 3)
    with pytest.raises(ValueError, match="loss_type"):
        row_scales(mask, "sum", 4)
