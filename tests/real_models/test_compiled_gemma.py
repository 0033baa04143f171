"""Compiled decoding on the real Gemma 3 270M, whose sliding-window layers would make a compiled
decode step compile anew at every step: one graph for the call, and the eager sampler's greedy
tokens."""

from __future__ import annotations

import pytest
import torch

from mutualrl.config import GRPOConfig, PolicyConfig
from mutualrl.policies.generation import SamplingSettings, generation_stats
from mutualrl.policies.policy import Policy
from tests.real_models.test_training import PROMPTS

pytestmark = pytest.mark.real_models
NEW = 12


def test_gemma3_compiles_its_decode_step_once_and_decodes_the_eager_tokens(converted):
    torch.set_num_threads(2)
    grpo = GRPOConfig(num_generations=2, max_completion_length=NEW, generation_compile="decode")
    cfg = PolicyConfig(name="g", checkpoint=str(converted["gemma-3-270m"][0]))
    policy = Policy(cfg, grpo, seed=0)
    ids = [policy.encode_prompt(p.text) for p in PROMPTS]

    def greedy(mode: str):
        settings = SamplingSettings(
            2, NEW, 0.0, cache_implementation="static", generation_compile=mode
        )
        return policy.backend.generate(PROMPTS, ids, settings)

    eager, fast = greedy("off"), greedy("decode")
    stats = generation_stats(policy.backend)
    assert stats["generation/compiled_graphs"] == 1  # not one per decode step
    assert max(len(s.completion_ids) for s in fast) > 2  # decode steps ran
    assert [s.completion_ids for s in fast] == [s.completion_ids for s in eager]
    for a, b in zip(fast, eager):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )
