"""Sharing strategies: built-ins register on ``STRATEGIES``; third parties via ``mutualrl.strategies``."""

from mutualrl.strategies import none, prp, sgt, xgrpo  # noqa: F401 - registers the built-ins
from mutualrl.strategies.base import (STRATEGIES, Strategy, StrategyContext, StrategySpec,
                                      build_strategy, register_strategy)

__all__ = ["STRATEGIES", "Strategy", "StrategyContext", "StrategySpec", "build_strategy",
           "register_strategy"]
