"""The torch sampler's preallocated KV cache (``grpo.cache_implementation = "static"``): the same
draws as the growing one, the trainer's own log-probs, and no allocation that grows with the step
(what fragments a GPU's caching allocator; guides/memory.md)."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import StaticCache

from mutualrl.config import GRPOConfig, LoraConfig, PolicyConfig
from mutualrl.policies.generation import SamplingSettings
from mutualrl.policies.generation.torch import TorchBackend
from mutualrl.policies.policy import Policy
from tests.policies.draws import assert_same_up_to_a_rounding_flip
from tests.policies.test_generation import PROMPTS, trainer_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPES = {  # architecture, tokenizer, extra policy settings
    "llama": ("llama", "mistral-v1", {}),
    "qwen2": ("qwen2", "deepseek-v3", {}),
    "gemma3": ("gemma3", "mistral-v1", {}),  # its sliding-window layers become full ones
    "llama-lora": ("llama", "mistral-v1", {"lora": LoraConfig(r=4, alpha=8)}),
}


def make(handles, shape: str, cache: str | None, new_tokens: int = 12, **settings) -> Policy:
    arch, tok, extra = SHAPES[shape]
    grpo = GRPOConfig(
        num_generations=4,
        max_completion_length=new_tokens,
        temperature=1.0,
        learning_rate=1e-2,
        cache_implementation=cache,
    )
    cfg = PolicyConfig(
        name="p",
        architecture=arch,
        tokenizer=tok,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        **extra,
        **settings,
    )
    return Policy(cfg, grpo, seed=0, handle=handles[tok])


def draw(policy: Policy, cache: str | None, new_tokens: int = 12, seed: int = 5):
    settings = SamplingSettings(4, new_tokens, 1.0, cache_implementation=cache)
    ids = [policy.encode_prompt(p.text) for p in PROMPTS]
    backend = TorchBackend(policy, policy.learner, torch.Generator().manual_seed(seed))
    return backend.generate(PROMPTS, ids, settings)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_static_cache_draws_the_dynamic_caches_tokens_with_the_trainers_log_probs(
    tokenizer_handles, shape
):
    pol = make(tokenizer_handles, shape, "static")
    grown, static = draw(pol, None), draw(pol, "static")
    assert max(len(s.completion_ids) for s in static) > 1  # decode steps ran
    assert [s.completion_ids for s in static] == [s.completion_ids for s in grown]
    for a, b in zip(static, grown):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
    for s, lp in zip(static, trainer_logprobs(pol, static)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=1e-4, rtol=0)


def test_under_bf16_autocast_the_static_cache_holds_keys_and_values_in_bf16_and_draws_alike(
    tokenizer_handles,
):
    # bf16 autocast over fp32 weights: the keys leave the rotary embedding in fp32, the values
    # their projection in bf16. transformers 5.17 then allocated both in fp32 and failed to copy
    # the values in (the first GPU run of gpu1-random-1b.toml); later versions kept fp32 keys.
    pol = make(tokenizer_handles, "llama", "static", dtype="bf16")
    caches, real = [], pol.learner.model.forward

    def forward(*a, **kw):  # the sampler passes its cache by whichever name the model takes
        caches.extend(v for v in kw.values() if isinstance(v, StaticCache))
        return real(*a, **kw)

    pol.learner.model.forward = forward
    grown, static = draw(pol, None), draw(pol, "static")
    assert caches and all(
        layer.keys.dtype == layer.values.dtype == torch.bfloat16 for layer in caches[-1].layers
    )
    assert max(len(s.completion_ids) for s in static) > 1
    # bf16's rounding: the padded cache sums in another order (log-probs 9.8e-4 apart with fp32
    # keys too), so a draw can fall on the other side of a token boundary (tests/policies/draws.py:
    # 4 of the 8 draws, at tokens 2-8 of 12, on a CPU with AMX; none on others).
    for a, b in zip(static, grown):
        assert_same_up_to_a_rounding_flip(
            a.completion_ids, a.logprobs, b.completion_ids, b.logprobs, atol=2e-3
        )


def test_the_setting_reaches_the_sampler_from_the_grpo_section(tokenizer_handles):
    for cache, static in ((None, False), ("dynamic", False), ("static", True)):
        pol = make(tokenizer_handles, "llama", cache)
        seen = []
        real = pol.learner.model.forward
        # replaced back by the next iteration, called only within this one
        pol.learner.model.forward = lambda *a, **kw: seen.append(kw) or real(*a, **kw)  # noqa: B023
        pol.generate(PROMPTS, 2, 4, 1.0)
        key = pol.backend.cache_key
        # the decode steps run on it (the prefill of each distinct prompt writes into it)
        assert isinstance(seen[-1].get(key), StaticCache) is static, cache
        assert ("cache_position" in seen[-1]) is static, cache


class Allocations(TorchDispatchMode):
    """The element count of every tensor an op returns, by the model forward it ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.forward, self.sizes = 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.sizes.setdefault(self.forward, Counter())[t.numel()] += 1
        return out


def growing_sizes(tokenizer_handles, cache: str | None) -> tuple[int, int]:
    """(largest tensor whose size is not the same at every decode step, the 2D attention mask's
    size at the last step): sizes that change from step to step are what a caching allocator
    cannot hand back to the next step."""
    pol = make(tokenizer_handles, "llama", cache, new_tokens=10)
    mode = Allocations()
    real = pol.learner.model.forward

    @functools.wraps(real)  # its signature names the cache keyword (cache_keyword)
    def counted(*a, **kw):
        mode.forward += 1
        return real(*a, **kw)

    pol.learner.model.forward = counted
    with mode:
        samples = draw(pol, cache, new_tokens=10)
    decode = [mode.sizes[k] for k in sorted(mode.sizes) if k >= 2]  # forward 1 is the prompt's
    assert len(decode) >= 5  # no early end of every row
    common = set.intersection(*(set(c) for c in decode))
    varying = {n for c in decode for n in c if n not in common}
    rows, prompt = len(samples), max(len(s.prompt_ids) for s in samples)
    return max(varying, default=0), rows * (prompt + 10)


def test_a_static_cache_step_allocates_nothing_that_grows_with_the_step(tokenizer_handles):
    largest, mask = growing_sizes(tokenizer_handles, "static")
    assert largest <= mask  # only the 2D attention mask (rows x tokens so far) grows
    # the growing cache: a new, longer key/value tensor per layer per step (rows x heads x
    # tokens x head_dim), far larger than the mask
    largest, mask = growing_sizes(tokenizer_handles, None)
    assert largest > 8 * mask
