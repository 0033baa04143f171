"""The peak accelerator memory an update reports (policies/device_memory.py): nothing off CUDA.
Its CUDA side is checked on a GPU (tests/policies/test_update_gpu.py)."""

from __future__ import annotations

import torch

from mutualrl.policies.device_memory import peak_memory_stats
from tests.policies.test_generation import PROMPTS, batch_of, make_policy


def test_no_memory_report_off_cuda():
    assert peak_memory_stats("cpu") == {}
    assert peak_memory_stats(torch.device("meta")) == {}


def test_a_cpu_policys_update_logs_no_cuda_memory(tokenizer_handles):
    pol = make_policy(tokenizer_handles)
    samples = pol.generate(PROMPTS, 4, 4, 0.7)
    stats, version = pol.update([batch_of(samples)])
    assert version == 1 and "grad_norm" in stats
    assert not any(k.startswith("cuda/") for k in stats)
    stats, _, drawn = pol.update_and_generate([batch_of(samples)], PROMPTS, 4, 4, 0.7)
    assert drawn and not any(k.startswith("cuda/") for k in stats)
