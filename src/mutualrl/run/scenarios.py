"""Scenarios: where each policy starts when RL begins, as a plug-in of the warm start.

A scenario decides, per policy, which prompt families its supervised warm start teaches, how much
of each batch comes from families it is otherwise not taught, and the accuracy at which it stops.
The run config picks one (``scenario = "overlap"``) and gives its parameters in
``[scenarios.<name>]``, exactly as strategies get theirs. Built-ins:

- ``disjoint`` (default): each policy warm starts on its ``warmup_families`` only; on its peers'
  families it has never produced a correct answer. Today's behaviour, bit for bit.
- ``overlap``: as ``disjoint``, plus a small share (``peer_share``) of every warm-start batch taken
  from the peers' families, so each policy solves its peers' families *sometimes*: own-sample
  GRPO, pooled baselines and importance-weighted peer rollouts all see non-zero rewards there.
  ``shared_fraction`` < 1 restricts those demonstrations to a fixed part of the peers' answers
  (a partially shared table) instead of a thin layer over all of them.
- ``asymmetric``: every policy warm starts on every family, but the ``weak`` one is taught only
  ``weak_known_fraction`` of each family's answers (a fixed part of each table), so it solves
  about that share of the prompts while the others solve nearly all (one strong and one weak
  policy, as in co-distillation and HACPO's settings). Stopping the weak one early instead does
  not work on the embedded default: its probe accuracy jumps from about 0.35 (with sampled
  success near 0.01) to 1.0 within ten warm-start steps.

Third-party scenarios register on ``SCENARIOS`` (or the entry point group
``mutualrl.run.scenarios``);
their ``[scenarios.<name>]`` tables reach them through ``RunConfig.scenarios.plugins``. The built-in
parameter structs live in ``mutualrl.config.scenarios``, checked when the config is loaded;
``check_scenario`` checks what needs this registry or the task.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from mutualrl.config import ConfigError
from mutualrl.config.scenarios import (
    BUILTIN_SCENARIOS,
    AsymmetricParams,
    DisjointParams,
    OverlapParams,
)
from mutualrl.registry import Registry, RegistryError


@dataclass(frozen=True)
class WarmPlan:
    """One policy's warm start: what it is taught, how much of its peers' families, when it stops.

    ``families`` are its own (the probe that decides when it stops measures them), restricted to
    prompts whose answer is among the first ``own_fraction`` of each family's answers (sorted, so
    the part is fixed); ``peer_share`` of each batch comes from ``peer_families``, restricted in
    the same way by ``shared_fraction``."""

    families: tuple[str, ...]
    target_accuracy: float
    own_fraction: float = 1.0
    peer_families: tuple[str, ...] = ()
    peer_share: float = 0.0
    shared_fraction: float = 1.0


@dataclass(frozen=True)
class ScenarioSpec:
    params: type
    plan: Callable[[Any, Any], dict[str, WarmPlan]]  # (params, RunConfig) -> plan per policy
    summary: str


SCENARIOS: Registry[ScenarioSpec] = Registry("scenario", entry_point_group="mutualrl.scenarios")


def register_scenario(name: str, params: type, summary: str):
    """Decorator: ``@register_scenario("mine", MyParams, "one line")`` on a plan function."""

    def decorator(fn):
        SCENARIOS.register(name, ScenarioSpec(params, fn, summary))
        return fn

    return decorator


def _all_families(cfg) -> tuple[str, ...]:
    from mutualrl.tasks import build_task

    return tuple(build_task(cfg.task).families)


@register_scenario("disjoint", DisjointParams, "each policy knows only its own families (default)")
def _disjoint(params: DisjointParams, cfg) -> dict[str, WarmPlan]:
    return {
        p.name: WarmPlan(tuple(p.warmup_families), cfg.warmup.target_accuracy) for p in cfg.policies
    }


@register_scenario("overlap", OverlapParams, "each policy solves its peers' families sometimes")
def _overlap(params: OverlapParams, cfg) -> dict[str, WarmPlan]:
    every = _all_families(cfg)
    out = {}
    for p in cfg.policies:
        peers = tuple(f for f in every if f not in p.warmup_families) if p.warmup_families else ()
        share = params.peer_share if peers else 0.0
        out[p.name] = WarmPlan(
            tuple(p.warmup_families),
            cfg.warmup.target_accuracy,
            peer_families=peers,
            peer_share=share,
            shared_fraction=params.shared_fraction,
        )
    return out


@register_scenario("asymmetric", AsymmetricParams, "one weak and one strong policy on every family")
def _asymmetric(params: AsymmetricParams, cfg) -> dict[str, WarmPlan]:
    names = [p.name for p in cfg.policies]
    weak = params.weak or names[0]  # a name RunConfig has checked
    every = _all_families(cfg)
    return {
        n: WarmPlan(
            every,
            cfg.warmup.target_accuracy,
            own_fraction=params.weak_known_fraction if n == weak else 1.0,
        )
        for n in names
    }


def scenario_spec(cfg) -> ScenarioSpec:
    """The run's registered scenario; ``ConfigError`` naming the known ones when there is none."""
    try:
        return SCENARIOS.get(cfg.scenario)
    except RegistryError as exc:
        raise ConfigError(f"scenario: {exc}") from None


def scenario_params(cfg) -> Any:
    """The run's scenario parameters: a built-in one's typed table (checked at load), a plug-in's
    table validated against its parameter struct (errors name ``$.scenarios.<name>``)."""
    spec = scenario_spec(cfg)
    if cfg.scenario in BUILTIN_SCENARIOS:
        return getattr(cfg.scenarios, cfg.scenario)
    try:
        return msgspec.convert(
            cfg.scenarios.plugins.get(cfg.scenario, {}), spec.params, strict=True
        )
    except msgspec.ValidationError as exc:
        msg = str(exc)
        msg = (
            msg.replace("at `$", f"at `$.scenarios.{cfg.scenario}")
            if "at `$" in msg
            else f"{msg} - at `$.scenarios.{cfg.scenario}`"
        )
        raise ConfigError(f"scenarios.{cfg.scenario}: {msg}") from None


def warm_plans(cfg) -> dict[str, WarmPlan]:
    """Every policy's warm-start plan under the run's scenario."""
    return scenario_spec(cfg).plan(scenario_params(cfg), cfg)


def own_families(cfg, policy: str) -> tuple[str, ...]:
    """The families ``policy`` is warm started on (to full target) under the run's scenario."""
    return warm_plans(cfg)[policy].families


# ---- the peer part of a warm-start batch ------------------------------------------------------
def shared_answers(task, family: str, fraction: float, probe: int = 512) -> frozenset[str]:
    """The first ``fraction`` (rounded up) of ``family``'s distinct train answers, sorted: a fixed
    part of its table that does not depend on the run's seed."""
    prompts = task.sample(np.random.default_rng([0, 7]), probe, "train", [family])
    answers = sorted({p.answer for p in prompts})
    return frozenset(answers[: max(1, math.ceil(fraction * len(answers)))])


def restricted_prompts(
    task,
    rng: np.random.Generator,
    n: int,
    families: Sequence[str],
    allowed: dict[str, frozenset[str]],
) -> list:
    """``n`` train prompts of ``families`` whose answers are in ``allowed[family]``."""
    out: list = []
    while len(out) < n:
        batch = task.sample(rng, max(8, 2 * (n - len(out))), "train", families)
        out += [p for p in batch if p.answer in allowed[p.family]]
    return out[:n]


def own_prompts(task, rng: np.random.Generator, n: int, plan: WarmPlan) -> list:
    """``n`` train prompts of the plan's own families (its known part of them)."""
    if plan.own_fraction >= 1:
        return task.sample(rng, n, "train", plan.families)
    allowed = {f: shared_answers(task, f, plan.own_fraction) for f in plan.families}
    return restricted_prompts(task, rng, n, plan.families, allowed)


def peer_prompts(
    task, rng: np.random.Generator, n: int, plan: WarmPlan, shared: dict[str, frozenset[str]]
) -> list:
    """``n`` train prompts of the plan's peer families whose answers are in the shared part."""
    return restricted_prompts(task, rng, n, plan.peer_families, shared)


def peer_count(plan: WarmPlan, batch_size: int) -> int:
    """How many of a warm-start batch come from peer families (0 under ``disjoint``)."""
    return int(round(plan.peer_share * batch_size)) if plan.peer_families else 0


def check_scenario(cfg) -> None:
    """What loading the config cannot check, to be run before a run writes anything: the scenario
    is registered, a plug-in scenario's table fits its parameters, and the warm-start plans can be
    made (which builds the task for any scenario but ``disjoint``). ``ConfigError`` otherwise."""
    scenario_params(cfg)
    if cfg.scenario != "disjoint":
        warm_plans(cfg)


def describe(cfg) -> str:
    """One line: the scenario and its parameters."""
    params = msgspec.to_builtins(scenario_params(cfg))
    extra = ", ".join(f"{k}={v}" for k, v in params.items())
    return cfg.scenario + (f" ({extra})" if extra else "")


def names() -> Sequence[str]:
    return SCENARIOS.names()
