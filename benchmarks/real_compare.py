"""The real pair's comparison of the sharing regimes, as the results page shows it: a table and
held-out learning curves, computed from the compares recorded in ``real_cpu.json``
(``real_cpu.py --compare-dir``) and nothing else, so anyone can check the page's figures.

    python benchmarks/real_compare.py --json benchmarks/results/real_cpu.json \\
        --tuned tuned --default default --plots docs/images

Per regime and model: held-out greedy pass@1 at the last evaluation (mean ± std over seeds), its
paired difference to ``none`` over the same seeds and problems with the hierarchical bootstrap's
95% interval (seeds, then problems within a seed, resampled: ``mutualrl.report.stats``), and the
seconds a training step took (mean over the runs). ``--tuned``: the compare run at each regime's
setting chosen on validation (``mutualrl compare --tuned``); ``--default``: the compare at the
config's shared setting (a regime whose tuned setting is the default has its tuned runs there).
The curves: pass@1 at every evaluation, a line per regime (mean over seeds) and its min-max band,
one PNG per model (``real-compare-<policy>.png``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from mutualrl.report.stats import paired_difference

BASELINE = "none"


def record_of(path: Path, label: str) -> dict:
    runs = json.loads(path.read_text())["runs"]
    for r in runs:
        if r.get("label") == label:
            if "problems_by_seed" not in r:
                raise SystemExit(
                    f"{path}: run {label!r} has no per-problem results; expected a compare "
                    "recorded by real_cpu.py --compare-dir"
                )
            return r
    raise SystemExit(f"{path}: no run labelled {label!r}; it has {[r.get('label') for r in runs]}")


def strategy_of(record: dict, arm: str) -> str:
    return (record.get("arms") or {}).get(arm, {}).get("strategy", arm)


def setting_of(record: dict, arm: str) -> str:
    """The arm's own overrides (its learning rates), or ``shared default``."""
    overrides = (record.get("arms") or {}).get(arm, {}).get("overrides", [])
    return " ".join(o.split("=", 1)[1] for o in overrides) or "shared default"


def final_greedy(run: dict, policy: str) -> np.ndarray:
    by_step = run["policies"][policy]["greedy_by_step"]
    last = max(by_step, key=int)
    return np.array([c == "1" for c in by_step[last]], float)


def step_seconds(run: dict) -> float:
    steps = max(int(s) for p in run["policies"].values() for s in p["pass@1_by_step"])
    return run["phase_times_s"]["train"] / steps


def regimes(record: dict, borrowed: dict | None = None) -> dict[str, tuple[str, dict[int, dict]]]:
    """strategy -> (its setting, seed -> run); ``borrowed`` adds regimes from another record
    (their runs are the same setting: a regime tuned to the shared default)."""
    out: dict[str, tuple[str, dict[int, dict]]] = {}
    for run in record["runs"].values():
        strategy = strategy_of(record, run["strategy"])
        setting = setting_of(record, run["strategy"])
        out.setdefault(strategy, (setting, {}))[1][run["seed"]] = run
    for strategy, (setting, seeds) in (borrowed or {}).items():
        out.setdefault(strategy, (f"{setting} (its tuned runs)", seeds))
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != BASELINE, kv[0])))


def rows(by: dict, policies: list[str]) -> list[dict]:
    """One row per regime of ``regimes()``: setting, seeds, and per policy its end pass@1 and
    paired difference to the baseline on the seeds both have."""
    base = by.get(BASELINE, ("", {}))[1]
    out = []
    for strategy, (setting, seeds) in by.items():
        row = {
            "strategy": strategy,
            "setting": setting,
            "seeds": sorted(seeds),
            "step_s": float(np.mean([step_seconds(r) for r in seeds.values()])),
        }
        for policy in policies:
            ends = [r["policies"][policy]["heldout_pass@1"]["end"]["mean"] for r in seeds.values()]
            starts = [
                r["policies"][policy]["heldout_pass@1"]["start"]["mean"] for r in seeds.values()
            ]
            cell = {"start": float(np.mean(starts)), "end": float(np.mean(ends))}
            cell["end_std"] = float(np.std(ends, ddof=1)) if len(ends) > 1 else None
            common = sorted(set(seeds) & set(base))
            if strategy != BASELINE and common:
                d = paired_difference(
                    np.stack([final_greedy(seeds[s], policy) for s in common]),
                    np.stack([final_greedy(base[s], policy) for s in common]),
                )
                cell["vs_baseline"] = {
                    "mean": d.mean,
                    "lo": d.lo,
                    "hi": d.hi,
                    "verdict": d.verdict,
                    "seeds": d.n_seeds,
                    "problems": d.n_prompts,
                }
            row[policy] = cell
        out.append(row)
    return out


def markdown(record: dict, by: dict, policies: list[str], title: str) -> str:
    head = ["regime", "setting", "seeds"]
    for p in policies:
        head += [f"{p} end", f"{p} vs `{BASELINE}`"]
    head.append("s / step")
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table = rows(by, policies)
    for r in table:
        cells = [f"`{r['strategy']}`", r["setting"], str(len(r["seeds"]))]
        for p in policies:
            c = r[p]
            spread = "" if c["end_std"] is None else f" ± {c['end_std']:.2f}"
            cells.append(f"{c['end']:.2f}{spread}")
            v = c.get("vs_baseline")
            cells.append("—" if v is None else f"{v['mean']:+.2f} [{v['lo']:+.2f}, {v['hi']:+.2f}]")
        cells.append(f"{r['step_s']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    starts = ", ".join(f"{p} {np.mean([r[p]['start'] for r in table]):.2f}" for p in policies)
    problems = {s: len(v["ids"]) for s, v in record["problems_by_seed"].items()}
    lines += [
        "",
        f"Start (step 0, mean over seeds): {starts}. Distinct held-out problems per seed: "
        + ", ".join(f"seed {s}: {n}" for s, n in problems.items())
        + f". Runs done: {record['runs_done']}"
        + (f"; not finished: {', '.join(record['pending'])}" if record.get("pending") else "")
        + ".",
    ]
    return "\n".join(lines)


def plot(by: dict, policy: str, path: Path, title: str) -> None:
    """Held-out pass@1 against the step: per regime the mean over seeds and a min-max band."""
    import matplotlib
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=120, layout="constrained")
    ax = fig.subplots()
    cmap = matplotlib.colormaps["tab10"]
    for i, (strategy, (_, seeds)) in enumerate(by.items()):
        curves = [
            {int(s): v for s, v in run["policies"][policy]["pass@1_by_step"].items()}
            for run in seeds.values()
        ]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = np.array([[c[s] for s in steps] for c in curves])
        control = strategy == BASELINE
        color = (0.25, 0.25, 0.25, 1.0) if control else cmap(i % 10)
        ax.plot(
            steps,
            values.mean(0),
            "--" if control else "-",
            color=color,
            lw=1.8,
            marker="o",
            ms=3,
            label=f"{strategy} (n={len(curves)})",
            zorder=3 if control else 2,
        )
        ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.12, lw=0)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out pass@1 (greedy)")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{title}\n(line: mean over seeds; band: min–max over seeds)", fontsize=10)
    fig.legend(loc="outside right upper", title="regime")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="real_cpu.json")
    ap.add_argument("--tuned", default="tuned", help="label of the compare at the tuned settings")
    ap.add_argument("--default", help="label of the compare at the shared default, if recorded")
    ap.add_argument(
        "--same-as-default",
        default="",
        help="with --default: regimes (comma-separated) whose tuned setting is the shared "
        "default; their tuned runs stand in the default's table",
    )
    ap.add_argument("--plots", type=Path, help="folder for the curves (real-compare-<policy>.png)")
    args = ap.parse_args()
    tuned = record_of(args.json, args.tuned)
    policies = list(next(iter(tuned["runs"].values()))["policies"])
    by = regimes(tuned)
    title = "each regime at its setting chosen on validation"
    print(markdown(tuned, by, policies, f"{title} (run {args.tuned!r})"), end="\n\n")
    if args.plots is not None:
        for policy in policies:
            path = args.plots / f"real-compare-{policy}.png"
            plot(by, policy, path, f"{policy}: {title}")
            print(f"wrote {path}")
    if args.default:
        same = [s for s in args.same_as_default.split(",") if s]
        missing = [s for s in same if s not in by]
        if missing:
            raise SystemExit(f"--same-as-default: {missing} not in run {args.tuned!r}")
        default = record_of(args.json, args.default)
        title = f"every regime at the shared default (run {args.default!r})"
        both = regimes(default, {s: by[s] for s in same})
        print(markdown(default, both, policies, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
