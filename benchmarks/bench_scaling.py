"""Scaling: GRPO step time as the number of policies and the completion length grow.

    python benchmarks/bench_scaling.py [--config configs/tiny.toml] [--policies 2,4,8]
        [--lengths 4,64,512] [--steps 4] [--rounds 2] [--set key=value ...]
        [--output benchmarks/results/scaling.json]

Two sweeps on the tiny policies of ``configs/tiny.toml`` (Llama on Mistral's SentencePiece and
Qwen2 on DeepSeek's 129k byte-level BPE, alternating; names made unique), one torch thread each,
run by the default threaded executor:

* **policies** 2 -> 4 -> 8 at the config's completion length, under ``none`` and ``prp``. Under
  ``prp`` every receiver pools the rollouts of its N - 1 peers, so its update batch grows with N
  as well as the number of updates: per-step work is quadratic in N by design.
* **lengths** 4 -> 64 -> 512 completion tokens at 2 policies under ``none``. There is no warm start
  (``warmup.max_steps = 0``): random policies almost never sample EOS, so completions run to the
  limit; the mean completion length actually sampled is recorded with each row.

Per run, step 0 is dropped and the median over the other steps is taken of the step time and of
each loop phase (``phase/<name>_time_s``). Each round runs every setting once, the order reversed
on odd rounds so drift of a shared machine's load spreads over all settings; medians and min/max
over rounds are reported, with each setting's ratio to the first of its sweep next to the ratio a
linear cost would give (policies / 2; tokens / the first row's tokens). Timing-only: nothing here
is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from mutualrl.config import config_from_dict, load_config, to_dict
from mutualrl.malloc import reuse_large_buffers
from mutualrl.provenance import git_commit, machine_info
from mutualrl.run import train
from mutualrl.run.metrics import read_metrics

PHASES = ("generate", "verify", "publish", "strategy", "update")


def scaled_config(
    base: str,
    overrides: list[str],
    n_policies: int,
    length: int | None,
    strategy: str,
    steps: int,
    out: Path,
):
    """``base`` with ``n_policies`` policies (its own, repeated in turn), no warm start, a final
    evaluation of one prompt, and ``length`` completion tokens (None: the config's)."""
    data = to_dict(load_config(base, overrides))
    own = data["policies"]
    data["policies"] = [
        dict(own[i % len(own)], name=f"{own[i % len(own)]['name']}-{i}") for i in range(n_policies)
    ]
    data.update(steps=steps, strategy=strategy, output_dir=str(out))
    data["warmup"]["max_steps"] = 0
    data["eval"].update(every=0, num_prompts=1, k=1)
    if length is not None:
        data["grpo"]["max_completion_length"] = length
    return config_from_dict(data, f"{base} scaled to {n_policies} policies")


def one_run(cfg) -> dict:
    train(cfg)
    recs = [
        r for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl") if r["phase"] == "train"
    ][1:]
    g = cfg.grpo
    lengths = [
        statistics.mean(r[f"policy/{p.name}/completion_length"] for p in cfg.policies) for r in recs
    ]
    res = {
        "step_s": statistics.median(r["time_s"] for r in recs),
        "completion_length": statistics.median(lengths),
        # completion tokens sampled per step, all policies together
        "completion_tokens": statistics.median(lengths)
        * len(cfg.policies)
        * g.prompts_per_step
        * g.num_generations,
    }
    for p in PHASES:
        res[p] = statistics.median(r.get(f"phase/{p}_time_s", 0.0) for r in recs)
    return res


def summarize(settings: list[tuple[str, dict]], rounds: list[dict[str, dict]]) -> list[dict]:
    rows = []
    for key, s in settings:
        runs = [r[key] for r in rounds]
        steps = [x["step_s"] for x in runs]
        rows.append(
            {
                **s,
                "key": key,
                "step_s_median": statistics.median(steps),
                "step_s_min": min(steps),
                "step_s_max": max(steps),
                "completion_length": statistics.median(x["completion_length"] for x in runs),
                "completion_tokens": statistics.median(x["completion_tokens"] for x in runs),
                "phases_median_s": {p: statistics.median(x[p] for x in runs) for p in PHASES},
            }
        )
    for row in rows:
        row["completion_tokens_per_s"] = row["completion_tokens"] / row["step_s_median"]
        first = next(
            r for r in rows if r["sweep"] == row["sweep"] and r["strategy"] == row["strategy"]
        )
        row["ratio_to_first"] = row["step_s_median"] / first["step_s_median"]
        row["linear_ratio"] = (
            row["policies"] / first["policies"]
            if row["sweep"] == "policies"
            else row["completion_tokens"] / first["completion_tokens"]
        )
    return rows


def main() -> None:
    reuse_large_buffers()  # as every mutualrl process does (malloc.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--policies", default="2,4,8")
    ap.add_argument("--lengths", default="4,64,512")
    ap.add_argument("--strategies", default="none,prp", help="for the policies sweep")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--output", default="benchmarks/results/scaling.json")
    a = ap.parse_args()
    settings = [
        (f"policies={n},{s}", {"sweep": "policies", "policies": n, "length": None, "strategy": s})
        for s in a.strategies.split(",")
        for n in map(int, a.policies.split(","))
    ]
    settings += [
        (f"length={t}", {"sweep": "lengths", "policies": 2, "length": t, "strategy": "none"})
        for t in map(int, a.lengths.split(","))
    ]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        # the process's first run pays one-time costs (imports, tokenizers, THL tables): not counted
        train(scaled_config(a.config, a.overrides, 2, None, "none", 1, Path(tmp) / "discarded"))
        for i in range(a.rounds):
            order = settings if i % 2 == 0 else settings[::-1]
            done = {}
            for key, s in order:
                cfg = scaled_config(
                    a.config,
                    a.overrides,
                    s["policies"],
                    s["length"],
                    s["strategy"],
                    a.steps,
                    Path(tmp) / f"{i}-{key.replace(',', '-')}",
                )
                done[key] = one_run(cfg)
                print(
                    f"round {i + 1}/{a.rounds} {key}: step {done[key]['step_s']:.2f} s", flush=True
                )
            rounds.append(done)
    rows = summarize(settings, rounds)
    result = {
        "benchmark": "scaling",
        "config": a.config,
        "steps": a.steps,
        "rounds": a.rounds,
        "overrides": a.overrides,
        "git_commit": git_commit(),
        "machine": machine_info(),
        "rows": rows,
    }
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2))
    print(
        f"{'setting':22s} {'step s (min-max)':>22s} {'x first':>8s} {'x linear':>9s} "
        f"{'tokens/step':>11s} {'tok/s':>8s}  update / generate / strategy s"
    )
    for r in rows:
        ph = r["phases_median_s"]
        print(
            f"{r['key']:22s} {r['step_s_median']:8.2f} "
            f"({r['step_s_min']:.2f}-{r['step_s_max']:.2f})"
            f"{r['ratio_to_first']:8.2f}x {r['linear_ratio']:8.2f}x {r['completion_tokens']:11.0f} "
            f"{r['completion_tokens_per_s']:8.0f}  {ph['update']:.2f} / {ph['generate']:.2f} / "
            f"{ph['strategy']:.2f}"
        )
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
