"""``none``: independent GRPO per policy — the control every comparison needs."""

from __future__ import annotations

import msgspec

from mutualrl.policies.batch import TrainBatch
from mutualrl.strategies.base import StrategyContext, register_strategy
from mutualrl.strategies.common import batch_of, own_sequences


class NoneParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class Independent:
    name = "none"

    def observe(self, ctx: StrategyContext, samples) -> None:
        return None

    def build_batches(self, ctx: StrategyContext, receiver: str, own) -> list[TrainBatch]:
        return batch_of(own_sequences(own, ctx.grpo))

    def after_update(self, ctx: StrategyContext, receiver: str) -> None:
        return None


@register_strategy("none", NoneParams, "independent GRPO per policy (the control)")
def _make_none(params: NoneParams, cfg) -> Independent:
    return Independent()
