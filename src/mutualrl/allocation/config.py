"""Re-exports of the ``[allocation]`` structs, which live in ``mutualrl.config.allocation``.

Kept only for modules that still import from here (``train.py``, ``executors.py``,
``ray_executor.py``); new code imports from ``mutualrl.config``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mutualrl.config import ConfigError
from mutualrl.config.allocation import (
    GIB,
    AllocationConfig,
    ArchitectureDims,
    InventoryConfig,
    MemoryModel,
    WorkerOverride,
)

__all__ = ["GIB", "AllocationConfig", "ArchitectureDims", "InventoryConfig", "MemoryModel",
           "WorkerOverride", "parse_allocation"]


# kept for train.py until the run package lands: RunConfig.allocation is typed now, so the
# ``parse_allocation(cfg.allocation)`` there gets its argument back.
def parse_allocation(d: AllocationConfig | dict[str, Any] | None) -> AllocationConfig:
    if isinstance(d, AllocationConfig):
        return d
    try:
        return msgspec.convert(d or {}, AllocationConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"allocation: {exc}") from None
