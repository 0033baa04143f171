"""Guards on hand-made metric streams, and one tiny run a guard stops (CLI exit 3)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mutualrl.cli import GUARD_EXIT, main
from mutualrl.config import ConfigError, GuardsConfig, load_config
from mutualrl.run.guards import Guards
from mutualrl.run.metrics import read_metrics

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


def stream(guards: Guards, records: list[dict]):
    """Feed records in order; (step, tripped) of the first trip, or None."""
    for step, metrics in enumerate(records):
        record = {
            "phase": "train",
            "step": step,
            **{f"policy/p/{k}": v for k, v in metrics.items()},
        }
        tripped = guards.observe(record, ["p"])
        if tripped is not None:
            return step, tripped
    return None


def test_guards_are_off_by_default():
    records = [
        {"kl": 1e6, "loss": math.nan, "skipped_nan": 1.0, "reward/mean": r}
        for r in (1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    ]
    assert stream(Guards(GuardsConfig()), records) is None


def test_max_kl_fires_on_the_first_step_above_the_bound():
    records = [{"kl": k, "loss": 0.1} for k in (0.01, 0.05, 0.2, 0.3)]
    step, t = stream(Guards(GuardsConfig(max_kl=0.1)), records)
    assert (step, t.guard, t.policy) == (2, "max_kl", "p")
    assert "kl 0.2 > max_kl 0.1" in t.reason
    assert t.record() == {
        "phase": "guard",
        "step": 2,
        "guard": "max_kl",
        "policy": "p",
        "reason": t.reason,
    }


def test_nan_guard_needs_consecutive_skipped_steps():
    g = Guards(GuardsConfig(max_nan_steps=3))
    nan, ok = {"loss": math.nan, "skipped_nan": 1.0}, {"loss": 0.1, "skipped_nan": 0.0}
    assert stream(g, [nan, nan, ok, nan, nan, {}]) is None  # a step with no update breaks nothing
    step, t = stream(Guards(GuardsConfig(max_nan_steps=3)), [ok, nan, nan, nan])
    assert (step, t.guard) == (3, "max_nan_steps") and "3 consecutive" in t.reason


def test_reward_collapse_compares_the_last_window_with_the_best():
    cfg = GuardsConfig(reward_collapse_fraction=0.5, reward_window=2)
    rewards = [0.2, 0.6, 0.8, 0.6, 0.3, 0.2]  # window means: .4 .7 .7 .45 .25
    step, t = stream(Guards(cfg), [{"reward/mean": r} for r in rewards])
    assert (step, t.guard) == (5, "reward_collapse")
    assert "0.250" in t.reason and "best 2-step mean 0.700" in t.reason


def test_reward_collapse_ignores_a_policy_that_never_earned_reward():
    cfg = GuardsConfig(reward_collapse_fraction=0.9, reward_window=1)
    assert stream(Guards(cfg), [{"reward/mean": 0.0}] * 5) is None


def test_bad_guard_settings_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"max_kl must be > 0 - at `\$.guards`"):
        load_config(TINY, ["guards.max_kl=-1"])
    with pytest.raises(
        ConfigError, match=r"reward_collapse_fraction must be in \(0, 1\] - at `\$.guards`"
    ):
        load_config(TINY, ["guards.reward_collapse_fraction=2.0"])


def test_tiny_run_stopped_by_max_kl_exits_3_and_saves(tmp_path, fast_run_builds, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            str(TINY),
            "--output-dir",
            str(out),
            "--steps",
            "3",
            "--no-progress",
            "--set",
            "grpo.beta=0.1",
            "--set",
            "grpo.num_iterations=2",
            "--set",
            "guards.max_kl=1e-12",
        ]
    )
    assert code == GUARD_EXIT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "guard max_kl tripped for policy" in err[0]
    records = read_metrics(out / "metrics.jsonl")
    guard = [r for r in records if r["phase"] == "guard"]
    assert len(guard) == 1 and guard[0]["guard"] == "max_kl" and records[-1] == guard[0]
    trained = [r for r in records if r["phase"] == "train"]
    assert trained[-1]["step"] == guard[0]["step"] < 2
    assert (out / "policies").is_dir() and any((out / "policies").iterdir())
