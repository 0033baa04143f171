"""The torch sampler's two KV caches side by side: time and memory of the same generation.

``grpo.cache_implementation = "static"`` allocates the cache once for the prompt and every new
token and writes it in place; unset (``"dynamic"``, TRL's default) the cache grows by one token a
step. The static cache keeps a GPU's reserved memory near its allocated memory
(docs/guides/memory.md); this measures what it costs in time. For each model, one ``Policy``
samples P prompts x G completions x N new tokens at temperature 1 with each cache in turn,
round after round (so drift hits both alike), in one process, after a short warm-up of each:
the median seconds, completion tokens/s and the largest peak memory of each (``torch.cuda``'s
counters, reset and the cache emptied before every generation; none on a CPU).

    python benchmarks/bench_kv_cache.py --json benchmarks/results/kv_cache_h200.json   # on a GPU
    python benchmarks/bench_kv_cache.py --models tiny --device cpu --tokens 16 --json /tmp/kv.json

``llama32-1b`` and ``qwen25-1.5b`` are ``configs/gpu1-random-1b.toml``'s two policies (random
weights, bf16 on a GPU; extras ``llama`` and ``qwen`` for their tokenizers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mutualrl.config import GRPOConfig, PolicyConfig
from mutualrl.policies.generation import SamplingSettings
from mutualrl.policies.generation.torch import TorchBackend
from mutualrl.policies.policy import Policy, load_handles
from mutualrl.provenance import git_commit, machine_info
from mutualrl.tasks.base import Prompt

MODELS = {
    "llama32-1b": dict(
        architecture="llama",
        tokenizer="llama-3",
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        intermediate_size=8192,
    ),
    "qwen25-1.5b": dict(
        architecture="qwen2",
        tokenizer="qwen2.5",
        hidden_size=1536,
        num_layers=28,
        num_heads=12,
        intermediate_size=8960,
    ),
    "tiny": dict(
        architecture="llama", tokenizer="mistral-v1", hidden_size=64, num_layers=2, num_heads=2
    ),
}
CACHES = ("static", "dynamic")
GIB = 2**30


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _generate(backend, prompts, ids, settings, device: str) -> tuple[float, int, dict]:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    samples = backend.generate(prompts, ids, settings)
    _sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.completion_ids) for s in samples)
    memory = (
        {
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        }
        if device.startswith("cuda")
        else {}
    )
    return seconds, tokens, memory


def bench_model(name: str, a) -> dict:
    dims = MODELS[name]
    cfg = PolicyConfig(name=name, dtype="bf16" if a.device.startswith("cuda") else "fp32", **dims)
    handle = load_handles([cfg])[cfg.tokenizer]
    policy = Policy(
        cfg,
        GRPOConfig(num_generations=a.generations, max_completion_length=a.tokens),
        seed=0,
        device=a.device,
        handle=handle,
    )
    words = ["cat", "dog", "sun", "tree", "moon", "fish", "bird", "star"]
    prompts = [
        Prompt(text=f"first: {' '.join(words[i:] * 3)} =", answer=" " + words[i], family="first")
        for i in range(a.prompts)
    ]
    ids = [policy.encode_prompt(q.text) for q in prompts]
    backend = TorchBackend(policy, policy.learner, torch.Generator().manual_seed(0))

    def settings(cache: str, tokens: int) -> SamplingSettings:
        return SamplingSettings(
            a.generations, tokens, 1.0, cache_implementation=None if cache == "dynamic" else cache
        )

    for cache in CACHES:  # kernels, cuBLAS handles and the first allocations, untimed
        _generate(backend, prompts, ids, settings(cache, 8), a.device)
    runs: dict[str, list] = {c: [] for c in CACHES}
    for r in range(a.rounds):
        for cache in CACHES if r % 2 == 0 else CACHES[::-1]:
            runs[cache].append(
                _generate(backend, prompts, ids, settings(cache, a.tokens), a.device)
            )
            s, n, _ = runs[cache][-1]
            print(f"{name} round {r} {cache}: {s:.2f} s, {n} tokens", flush=True)
    out = {
        "dims": dims,
        "dtype": cfg.dtype,
        "parameters": sum(p.numel() for p in policy.model.parameters()),
    }
    for cache, got in runs.items():
        seconds = [s for s, _, _ in got]
        entry = {
            "median_s": statistics.median(seconds),
            "seconds": seconds,
            "tokens": got[0][1],
            "tokens_per_s": statistics.median(n / s for s, n, _ in got),
        }
        for key in ("peak_allocated_gib", "peak_reserved_gib"):
            if got[0][2]:
                entry[f"{key}_max"] = max(m[key] for _, _, m in got)
        out[cache] = entry
    out["static_over_dynamic_time"] = out["static"]["median_s"] / out["dynamic"]["median_s"]
    del policy, backend
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--models", nargs="+", default=["llama32-1b", "qwen25-1.5b"], choices=list(MODELS)
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    device_name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    results = {
        "benchmark": "kv_cache",
        "git_commit": git_commit(),
        "device": device_name,
        "machine": machine_info(),
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(a).items() if k != "json"},
        "models": {m: bench_model(m, a) for m in a.models},
    }
    for m, r in results["models"].items():
        print(
            f"{m}: static {r['static']['median_s']:.2f} s, "
            f"dynamic {r['dynamic']['median_s']:.2f} s "
            f"(static / dynamic {r['static_over_dynamic_time']:.2f})"
        )
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
