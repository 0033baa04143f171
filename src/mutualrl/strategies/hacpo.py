"""``hacpo`` — Heterogeneous Agent Collaborative Policy Optimization (data level).

After Zhang et al., "Heterogeneous Agent Collaborative Reinforcement Learning" (arXiv 2603.02604).
Every policy's verified rollouts are shared; a receiver ``k`` trains on its own group for a
prompt plus the peers' rollouts of that prompt, with four mechanisms:

1. **Capability** ``P_j``: the mean, over the last ``capability_window`` steps, of policy ``j``'s
   share of rollouts with reward > 0 (``capability_metric = "positive_rate"``) or of its mean
   reward; floored at 1e-8, and 1 before any step.
2. **Agent-capability-aware advantage** (eqs. 5-6): the group baseline weighs each sample's
   reward by ``omega(k, j) = P_k / P_j`` of its source ``j`` (own samples: 1),
   ``b = mean_i(omega_i r_i)``; ``A_i = (r_i - b) / (std(r) + eps)``. A group of equal rewards
   keeps the plain mean (no signal is created); a baseline above 1, the top of the verifiers'
   reward range, falls back to the mean of the receiver's own rewards (the authors' guard).
3. **Capability discrepancy coefficient** ``c_jk = clip(P_j / P_k, ratio_min, ratio_max)``
   scales a peer sample's term: rollouts of a stronger peer count more.
4. **Exponential importance sampling with stepwise clipping**: a peer sample's sequence ratio
   ``r = exp(mean_t log p_k - mean_s log p_j)``, each side length-normalised in its own
   tokenization (across tokenizers, through THL as in PRP), enters as
   ``clip(r, l_m, 1) * sg(clip(r, l_m, 1))^alpha * c_jk * A`` with the lower bound
   ``l_m = min(1, 1 - cross_clip_delta + m * cross_clip_step)`` tightening with the update
   index ``m`` within a step. The clip is a clamp: outside ``[l_m, 1]`` the term has no gradient.
   Own samples take the run's GRPO clipped surrogate; the source's base is GSPO, i.e.
   ``grpo.importance_sampling_level = "sequence"`` (not forced here, so controls stay equal).

Our choices where the loop differs from the authors' trainer:

* The term's gradient is ``r^(1+alpha) c_jk A grad(mean_t log p_k)`` inside the clamp range and
  0 outside, so a peer sequence trains as a pooled sample with detached weight
  ``w = r^(1+alpha) c_jk`` (0 outside the range). ``r`` is taken once, before the step's first
  update (exact for one update per step, the default).
* ``updates_per_step = U`` splits the receiver's sequences into ``U`` optimizer updates
  (sequence ``i`` in update ``i mod U``); update ``m`` uses ``l_m``. That is the stepwise clip;
  with ``U = 1`` (default) only ``l_0 = 1 - cross_clip_delta`` acts.
* Std and scaling follow the run's ``grpo.scale_rewards`` and ``grpo.advantage_std``, as in
  every strategy here, so a lone policy trains exactly as ``none``. The default is the population
  std; the authors' sample std (TRL's too) is ``grpo.advantage_std = "sample"``. Rewards are used
  as they are (``grpo.advantage_estimator`` is not consulted).
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

from mutualrl.config import GRPOConfig
from mutualrl.grpo import group_moments
from mutualrl.policies.batch import TrainBatch
from mutualrl.strategies.base import StrategyContext, register_strategy
from mutualrl.strategies.common import MixedGroup, baseline_advantages, mixed_group

CAPABILITY_FLOOR = 1e-8


class HACPOParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    alpha: float = 1.0  # exponent of the detached ratio factor
    cross_clip_delta: float = 0.2  # lower clamp of a peer ratio: 1 - delta
    cross_clip_step: float = 0.0  # the lower clamp rises this much per update in a step
    updates_per_step: int = 1  # optimizer updates per step (the m of the stepwise clip)
    capability_window: int = 5  # steps averaged into a policy's capability
    capability_metric: Literal["positive_rate", "reward_mean"] = (
        "positive_rate"  # share rewarded > 0, or mean reward
    )
    capability_ratio_min: float = 0.1  # lower clip of the capability coefficient P_src / P_recv
    capability_ratio_max: float = 10.0  # upper clip of the capability coefficient
    max_peer_per_group: int | None = None  # None: every peer sample for the prompt

    def __post_init__(self) -> None:
        if self.alpha < 0:
            raise ValueError("alpha must be >= 0")
        if not 0 <= self.cross_clip_delta <= 1:
            raise ValueError("cross_clip_delta must be in [0, 1]")
        if self.cross_clip_step < 0:
            raise ValueError("cross_clip_step must be >= 0")
        if self.updates_per_step < 1 or self.capability_window < 1:
            raise ValueError("updates_per_step and capability_window must be >= 1")
        if not 0 < self.capability_ratio_min <= self.capability_ratio_max:
            raise ValueError("need 0 < capability_ratio_min <= capability_ratio_max")
        if self.max_peer_per_group is not None and self.max_peer_per_group < 0:
            raise ValueError("max_peer_per_group must be >= 0")

    def cross_clip_lower(self, m: int) -> float:
        """Lower clamp of a peer ratio in the ``m``-th update of a step (stepwise clipping)."""
        return min(1.0, 1.0 - self.cross_clip_delta + m * self.cross_clip_step)


def capability_advantages(
    rewards: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    omega: torch.Tensor,
    own: torch.Tensor,
    grpo: GRPOConfig,
):
    """Capability-aware advantages: rewards, groups, omega (N,), own (N,) bool ->
    advantages, baselines, zero-std flags, guarded flags.

    ``omega`` is ``P_receiver / P_source`` per sample (1 for own samples); ``grpo``'s
    ``scale_rewards`` and ``advantage_std`` scale them (``common.baseline_advantages``).
    Returns (N,) advantages, (K,) baselines, (N,) zero-std flags and (K,) flags of groups whose
    baseline fell back.
    """
    r = rewards.to(torch.float64)
    m = group_moments(r, groups, num_groups, grpo.advantage_std)
    weighted = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, groups, r * omega.to(torch.float64)
    )
    base = weighted / m.count.clamp(min=1)  # (K,)
    own_f = own.to(torch.float64)
    own_n = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, own_f)
    own_sum = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, r * own_f)
    own_mean = own_sum / own_n.clamp(min=1)
    uniform = m.std == 0
    guarded = (base > 1.0) & ~uniform & (own_n > 0)
    base = torch.where(guarded, own_mean, base)
    base = torch.where(uniform, m.mean, base)
    zero = uniform[groups]
    adv = baseline_advantages(r, base[groups], m.std[groups], grpo)
    adv = torch.where(zero, torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype), base, zero, guarded


def cross_weights(log_ratio: torch.Tensor, coef: torch.Tensor, alpha: float, lower: float):
    """Peer-sample loss weights (B,), (B,) -> w (B,), clamped (B,) bool.

    ``w = r^(1+alpha) * coef`` for ``lower <= r <= 1`` (the gradient factor of
    ``clip(r) sg(clip(r))^alpha coef A``), else 0: a clamped ratio carries no gradient.
    """
    r = torch.exp(log_ratio.to(torch.float64))
    inside = (r >= lower) & (r <= 1.0)
    w = torch.where(inside, r.pow(1 + alpha) * coef.to(torch.float64), torch.zeros_like(r))
    return w, ~inside


class HACPO:
    name = "hacpo"

    def __init__(self, params: HACPOParams) -> None:
        self.params = params
        self.history: dict[str, list[float]] = {}  # policy -> capability estimates, newest last

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per step and policy (the run sizes learning-rate schedules by it)."""
        return self.params.updates_per_step

    # ---- capability ----------------------------------------------------------------------
    def capability(self, name: str) -> float:
        h = self.history.get(name)
        return max(sum(h) / len(h), CAPABILITY_FLOOR) if h else 1.0

    def coefficient(self, source: str, target: str) -> float:
        """``c = clip(P_source / P_target, ratio_min, ratio_max)``."""
        raw = self.capability(source) / self.capability(target)
        return min(max(raw, self.params.capability_ratio_min), self.params.capability_ratio_max)

    def observe(self, ctx: StrategyContext, samples) -> None:
        for name, own in samples.items():
            if not own:
                continue
            rewards = [s.reward for s in own]
            value = (
                sum(r > 0 for r in rewards) / len(rewards)
                if self.params.capability_metric == "positive_rate"
                else sum(rewards) / len(rewards)
            )
            h = self.history.setdefault(name, [])
            h.append(max(float(value), CAPABILITY_FLOOR))
            del h[: -self.params.capability_window]

    # ---- batches -------------------------------------------------------------------------
    def build_batches(self, ctx: StrategyContext, receiver: str, own) -> list[TrainBatch]:
        mixed = mixed_group(ctx, receiver, own, self.params.max_peer_per_group)
        n, p_recv = mixed.n_own, self.capability(receiver)
        omega = torch.tensor(
            [1.0] * n + [p_recv / self.capability(j) for j in mixed.peers.sources],
            dtype=torch.float64,
        )
        is_own = torch.arange(len(mixed.rewards)) < n
        adv, _, zero, guarded = capability_advantages(
            mixed.rewards,
            mixed.groups,
            mixed.num_groups,
            omega,
            is_own,
            ctx.grpo,
        )
        self._log_capabilities(ctx, receiver, guarded)
        own_seqs = mixed.own_sequences(adv, zero, ctx.grpo)
        return self._split(own_seqs, self._peer_sequences(ctx, receiver, mixed, adv, zero))

    def _peer_sequences(self, ctx, receiver, mixed: MixedGroup, adv, zero):
        """Per update index m, the peer sequences weighted with that update's clamp.

        adv, zero: (N,) over the mixed group; returns U lists of sequences."""
        U, peers = self.params.updates_per_step, mixed.peers
        if not len(peers):
            ctx.log(receiver, "hacpo/peer_samples", 0)
            return [[] for _ in range(U)]
        recv_total = ctx.sequence_logprobs[receiver](peers.prompts, peers.completions).to(
            torch.float64
        )
        recv_len = torch.tensor([max(len(c), 1) for c in peers.completions], dtype=torch.float64)
        src_total, src_len = peers.logprob_totals()
        log_ratio = recv_total / recv_len - src_total / src_len  # (P,) length-normalised
        coef = torch.tensor(
            [self.coefficient(j, receiver) for j in peers.sources], dtype=torch.float64
        )
        index = torch.arange(len(peers)) % U  # (P,) update of each row
        clamped_all = torch.zeros(len(peers), dtype=torch.bool)
        weights_all = torch.zeros(len(peers), dtype=torch.float64)
        for m in range(U):
            w, clamped = cross_weights(
                log_ratio, coef, self.params.alpha, self.params.cross_clip_lower(m)
            )
            sel = index == m
            weights_all[sel], clamped_all[sel] = w[sel], clamped[sel]
        parts = [
            mixed.peer_sequences(adv, zero, weights_all, ctx.grpo, select=index == m)
            for m in range(U)
        ]
        ratio = torch.exp(log_ratio)
        ctx.log(receiver, "hacpo/peer_samples", len(peers))
        ctx.log(receiver, "hacpo/ratio_mean", float(ratio.mean()))
        ctx.log(receiver, "hacpo/ratio_var", float(ratio.var(unbiased=False)))
        ctx.log(receiver, "hacpo/clamped_frac", float(clamped_all.double().mean()))
        ctx.log(receiver, "hacpo/weight_mean", float(weights_all.mean()))
        # the weights applied (0 where clamped out), as the report's IS-weight column reads them
        ctx.log(receiver, "hacpo/weight_var", float(weights_all.var(unbiased=False)))
        ctx.log(receiver, "hacpo/coef_mean", float(coef.mean()))
        return parts

    def _split(self, own_seqs, peer_parts) -> list[TrainBatch]:
        U = self.params.updates_per_step
        batches = []
        for m in range(U):
            seqs = tuple(own_seqs[m::U]) + tuple(peer_parts[m])
            if seqs:
                batches.append(TrainBatch(sequences=seqs, tag="grpo" if m == 0 else f"update{m}"))
        return batches

    def _log_capabilities(self, ctx, receiver, guarded) -> None:
        for name in ctx.policy_names:
            ctx.log(receiver, f"hacpo/capability/{name}", self.capability(name))
        ctx.log(receiver, "hacpo/baseline_guarded_groups", int(guarded.sum()))

    def after_update(self, ctx: StrategyContext, receiver: str) -> None:
        return None

    # ---- checkpoint state ----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"history": {k: list(v) for k, v in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.history = {str(k): [float(x) for x in v] for k, v in state.get("history", {}).items()}


@register_strategy(
    "hacpo",
    HACPOParams,
    "shared rollouts with capability-aware advantages and exponential IS (HACPO)",
    needs_lock_step="its capability-aware baseline weighs each peer by that peer's "
    "rewards at the same step, which a paced receiver does not hold",
)
def _make_hacpo(params: HACPOParams, cfg) -> HACPO:
    return HACPO(params)
