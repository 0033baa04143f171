"""The ``[scenarios.<name>]`` tables: parameters of the built-in scenarios
(``mutualrl.run.scenarios``).

Every built-in table is typed and checked at load, whichever scenario the run picks. Scenarios
that other packages register keep their tables as plain dicts in ``plugins``: only
``mutualrl.run.scenarios.check_scenario`` knows their parameter structs. A config may still write
such
a table as ``[scenarios.<name>]``; ``config_from_dict`` files it under ``plugins``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mutualrl.config.base import ConfigStruct, check


class DisjointParams(ConfigStruct, frozen=True):
    """``disjoint`` takes no parameters."""


class OverlapParams(ConfigStruct, frozen=True):
    """``overlap``: a share of every warm-start batch from the peers' families."""

    # Share of each warm-start batch from the peers' families. 0.2 on the embedded default (seed
    # 0): peer family greedy pass@1 0.13 / 0.08, sampled success 0.06-0.10 / 0.11-0.14 at T=0.7
    # (llama-mistral / qwen-deepseek); 0.05 gave sampled success below 0.01.
    peer_share: float = 0.2  # share of each warm-start batch from the peers' families
    shared_fraction: float = 1.0  # part of each peer family's answers those demonstrations cover

    def __post_init__(self) -> None:
        check(0 < self.peer_share < 1, "peer_share must be in (0, 1)")
        check(0 < self.shared_fraction <= 1, "shared_fraction must be in (0, 1]")


class AsymmetricParams(ConfigStruct, frozen=True):
    """``asymmetric``: everyone is taught every family, the weak policy only part of each."""

    weak: str | None = None  # the weak policy's name; None: the first policy
    # Share of each family's answers the weak policy is taught. 0.5 on the embedded default (seed
    # 0, weak llama-mistral): greedy pass@1 0.44 / 0.50 and sampled success 0.10-0.14 on alpha /
    # beta at T=0.7; the strong qwen-deepseek 1.00 / 1.00 and 0.94-0.96.
    weak_known_fraction: float = 0.5  # share of each family's answers the weak policy is taught

    def __post_init__(self) -> None:
        check(0 < self.weak_known_fraction <= 1, "weak_known_fraction must be in (0, 1]")


class ScenariosConfig(ConfigStruct, frozen=True):
    """Parameters per scenario; the run's ``scenario`` picks which table is used."""

    disjoint: DisjointParams = msgspec.field(default_factory=DisjointParams)  # no parameters
    overlap: OverlapParams = msgspec.field(default_factory=OverlapParams)  # peer demonstrations
    asymmetric: AsymmetricParams = msgspec.field(
        default_factory=AsymmetricParams
    )  # weak and strong
    # Tables of scenarios registered by other packages (name -> table), checked against their
    # own parameter struct by mutualrl.run.scenarios.check_scenario.
    plugins: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)  # third-party tables


BUILTIN_SCENARIOS = tuple(f for f in ScenariosConfig.__struct_fields__ if f != "plugins")


def file_plugin_tables(tables: Any) -> Any:
    """``[scenarios.<name>]`` tables of scenarios not built in, moved under ``plugins`` (a copy).

    Third-party scenarios kept their tables next to the built-in ones before the tables were
    typed; configs written that way keep loading. Anything that is not a table of tables is
    returned as it is, for msgspec to reject with the field path."""
    if not isinstance(tables, dict) or not isinstance(tables.get("plugins", {}), dict):
        return tables
    known = (*BUILTIN_SCENARIOS, "plugins")
    out = {k: v for k, v in tables.items() if k in known}
    moved = {k: v for k, v in tables.items() if k not in known}
    if moved:
        out["plugins"] = {**tables.get("plugins", {}), **moved}
    return out
