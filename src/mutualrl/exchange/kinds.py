"""Registration of experience types: the name -> Struct registry behind the envelope's ``kind``.

A record type is any frozen ``msgspec.Struct``, defined anywhere. The envelope's ``kind`` field is
the (external) tag of the union, so payloads carry no tag of their own and a type defined in
another package (e.g. THL's ``AlignmentResiduals``) registers exactly like a built-in:

    @experience_type("thl.alignment_residuals")
    class AlignmentResiduals(msgspec.Struct, frozen=True, kw_only=True): ...

Third-party packages may instead point the entry point group ``mutualrl.experience_types`` at
their Struct class (``name = "pkg.module:Class"``); it is loaded lazily on first lookup.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

import msgspec

from mutualrl.exchange.errors import UnknownKindError
from mutualrl.registry import Registry, RegistryError

S = TypeVar("S", bound=type[msgspec.Struct])

# Lower-case, dots allowed so third parties can namespace their kinds ("thl.residuals").
_KIND_RE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$")


def check_record_type(kind: str, cls: object) -> None:
    """Raise ``RegistryError`` unless ``cls`` can be an experience type named ``kind``."""
    if not isinstance(kind, str) or not _KIND_RE.match(kind):
        raise RegistryError(
            f"experience kind must match {_KIND_RE.pattern} (lower-case, dot-namespaced), "
            f"got {kind!r}"
        )
    if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        raise RegistryError(
            f"experience type {kind!r} must be a msgspec.Struct subclass, got {cls!r}"
        )
    # Frozen because the in-process bus hands the same object to every subscriber thread.
    if not cls.__struct_config__.frozen:
        raise RegistryError(
            f"experience type {kind!r} ({cls.__qualname__}) must be declared frozen=True: "
            "records are shared between threads without copying"
        )


#: kind name -> record Struct type. The only module-level mutable state (a registry, rule 5).
#: Every registration is checked, entry points included.
EXPERIENCE_TYPES: Registry[type[msgspec.Struct]] = Registry(
    "experience type", entry_point_group="mutualrl.experience_types", check=check_record_type
)


def experience_type(
    kind: str, *, registry: Registry[type[msgspec.Struct]] = EXPERIENCE_TYPES
) -> Callable[[S], S]:
    """Class decorator registering a frozen msgspec Struct as experience kind ``kind``.

    Duplicate names are rejected by the registry; the class is returned unchanged.
    """

    def decorator(cls: S) -> S:
        check_record_type(kind, cls)
        registry.register(kind, cls)
        return cls

    return decorator


def kind_of(cls: type, registry: Registry[type[msgspec.Struct]] = EXPERIENCE_TYPES) -> str:
    """The registered kind name of record type ``cls`` (scan: callers cache the answer)."""
    for name in registry.names():
        if registry.get(name) is cls:
            return name
    raise UnknownKindError(
        f"{cls.__module__}.{cls.__qualname__} is not a registered experience type; "
        f'decorate it with @experience_type("<kind>"); known kinds: {", ".join(registry.names())}'
    )
