"""Real-size policies (random init) on a GPU: a bf16 update, its memory report, the sampler's KV
cache against the caching allocator.

Opt-in: ``pytest -m gpu``; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig
from mutualrl.policies.batch import TrainBatch, TrainSequence
from mutualrl.policies.generation import SamplingSettings
from mutualrl.policies.generation.torch import TorchBackend
from mutualrl.policies.policy import Policy
from mutualrl.tasks.base import Prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_half_billion_parameter_policy_takes_a_bf16_micro_batched_chunked_step(tokenizer_handles):
    # Qwen2.5-0.5B's layer dimensions on DeepSeek's 129k vocabulary (tied embeddings)
    cfg = PolicyConfig(
        name="qwen-0.5b",
        architecture="qwen2",
        tokenizer="deepseek-v3",
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        intermediate_size=4864,
        dtype="bf16",
    )
    grpo = GRPOConfig(num_generations=8, max_completion_length=256, beta=0.0, learning_rate=1e-6)
    training = TrainingConfig(
        per_device_train_batch_size=8, logprob_chunk_size=1024, gradient_checkpointing=True
    )
    p = Policy(
        cfg,
        grpo,
        seed=0,
        device="cuda:0",
        handle=tokenizer_handles["deepseek-v3"],
        training=training,
    )
    assert sum(q.numel() for q in p.model.parameters()) > 4e8
    g = torch.Generator().manual_seed(0)
    seqs = tuple(
        TrainSequence(
            tuple(int(t) for t in torch.randint(10, 120000, (64,), generator=g)),
            tuple(int(t) for t in torch.randint(10, 120000, (256,), generator=g)),
            advantage=float(i % 2) - 0.5,
            weight=1.0,
        )
        for i in range(32)
    )
    before = [q.detach().clone() for q in p.model.parameters()]
    torch.cuda.reset_peak_memory_stats()
    stats = p.train_step(TrainBatch(sequences=seqs))
    peak = torch.cuda.max_memory_allocated()
    assert stats["skipped_nan"] == 0.0 and stats["grad_norm"] > 0
    assert any(not torch.equal(a, q) for a, q in zip(before, p.model.parameters()))
    # weights + grads + AdamW moments in fp32 are ~8 GB; whole-batch (32 x 256 x 129k) fp32
    # logits alone would be 4.2 GB more, times three for log-softmax and its gradient.
    assert peak < 14e9, peak
    print(f"peak {peak / 1e9:.2f} GB, step {stats['step_time_s']:.2f} s")


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_every_loss_type_takes_a_micro_batched_step_on_cuda(tokenizer_handles, loss_type):
    # micro-batches make the update use the whole batch's row scales (grpo/normalise.py), which
    # dapo and dr_grpo once built on the CPU: a run on a GPU failed at its first update
    cfg = PolicyConfig(
        name="tiny",
        architecture="llama",
        tokenizer="mistral-v1",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        dtype="bf16",
    )
    grpo = GRPOConfig(num_generations=4, max_completion_length=16, loss_type=loss_type)
    p = Policy(
        cfg,
        grpo,
        seed=0,
        device="cuda:0",
        handle=tokenizer_handles["mistral-v1"],
        training=TrainingConfig(per_device_train_batch_size=2),
    )
    g = torch.Generator().manual_seed(0)
    seqs = tuple(
        TrainSequence(
            tuple(int(t) for t in torch.randint(10, 30000, (8,), generator=g)),
            tuple(int(t) for t in torch.randint(10, 30000, (16 - i,), generator=g)),
            advantage=float(i % 2) - 0.5,
        )
        for i in range(8)
    )
    stats = p.train_step(TrainBatch(sequences=seqs))
    assert stats["skipped_nan"] == 0.0 and stats["grad_norm"] > 0


def test_an_update_reports_the_processes_peak_cuda_memory_and_starts_it_again(tokenizer_handles):
    cfg = PolicyConfig(
        name="tiny",
        architecture="llama",
        tokenizer="mistral-v1",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        dtype="bf16",
    )
    p = Policy(
        cfg,
        GRPOConfig(num_generations=4, max_completion_length=16),
        seed=0,
        device="cuda:0",
        handle=tokenizer_handles["mistral-v1"],
    )
    g = torch.Generator().manual_seed(0)
    seqs = tuple(
        TrainSequence(
            tuple(int(t) for t in torch.randint(10, 30000, (8,), generator=g)),
            tuple(int(t) for t in torch.randint(10, 30000, (16,), generator=g)),
            advantage=float(i % 2) - 0.5,
        )
        for i in range(8)
    )
    held = torch.cuda.memory_allocated() / 2**30  # this process's tensors so far, any test's
    big = torch.empty(2**28, dtype=torch.uint8, device="cuda:0")  # 0.25 GiB more, for now
    del big
    first, _ = p.update([TrainBatch(sequences=seqs)])
    second, _ = p.update([TrainBatch(sequences=seqs)])
    assert first["cuda/peak_allocated_gib"] >= held + 0.25  # the peak since the last report
    assert second["cuda/peak_allocated_gib"] < held + 0.25  # started again after it
    for stats in (first, second):
        assert 0 < stats["cuda/peak_allocated_gib"] <= stats["cuda/peak_reserved_gib"]
        assert stats["cuda/alloc_retries"] == 0


def test_the_static_kv_cache_keeps_reserved_memory_near_allocated_memory(tokenizer_handles):
    # Llama-3.2-1B's layer dimensions (no grouped-query attention: 32 KV heads), 64 rows x 256
    # new tokens: as gpu1-random-1b.toml samples. With the growing cache an H200 run reserved
    # 139 GiB for 18 GiB of tensors (guides/memory.md).
    cfg = PolicyConfig(
        name="llama-1b",
        architecture="llama",
        tokenizer="mistral-v1",
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        intermediate_size=8192,
        dtype="bf16",
    )
    p = Policy(
        cfg,
        GRPOConfig(num_generations=8, max_completion_length=256),
        seed=0,
        device="cuda:0",
        handle=tokenizer_handles["mistral-v1"],
    )
    prompts = [
        Prompt(
            text=f"first: {' '.join(['cat', 'dog', 'sun', 'tree'][i:] * 3)} =",
            answer=" cat",
            family="first",
        )
        for i in range(4)
    ] * 2
    ids = [p.encode_prompt(q.text) for q in prompts]
    seen = {}
    for cache in ("static", None):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        backend = TorchBackend(p, p.learner, torch.Generator().manual_seed(0))
        backend.generate(prompts, ids, SamplingSettings(8, 256, 1.0, cache_implementation=cache))
        seen[cache] = (
            torch.cuda.max_memory_allocated() / 2**30,
            torch.cuda.max_memory_reserved() / 2**30,
        )
        print(
            f"cache {cache or 'dynamic'}: peak allocated {seen[cache][0]:.2f} GiB, "
            f"reserved {seen[cache][1]:.2f} GiB"
        )
    allocated, reserved = seen["static"]
    assert reserved < 1.25 * allocated + 1.0
