"""What sharing costs: GRPO step time of every registered strategy relative to ``none``.

    python benchmarks/bench_strategy_overhead.py [--config configs/tiny.toml] [--steps 5]
        [--rounds 2] [--set key=value ...] [--output benchmarks/results/strategy_overhead.json]

Each round trains every strategy once at the same settings (the order rotates between rounds,
so slow drift of a shared machine's load spreads over all contenders). Per run, step 0 is
dropped (first-call allocations) and the median over the remaining steps is taken of the step
time and of each loop phase (``phase/<name>_time_s`` in the train records). Ratios are to
``none`` of the same round; median and min/max over rounds are reported.

Where the cost sits: ``generate``/``verify`` are the same work in every strategy. **Extra model
compute** is ``update`` over ``none``'s (pooled rows, SFT batches) plus the strategy phase's model
calls: ``strategy.logprobs`` (the receiver's log-prob forward, e.g. PRP's importance weights) and
``strategy.generate`` (extra completions, e.g. ``hint``). **Pure overhead** is the rest of the
strategy phase (``strategy.retokenize``, i.e. THL, plus routing, buffers and advantages) plus
``publish`` over ``none``'s (the exchange). Both are given as a share of a ``none`` step.
Timing-only: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from mutualrl.config import load_config
from mutualrl.malloc import reuse_large_buffers
from mutualrl.provenance import git_commit, machine_info
from mutualrl.run import train
from mutualrl.run.metrics import read_metrics
from mutualrl.strategies.base import STRATEGIES

PHASES = ("generate", "verify", "publish", "strategy", "update")
PARTS = ("strategy.retokenize", "strategy.logprobs", "strategy.generate")  # inside "strategy"


def one_run(config: str, strategy: str, steps: int, overrides: list[str], out: Path) -> dict:
    cfg = load_config(
        config,
        [
            f'strategy="{strategy}"',
            f"steps={steps}",
            "eval.every=0",
            f'output_dir="{out}"',
            *overrides,
        ],
    )
    train(cfg)
    recs = [r for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"][1:]
    res = {"step": statistics.median(r["time_s"] for r in recs)}
    for p in PHASES + PARTS:
        res[p] = statistics.median(r.get(f"phase/{p}_time_s", 0.0) for r in recs)
    # per step, then the median: the parts of one step belong together
    res["model_in_strategy"] = statistics.median(
        r.get("phase/strategy.logprobs_time_s", 0.0) + r.get("phase/strategy.generate_time_s", 0.0)
        for r in recs
    )
    res["strategy_overhead"] = statistics.median(
        r.get("phase/strategy_time_s", 0.0)
        - r.get("phase/strategy.logprobs_time_s", 0.0)
        - r.get("phase/strategy.generate_time_s", 0.0)
        for r in recs
    )
    return res


def summarize(rounds: list[dict[str, dict]]) -> dict:
    out = {}
    for name in rounds[0]:
        ratio = [r[name]["step"] / r["none"]["step"] for r in rounds]
        keys = PHASES + PARTS + ("model_in_strategy", "strategy_overhead")
        extra = {p: [(r[name][p] - r["none"][p]) / r["none"]["step"] for r in rounds] for p in keys}
        model = [
            (
                r[name]["update"]
                - r["none"]["update"]
                + r[name]["model_in_strategy"]
                - r["none"]["model_in_strategy"]
            )
            / r["none"]["step"]
            for r in rounds
        ]
        pure = [
            (
                r[name]["strategy_overhead"]
                - r["none"]["strategy_overhead"]
                + r[name]["publish"]
                - r["none"]["publish"]
            )
            / r["none"]["step"]
            for r in rounds
        ]
        out[name] = {
            "step_ratio_median": statistics.median(ratio),
            "step_ratio_min": min(ratio),
            "step_ratio_max": max(ratio),
            "extra_model_compute": statistics.median(model),
            "pure_overhead": statistics.median(pure),
            "pure_overhead_min": min(pure),
            "pure_overhead_max": max(pure),
            "extra_over_none_step": {p: statistics.median(v) for p, v in extra.items()},
            "per_round": [r[name] for r in rounds],
        }
    return out


def main() -> None:
    reuse_large_buffers()  # as every mutualrl process does (malloc.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--output", default="benchmarks/results/strategy_overhead.json")
    a = ap.parse_args()
    names = ["none"] + [n for n in STRATEGIES.names() if n != "none"]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        # the process's first run pays one-time costs (imports, kernels, caches): not counted
        one_run(a.config, "none", 2, a.overrides, Path(tmp) / "discarded")
        for i in range(a.rounds):
            order = names[i % len(names) :] + names[: i % len(names)]
            rounds.append(
                {
                    n: one_run(a.config, n, a.steps, a.overrides, Path(tmp) / f"{i}-{n}")
                    for n in order
                }
            )
    result = {
        "benchmark": "strategy_overhead",
        "config": a.config,
        "steps": a.steps,
        "overrides": a.overrides,
        "git_commit": git_commit(),
        "machine": machine_info(),
        "strategies": summarize(rounds),
    }
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2))
    for n, s in result["strategies"].items():
        extra = ", ".join(
            f"{p} {v:+.1%}" for p, v in s["extra_over_none_step"].items() if p in PHASES + PARTS
        )
        print(
            f"{n:9s} step x{s['step_ratio_median']:.2f} ({s['step_ratio_min']:.2f}-"
            f"{s['step_ratio_max']:.2f})  model {s['extra_model_compute']:+.1%}  pure overhead "
            f"{s['pure_overhead']:+.1%} "
            f"({s['pure_overhead_min']:+.1%}..{s['pure_overhead_max']:+.1%})"
            f"  [{extra}]"
        )
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
