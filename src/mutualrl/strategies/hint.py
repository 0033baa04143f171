"""``hint`` — peer successes as scaffolds (outcome level, after Scaf-GRPO).

After Scaf-GRPO (Zhang et al., "Scaf-GRPO: Scaffolded Group Relative Policy Optimization"):
where a policy's whole group fails on a prompt, GRPO has no signal (every advantage is 0).
Scaf-GRPO then adds a hint to the prompt, tier by tier from the least to the most revealing,
and trains on the first hinted group that succeeds. Here the hints are *peer* solutions:

* a receiver's prompt becomes a **candidate** once its own group has had no success
  (reward >= ``tau``) on ``patience`` consecutive steps in which it was sampled;
* if a peer's verified success for that prompt is among this step's deliveries, its completion
  text ``y`` gives the hints: tier ``f`` in ``tiers`` is the prefix of ``y`` of
  ``min(ceil(f * |y|), |y| - 1)`` characters (a hint never gives the whole solution);
* tier by tier, the receiver samples ``G`` completions ``c`` with ``h`` as the start of its
  answer (``Prompt.prefill``: raw text ``x + h``, its own tokenization of the concatenated
  text; under a chat template ``h`` opens the assistant's turn, not the question), with its
  sampler and temperature, and
  each is scored by the task's verifier on the *original* prompt and the hinted solution,
  ``r = verify(x, h + c)``; the first tier with a success stops the search;
* that hinted group joins the receiver's batch as one more GRPO group: group-relative
  advantages on its rewards, behaviour log-probs and the ratio taken under the hinted prompt.

Our choices: hints are character prefixes of one peer solution (Scaf-GRPO's tiers are written
knowledge / planning / solution hints, which a verifier-only task does not have); the peer
solution is the first success delivered this step; ``patience = 1`` because a prompt recurs
rarely in a run of sampled prompts. Cost: up to ``len(tiers) * G`` extra completions per
candidate prompt (``hint/generated``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import msgspec

from mutualrl.policies.batch import TrainBatch
from mutualrl.strategies.base import StrategyContext, register_strategy
from mutualrl.strategies.common import batch_of, group_count, own_sequences, peer_rollouts
from mutualrl.tasks.base import Prompt


class HintParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    tiers: tuple[float, ...] = (0.25, 0.5)  # shares of the peer solution given, tried in order
    patience: int = 1  # failed sampled steps before a prompt is hinted
    tau: float = 1.0  # success threshold (reward >= tau; combined reward with weights)
    max_hinted_prompts: int | None = None  # per receiver and step; None: every candidate

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("tiers must name at least one share of the peer solution")
        if any(not 0 < f < 1 for f in self.tiers) or list(self.tiers) != sorted(set(self.tiers)):
            raise ValueError("tiers must be strictly increasing shares in (0, 1)")
        if self.patience < 1:
            raise ValueError("patience must be >= 1")
        if not self.tau > 0:
            raise ValueError("tau must be > 0 (a success is a reward >= tau)")
        if self.max_hinted_prompts is not None and self.max_hinted_prompts < 1:
            raise ValueError("max_hinted_prompts must be >= 1 (or absent: every candidate)")


def hint_prefix(solution: str, share: float) -> str:
    """The first ``min(ceil(share * len), len - 1)`` characters of a solution ('' if too short)."""
    n = min(math.ceil(share * len(solution)), len(solution) - 1)
    return solution[: max(n, 0)]


class PeerHints:
    name = "hint"

    def __init__(self, params: HintParams) -> None:
        self.params = params
        self.fail_streak: dict[str, dict[str, int]] = {}  # receiver -> prompt id -> failed steps

    def observe(self, ctx: StrategyContext, samples) -> None:
        for name, own in samples.items():
            solved: dict[str, bool] = {}
            for s in own:
                solved[s.prompt.id] = solved.get(s.prompt.id, False) or s.reward >= self.params.tau
            streak = self.fail_streak.setdefault(name, {})
            for pid, ok in solved.items():
                if ok:
                    streak.pop(pid, None)
                else:
                    streak[pid] = streak.get(pid, 0) + 1

    def _candidates(self, ctx, receiver, own) -> list[tuple[Prompt, str]]:
        """(prompt, peer solution) for each of this step's prompts that qualifies for a hint."""
        streak = self.fail_streak.get(receiver, {})
        solutions: dict[str, str] = {}
        for d in peer_rollouts(ctx, receiver):
            if d.record.reward >= self.params.tau:
                solutions.setdefault(d.record.prompt_id, d.record.completion)
        out, seen = [], set()
        for s in own:
            pid = s.prompt.id
            if pid in seen or streak.get(pid, 0) < self.params.patience:
                continue
            seen.add(pid)
            if pid in solutions:
                out.append((s.prompt, solutions[pid]))
        return out

    def _hinted_group(self, ctx, receiver, prompt: Prompt, solution: str, group: int, counts: dict):
        """The first hinted group with a success, tier by tier; None when no tier succeeds."""
        G = ctx.grpo.num_generations
        for tier, share in enumerate(self.params.tiers):
            hint = hint_prefix(solution, share)
            if not hint:
                continue
            # the hint opens the receiver's answer, which its completion continues (under a
            # chat template too: after the assistant turn's opening, not inside the question)
            hinted = replace(prompt, prefill=hint)
            samples = ctx.generate[receiver]([hinted], G)
            counts["generated"] += len(samples)
            scored = [
                replace(s, group=group, reward=float(ctx.verify(prompt, hint + s.text)))
                for s in samples
            ]
            if any(s.reward >= self.params.tau for s in scored):
                counts[f"tier_{tier}"] += 1
                return scored
        return None

    def build_batches(self, ctx: StrategyContext, receiver: str, own) -> list[TrainBatch]:
        candidates = self._candidates(ctx, receiver, own)
        if self.params.max_hinted_prompts is not None:
            candidates = candidates[: self.params.max_hinted_prompts]
        if candidates and (receiver not in ctx.generate or ctx.verify is None):
            raise RuntimeError(
                "strategy 'hint' needs StrategyContext.generate and .verify "
                "(the training loop provides them)"
            )
        counts = {"generated": 0, **{f"tier_{i}": 0 for i in range(len(self.params.tiers))}}
        extra, next_group = [], group_count(own)
        for prompt, solution in candidates:
            group = self._hinted_group(ctx, receiver, prompt, solution, next_group, counts)
            if group is not None:
                extra += group
                next_group += 1
        seqs = own_sequences(list(own) + extra, ctx.grpo)
        ctx.log(receiver, "hint/candidates", len(candidates))
        ctx.log(receiver, "hint/rescued_prompts", next_group - group_count(own))
        ctx.log(receiver, "hint/generated", counts["generated"])
        for i in range(len(self.params.tiers)):
            ctx.log(receiver, f"hint/tier_{i}_used", counts[f"tier_{i}"])
        if extra:
            ctx.log(receiver, "hint/hinted_reward_mean", sum(s.reward for s in extra) / len(extra))
        return batch_of(seqs)

    def after_update(self, ctx: StrategyContext, receiver: str) -> None:
        return None

    # ---- checkpoint state ----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"fail_streak": {r: dict(v) for r, v in self.fail_streak.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.fail_streak = {
            str(r): {str(p): int(n) for p, n in v.items()}
            for r, v in state.get("fail_streak", {}).items()
        }


@register_strategy(
    "hint",
    HintParams,
    "peer successes as tiered hints on prompts the receiver keeps failing (Scaf-GRPO)",
)
def _make_hint(params: HintParams, cfg) -> PeerHints:
    return PeerHints(params)
