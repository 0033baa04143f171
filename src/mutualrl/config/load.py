"""Reading a run config: TOML in, dotted overrides applied, one msgspec pass out.

Command-line overrides are dotted paths (``--set grpo.beta=0.01``) whose values are parsed as
TOML literals (``0.01``, ``"text"``, ``[1, 2]``, ``true``), falling back to a bare string.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import tomllib

from mutualrl.config.base import ConfigError
from mutualrl.config.packaged import resolve_config
from mutualrl.config.run import RunConfig
from mutualrl.config.scenarios import file_plugin_tables

# A value starting like a TOML string, array or table must parse as one: a typo there (a missing
# quote or bracket) is an error, never a bare string (``output_dir="runs/o3`` is no folder name).
_TOML_OPENERS = ('"', "'", "[", "{")


def _parse_value(text: str, key: str = "") -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        if text.startswith(_TOML_OPENERS):
            raise ConfigError(
                f"override {key}={text}: not a valid TOML value ({exc}); quote "
                'strings whole, e.g. output_dir="runs/x", and close lists, e.g. '
                "[0.1, 0.2]"
            ) from None
        return text


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string literal that parses back to exactly ``text``: what turns a
    value from the command line (a folder name holding ``"``, ``\\``, a tab) into an override's
    right-hand side. Quote and backslash are escaped, and every control character as
    ``\\uXXXX`` (TOML allows none raw but tab)."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def check_finite(data: Any, path: str = "$") -> None:
    """Refuse inf and nan anywhere in a config (TOML writes them ``inf``, ``nan``): no setting
    means anything at them (a temperature of inf samples uniformly), so each names its path."""
    if isinstance(data, float) and not math.isfinite(data):
        raise ConfigError(f"{path}: {data} is not a finite number; expected a finite value")
    if isinstance(data, dict):
        for k, v in data.items():
            check_finite(v, f"{path}.{k}")
    elif isinstance(data, list):
        for i, v in enumerate(data):
            check_finite(v, f"{path}[{i}]")


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
        node[int(last)] = _parse_value(raw.strip(), key)
    else:
        node[last] = _parse_value(raw.strip(), key)


# Paths that moved, old "table.key" -> new "table.key": to another table under the same key, or
# renamed within its table. A config (or a run's config.json) written with the old path keeps
# working: the value moves to the new path, and a warning names it once per load.
MOVED = {
    **{
        f"grpo.{name}": f"training.{name}"
        for name in (
            "max_grad_norm",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "logprob_chunk_size",
            "gradient_checkpointing",
            "lr_scheduler_type",
            "warmup_ratio",
            "weight_decay",
        )
    },
    # TRL renamed it (its old name is deprecated there too)
    "grpo.vllm_importance_sampling_cap": "grpo.vllm_importance_sampling_clip_max",
}


class ConfigPathMoved(UserWarning):
    """A config used a path that moved; its value was taken at the new path."""


def migrate(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``data`` with every moved path at its new place (a copy where anything moved)."""
    # A table replaced by a value (``--set grpo=1``) moves nothing: msgspec names it below.
    moved = [
        (old, new)
        for old, new in MOVED.items()
        if isinstance(table := data.get(old.split(".")[0]), dict) and old.split(".")[1] in table
    ]
    if not moved:
        return data
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for old, new in moved:
        (old_table, old_key), (new_table, new_key) = old.split("."), new.split(".")
        table = data.setdefault(new_table, {})
        if new_key in table:
            raise ConfigError(
                f"{source}: {old} and {new} are both set; {old} moved to {new}: keep only {new}"
            )
        table[new_key] = data[old_table].pop(old_key)
    warnings.warn(
        f"{source}: "
        + ", ".join(f"{old} is now {new}" for old, new in moved)
        + " (the old paths still work; write the new ones)",
        ConfigPathMoved,
        stacklevel=3,
    )
    return data


def config_from_dict(data: dict[str, Any], source: str = "<config>") -> RunConfig:
    """Validate a whole run config (a TOML table or a run's config.json) in one msgspec pass;
    errors name ``source`` and the field path (``$.allocation.inventory``). Paths that moved
    (``MOVED``) are read at their new place."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a table of settings at the top, got {type(data).__name__}"
        )
    try:
        check_finite(data)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    data = migrate(data, source)
    if "scenarios" in data:
        data = {**data, "scenarios": file_plugin_tables(data["scenarios"])}
    try:
        return msgspec.convert(data, RunConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a TOML file, apply dotted overrides, and validate everything once. A bare name
    (``"tiny"``: no ``/`` or ``.``) is a config ``mutualrl`` ships (``config.packaged``)."""
    path = resolve_config(path)
    try:
        data = tomllib.loads(_read_text(path, "a TOML file"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for item in overrides:
        apply_override(data, item)
    return config_from_dict(data, str(path))


def _read_text(path: Path, expected: str) -> str:
    """The file's text; a missing, unreadable or binary file is a ``ConfigError`` naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):
        raise ConfigError(f"config file not found: {path} (expected {expected})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); expected {expected}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror}); expected {expected}") from None


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A run's ``config.json`` as plain data, for ``config_from_dict``; a file that is not a JSON
    table is a ``ConfigError`` naming it."""
    path = Path(path)
    expected = "the JSON config a run of `mutualrl train` writes"
    try:
        data = json.loads(_read_text(path, expected))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); expected {expected}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: holds a JSON {type(data).__name__}; expected {expected}")
    return data


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data (what a run's config.json holds): every field, defaults included;
    ``config_from_dict`` reads it back to an equal config."""
    return msgspec.to_builtins(cfg)
