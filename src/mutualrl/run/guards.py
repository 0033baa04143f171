"""Run guards: stop a run cleanly when a policy is going wrong, instead of burning the budget.

Each guard reads the loop's ``train`` records (the same dict written to ``metrics.jsonl``), one per
step, and says whether a policy tripped it:

- ``max_kl``: the policy's ``kl`` to its frozen reference (logged when ``grpo.beta > 0``) exceeds
  the bound.
- reward collapse: with ``reward_window = W`` and ``reward_collapse_fraction = f``, the policy's
  mean train reward over its last W steps falls below f times the best mean over any W
  consecutive steps seen so far. It is judged only once W steps exist and the best window mean is
  above 0 (a policy that never earned reward has nothing to collapse from).
- ``max_nan_steps = N``: the policy's loss was NaN (its update skipped) for N consecutive steps.

When one fires, the loop finishes the step, writes a ``{"phase": "guard", ...}`` record naming the
guard, the policy and why, and raises ``GuardTripped``; ``train`` then saves the policies and
re-raises it, and the CLI exits with code 3. All guards are off by default.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field

from mutualrl.config import GuardsConfig


class GuardTripped(RuntimeError):
    """A guard stopped the run; ``guard``, ``policy``, ``step`` and ``reason`` say which and why."""

    def __init__(self, guard: str, policy: str, step: int, reason: str) -> None:
        super().__init__(f"guard {guard} tripped for policy {policy} at step {step}: {reason}")
        self.guard, self.policy, self.step, self.reason = guard, policy, step, reason

    def record(self) -> dict:
        return {
            "phase": "guard",
            "step": self.step,
            "guard": self.guard,
            "policy": self.policy,
            "reason": self.reason,
        }


def _metric(record: dict, policy: str, name: str) -> float | None:
    value = record.get(f"policy/{policy}/{name}")
    return None if value is None else float(value)


@dataclass
class Guards:
    """The guards' state across steps; ``observe`` each train record, in step order."""

    cfg: GuardsConfig
    rewards: dict[str, deque] = field(default_factory=dict)
    best_window: dict[str, float] = field(default_factory=dict)
    nan_streak: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def state_dict(self) -> dict:
        """The windows and streaks a resumed run continues from (its config may differ)."""
        return {
            "rewards": {p: list(w) for p, w in self.rewards.items()},
            "best_window": dict(self.best_window),
            "nan_streak": dict(self.nan_streak),
        }

    def load_state_dict(self, state: dict) -> None:
        w = self.cfg.reward_window
        self.rewards = {p: deque(v[-w:], maxlen=w) for p, v in state["rewards"].items()}
        self.best_window = dict(state["best_window"])
        self.nan_streak = defaultdict(int, state["nan_streak"])

    def observe(self, record: dict, policies: list[str]) -> GuardTripped | None:
        """The first guard the record trips (policies in order), or None."""
        for policy in policies:
            for check in (self._kl, self._nan, self._collapse):
                reason = check(record, policy)
                if reason is not None:
                    return GuardTripped(reason[0], policy, int(record["step"]), reason[1])
        return None

    def _kl(self, record: dict, policy: str) -> tuple[str, str] | None:
        kl = _metric(record, policy, "kl")
        if self.cfg.max_kl is None or kl is None or not kl > self.cfg.max_kl:
            return None
        return "max_kl", f"kl {kl:.4g} > max_kl {self.cfg.max_kl:g}"

    def _nan(self, record: dict, policy: str) -> tuple[str, str] | None:
        loss = _metric(record, policy, "loss")
        if loss is None:  # no update this step (the policy failed): no evidence either way
            return None
        skipped = math.isnan(loss) or (_metric(record, policy, "skipped_nan") or 0) > 0
        self.nan_streak[policy] = self.nan_streak[policy] + 1 if skipped else 0
        n = self.cfg.max_nan_steps
        if n is None or self.nan_streak[policy] < n:
            return None
        return (
            "max_nan_steps",
            f"loss NaN (update skipped) for {self.nan_streak[policy]} consecutive steps",
        )

    def _collapse(self, record: dict, policy: str) -> tuple[str, str] | None:
        reward = _metric(record, policy, "reward/mean")
        w = self.cfg.reward_window
        if reward is None:
            return None
        window = self.rewards.setdefault(policy, deque(maxlen=w))
        window.append(reward)
        if len(window) < w:
            return None
        mean = sum(window) / w
        best = self.best_window[policy] = max(self.best_window.get(policy, mean), mean)
        f = self.cfg.reward_collapse_fraction
        if f is None or best <= 0 or mean >= f * best:
            return None
        return (
            "reward_collapse",
            f"mean reward {mean:.3f} over the last {w} steps < "
            f"{f:g} x best {w}-step mean {best:.3f}",
        )
