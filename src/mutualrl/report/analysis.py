"""The compare's analysis: paired statistics against ``none``, sample efficiency, the starting point
and the trade-off table, from what the runs wrote (``metrics.jsonl`` and ``heldout.jsonl``).

Every number here is per policy and strategy. Per-prompt held-out results make the paired
bootstrap possible (``mutualrl.report.stats``): the runs of a seed evaluate the same prompts in
the same order, so a strategy's result on a prompt is compared with ``none``'s on that prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mutualrl.report.data import (
    THL_HEADLINE,
    THL_PREFIX,
    RunData,
    bytes_exchanged,
    is_weight_var,
    own_families_of,
    policies_of,
    tokens_generated,
    tokens_per_step,
)
from mutualrl.report.stats import cost_to_target, curve_area, paired_difference, wilson_interval
from mutualrl.run.evaluation import read_heldout

# Held-out pass@1 (all families) a regime must reach for "tokens to target".
TARGET_ACCURACY = 0.75
BOOTSTRAP_SEED = 0
N_BOOT = 2000


@dataclass(frozen=True)
class Curve:
    """One policy's held-out results in one run: T evaluations x P prompts."""

    steps: np.ndarray  # (T,)
    greedy: np.ndarray  # (T, P) 1.0 if the greedy answer was correct
    sampled: np.ndarray  # (T, P) share of the k samples that were correct
    texts: list[list[str]]  # (T, P) greedy answers
    families: np.ndarray  # (P,)
    prompt_ids: tuple[str, ...]
    split: str = "heldout"  # eval.split the prompts came from (records before it: heldout)


def curve_of(records: list[dict[str, Any]], policy: str) -> Curve | None:
    """The policy's evaluations from a run's ``heldout.jsonl`` records (None if it has none)."""
    rs = sorted((r for r in records if r["policy"] == policy), key=lambda r: r["step"])
    rs = list({r["step"]: r for r in rs}.values())  # one per step (the last written wins)
    if not rs:
        return None
    return Curve(
        np.array([r["step"] for r in rs], float),
        np.array([r["greedy"] for r in rs], float),
        np.array([r["sampled"] for r in rs], float) / np.array([[r["k"]] for r in rs], float),
        [r["greedy_text"] for r in rs],
        np.array(rs[0]["families"]),
        tuple(rs[0]["prompt_ids"]),
        str(rs[0].get("split", "heldout")),
    )


def load_curves(runs: list[RunData]) -> dict[tuple[str, str, int], Curve]:
    """(policy, strategy, seed) -> Curve, for every run that wrote per-prompt results."""
    out = {}
    for r in runs:
        records = read_heldout(r.path)
        for policy in policies_of([r]):
            c = curve_of(records, policy)
            if c is not None:
                out[(policy, r.strategy, r.seed)] = c
    return out


# ---- metrics per prompt ----------------------------------------------------------------------
def prompt_roles(run: RunData, policy: str, curve: Curve) -> dict[str, list[str]]:
    """Families to test over: all of them, and the own and peer ones where the policy has both."""
    own = set(own_families_of(run, policy))
    evaluated = sorted(set(curve.families.tolist()))
    mine, peer = [f for f in evaluated if f in own], [f for f in evaluated if f not in own]
    return {"all": [], "own": mine if own and peer else [], "peer": peer if own else []}


def prompt_metrics(curve: Curve, roles: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """Per-prompt values of every tested metric: final greedy pass@1 and sampled success, and the
    area under the greedy curve, over all families and over the own/peer ones."""
    out = {}
    for role, fams in roles.items():
        sel = np.isin(curve.families, fams) if fams else np.ones(len(curve.families), bool)
        if role != "all" and not fams:
            continue
        out[f"pass@1 end ({role})"] = curve.greedy[-1, sel]
        out[f"sampled end ({role})"] = curve.sampled[-1, sel]
        out[f"pass@1 area ({role})"] = np.atleast_1d(curve_area(curve.steps, curve.greedy[:, sel]))
    return out


def significance(
    runs: list[RunData], curves: dict, strategies: Sequence[str]
) -> list[dict[str, Any]]:
    """Per policy, strategy (not ``none``) and metric: the paired difference to ``none`` with its
    hierarchical bootstrap interval and verdict, over the seeds both ran."""
    by_key = {(r.strategy, r.seed): r for r in runs}
    rows: list[dict[str, Any]] = []
    for policy in policies_of(runs):
        for strategy in [s for s in strategies if s != "none"]:
            seeds = sorted(
                s
                for (st, s) in by_key
                if st == strategy
                and ("none", s) in by_key
                and (policy, strategy, s) in curves
                and (policy, "none", s) in curves
            )
            seeds = [
                s
                for s in seeds
                if curves[(policy, strategy, s)].prompt_ids
                == curves[(policy, "none", s)].prompt_ids
            ]
            if not seeds:
                continue
            roles = prompt_roles(
                by_key[(strategy, seeds[0])], policy, curves[(policy, "none", seeds[0])]
            )
            diffs = paired_metrics(
                [curves[(policy, strategy, s)] for s in seeds],
                [curves[(policy, "none", s)] for s in seeds],
                roles,
            )
            rows.extend(
                {
                    "policy": policy,
                    "strategy": strategy,
                    "metric": metric,
                    "seeds": seeds,
                    **d.as_dict(),
                }
                for metric, d in diffs.items()
            )
    return rows


def paired_metrics(
    treat: Sequence[Curve], control: Sequence[Curve], roles: dict[str, list[str]]
) -> dict[str, Any]:
    """Per tested metric (``prompt_metrics``): the paired difference of the ``treat`` runs' curves
    against the ``control`` runs' (one of each per seed, in the same order, asked the same
    held-out prompts) with its hierarchical bootstrap interval and verdict."""
    if any(t.prompt_ids != c.prompt_ids for t, c in zip(treat, control, strict=True)):
        raise ValueError("paired runs must be asked the same held-out prompts")
    t_m = [prompt_metrics(c, roles) for c in treat]
    c_m = [prompt_metrics(c, roles) for c in control]
    return {
        metric: paired_difference(
            np.stack([m[metric] for m in t_m]),
            np.stack([m[metric] for m in c_m]),
            n_boot=N_BOOT,
            seed=BOOTSTRAP_SEED,
        )
        for metric in t_m[0]
    }


# ---- sample efficiency ------------------------------------------------------------------------
def tokens_before(run: RunData, policy: str, steps: np.ndarray) -> np.ndarray:
    """Completion tokens the policy generated in GRPO steps before each of ``steps``."""
    s, per_step = tokens_per_step(run, policy)
    return np.array([per_step[s < x].sum() for x in steps], float)


def efficiency(runs: list[RunData], curves: dict, target: float = TARGET_ACCURACY) -> list[dict]:
    """Per policy and strategy: area under the held-out pass@1 curve (its mean height over the
    run), and tokens and steps to reach ``target`` held-out pass@1 (per seed; None: not reached)."""
    rows: dict[tuple[str, str], dict] = {}
    for r in runs:
        for policy in policies_of([r]):
            c = curves.get((policy, r.strategy, r.seed))
            if c is None:
                continue
            acc = c.greedy.mean(1)  # (T,)
            row = rows.setdefault(
                (policy, r.strategy),
                {
                    "policy": policy,
                    "strategy": r.strategy,
                    "seeds": [],
                    "area": [],
                    "tokens_to_target": [],
                    "steps_to_target": [],
                    "target": target,
                },
            )
            row["seeds"].append(r.seed)
            row["area"].append(float(curve_area(c.steps, acc)))
            row["tokens_to_target"].append(
                cost_to_target(tokens_before(r, policy, c.steps), acc, target)
            )
            row["steps_to_target"].append(cost_to_target(c.steps, acc, target))
    order = {p: i for i, p in enumerate(policies_of(runs))}
    return sorted(
        rows.values(), key=lambda row: order[row["policy"]]
    )  # stable: strategies keep order


# ---- the starting point ------------------------------------------------------------------------
def starting_point(records: list[dict[str, Any]]) -> dict[str, dict[str, tuple[float, float]]]:
    """policy -> family -> (greedy pass@1, sampled success) at step 0, after the warm start."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for policy in dict.fromkeys(r["policy"] for r in records):
        c = curve_of([r for r in records if r["step"] == 0], policy)
        if c is None:
            continue
        out[policy] = {
            str(f): (
                float(c.greedy[0, c.families == f].mean()),
                float(c.sampled[0, c.families == f].mean()),
            )
            for f in sorted(set(c.families.tolist()))
        }
    return out


def starting_point_line(run_dir: str | Path) -> str:
    """``llama-mistral alpha 1.00/0.58 beta 0.00/0.01 | ...`` (greedy/sampled), or ''."""
    start = starting_point(read_heldout(run_dir))
    return " | ".join(
        f"{p} " + " ".join(f"{f} {g:.2f}/{s:.2f}" for f, (g, s) in fams.items())
        for p, fams in start.items()
    )


@dataclass(frozen=True)
class HeldoutChange:
    """One policy's greedy held-out pass@1 at its first and last evaluation (the same prompts),
    each with its 95% Wilson interval over prompts, and the paired change's bootstrap interval."""

    policy: str
    steps: tuple[int, int]
    start: tuple[float, float, float]  # pass@1, lo, hi
    end: tuple[float, float, float]
    change: tuple[float, float, float]  # mean, lo, hi (paired over prompts)
    n_prompts: int

    @property
    def verdict(self) -> str:
        """``rose``/``fell`` beyond the start's interval, else ``within the start's interval``."""
        if self.end[0] > self.start[2]:
            return "rose beyond the start's 95% interval"
        if self.end[0] < self.start[1]:
            return "fell below the start's 95% interval"
        return "within the start's 95% interval"


def heldout_changes(run_dir: str | Path) -> list[HeldoutChange]:
    """Each policy's held-out pass@1 from its first to its last evaluation (policies evaluated
    once or not at all are left out)."""
    records = read_heldout(run_dir)
    out = []
    for policy in dict.fromkeys(r["policy"] for r in records):
        c = curve_of(records, policy)
        if c is None or len(c.steps) < 2:
            continue
        first, last = c.greedy[0], c.greedy[-1]  # (P,) 0/1 each
        n = len(first)
        ends = [(float(g.mean()), *wilson_interval(int(g.sum()), n)) for g in (first, last)]
        d = paired_difference(last[None], first[None])
        out.append(
            HeldoutChange(
                policy,
                (int(c.steps[0]), int(c.steps[-1])),
                ends[0],
                ends[1],
                (d.mean, d.lo, d.hi),
                n,
            )
        )
    return out


def heldout_change_lines(run_dir: str | Path) -> list[str]:
    """``smollm2: 0.42 [0.35, 0.49] -> 0.55 [0.48, 0.62] (+0.13 [+0.07, +0.19]); rose ...``."""
    return [
        f"{h.policy}: {h.start[0]:.3f} [{h.start[1]:.3f}, {h.start[2]:.3f}] -> "
        f"{h.end[0]:.3f} [{h.end[1]:.3f}, {h.end[2]:.3f}] over {h.n_prompts} prompts "
        f"(change {h.change[0]:+.3f} [{h.change[1]:+.3f}, {h.change[2]:+.3f}]); {h.verdict}"
        for h in heldout_changes(run_dir)
    ]


def starting_points(runs: list[RunData]) -> list[dict[str, Any]]:
    """Per policy and family: greedy and sampled success at step 0 over seeds (one run per seed:
    the runs of a seed share their warm start)."""
    per_seed: dict[int, dict] = {}
    for r in runs:
        per_seed.setdefault(r.seed, starting_point(read_heldout(r.path)))
    rows: dict[tuple[str, str], dict] = {}
    for seed, start in sorted(per_seed.items()):
        for policy, fams in start.items():
            for fam, (g, s) in fams.items():
                row = rows.setdefault(
                    (policy, fam),
                    {"policy": policy, "family": fam, "seeds": [], "greedy": [], "sampled": []},
                )
                row["seeds"].append(seed)
                row["greedy"].append(g)
                row["sampled"].append(s)
    return list(rows.values())


# ---- the trade-off table ---------------------------------------------------------------------
def _var_over_steps(run: RunData, key: str) -> float | None:
    _, v = run.series(key, "train")
    return float(v.var()) if len(v) > 1 else None


def _mean_over_steps(run: RunData, key: str) -> float | None:
    _, v = run.series(key, "train")
    return float(v.mean()) if len(v) else None


def tradeoff_of(run: RunData, policy: str, curve: Curve | None) -> dict[str, float | None]:
    """One run's trade-off numbers for one policy: stability, support, residuals paid, cost."""
    head = f"policy/{policy}/"
    beta = run.config["grpo"].get("beta", 0.0)
    out = {
        "reward_var": _var_over_steps(run, head + "reward/mean"),
        "entropy_var": _var_over_steps(run, head + "entropy"),
        "kl_to_start": _mean_over_steps(run, head + "kl") if beta > 0 else None,
        "is_weight_var": is_weight_var(run, policy),
    }
    thl = [k for k in THL_HEADLINE if run.series(head + THL_PREFIX + k, "train")[1].size][:2]
    for k in thl:
        out[THL_PREFIX + k] = _mean_over_steps(run, head + THL_PREFIX + k)
    out.update({"answers_changed": None, "rescued": None, "lost": None, "failed_at_start": None})
    if curve is not None and len(curve.steps) > 1:
        start, end = curve.greedy[0] > 0, curve.greedy[-1] > 0
        out["answers_changed"] = float(
            np.mean([a != b for a, b in zip(curve.texts[0], curve.texts[-1])])
        )
        out.update(
            rescued=float((~start & end).sum()),
            lost=float((start & ~end).sum()),
            failed_at_start=float((~start).sum()),
        )
    out["train_time_s"] = run.summary.get("phase_times_s", {}).get("train")
    out["tokens"] = tokens_generated(run, policy)
    out["bytes_exchanged"] = bytes_exchanged(run)[0]
    return out


def tradeoff(runs: list[RunData], curves: dict, strategies: Sequence[str]) -> list[dict[str, Any]]:
    """Per policy and strategy: every trade-off number as its values per seed (None: not
    measured)."""
    rows = []
    for policy in policies_of(runs):
        for strategy in strategies:
            mine = [r for r in runs if r.strategy == strategy]
            if not mine:
                continue
            per_run = [tradeoff_of(r, policy, curves.get((policy, strategy, r.seed))) for r in mine]
            keys = list(dict.fromkeys(k for d in per_run for k in d))
            rows.append(
                {
                    "policy": policy,
                    "strategy": strategy,
                    "seeds": [r.seed for r in mine],
                    "values": {k: [d.get(k) for d in per_run] for k in keys},
                }
            )
    return rows


def eval_sets(curves: dict[tuple[str, str, int], Curve]) -> list[dict[str, Any]]:
    """Per policy, what its evaluations asked: the split, and how many distinct problems of each
    family (each counted once by every statistic here), over all its runs."""
    out: dict[str, dict[str, Any]] = {}
    for (policy, _, _), c in sorted(curves.items(), key=lambda kv: kv[0]):
        entry = out.setdefault(policy, {"policy": policy, "splits": set(), "families": {}})
        entry["splits"].add(c.split)
        for f in sorted(set(c.families.tolist())):
            ids = {i for i, fam in zip(c.prompt_ids, c.families) if fam == f}
            entry["families"].setdefault(str(f), set()).update(ids)
    return [
        {
            "policy": e["policy"],
            "splits": sorted(e["splits"]),
            "families": {f: len(ids) for f, ids in e["families"].items()},
            "distinct_problems": sum(len(ids) for ids in e["families"].values()),
        }
        for e in out.values()
    ]


def analyse(runs: list[RunData], strategies: Sequence[str]) -> dict[str, Any]:
    """Everything this module computes, as plain data for ``report.json`` and the markdown."""
    curves = load_curves(runs)
    return {
        "eval_sets": eval_sets(curves),
        "starting_point": starting_points(runs),
        "significance": significance(runs, curves, strategies),
        "efficiency": efficiency(runs, curves),
        "tradeoff": tradeoff(runs, curves, strategies),
        "bootstrap": {"n_boot": N_BOOT, "seed": BOOTSTRAP_SEED, "level": 0.95},
        "target_accuracy": TARGET_ACCURACY,
    }
