"""The compare report itself: ``report.md`` (tables, plots, runs, config) and ``report.json``.

Built only from what the runs wrote and the compare's state (``compare.json``), so it can be
rebuilt at any time (``mutualrl compare --report-only``). How to read it:
``docs/reading-the-report.md``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mutualrl.report.analysis import analyse
from mutualrl.report.analysis_md import analysis_sections, eval_set_lines, section_glance
from mutualrl.report.data import (
    DENSITY_PREFIX,
    THL_HEADLINE,
    THL_PREFIX,
    RunData,
    accuracy_columns,
    build_table,
    bytes_exchanged,
    cost_columns,
    load_runs,
    policies_of,
    transfer_columns,
    warm_started,
)
from mutualrl.report.plots import MAX_PANELS, make_plots


# ---- formatting -------------------------------------------------------------------------------
def _human(x: float, unit: str = "") -> str:
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}{unit}"
    return f"{x:.0f}{unit}"


def fmt(column: str, s: dict[str, Any] | None) -> str:
    if s is None:
        return "–"
    if column in ("wall_time_s", "train_time_s"):
        return f"{s['mean']:.1f} ± {s['std']:.1f} s"
    if column in ("tokens", "bytes_exchanged"):
        unit = "B" if column == "bytes_exchanged" else ""
        return f"{_human(s['mean'], unit)} ± {_human(s['std'], unit)}"
    sign = "+" if column.startswith("delta") and s["mean"] > 0 else ""
    return f"{sign}{s['mean']:.3f} ± {s['std']:.3f}"


_TITLES = {
    "wall_time_s": "wall time (run)",
    "train_time_s": "GRPO steps time (run)",
    "tokens": "tokens generated",
    "bytes_exchanged": "bytes exchanged (run)",
    "delta_vs_none/pass@1": "Δ pass@1 vs none",
    "transfer/peer/start": "peer pass@1 start",
    "transfer/peer/end": "peer pass@1 end",
    "transfer/peer/change": "peer change",
    "delta_vs_none/transfer/peer/end": "peer Δ vs none",
    "transfer/own/start": "own pass@1 start",
    "transfer/own/end": "own pass@1 end",
    "transfer/own/change": "own change",
    THL_PREFIX + "boundary_iou_mean": "THL boundary IoU",
    THL_PREFIX + "roundtrip_mismatch_frac": "THL round-trip mismatch",
    DENSITY_PREFIX + "_var": "density-ratio var",
}


def title(column: str) -> str:
    if column in _TITLES:
        return _TITLES[column]
    return column.replace("/", " ") if column.startswith("pass@") else column


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    head = ["policy", "strategy", "seeds", *map(title, columns)]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 3 + ["---:"] * len(columns)) + "|",
    ]
    for r in rows:
        cells = [r["policy"], f"`{r['strategy']}`", str(len(r["seeds"]))]
        cells += [fmt(c, r["columns"].get(c)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the report -------------------------------------------------------------------------------
HOW_TO_READ = """\
Each strategy ran once per seed; a seed fixes the prompts and the initial weights, so runs with the
same seed differ only in what the policies share, and `Δ pass@1 vs none` is paired by seed.
Accuracy is measured at the end of training on held-out prompts (pass@1: greedy decoding;
pass@k: k samples at the training temperature, unbiased estimator). Table cells are mean ± sample
std over seeds; plot lines are means over seeds, shaded bands span min–max. Times and bytes are
per run (shared by its policies); the GRPO steps time is what a strategy costs{warm}.
Tokens are the completion tokens each policy sampled in GRPO steps, its groups and any extra
sampling by the strategy. With few seeds, differences smaller than the spread are not evidence.
Details: `docs/reading-the-report.md`."""


HOW_TO_READ_WARM = """, while a run's wall
time also holds its warm start, paid only by the first run of each seed (the others load it)"""


TRANSFER = """\
*Own* families are those a policy was warm started on; *peer* families are the others, which only
its peers know at the start. *start* is held-out greedy pass@1 after the warm start (step 0),
*end* after the last GRPO step, *change* their difference (per seed, then averaged); `peer Δ vs
none` is the paired difference to the `none` run of the same seed. A sharing strategy that
transfers skill raises the peer columns; the own columns show what it cost."""


def _section_transfer(rows: list[dict[str, Any]]) -> list[str]:
    columns = transfer_columns(rows)
    with_roles = [r for r in rows if any(c in r["columns"] for c in columns)]
    if not with_roles:
        return []
    return [
        "## Transfer to peer families",
        "",
        TRANSFER,
        "",
        markdown_table(with_roles, columns),
        "",
    ]


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
        notes.append(
            f"THL plots show at most {MAX_PANELS} residuals (headline ones first); "
            "`report.json` has the per-step mean of every `thl/` residual per row."
        )
    else:
        notes.append(
            "No retokenization residuals (`policy/<name>/thl/...`) were logged by these "
            "strategies, so there is no THL plot."
        )
    if not any(n.startswith("density-ratio-") for n in names):
        notes.append(
            "No density-ratio metrics (`policy/<name>/prp/density_ratio...`) were logged, "
            "so there is no density-ratio plot."
        )
    return notes


def _section_runs(state: dict[str, Any], runs: list[RunData]) -> list[str]:
    done = {r.name for r in runs}
    lines = [
        "## Runs",
        "",
        "| run | status | commit | wall time | metrics |",
        "|---|---|---|---:|---|",
    ]
    for name, info in state["runs"].items():
        status = "done" if name in done else info.get("status", "pending")
        wall = f"{info['wall_time_s']:.1f} s" if info.get("wall_time_s") is not None else "–"
        link = f"[metrics.jsonl](runs/{name}/metrics.jsonl)" if name in done else "–"
        err = f" ({info['error']})" if info.get("error") and name not in done else ""
        lines.append(
            f"| `{name}` | {status}{err} | {str(info.get('commit', '–'))[:12]} | {wall} | {link} |"
        )
    return lines


def report_data(out: Path, state: dict[str, Any], runs: list[RunData], rows, made, notes) -> dict:
    return {
        "config_path": state["config_path"],
        "overrides": state["overrides"],
        "commit": state.get("commit", "unknown"),
        "strategies": state["strategies"],
        "seeds": state["seeds"],
        "policies": policies_of(runs),
        "accuracy_columns": accuracy_columns(rows),
        "transfer_columns": transfer_columns(rows),
        "cost_columns": cost_columns(rows),
        "bytes_source": {r.name: bytes_exchanged(r)[1] for r in runs},
        "rows": rows,
        "plots": [p.relative_to(out).as_posix() for ps in made.values() for p in ps],
        "notes": notes,
        "runs": state["runs"],
        "config": runs[0].config if runs else None,
    }


def _other_commits(state: dict[str, Any], current: str) -> str:
    """A resumed compare may span commits; say so rather than let one commit speak for all."""
    others = sorted(
        {str(i["commit"]) for i in state["runs"].values() if i.get("commit")} - {current}
    )
    return f" (some runs at {', '.join(f'`{c[:12]}`' for c in others)}: see Runs)" if others else ""


def _arm_lines(state: dict[str, Any]) -> list[str]:
    """A tuning or tuned compare's columns: each one's own overrides (``compare.tuning``)."""
    arms = state.get("arms")
    if not arms:
        return []
    cells = [
        f"- `{label}`: `{a['strategy']}` with "
        + (", ".join(f"`{o}`" for o in a["overrides"]) or "the shared settings")
        for label, a in arms.items()
    ]
    return ["Each column's own settings (on top of the overrides above):", "", *cells, ""]


def render_markdown(
    data: dict[str, Any],
    state: dict[str, Any],
    runs: list[RunData],
    made: dict[str, list[Path]],
    out: Path,
) -> str:
    rows = data["rows"]
    overrides = ", ".join(f"`{o}`" for o in data["overrides"]) or "none"
    lines = [
        f"# Compare: {' vs '.join(data['strategies'])}",
        "",
        f"Config `{data['config_path']}` (overrides: {overrides}); seeds 0..{data['seeds'] - 1}; "
        f"code at commit `{data['commit']}`{_other_commits(state, data['commit'])}. "
        f"{len(runs)} of {len(state['runs'])} runs finished.",
        "",
        *_arm_lines(state),
        *eval_set_lines(data["analysis"]),
        "## How to read this",
        "",
        HOW_TO_READ.format(warm=HOW_TO_READ_WARM if data["warm_start"] else ""),
        "",
        *section_glance(data["analysis"]),
        *_section_transfer(rows),
        "## Final held-out accuracy",
        "",
        markdown_table(rows, data["accuracy_columns"]),
        "",
        *analysis_sections(
            data["analysis"], (data.get("scenario") or "disjoint") if data["warm_start"] else None
        ),
        "## Cost",
        "",
        markdown_table(rows, data["cost_columns"]),
        "",
    ]
    thl = [
        THL_PREFIX + k for k in THL_HEADLINE if any(THL_PREFIX + k in r["columns"] for r in rows)
    ]
    if thl:
        with_thl = [r for r in rows if any(c in r["columns"] for c in thl)]
        lines += [
            "## Retokenization residuals (mean over steps)",
            "",
            markdown_table(with_thl, thl),
            "",
        ]
    lines += _section_plots(made, out, data["notes"]) + [""] + _section_runs(state, runs) + [""]
    return "\n".join(lines + _section_config(data["config"]))


def _section_config(config: dict[str, Any] | None) -> list[str]:
    if config is None:
        return []
    return [
        "## Config (seed 0)",
        "",
        "<details><summary>resolved config</summary>",
        "",
        "```json",
        json.dumps(config, indent=2),
        "```",
        "",
        "</details>",
        "",
    ]


def write_report(out: Path, state: dict[str, Any]) -> Path:
    """Write plots, ``report.json`` and ``report.md`` into ``out``; returns ``report.md``'s path."""
    out = Path(out)
    runs = load_runs(out, state)
    rows = build_table(runs, state["strategies"])
    made = make_plots(runs, state["strategies"], out) if runs else {}
    notes = _plot_notes(made) if runs else ["No run has finished yet."]
    data = report_data(out, state, runs, rows, made, notes)
    data["scenario"] = runs[0].config.get("scenario", "disjoint") if runs else None
    data["warm_start"] = warm_started(runs)
    data["analysis"] = analyse(runs, state["strategies"])
    (out / "report.json").write_text(json.dumps(data, indent=2))
    path = out / "report.md"
    path.write_text(render_markdown(data, state, runs, made, out))
    return path
