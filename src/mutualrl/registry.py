"""Name -> object registries: the one way the project dispatches on a name.

House rule 4: built-ins register themselves on a ``Registry`` object; third parties add theirs
through an entry point group. Duplicates are rejected so two plug-ins can never silently shadow
each other, and an unknown name fails with the list of known ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """Unknown or duplicate name in a registry."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


class Registry(Generic[T]):
    """A named collection of plug-ins of one kind.

    ``kind`` names what is registered (used in error messages); ``entry_point_group`` is the
    ``importlib.metadata`` group third-party packages use, loaded lazily on first lookup.
    ``check(name, obj)`` raises for an object that cannot be registered under that name; it
    applies to every registration, entry points included.
    """

    def __init__(self, kind: str, entry_point_group: str | None = None,
                 check: Callable[[str, T], None] | None = None) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.check = check
        self._items: dict[str, T] = {}
        self._entry_points_loaded = entry_point_group is None

    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """Register ``obj`` under ``name``; usable as ``@registry.register("name")``."""
        if obj is None:
            def decorator(o: T) -> T:
                self._add(name, o)
                return o
            return decorator
        self._add(name, obj)
        return obj

    def _add(self, name: str, obj: T) -> None:
        if not name or not isinstance(name, str):
            raise RegistryError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items and self._items[name] is not obj:
            raise RegistryError(f"{self.kind} {name!r} is already registered ({self._items[name]!r})")
        if self.check is not None:
            self.check(name, obj)
        self._items[name] = obj

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.entry_point_group):
            try:   # the same object twice (two installs of one package) is not a duplicate
                self._add(ep.name, ep.load())
            except RegistryError as exc:
                raise RegistryError(f"entry point {ep.name!r} = {ep.value!r} of group "
                                    f"{self.entry_point_group!r}: {exc}") from None

    def get(self, name: str) -> T:
        self._load_entry_points()
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise RegistryError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        self._load_entry_points()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
