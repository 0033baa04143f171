"""Multi-Worker Resource Allocation: plan who gets which devices, run workers, pace them.

* ``plan(specs, inventory)`` — the pure planner (``planner``); ``worker_specs_from_config`` and
  ``resolve_inventory`` build its inputs from a run config and the machine (``specs``).
* ``make_executor(alloc)`` — ``local`` (threads or sequential, default) or ``ray`` executors,
  applying typed calls (``calls``: ``call_each``, ``call_live``, ``call_one``) to their workers.
* ``VersionGate``, ``is_fresh``, ``run_paced``, ``starvation_report`` — bounded-staleness pacing.

The Ray executor lives in ``ray_executor`` and is imported only when asked for (extra ``ray``).
"""

from mutualrl.allocation.calls import (
    CallResult,
    Executor,
    WorkerCall,
    WorkerFailedError,
    WorkerFailure,
    WorkerUnavailable,
    call_each,
    call_live,
    call_one,
)
from mutualrl.allocation.executors import LocalExecutor
from mutualrl.allocation.kinds import EXECUTORS, make_executor
from mutualrl.allocation.paced import PacedReport, StepWorker, run_paced
from mutualrl.allocation.pacing import (
    Channel,
    PacedRecord,
    QueueChannel,
    VersionGate,
    is_fresh,
    starvation_report,
)
from mutualrl.allocation.planner import (
    Assignment,
    GpuSlot,
    Plan,
    PlanError,
    largest_remainder,
    plan,
)
from mutualrl.allocation.processes import ProcessExecutor
from mutualrl.allocation.specs import (
    Inventory,
    WorkerSpec,
    detect_inventory,
    inventory_from_config,
    resolve_inventory,
    worker_specs_from_config,
)
from mutualrl.config import (
    AllocationConfig,
    ArchitectureDims,
    InventoryConfig,
    MemoryModel,
    WorkerOverride,
)

__all__ = [
    "AllocationConfig",
    "ArchitectureDims",
    "InventoryConfig",
    "MemoryModel",
    "WorkerOverride",
    "EXECUTORS",
    "CallResult",
    "Executor",
    "LocalExecutor",
    "ProcessExecutor",
    "WorkerCall",
    "WorkerFailedError",
    "WorkerFailure",
    "WorkerUnavailable",
    "call_each",
    "call_live",
    "call_one",
    "make_executor",
    "PacedReport",
    "StepWorker",
    "run_paced",
    "Channel",
    "PacedRecord",
    "QueueChannel",
    "VersionGate",
    "is_fresh",
    "starvation_report",
    "Assignment",
    "GpuSlot",
    "Plan",
    "PlanError",
    "largest_remainder",
    "plan",
    "Inventory",
    "WorkerSpec",
    "detect_inventory",
    "inventory_from_config",
    "resolve_inventory",
    "worker_specs_from_config",
]
