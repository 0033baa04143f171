"""What staleness costs in learning: the embedded default at ``allocation.max_staleness`` k = 0, 1,
2.

One ``mutualrl compare`` per k (the same strategies and seeds, ``--set allocation.max_staleness=k``,
into ``reports/staleness/k<k>/``), then, per policy and strategy, the final held-out pass@1 on its
own and its peer's family at each k (mean ± sample std over seeds, as the compare report gives
it), and the paired difference of k >= 1 against k = 0 (seed by seed, prompt by prompt: the runs of
one seed start from the same warm start
and are asked the same held-out prompts) with the compare report's hierarchical bootstrap
interval. Paced runs depend on how the policies' steps interleave on the machine, so their
numbers are one draw of that too; lock-step ones are reproducible.

    python benchmarks/staleness_cost.py --json benchmarks/results/staleness_cost.json
    python benchmarks/staleness_cost.py --report-only --json ...   # the compares already ran
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mutualrl.provenance import git_commit, machine_info
from mutualrl.report.analysis import load_curves, paired_metrics, prompt_metrics, prompt_roles
from mutualrl.report.data import load_runs, stat

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("pass@1 end (own)", "pass@1 end (peer)")


def run_compare(k: int, a) -> Path:
    out = a.reports / f"k{k}"
    if not a.report_only:
        cmd = [
            sys.executable,
            "-m",
            "mutualrl.cli",
            "compare",
            "--config",
            str(a.config),
            "--strategies",
            a.strategies,
            "--seeds",
            str(a.seeds),
            "--jobs",
            str(a.jobs),
            "--output-dir",
            str(out),
            "--set",
            f"allocation.max_staleness={k}",
            "--no-progress",
        ]
        if (out / "compare.json").exists():
            cmd.append("--resume")
        subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def curves_and_roles(out: Path) -> dict:
    """(policy, strategy, seed) -> (held-out curve, the families to test over) of that run."""
    runs = load_runs(out, json.loads((out / "compare.json").read_text()))
    by = {(r.strategy, r.seed): r for r in runs}
    return {
        key: (c, prompt_roles(by[key[1], key[2]], key[0], c))
        for key, c in load_curves(runs).items()
    }


def table(results: dict[int, dict], ks: list[int]) -> list[dict]:
    """Per policy, strategy and k: the final metrics' mean ± sample std over seeds and, for k
    other than the first, the paired difference to the first k over the seeds both ran."""
    base = results[ks[0]]
    rows = []
    for policy, strategy in sorted({(p, s) for p, s, _ in base}):
        for k in ks:
            seeds = sorted(
                sd
                for p, s, sd in results[k]
                if (p, s) == (policy, strategy) and (policy, strategy, sd) in base
            )
            runs = [results[k][policy, strategy, sd] for sd in seeds]
            row = {"policy": policy, "strategy": strategy, "k": k, "seeds": seeds}
            finals = [prompt_metrics(curve, roles) for curve, roles in runs]
            diffs = (
                paired_metrics(
                    [c for c, _ in runs],
                    [base[policy, strategy, sd][0] for sd in seeds],
                    runs[0][1],
                )
                if k != ks[0]
                else {}
            )
            for m in METRICS:
                spread = stat([float(f[m].mean()) for f in finals])
                row[m] = {"mean": spread["mean"], "std": spread["std"]}
                if m in diffs:
                    row[m]["vs_k0"] = diffs[m].as_dict()
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "default.toml")
    ap.add_argument("--strategies", default="none,prp,sgt")
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--reports", type=Path, default=ROOT / "reports" / "staleness")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    results = {k: curves_and_roles(run_compare(k, a)) for k in a.k}
    rows = table(results, a.k)
    for r in rows:
        cells = []
        for m in METRICS:
            c = r[m]
            diff = c.get("vs_k0")
            cells.append(
                f"{m.split('(')[1][:-1]} {c['mean']:.3f} ± {c['std']:.3f}"
                + (
                    f" ({diff['mean']:+.3f} [{diff['lo']:+.3f}, {diff['hi']:+.3f}]"
                    f" {diff['verdict']})"
                    if diff
                    else ""
                )
            )
        print(f"{r['policy']:14s} {r['strategy']:5s} k={r['k']}  " + "  ".join(cells))
    if a.json:
        config = a.config.relative_to(ROOT) if a.config.is_relative_to(ROOT) else a.config
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(
            json.dumps(
                {
                    "benchmark": "staleness_cost",
                    "commit": git_commit(ROOT),
                    "machine": machine_info(),
                    "settings": {
                        "config": str(config),
                        "k": a.k,
                        "strategies": a.strategies,
                        "seeds": a.seeds,
                    },
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
