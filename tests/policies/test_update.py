"""The update engine: micro-batched and chunked updates equal the single pass; bf16; schedules."""

from __future__ import annotations

import warnings

import pytest
import torch

from mutualrl.config import GRPOConfig, LoraConfig, PolicyConfig, TrainingConfig
from mutualrl.policies.batch import TrainBatch, micro_batch_slices
from mutualrl.policies.policy import Policy
from mutualrl.policies.update import prepare_model
from tests.policies.batches import mixed_batch

# Micro-batched and chunked steps differ from the single pass only by float summation order:
# gradients agree to GRAD_TOL; parameters after AdamW steps (lr 1e-3) to PARAM_ATOL, 5% of a step
# (AdamW's first steps move near-zero gradients by ~lr, amplifying their rounding).
GRAD_TOL = dict(atol=1e-6, rtol=1e-4)
PARAM_ATOL = 5e-5


def split_settings(kw: dict) -> tuple[dict, dict]:
    """(GRPOConfig fields, TrainingConfig fields) of keyword settings."""
    training = {k: v for k, v in kw.items() if k in TrainingConfig.__struct_fields__}
    return {k: v for k, v in kw.items() if k not in training}, training


def make_policy(
    handles, seed=3, dtype="fp32", total_steps=None, lora: LoraConfig | None = None, **settings
) -> Policy:
    torch.set_num_threads(1)
    cfg = PolicyConfig(
        name="p",
        architecture="llama",
        tokenizer="mistral-v1",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        dtype=dtype,
        lora=lora,
    )
    grpo, training = split_settings(settings)
    g = GRPOConfig(num_generations=4, temperature=0.7, **grpo)
    return Policy(
        cfg,
        g,
        seed=seed,
        handle=handles["mistral-v1"],
        total_steps=total_steps,
        training=TrainingConfig(**training),
    )


def batch_for(p: Policy, sft_coef: float = 0.5, diagnose: bool = False) -> TrainBatch:
    return mixed_batch(p, sft_coef=sft_coef, diagnose=diagnose)


def run_step(p: Policy, batch: TrainBatch):
    """The stats and each optimizer step's flat gradient."""
    grads, step = [], p.learner.optimizer.step

    def recording_step(*a, **k):
        grads.append(
            torch.cat([q.grad.flatten() for q in p.model.parameters() if q.grad is not None])
        )
        return step(*a, **k)

    p.learner.optimizer.step = recording_step
    stats = p.train_step(batch)
    return stats, grads


def test_micro_batch_slices_cover_the_rows_in_order():
    assert micro_batch_slices(7, None, 1) == [slice(0, 7)]
    assert micro_batch_slices(7, 3, 1) == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert micro_batch_slices(7, None, 2) == [slice(0, 4), slice(4, 7)]
    assert micro_batch_slices(7, 4, 3) == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert micro_batch_slices(2, None, 8) == [slice(0, 1), slice(1, 2)]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batched_chunked_step_equals_the_single_pass(tokenizer_handles, loss_type):
    common = dict(
        loss_type=loss_type,
        beta=0.04,
        num_iterations=2,
        epsilon_high=0.28,
        mask_truncated_completions=True,
        max_completion_length=5,
    )
    whole = make_policy(tokenizer_handles, **common)
    split = make_policy(
        tokenizer_handles, per_device_train_batch_size=3, logprob_chunk_size=5, **common
    )
    s_whole, g_whole = run_step(whole, batch_for(whole, diagnose=True))
    s_split, g_split = run_step(split, batch_for(split, diagnose=True))
    assert len(g_whole) == len(g_split) == 2  # one optimizer step per iteration
    for a, b in zip(g_whole, g_split):
        torch.testing.assert_close(b, a, **GRAD_TOL)
    for a, b in zip(whole.model.parameters(), split.model.parameters()):
        torch.testing.assert_close(b, a, atol=PARAM_ATOL, rtol=0)
    for key in (
        "loss",
        "grpo_loss",
        "sft_loss",
        "kl",
        "entropy",
        "clip_ratio_low",
        "clip_ratio_high",
        "grad_norm",
        "grad/own_norm",
        "grad/peer_norm",
        "grad/own_peer_cosine",
    ):
        assert s_split[key] == pytest.approx(s_whole[key], rel=1e-4, abs=1e-6), key
    assert s_whole["kl"] > 0 and s_whole["clip_ratio_low"] + s_whole["clip_ratio_high"] > 0


def test_gradient_accumulation_and_checkpointing_equal_the_single_pass(tokenizer_handles):
    whole = make_policy(tokenizer_handles)
    split = make_policy(
        tokenizer_handles, gradient_accumulation_steps=4, gradient_checkpointing=True
    )
    _, g_whole = run_step(whole, batch_for(whole))
    _, g_split = run_step(split, batch_for(split))
    torch.testing.assert_close(g_split[0], g_whole[0], **GRAD_TOL)


def test_gradient_checkpointing_is_switched_on_without_a_deprecated_call():
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers 5.24 deprecates gradient_checkpointing_enable
        prepare_model(model, TrainingConfig(gradient_checkpointing=True))
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_micro_batched_sft_step_and_sequence_logprobs_equal_the_single_pass(tokenizer_handles):
    whole = make_policy(tokenizer_handles)
    split = make_policy(tokenizer_handles, per_device_train_batch_size=2, logprob_chunk_size=3)
    b = batch_for(whole)
    prompts = [s.prompt_ids for s in b.sequences]
    completions = [s.completion_ids for s in b.sequences]
    torch.testing.assert_close(
        split.sequence_logprobs(prompts, completions),
        whole.sequence_logprobs(prompts, completions),
        atol=1e-4,
        rtol=1e-6,
    )
    loss_whole, loss_split = whole.sft_step(b.sft), split.sft_step(b.sft)
    assert loss_split == pytest.approx(loss_whole, rel=1e-5)
    for a, c in zip(whole.model.parameters(), split.model.parameters()):
        torch.testing.assert_close(c, a, atol=PARAM_ATOL, rtol=0)


def test_nan_in_a_later_micro_batch_skips_the_whole_step(tokenizer_handles, monkeypatch):
    p = make_policy(tokenizer_handles, per_device_train_batch_size=4)
    before = [q.detach().clone() for q in p.model.parameters()]
    real, calls = p.learner.logprobs.completion_logits, []

    def poisoned(model, c, **kw):
        calls.append(1)
        out = real(model, c, **kw)
        return out * float("nan") if len(calls) == 2 else out

    monkeypatch.setattr(p.learner.logprobs, "completion_logits", poisoned)
    stats = p.train_step(batch_for(p, sft_coef=0.0))
    assert stats["skipped_nan"] == 1.0 and p.learner.skipped_nan_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, p.model.parameters()))
    assert len(p.learner.optimizer.state) == 0


def test_bf16_policy_trains_on_cpu_with_fp32_log_probs(tokenizer_handles):
    p = make_policy(tokenizer_handles, dtype="bf16", logprob_chunk_size=4)
    assert all(q.dtype == torch.float32 for q in p.model.parameters())  # fp32 master weights
    b = batch_for(p)
    parts = p.learner.objective.grpo_parts(p.model, p.learner.reference, b)
    out, ent = p.learner.objective.grpo_loss(p.model, parts, 0, parts.collated.seq.weights)
    assert out.loss.dtype == torch.float32 and ent.dtype == torch.float32
    before = [q.detach().clone() for q in p.model.parameters()]
    stats = p.train_step(b)
    assert stats["skipped_nan"] == 0.0 and torch.isfinite(torch.tensor(stats["loss"]))
    assert any(not torch.equal(a, q) for a, q in zip(before, p.model.parameters()))
    # bf16 compute is close to, not equal to, fp32 compute
    ref = make_policy(tokenizer_handles)
    prompts = [s.prompt_ids for s in b.sequences]
    completions = [s.completion_ids for s in b.sequences]
    fp32 = ref.sequence_logprobs(prompts, completions)
    bf16 = make_policy(tokenizer_handles, dtype="bf16").sequence_logprobs(prompts, completions)
    assert not torch.equal(bf16, fp32)
    torch.testing.assert_close(bf16, fp32, atol=0.5, rtol=0.05)


def test_linear_warmup_schedule_moves_the_learning_rate(tokenizer_handles):
    p = make_policy(
        tokenizer_handles,
        total_steps=4,
        lr_scheduler_type="linear",
        warmup_ratio=0.5,
        learning_rate=1e-3,
    )
    seen, step = [], p.learner.optimizer.step
    p.learner.optimizer.step = lambda *a, **k: (
        seen.append(p.learner.optimizer.param_groups[0]["lr"]),
        step(*a, **k),
    )[1]
    b = batch_for(p)
    for _ in range(4):
        p.train_step(b)
    # warmup over ceil(0.5 * 4) = 2 steps, then linear decay to 0 at step 4
    assert seen == pytest.approx([0.0, 5e-4, 1e-3, 5e-4])
    # an SFT-only batch with its own rate neither uses nor advances the schedule
    p.train_step(TrainBatch(sft=b.sft, sft_coef=1.0, tag="sft", learning_rate=3e-2))
    assert seen[-1] == 3e-2 and p.learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
    assert p.learner.scheduler.last_epoch == 4


def test_scheduler_state_travels_with_save_state(tokenizer_handles, tmp_path):
    kw = dict(total_steps=10, lr_scheduler_type="cosine", warmup_ratio=0.1)
    a = make_policy(tokenizer_handles, **kw)
    a.train_step(batch_for(a))
    a.train_step(batch_for(a))
    a.save_state(tmp_path / "a.pt")
    b = make_policy(tokenizer_handles, **kw)
    b.load_state(tmp_path / "a.pt")
    assert b.learner.scheduler.last_epoch == a.learner.scheduler.last_epoch == 2
    assert b.learner.optimizer.param_groups[0]["lr"] == a.learner.optimizer.param_groups[0]["lr"]
    a.train_step(batch_for(a))
    b.train_step(batch_for(b))
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def test_default_optimizer_is_torchs_adamw_default(tokenizer_handles):
    p = make_policy(tokenizer_handles)
    assert (
        p.learner.optimizer.param_groups[0]["weight_decay"]
        == torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]
    )
    assert p.learner.optimizer.param_groups[0]["lr"] == 1e-3


def test_schedules_other_than_constant_need_the_run_length(tokenizer_handles):
    with pytest.raises(ValueError, match="lr_scheduler_type.*total_steps"):
        make_policy(tokenizer_handles, lr_scheduler_type="linear")


def test_lora_policy_micro_batched_and_chunked_equals_the_single_pass(tokenizer_handles):
    """The reference of a LoRA policy is its adapter disabled, on the chunked path too."""
    from mutualrl.config import LoraConfig

    def lora_policy(**training):
        torch.set_num_threads(1)
        cfg = PolicyConfig(
            name="p",
            architecture="llama",
            tokenizer="mistral-v1",
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            lora=LoraConfig(r=4, alpha=8),
        )
        return Policy(
            cfg,
            GRPOConfig(num_generations=4, temperature=0.7, beta=0.04),
            seed=3,
            handle=tokenizer_handles["mistral-v1"],
            training=TrainingConfig(**training),
        )

    whole, split = lora_policy(), lora_policy(per_device_train_batch_size=2, logprob_chunk_size=4)
    _, g_whole = run_step(whole, batch_for(whole))
    _, g_split = run_step(split, batch_for(split))
    torch.testing.assert_close(g_split[0], g_whole[0], **GRAD_TOL)
    s_whole, _ = run_step(whole, batch_for(whole))
    s_split, _ = run_step(split, batch_for(split))
    assert s_whole["kl"] > 0 and s_split["kl"] == pytest.approx(s_whole["kl"], rel=1e-3)


def test_peer_rows_keep_the_first_passs_log_probs_and_are_clipped_on_later_iterations(
    tokenizer_handles,
):
    """A row without behaviour log-probs (a peer's sample) takes the policy's own before the
    update as its old log-probs, once: its update equals that of the row given those log-probs.
    Before, they were taken again at every pass, so its ratio stayed 1 on every iteration and the
    clip never acted on it."""
    from dataclasses import replace

    from mutualrl.policies.batch import collate_sequences

    common = dict(num_iterations=3, epsilon=0.05, learning_rate=3e-2)
    given, missing = (
        make_policy(tokenizer_handles, **common),
        make_policy(tokenizer_handles, **common),
    )
    for p in (given, missing):  # see below
        p.learner.optimizer.param_groups[0]["eps"] = 1e-3
    batch = batch_for(missing, sft_coef=0.0)
    assert any(s.old_logprobs is None for s in batch.sequences)
    given.model.train()
    logp = given.learner.logprobs.batch_logprobs(
        given.model, collate_sequences(batch.sequences, given.pad_id)
    )
    filled = tuple(
        s
        if s.old_logprobs is not None
        else replace(s, old_logprobs=tuple(logp[i, : len(s.completion_ids)].tolist()))
        for i, s in enumerate(batch.sequences)
    )
    given.train_step(replace(batch, sequences=filled))
    s_missing = missing.train_step(batch)
    # The two take the old log-probs through batches of different shapes, whose float32 rounding
    # differs on some CPUs (an AMD EPYC host). AdamW's default eps (1e-8) turns such a difference
    # in a near-zero gradient into a step of the learning rate's size (3e-4 on a parameter after
    # three steps at 3e-2 there); with eps 1e-3 a step stays in proportion to its gradient.
    # Taking the old log-probs again at every pass would change whole rows' gradients instead.
    for a, b in zip(given.model.parameters(), missing.model.parameters()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert s_missing["clip_ratio_low"] + s_missing["clip_ratio_high"] > 0
