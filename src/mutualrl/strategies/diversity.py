"""Diversity regularisation for any strategy: a repulsive term between policies' successes.

Step 8 of the CP-GRPO-VS specification asks for an optional regulariser that keeps policies
from collapsing onto the same solutions. Ours is a repulsive reward term between the policies'
success distributions over prompts: for receiver ``k``'s own sample ``i`` on prompt ``x``,

    r'_i = r_i - coef * r_i * s_peers(x),   s_peers(x) = mean reward of the peers' rollouts for x

so a success counts fully where no peer succeeds and ``1 - coef`` where every peer does; a
failure stays 0 and never becomes a success. Prompts no peer sampled this step keep ``r``.
Only the receiver's GRPO advantages see ``r'``: ``observe``, the exchange and every success
test on verified rewards (SGT's buffer, hints) keep the verified reward. Off by default
(``[diversity] coef = 0``), which leaves every strategy exactly as it is. The alternative
the specification names, temperature balancing, is not implemented.
"""

from __future__ import annotations

from dataclasses import replace

from mutualrl.strategies.common import peer_rollouts


def peer_success(ctx, receiver: str) -> dict[str, float]:
    """Mean verified reward of the peers' rollouts per prompt id this step."""
    sums: dict[str, list[float]] = {}
    for d in peer_rollouts(ctx, receiver):
        sums.setdefault(d.record.prompt_id, []).append(float(d.record.reward))
    return {pid: sum(v) / len(v) for pid, v in sums.items()}


def repulsed_rewards(
    rewards: list[float], peer_rates: list[float | None], coef: float
) -> list[float]:
    """``r - coef * r * s`` per sample; ``s`` None (no peer data) leaves ``r``."""
    return [r if s is None else r - coef * r * s for r, s in zip(rewards, peer_rates)]


class DiversityRegularised:
    """Any strategy with its receivers' own rewards shaped by the repulsive term."""

    def __init__(self, inner, coef: float) -> None:
        self.inner, self.coef = inner, coef
        self.name = inner.name

    def __getattr__(self, attr):  # the wrapped strategy's parameters and state
        if attr == "inner":  # not set yet (e.g. while unpickling)
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def observe(self, ctx, samples) -> None:
        self.inner.observe(ctx, samples)

    def build_batches(self, ctx, receiver: str, own):
        rates = peer_success(ctx, receiver)
        shaped = repulsed_rewards(
            [s.reward for s in own], [rates.get(s.prompt.id) for s in own], self.coef
        )
        if own:
            ctx.log(
                receiver,
                "diversity/reward_shift_mean",
                sum(a - s.reward for a, s in zip(shaped, own)) / len(own),
            )
            ctx.log(
                receiver,
                "diversity/peer_success_mean",
                sum(rates.get(s.prompt.id, 0.0) for s in own) / len(own),
            )
        own = [replace(s, reward=r) for s, r in zip(own, shaped)]
        return self.inner.build_batches(ctx, receiver, own)

    def after_update(self, ctx, receiver: str) -> None:
        self.inner.after_update(ctx, receiver)


def with_diversity(strategy, cfg):
    """The strategy itself when the regulariser is off (``cfg`` None or ``coef == 0``). A strategy
    whose ``no_diversity`` says why it cannot take shaped own rewards is refused."""
    if cfg is None or cfg.coef == 0:
        return strategy
    why = getattr(strategy, "no_diversity", None)
    if why:
        from mutualrl.config import ConfigError

        raise ConfigError(
            f"diversity.coef = {cfg.coef}: strategy {strategy.name!r} cannot take "
            f"the regulariser: {why}; set diversity.coef = 0 or use another strategy"
        )
    return DiversityRegularised(strategy, cfg.coef)
