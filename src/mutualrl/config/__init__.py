"""One typed configuration for a run: TOML in, frozen msgspec structs out, validated once.

Field names follow TRL's ``GRPOConfig`` where the concept exists there, so TRL users feel at home.
Every error names the field path (``$.grpo.beta``) and what was expected, and is raised before any
work starts. Command-line overrides are dotted paths (``--set grpo.beta=0.01``) whose values are
parsed as TOML literals (``0.01``, ``"text"``, ``[1, 2]``, ``true``), falling back to a bare string.

The bottom layer of the package: it imports nothing else from ``mutualrl``, so every other layer
may import it. Checks that need more than the config (a scenario's name in its plug-in registry,
building the task) live with what they need (``mutualrl.run.scenarios.check_scenario``).

* ``base``: ``ConfigError``, ``ConfigStruct``, ``check``;
* ``grpo``: ``GRPOConfig`` (``[grpo]``), ``TrainingConfig`` (``[training]``); ``sections``: warm
start, policy (LoRA, generation), task, evaluation,
  exchange, diversity, guards; ``allocation``: ``[allocation]``; ``scenarios``: ``[scenarios]``;
* ``run``: ``RunConfig``; ``load``: ``load_config``, ``config_from_dict``, ``apply_override``,
  ``to_dict``.
"""

from mutualrl.config.allocation import (
    GIB,
    AllocationConfig,
    ArchitectureDims,
    InventoryConfig,
    MemoryModel,
    WorkerOverride,
)
from mutualrl.config.base import ConfigError, ConfigStruct, check
from mutualrl.config.grpo import GRPOConfig, TrainingConfig
from mutualrl.config.load import apply_override, config_from_dict, load_config, to_dict
from mutualrl.config.run import RunConfig
from mutualrl.config.scenarios import (
    AsymmetricParams,
    DisjointParams,
    OverlapParams,
    ScenariosConfig,
)
from mutualrl.config.sections import (
    DiversityConfig,
    EvalConfig,
    ExchangeConfig,
    GenerationConfig,
    GuardsConfig,
    LoraConfig,
    PolicyConfig,
    ShardingConfig,
    TaskConfig,
    WarmupConfig,
)

__all__ = [
    "ConfigError",
    "ConfigStruct",
    "check",
    "GRPOConfig",
    "TrainingConfig",
    "WarmupConfig",
    "LoraConfig",
    "GenerationConfig",
    "PolicyConfig",
    "ShardingConfig",
    "TaskConfig",
    "EvalConfig",
    "ExchangeConfig",
    "DiversityConfig",
    "GuardsConfig",
    "GIB",
    "AllocationConfig",
    "ArchitectureDims",
    "InventoryConfig",
    "MemoryModel",
    "WorkerOverride",
    "AsymmetricParams",
    "DisjointParams",
    "OverlapParams",
    "ScenariosConfig",
    "RunConfig",
    "apply_override",
    "config_from_dict",
    "load_config",
    "to_dict",
]
