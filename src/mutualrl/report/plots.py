"""The compare report's plots: one line per strategy (mean over seeds), a min-max band over seeds.

Per policy: training reward and held-out pass@1 per family against the step; retokenization (THL)
residuals and PRP density ratios where some strategy logged them. matplotlib's object API only
(no pyplot state), so plotting is safe anywhere.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mutualrl.report.data import (
    DENSITY_PREFIX,
    THL_HEADLINE,
    THL_PREFIX,
    RunData,
    final_heldout,
    policies_of,
)

MAX_PANELS = 6


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
    head = c[1:window] / np.arange(1, window)  # partial windows at the start
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
    return (
        steps,
        np.array([np.mean(v) for v in vals]),
        np.array([np.min(v) for v in vals]),
        np.array([np.max(v) for v in vals]),
    )


@dataclass(frozen=True)
class PlotSpec:
    path: Path
    title: str
    panels: list[tuple[str, str]]  # (metric key under policy/<p>/, panel title)
    phase: str
    ylabel: str
    window: int = 1
    unit_range: bool = False  # y in [0, 1]
    xlabel: str = "GRPO step"


MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def plot_panels(
    spec: PlotSpec, policy: str, groups: dict[str, list[RunData]], colors: dict[str, Any]
) -> bool:
    """One panel per metric, one line per strategy (mean over seeds) and a min-max band."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    ncols = min(3, len(spec.panels))
    nrows = math.ceil(len(spec.panels) / ncols)
    fig = Figure(
        figsize=(10, 4 if nrows == 1 else 1.2 + 2.8 * nrows), dpi=120, layout="constrained"
    )
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, (key, panel_title) in zip(axes, spec.panels):
        for i, (strategy, runs) in enumerate(groups.items()):
            b = band(runs, f"policy/{policy}/{key}", spec.phase, spec.window)
            if b is None:
                continue
            steps, mean, lo, hi = b
            # The control is dashed, hollow and on top, so it stays visible where lines coincide;
            # other
            # strategies get their own marker, larger for earlier ones, so coinciding points show.
            control = strategy == "none"
            marker = MARKERS[i % len(MARKERS)] if len(steps) <= 12 else None
            (line,) = ax.plot(
                steps,
                mean,
                "--" if control else "-",
                color=colors[strategy],
                lw=1.8,
                marker=marker,
                ms=max(3.0, 8.0 - 1.3 * i),
                zorder=3 if control else 2,
                mfc="none" if control else colors[strategy],
            )
            ax.fill_between(steps, lo, hi, color=colors[strategy], alpha=0.18, lw=0)
            handles[f"{strategy} (n={len(runs)})"] = line
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel(spec.xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(spec.ylabel, fontsize=9)
        ax.grid(alpha=0.3)
        if spec.unit_range:
            ax.set_ylim(-0.03, 1.03)
    for ax in axes[len(spec.panels) :]:
        ax.set_visible(False)
    if not handles:
        return False
    smoothed = f"moving average over {spec.window} steps; " if spec.window > 1 else ""
    fig.suptitle(
        f"{spec.title}\n({smoothed}line: mean over seeds; band: min–max over seeds)", fontsize=11
    )
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
    families = sorted(
        {
            k.split("/")[1]
            for r in runs
            for k in final_heldout(r, policy)
            if "/" in k and k.startswith("pass@1/")
        }
    )
    n_steps = max(
        (len(r.series(f"policy/{policy}/reward/mean", "train")[0]) for r in runs), default=0
    )
    window = max(1, round(n_steps / 20))
    fam_reward = sorted(
        {
            k
            for r in runs
            for k in r.policy_keys(policy, "reward/")
            if re.fullmatch(r"reward/[^/]+/mean", k)
        }
    )
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", policy)
    specs = [
        PlotSpec(
            plots / f"reward-{safe}.png",
            f"{policy}: train reward",
            [("reward/mean", "all families")] + [(k, k.split("/")[1]) for k in fam_reward],
            "train",
            "mean reward",
            window,
            unit_range=True,
        ),
        PlotSpec(
            plots / f"heldout-{safe}.png",
            f"{policy}: held-out pass@1 (greedy)",
            [(f"heldout/{f}/pass@1", f) for f in families] + [("heldout/pass@1", "all families")],
            "eval",
            "pass@1",
            unit_range=True,
            xlabel="GRPO steps completed",
        ),
    ]
    for prefix, name, what in (
        (THL_PREFIX, "thl", "retokenization (THL) residuals of received peer rollouts"),
        (DENSITY_PREFIX, "density-ratio", "PRP density ratio of peer rollouts"),
    ):
        keys = _plotted_keys(sorted(set().union(*(r.policy_keys(policy, prefix) for r in runs))))
        if keys:
            specs.append(
                PlotSpec(
                    plots / f"{name}-{safe}.png",
                    f"{policy}: {what}",
                    [(k, k.removeprefix(THL_PREFIX)) for k in keys],
                    "train",
                    "per-step value",
                    window,
                )
            )
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
