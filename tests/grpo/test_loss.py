"""The GRPO objective: aggregation, clipped surrogate, k3 KL, masks, against hand-computed
values."""

from __future__ import annotations

import math

import pytest
import torch

from mutualrl.grpo import (
    LossShare,
    SurrogateSettings,
    aggregate,
    clipped_surrogate,
    completion_mask,
    entropy_from_logits,
    entropy_from_logprobs,
    k3_kl,
    row_scales,
    selective_log_softmax,
    token_logprobs,
)

# A ragged (B=3, T=4) per-token loss with lengths 1, 3, 4.
PER_TOKEN = torch.tensor([[1.0, 9.0, 9.0, 9.0], [2.0, 4.0, 6.0, 9.0], [1.0, 1.0, 1.0, 5.0]])
MASK = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])


def test_aggregate_grpo_is_mean_of_per_sequence_means():
    # (1) + (2+4+6)/3 + (1+1+1+5)/4 = 1 + 4 + 2 -> mean 7/3
    assert aggregate(PER_TOKEN, MASK, "grpo", 4).item() == pytest.approx(7 / 3)


def test_aggregate_dr_grpo_is_sum_over_b_times_max_length():
    # masked sum 1 + 12 + 8 = 21, over B * max_completion_length = 3 * 5 (not the tensor's T)
    assert aggregate(PER_TOKEN, MASK, "dr_grpo", 5).item() == pytest.approx(21 / 15)


def test_aggregate_dapo_is_sum_over_masked_tokens():
    assert aggregate(PER_TOKEN, MASK, "dapo", 4).item() == pytest.approx(21 / 8)


def test_aggregate_ignores_values_outside_the_mask():
    changed = PER_TOKEN.clone()
    changed[MASK == 0] = 1000.0
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        assert aggregate(changed, MASK, loss_type, 4) == aggregate(PER_TOKEN, MASK, loss_type, 4)


def test_aggregate_empty_rows_do_not_divide_by_zero():
    mask = torch.tensor([[0, 0], [1, 1]])
    x = torch.tensor([[5.0, 5.0], [1.0, 3.0]])
    assert aggregate(x, mask, "grpo", 2).item() == pytest.approx(1.0)  # (0 + 2) / 2
    assert aggregate(torch.ones(1, 2), torch.zeros(1, 2), "dapo", 2).item() == 0.0


def test_aggregate_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type"):
        aggregate(PER_TOKEN, MASK, "ppo", 4)


def surrogate(logp, old, adv, mask, *, ref_logp=None, sample_weight=None, share=None, **settings):
    share = LossShare() if share is None else share
    settings.setdefault("epsilon", 0.2)
    settings.setdefault("epsilon_high", None)
    settings.setdefault("loss_type", "dapo")
    settings.setdefault("max_completion_length", logp.shape[1])
    return clipped_surrogate(
        logp,
        old,
        adv,
        mask,
        SurrogateSettings(**settings),
        ref_logp=ref_logp,
        sample_weight=sample_weight,
        share=share,
    )


def test_settings_reject_an_unknown_loss_type_naming_the_allowed_ones():
    with pytest.raises(
        ValueError, match="loss_type: unknown loss type 'ppo'; known: dapo, dr_grpo, grpo"
    ):
        SurrogateSettings(epsilon=0.2, epsilon_high=None, loss_type="ppo", max_completion_length=4)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batch_shares_of_the_surrogate_sum_to_the_whole_batch_loss(loss_type):
    g = torch.Generator().manual_seed(3)
    logp, old = torch.randn(5, 4, generator=g) - 2, torch.randn(5, 4, generator=g) - 2
    adv = torch.randn(5, generator=g)
    mask = torch.arange(4).unsqueeze(0) < torch.tensor([4, 1, 3, 0, 2]).unsqueeze(-1)
    whole = surrogate(logp, old, adv, mask, loss_type=loss_type, max_completion_length=6)
    scales = row_scales(mask, loss_type, 6)
    parts = [
        surrogate(
            logp[s],
            old[s],
            adv[s],
            mask[s],
            loss_type=loss_type,
            max_completion_length=6,
            share=LossShare(row_scale=scales[s]),
        )
        for s in (slice(0, 2), slice(2, 5))
    ]
    assert float(sum(p.loss for p in parts)) == pytest.approx(float(whole.loss), rel=1e-6)


def test_ratio_one_gives_minus_advantage_per_token():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.2, 0.2, 0.2]]))
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = surrogate(logp, logp.clone(), adv, mask, loss_type="grpo")
    # per sequence mean of -A: -2 and +1 -> mean -0.5
    assert out.loss.item() == pytest.approx(-0.5)
    out = surrogate(logp, logp.clone(), adv, mask, loss_type="dapo")
    # token mean: (2 * -2 + 3 * 1) / 5
    assert out.loss.item() == pytest.approx(-1 / 5)
    assert out.clip_low_frac.item() == 0 and out.clip_high_frac.item() == 0
    assert out.kl.item() == 0


def test_ratio_one_gradient_is_minus_advantage():
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    out = surrogate(logp, logp.detach().clone(), torch.tensor([3.0]), torch.ones(1, 2))
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -1.5]]))  # -A * ratio / n_tokens


def test_clipping_low_for_negative_and_high_for_positive_advantages():
    # ratios per token: 0.5, 1.0, 2.0 in each row; epsilon .2 (low 0.8), epsilon_high .5 (high 1.5)
    old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[0.5, 1.0, 2.0], [0.5, 1.0, 2.0]]))
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 3)
    out = surrogate(logp, old, adv, mask, epsilon=0.2, epsilon_high=0.5)
    # A=+1: min(r, clip(r)) = 0.5, 1.0, 1.5   -> loss -0.5, -1, -1.5
    # A=-1: min(-r, -clip(r)) = -0.8, -1, -2  -> loss  0.8,  1,  2
    assert out.loss.item() == pytest.approx((-0.5 - 1 - 1.5 + 0.8 + 1 + 2) / 6)
    # clipped: A>0 at ratio 2 > 1.5 (high); A<0 at ratio .5 < .8 (low); the other extremes are
    # taken unclipped by the min and are not counted
    assert out.clip_high_frac.item() == pytest.approx(1 / 6)
    assert out.clip_low_frac.item() == pytest.approx(1 / 6)


def test_epsilon_high_differs_from_epsilon():
    old = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[1.3]]))
    adv = torch.tensor([1.0])
    symmetric = surrogate(logp, old, adv, torch.ones(1, 1), epsilon=0.2, epsilon_high=None)
    assert symmetric.loss.item() == pytest.approx(-1.2)  # clipped at 1 + epsilon
    assert symmetric.clip_high_frac.item() == 1.0
    higher = surrogate(logp, old, adv, torch.ones(1, 1), epsilon=0.2, epsilon_high=0.4)
    assert higher.loss.item() == pytest.approx(-1.3)  # within 1 + epsilon_high
    assert higher.clip_high_frac.item() == 0.0


def test_clipped_tokens_get_no_gradient():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[2.0, 1.1]])).requires_grad_()
    out = surrogate(logp, old, torch.tensor([1.0]), torch.ones(1, 2), epsilon=0.2)
    out.loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped at 1.2
    assert logp.grad[0, 1].item() == pytest.approx(-1.1 / 2)  # -A * ratio / 2 tokens


def test_clip_fractions_count_only_masked_tokens():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[3.0, 3.0, 1.0, 3.0]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    out = surrogate(logp, old, torch.tensor([1.0]), mask)
    assert out.clip_high_frac.item() == pytest.approx(2 / 3)


def test_k3_kl_is_zero_when_equal_and_positive_otherwise():
    logp = torch.log(torch.tensor([0.1, 0.5, 0.9]))
    assert torch.equal(k3_kl(logp, logp), torch.zeros(3))
    other = torch.log(torch.tensor([0.2, 0.4, 0.3]))
    kl = k3_kl(logp, other)
    assert (kl > 0).all()
    d = math.log(0.2) - math.log(0.1)
    assert kl[0].item() == pytest.approx(math.exp(d) - d - 1, rel=1e-5)


def test_kl_term_enters_the_loss_with_beta():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    adv = torch.tensor([0.0])
    out = surrogate(logp, logp.clone(), adv, torch.ones(1, 2), ref_logp=ref, beta=0.1)
    d = math.log(0.5)  # ref - logp on the first token
    k = math.exp(d) - d - 1
    assert out.kl.item() == pytest.approx(k / 2, rel=1e-5)
    assert out.loss.item() == pytest.approx(0.1 * k / 2, rel=1e-5)
    # beta 0 ignores the reference entirely
    out0 = surrogate(logp, logp.clone(), adv, torch.ones(1, 2), ref_logp=ref, beta=0.0)
    assert out0.loss.item() == 0.0 and out0.kl.item() == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_is_the_k3_estimate_times_the_importance_ratio(level):
    # TRL's use_bias_correction_kl (its default): beta * k3 * r, r differentiable, so even at
    # r = 1 the gradient differs from that of beta * k3: d(k r)/dlogp = dk/dlogp + k
    g = torch.Generator().manual_seed(5)
    logp0 = torch.randn(2, 3, generator=g) - 1
    old, ref = (
        logp0 + 0.1 * torch.randn(2, 3, generator=g),
        logp0 + 0.3 * torch.randn(2, 3, generator=g),
    )
    adv, mask = torch.zeros(2), torch.tensor([[1, 1, 1], [1, 1, 0]])
    grads, losses = {}, {}
    for corrected in (True, False):
        logp = logp0.clone().requires_grad_()
        out = surrogate(
            logp,
            old,
            adv,
            mask,
            ref_logp=ref,
            beta=0.1,
            use_bias_correction_kl=corrected,
            importance_sampling_level=level,
        )
        out.loss.backward()
        grads[corrected], losses[corrected] = logp.grad, out.loss
    from mutualrl.grpo import importance_ratio

    r = importance_ratio(logp0, old, mask, level)
    k = k3_kl(logp0, ref)
    m = mask.float()
    assert losses[True].item() == pytest.approx(float(0.1 * (k * r * m).sum() / m.sum()), rel=1e-6)
    assert losses[False].item() == pytest.approx(float(0.1 * (k * m).sum() / m.sum()), rel=1e-6)
    assert not torch.allclose(grads[True], grads[False])
    if level == "token":
        # on-policy (r = 1) the values agree; the gradients differ by beta * k3 per token / N
        on = {}
        for corrected in (True, False):
            logp = logp0.clone().requires_grad_()
            out = surrogate(
                logp, logp0, adv, mask, ref_logp=ref, beta=0.1, use_bias_correction_kl=corrected
            )
            out.loss.backward()
            on[corrected] = (out.loss.item(), logp.grad)
        assert on[True][0] == pytest.approx(on[False][0], rel=1e-6)
        torch.testing.assert_close(on[True][1] - on[False][1], 0.1 * k * m / m.sum())


def test_sample_weight_scales_each_sequence():
    logp = torch.zeros(2, 2)
    adv = torch.tensor([1.0, 1.0])
    mask = torch.ones(2, 2)
    base = surrogate(logp, logp.clone(), adv, mask, loss_type="grpo")
    assert base.loss.item() == pytest.approx(-1.0)
    weighted = surrogate(
        logp, logp.clone(), adv, mask, loss_type="grpo", sample_weight=torch.tensor([0.5, 0.0])
    )
    assert weighted.loss.item() == pytest.approx(-0.25)
    doubled = surrogate(
        logp, logp.clone(), adv, mask, loss_type="grpo", sample_weight=torch.tensor([2.0, 2.0])
    )
    assert doubled.loss.item() == pytest.approx(2 * base.loss.item())


def test_sample_weight_is_not_differentiated():
    w = torch.tensor([0.5], requires_grad=True)
    logp = torch.zeros(1, 1, requires_grad=True)
    out = surrogate(
        logp, logp.detach().clone(), torch.tensor([1.0]), torch.ones(1, 1), sample_weight=w
    )
    out.loss.backward()
    assert w.grad is None
    assert logp.grad.item() == pytest.approx(-0.5)


def test_selective_log_softmax_equals_log_softmax_gather():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen) * 4
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    want = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, targets), want)


def test_token_logprobs_agree_with_the_selective_path_in_value_and_gradient():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 4
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    grads = []
    for fn in (selective_log_softmax, lambda z, t: token_logprobs(z, t)[0]):
        logits = base.clone().requires_grad_()
        logp = fn(logits, targets)
        (logp * weights).sum().backward()
        grads.append((logp.detach(), logits.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    _, logp_all = token_logprobs(base, targets)
    torch.testing.assert_close(entropy_from_logprobs(logp_all), entropy_from_logits(base))
    p = torch.softmax(base, -1)
    torch.testing.assert_close(entropy_from_logits(base), -(p * p.log()).sum(-1))


def test_entropy_from_logits():
    uniform = torch.zeros(1, 1, 8)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(8), rel=1e-6)
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_completion_mask_lengths_and_truncation():
    ids = torch.zeros(3, 4, dtype=torch.long)
    lengths = torch.tensor([2, 4, 0])
    truncated = torch.tensor([False, True, False])
    mask = completion_mask(ids, lengths, truncated, mask_truncated=False)
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [False] * 4]
    masked = completion_mask(ids, lengths, truncated, mask_truncated=True)
    assert masked.tolist() == [[True, True, False, False], [False] * 4, [False] * 4]


# ---- GSPO: importance_sampling_level = "sequence" --------------------------------------------
def test_sequence_ratio_is_the_length_normalised_mean_of_token_log_ratios():
    from mutualrl.grpo import importance_ratio

    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    old = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # row 0: token log-ratios 0.5, -1.0 (the third is masked) -> mean -0.25; row 1: 0
    seq = importance_ratio(logp, old, mask, "sequence")
    torch.testing.assert_close(seq, torch.tensor([[math.exp(-0.25)] * 3, [1.0] * 3]))
    torch.testing.assert_close(importance_ratio(logp, old, mask, "token"), torch.exp(logp - old))
    with pytest.raises(ValueError, match="importance_sampling_level"):
        importance_ratio(logp, old, mask, "tokens")


def test_sequence_level_clips_whole_sequences_and_token_level_is_the_default():
    # token log-ratios log 2 and log 0.5: token level clips each (A>0: 1.2 and 0.5);
    # sequence level sees their mean, 0 -> ratio 1 on both tokens, nothing clipped
    logp = torch.log(torch.tensor([[2.0, 0.5]]))
    old = torch.zeros(1, 2)
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    tok = surrogate(logp, old, adv, mask)
    assert tok.loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    assert tok.clip_high_frac.item() == pytest.approx(0.5)
    seq = surrogate(logp, old, adv, mask, importance_sampling_level="sequence")
    assert seq.loss.item() == pytest.approx(-1.0)
    assert seq.clip_high_frac.item() == 0
    # a sequence ratio of exp(1) > 1.2 with A > 0 is clipped on every token: no gradient
    lp = torch.tensor([[1.5, 0.5]], requires_grad=True)
    out = surrogate(lp, old, adv, mask, importance_sampling_level="sequence")
    out.loss.backward()
    assert out.clip_high_frac.item() == 1.0 and lp.grad.abs().sum().item() == 0


def test_sequence_level_gradient_at_ratio_one_is_the_token_mean():
    # d/dlogp_t of -A * exp(mean(logp - old)) at ratio 1: -A / n_tokens per token; dapo over
    # 2 tokens then halves it: loss = mean over tokens of the same sequence value
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    out = surrogate(
        logp,
        logp.detach().clone(),
        torch.tensor([3.0]),
        torch.ones(1, 2),
        importance_sampling_level="sequence",
    )
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -1.5]]))
