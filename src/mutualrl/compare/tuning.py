"""Per-strategy tuning for ``mutualrl compare``: the same small budget for every regime, chosen on
the validation split, never on the held-out test.

``--tune KEY=V1,V2,...`` (repeatable; several keys are zipped, so ``--tune
policies.0.learning_rate=1e-5,2e-5 --tune policies.1.learning_rate=2.5e-6,5e-6`` gives two
settings) runs every strategy at every setting, each an *arm* labelled ``<strategy>@<i>``, on the
validation split (``eval.split = "validation"`` is added). When the runs are done, ``tuning.json``
in the compare's folder holds, per strategy, each setting's validation score (final greedy
pass@1, the mean over seeds and policies) and the setting chosen (the highest; the first on a
tie).

``--tuned DIR`` then runs each strategy at the setting ``DIR/tuning.json`` chose for it, on the
config's own split (held-out by default); a compare without it runs every strategy at the shared
default. A tuning made on the held-out split is refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mutualrl.config import ConfigError

TUNING_FILE = "tuning.json"
VALIDATION = 'eval.split="validation"'


@dataclass(frozen=True)
class Arm:
    """One column of a compare: a label (run folders ``<label>-seed<s>``), the strategy it runs
    and the overrides only its runs get."""

    label: str
    strategy: str
    overrides: tuple[str, ...] = field(default=())


def add_tuning_arguments(parser) -> None:
    """``--tune`` and ``--tuned`` on the compare's command line."""
    parser.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="run every strategy at each value, on the validation split, and write the best "
        "per strategy to tuning.json (repeatable: several keys are zipped)",
    )
    parser.add_argument(
        "--tuned",
        metavar="DIR",
        help="run each strategy at the setting DIR/tuning.json chose for it (a --tune compare)",
    )


def plain_arms(strategies: Sequence[str]) -> list[Arm]:
    return [Arm(s, s) for s in strategies]


def parse_tune(items: Sequence[str]) -> list[tuple[str, ...]]:
    """``["a=1,2", "b=x,y"]`` -> ``[("a=1", "b=x"), ("a=2", "b=y")]``; one line per bad item."""
    keys, columns = [], []
    for item in items:
        key, sep, values = item.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not vals:
            raise ConfigError(
                f"--tune: expected KEY=V1,V2,... (e.g. grpo.learning_rate=1e-5,2e-5), got {item!r}"
            )
        keys.append(key.strip())
        columns.append(vals)
    if len({len(c) for c in columns}) > 1:
        counts = ", ".join(f"{k} {len(c)}" for k, c in zip(keys, columns))
        raise ConfigError(f"--tune: zipped keys need as many values each; got {counts}")
    return [tuple(f"{k}={c[i]}" for k, c in zip(keys, columns)) for i in range(len(columns[0]))]


def tuning_arms(strategies: Sequence[str], settings: Sequence[tuple[str, ...]]) -> list[Arm]:
    """Every strategy at every setting, each on the validation split."""
    return [
        Arm(f"{s}@{i}", s, (VALIDATION, *setting))
        for s in strategies
        for i, setting in enumerate(settings)
    ]


def tuned_arms(strategies: Sequence[str], folder: Path) -> list[Arm]:
    """Each strategy at the setting ``folder/tuning.json`` chose for it."""
    path = Path(folder) / TUNING_FILE
    try:
        tuning = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--tuned: cannot read {path} ({exc}); expected the folder of a finished "
            "`mutualrl compare --tune ...`"
        ) from None
    if tuning.get("split") != "validation":
        raise ConfigError(
            f"--tuned: {path} was chosen on the {tuning.get('split')!r} split; settings are "
            "chosen on validation only (tune without eval.split overrides)"
        )
    missing = [s for s in strategies if s not in tuning["chosen"]]
    if missing:
        raise ConfigError(
            f"--tuned: {path} has no setting for {missing}; it tuned {sorted(tuning['chosen'])}"
        )
    return [Arm(s, s, tuple(tuning["chosen"][s]["overrides"])) for s in strategies]


def arms_state(arms: Sequence[Arm]) -> dict[str, Any] | None:
    """What the compare's state records of its arms (None for plain strategies, as before)."""
    if all(a.label == a.strategy and not a.overrides for a in arms):
        return None
    return {a.label: {"strategy": a.strategy, "overrides": list(a.overrides)} for a in arms}


def score(summary: dict[str, Any]) -> float | None:
    """A run's validation score: final greedy pass@1, the mean over its policies."""
    values = [
        v
        for k, v in summary.get("final_eval", {}).items()
        if k.startswith("policy/") and k.endswith("/heldout/pass@1") and v is not None
    ]
    return sum(values) / len(values) if values else None


def write_tuning(out: Path, state: dict[str, Any]) -> dict[str, Any] | None:
    """``tuning.json`` of a finished tuning compare (None unless every run of it is done)."""
    arms = state.get("arms")
    if not arms or not any(VALIDATION in a["overrides"] for a in arms.values()):
        return None
    runs = state["runs"]
    if any(info.get("status") != "done" for info in runs.values()):
        return None
    per: dict[str, dict[str, Any]] = {}
    for label, arm in arms.items():
        scores = []
        for name, info in runs.items():
            if info["strategy"] == label:
                summary = json.loads((out / "runs" / name / "summary.json").read_text())
                scores.append(score(summary))
        valid = [s for s in scores if s is not None]
        overrides = [o for o in arm["overrides"] if o != VALIDATION]
        per.setdefault(arm["strategy"], {"settings": []})["settings"].append(
            {
                "label": label,
                "overrides": overrides,
                "validation_pass@1": sum(valid) / len(valid) if valid else None,
                "seeds": len(valid),
            }
        )
    chosen = {}
    for strategy, entry in per.items():
        scored = [s for s in entry["settings"] if s["validation_pass@1"] is not None]
        if scored:
            chosen[strategy] = max(scored, key=lambda s: s["validation_pass@1"])
    tuning = {"split": "validation", "strategies": per, "chosen": chosen}
    (out / TUNING_FILE).write_text(json.dumps(tuning, indent=2))
    return tuning


def tuning_lines(tuning: dict[str, Any]) -> list[str]:
    """One line per strategy: each setting's validation score, and the one chosen."""
    lines = []
    for strategy, entry in tuning["strategies"].items():
        cells = ", ".join(
            f"{' '.join(s['overrides']) or 'default'}: "
            + ("n/a" if s["validation_pass@1"] is None else f"{s['validation_pass@1']:.3f}")
            for s in entry["settings"]
        )
        best = tuning["chosen"].get(strategy)
        pick = " ".join(best["overrides"]) if best else "none (no score)"
        lines.append(f"{strategy}: {cells} -> {pick}")
    return lines
