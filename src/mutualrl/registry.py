"""Name -> object registries: the one way the project dispatches on a name.

House rule 4: built-ins register themselves on a ``Registry`` object; third parties add theirs
through an entry point group. Duplicates are rejected so two plug-ins can never silently shadow
each other, and an unknown name fails with the list of known ones.

A third-party plug-in that fails to load (its import raises, its name is taken, its object is
refused) is skipped with a one-line warning naming its package and entry point, so one broken
package never takes down the command line; looking its name up then fails with that line.
Which name counts: the entry point's. If loading it runs the module's own decorator under the
same name, that is the same plug-in and nothing is doubled; if the decorator registered the
same object under another name, the decorator's name is the one used and the entry point's is
not registered (the warning says so): one object, one name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar, overload

T = TypeVar("T")

# Where a plug-in that fails to load is reported: with no logging set up, Python prints a
# warning's message alone on stderr, one line; an application may route it as it likes.
_PLUGIN_LOG = logging.getLogger("mutualrl.plugins")


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

    def __init__(
        self,
        kind: str,
        entry_point_group: str | None = None,
        check: Callable[[str, T], None] | None = None,
    ) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.check = check
        self._items: dict[str, T] = {}
        self._failed: dict[str, str] = {}  # entry point name -> why it was skipped (one line)
        self._entry_points_loaded = entry_point_group is None

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T) -> T: ...

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
        if name in self._items and not _same(self._items[name], obj):
            raise RegistryError(
                f"{self.kind} {name!r} is already registered ({self._items[name]!r})"
            )
        if self.check is not None:
            self.check(name, obj)
        self._items[name] = obj

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        if self.entry_point_group is None:  # a registry without plug-ins
            return
        for ep in entry_points(group=self.entry_point_group):
            problem = self._load_entry_point(ep)
            if problem is not None:
                message = (
                    f"{self.kind} plug-in {ep.name!r} (entry point {ep.name} = {ep.value} "
                    f"in group {self.entry_point_group}, {_package(ep)}) {problem}"
                )
                self._failed.setdefault(ep.name, message)
                _PLUGIN_LOG.warning("mutualrl: warning: %s", message)

    def _load_entry_point(self, ep: EntryPoint) -> str | None:
        """Load and register one entry point; what went wrong, or None."""
        before = set(self._items)
        try:
            obj = ep.load()
        except (Exception, SystemExit) as exc:  # a plug-in's import may raise anything
            for name in set(self._items) - before:  # what its module registered before failing
                del self._items[name]
            return f"failed to load ({_one_line(exc)}); skipped"
        registered = self._items.get(ep.name)
        if registered is not None and (ep.name not in before or _same(registered, obj)):
            return None  # its module's decorator registered this name, or one plug-in twice
        other = next((n for n, o in self._items.items() if _same(o, obj)), None)
        if other is not None:
            return (
                f"names an object already registered as {other!r} (by its decorator); "
                f"{other!r} is the name used, {ep.name!r} is not registered (give both the "
                f"same name)"
            )
        try:
            self._add(ep.name, obj)
        except RegistryError as exc:
            return f"was refused ({exc}); skipped"
        return None

    def get(self, name: str) -> T:
        self._load_entry_points()
        try:
            return self._items[name]
        except KeyError:
            if name in self._failed:
                raise RegistryError(self._failed[name]) from None
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


def _same(a: object, b: object) -> bool:
    """One plug-in registered twice: the very object, or an equal spec built twice (a module
    imported under two names, a decorator's spec and the entry point's)."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == cannot answer is not the same
        return False


def _package(ep: EntryPoint) -> str:
    """``package NAME VERSION`` of the distribution that declares ``ep``."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "package unknown"
    return f"package {dist.metadata['Name']} {dist.version}"


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
