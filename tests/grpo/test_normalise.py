"""Whole-batch normalisers: micro-batch shares sum to ``aggregate`` of the whole batch."""

import pytest
import torch

from mutualrl.grpo import NORMALISERS, aggregate, row_scales, scaled_sum, token_mean_scale


@pytest.mark.parametrize("loss_type", sorted(NORMALISERS))
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


def test_the_normaliser_table_holds_the_three_loss_types():
    assert sorted(NORMALISERS) == ["dapo", "dr_grpo", "grpo"]


@pytest.mark.parametrize("loss_type", sorted(NORMALISERS))
@pytest.mark.parametrize("skipped", [(0, 0), (2, 5)])
def test_skipped_rows_count_alike_in_both_forms(loss_type, skipped):
    g = torch.Generator().manual_seed(2)
    per_token = torch.randn(4, 3, generator=g, dtype=torch.float64)
    mask = torch.arange(3).unsqueeze(0) < torch.tensor([3, 1, 2, 0]).unsqueeze(-1)
    scales = row_scales(mask, loss_type, 5, *skipped)
    assert float(scaled_sum(per_token, mask, scales)) == pytest.approx(
        float(aggregate(per_token, mask, loss_type, 5, *skipped)), rel=1e-6
    )


def test_unknown_loss_type_names_the_allowed_values():
    for fn in (
        lambda: aggregate(torch.ones(1, 1), torch.ones(1, 1), "sum", 1),
        lambda: row_scales(torch.ones(1, 1), "sum", 1),
    ):
        with pytest.raises(
            ValueError, match="loss_type: unknown loss type 'sum'; known: dapo, dr_grpo, grpo"
        ):
            fn()


def test_a_registered_loss_type_is_checked_for_both_forms_and_reaches_aggregate():
    """A plug-in loss type (here: the plain sum) is looked up by name as the built-ins are; an
    object without ``reduce`` and ``row_scales`` is refused when it is registered."""
    from mutualrl.registry import RegistryError

    class Sum:
        def reduce(self, per_token, mask, max_completion_length, skipped_rows, skipped_tokens):
            return (per_token * mask).sum()

        def row_scales(self, mask, max_completion_length, skipped_rows, skipped_tokens):
            return mask.new_ones(mask.shape[0])

    NORMALISERS.register("test-sum", Sum())
    try:
        per_token, mask = torch.full((2, 3), 2.0), torch.ones(2, 3)
        assert float(aggregate(per_token, mask, "test-sum", 3)) == 12.0
        assert float(scaled_sum(per_token, mask, row_scales(mask, "test-sum", 3))) == 12.0
    finally:
        del NORMALISERS._items["test-sum"]
    with pytest.raises(RegistryError, match="loss type 'bad' must be an object with reduce"):
        NORMALISERS.register("bad", lambda per_token, mask: per_token.sum())
