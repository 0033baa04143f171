"""The guide's strategy: GRPO with scaled advantages, exposed through the entry point ``echo``.

It keeps the ``@register_strategy`` decorator as well, under the same name: loading the entry
point runs the decorator, and the two are one plug-in, not a duplicate.
"""

import msgspec

from mutualrl.policies.batch import TrainBatch
from mutualrl.strategies import StrategySpec, register_strategy
from mutualrl.strategies.common import own_advantages, sequences_from_samples

SUMMARY = "GRPO with scaled advantages"


class EchoParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    scale: float = 1.0


class Echo:
    name = "echo"

    def __init__(self, params):
        self.params = params

    def observe(self, ctx, samples):
        pass

    def build_batches(self, ctx, receiver, own):
        adv, zero = own_advantages(own, ctx.grpo)
        seqs = sequences_from_samples(own, adv * self.params.scale, zero, ctx.grpo)
        return [TrainBatch(sequences=tuple(seqs))]

    def after_update(self, ctx, receiver):
        pass


@register_strategy("echo", EchoParams, SUMMARY)
def make_echo(params, run_config):
    return Echo(params)


spec = StrategySpec(params=EchoParams, factory=make_echo, summary=SUMMARY, needs_lock_step=None)
