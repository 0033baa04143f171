"""The GRPO math keeps every tensor on its inputs' device.

A tensor made without ``device=`` lands on the CPU; on a GPU run it then meets CUDA tensors and
the update fails ("Expected all tensors to be on the same device"), as ``dapo``'s and
``dr_grpo``'s row scales once did under micro-batching. The ``meta`` device catches the same
mistake on a machine without a GPU: an op that mixes a meta tensor with a CPU one (other than a
0-dim scalar) raises, so each function below runs on meta inputs and must return meta tensors.
"""

import pytest
import torch

from mutualrl.grpo import NORMALISERS, aggregate, row_scales, scaled_sum
from mutualrl.grpo.loss import SurrogateSettings, clipped_surrogate, completion_mask
from mutualrl.grpo.normalise import LossShare

META = torch.device("meta")
B, T = 4, 6


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device=META)


@pytest.mark.parametrize("loss_type", sorted(NORMALISERS))
def test_normalisers_stay_on_the_device(loss_type):
    mask = meta(B, T)
    scales = row_scales(mask, loss_type, max_completion_length=T, skipped_rows=1, skipped_tokens=3)
    assert scales.device == META and scales.shape == (B,)
    assert scaled_sum(meta(B, T), mask, scales).device == META
    assert aggregate(meta(B, T), mask, loss_type, T, 1, 3).device == META


@pytest.mark.parametrize("loss_type", sorted(NORMALISERS))
@pytest.mark.parametrize("micro_batch", [False, True])
def test_the_clipped_surrogate_stays_on_the_device(loss_type, micro_batch):
    mask = meta(B, T, dtype=torch.bool)
    share = LossShare(row_scale=row_scales(mask, loss_type, T)) if micro_batch else LossShare()
    settings = SurrogateSettings(
        epsilon=0.2, epsilon_high=0.28, loss_type=loss_type, max_completion_length=T, beta=0.04
    )
    out = clipped_surrogate(
        meta(B, T),
        meta(B, T),
        meta(B),
        mask,
        settings,
        ref_logp=meta(B, T),
        sample_weight=meta(B),
        sampler_weight=meta(B, T),
        share=share,
    )
    assert {t.device for t in (out.loss, out.clip_low_frac, out.clip_high_frac, out.kl)} == {META}


def test_the_completion_mask_stays_on_the_device():
    ids, lengths = meta(B, T, dtype=torch.long), meta(B, dtype=torch.long)
    mask = completion_mask(ids, lengths, meta(B, dtype=torch.bool), mask_truncated=True)
    assert mask.device == META and mask.shape == (B, T)
