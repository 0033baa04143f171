"""Group-relative advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from mutualrl.grpo import (
    STD_DDOF,
    group_advantages,
    group_moments,
    normalize,
    std_from_m2,
    within_group_ranks,
)


def t(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def g(*groups):
    return torch.tensor(groups, dtype=torch.long)


def test_zscore_with_population_std():
    # mean 0.5, population std 0.5 -> +-1 (a sample std would give +-0.866)
    adv = group_advantages(t(0, 1, 1, 0), g(0, 0, 0, 0), 1)
    torch.testing.assert_close(adv.advantages, t(-1, 1, 1, -1), atol=1e-3, rtol=0)
    assert not adv.zero_std.any()
    assert adv.moments.std.item() == pytest.approx(0.5)
    assert adv.moments.mean.item() == pytest.approx(0.5)


def test_zscore_with_sample_std_as_trl():
    # advantage_std="sample": Bessel's correction, (r - mean) / (std_{n-1} + 1e-4) as TRL's
    # GRPOTrainer: mean .5, sample std sqrt(1/3) -> +-0.866
    s = math.sqrt(1 / 3)
    adv = group_advantages(t(0, 1, 1, 0), g(0, 0, 0, 0), 1, advantage_std="sample")
    torch.testing.assert_close(adv.advantages, t(-0.5, 0.5, 0.5, -0.5) / (s + 1e-4))
    assert adv.moments.std.item() == pytest.approx(s)
    reference = torch.tensor([0.0, 1, 1, 0], dtype=torch.float64)
    assert adv.moments.std.item() == pytest.approx(reference.std(correction=1).item(), rel=1e-12)


def test_sample_std_in_groups_of_different_sizes_and_the_whole_batch():
    values = [0.0, 2.0, 10.0, 14.0, 3.0]
    groups = g(0, 0, 1, 1, 1)
    adv = group_advantages(t(*values), groups, 2, advantage_std="sample").advantages
    g1 = torch.tensor([10.0, 14.0, 3.0], dtype=torch.float64)
    s0, s1 = math.sqrt(2.0), float(g1.std(correction=1))
    expected = [-1 / (s0 + 1e-4), 1 / (s0 + 1e-4), *((g1 - g1.mean()) / (s1 + 1e-4)).tolist()]
    torch.testing.assert_close(adv, t(*expected), atol=1e-6, rtol=1e-6)
    batch = group_advantages(
        t(*values), groups, 2, scale="batch", advantage_std="sample"
    ).advantages
    sb = float(torch.tensor(values, dtype=torch.float64).std(correction=1))
    means = [1.0, 1.0, *[float(g1.mean())] * 3]
    torch.testing.assert_close(
        batch, t(*[(v - m) / (sb + 1e-4) for v, m in zip(values, means)]), atol=1e-6, rtol=1e-6
    )


def test_a_singleton_group_has_zero_std_and_advantage_under_either_std():
    for kind in STD_DDOF:
        adv = group_advantages(t(3.0, 1, 2), g(0, 1, 1), 2, advantage_std=kind)
        assert adv.advantages[0].item() == 0.0 and bool(adv.zero_std[0])
        assert adv.moments.std[0].item() == 0.0


def test_std_from_m2_divides_by_n_or_n_minus_1_and_names_bad_kinds():
    m2, n = torch.tensor([8.0], dtype=torch.float64), torch.tensor([5.0], dtype=torch.float64)
    assert std_from_m2(m2, n).item() == pytest.approx(math.sqrt(8 / 5))
    assert std_from_m2(m2, n, "sample").item() == pytest.approx(math.sqrt(8 / 4))
    with pytest.raises(ValueError, match="advantage_std must be one of .*'population', 'sample'"):
        group_advantages(t(0, 1), g(0, 0), 1, advantage_std="bessel")


def test_zscore_uneven_rewards():
    # [1, 0, 0, 0]: mean .25, std sqrt(.1875) = .4330
    adv = group_advantages(t(1, 0, 0, 0), g(0, 0, 0, 0), 1).advantages
    s = math.sqrt(0.1875)
    torch.testing.assert_close(adv, t(0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s), atol=1e-3, rtol=0)


def test_mean_only_scale_none():
    rewards = t(0, 2, 4, 10)
    adv = group_advantages(rewards, g(0, 0, 0, 0), 1, scale="none").advantages
    torch.testing.assert_close(adv, t(-4, -2, 0, 6))


def test_batch_scale_uses_the_std_of_the_whole_batch():
    # group 0: [0, 2] mean 1; group 1: [10, 14] mean 12; batch population std of all four values:
    values = [0.0, 2.0, 10.0, 14.0]
    m = sum(values) / 4
    batch_std = math.sqrt(sum((v - m) ** 2 for v in values) / 4)
    adv = group_advantages(t(*values), g(0, 0, 1, 1), 2, scale="batch").advantages
    expected = t(-1 / batch_std, 1 / batch_std, -2 / batch_std, 2 / batch_std)
    torch.testing.assert_close(adv, expected, atol=1e-3, rtol=0)
    # unlike "group" scaling, which gives +-1 in both groups
    grp = group_advantages(t(*values), g(0, 0, 1, 1), 2, scale="group").advantages
    torch.testing.assert_close(grp, t(-1, 1, -1, 1), atol=1e-3, rtol=0)


def test_rank_estimator_with_ties():
    # ranks of [5, 1, 5, 3]: sorted 1, 3, 5, 5 -> positions 0, 1, (2+3)/2 -> /3 -> [5/6, 0, 5/6,
    # 1/3]
    ranks = within_group_ranks(t(5, 1, 5, 3), g(0, 0, 0, 0), 1)
    torch.testing.assert_close(ranks, t(5 / 6, 0, 5 / 6, 1 / 3))
    adv = group_advantages(t(5, 1, 5, 3), g(0, 0, 0, 0), 1, estimator="rank").advantages
    r = torch.tensor([5 / 6, 0, 5 / 6, 1 / 3], dtype=torch.float64)
    expected = (r - r.mean()) / (r.std(unbiased=False) + 1e-4)
    torch.testing.assert_close(adv, expected.float(), atol=1e-5, rtol=0)


def test_rank_is_invariant_to_monotone_rescaling():
    rewards = t(0.1, 3.0, -2.0, 0.5, 7.0, 7.0)
    groups = g(0, 0, 0, 1, 1, 1)
    a = group_advantages(rewards, groups, 2, estimator="rank").advantages
    b = group_advantages(torch.exp(rewards) * 100, groups, 2, estimator="rank").advantages
    torch.testing.assert_close(a, b)


def test_ranks_per_group_in_interleaved_order_and_singletons():
    # groups interleaved, of sizes 3, 2 and 1
    values = t(3, 9, 1, 9, 2, 4)
    groups = g(0, 1, 0, 1, 0, 2)
    ranks = within_group_ranks(values, groups, 3)
    # group 0: [3, 1, 2] -> [1, 0, .5]; group 1: [9, 9] tie -> [.5, .5]; group 2 singleton -> .5
    torch.testing.assert_close(ranks, t(1, 0.5, 0, 0.5, 0.5, 0.5))


def test_zero_variance_groups_are_flagged_and_get_exact_zeros():
    rewards = t(1, 1, 1, 0, 1, 0.3, 0.3)
    groups = g(0, 0, 0, 1, 1, 2, 2)
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, groups, 3, scale=scale)
        assert adv.zero_std.tolist() == [True, True, True, False, False, True, True]
        assert (adv.advantages[adv.zero_std] == 0).all()
        assert (adv.advantages[~adv.zero_std] != 0).all()


def test_groups_of_different_sizes_via_group_index():
    # group 0 has 3 samples, group 1 has 5; order mixed
    rewards = t(1, 0, 0, 1, 1, 0, 0, 0)
    groups = g(0, 1, 0, 1, 0, 1, 1, 1)
    adv = group_advantages(rewards, groups, 2)
    m = adv.moments
    torch.testing.assert_close(m.count, torch.tensor([3.0, 5.0], dtype=torch.float64))
    torch.testing.assert_close(m.mean, torch.tensor([2 / 3, 1 / 5], dtype=torch.float64))
    s0, s1 = math.sqrt(2 / 9), math.sqrt(0.16)
    expected = t(
        (1 - 2 / 3) / s0,
        (0 - 0.2) / s1,
        (0 - 2 / 3) / s0,
        (1 - 0.2) / s1,
        (1 - 2 / 3) / s0,
        -0.2 / s1,
        -0.2 / s1,
        -0.2 / s1,
    )
    torch.testing.assert_close(adv.advantages, expected, atol=1e-3, rtol=0)
    # advantages sum to zero within each group
    for k in range(2):
        assert adv.advantages[groups == k].sum().item() == pytest.approx(0.0, abs=1e-5)


def test_group_moments_empty_group_does_not_divide_by_zero():
    m = group_moments(t(1, 3), g(0, 0), 2)
    assert m.count.tolist() == [2.0, 0.0]
    assert m.mean.tolist() == [2.0, 0.0]
    assert m.std.tolist() == [1.0, 0.0]


def test_advantages_keep_the_reward_dtype():
    adv = group_advantages(t(0, 1, dtype=torch.float32), g(0, 0), 1).advantages
    assert adv.dtype == torch.float32


def test_unknown_scale_and_estimator_raise_naming_the_known_ones():
    from mutualrl.registry import RegistryError

    with pytest.raises(RegistryError, match="reward scaling 'median'.*batch, group, none|group"):
        normalize(t(1.0), t(0.0), t(1.0), "median")
    with pytest.raises(RegistryError, match="advantage estimator 'quantile'"):
        group_advantages(t(0, 1), g(0, 0), 1, estimator="quantile")


def test_ranks_and_rank_advantages_of_no_values_are_empty():
    empty, index = torch.zeros(0), torch.zeros(0, dtype=torch.long)
    assert within_group_ranks(empty, index, 0).shape == (0,)
    adv = group_advantages(empty, index, 0, estimator="rank")
    assert adv.advantages.shape == (0,) and adv.zero_std.shape == (0,)


def test_a_registered_scaling_and_estimator_reach_group_advantages():
    """The algorithm's parts are open: a plug-in's scaling (here: divide by the group's range)
    and estimator (here: rewards squared) are looked up by name, as the built-ins are."""
    from mutualrl.grpo import ADVANTAGE_ESTIMATORS, REWARD_SCALINGS

    def by_range(values, std, advantage_std):
        return torch.full_like(values, 2.0, dtype=torch.float64)

    REWARD_SCALINGS.register("test-range", by_range)
    ADVANTAGE_ESTIMATORS.register("test-square", lambda r, g, k: r**2)
    try:
        rewards, groups = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0, 0, 0, 0])
        got = group_advantages(rewards, groups, 1, scale="test-range", estimator="test-square")
        assert got.advantages.tolist() == [(v - 3.5) / 2 for v in (0.0, 1.0, 4.0, 9.0)]
    finally:
        del REWARD_SCALINGS._items["test-range"], ADVANTAGE_ESTIMATORS._items["test-square"]


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("scale_rewards", "groups", "grpo.scale_rewards: unknown reward scaling 'groups'"),
        ("advantage_estimator", "ranks", "grpo.advantage_estimator: unknown advantage estimator"),
        ("loss_type", "ppo", "grpo.loss_type: unknown loss type 'ppo'; known: dapo, dr_grpo, grpo"),
    ],
)
def test_an_unknown_algorithm_part_is_one_line_naming_the_field(field, value, says):
    from mutualrl.config import ConfigError, load_config
    from mutualrl.run.inputs import check_inputs

    cfg = load_config("tiny", [f'grpo.{field}="{value}"'])
    with pytest.raises(ConfigError) as caught:
        check_inputs(cfg)
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value)
