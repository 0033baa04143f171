"""What every config section is built on: the error type, the struct base, the check helper."""

from __future__ import annotations

import msgspec


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field path."""


class ConfigStruct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: frozen, keyword-only, unknown keys rejected.

    Sections say ``frozen=True`` again (msgspec inherits it; type checkers read each class's own
    arguments, and take a section without it for a mutable one)."""


def check(cond: bool, msg: str) -> None:
    # msgspec turns a ValueError raised in __post_init__ into a ValidationError carrying the
    # field path, which is exactly the error a user needs.
    if not cond:
        raise ValueError(msg)
