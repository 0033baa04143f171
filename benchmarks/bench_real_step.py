"""A real model's GRPO step on a CPU, lever by lever, beside the bare PyTorch floor.

Each real model of ``configs/real-cpu.toml`` (SmolLM2-135M-Instruct through its chat template,
Gemma 3 270M on raw prompts) is stepped alone (strategy ``none``) at the config's work: 4 prompts
x 8 completions, ``dapo``, at 16 new tokens (the config's) and at 64. Seven entries share each
round, in alternating order, every one from the same weights, optimizer state and sampler
generator (restored untimed before each), on the same prompts:

- ``before``: the config as it shipped before these levers: fp32, every row computing its prompt
  in the sampler and in the update, micro-batches of 8 rows, the LM head in chunks of 128
  positions, AdamW's loop over tensors (``training.optim = "adamw_torch"``), sdpa attention;
- ``bf16``: bf16 autocast over fp32 weights only (``policies.*.dtype = "bf16"``, what ``auto``
  chooses on a CPU with AVX512-BF16 or AMX);
- ``shared``: each prompt computed once only (``training.shared_prefix``, the sampler's
  prefill), in fp32;
- ``bf16+shared``: both levers, the old micro-batches;
- ``all``: both levers and the config's new update shape (the whole batch in one pass, the LM
  head in chunks of 512 positions), AdamW's fused kernel (``training.optim``'s default) and the
  config's update attention (eager for SmolLM2): what ``configs/real-cpu.toml`` runs now;
- ``all-adamw_torch``: ``all`` with AdamW's loop over tensors, what the fused kernel gains;
- ``bare-all``: ``bench_floor.Bare`` with the levers of ``all`` and the same update shape: the
  least work that computes the step.

Generation and update are timed apart (the run's own ``phase/*_time_s``). Medians over the rounds
(round 0 warms up, dropped), each entry's speed-up over ``before``, ``all`` over
``bare-all``, and the completion lengths drawn (bf16 draws other tokens than fp32, so its work
differs a little) go to one JSON.

    python benchmarks/bench_real_step.py --rounds 3 --json benchmarks/results/real_step.json

``--attention kernels`` (or ``--attention`` alone) instead times ``all`` under two attention
implementations, alternating: ``sdpa`` (what transformers chooses when
``policies.*.attn_implementation`` is unset) and ``eager`` (the run labelled ``attention``; the
speed-ups are over ``all-sdpa``).
``--attention update`` times ``all-sdpa`` against ``all-eager-update``: the sampler under sdpa,
the update under eager (``policies.*.train_attn_implementation``; the run labelled
``attention-update``):

    python benchmarks/bench_real_step.py --attention kernels --rounds 3 \
        --json benchmarks/results/real_step.json
    python benchmarks/bench_real_step.py --attention update --models smollm2-135m-instruct \
        --rounds 3 --json benchmarks/results/real_step.json

``--profile`` instead profiles one ``all`` step of each model (after a warm-up step) with
``torch.profiler`` and writes where its time went, by phase and by operator (the run labelled
``profile``):

    python benchmarks/bench_real_step.py --profile --tokens 16 \
        --json benchmarks/results/real_step.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch
from bench_floor import Bare, _Verifier

from mutualrl.bench.results import write_run
from mutualrl.config import load_config
from mutualrl.malloc import reuse_large_buffers
from mutualrl.policies.model_cache import resolve_checkpoint
from mutualrl.policies.precision import native_bf16
from mutualrl.policies.update import adamw_fused
from mutualrl.provenance import git_commit, machine_info
from mutualrl.run.build import build_run
from mutualrl.run.schedule import lock_step

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"smollm2-135m-instruct": True, "gemma-3-270m": False}  # name: chat template
# the old config's update: micro-batches of 8, LM-head chunks of 128, AdamW's loop over tensors
BEFORE = dict(per_device_train_batch_size=8, logprob_chunk_size=128, optim="adamw_torch")
# name: (bf16, each prompt once, update shape, attention; None: the config's). The attention
# (the model's kernel, the update's; None: the model's): the four lever entries keep the model's
# kernel (sdpa) in the update, as the config shipped before; ``all`` takes the config's update
# kernel (``train_attn_implementation``: eager for SmolLM2)
KEPT = (None, None)
VARIANTS = {
    "before": (False, False, BEFORE, KEPT),
    "bf16": (True, False, BEFORE, KEPT),
    "shared": (False, True, BEFORE, KEPT),
    "bf16+shared": (True, True, BEFORE, KEPT),
    "all": (True, True, None, None),
    "all-adamw_torch": (True, True, dict(optim="adamw_torch"), None),
}
ATTENTION = {  # attention: (the model's kernel, the update's; None: the model's)
    "kernels": {
        "all-sdpa": (True, True, None, ("sdpa", None)),
        "all-eager": (True, True, None, ("eager", None)),
    },
    "update": {
        "all-sdpa": (True, True, None, ("sdpa", None)),
        "all-eager-update": (True, True, None, ("sdpa", "eager")),
    },
}
PHASES = ("generate", "update", "step")


def configured_attention(model: str) -> str | None:
    """The update's attention kernel ``configs/real-cpu.toml`` gives this model."""
    for p in load_config(ROOT / "configs" / "real-cpu.toml").policies:
        if p.checkpoint == model:
            return p.train_attn_implementation
    return None


def config(model: str, tokens: int, out: Path, more: tuple[str, ...] = ()):
    chat = "true" if MODELS[model] else "false"
    attn = configured_attention(model)
    update_attn = f', train_attn_implementation="{attn}"' if attn else ""
    return load_config(
        ROOT / "configs" / "real-cpu.toml",
        [
            f'output_dir="{out}"',
            'strategy="none"',
            "steps=1000",
            "save_steps=0",
            # the verifier alone scores, replaced by bench_floor's reward on both sides
            "task.reward_funcs=[]",
            "task.reward_weights=[]",
            f"grpo.max_completion_length={tokens}",
            f'policies=[{{name="p", checkpoint="{resolve_checkpoint(model)}", '
            f'chat_template={chat}, dtype="fp32"{update_attn}}}]',
            *more,
        ],
    )


class State:
    """A policy's weights, optimizer state and generator, to start every entry from."""

    def __init__(self, policy) -> None:
        learner = policy.learner
        self.model = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
        self.optimizer = copy.deepcopy(learner.optimizer.state_dict())
        self.generator = policy.generator.get_state()
        self.version = learner.version

    def restore(self, policy) -> None:
        learner = policy.learner
        learner.model.load_state_dict(self.model)
        learner.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        policy.generator.set_state(self.generator)
        learner.version = self.version


def ours(policy, bf16: bool, shared: bool, shape: dict | None, attention: tuple | None):
    learner = policy.learner
    training = (
        learner.training if shape is None else msgspec.structs.replace(learner.training, **shape)
    )
    kernel, update_kernel = attention or (None, learner.cfg.train_attn_implementation)

    def step(run, at: int):
        # the update's settings of this entry, wherever the learner reads them
        learner.training = learner.logprobs.training = learner.objective.training = training
        for group in learner.optimizer.param_groups:  # AdamW reads its kernel at each step
            group["fused"] = adamw_fused(training.optim)
        learner.logprobs.bf16 = bf16
        learner.logprobs.shared_prefix = shared
        policy.backend.share_prompts = shared
        if kernel is not None:  # the sampler's model is the learner's
            learner.model.set_attn_implementation(kernel)
        learner.cfg = msgspec.structs.replace(learner.cfg, train_attn_implementation=update_kernel)
        t0 = time.perf_counter()
        rec = lock_step(run, at)
        times = {k: rec[f"phase/{k}_time_s"] for k in ("generate", "update")}
        times["step"] = time.perf_counter() - t0
        return times, (rec["policy/p/loss"], rec["policy/p/completion_length"])

    return step


def bare(b: Bare):
    def step(run, at: int):
        b.sync_from(run.executor.worker("p"))
        times, (loss, _) = b.step(run, at)
        return times, (loss, None)

    return step


def bench(model: str, tokens: int, rounds: int, variants: dict = VARIANTS) -> dict:
    """The entries of ``variants`` (and ``bare-all`` beside ``VARIANTS``), alternating."""
    floor = variants is VARIANTS
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(model, tokens, Path(tmp) / "run")
        run = build_run(cfg)
        run.verifier = _Verifier(run.verifier)  # bench_floor's reward, on both sides
        try:
            policy = run.executor.worker("p")
            entries = {name: ours(policy, *levers) for name, levers in variants.items()}
            if floor:
                attn = cfg.policies[0].train_attn_implementation  # the update's, as ``all``'s
                entries["bare-all"] = bare(Bare(policy, cfg, bf16=True, shared=True, attn=attn))
            times: dict[str, list[dict]] = {name: [] for name in entries}
            seen: dict[str, list] = {name: [] for name in entries}
            state = None
            for r in range(rounds + 1):  # round 0 warms every entry up, then dropped
                order = list(entries) if r % 2 == 0 else list(entries)[::-1]
                for name in order:
                    if state is not None:
                        state.restore(policy)
                    t, got = entries[name](run, r + 1)
                    if r:
                        times[name].append(t)
                        seen[name].append(got)
                    print(
                        f"{model} {tokens} tokens, round {r}, {name}: "
                        f"generate {t['generate']:.2f} s, update {t['update']:.2f} s",
                        flush=True,
                    )
                if state is None:  # after the warm-up: AdamW's state exists from here on
                    state = State(policy)
        finally:
            run.close()
    med = {n: {k: statistics.median(t[k] for t in ts) for k in PHASES} for n, ts in times.items()}
    base_name = "before" if floor else "all-sdpa"
    base = med[base_name]
    out = {
        "model": model,
        "new_tokens": tokens,
        "median_s": med,
        f"speedup_over_{base_name}": {
            n: {k: base[k] / m[k] for k in PHASES} for n, m in med.items()
        },
        "completion_length": {n: [g[1] for g in got] for n, got in seen.items() if n != "bare-all"},
        "per_round_s": times,
    }
    if floor:
        out["all_over_bare_all"] = {k: med["all"][k] / med["bare-all"][k] for k in PHASES}
        out["loss_all_minus_bare_all"] = [
            a[0] - b[0] for a, b in zip(seen["all"], seen["bare-all"])
        ]
    return out


def profile(model: str, tokens: int, top: int = 12) -> dict:
    """One ``all`` step after a warm-up one, profiled: the phases' seconds and the operators
    with the most self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with tempfile.TemporaryDirectory() as tmp:
        # the worker's calls in this thread, where the profiler records them
        more = ('allocation.local_mode="sequential"',)
        run = build_run(config(model, tokens, Path(tmp) / "run", more))
        run.verifier = _Verifier(run.verifier)
        try:
            step = ours(run.executor.worker("p"), *VARIANTS["all"])
            step(run, 1)
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                times, _ = step(run, 2)
        finally:
            run.close()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return {
        "model": model,
        "new_tokens": tokens,
        "phases_s": times,
        "top_self_cpu": [
            {
                "op": e.key,
                "self_s": e.self_cpu_time_total / 1e6,
                "share": e.self_cpu_time_total / total,
                "calls": e.count,
            }
            for e in events[:top]
        ],
    }


def write(path: Path, record: dict) -> None:
    """Into the file's runs, in place of the run with the same label (``real-cpu``, ``profile``)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"runs": []}\n')
    write_run(path, record)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="profile one step per model instead")
    ap.add_argument(
        "--attention",
        nargs="?",
        const="kernels",
        choices=list(ATTENTION),
        help="all under other attention kernels instead (alone: kernels)",
    )
    a = ap.parse_args()
    malloc = reuse_large_buffers()  # as `mutualrl train` sets it up (malloc.py)
    torch.set_num_threads(a.threads)
    if a.profile:
        found = [profile(m, t) for t in a.tokens for m in a.models]
        write(
            a.json,
            {
                "benchmark": "real_step",
                "label": "profile",
                "command": "python benchmarks/bench_real_step.py " + " ".join(sys.argv[1:]),
                "commit": git_commit(),
                "machine": machine_info(torch=torch.__version__),
                "profiles": found,
            },
        )
        for f in found:
            print(f["model"], f["phases_s"])
            for e in f["top_self_cpu"]:
                print(f"  {e['op']:40s} {e['self_s']:7.2f} s {e['share']:6.1%} x{e['calls']}")
        return
    variants = ATTENTION[a.attention] if a.attention else VARIANTS
    results = [bench(m, t, a.rounds, variants) for t in a.tokens for m in a.models]
    record = {
        "benchmark": "real_step",
        "label": {None: "real-cpu", "kernels": "attention", "update": "attention-update"}[
            a.attention
        ],
        "command": "python benchmarks/bench_real_step.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(),
        "machine": machine_info(torch=torch.__version__),
        "native_bf16": native_bf16("cpu"),
        "malloc": malloc,
        "variants": {
            n: {"bf16": b, "shared": sh, "update": u or "config", "attention": at or "config"}
            for n, (b, sh, u, at) in variants.items()
        },
        "settings": {k: v for k, v in vars(a).items() if k != "json"},
        "results": results,
    }
    write(a.json, record)
    for r in results:
        print(
            json.dumps(
                {
                    "model": r["model"],
                    "new_tokens": r["new_tokens"],
                    "speedup": {n: r["speedup_over_all-sdpa"][n] for n in variants}
                    if a.attention
                    else r["speedup_over_before"]["all"],
                    "all_over_bare_all": r.get("all_over_bare_all"),
                }
            )
        )


if __name__ == "__main__":
    main()
