"""A compare's own state, ``compare.json``: what was asked (strategies or arms, seeds, config,
overrides and the resolved config's digest), the commit, and each run's status. Rewritten
atomically after every change, so ``--resume`` continues exactly the compare that was asked."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mutualrl.compare.tuning import arms_state
from mutualrl.config import ConfigError
from mutualrl.provenance import git_commit

STATE_FILE = "compare.json"
STATE_VERSION = 1
# What must match for --resume to continue a compare rather than start a different one.
_RESUME_KEYS = (
    "strategies",
    "seeds",
    "first_seed",
    "config_path",
    "overrides",
    "config_digest",
    "arms",
)


def config_digest(config_path: str | Path, overrides: Sequence[str]) -> str:
    """Hash of the resolved config (not the file's bytes: comments may change, values may not)."""
    import hashlib

    from mutualrl.config import load_config, to_dict

    data = to_dict(load_config(config_path, [*overrides, "seed=0", 'output_dir=""']))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def read_state(out: Path) -> dict[str, Any]:
    path = out / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no compare here (run `mutualrl compare` first)")
    return json.loads(path.read_text())


def write_state(out: Path, state: dict[str, Any]) -> None:
    tmp = out / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, out / STATE_FILE)  # atomic: an interrupt never leaves half a state file


def _new_state(
    config_path, strategies, seeds, overrides, runs, arms=None, first_seed=0
) -> dict[str, Any]:
    recorded = arms_state(arms) if arms else None
    return {
        "version": STATE_VERSION,
        "config_path": str(config_path),
        "overrides": list(overrides),
        "config_digest": config_digest(config_path, overrides),
        "strategies": [a.label for a in arms] if arms else list(strategies),
        **({"arms": recorded} if recorded else {}),
        "seeds": seeds,
        # recorded only when not 0, so a compare started before the flag existed resumes
        **({"first_seed": first_seed} if first_seed else {}),
        "commit": git_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": {
            r.name: {"strategy": r.strategy, "seed": r.seed, "status": "pending"} for r in runs
        },
    }


def open_state(out: Path, fresh: dict[str, Any], resume: bool) -> dict[str, Any]:
    """The state to continue from: the fresh one, or (``--resume``) the recorded one if it
    matches."""
    existing = out / STATE_FILE
    if not resume:
        if existing.exists() or (out / "runs").exists():
            raise ConfigError(
                f"{out} already holds a compare; pass --resume to continue it, "
                "or choose another --output-dir"
            )
        return fresh
    if not existing.exists():
        return fresh  # nothing to resume: start it
    old = read_state(out)
    diff = [k for k in _RESUME_KEYS if old.get(k) != fresh.get(k)]
    if diff:
        detail = "; ".join(f"{k}: recorded {old.get(k)!r}, now {fresh.get(k)!r}" for k in diff)
        raise ConfigError(f"--resume: {out} holds a different compare ({detail})")
    old["commit"] = fresh["commit"]
    return old
