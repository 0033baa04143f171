"""Bounded-staleness pacing: each worker in its own step loop, sharing records as it goes.

* ``VersionGate``, ``is_fresh``, channels and ``starvation_report`` (``gate``): who may start
  which step, and what is fresh enough to use;
* ``run_paced`` (``driver``): every worker's loop in a thread of its own behind the gate, a
  hung or failed one reported and left behind.

``run.schedule`` steps the policies of a training run with them, lock-step or paced.
"""

from mutualrl.pacing.driver import PacedReport, PhasedWorker, StepWorker, run_paced
from mutualrl.pacing.gate import (
    Channel,
    PacedRecord,
    QueueChannel,
    VersionGate,
    is_fresh,
    starvation_report,
)

__all__ = [
    "PacedReport",
    "PhasedWorker",
    "StepWorker",
    "run_paced",
    "Channel",
    "PacedRecord",
    "QueueChannel",
    "VersionGate",
    "is_fresh",
    "starvation_report",
]
