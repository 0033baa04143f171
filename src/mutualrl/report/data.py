"""The compare report: runs' metrics in; PNG plots, ``report.md`` and ``report.json`` out.

Reads only what the runs wrote (``runs/<strategy>-seed<s>/{metrics.jsonl,summary.json,config.json}``)
and the compare's state, so a report can be rebuilt at any time. Only finished runs (with a
``summary.json``) enter the table and the plots. How to read it: ``docs/reading-the-report.md``.

Spread conventions: tables give mean ± sample std over seeds; plot bands span min-max over seeds.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mutualrl.metrics import read_metrics

THL_PREFIX = "thl/"
DENSITY_PREFIX = "prp/density_ratio"
# THL residuals shown in the markdown tables when present (report.json carries every thl/ key).
THL_HEADLINE = ("boundary_iou_mean", "roundtrip_mismatch_frac", "frac_groups_1_1",
                "length_ratio_mean", "byte_fallback_rate", "logprob_mass_error_max")
MAX_PANELS = 6
_PASS = re.compile(r"^heldout/(?:(?P<fam>[^/]+)/)?pass@(?P<k>\d+)$")


# ---- loading ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunData:
    name: str
    strategy: str
    seed: int
    path: Path
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any]

    def series(self, key: str, phase: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of ``key`` over records of ``phase``; nulls (NaN) are skipped."""
        pts = [(r["step"], r[key]) for r in self.records
               if r.get("phase") == phase and r.get(key) is not None]
        return np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)

    def policy_keys(self, policy: str, prefix: str, phase: str = "train") -> set[str]:
        head = f"policy/{policy}/{prefix}"
        return {k[len(f"policy/{policy}/"):] for r in self.records if r.get("phase") == phase
                for k in r if k.startswith(head)}


def load_runs(out: Path, state: dict[str, Any]) -> list[RunData]:
    """Every finished run of the compare, in the state's order."""
    runs = []
    for name, info in state["runs"].items():
        d = out / "runs" / name
        if not (d / "summary.json").exists():
            continue
        runs.append(RunData(name, info["strategy"], info["seed"], d, read_metrics(d / "metrics.jsonl"),
                            json.loads((d / "summary.json").read_text()),
                            json.loads((d / "config.json").read_text())))
    return runs


# ---- per-run quantities -----------------------------------------------------------------------
def final_heldout(run: RunData, policy: str) -> dict[str, float]:
    """``pass@1/<family>``, ``pass@1``, ``pass@<k>/<family>`` from the run's final evaluation."""
    out = {}
    head = f"policy/{policy}/"
    for key, value in run.summary["final_eval"].items():
        m = _PASS.match(key[len(head):]) if key.startswith(head) else None
        if m and value is not None:
            out[f"pass@{m['k']}" + (f"/{m['fam']}" if m["fam"] else "")] = float(value)
    return out


def tokens_generated(run: RunData, policy: str) -> float:
    """Completion tokens the policy sampled in GRPO steps: a ``tokens`` metric summed if logged,
    else sum over steps of mean completion length x prompts_per_step x num_generations."""
    _, tokens = run.series(f"policy/{policy}/tokens", "train")
    if len(tokens):
        return float(tokens.sum())
    _, lengths = run.series(f"policy/{policy}/completion_length", "train")
    g = run.config["grpo"]
    return float(lengths.sum() * g["prompts_per_step"] * g["num_generations"])


def bytes_exchanged(run: RunData) -> tuple[float, str]:
    """(bytes, source): the exchange log's byte counter (cumulative, so its max), or the size of
    the run's ``experience/`` folder when the counter is absent or zero (it counts flushed frames)."""
    _, counter = run.series("exchange/bytes", "train")
    if len(counter) and counter.max() > 0:
        return float(counter.max()), "exchange/bytes"
    folder = run.path / "experience"
    if folder.is_dir():
        return float(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())), "experience/ on disk"
    return 0.0, "none"


def step_means(run: RunData, policy: str, prefix: str) -> dict[str, float]:
    """Mean over train steps of each ``policy/<policy>/<prefix>...`` metric."""
    out = {}
    for key in sorted(run.policy_keys(policy, prefix)):
        _, v = run.series(f"policy/{policy}/{key}", "train")
        if len(v):
            out[key] = float(v.mean())
    return out


def run_columns(run: RunData, policy: str) -> dict[str, float]:
    """One row's worth of numbers for one run (one seed)."""
    cols = final_heldout(run, policy)
    cols["wall_time_s"] = float(run.summary["wall_time_s"])
    cols["tokens"] = tokens_generated(run, policy)
    cols["bytes_exchanged"] = bytes_exchanged(run)[0]
    cols.update(step_means(run, policy, THL_PREFIX))
    cols.update(step_means(run, policy, DENSITY_PREFIX))
    return cols


# ---- aggregation over seeds -------------------------------------------------------------------
def stat(values: Sequence[float]) -> dict[str, Any]:
    v = np.asarray(values, float)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max()), "n": len(v), "values": v.tolist()}


def policies_of(runs: list[RunData]) -> list[str]:
    return list(dict.fromkeys(p["name"] for r in runs for p in r.config["policies"]))


def build_table(runs: list[RunData], strategies: Sequence[str]) -> list[dict[str, Any]]:
    """One row per policy x strategy: every column as mean/std/min/max over seeds.

    ``delta_vs_none/pass@1`` is paired by seed (same prompts and initial weights).
    """
    rows = []
    for policy in policies_of(runs):
        per_seed = {(r.strategy, r.seed): run_columns(r, policy) for r in runs}
        for strategy in strategies:
            seeds = sorted(s for (st, s) in per_seed if st == strategy)
            if not seeds:
                continue
            cols: dict[str, list[float]] = {}
            for s in seeds:
                for k, v in per_seed[(strategy, s)].items():
                    cols.setdefault(k, []).append(v)
            paired = [per_seed[(strategy, s)].get("pass@1", math.nan) - per_seed[("none", s)]["pass@1"]
                      for s in seeds if ("none", s) in per_seed and "pass@1" in per_seed[("none", s)]]
            if strategy != "none" and paired:
                cols["delta_vs_none/pass@1"] = paired
            rows.append({"policy": policy, "strategy": strategy, "seeds": seeds,
                         "columns": {k: stat(v) for k, v in cols.items()}})
    return rows


def accuracy_columns(rows: list[dict[str, Any]]) -> list[str]:
    """pass@1 per family, pass@1 overall, pass@k per family, then the paired delta."""
    keys = {k for r in rows for k in r["columns"] if k.startswith("pass@")}
    fam1 = sorted(k for k in keys if k.startswith("pass@1/"))
    famk = sorted((k for k in keys if "/" in k and not k.startswith("pass@1/")),
                  key=lambda k: (int(k.split("/")[0][5:]), k))
    delta = ["delta_vs_none/pass@1"] if any("delta_vs_none/pass@1" in r["columns"] for r in rows) else []
    return fam1 + (["pass@1"] if "pass@1" in keys else []) + famk + delta


def cost_columns(rows: list[dict[str, Any]]) -> list[str]:
    present = {k for r in rows for k in r["columns"]}
    thl = [THL_PREFIX + k for k in THL_HEADLINE if THL_PREFIX + k in present][:2]
    density = [k for k in (DENSITY_PREFIX + "_var",) if k in present]
    return ["wall_time_s", "tokens", "bytes_exchanged", *thl, *density]


# ---- formatting -------------------------------------------------------------------------------
def _human(x: float, unit: str = "") -> str:
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}{unit}"
    return f"{x:.0f}{unit}"


def fmt(column: str, s: dict[str, Any] | None) -> str:
    if s is None:
        return "–"
    if column == "wall_time_s":
        return f"{s['mean']:.1f} ± {s['std']:.1f} s"
    if column in ("tokens", "bytes_exchanged"):
        unit = "B" if column == "bytes_exchanged" else ""
        return f"{_human(s['mean'], unit)} ± {_human(s['std'], unit)}"
    sign = "+" if column.startswith("delta") and s["mean"] > 0 else ""
    return f"{sign}{s['mean']:.3f} ± {s['std']:.3f}"


_TITLES = {"wall_time_s": "wall time (run)", "tokens": "tokens generated",
           "bytes_exchanged": "bytes exchanged (run)", "delta_vs_none/pass@1": "Δ pass@1 vs none",
           THL_PREFIX + "boundary_iou_mean": "THL boundary IoU",
           THL_PREFIX + "roundtrip_mismatch_frac": "THL round-trip mismatch",
           DENSITY_PREFIX + "_var": "density-ratio var"}


def title(column: str) -> str:
    if column in _TITLES:
        return _TITLES[column]
    return column.replace("/", " ") if column.startswith("pass@") else column


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    head = ["policy", "strategy", "seeds", *map(title, columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * len(columns)) + "|"]
    for r in rows:
        cells = [r["policy"], f"`{r['strategy']}`", str(len(r["seeds"]))]
        cells += [fmt(c, r["columns"].get(c)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- plots --------------------------------------------------------------------------------
def _colors(strategies: Sequence[str]) -> dict[str, Any]:
    """A fixed colour per strategy across every plot; the ``none`` control is dark grey."""
    import matplotlib
    cmap = matplotlib.colormaps["tab10"]
    others = [s for s in strategies if s != "none"]
    out = {s: cmap(i % 10) for i, s in enumerate(others)}
    out["none"] = (0.25, 0.25, 0.25, 1.0)
    return out


def _smooth(v: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or len(v) < window:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    head = c[1:window] / np.arange(1, window)            # partial windows at the start
    return np.concatenate([head, (c[window:] - c[:-window]) / window])


def band(runs: list[RunData], key: str, phase: str, window: int = 1):
    """(steps, mean, min, max) over runs at each step any of them logged; None if no data."""
    by_step: dict[float, list[float]] = {}
    for r in runs:
        steps, values = r.series(key, phase)
        for s, v in zip(steps, _smooth(values, window)):
            by_step.setdefault(s, []).append(v)
    if not by_step:
        return None
    steps = np.array(sorted(by_step))
    vals = [by_step[s] for s in steps]
    return (steps, np.array([np.mean(v) for v in vals]), np.array([np.min(v) for v in vals]),
            np.array([np.max(v) for v in vals]))


@dataclass(frozen=True)
class PlotSpec:
    path: Path
    title: str
    panels: list[tuple[str, str]]        # (metric key under policy/<p>/, panel title)
    phase: str
    ylabel: str
    window: int = 1
    unit_range: bool = False             # y in [0, 1]
    xlabel: str = "GRPO step"


MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def plot_panels(spec: PlotSpec, policy: str, groups: dict[str, list[RunData]],
                colors: dict[str, Any]) -> bool:
    """One panel per metric, one line per strategy (mean over seeds) and a min-max band."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    ncols = min(3, len(spec.panels))
    nrows = math.ceil(len(spec.panels) / ncols)
    fig = Figure(figsize=(10, 4 if nrows == 1 else 1.2 + 2.8 * nrows), dpi=120, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, (key, panel_title) in zip(axes, spec.panels):
        for i, (strategy, runs) in enumerate(groups.items()):
            b = band(runs, f"policy/{policy}/{key}", spec.phase, spec.window)
            if b is None:
                continue
            steps, mean, lo, hi = b
            # The control is dashed, hollow and on top, so it stays visible where lines coincide; other
            # strategies get their own marker, larger for earlier ones, so coinciding points show.
            control = strategy == "none"
            marker = MARKERS[i % len(MARKERS)] if len(steps) <= 12 else None
            (line,) = ax.plot(steps, mean, "--" if control else "-", color=colors[strategy], lw=1.8,
                              marker=marker, ms=max(3.0, 8.0 - 1.3 * i), zorder=3 if control else 2,
                              mfc="none" if control else colors[strategy])
            ax.fill_between(steps, lo, hi, color=colors[strategy], alpha=0.18, lw=0)
            handles[f"{strategy} (n={len(runs)})"] = line
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel(spec.xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(spec.ylabel, fontsize=9)
        ax.grid(alpha=0.3)
        if spec.unit_range:
            ax.set_ylim(-0.03, 1.03)
    for ax in axes[len(spec.panels):]:
        ax.set_visible(False)
    if not handles:
        return False
    fig.suptitle(spec.title + "\n(line: mean over seeds; band: min–max over seeds)", fontsize=11)
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", title="strategy")
    spec.path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(spec.path)
    return True


def _plotted_keys(keys: list[str]) -> list[str]:
    """At most ``MAX_PANELS`` keys, headline THL residuals first: a wall of 30 small panels is
    unreadable; every key's per-run mean is in ``report.json`` all the same."""
    headline = [THL_PREFIX + k for k in THL_HEADLINE] + [DENSITY_PREFIX + "_var"]
    ordered = [k for k in headline if k in keys] + [k for k in keys if k not in headline]
    return ordered[:MAX_PANELS]


def plot_specs(runs: list[RunData], policy: str, plots: Path) -> list[PlotSpec]:
    """What to draw for one policy; residual and density-ratio plots only where logged."""
    families = sorted({k.split("/")[1] for r in runs for k in final_heldout(r, policy) if "/" in k
                       and k.startswith("pass@1/")})
    n_steps = max((len(r.series(f"policy/{policy}/reward/mean", "train")[0]) for r in runs), default=0)
    window = max(1, round(n_steps / 20))
    smooth = f", moving average over {window} steps" if window > 1 else ""
    fam_reward = sorted({k for r in runs for k in r.policy_keys(policy, "reward/")
                         if re.fullmatch(r"reward/[^/]+/mean", k)})
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", policy)
    specs = [PlotSpec(plots / f"reward-{safe}.png", f"{policy}: train reward{smooth}",
                      [("reward/mean", "all families")] + [(k, k.split("/")[1]) for k in fam_reward],
                      "train", "mean reward", window, unit_range=True),
             PlotSpec(plots / f"heldout-{safe}.png", f"{policy}: held-out pass@1 (greedy)",
                      [(f"heldout/{f}/pass@1", f) for f in families] + [("heldout/pass@1", "all families")],
                      "eval", "pass@1", unit_range=True, xlabel="GRPO steps completed")]
    for prefix, name, what in ((THL_PREFIX, "thl", "retokenization (THL) residuals of received peer rollouts"),
                               (DENSITY_PREFIX, "density-ratio", "PRP density ratio of peer rollouts")):
        keys = _plotted_keys(sorted(set().union(*(r.policy_keys(policy, prefix) for r in runs))))
        if keys:
            specs.append(PlotSpec(plots / f"{name}-{safe}.png", f"{policy}: {what}{smooth}",
                                  [(k, k[len("thl/"):] if prefix == THL_PREFIX else k) for k in keys],
                                  "train", "per-step value", window))
    return specs


def make_plots(runs: list[RunData], strategies: Sequence[str], out: Path) -> dict[str, list[Path]]:
    colors = _colors(strategies)
    groups = {s: [r for r in runs if r.strategy == s] for s in strategies}
    groups = {s: rs for s, rs in groups.items() if rs}
    made: dict[str, list[Path]] = {}
    for policy in policies_of(runs):
        for spec in plot_specs(runs, policy, out / "plots"):
            if plot_panels(spec, policy, groups, colors):
                made.setdefault(policy, []).append(spec.path)
    return made


# ---- the report -------------------------------------------------------------------------------
HOW_TO_READ = """\
Each strategy ran once per seed; a seed fixes the prompts and the initial weights, so runs with the
same seed differ only in what the policies share, and `Δ pass@1 vs none` is paired by seed.
Accuracy is measured at the end of training on held-out prompts (pass@1: greedy decoding;
pass@k: k samples at the training temperature, unbiased estimator). Table cells are mean ± sample
std over seeds; plot lines are means over seeds, shaded bands span min–max. Wall time and bytes are
per run (shared by its policies); tokens are each policy's own sampled completion tokens in GRPO
steps. With few seeds, differences smaller than the spread are not evidence. Details:
`docs/reading-the-report.md`."""


def _section_plots(made: dict[str, list[Path]], out: Path, notes: list[str]) -> list[str]:
    lines = ["## Plots", ""]
    for policy, paths in made.items():
        lines += [f"### {policy}", ""]
        lines += [f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in paths] + [""]
    lines += [f"- {n}" for n in notes]
    return lines


def _plot_notes(made: dict[str, list[Path]]) -> list[str]:
    names = [p.name for ps in made.values() for p in ps]
    notes = []
    if any(n.startswith("thl-") for n in names):
        notes.append(f"THL plots show at most {MAX_PANELS} residuals (headline ones first); "
                     "`report.json` has the per-step mean of every `thl/` residual per row.")
    else:
        notes.append("No retokenization residuals (`policy/<name>/thl/...`) were logged by these "
                     "strategies, so there is no THL plot.")
    if not any(n.startswith("density-ratio-") for n in names):
        notes.append("No density-ratio metrics (`policy/<name>/prp/density_ratio...`) were logged, "
                     "so there is no density-ratio plot.")
    return notes


def _section_runs(state: dict[str, Any], runs: list[RunData]) -> list[str]:
    done = {r.name for r in runs}
    lines = ["## Runs", "", "| run | status | commit | wall time | metrics |", "|---|---|---|---:|---|"]
    for name, info in state["runs"].items():
        status = "done" if name in done else info.get("status", "pending")
        wall = f"{info['wall_time_s']:.1f} s" if info.get("wall_time_s") is not None else "–"
        link = f"[metrics.jsonl](runs/{name}/metrics.jsonl)" if name in done else "–"
        err = f" ({info['error']})" if info.get("error") and name not in done else ""
        lines.append(f"| `{name}` | {status}{err} | {str(info.get('commit', '–'))[:12]} | {wall} | {link} |")
    return lines


def report_data(out: Path, state: dict[str, Any], runs: list[RunData], rows, made, notes) -> dict:
    return {"config_path": state["config_path"], "overrides": state["overrides"],
            "commit": state.get("commit", "unknown"), "strategies": state["strategies"],
            "seeds": state["seeds"], "policies": policies_of(runs),
            "accuracy_columns": accuracy_columns(rows), "cost_columns": cost_columns(rows),
            "bytes_source": {r.name: bytes_exchanged(r)[1] for r in runs},
            "rows": rows, "plots": [p.relative_to(out).as_posix() for ps in made.values() for p in ps],
            "notes": notes, "runs": state["runs"],
            "config": runs[0].config if runs else None}


def _other_commits(state: dict[str, Any], current: str) -> str:
    """A resumed compare may span commits; say so rather than let one commit speak for all."""
    others = sorted({str(i["commit"]) for i in state["runs"].values() if i.get("commit")} - {current})
    return f" (some runs at {', '.join(f'`{c[:12]}`' for c in others)}: see Runs)" if others else ""


def render_markdown(data: dict[str, Any], state: dict[str, Any], runs: list[RunData],
                    made: dict[str, list[Path]], out: Path) -> str:
    rows = data["rows"]
    overrides = ", ".join(f"`{o}`" for o in data["overrides"]) or "none"
    lines = [f"# Compare: {' vs '.join(data['strategies'])}", "",
             f"Config `{data['config_path']}` (overrides: {overrides}); seeds 0..{data['seeds'] - 1}; "
             f"code at commit `{data['commit']}`{_other_commits(state, data['commit'])}. "
             f"{len(runs)} of {len(state['runs'])} runs finished.",
             "", "## How to read this", "", HOW_TO_READ, "",
             "## Final held-out accuracy", "", markdown_table(rows, data["accuracy_columns"]), "",
             "## Cost", "", markdown_table(rows, data["cost_columns"]), ""]
    thl = [THL_PREFIX + k for k in THL_HEADLINE if any(THL_PREFIX + k in r["columns"] for r in rows)]
    if thl:
        with_thl = [r for r in rows if any(c in r["columns"] for c in thl)]
        lines += ["## Retokenization residuals (mean over steps)", "", markdown_table(with_thl, thl), ""]
    lines += _section_plots(made, out, data["notes"]) + [""] + _section_runs(state, runs) + [""]
    if data["config"] is not None:
        lines += ["## Config (seed 0)", "", "<details><summary>resolved config</summary>", "",
                  "```json", json.dumps(data["config"], indent=2), "```", "", "</details>", ""]
    return "\n".join(lines)


def write_report(out: Path, state: dict[str, Any]) -> Path:
    """Write plots, ``report.json`` and ``report.md`` into ``out``; returns ``report.md``'s path."""
    out = Path(out)
    runs = load_runs(out, state)
    rows = build_table(runs, state["strategies"])
    made = make_plots(runs, state["strategies"], out) if runs else {}
    notes = _plot_notes(made) if runs else ["No run has finished yet."]
    data = report_data(out, state, runs, rows, made, notes)
    (out / "report.json").write_text(json.dumps(data, indent=2))
    path = out / "report.md"
    path.write_text(render_markdown(data, state, runs, made, out))
    return path


__all__ = ["RunData", "build_table", "load_runs", "make_plots", "write_report"]
