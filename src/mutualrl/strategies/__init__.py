"""Sharing strategies: built-ins register on ``STRATEGIES``; third parties via ``mutualrl.strategies``."""

from mutualrl.strategies import (codistill, hacpo, hint, none, prp, sgt,  # noqa: F401 - registers the built-ins
                                  xgrpo)
from mutualrl.strategies.base import (STRATEGIES, Strategy, StrategyContext, StrategySpec,
                                      build_strategy, register_strategy)

__all__ = ["STRATEGIES", "Strategy", "StrategyContext", "StrategySpec", "build_strategy",
           "register_strategy"]
