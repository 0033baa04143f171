"""Bounded staleness past this machine: the real ``run_paced`` driving workers whose steps only
wait.

Each worker is an ``pacing.PhasedWorker`` whose ``produce`` (generation) and ``learn`` (the
update) sleep for times drawn from a heavy-tailed distribution: a log-normal around the worker's
own speed (workers differ, as heterogeneous policies do), and now and then a straggler step many
times longer (a long-tailed generation, a slow node). Every worker publishes one record per step
to every other, as a paced ``mutualrl train`` does, so the channel, the freshness check and the
accounting run as they do there. The draws are seeded per worker and step: every ``k`` sees the
same step times.

Throughput is steps completed per second of wall time, over all workers; ``k = 0`` is lock-step
(no worker starts step s before every worker has finished step s - 1). Rows for 2, 8 and 64
workers and k = 0, 1, 2, 4 go to JSON with the machine and the commit, and a plot to
``docs/images/paced-simulation.png``.

    python benchmarks/sim_paced.py --json benchmarks/results/paced_simulation.json \\
        --plot docs/images/paced-simulation.png
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from mutualrl.pacing import QueueChannel, VersionGate, run_paced
from mutualrl.provenance import git_commit, machine_info

ROOT = Path(__file__).resolve().parent.parent


class SleepyWorker:
    """Generation then update, each ``scale * speed * lognormal`` seconds, stragglers included."""

    def __init__(self, index: int, args) -> None:
        rng = np.random.default_rng([args.seed, index])
        self.speed = float(rng.uniform(0.7, 1.4))  # heterogeneous workers
        self.times = [self._draw(rng, args) for _ in range(args.steps)]

    def _draw(self, rng, args) -> tuple[float, float]:
        gen = args.scale * self.speed * float(rng.lognormal(0.0, args.sigma))
        if rng.random() < args.straggler_p:
            gen *= args.straggler_x
        return gen, 0.5 * args.scale * self.speed * float(rng.lognormal(0.0, args.sigma / 2))

    def produce(self, k: int) -> list:
        time.sleep(self.times[k][0])
        return [k]

    def learn(self, k: int, incoming) -> None:
        time.sleep(self.times[k][1])


def simulate(workers: int, k: int, args) -> dict:
    names = [f"w{i}" for i in range(workers)]
    team = {n: SleepyWorker(i, args) for i, n in enumerate(names)}
    gate = VersionGate(names, max_staleness=k)
    t0 = time.perf_counter()
    report = run_paced(team, args.steps, gate, QueueChannel(names), step_timeout_s=60.0)
    wall = time.perf_counter() - t0
    assert report.balanced() and not report.failures
    busy = sum(sum(g + u for g, u in w.times) for w in team.values())
    return {
        "workers": workers,
        "k": k,
        "steps": args.steps,
        "wall_s": wall,
        "steps_per_s": workers * args.steps / wall,
        "busy_fraction": busy / (workers * wall),
        "wait_s_mean": float(np.mean(list(report.wait_s.values()))),
        "stale_dropped": sum(report.dropped_stale.values()),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for workers in sorted({r["workers"] for r in rows}):
        mine = sorted((r for r in rows if r["workers"] == workers), key=lambda r: r["k"])
        base = mine[0]["steps_per_s"]
        ax.plot(
            [r["k"] for r in mine],
            [r["steps_per_s"] / base for r in mine],
            marker="o",
            label=f"{workers} workers",
        )
    ax.axhline(1.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("allocation.max_staleness (k)")
    ax.set_ylabel("throughput / lock-step")
    ax.set_title("run_paced with heavy-tailed step times (simulated)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 8, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--scale", type=float, default=0.02, help="median generation seconds")
    ap.add_argument("--sigma", type=float, default=0.6, help="log-normal spread of a step")
    ap.add_argument("--straggler-p", type=float, default=0.03)
    ap.add_argument("--straggler-x", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    rows = []
    for workers in args.workers:
        for k in args.k:
            rows.append(simulate(workers, k, args))
            base = next(r for r in rows if r["workers"] == workers and r["k"] == args.k[0])
            print(
                f"{workers:3d} workers  k={k}  {rows[-1]['steps_per_s']:8.1f} steps/s  "
                f"{rows[-1]['steps_per_s'] / base['steps_per_s']:.2f}x lock-step  "
                f"busy {rows[-1]['busy_fraction']:.0%}",
                flush=True,
            )
    out = {
        "benchmark": "sim_paced",
        "commit": git_commit(ROOT),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
