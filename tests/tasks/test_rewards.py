"""Weighted reward functions: registry, weighted sum, guarded failures, config errors."""

from __future__ import annotations

import pytest

from mutualrl.config import ConfigError, TaskConfig
from mutualrl.tasks.base import Prompt
from mutualrl.tasks.rewards import REWARD_FUNCS, WeightedReward, build_rewards, mean_parts
from tests.tasks.test_verifier import Raises, Sleeps

P = Prompt(text="2 + 2?", answer="2 + 2 = 4\n#### 4", family="default")


class _Task:
    def __init__(self, verifier):
        self.verifier = verifier


class _Right:
    verifier_id, version = "right", 1

    def __call__(self, prompt, completion):
        return 1.0 if "4" in completion else 0.0


def test_builtins_are_registered():
    assert {"correctness", "boxed_format", "hash_format", "think_format"} <= set(
        REWARD_FUNCS.names()
    )


@pytest.mark.parametrize(
    "name, completion, want",
    [
        ("boxed_format", r"so \boxed{4}", 1.0),
        ("boxed_format", r"\boxed{4", 0.0),
        ("hash_format", "#### 4", 1.0),
        ("hash_format", "####", 0.0),
        ("think_format", "<think>2+2</think> 4", 1.0),
        ("think_format", "<think>2+2</think>", 0.0),
        ("think_format", "4 <think>x</think> 4", 0.0),
    ],
)
def test_format_rewards(name, completion, want):
    assert REWARD_FUNCS.get(name)(_Task(_Right()))(P, completion) == want


def test_weighted_sum_and_parts():
    r = WeightedReward(_Task(_Right()), ["correctness", "hash_format"], [1.0, 0.25], timeout_s=5)
    assert r.score(P, "#### 4") == (1.25, {"correctness": 1.0, "hash_format": 1.0})
    assert r.score(P, "#### 5") == (0.25, {"correctness": 0.0, "hash_format": 1.0})
    assert r(P, "4") == 1.0
    assert r.verifier_id == "weighted(1*right+0.25*hash-format)"
    assert mean_parts([{"a": 1.0}, {"a": 0.0}]) == {"rewards/a/mean": 0.5}
    r.close()


def test_score_many_is_score_of_each_pair_with_threads():
    r = WeightedReward(
        _Task(_Right()), ["correctness", "hash_format"], [1.0, 0.25], timeout_s=5, threads=3
    )
    items = [(P, c) for c in ("#### 4", "#### 5", "4", "5", "#### 44")]
    assert r.score_many(items) == [r.score(p, c) for p, c in items]
    assert r.score_many(items)[0] == (1.25, {"correctness": 1.0, "hash_format": 1.0})
    assert all(g.threads == 3 for _, _, g in r.terms)
    r.close()


def test_failures_give_zero_and_are_counted():
    r = WeightedReward(_Task(Raises()), ["correctness", "hash_format"], [], timeout_s=5)
    assert r.score(P, "#### 4") == (1.0, {"correctness": 0.0, "hash_format": 1.0})
    assert r.failures() == (1, 0)
    slow = WeightedReward(_Task(Sleeps(0.5)), ["correctness"], [2.0], timeout_s=0.05)
    assert slow(P, "4") == 0.0 and slow.failures() == (0, 1)
    r.close(), slow.close()


def test_config_errors_name_the_field():
    with pytest.raises(
        ConfigError, match=r"task.reward_funcs: unknown reward function 'nope'; known:"
    ):
        build_rewards(TaskConfig(reward_funcs=["nope"]), _Task(_Right()))
    with pytest.raises(ValueError, match="reward_weights must have one weight per reward_funcs"):
        import msgspec

        msgspec.convert({"reward_funcs": ["correctness"], "reward_weights": [1.0, 2.0]}, TaskConfig)
    assert build_rewards(TaskConfig(), _Task(_Right())) is None  # default: the verifier alone
