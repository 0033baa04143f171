"""Plain GRPO in TRL and in mutualrl on the same recipe, scored by one evaluation: does our
``none`` learn as TRL's ``GRPOTrainer`` does? (``benchmarks/results/trl_check.json``)

For one policy of a run config (its checkpoint, prompt rendering, reward functions and weights,
and the ``[grpo]`` settings TRL has a name for), the script trains that policy with TRL 1.16's
``GRPOTrainer`` on the prompts a mutualrl run of the same seed draws at each step, in the same
order (TRL's sampler unshuffled, one generation batch per step). Then it scores three models
with mutualrl's own evaluation (a zero-step run of the config on the folder: greedy, the
config's ``eval`` split and distinct problems): the starting checkpoint, TRL's result, and,
where ``--mutualrl-run`` gives one, the final weights of a ``mutualrl train --strategy none`` run
of the config. Each gets held-out pass@1 with its 95% Wilson interval, per family, and its mean
greedy completion length in tokens (a collapse to bare numbers shows there).

    python benchmarks/trl_check.py --config configs/real-cpu.toml --policy smollm2 --seeds 0 1 \\
        --mutualrl-run 0=runs/none-seed0 --mutualrl-run 1=runs/none-seed1 \\
        --json benchmarks/results/trl_check.json

What TRL does differently is its own: it generates with ``model.generate`` (in its precision:
bf16 where the config's dtype resolves to it) and computes its loss its own way
(docs/trl-parity.md lists the departures of our update from it). It is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

from mutualrl.bench.results import write_run
from mutualrl.config import config_from_dict, load_config, to_dict
from mutualrl.policies.model_cache import resolve_policies
from mutualrl.policies.precision import resolve_precision
from mutualrl.provenance import git_commit, machine_info
from mutualrl.report.analysis import curve_of
from mutualrl.report.stats import wilson_interval
from mutualrl.retokenize.loaders import load_tokenizer
from mutualrl.run import train
from mutualrl.run.evaluation import read_heldout

ROOT = Path(__file__).resolve().parents[1]


def resolved(args):
    cfg = load_config(args.config, list(args.set))
    cfg = msgspec.structs.replace(cfg, policies=resolve_policies(cfg.policies))
    cfg = resolve_precision(cfg)
    names = [p.name for p in cfg.policies]
    if args.policy not in names:
        raise SystemExit(f"--policy: {args.policy!r} is not a policy of {args.config} ({names})")
    return cfg


def training_prompts(cfg, task, steps: int):
    """The prompts a mutualrl run of ``cfg.seed`` draws, step by step (``run.phases``)."""
    return [
        p
        for step in range(steps)
        for p in task.sample(
            np.random.default_rng([cfg.seed, 3, step]), cfg.grpo.prompts_per_step, "train"
        )
    ]


def trained_before(cfg, steps: int, out: Path) -> tuple[Path, float, list[dict]] | None:
    """A finished TRL training of ``cfg`` for ``steps`` in ``out`` (its weights and
    ``trained.json``), taken as it is, so a later failure (an evaluation) costs no retraining."""
    final, done = out / "final", out / "trained.json"
    if not (done.exists() and final.exists()):
        return None
    info = json.loads(done.read_text())
    # compared as written: JSON keeps a tuple field as a list
    if info["config"] != json.loads(json.dumps(to_dict(cfg))) or info["steps"] != steps:
        return None
    print(f"  TRL's weights from {final} (trained before)", file=sys.stderr)
    return final, info["wall_s"], info["logs"]


def trl_args(cfg, policy, steps: int, out: Path):
    """TRL's GRPOConfig for the run config's ``[grpo]`` settings TRL has a name for."""
    import torch
    from trl import GRPOConfig as TRLConfig

    g = cfg.grpo
    lr = policy.learning_rate if policy.learning_rate is not None else g.learning_rate
    n = g.prompts_per_step * g.num_generations
    return TRLConfig(
        output_dir=str(out / "trainer"),
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        per_device_train_batch_size=n,
        num_generations=g.num_generations,
        max_completion_length=g.max_completion_length,
        temperature=g.temperature,
        beta=g.beta,
        epsilon=g.epsilon,
        loss_type=g.loss_type,
        scale_rewards=g.scale_rewards,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_steps=steps,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=cfg.seed,
        bf16=policy.dtype == "bf16",  # what dtype = "auto" chose for a mutualrl run
        disable_tqdm=False,
    )


def train_trl(cfg, policy, steps: int, out: Path) -> tuple[Path, float, list[dict]]:
    """TRL's GRPOTrainer on the policy's checkpoint; its weights saved to ``out``, unless
    ``out`` holds a finished training of the same config (``trained_before``)."""
    final, done = out / "final", out / "trained.json"
    if (before := trained_before(cfg, steps, out)) is not None:
        return before
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from mutualrl.policies.prompting import chat_prompt
    from mutualrl.tasks import build_task
    from mutualrl.tasks.rewards import build_rewards

    task = build_task(cfg.task)
    rewards = build_rewards(cfg.task, task, 0)  # the weighted sum a mutualrl run trains on

    def score(prompt, completion: str) -> float:
        return (
            rewards.score(prompt, completion)[0] if rewards else task.verifier(prompt, completion)
        )

    tokenizer = load_tokenizer(policy.tokenizer).tokenizer
    chat = chat_prompt(policy, tokenizer)
    prompts = training_prompts(cfg, task, steps)
    text = [chat.render(p.text) if chat is not None else p.text for p in prompts]

    def reward_fn(prompts, completions, index, **kwargs):
        return [float(score(all_prompts[i], c)) for i, c in zip(index, completions)]

    all_prompts = prompts
    args = trl_args(cfg, policy, steps, out)
    model = AutoModelForCausalLM.from_pretrained(policy.checkpoint, dtype=torch.float32)
    data = Dataset.from_dict({"prompt": text, "index": list(range(len(prompts)))})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    logs = [
        {k: v for k, v in r.items() if isinstance(v, (int, float))}
        for r in trainer.state.log_history
        if "reward" in r
    ]
    info = {"config": to_dict(cfg), "steps": steps, "wall_s": wall, "logs": logs}
    done.write_text(json.dumps(info))
    return final, wall, logs


def evaluate(cfg, policy, folder: Path, out: Path) -> dict:
    """mutualrl's evaluation of ``folder`` as ``policy``: a zero-step run of the config."""
    data = to_dict(cfg)
    mine = next(p for p in data["policies"] if p["name"] == policy.name)
    mine["checkpoint"] = str(folder)  # the policy's own tokenizer and prompt rendering
    data.update({"policies": [mine], "steps": 0, "output_dir": str(out), "strategy": "none"})
    data["exchange"]["log"] = False
    train(config_from_dict(data, "trl_check"))
    curve = curve_of(read_heldout(out), policy.name)
    assert curve is not None
    greedy = curve.greedy[0]
    lo, hi = wilson_interval(int(greedy.sum()), len(greedy))
    tokenizer = load_tokenizer(policy.tokenizer).tokenizer
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in curve.texts[0]]
    return {
        "pass@1": {"mean": float(greedy.mean()), "lo": lo, "hi": hi},
        "prompts": len(greedy),
        "split": curve.split,
        "families": {
            str(f): float(greedy[curve.families == f].mean())
            for f in sorted(set(curve.families.tolist()))
        },
        "mean_completion_tokens": float(np.mean(lengths)),
    }


def verdict(start: dict, end: dict) -> str:
    if end["pass@1"]["mean"] > start["pass@1"]["hi"]:
        return "rose beyond the start's 95% interval"
    if end["pass@1"]["mean"] < start["pass@1"]["lo"]:
        return "fell below the start's 95% interval"
    return "within the start's 95% interval"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/real-cpu.toml")
    ap.add_argument("--policy", default="smollm2")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, help="GRPO steps (default: the config's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--mutualrl-run",
        action="append",
        default=[],
        metavar="SEED=RUN_DIR",
        help="a finished `mutualrl train --strategy none` run of the config at that seed",
    )
    ap.add_argument("--work", default="runs/trl-check", help="folder for TRL's weights and evals")
    ap.add_argument("--label", default="trl-check")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = {int(s): Path(d) for s, _, d in (r.partition("=") for r in args.mutualrl_run)}
    for seed, run in runs.items():  # before any training: a missing run loses nothing
        if not (run / "policies" / args.policy).is_dir():
            raise SystemExit(
                f"--mutualrl-run {seed}={run}: no final weights of {args.policy!r} at "
                f"{run / 'policies' / args.policy} (the run did not finish)"
            )
    work = Path(args.work)
    seeds = []
    for seed in args.seeds:
        args_seed = argparse.Namespace(**{**vars(args), "set": [*args.set, f"seed={seed}"]})
        cfg = resolved(args_seed)
        policy = next(p for p in cfg.policies if p.name == args.policy)
        steps = args.steps if args.steps is not None else cfg.steps
        where = work / f"seed{seed}"
        print(f"seed {seed}: TRL GRPOTrainer, {steps} steps", file=sys.stderr)
        final, wall, logs = train_trl(cfg, policy, steps, where / "trl")
        row = {"seed": seed, "steps": steps, "trl_train_wall_s": wall, "trl_log": logs}
        row["start"] = evaluate(cfg, policy, Path(policy.checkpoint), where / "eval-start")
        row["trl"] = evaluate(cfg, policy, final, where / "eval-trl")
        row["trl"]["verdict"] = verdict(row["start"], row["trl"])
        if seed in runs:
            mine = runs[seed] / "policies" / policy.name
            row["mutualrl"] = evaluate(cfg, policy, mine, where / "eval-mutualrl")
            row["mutualrl"]["verdict"] = verdict(row["start"], row["mutualrl"])
            row["mutualrl"]["run"] = str(runs[seed])
        seeds.append(row)
        for side in ("start", "trl", "mutualrl"):
            if side in row:
                r = row[side]
                print(
                    f"  {side}: pass@1 {r['pass@1']['mean']:.3f} [{r['pass@1']['lo']:.3f}, "
                    f"{r['pass@1']['hi']:.3f}] {r['families']} "
                    f"{r['mean_completion_tokens']:.1f} tokens {r.get('verdict', '')}",
                    file=sys.stderr,
                )
    record = {
        "benchmark": "trl_check",
        "label": args.label,
        "commit": git_commit(ROOT),
        "machine": machine_info(),
        "command": "python " + " ".join(sys.argv),
        "config": args.config,
        "policy": args.policy,
        "overrides": args.set,
        "seeds": seeds,
    }
    if args.json:
        write_run(args.json, record)
    print(json.dumps({s["seed"]: {k: s[k]["pass@1"] for k in ("start", "trl")} for s in seeds}))


if __name__ == "__main__":
    main()
