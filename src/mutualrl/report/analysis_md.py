"""Markdown sections of the analysis (``mutualrl.report.analysis``): starting point, paired
differences with verdicts, sample efficiency, and the trade-off table."""

from __future__ import annotations

from typing import Any

import numpy as np

from mutualrl.report.data import THL_PREFIX


def _spread(values: list[float | None], digits: int = 3, unit: str = "") -> str:
    """Mean ± sample std over the seeds that measured it; '–' when none did."""
    v = np.array([x for x in values if x is not None], float)
    if not len(v):
        return "–"
    std = float(v.std(ddof=1)) if len(v) > 1 else 0.0
    if unit == "human":
        return f"{_human(v.mean())} ± {_human(std)}"
    return f"{v.mean():.{digits}f} ± {std:.{digits}f}{unit}"


def _human(x: float) -> str:
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.0f}"


def _table(head: list[str], rows: list[list[str]], left: int) -> list[str]:
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * left + ["---:"] * (len(head) - left)) + "|",
    ]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


START = """\
Held-out results at step 0, {when}: greedy pass@1 and sampled success (the share of the k samples
at the GRPO temperature that are correct), per prompt family, mean ± std over seeds: {what}. A
family with sampled success 0 gives GRPO no signal; one between 0 and 1 does."""


def section_start(rows: list[dict[str, Any]], scenario: str | None) -> list[str]:
    """``scenario``: the one that warm started the policies; None where none was warm started."""
    if not rows:
        return []
    body = [[r["policy"], r["family"], _spread(r["greedy"]), _spread(r["sampled"])] for r in rows]
    if scenario is None:
        title = "## Starting point (no warm start)"
        text = START.format(when="before any training", what="what the policies start from")
    else:
        title = f"## Starting point (scenario `{scenario}`)"
        text = START.format(
            when="after the warm start and before any sharing", what="what the scenario set up"
        )
    return [
        title,
        "",
        text,
        "",
        *_table(["policy", "family", "greedy pass@1", "sampled success"], body, 2),
        "",
    ]


SIGNIFICANCE = """\
Each row: a strategy's result minus `none`'s on the same seed and the same held-out prompts,
averaged; the 95% interval is a hierarchical paired bootstrap over seeds and, within each seed,
prompts ({n_boot} replicates, seeded). *end*: after the last GRPO step; *area*: mean height of the
held-out greedy curve over the run (sample efficiency); *sampled*: share of correct samples at the
GRPO temperature; *own*/*peer*: the families a policy was / was not warm started on. **better** or
**worse** only when the whole interval is on one side of zero. With few seeds the interval is
coarse; a "no difference" says the data cannot tell, not that the strategies are equal."""


GLANCE = """\
One line per policy and sharing strategy: the paired difference against `none` (same seeds, same
held-out prompts) with its 95% bootstrap interval and verdict, for greedy pass@1 at the end on all
families,{roles} and for the area under its held-out curve over all families (sample efficiency);
then what the strategy cost, as its mean GRPO time and generated tokens over `none`'s. Details in
the sections below."""
GLANCE_ROLES = """ on the policy's *peer* families (what sharing should teach) and *own*
families (what it may cost; `–` where the scenario warm starts a policy on every family),"""
_GLANCE_METRICS = {  # metric -> column; the peer and own ones only where a policy has both
    "pass@1 end (all)": "Δ pass@1 end",
    "pass@1 end (peer)": "Δ peer pass@1 end",
    "pass@1 end (own)": "Δ own pass@1 end",
    "pass@1 area (all)": "Δ area",
}


def _verdict_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "–"
    verdict = "no difference" if r["verdict"].startswith("no") else f"**{r['verdict']}**"
    return f"{r['mean']:+.3f} [{r['lo']:+.2f}, {r['hi']:+.2f}] {verdict}"


def _ratio_to_none(rows: dict, policy: str, strategy: str, key: str) -> str:
    def mean(s: str) -> float | None:
        v = [x for x in rows.get((policy, s), {}).get(key, []) if x is not None]
        return float(np.mean(v)) if v else None

    mine, base = mean(strategy), mean("none")
    return f"{mine / base:.2f}×" if mine is not None and base else "–"


def eval_set_lines(analysis: dict[str, Any]) -> list[str]:
    """What the evaluations asked, per policy: the split and its distinct problems per family. A
    validation split is labelled as such: its numbers choose settings, they are not the test."""
    sets = analysis.get("eval_sets") or []
    if not sets:
        return []
    lines = []
    for e in sets:
        fams = ", ".join(f"{f} {n}" for f, n in e["families"].items())
        lines.append(
            f"- {e['policy']}: {' and '.join(e['splits'])} split, {e['distinct_problems']} "
            f"distinct problems ({fams}), each counted once"
        )
    if any("validation" in e["splits"] for e in sets):
        lines.append(
            '- **Validation split** (`eval.split = "validation"`): these numbers are for '
            "choosing settings; the held-out split is the test and chooses nothing"
        )
    return ["Evaluated on:", "", *lines, ""]


def section_glance(analysis: dict[str, Any]) -> list[str]:
    """The verdicts that answer "does it help, and at what cost", one line per regime."""
    sig = {(r["policy"], r["strategy"], r["metric"]): r for r in analysis["significance"]}
    pairs = list(dict.fromkeys((p, s) for p, s, _ in sig))
    if not pairs:
        return []
    trade = {(r["policy"], r["strategy"]): r["values"] for r in analysis["tradeoff"]}
    metrics = [m for m in _GLANCE_METRICS if any(k[2] == m for k in sig)]
    body = [
        [
            p,
            f"`{s}`",
            *(_verdict_cell(sig.get((p, s, m))) for m in metrics),
            _ratio_to_none(trade, p, s, "train_time_s"),
            _ratio_to_none(trade, p, s, "tokens"),
        ]
        for p, s in pairs
    ]
    return [
        "## At a glance: each regime against `none`",
        "",
        GLANCE.format(roles=GLANCE_ROLES if "pass@1 end (peer)" in metrics else ""),
        "",
        *_table(
            ["policy", "strategy", *(_GLANCE_METRICS[m] for m in metrics), "GRPO time", "tokens"],
            body,
            2,
        ),
        "",
    ]


def section_significance(rows: list[dict[str, Any]], n_boot: int) -> list[str]:
    if not rows:
        return [
            "## Paired differences against `none`",
            "",
            "No strategy has runs paired with `none` (same seed, per-prompt results), so "
            "there is nothing to test.",
            "",
        ]
    body = []
    for r in rows:
        verdict = r["verdict"] if r["verdict"].startswith("no") else f"**{r['verdict']}**"
        body.append(
            [
                r["policy"],
                f"`{r['strategy']}`",
                r["metric"],
                f"{r['mean']:+.3f}",
                f"[{r['lo']:+.3f}, {r['hi']:+.3f}]",
                verdict,
                f"{r['n_seeds']} × {r['n_prompts']}",
            ]
        )
    return [
        "## Paired differences against `none`",
        "",
        SIGNIFICANCE.format(n_boot=n_boot),
        "",
        *_table(
            ["policy", "strategy", "metric", "Δ vs none", "95% CI", "verdict", "seeds × prompts"],
            body,
            3,
        ),
        "",
    ]


EFFICIENCY = """\
*Area*: the held-out greedy pass@1 curve (all families) averaged over the run, step 0 included
(higher: better sooner). *Tokens / steps to {target}*: completion tokens the policy generated in
GRPO steps, and the number of GRPO steps, before the first evaluation at which its held-out pass@1
(all families) reached {target}; mean over the seeds that reached it, and how many did (0: it
started there; steps are resolved to the evaluation interval)."""


def _to_target(values: list[float | None], human: bool) -> str:
    hit = [v for v in values if v is not None]
    if not hit:
        return f"not reached (0/{len(values)})"
    mean = float(np.mean(hit))
    return f"{_human(mean) if human else f'{mean:.0f}'} ({len(hit)}/{len(values)})"


def section_efficiency(rows: list[dict[str, Any]], target: float) -> list[str]:
    if not rows:
        return []
    body = [
        [
            r["policy"],
            f"`{r['strategy']}`",
            _spread(r["area"]),
            _to_target(r["tokens_to_target"], True),
            _to_target(r["steps_to_target"], False),
        ]
        for r in rows
    ]
    return [
        "## Sample efficiency",
        "",
        EFFICIENCY.format(target=target),
        "",
        *_table(
            [
                "policy",
                "strategy",
                "area under pass@1",
                f"tokens to {target}",
                f"steps to {target}",
            ],
            body,
            2,
        ),
        "",
    ]


TRADEOFF = """\
Per strategy, side by side (mean ± std over seeds; – where not measured). **Stability**: variance
over GRPO steps of the train reward and of the policy's token entropy; KL to the start (the k3
estimate against the warm-started reference, logged only when `grpo.beta` > 0); *answers changed*:
share of held-out prompts whose greedy answer differs between step 0 and the end (a drift measure
that needs no reference); *IS-weight var*: variance of the importance weights the strategy put on
peer samples (PRP's density ratios, HACPO's and CoDistill's ratios), mean over steps. **Support**:
*rescued*: held-out prompts the policy failed (greedy) at step 0 and solves at the end; *lost*:
the reverse; out of *failed at start*. **THL residuals** of the peer rollouts it received (mean
over steps). **Cost**: time in
GRPO steps, completion tokens generated (its own groups and any extra sampling by the strategy,
such as `hint`'s), bytes through the exchange (per run)."""

_COLUMNS = [
    ("reward_var", "reward var", 4, ""),
    ("entropy_var", "entropy var", 4, ""),
    ("kl_to_start", "KL to start", 4, ""),
    ("answers_changed", "answers changed", 3, ""),
    ("is_weight_var", "IS-weight var", 3, ""),
    ("rescued", "rescued", 1, ""),
    ("lost", "lost", 1, ""),
    ("failed_at_start", "failed at start", 1, ""),
]
_COST = [
    ("train_time_s", "GRPO time", 1, " s"),
    ("tokens", "tokens", 0, "human"),
    ("bytes_exchanged", "bytes", 0, "human"),
]


def section_tradeoff(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    thl = sorted({k for r in rows for k in r["values"] if k.startswith(THL_PREFIX)})
    cols = _COLUMNS + [(k, k.replace(THL_PREFIX, "THL "), 3, "") for k in thl] + _COST
    cols = [
        c for c in cols if any(any(v is not None for v in r["values"].get(c[0], [])) for r in rows)
    ]
    body = [
        [
            r["policy"],
            f"`{r['strategy']}`",
            *(_spread(r["values"].get(k, []), d, u) for k, _, d, u in cols),
        ]
        for r in rows
    ]
    return [
        "## Trade-off: stability, support, residuals, cost",
        "",
        TRADEOFF,
        "",
        *_table(["policy", "strategy", *(t for _, t, _, _ in cols)], body, 2),
        "",
    ]


def analysis_sections(analysis: dict[str, Any], scenario: str | None) -> list[str]:
    """``scenario``: the one that warm started the policies; None where none was warm started."""
    return [
        *section_start(analysis["starting_point"], scenario),
        *section_significance(analysis["significance"], analysis["bootstrap"]["n_boot"]),
        *section_efficiency(analysis["efficiency"], analysis["target_accuracy"]),
        *section_tradeoff(analysis["tradeoff"]),
    ]
