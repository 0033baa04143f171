"""Scenarios: which families each policy's warm start teaches, how much of its peers', and where
it stops; validated at config load with the field path in the error, except what needs the
plug-in registry or the task (``check_scenario``, run before a run writes anything)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from mutualrl.config import ConfigError, load_config
from mutualrl.run.scenarios import (
    SCENARIOS,
    ScenarioSpec,
    WarmPlan,
    check_scenario,
    describe,
    own_families,
    own_prompts,
    peer_count,
    peer_prompts,
    shared_answers,
    warm_plans,
)
from mutualrl.tasks import build_task

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.toml"


def test_the_default_is_disjoint_and_teaches_each_policy_its_own_families():
    cfg = load_config(DEFAULT)
    assert cfg.scenario == "disjoint" and set(SCENARIOS.names()) >= {
        "disjoint",
        "overlap",
        "asymmetric",
    }
    plans = warm_plans(cfg)
    assert plans["llama-mistral"] == WarmPlan(("alpha",), 0.9)
    assert plans["qwen-deepseek"] == WarmPlan(("beta",), 0.9)
    assert peer_count(plans["llama-mistral"], 32) == 0


def test_overlap_adds_a_share_of_the_peers_families():
    cfg = load_config(
        DEFAULT,
        [
            'scenario="overlap"',
            "scenarios.overlap.peer_share=0.25",
            "scenarios.overlap.shared_fraction=0.5",
        ],
    )
    plan = warm_plans(cfg)["llama-mistral"]
    assert plan.families == ("alpha",) and plan.peer_families == ("beta",)
    assert peer_count(plan, 32) == 8 and own_families(cfg, "llama-mistral") == ("alpha",)
    task = build_task(cfg.task)
    shared = {"beta": shared_answers(task, "beta", plan.shared_fraction)}
    assert len(shared["beta"]) == 4  # half of the 8 facts, the same every time
    assert shared == {"beta": shared_answers(task, "beta", 0.5)}
    got = peer_prompts(task, np.random.default_rng(0), 50, plan, shared)
    assert len(got) == 50 and {p.family for p in got} == {"beta"}
    assert {p.answer for p in got} <= shared["beta"]
    assert "peer_share=0.25" in describe(cfg)


def test_asymmetric_teaches_everyone_everything_but_the_weak_one_only_part():
    cfg = load_config(
        DEFAULT, ['scenario="asymmetric"', 'scenarios.asymmetric.weak="qwen-deepseek"']
    )
    plans = warm_plans(cfg)
    assert plans["llama-mistral"] == WarmPlan(("alpha", "beta"), 0.9)
    assert plans["qwen-deepseek"] == WarmPlan(("alpha", "beta"), 0.9, own_fraction=0.5)
    task = build_task(cfg.task)
    weak = own_prompts(task, np.random.default_rng(1), 64, plans["qwen-deepseek"])
    strong = own_prompts(task, np.random.default_rng(1), 64, plans["llama-mistral"])
    assert len({p.answer for p in weak}) == 8 and len({p.answer for p in strong}) == 16


@pytest.mark.parametrize(
    "sets, where",
    [
        (
            ['scenario="overlap"', "scenarios.overlap.peer_share=1.5"],
            "peer_share must be in (0, 1) - at `$.scenarios.overlap`",
        ),
        (['scenario="overlap"', "scenarios.overlap.typo=1"], "$.scenarios.overlap"),
        (
            ['scenario="asymmetric"', 'scenarios.asymmetric.weak="bob"'],
            "scenarios.asymmetric.weak: 'bob'",
        ),
    ],
)
def test_bad_scenarios_fail_at_load_naming_the_field(sets, where):
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, sets)
    assert where in str(err.value)


def test_every_built_in_table_is_checked_at_load_whichever_scenario_runs():
    with pytest.raises(
        ConfigError, match=r"peer_share must be in \(0, 1\) - at `\$\.scenarios\.overlap`"
    ):
        load_config(DEFAULT, ["scenarios.overlap.peer_share=1.5"])
    # a weak policy of another config's asymmetric table is only checked when it runs
    assert load_config(DEFAULT, ['scenarios.asymmetric.weak="bob"']).scenario == "disjoint"


def test_an_unknown_scenario_fails_the_run_check_naming_the_known_ones():
    # The registry takes plug-ins, so the config layer cannot know every name: the run checks it.
    cfg = load_config(DEFAULT, ['scenario="nope"'])
    with pytest.raises(ConfigError) as err:
        check_scenario(cfg)
    assert "unknown scenario 'nope'; known: asymmetric, disjoint, overlap" in str(err.value)


class _MineParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    depth: int = 1


def test_a_plug_in_scenario_gets_its_table_checked_by_its_own_struct(monkeypatch):
    def plan(params, cfg):
        return {p.name: WarmPlan((), params.depth / 10) for p in cfg.policies}

    monkeypatch.setitem(SCENARIOS._items, "mine", ScenarioSpec(_MineParams, plan, "test only"))
    cfg = load_config(DEFAULT, ['scenario="mine"', "scenarios.mine.depth=3"])
    assert cfg.scenarios.plugins == {"mine": {"depth": 3}}
    check_scenario(cfg)
    assert warm_plans(cfg)["llama-mistral"].target_accuracy == pytest.approx(0.3)
    assert describe(cfg) == "mine (depth=3)"
    bad = load_config(DEFAULT, ['scenario="mine"', "scenarios.mine.width=3"])
    with pytest.raises(ConfigError, match=r"unknown field `width` - at `\$\.scenarios\.mine`"):
        check_scenario(bad)
