"""Compiled decoding in the torch sampler (``grpo.generation_compile = "decode"``): the decode step
through torch.compile over the static cache, shapes bucketed, compilations counted.

Each compiled policy is built once per module (a compile of these 2-layer models takes ~20 s of
inductor on one CPU thread) and every test below draws from that one backend: a new backend
would compile anew."""

from __future__ import annotations

import pytest
import torch

from mutualrl.config import ConfigError, GRPOConfig, PolicyConfig, load_config
from mutualrl.policies.generation import SamplingSettings, generation_stats
from mutualrl.policies.generation.compiled import PROMPT_FLOOR, bucket
from mutualrl.policies.models import ARCHITECTURES
from mutualrl.policies.policy import Policy
from mutualrl.tasks.base import Prompt
from tests.policies.draws import assert_same_up_to_a_rounding_flip
from tests.policies.test_generation import PROMPTS, trainer_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPES = {
    "llama": ("llama", "mistral-v1"),
    "qwen2": ("qwen2", "deepseek-v3"),
    "gemma3": ("gemma3", "mistral-v1"),  # sliding-window layers (window 512)
}
NEW = 8  # new tokens: every call below shares one cache length, so one bucket per batch size
# Prompts of other lengths than PROMPTS' (7-8 tokens), all within the first prompt bucket
OTHER = [
    Prompt(text="first: one two three four five six =", answer=" one", family="first"),
    Prompt(text="last: a b =", answer=" b", family="last"),
]


def build(handles, shape: str, device: str = "cpu") -> Policy:
    arch, tok = SHAPES[shape]
    grpo = GRPOConfig(
        num_generations=4, max_completion_length=NEW, temperature=1.0, generation_compile="decode"
    )  # cache_implementation unset: static
    cfg = PolicyConfig(
        name="p", architecture=arch, tokenizer=tok, hidden_size=64, num_layers=2, num_heads=2
    )
    return Policy(cfg, grpo, seed=0, handle=handles[tok], device=device)


@pytest.fixture(scope="module")
def compiled(tokenizer_handles):
    made: dict[str, Policy] = {}

    def get(shape: str) -> Policy:
        if shape not in made:
            made[shape] = build(tokenizer_handles, shape)
        return made[shape]

    return get


def draw(
    pol: Policy, mode: str, temperature: float, prompts=PROMPTS, per_prompt: int = 4, seed: int = 5
):
    """``per_prompt`` completions per prompt from the policy's own backend and generator."""
    settings = SamplingSettings(
        per_prompt, NEW, temperature, cache_implementation="static", generation_compile=mode
    )
    pol.backend.generator.manual_seed(seed)
    ids = [pol.encode_prompt(p.text) for p in prompts]
    return pol.backend.generate(prompts, ids, settings)


def graphs(pol: Policy) -> int:
    return sum(d.graphs for d in pol.backend._decoders.values())


@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_greedy_decoding_gives_the_eager_tokens(compiled, shape):
    pol = compiled(shape)
    eager, fast = draw(pol, "off", 0.0), draw(pol, "decode", 0.0)
    assert graphs(pol) >= 1  # it did compile
    assert max(len(s.completion_ids) for s in fast) > 1  # decode steps ran
    assert [s.completion_ids for s in fast] == [s.completion_ids for s in eager]
    for a, b in zip(fast, eager):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )


def test_sliding_window_layers_within_their_window_compile_once_per_bucket(compiled):
    # Gemma 3's sliding-window cache layer counts its tokens in a Python int: compiled as it is,
    # the decode step would compile anew at every step (up to dynamo's recompile limit)
    pol = compiled("gemma3")
    draw(pol, "decode", 0.0)
    before = graphs(pol)
    assert before == 1  # one bucket, one graph, however many decode steps
    draw(pol, "decode", 1.0, prompts=OTHER, per_prompt=3)  # the same bucket
    assert graphs(pol) == before


def test_a_bucket_that_outgrows_the_sliding_window_decodes_eagerly_with_a_warning(
    tokenizer_handles, monkeypatch
):
    def narrow(p, t):  # Gemma 3 with a window of 8 tokens: prompt bucket + new tokens exceed it
        config = ARCHITECTURES.get("gemma3")(p, t)
        config.sliding_window = 8
        return config

    monkeypatch.setitem(ARCHITECTURES._items, "gemma3-narrow", narrow)
    monkeypatch.setitem(SHAPES, "gemma3-narrow", ("gemma3-narrow", "mistral-v1"))
    pol = build(tokenizer_handles, "gemma3-narrow")
    eager = draw(pol, "off", 0.0)
    with pytest.warns(UserWarning, match=r"generation_compile.*24 tokens.*sliding window"):
        fast = draw(pol, "decode", 0.0)
    assert graphs(pol) == 0
    assert max(len(s.completion_ids) for s in fast) > 1
    assert [s.completion_ids for s in fast] == [s.completion_ids for s in eager]


def test_compiled_sampling_draws_the_eager_tokens_from_the_same_generator(compiled):
    pol = compiled("llama")
    eager, fast = draw(pol, "off", 1.0, seed=11), draw(pol, "decode", 1.0, seed=11)
    assert max(len(s.completion_ids) for s in fast) > 1
    for a, b in zip(fast, eager):  # fp32, other kernels: equal up to a draw on a token boundary
        assert_same_up_to_a_rounding_flip(
            a.completion_ids, a.logprobs, b.completion_ids, b.logprobs, atol=1e-4
        )
    # the behaviour log-probs are the trainer's own: no mismatch to correct
    for s, lp in zip(fast, trainer_logprobs(pol, fast)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=1e-4, rtol=0)


def test_other_prompt_lengths_and_row_counts_in_the_same_bucket_do_not_recompile(compiled):
    pol = compiled("llama")
    draw(pol, "decode", 1.0)  # 8 rows, prompts of 7-8 tokens
    generation_stats(pol.backend)  # read: the counters restart
    before = graphs(pol)
    assert before >= 1
    lengths = {len(pol.encode_prompt(p.text)) for p in OTHER + PROMPTS}
    assert len(lengths) > 2 and max(lengths) <= PROMPT_FLOOR  # other lengths, one bucket
    for per_prompt in (4, 3):  # 8 rows, then 6 padded to 8
        samples = draw(pol, "decode", 1.0, prompts=OTHER, per_prompt=per_prompt)
        assert len(samples) == 2 * per_prompt  # the dummy rows are dropped
    assert graphs(pol) == before
    stats = generation_stats(pol.backend)
    assert stats["generation/compile_s"] == 0 and stats["generation/decode_s"] > 0
    assert stats["generation/compiled_graphs"] == before
    assert stats["generation/decode_tokens_per_s"] > 0


def test_the_setting_reaches_the_sampler_and_its_costs_reach_the_update_stats(compiled):
    pol = compiled("llama")
    before = graphs(pol)
    pol.generate(PROMPTS, 4, NEW, 1.0)  # the policy's own settings
    assert pol.backend._decoders and graphs(pol) == max(before, 1)  # ... took the compiled path
    pol.train_steps = lambda batches, push=True: {}  # only the stats are looked at
    stats, _ = pol.update([])
    assert {"generation/compile_s", "generation/decode_s", "generation/compiled_graphs"} <= set(
        stats
    )


def test_off_is_the_eager_path_and_compiles_nothing(tokenizer_handles, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled with it off"))
    for cache in (None, "static"):
        grpo = GRPOConfig(num_generations=2, max_completion_length=4, cache_implementation=cache)
        assert grpo.generation_compile == "off"  # the default
        cfg = PolicyConfig(
            name="p",
            architecture="llama",
            tokenizer="mistral-v1",
            hidden_size=32,
            num_layers=1,
            num_heads=4,
        )
        pol = Policy(cfg, grpo, seed=0, handle=tokenizer_handles["mistral-v1"])
        pol.generate(PROMPTS, 2, 4, 1.0)
        assert pol.backend._decoders == {} and generation_stats(pol.backend) == {}


def test_the_overlap_sampler_keeps_its_compiled_decoder_from_step_to_step(tokenizer_handles):
    # allocation.async_generation draws from a frozen copy through a new backend every step:
    # the decoders (and their graphs) live in a table the backends share
    cfg = PolicyConfig(
        name="p",
        architecture="llama",
        tokenizer="mistral-v1",
        hidden_size=32,
        num_layers=1,
        num_heads=4,
    )
    pol = Policy(
        cfg, GRPOConfig(generation_compile="decode"), seed=0, handle=tokenizer_handles["mistral-v1"]
    )
    first, second = pol.backend.overlap_sampler(), pol.backend.overlap_sampler()
    assert first._decoders is second._decoders is pol.backend._decoders
    assert first.learner is second.learner  # the same frozen copy
    assert first._decoder() is second._decoder() is not pol.backend._decoder()


def test_buckets_are_powers_of_two_above_a_floor():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 64, 65)] == [1, 2, 4, 8, 8, 16, 64, 128]
    assert [bucket(n, PROMPT_FLOOR) for n in (1, 7, 16, 17)] == [16, 16, 16, 32]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (['grpo.generation_compile="full"'], r"'full'.*\$\.grpo\.generation_compile"),
        (
            ['grpo.generation_compile="decode"', 'grpo.cache_implementation="dynamic"'],
            r"generation_compile.*set cache_implementation = \"static\".*\$\.grpo",
        ),
    ],
)
def test_a_compile_setting_the_sampler_cannot_honour_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", overrides)
    GRPOConfig(generation_compile="decode")  # unset cache: the static one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_decode_step_replays_a_cuda_graph_with_the_eager_tokens(tokenizer_handles):
    pol = build(tokenizer_handles, "llama", device="cuda:0")
    eager, fast = draw(pol, "off", 0.0), draw(pol, "decode", 0.0)
    assert [d.mode for d in pol.backend._decoders.values()] == ["reduce-overhead"]
    assert [s.completion_ids for s in fast] == [s.completion_ids for s in eager]
    before = graphs(pol)
    again = draw(pol, "decode", 1.0, prompts=OTHER, per_prompt=3)
    assert graphs(pol) == before and len(again) == 6
    for s, lp in zip(again, trainer_logprobs(pol, again)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp.cpu(), atol=1e-3, rtol=0)
