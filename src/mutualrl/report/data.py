"""A compare's runs as numbers: loading what the runs wrote, per-run columns, aggregation over
seeds.

Reads only ``runs/<strategy>-seed<s>/{metrics.jsonl,summary.json,config.json}`` of finished runs
(those with a ``summary.json``). Tables give mean ± sample std over seeds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mutualrl.run.metrics import read_metrics

THL_PREFIX = "thl/"
DENSITY_PREFIX = "prp/density_ratio"
# What a strategy samples beyond the step's own groups (e.g. hint's hinted prompts), per step.
EXTRA_TOKENS = "strategy/generated_tokens"
# THL residuals shown in the markdown tables when present (report.json carries every thl/ key).
THL_HEADLINE = (
    "boundary_iou_mean",
    "roundtrip_mismatch_frac",
    "frac_groups_1_1",
    "length_ratio_mean",
    "byte_fallback_rate",
    "logprob_mass_error_max",
)
_PASS = re.compile(r"^heldout/(?:(?P<fam>[^/]+)/)?pass@(?P<k>\d+)$")
# Columns also given as a difference to the `none` run of the same seed.
PAIRED = ("pass@1", "transfer/peer/end")


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
        pts = [
            (r["step"], r[key])
            for r in self.records
            if r.get("phase") == phase and r.get(key) is not None
        ]
        return np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)

    def policy_keys(self, policy: str, prefix: str, phase: str = "train") -> set[str]:
        head = f"policy/{policy}/{prefix}"
        return {
            k[len(f"policy/{policy}/") :]
            for r in self.records
            if r.get("phase") == phase
            for k in r
            if k.startswith(head)
        }


def load_runs(out: Path, state: dict[str, Any]) -> list[RunData]:
    """Every finished run of the compare, in the state's order."""
    runs = []
    for name, info in state["runs"].items():
        d = out / "runs" / name
        if not (d / "summary.json").exists():
            continue
        runs.append(
            RunData(
                name,
                info["strategy"],
                info["seed"],
                d,
                read_metrics(d / "metrics.jsonl"),
                json.loads((d / "summary.json").read_text()),
                json.loads((d / "config.json").read_text()),
            )
        )
    return runs


# ---- per-run quantities -----------------------------------------------------------------------
def heldout_scores(record: dict[str, Any], policy: str) -> dict[str, float]:
    """``pass@1/<family>``, ``pass@1``, ``pass@<k>/<family>`` of ``policy`` in an evaluation
    record."""
    out = {}
    head = f"policy/{policy}/"
    for key, value in record.items():
        m = _PASS.match(key[len(head) :]) if key.startswith(head) else None
        if m and value is not None:
            out[f"pass@{m['k']}" + (f"/{m['fam']}" if m["fam"] else "")] = float(value)
    return out


def final_heldout(run: RunData, policy: str) -> dict[str, float]:
    """The held-out scores of the run's final evaluation."""
    return heldout_scores(run.summary["final_eval"], policy)


def tokens_per_step(run: RunData, policy: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, completion tokens the policy sampled in each GRPO step): its own groups (the mean
    completion length over the step's samples x prompts_per_step x num_generations) plus what the
    strategy sampled for it beyond them (``strategy/generated_tokens``)."""
    steps, lengths = run.series(f"policy/{policy}/completion_length", "train")
    g = run.config["grpo"]
    tokens = lengths * g["prompts_per_step"] * g["num_generations"]
    extra_steps, extra = run.series(f"policy/{policy}/{EXTRA_TOKENS}", "train")
    by_step = dict(zip(extra_steps.tolist(), extra.tolist()))
    return steps, tokens + np.array([by_step.get(s, 0.0) for s in steps.tolist()], float)


def tokens_generated(run: RunData, policy: str) -> float:
    """Completion tokens the policy sampled in GRPO steps, summed over steps
    (``tokens_per_step``)."""
    return float(tokens_per_step(run, policy)[1].sum())


def is_weight_var(run: RunData, policy: str) -> float | None:
    """Mean over steps of the variance of the importance weights the run's strategy put on peer
    samples: its own ``<strategy>/...weight_var`` metric, else its ``...ratio_var`` (PRP's
    ``prp/density_ratio_var``, HACPO's ``hacpo/weight_var``, CoDistill's
    ``codistill/is_weight_var``: each the variance of the weights applied); None when it logs
    none. (HACPO's ``hacpo/ratio_var`` is of its raw ratio, before the clamp.)"""
    keys = sorted(
        (
            k
            for k in run.policy_keys(policy, f"{run.config.get('strategy', run.strategy)}/")
            if k.endswith(("ratio_var", "weight_var"))
        ),
        key=lambda k: (not k.endswith("weight_var"), k),
    )
    if not keys:
        return None
    _, v = run.series(f"policy/{policy}/{keys[0]}", "train")
    return float(v.mean()) if len(v) else None


def bytes_exchanged(run: RunData) -> tuple[float, str]:
    """(bytes, source): the exchange log's byte counter (cumulative, so its max), or the size of
    the run's ``experience/`` folder when the counter is absent or zero (it counts flushed
    frames)."""
    _, counter = run.series("exchange/bytes", "train")
    if len(counter) and counter.max() > 0:
        return float(counter.max()), "exchange/bytes"
    folder = run.path / "experience"
    if folder.is_dir():
        return float(
            sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        ), "experience/ on disk"
    return 0.0, "none"


def step_means(run: RunData, policy: str, prefix: str) -> dict[str, float]:
    """Mean over train steps of each ``policy/<policy>/<prefix>...`` metric."""
    out = {}
    for key in sorted(run.policy_keys(policy, prefix)):
        _, v = run.series(f"policy/{policy}/{key}", "train")
        if len(v):
            out[key] = float(v.mean())
    return out


def heldout_at(run: RunData, policy: str, step: int) -> dict[str, float]:
    """The held-out scores of the evaluation after ``step`` GRPO steps (none if there was none)."""
    record = next(
        (r for r in run.records if r.get("phase") == "eval" and r.get("step") == step), {}
    )
    return heldout_scores(record, policy)


def family_roles(run: RunData, policy: str) -> tuple[list[str], list[str]]:
    """(own, peer): the evaluated families ``policy`` was warm started on (to its full target,
    under the run's scenario), and the others. Both empty when it had no warm start: then no
    family is its own and none its peer's."""
    own = own_families_of(run, policy)
    if not own:
        return [], []
    evaluated = sorted(
        k.split("/", 1)[1] for k in final_heldout(run, policy) if k.startswith("pass@1/")
    )
    return [f for f in evaluated if f in own], [f for f in evaluated if f not in own]


def own_families_of(run: RunData, policy: str) -> list[str]:
    """The families the run's scenario warm started ``policy`` on (none without a warm start:
    ``warmup.max_steps = 0``); a run's config.json from before scenarios existed is ``disjoint``:
    its ``warmup_families``."""
    from mutualrl.config import ConfigError, config_from_dict
    from mutualrl.run.scenarios import own_families

    if run.config.get("warmup", {}).get("max_steps", 1) <= 0:
        return []
    try:
        return list(own_families(config_from_dict(dict(run.config), str(run.path)), policy))
    except (ConfigError, KeyError):
        return next(
            (p.get("warmup_families") or [] for p in run.config["policies"] if p["name"] == policy),
            [],
        )


def warm_started(runs: Sequence[RunData]) -> bool:
    """Whether the runs' policies were warm started: a warm start of some steps, and a scenario
    that teaches some policy some family (pretrained ones with ``warmup.max_steps = 0``: no)."""
    return bool(runs) and any(
        own_families_of(runs[0], p["name"]) for p in runs[0].config["policies"]
    )


def transfer_columns_of(run: RunData, policy: str) -> dict[str, float]:
    """Held-out pass@1 on the policy's own and peer families at the start of RL (step 0, after the
    warm start) and at the end, and the change: what sharing taught it, and what it cost."""
    own, peer = family_roles(run, policy)
    start, end = heldout_at(run, policy, 0), final_heldout(run, policy)
    out: dict[str, float] = {}
    for role, families in (("peer", peer), ("own", own)):
        keys = [f"pass@1/{f}" for f in families]
        if keys and all(k in start and k in end for k in keys):
            s, e = float(np.mean([start[k] for k in keys])), float(np.mean([end[k] for k in keys]))
            out.update(
                {
                    f"transfer/{role}/start": s,
                    f"transfer/{role}/end": e,
                    f"transfer/{role}/change": e - s,
                }
            )
    return out


def run_columns(run: RunData, policy: str) -> dict[str, float]:
    """One row's worth of numbers for one run (one seed)."""
    cols = final_heldout(run, policy)
    cols.update(transfer_columns_of(run, policy))
    cols["wall_time_s"] = float(run.summary["wall_time_s"])
    train_time = run.summary.get("phase_times_s", {}).get("train")
    if train_time is not None:
        cols["train_time_s"] = float(train_time)
    cols["tokens"] = tokens_generated(run, policy)
    cols["bytes_exchanged"] = bytes_exchanged(run)[0]
    cols.update(step_means(run, policy, THL_PREFIX))
    cols.update(step_means(run, policy, DENSITY_PREFIX))
    return cols


# ---- aggregation over seeds -------------------------------------------------------------------
def stat(values: Sequence[float]) -> dict[str, Any]:
    v = np.asarray(values, float)
    return {
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
        "min": float(v.min()),
        "max": float(v.max()),
        "n": len(v),
        "values": v.tolist(),
    }


def policies_of(runs: list[RunData]) -> list[str]:
    return list(dict.fromkeys(p["name"] for r in runs for p in r.config["policies"]))


def build_table(runs: list[RunData], strategies: Sequence[str]) -> list[dict[str, Any]]:
    """One row per policy x strategy: every column as mean/std/min/max over seeds.

    ``delta_vs_none/<column>`` (for the ``PAIRED`` columns) is paired by seed: same prompts and
    initial weights.
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
            for col in PAIRED if strategy != "none" else ():
                paired = [
                    per_seed[(strategy, s)][col] - per_seed[("none", s)][col]
                    for s in seeds
                    if col in per_seed.get(("none", s), {}) and col in per_seed[(strategy, s)]
                ]
                if paired:
                    cols[f"delta_vs_none/{col}"] = paired
            rows.append(
                {
                    "policy": policy,
                    "strategy": strategy,
                    "seeds": seeds,
                    "columns": {k: stat(v) for k, v in cols.items()},
                }
            )
    return rows


def transfer_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Peer families first (did sharing teach it?), then own families (what did it cost?)."""
    present = {k for r in rows for k in r["columns"]}
    order = [
        "transfer/peer/start",
        "transfer/peer/end",
        "transfer/peer/change",
        "delta_vs_none/transfer/peer/end",
        "transfer/own/start",
        "transfer/own/end",
        "transfer/own/change",
    ]
    return [k for k in order if k in present]


def accuracy_columns(rows: list[dict[str, Any]]) -> list[str]:
    """pass@1 per family, pass@1 overall, pass@k per family, then the paired delta."""
    keys = {k for r in rows for k in r["columns"] if k.startswith("pass@")}
    fam1 = sorted(k for k in keys if k.startswith("pass@1/"))
    famk = sorted(
        (k for k in keys if "/" in k and not k.startswith("pass@1/")),
        key=lambda k: (int(k.split("/")[0][5:]), k),
    )
    delta = (
        ["delta_vs_none/pass@1"]
        if any("delta_vs_none/pass@1" in r["columns"] for r in rows)
        else []
    )
    return fam1 + (["pass@1"] if "pass@1" in keys else []) + famk + delta


def cost_columns(rows: list[dict[str, Any]]) -> list[str]:
    present = {k for r in rows for k in r["columns"]}
    thl = [THL_PREFIX + k for k in THL_HEADLINE if THL_PREFIX + k in present][:2]
    density = [k for k in (DENSITY_PREFIX + "_var",) if k in present]
    times = ["train_time_s"] if "train_time_s" in present else []
    return [*times, "wall_time_s", "tokens", "bytes_exchanged", *thl, *density]
