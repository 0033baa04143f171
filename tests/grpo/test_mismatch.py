"""Sampler/trainer mismatch weights and the IS-corrected GRPO loss, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from mutualrl.grpo import SurrogateSettings, clipped_surrogate
from mutualrl.grpo.mismatch import importance_weights

# B=2, T=2; the second row has one real token. Log-ratios trainer - sampler: [[0.5, 0], [0, -]].
TRAINER = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
SAMPLER = torch.tensor([[-1.5, -2.0], [-0.5, 0.0]])
MASK = torch.tensor([[True, True], [True, False]])
E = math.exp


@pytest.mark.parametrize(
    "mode,cap,expected",
    [
        ("token_truncate", 1.5, [[1.5, 1.0], [1.0, 1.0]]),  # e^.5 = 1.649 truncated at 1.5
        ("token_mask", 1.5, [[0.0, 1.0], [1.0, 1.0]]),  # e^.5 above the cap: dropped
        (
            "sequence_truncate",
            1.5,
            [[E(0.25), E(0.25)], [1.0, 1.0]],
        ),  # exp(mean(.5, 0)), not exp(sum)
        ("sequence_mask", 1.2, [[0.0, 0.0], [1.0, 1.0]]),  # e^.25 = 1.284 > 1.2: dropped
    ],
)
def test_importance_weights_by_hand(mode, cap, expected):
    w, _ = importance_weights(TRAINER, SAMPLER, MASK, mode, cap)
    torch.testing.assert_close(w, torch.tensor(expected))


@pytest.mark.parametrize(
    "mode,low,high,expected",
    [
        # token ratios e^.5 = 1.649, 1, and (row 1) 1: TRL's [clip_min, clip_max] semantics
        (
            "token_truncate",
            1.2,
            None,
            [[E(0.5), 1.2], [1.2, 1.0]],
        ),  # raised to clip_min; pad stays 1
        ("token_mask", 1.2, 2.0, [[E(0.5), 0.0], [0.0, 1.0]]),  # below clip_min: dropped
        ("token_mask", None, None, [[E(0.5), 1.0], [1.0, 1.0]]),  # no bounds: the plain ratio
        ("sequence_truncate", 0.5, 1.5, [[1.5, 1.5], [1.0, 1.0]]),  # "sum": e^.5 truncated
    ],
)
def test_importance_weights_between_clip_min_and_clip_max(mode, low, high, expected):
    w, stats = importance_weights(TRAINER, SAMPLER, MASK, mode, high, low, sequence_ratio="sum")
    torch.testing.assert_close(w, torch.tensor(expected))
    rho = (
        torch.tensor([E(0.5), 1.0, 1.0])
        if mode.startswith("token")
        else torch.tensor([E(0.5)] * 2 + [1.0])
    )
    outside = ((rho < (low or 0)) | (rho > (high or math.inf))).float().mean().item()
    assert stats["mismatch/is_capped_frac"] == pytest.approx(outside)


def test_sequence_ratio_mean_or_sum_of_token_log_ratios():
    # row 0: log-ratios .5 and 0 -> mean .25 (ours), sum .5 (TRL's); row 1: one token, 0
    mean, _ = importance_weights(TRAINER, SAMPLER, MASK, "sequence_truncate", 10.0)
    total, _ = importance_weights(
        TRAINER, SAMPLER, MASK, "sequence_truncate", 10.0, sequence_ratio="sum"
    )
    torch.testing.assert_close(mean, torch.tensor([[E(0.25)] * 2, [1.0, 1.0]]))
    torch.testing.assert_close(total, torch.tensor([[E(0.5)] * 2, [1.0, 1.0]]))
    with pytest.raises(ValueError, match="sequence_ratio must be one of"):
        importance_weights(TRAINER, SAMPLER, MASK, "sequence_truncate", 10.0, sequence_ratio="max")


def test_mismatch_statistics_by_hand():
    _, stats = importance_weights(TRAINER, SAMPLER, MASK, "token_truncate", 1.5)
    assert stats["mismatch/logp_abs_diff_mean"] == pytest.approx(0.5 / 3)
    assert stats["mismatch/logp_abs_diff_max"] == pytest.approx(0.5)
    assert stats["mismatch/is_ratio_min"] == pytest.approx(1.0)
    assert stats["mismatch/is_ratio_max"] == pytest.approx(E(0.5))
    assert stats["mismatch/is_ratio_mean"] == pytest.approx((E(0.5) + 2) / 3)
    assert stats["mismatch/is_capped_frac"] == pytest.approx(1 / 3)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        importance_weights(TRAINER, SAMPLER, MASK, "sum", 2.0)


@pytest.mark.parametrize(
    "loss_type,expected",
    [
        # per-token -ratio*A with ratio 1 (old = trainer): row 0 (A=1) [-1, -1] weighted [1.5, 1];
        # row 1 (A=-2) [2] weighted 1.
        ("grpo", ((-1.5 - 1.0) / 2 + 2.0) / 2),  # mean of per-sequence means = 0.375
        ("dapo", (-1.5 - 1.0 + 2.0) / 3),  # token mean over the batch
        ("dr_grpo", (-1.5 - 1.0 + 2.0) / (2 * 4)),  # / (B * max_completion_length)
    ],
)
def test_is_corrected_loss_by_hand(loss_type, expected):
    w, _ = importance_weights(TRAINER, SAMPLER, MASK, "token_truncate", 1.5)
    out = clipped_surrogate(
        TRAINER,
        TRAINER,
        torch.tensor([1.0, -2.0]),
        MASK,
        SurrogateSettings(
            epsilon=0.2, epsilon_high=None, loss_type=loss_type, max_completion_length=4
        ),
        sampler_weight=w,
    )
    assert out.loss.item() == pytest.approx(expected)


def test_sampler_weights_correct_the_policy_term_only_and_sample_weights_everything():
    # TRL's order: -min(rA, clip(r)A) * rho + beta * kl; our per-sequence weights multiply both.
    # One token, ratio 1, A = 1: policy term -1; k3 of ref - logp = log .5: .5 - log .5 - 1.
    logp, ref = torch.zeros(1, 1), torch.full((1, 1), math.log(0.5))
    k = 0.5 - math.log(0.5) - 1
    settings = SurrogateSettings(
        epsilon=0.2, epsilon_high=None, loss_type="dapo", max_completion_length=1, beta=0.1
    )
    rho, w = torch.tensor([[0.25]]), torch.tensor([2.0])

    def loss(**kw):
        return clipped_surrogate(
            logp, logp, torch.tensor([1.0]), torch.ones(1, 1), settings, ref_logp=ref, **kw
        ).loss.item()

    assert loss() == pytest.approx(-1 + 0.1 * k)
    assert loss(sampler_weight=rho) == pytest.approx(-0.25 + 0.1 * k)
    assert loss(sample_weight=w) == pytest.approx(2 * (-1 + 0.1 * k))
    assert loss(sampler_weight=rho, sample_weight=w) == pytest.approx(2 * (-0.25 + 0.1 * k))


def test_token_weights_carried_in_train_sequences_reach_the_loss():
    from mutualrl.policies.batch import TrainSequence, collate_sequences

    seqs = (
        TrainSequence(
            prompt_ids=(1,),
            completion_ids=(5, 6),
            advantage=1.0,
            weight=2.0,
            token_weights=(1.5, 1.0),
        ),
        TrainSequence(prompt_ids=(1, 2), completion_ids=(7,), advantage=-2.0),
    )
    c = collate_sequences(seqs, pad_id=0)
    torch.testing.assert_close(c.seq.weights, torch.tensor([[3.0, 2.0], [1.0, 1.0]]))
    out = clipped_surrogate(
        TRAINER,
        TRAINER,
        c.seq.advantages,
        MASK,
        SurrogateSettings(
            epsilon=0.2, epsilon_high=None, loss_type="dapo", max_completion_length=4
        ),
        sample_weight=c.seq.weights,
    )
    assert out.loss.item() == pytest.approx((-3.0 - 2.0 + 2.0) / 3)
    plain = collate_sequences(
        tuple(
            TrainSequence(
                prompt_ids=s.prompt_ids, completion_ids=s.completion_ids, advantage=s.advantage
            )
            for s in seqs
        ),
        pad_id=0,
    )
    assert plain.seq.weights.shape == (2,)  # no token weights: per-sequence, as before
