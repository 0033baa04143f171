"""The run: its lifecycle, phases and state in one package.

``train(cfg)`` is the whole job (``loop``); ``build_run`` validates and assembles a ``Run``
(``build``), the object that owns the run's state (``state``: ``state_dict`` / ``load_state_dict``).
One GRPO step is a short list of named phases (``phases``); the warm start (``warmup``), held-out
evaluation (``evaluation``), checkpoints (``checkpoint``), metrics and trackers (``metrics``,
``tracking``), guards (``guards``), the exchange's run side (``experience``) and progress display
(``progress``) live beside them. Nothing below this package imports it.
"""

from mutualrl.run.build import build_run
from mutualrl.run.loop import RunSummary, train
from mutualrl.run.state import Run

__all__ = ["Run", "RunSummary", "build_run", "train"]
