"""Lock-step against paced training on this machine: two policies of unequal cost, real runs.

``configs/tiny.toml`` with its second policy made the expensive one (hidden 256, 4 layers, on the
129k DeepSeek vocabulary) beside a small first one (hidden 64, 2 layers, on Mistral's 32k), one
torch thread each, one process per policy (``allocation.executor = "process"``), 16-token
completions, strategy ``sgt``. The variants, run alternately round after round with the same
seed: lock-step (k = 0), ``max_staleness`` 1 and 2, and ``async_generation`` on top of lock-step
and of k = 1. For each: the train phase's wall seconds per step (the run's own
``phase_times_s["train"]`` over its steps), and per policy its idle fraction (the share of its
wall time its worker was not computing) and its steps a minute (``summary.json``'s ``pace``).

    python benchmarks/bench_paced.py --json benchmarks/results/paced_tiny.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mutualrl.provenance import git_commit, machine_info

ROOT = Path(__file__).resolve().parent.parent
POLICIES = (
    'policies=[{name="llama-mistral", architecture="llama", tokenizer="mistral-v1", '
    'hidden_size=64, num_layers=2, num_heads=4, learning_rate=1e-3, warmup_families=["first"]}, '
    '{name="qwen-deepseek", architecture="qwen2", tokenizer="deepseek-v3", hidden_size=256, '
    'num_layers=4, num_heads=4, learning_rate=3e-4, warmup_families=["last"]}]'
)
VARIANTS = {
    "lock-step": [],
    "k=1": ["allocation.max_staleness=1"],
    "k=2": ["allocation.max_staleness=2"],
    "lock-step + async": ["allocation.async_generation=true"],
    "k=1 + async": ["allocation.max_staleness=1", "allocation.async_generation=true"],
}


def run(out: Path, a, extra: list[str]) -> dict:
    sets = [
        f"steps={a.steps}",
        "save_steps=0",
        "eval.every=0",
        "torch_threads=1",
        'strategy="sgt"',
        'allocation.executor="process"',
        f"seed={a.seed}",
        "grpo.max_completion_length=16",
        POLICIES,
        *extra,
    ]
    cmd = [
        sys.executable,
        "-m",
        "mutualrl.cli",
        "train",
        "--config",
        str(ROOT / "configs" / "tiny.toml"),
        "--output-dir",
        str(out),
        "--overwrite",
        "--no-progress",
        *(x for s in sets for x in ("--set", s)),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    got: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, extra in VARIANTS.items():
                s = run(Path(tmp) / name.replace(" ", ""), a, extra)
                got[name].append(
                    {"step_s": s["phase_times_s"]["train"] / a.steps, "pace": s["pace"]}
                )
                print(
                    f"round {r} {name:18s} {got[name][-1]['step_s']:.3f} s/step  "
                    + "  ".join(
                        f"{p}: idle {v['idle_fraction']:.0%}" for p, v in s["pace"].items()
                    ),
                    flush=True,
                )
    rows = []
    base = statistics.median(x["step_s"] for x in got["lock-step"])
    for name, runs in got.items():
        step_s = statistics.median(x["step_s"] for x in runs)
        policies = {
            p: {
                k: statistics.median(x["pace"][p][k] for x in runs)
                for k in ("idle_fraction", "steps_per_min", "gate_wait_s", "busy_s")
            }
            for p in runs[0]["pace"]
        }
        rows.append(
            {
                "variant": name,
                "step_s_median": step_s,
                "step_s_all": [x["step_s"] for x in runs],
                "speedup_vs_lock_step": base / step_s,
                "policies": policies,
            }
        )
        print(
            f"{name:18s} {step_s:.3f} s/step  {base / step_s:.2f}x lock-step  "
            + "  ".join(
                f"{p}: idle {v['idle_fraction']:.0%}, {v['steps_per_min']:.0f} steps/min"
                for p, v in policies.items()
            )
        )
    out = {
        "benchmark": "bench_paced",
        "commit": git_commit(ROOT),
        "machine": machine_info(),
        "settings": {"steps": a.steps, "rounds": a.rounds, "seed": a.seed, "variants": VARIANTS},
        "rows": rows,
    }
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
