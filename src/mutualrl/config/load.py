"""Reading a run config: TOML in, dotted overrides applied, one msgspec pass out.

Command-line overrides are dotted paths (``--set grpo.beta=0.01``) whose values are parsed as
TOML literals (``0.01``, ``"text"``, ``[1, 2]``, ``true``), falling back to a bare string.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import msgspec

from mutualrl.config.base import ConfigError
from mutualrl.config.run import RunConfig
from mutualrl.config.scenarios import file_plugin_tables


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], dotted: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; list elements by index (``policies.0.name=x``)."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r}: expected KEY=VALUE, e.g. grpo.beta=0.01")
    key, _, raw = dotted.partition("=")
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {key}: {where} needs an index below {len(node)}")
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"override {key}: {where} is a value, not a table")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override {key}: needs an index below {len(node)}")
        node[int(last)] = _parse_value(raw.strip())
    else:
        node[last] = _parse_value(raw.strip())


def config_from_dict(data: dict[str, Any], source: str = "<config>") -> RunConfig:
    """Validate a whole run config (a TOML table or a run's config.json) in one msgspec pass;
    errors name ``source`` and the field path (``$.allocation.inventory``)."""
    if "scenarios" in data:
        data = {**data, "scenarios": file_plugin_tables(data["scenarios"])}
    try:
        return msgspec.convert(data, RunConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a TOML file, apply dotted overrides, and validate everything once."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise ConfigError(f"config file not found: {path} (expected a TOML file)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for item in overrides:
        apply_override(data, item)
    return config_from_dict(data, str(path))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data (what a run's config.json holds): every field, defaults included;
    ``config_from_dict`` reads it back to an equal config."""
    return msgspec.to_builtins(cfg)
