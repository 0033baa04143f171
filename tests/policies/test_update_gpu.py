"""A real-size policy (Qwen2.5-0.5B dimensions, random init) through one bf16 update on a GPU.

Opt-in: ``pytest -m gpu``; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mutualrl.config import GRPOConfig, TrainingConfig, PolicyConfig
from mutualrl.policies.batch import TrainBatch, TrainSequence
from mutualrl.policies.policy import Policy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_half_billion_parameter_policy_takes_a_bf16_micro_batched_chunked_step(tokenizer_handles):
    # Qwen2.5-0.5B's layer dimensions on DeepSeek's 129k vocabulary (tied embeddings)
    cfg = PolicyConfig(name="qwen-0.5b", architecture="qwen2", tokenizer="deepseek-v3",
                       hidden_size=896, num_layers=24, num_heads=14, intermediate_size=4864,
                       dtype="bf16")
    grpo = GRPOConfig(num_generations=8, max_completion_length=256, beta=0.0, learning_rate=1e-6)
    training = TrainingConfig(per_device_train_batch_size=8, logprob_chunk_size=1024,
                              gradient_checkpointing=True)
    p = Policy(cfg, grpo, seed=0, device="cuda:0", handle=tokenizer_handles["deepseek-v3"],
               training=training)
    assert sum(q.numel() for q in p.model.parameters()) > 4e8
    g = torch.Generator().manual_seed(0)
    seqs = tuple(TrainSequence(tuple(int(t) for t in torch.randint(10, 120000, (64,), generator=g)),
                               tuple(int(t) for t in torch.randint(10, 120000, (256,), generator=g)),
                               advantage=float(i % 2) - 0.5, weight=1.0) for i in range(32))
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
    cfg = PolicyConfig(name="tiny", architecture="llama", tokenizer="mistral-v1", hidden_size=64,
                       num_layers=2, num_heads=2, dtype="bf16")
    grpo = GRPOConfig(num_generations=4, max_completion_length=16, loss_type=loss_type)
    p = Policy(cfg, grpo, seed=0, device="cuda:0", handle=tokenizer_handles["mistral-v1"],
               training=TrainingConfig(per_device_train_batch_size=2))
    g = torch.Generator().manual_seed(0)
    seqs = tuple(TrainSequence(tuple(int(t) for t in torch.randint(10, 30000, (8,), generator=g)),
                               tuple(int(t) for t in torch.randint(10, 30000, (16 - i,), generator=g)),
                               advantage=float(i % 2) - 0.5) for i in range(8))
    stats = p.train_step(TrainBatch(sequences=seqs))
    assert stats["skipped_nan"] == 0.0 and stats["grad_norm"] > 0
