"""A group's prompt computed once (training.shared_prefix, policies/prefix.py): the log-probs, the
loss and the gradients equal the unshared pass's, on the Llama, Qwen2 and Gemma 3 model classes
(sliding-window layers shorter than the prompt included), with LoRA, micro-batches, the chunked
LM head, and peer rows under another rendering of the prompt; and the prompt really runs once.
The sampler prefills each distinct prompt once and draws the tokens it drew before (dynamic,
static and compiled caches)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

from mutualrl.config import GRPOConfig, LoraConfig, TrainingConfig
from mutualrl.policies.batch import TrainBatch, TrainSequence, collate
from mutualrl.policies.generation import SamplingSettings
from mutualrl.policies.generation.torch import TorchBackend
from mutualrl.policies.logprobs import LogProbs
from mutualrl.policies.prefix import prefix_groups
from tests.policies.test_generation import PROMPTS
from tests.policies.test_update import GRAD_TOL, PARAM_ATOL, make_policy, run_step

VOCAB, PAD = 300, 0
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=PAD,
    max_position_embeddings=128,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    "qwen2": lambda: Qwen2Config(**SMALL),
    # a window of 4 keys, shorter than every prompt: the completions' sliding layers see only
    # the prompt's last positions, through the cache's window as through the unshared mask
    "gemma3": lambda: Gemma3TextConfig(
        **SMALL,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def grouped_rows(generator: torch.Generator):
    """Three prompts of different lengths, four completions each of 1-6 tokens, and two peer
    rows whose prompt is a different rendering of the first problem; rows interleaved."""
    prompts = [
        tuple(torch.randint(5, VOCAB, (n,), generator=generator).tolist()) for n in (9, 6, 12)
    ]
    peer = prompts[0][1:] + (7,)
    rows = []
    for _ in range(4):
        for p in prompts:
            n = int(torch.randint(1, 7, (), generator=generator))
            rows.append((p, tuple(torch.randint(5, VOCAB, (n,), generator=generator).tolist())))
    rows += [(peer, (11, 12, 13)), (peer, (14,))]
    return [r[0] for r in rows], [r[1] for r in rows]


def logprobs(shared: bool, chunk: int | None = None, top_k: int = 0) -> LogProbs:
    return LogProbs(
        "p",
        torch.device("cpu"),
        PAD,
        GRPOConfig(temperature=0.7, top_k=top_k),
        TrainingConfig(logprob_chunk_size=chunk),
        bf16=False,
        shared_prefix=shared,
    )


def test_rows_are_grouped_by_their_whole_collated_prompt():
    prompts = [(5, 6, 7), (5, 6, 7), (6, 7), (5, 6, 7), (8, 6, 7)]
    c = collate(prompts, [(1,), (2, 3), (4,), (5,), (6,)], PAD)
    P = c.input_ids.shape[1] - c.completion_len
    groups = prefix_groups(c.input_ids, c.attention_mask, P)
    assert groups is not None and groups.count == 3
    rows_of = [groups.first[groups.inverse[i]].item() for i in range(5)]
    assert rows_of == [0, 0, 2, 0, 4]  # each row's prompt is computed from its first row
    distinct = collate(prompts[2:], [(1,)] * 3, PAD)
    assert prefix_groups(distinct.input_ids, distinct.attention_mask, 3) is None


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("chunk", [None, 8], ids=["head", "chunked"])
def test_shared_log_probs_and_gradients_equal_the_unshared(arch, chunk):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch]()).float()
    prompts, completions = grouped_rows(torch.Generator().manual_seed(1))
    c = collate(prompts, completions, PAD)
    results = []
    for shared in (False, True):
        model.zero_grad()
        logp, _ = logprobs(shared, chunk).token_logprobs(model, c, entropy=False)
        valid = torch.arange(c.completion_len) < c.lengths.unsqueeze(1)
        (logp * valid).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logp.detach() * valid, grads))
    (plain, plain_grad), (shared_logp, shared_grad) = results
    torch.testing.assert_close(shared_logp, plain, atol=1e-5, rtol=1e-5)
    # each prompt position's gradient is summed over its group's rows in another order: fp32
    # rounding of the largest entries (relative 6e-7 of the gradient's norm, Gemma 3's largest)
    torch.testing.assert_close(
        shared_grad, plain_grad, atol=1e-6 * plain_grad.abs().max(), rtol=1e-4
    )
    assert (shared_grad - plain_grad).norm() < 2e-6 * plain_grad.norm()


def test_shared_log_probs_under_top_k_truncation_equal_the_unshared():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"]()).float().eval()
    prompts, completions = grouped_rows(torch.Generator().manual_seed(2))
    c = collate(prompts, completions, PAD)
    with torch.no_grad():
        a = logprobs(False, top_k=20).plain_logprobs(model, c)
        b = logprobs(True, top_k=20).plain_logprobs(model, c)
    valid = torch.arange(c.completion_len) < c.lengths.unsqueeze(1)
    torch.testing.assert_close(b * valid, a * valid, atol=1e-5, rtol=1e-5)


def test_the_prompt_runs_once_per_group_and_completions_once_per_row():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"]()).float()
    prompts, completions = grouped_rows(torch.Generator().manual_seed(1))
    c = collate(prompts, completions, PAD)
    shapes: list[tuple[int, int]] = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: shapes.append(tuple(args[0].shape))
    )
    try:
        logprobs(True).token_logprobs(model, c)
    finally:
        hook.remove()
    B, T = c.input_ids.shape[0], c.completion_len
    P = c.input_ids.shape[1] - T
    assert shapes == [(4, P), (B, T - 1)]  # 3 prompts and the peers' rendering; then the tails
    assert 4 * P + B * (T - 1) < 0.6 * B * (P + T)


def grouped_batch(p) -> TrainBatch:
    """Two groups of four own rows, and a peer group under its own prompt rendering."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for j, text in enumerate(["first: cat dog sun =", "second: a b c d e f ="]):
        for k in range(4):
            n = 1 + (j + k) % 4
            ids = tuple(int(t) for t in torch.randint(100, 30000, (n,), generator=g))
            old = tuple(float(x) for x in -10 + 0.5 * torch.randn(n, generator=g))
            seqs.append(
                TrainSequence(
                    p.encode_prompt(text),
                    ids,
                    advantage=float(torch.randn((), generator=g)),
                    old_logprobs=old,
                    truncated=k == 3,
                )
            )
    for k in range(3):
        ids = tuple(int(t) for t in torch.randint(100, 30000, (2 + k,), generator=g))
        seqs.append(
            TrainSequence(
                p.encode_prompt("First problem: cat dog sun ="),
                ids,
                advantage=float(torch.randn((), generator=g)),
                weight=0.5,
                source="peer",
            )
        )
    return TrainBatch(sequences=tuple(seqs))


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(per_device_train_batch_size=4),
        dict(per_device_train_batch_size=5, logprob_chunk_size=6, beta=0.05),
        dict(lora=True, per_device_train_batch_size=4),
    ],
    ids=["whole", "micro-batches", "chunked-kl", "lora"],
)
def test_a_shared_prefix_step_equals_the_unshared_step(tokenizer_handles, settings):
    settings = dict(settings, loss_type="dapo", num_iterations=2)
    lora = LoraConfig(r=4, alpha=8) if settings.pop("lora", False) else None
    steps = []
    for shared in (False, True):
        p = make_policy(
            tokenizer_handles, lora=lora, shared_prefix=shared, learning_rate=1e-3, **settings
        )
        assert p.learner.logprobs.shared_prefix is shared
        stats, grads = run_step(p, grouped_batch(p))
        steps.append((stats, grads, [q.detach().clone() for q in p.model.parameters()]))
    (s0, g0, w0), (s1, g1, w1) = steps
    assert s1["loss"] == pytest.approx(s0["loss"], rel=1e-5, abs=1e-7)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, **GRAD_TOL)
    for a, b in zip(w0, w1):
        torch.testing.assert_close(b, a, atol=PARAM_ATOL, rtol=0)


def test_shared_prefix_is_off_where_the_model_keeps_no_cache(tokenizer_handles):
    p = make_policy(tokenizer_handles, gradient_checkpointing=True)
    assert p.learner.logprobs.shared_prefix is False
    assert make_policy(tokenizer_handles).learner.logprobs.shared_prefix is True


# ---- the sampler: each distinct prompt prefilled once ------------------------------------------
SAMPLER_SHAPES = ["llama", "gemma3", "llama-lora"]


def unshared(monkeypatch) -> None:
    """The prefill before: every row computes its prompt (the sampler's own switch)."""
    monkeypatch.setattr(TorchBackend, "share_prompts", False)


def assert_same_draws(once, every) -> None:
    assert [s.completion_ids for s in once] == [s.completion_ids for s in every]
    for a, b in zip(once, every):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic", "static"])
@pytest.mark.parametrize("shape", SAMPLER_SHAPES)
def test_prefilling_each_prompt_once_draws_the_same_tokens(
    tokenizer_handles, monkeypatch, shape, cache
):
    from tests.policies.test_static_cache import draw, make

    pol = make(tokenizer_handles, shape, cache)
    once = draw(pol, cache)
    with monkeypatch.context() as m:
        unshared(m)
        every = draw(pol, cache)
    assert max(len(s.completion_ids) for s in once) > 1  # decode steps ran
    assert_same_draws(once, every)


def test_the_sampler_prefills_each_distinct_prompt_once(tokenizer_handles):
    from tests.policies.test_static_cache import draw, make

    pol = make(tokenizer_handles, "llama", None)
    shapes: list[tuple[int, int]] = []
    hook = pol.model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: shapes.append(tuple(args[0].shape))
    )
    try:
        draw(pol, None)
    finally:
        hook.remove()
    assert shapes[0][0] == 2  # two prompts, four completions each: two prompt rows
    assert all(s == (8, 1) for s in shapes[1:])  # then one token per completion a step


def test_compiled_decoding_prefills_each_prompt_once_and_draws_the_same_tokens(
    tokenizer_handles, monkeypatch
):
    from tests.policies.test_static_cache import make

    pol = make(tokenizer_handles, "llama", "static", new_tokens=6)
    settings = SamplingSettings(
        4, 6, 1.0, cache_implementation="static", generation_compile="decode"
    )
    ids = [pol.encode_prompt(p.text) for p in PROMPTS]

    def sample():
        backend = TorchBackend(pol, pol.learner, torch.Generator().manual_seed(5))
        return backend.generate(PROMPTS, ids, settings)

    once = sample()
    with monkeypatch.context() as m:
        unshared(m)
        every = sample()
    assert_same_draws(once, every)
