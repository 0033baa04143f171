"""Sharing strategies: built-ins register on ``STRATEGIES``; third parties via
``mutualrl.strategies``."""

# importing the modules registers the built-ins
from mutualrl.strategies import codistill, hacpo, hint, none, prp, sgt, xgrpo  # noqa: F401
from mutualrl.strategies.base import (
    STRATEGIES,
    StatefulStrategy,
    Strategy,
    StrategyContext,
    StrategyRetokenizer,
    StrategySpec,
    build_strategy,
    register_strategy,
)

__all__ = [
    "STRATEGIES",
    "StatefulStrategy",
    "Strategy",
    "StrategyContext",
    "StrategyRetokenizer",
    "StrategySpec",
    "build_strategy",
    "register_strategy",
]
