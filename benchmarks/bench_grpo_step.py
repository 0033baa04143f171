"""One GRPO step of mutualrl against TRL's ``GRPOTrainer`` on the same work, on CPU.

Same for both: the model (a Llama built by mutualrl's architecture registry, random init, handed
to TRL as a model object; two copies from the same seed), the tokenizer, the prompts,
``num_generations``, ``max_completion_length``, batch (one optimizer step on every completion),
``beta``, ``loss_type``, learning rate, one torch thread, and the reward function (a cheap
deterministic function of the completion text).

The contenders alternate: a ``TrainerCallback`` times each TRL step (``on_step_begin`` to
``on_step_end``: generation, rewards, advantages, log-probs, loss, backward, optimizer) and then
runs and times one mutualrl step (generate, verify, advantages + batch, update), so both see the
same machine load. Medians, min/max, the ratio of medians and ``os.getloadavg()`` go to JSON.

    python benchmarks/bench_grpo_step.py --json grpo_step_small.json
    python benchmarks/bench_grpo_step.py --tokenizer deepseek-v3 --max-completion-length 128 \\
        --prompts 4 --generations 4 --steps 3 --json grpo_step_129k.json
    python benchmarks/bench_grpo_step.py --tokenizer deepseek-v3 --max-completion-length 128 \\
        --prompts 4 --generations 4 --steps 3 --micro-batch 4 --json grpo_step_129k_micro4.json

``benchmarks/results/grpo_step.json`` holds the newest run of the three, each with its command.

``--micro-batch N`` trains both sides on N completions per forward/backward with gradient
accumulation up to one optimizer step on all of them (ours: ``per_device_train_batch_size``;
TRL: ``per_device_train_batch_size=N`` and ``gradient_accumulation_steps`` = completions / N, one
generation per optimizer step), so neither holds the whole batch's (B, T, V) logits at once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig
from mutualrl.grpo import group_advantages
from mutualrl.malloc import reuse_large_buffers
from mutualrl.policies.batch import TrainBatch
from mutualrl.policies.policy import Policy
from mutualrl.provenance import git_commit, machine_info
from mutualrl.retokenize import load_tokenizer
from mutualrl.strategies.common import sequences_from_samples
from mutualrl.tasks.base import Prompt

_WORDS = "cat dog sun tree red blue one two three four five six seven eight nine ten".split()


def reward(text: str) -> float:
    """A deterministic, cheap reward: the share of vowels among the completion's letters."""
    letters = [ch for ch in text.lower() if ch.isalpha()]
    return sum(ch in "aeiou" for ch in letters) / max(len(letters), 1)


def make_prompts(n: int) -> list[Prompt]:
    return [
        Prompt(
            text=f"Repeat the words: {' '.join(_WORDS[i % 7 : i % 7 + 5])} =",
            answer="",
            family="bench",
        )
        for i in range(n)
    ]


def build_policy(args, handle) -> Policy:
    grpo = GRPOConfig(
        num_generations=args.generations,
        prompts_per_step=args.prompts,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        beta=args.beta,
        loss_type=args.loss_type,
        learning_rate=1e-4,
    )
    cfg = PolicyConfig(
        name="bench",
        architecture="llama",
        tokenizer=args.tokenizer,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        learning_rate=1e-4,
    )
    return Policy(
        cfg,
        grpo,
        seed=0,
        handle=handle,
        training=TrainingConfig(per_device_train_batch_size=args.micro_batch),
    )


class OursStep:
    """One mutualrl GRPO step, phase by phase, on a single policy."""

    def __init__(self, policy: Policy, prompts: list[Prompt]) -> None:
        self.policy, self.prompts = policy, prompts
        self.phases: list[dict[str, float]] = []
        self.tokens: list[tuple[int, int]] = []  # (completion tokens, prompt + completion tokens)

    def __call__(self) -> float:
        p, g, t = self.policy, self.policy.grpo, {}
        t0 = time.perf_counter()
        samples = p.generate(
            self.prompts, g.num_generations, g.max_completion_length, g.temperature
        )
        t1 = time.perf_counter()
        rewards = torch.tensor([reward(s.text) for s in samples])
        t2 = time.perf_counter()
        groups = torch.tensor([s.group for s in samples])
        adv = group_advantages(
            rewards,
            groups,
            len(self.prompts),
            scale=g.scale_rewards,
            estimator=g.advantage_estimator,
        )
        batch = TrainBatch(
            sequences=tuple(sequences_from_samples(samples, adv.advantages, adv.zero_std, g))
        )
        t3 = time.perf_counter()
        if batch.sequences:
            p.train_step(batch)
        t4 = time.perf_counter()
        t.update(generate=t1 - t0, verify=t2 - t1, strategy=t3 - t2, update=t4 - t3)
        self.phases.append(t)
        comp = sum(len(s.completion_ids) for s in samples)
        self.tokens.append((comp, comp + sum(len(s.prompt_ids) for s in samples)))
        return t4 - t0


def trl_trainer(args, model, tokenizer, prompts, on_step_end):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self._t0 = [], 0.0

        def on_step_begin(self, *a, **k):
            self._t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._t0)
            on_step_end()

    def reward_fn(completions, **kwargs):
        return [reward(c) for c in completions]

    n = args.prompts * args.generations
    micro = args.micro_batch or n
    if n % micro:
        raise SystemExit(
            f"--micro-batch: expected a divisor of prompts x generations ({n}), got {micro}"
        )
    cfg = TRLConfig(
        output_dir=str(Path(args.tmp) / "trl"),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        beta=args.beta,
        loss_type=args.loss_type,
        learning_rate=1e-4,
        temperature=1.0,
        max_steps=args.steps + 1,
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        bf16=False,
        disable_tqdm=True,
    )
    data = Dataset.from_dict({"prompt": [p.text for p in prompts] * (args.steps + 2)})
    timer = Timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=cfg,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    return trainer, timer


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> None:
    reuse_large_buffers()  # both sides in this process: TRL gets the same allocator
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default="mistral-v1")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5, help="timed steps each (after one warm-up)")
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--loss-type", default="grpo")
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="completions per forward/backward on both sides (default: all at once)",
    )
    ap.add_argument("--tmp", default="/tmp/mutualrl-bench-grpo")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    handle = load_tokenizer(args.tokenizer)
    prompts = make_prompts(args.prompts)
    ours_policy, theirs = build_policy(args, handle), build_policy(args, handle)
    ours = OursStep(ours_policy, prompts)
    ours_times: list[float] = []
    load_before = os.getloadavg()
    trainer, timer = trl_trainer(
        args, theirs.model, handle.tokenizer, prompts, lambda: ours_times.append(ours())
    )
    trainer.train()
    trl_t, our_t = timer.times[1:], ours_times[1:]  # first of each: warm-up
    comp = statistics.median(c for c, _ in ours.tokens[1:])
    total = statistics.median(a for _, a in ours.tokens[1:])
    trl_hist = [h for h in trainer.state.log_history if "completions/mean_length" in h][1:]
    trl_comp = (
        (
            statistics.median(h["completions/mean_length"] for h in trl_hist)
            * args.prompts
            * args.generations
        )
        if trl_hist
        else float("nan")
    )
    res = {
        "benchmark": "grpo_step",
        "commit": git_commit(),
        "machine": machine_info(
            torch=torch.__version__,
            trl=__import__("trl").__version__,
            transformers=__import__("transformers").__version__,
        ),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "tmp")},
        "vocab_size": handle.vocab_size,
        "ours_step_s": summary(our_t),
        "trl_step_s": summary(trl_t),
        "ours_phases_median_s": {
            k: statistics.median(p[k] for p in ours.phases[1:]) for k in ours.phases[0]
        },
        "ours_completion_tokens": comp,
        "trl_completion_tokens": trl_comp,
        "ours_completion_tokens_per_s": comp / statistics.median(our_t),
        "ours_total_tokens_per_s": total / statistics.median(our_t),
        "trl_completion_tokens_per_s": trl_comp / statistics.median(trl_t),
        "speedup_ours_over_trl": statistics.median(trl_t) / statistics.median(our_t),
        "paired_speedups": [b / a for a, b in zip(our_t, trl_t)],
    }
    text = json.dumps(res, indent=2, default=float)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
