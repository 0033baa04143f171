"""A strategy under a name a built-in holds (``sgt``)."""

import msgspec

from mutualrl.strategies import StrategySpec


class Params(msgspec.Struct, frozen=True):
    pass


def make(params, run_config):
    raise AssertionError("never built: the name belongs to the built-in")


spec = StrategySpec(params=Params, factory=make, summary="not the built-in sgt")
