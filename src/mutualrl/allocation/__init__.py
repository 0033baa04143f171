"""Multi-Worker Resource Allocation, the planning half: who gets which devices (pure).

* ``plan(specs, inventory)`` — the pure planner (``planner``); ``worker_specs_from_config`` and
  ``resolve_inventory`` build its inputs from a run config and the machine (``specs``); what
  ``mutualrl plan`` shows (``cli``). The memory a policy needs (``dims``) and where a process
  puts it (``placement``).

The workers the plan runs, and their executors, are ``mutualrl.workers``; pacing them at
bounded staleness is ``mutualrl.pacing``.
"""

from mutualrl.allocation.planner import (
    Assignment,
    GpuSlot,
    Plan,
    PlanError,
    largest_remainder,
    plan,
)
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
