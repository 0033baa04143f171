"""The sharded learner on CUDA (opt-in: ``pytest -m gpu``; NCCL): bf16 through FSDP2's mixed
precision on one rank, its step time and peak GPU memory against the plan; two ranks against one
where two GPUs exist; CPU offload.

A rank group of one is the sharded code path on a single GPU (FSDP2 over a mesh of one): what a
one-GPU machine can check of it.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import pytest
import torch

from mutualrl.allocation.dims import dims_from_policy
from mutualrl.allocation.planner import Assignment, GpuSlot
from mutualrl.allocation.specs import (
    activation_bytes,
    gathered_bytes,
    generator_memory_bytes,
    kv_cache_bytes,
    learner_memory_bytes,
)
from mutualrl.config import (
    AllocationConfig,
    GRPOConfig,
    MemoryModel,
    PolicyConfig,
    ShardingConfig,
    TrainingConfig,
)
from mutualrl.policies.batch import TrainBatch, TrainSequence
from mutualrl.policies.models import TokenizerFacts, count_parameters
from mutualrl.policies.sharded.worker import build_rank
from mutualrl.policies.worker import Update
from mutualrl.workers import ProcessExecutor, call_one
from mutualrl.workers.ranks import RankGroup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GIB = 1024**3
BF16 = MemoryModel(weight_bytes=2, grad_bytes=2, optimizer_bytes=12)  # fp32 master + AdamW
ROWS, PROMPT, COMPLETION = 16, 64, 64


@dataclass(frozen=True)
class CudaPeak:
    """Every rank's peak allocated GPU memory since the last reset, bytes; then reset."""

    def __call__(self, worker) -> list[int]:
        import torch.distributed as dist

        peaks: list = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        return peaks


def policy(**kw) -> PolicyConfig:
    # Qwen2.5-0.5B's dimensions (a key/value head per query head, as every random model here)
    return PolicyConfig(
        name="q",
        architecture="qwen2",
        tokenizer="qwen2.5",
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        intermediate_size=4864,
        **kw,
    )


def start(cfg: PolicyConfig, ranks: int, training: TrainingConfig) -> ProcessExecutor:
    from mutualrl.retokenize.loaders import load_tokenizer

    facts = TokenizerFacts.of(load_tokenizer(cfg.tokenizer).tokenizer)
    grpo = GRPOConfig(num_generations=4, max_completion_length=COMPLETION)
    a = Assignment(
        worker="q",
        role="learner",
        policy="q",
        group="q",
        num_parameters=1,
        tokens_per_step=1,
        cost=1.0,
        cost_share=1.0,
        memory_bytes=0,
        node=0,
        gpus=tuple(GpuSlot(0, r) for r in range(ranks)),
        threads=4,
        ranks=ranks,
    )
    ex = ProcessExecutor(AllocationConfig(call_timeout_s=600, process_group_timeout_s=120))
    ex.start(
        {
            "q": RankGroup(
                ranks,
                functools.partial(build_rank, cfg, grpo, 0, facts, "cuda:0", None, training),
                backend="nccl",
            )
        },
        types.SimpleNamespace(assignments=(a,)),
    )
    return ex


def batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    return TrainBatch(
        sequences=tuple(
            TrainSequence(
                tuple(int(t) for t in torch.randint(1000, 100000, (PROMPT,), generator=g)),
                tuple(int(t) for t in torch.randint(1000, 100000, (COMPLETION,), generator=g)),
                advantage=(-1) ** i * 0.5,
            )
            for i in range(ROWS)
        )
    )


def test_one_rank_sharded_bf16_step_time_and_peak_memory_against_the_plan(record_property):
    cfg = policy(dtype="bf16")
    training = TrainingConfig(gradient_checkpointing=True)
    n = count_parameters(cfg, 151665)
    d = dims_from_policy(cfg, 151665)
    plan = (
        learner_memory_bytes(n, BF16, reference=False, lora=False, ranks=1)
        + activation_bytes(d, ROWS, PROMPT + COMPLETION, COMPLETION, 2, True)
        + gathered_bytes(d, True, BF16)
        + generator_memory_bytes(
            n, kv_cache_bytes(d.layers, d.kv_width, ROWS * (PROMPT + COMPLETION), BF16), BF16
        )
    )
    ex = start(cfg, 1, training)
    try:
        call_one(ex, "q", CudaPeak())
        times = [call_one(ex, "q", Update([batch()]))[0]["step_time_s"] for _ in range(3)]
        peak = call_one(ex, "q", CudaPeak())[0]
    finally:
        ex.shutdown()
    record_property("step_time_s", min(times))
    record_property("peak_gib", peak / GIB)
    record_property("plan_gib", plan / GIB)
    print(
        f"\nbf16, 1 rank, {n / 1e9:.2f}B params, {ROWS} x {PROMPT + COMPLETION} tokens: step "
        f"{min(times):.3f} s, peak {peak / GIB:.2f} GiB, plan {plan / GIB:.2f} GiB"
    )
    assert peak <= plan


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_on_cuda_update_like_one():
    from tests.policies.test_sharded import Snapshot

    cfg = policy()
    training = TrainingConfig(entropy_sample_size=None)
    one, two = start(cfg, 1, training), start(cfg, 2, training)
    try:
        s1, _ = call_one(one, "q", Update([batch()]))
        s2, _ = call_one(two, "q", Update([batch()]))
        assert s2["loss"] == pytest.approx(s1["loss"], rel=1e-4)
        a, b = call_one(one, "q", Snapshot()), call_one(two, "q", Snapshot())
        for name, (_p, g) in a.items():
            torch.testing.assert_close(b[name][1], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()))
    finally:
        one.shutdown()
        two.shutdown()


@dataclass(frozen=True)
class Where:
    """The devices of this rank's parameter shards."""

    def __call__(self, worker):
        return {p.to_local().device.type for p in worker.learner.model.parameters()}


def test_cpu_offload_keeps_shards_in_host_memory_and_trains():
    cfg = policy(sharding=ShardingConfig(cpu_offload=True))
    ex = start(cfg, 1, TrainingConfig())
    try:
        stats, version = call_one(ex, "q", Update([batch()]))
        assert version == 1 and stats["skipped_nan"] == 0.0
        assert call_one(ex, "q", Where()) == {"cpu"}
    finally:
        ex.shutdown()
