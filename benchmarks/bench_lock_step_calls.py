"""Is lock-step fast because its executor calls are batched? One run's steps two ways, alternating.

Lock-step drives every live policy as one member of the version gate (``run.schedule.LockStep``):
each phase is one executor call for all policies at once (generate, the strategy's, update). The
alternative it replaced would drive each policy as a member of its own (``PolicyStepper``, as a
paced run does) at staleness 0: the same steps in the same lock-step order, each policy's calls
its own, from its own driver thread. This script builds two runs of one config (strategy ``none``,
whose steps do not depend on the order the policies' calls interleave), one scheduled each way,
and times them segment by segment, alternating which goes first, in one process: the train
phase's wall seconds a step for each, and their ratio.

    python benchmarks/bench_lock_step_calls.py --config configs/default.toml \\
        --json benchmarks/results/lock_step_calls.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mutualrl.config import load_config
from mutualrl.pacing import VersionGate
from mutualrl.provenance import git_commit, machine_info
from mutualrl.run.build import build_run
from mutualrl.run.schedule import LockStep, Paced


def _runs(config: str, tmp: Path, steps: int, sets: list[str]):
    base = [*sets, 'strategy="none"', f"steps={steps}", "save_steps=0", "eval.every=0"]
    lock = build_run(load_config(config, [*base, f'output_dir="{tmp / "lock"}"']))
    apart = build_run(
        load_config(config, [*base, "allocation.max_staleness=1", f'output_dir="{tmp / "apart"}"'])
    )
    assert apart.pace is not None
    apart.pace.gate = VersionGate(list(apart.policies), max_staleness=0)  # lock-step order
    return {"batched": (lock, LockStep(lock, 0)), "per-policy": (apart, Paced(apart))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--segments", type=int, default=8, help="timed segments per schedule")
    ap.add_argument("--segment-steps", type=int, default=4, help="steps a segment")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    per_step: dict[str, list[float]] = {"batched": [], "per-policy": []}
    steps = (a.segments + 1) * a.segment_steps  # the first segment warms up, untimed
    with tempfile.TemporaryDirectory() as tmp:
        runs = _runs(a.config, Path(tmp), steps, a.set)
        try:
            for seg in range(a.segments + 1):
                end = (seg + 1) * a.segment_steps
                order = list(runs) if seg % 2 == 0 else list(runs)[::-1]
                for name in order:
                    run, schedule = runs[name]
                    t = time.perf_counter()
                    schedule.segment(end)
                    took = (time.perf_counter() - t) / a.segment_steps
                    assert schedule.reached(end), f"{name}: the segment did not reach {end}"
                    if seg:
                        per_step[name].append(took)
                if seg:
                    print(
                        f"segment {seg}: batched {per_step['batched'][-1]:.3f} s/step, "
                        f"per-policy {per_step['per-policy'][-1]:.3f} s/step",
                        flush=True,
                    )
        finally:
            for run, _ in runs.values():
                run.close()
    spread = {
        n: {"median": statistics.median(v), "min": min(v), "max": max(v)}
        for n, v in per_step.items()
    }
    ratio = [p / b for b, p in zip(per_step["batched"], per_step["per-policy"])]
    record = {
        "benchmark": "lock_step_calls",
        "command": "python benchmarks/bench_lock_step_calls.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(),
        "machine": machine_info(),
        "settings": {
            "config": a.config,
            "set": a.set,
            "segments": a.segments,
            "segment_steps": a.segment_steps,
        },
        "s_per_step": spread,
        "per_policy_over_batched": {
            "median": statistics.median(ratio),
            "min": min(ratio),
            "max": max(ratio),
        },
    }
    print(json.dumps({k: record[k] for k in ("s_per_step", "per_policy_over_batched")}, indent=1))
    if a.json:
        a.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
