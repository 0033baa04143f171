"""Reward functions and their weighted sum (``task.reward_funcs``, ``task.reward_weights``; TRL's
names).

A reward function is registered on ``REWARD_FUNCS`` as a factory: given the task, it returns a
verifier (``(prompt, completion) -> float`` with ``verifier_id`` and ``version``). The built-ins:

* ``correctness``  the task's own verifier (what a run without ``reward_funcs`` uses alone);
* ``boxed_format`` 1 when the completion has a complete ``\\boxed{...}`` answer;
* ``hash_format``  1 when the completion states a number after ``####`` (GSM8K's format);
* ``think_format`` 1 when the completion is ``<think>...</think>`` followed by a non-empty answer;
* ``number_format`` 1 when the whole completion is one number (``42``, ``-5``, ``**42**``,
  ``\\boxed{42}``; ``tasks.numeric.clean_number``), the arithmetic task's format reward.

The reward a policy trains on is ``sum_i weight_i * f_i`` (weights default to 1). Every function
runs under its own ``GuardedVerifier``: an error or a time-out gives that function 0 and is
counted, never stopping the run. Each function's mean per policy per step is logged as
``policy/<policy>/rewards/<name>/mean``. Held-out evaluation keeps scoring correctness alone, so
pass@k
stays comparable between runs with different format rewards.

Third-party packages register theirs through the ``mutualrl.reward_funcs`` entry point group.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from mutualrl.config import ConfigError
from mutualrl.registry import Registry, RegistryError
from mutualrl.tasks.answers import last_boxed
from mutualrl.tasks.base import GuardedVerifier, Prompt, Task, Verifier
from mutualrl.tasks.numeric import clean_number

REWARD_FUNCS: Registry[Callable[[Task], Verifier]] = Registry(
    "reward function", entry_point_group="mutualrl.reward_funcs"
)


class PatternReward:
    """1 when ``test(completion)`` holds, else 0."""

    version = 1

    def __init__(self, verifier_id: str, test: Callable[[str], bool]) -> None:
        self.verifier_id = verifier_id
        self.test = test

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if self.test(completion) else 0.0


_HASH = re.compile(r"####\s*-?\$?\d")
_THINK = re.compile(r"\s*<think>.*?</think>\s*\S", re.DOTALL)


@REWARD_FUNCS.register("correctness")
def _correctness(task: Task) -> Verifier:
    return task.verifier


@REWARD_FUNCS.register("boxed_format")
def _boxed_format(task: Task) -> Verifier:
    return PatternReward("boxed-format", lambda c: last_boxed(c) is not None)


@REWARD_FUNCS.register("hash_format")
def _hash_format(task: Task) -> Verifier:
    return PatternReward("hash-format", lambda c: _HASH.search(c) is not None)


@REWARD_FUNCS.register("think_format")
def _think_format(task: Task) -> Verifier:
    return PatternReward("think-format", lambda c: _THINK.match(c) is not None)


@REWARD_FUNCS.register("number_format")
def _number_format(task: Task) -> Verifier:
    return PatternReward("number-format", clean_number)


class WeightedReward:
    """The weighted sum of several guarded reward functions, with each one's value kept."""

    version = 1

    def __init__(
        self,
        task: Task,
        names: Sequence[str],
        weights: Sequence[float],
        timeout_s: float,
        threads: int = 0,
    ) -> None:
        weights = list(weights) or [1.0] * len(names)
        self.terms: list[tuple[str, float, GuardedVerifier]] = []
        for name, weight in zip(names, weights, strict=True):
            try:
                factory = REWARD_FUNCS.get(name)
            except RegistryError as exc:
                raise ConfigError(f"task.reward_funcs: {exc}") from None
            self.terms.append(
                (name, float(weight), GuardedVerifier(factory(task), timeout_s, threads))
            )
        ids = "+".join(f"{w:g}*{g.verifier.verifier_id}" for _, w, g in self.terms)
        self.verifier_id = f"weighted({ids})"

    def score(self, prompt: Prompt, completion: str) -> tuple[float, dict[str, float]]:
        """The combined reward and each function's own value."""
        return self._total({name: guarded(prompt, completion) for name, _, guarded in self.terms})

    def score_many(
        self, items: Sequence[tuple[Prompt, str]]
    ) -> list[tuple[float, dict[str, float]]]:
        """``score`` of each (prompt, completion) pair, each function verifying its ``threads``
        at once (``GuardedVerifier.score_many``)."""
        values = {name: guarded.score_many(items) for name, _, guarded in self.terms}
        return [self._total({name: values[name][i] for name in values}) for i in range(len(items))]

    def _total(self, parts: dict[str, float]) -> tuple[float, dict[str, float]]:
        return sum(w * parts[name] for name, w, _ in self.terms), parts

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return self.score(prompt, completion)[0]

    def seconds_in_calls(self, ident: int) -> float:
        """Seconds the thread ``ident`` has spent verifying, over every function
        (``GuardedVerifier.seconds_in_calls``)."""
        return sum(g.seconds_in_calls(ident) for _, _, g in self.terms)

    def failures(self) -> tuple[int, int]:
        """Errors and time-outs over every function so far."""
        return (
            sum(g.counters.errors for _, _, g in self.terms),
            sum(g.counters.timeouts for _, _, g in self.terms),
        )

    def close(self) -> None:
        for _, _, guarded in self.terms:
            guarded.close()


def build_rewards(cfg, task: Task, threads: int = 0) -> WeightedReward | None:
    """The run's weighted reward, or None when ``reward_funcs`` is empty (the task's verifier);
    ``threads``: samples each function verifies at once (``allocation.verifier_threads``)."""
    if not cfg.reward_funcs:
        return None
    return WeightedReward(
        task, cfg.reward_funcs, cfg.reward_weights, cfg.verifier_timeout_s, threads
    )


def mean_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    """Each function's mean over one policy's samples, as logged: ``rewards/<name>/mean``."""
    if not parts:
        return {}
    return {f"rewards/{name}/mean": sum(p[name] for p in parts) / len(parts) for name in parts[0]}
