"""The name -> plug-in registry: registration, duplicates, unknown names, built-in registries."""

from __future__ import annotations

import pytest

from mutualrl.registry import Registry, RegistryError


def test_register_directly_and_get():
    reg: Registry[int] = Registry("widget")
    assert reg.register("a", 1) == 1
    assert reg.get("a") == 1
    assert "a" in reg and "b" not in reg
    assert reg.names() == ["a"]


def test_decorator_registers_and_returns_the_object():
    reg: Registry = Registry("widget")

    @reg.register("f")
    def f():
        return 42

    assert f() == 42  # the decorator gave the function back unchanged
    assert reg.get("f") is f


def test_duplicate_name_is_rejected_and_keeps_the_first():
    reg: Registry = Registry("widget")
    first, second = object(), object()
    reg.register("x", first)
    with pytest.raises(RegistryError, match="widget 'x' is already registered"):
        reg.register("x", second)
    assert reg.get("x") is first


def test_reregistering_the_same_object_is_harmless():
    reg: Registry = Registry("widget")
    obj = object()
    reg.register("x", obj)
    reg.register("x", obj)  # e.g. a module imported twice
    assert reg.names() == ["x"]


def test_unknown_name_lists_the_known_ones():
    reg: Registry = Registry("widget")
    reg.register("beta", 2)
    reg.register("alpha", 1)
    with pytest.raises(RegistryError) as info:
        reg.get("gamma")
    assert str(info.value) == "unknown widget 'gamma'; known: alpha, beta"
    assert isinstance(info.value, KeyError)


def test_unknown_name_in_an_empty_registry():
    with pytest.raises(RegistryError, match=r"known: \(none\)"):
        Registry("widget").get("x")


@pytest.mark.parametrize("bad", ["", None, 3])
def test_names_must_be_non_empty_strings(bad):
    with pytest.raises(RegistryError, match="non-empty string"):
        Registry("widget").register(bad, 1)


def test_iteration_is_sorted():
    reg: Registry = Registry("widget")
    for name in ["c", "a", "b"]:
        reg.register(name, name)
    assert list(reg) == ["a", "b", "c"]


def test_entry_points_of_an_empty_group_load_nothing():
    reg: Registry = Registry("widget", entry_point_group="mutualrl.tests.no-such-group")
    reg.register("own", 1)
    assert reg.names() == ["own"]


def test_builtin_registries_hold_the_builtins():
    from mutualrl.policies.models import ARCHITECTURES
    from mutualrl.strategies import STRATEGIES
    from mutualrl.tasks import TASKS

    assert {"llama", "qwen2", "mistral"} <= set(ARCHITECTURES.names())
    assert {"pointer", "jsonl"} <= set(TASKS.names())
    assert "none" in STRATEGIES


class _EntryPoint:
    """What ``importlib.metadata.entry_points`` yields, for a fake installed plug-in."""

    def __init__(self, name: str, obj: object) -> None:
        self.name, self.value, self._obj = name, f"plugin:{name}", obj

    def load(self) -> object:
        return self._obj


def test_entry_points_go_through_the_registrys_check_and_refused_ones_are_skipped(
    monkeypatch, caplog
):
    """An experience type from an entry point is checked as the decorator checks it; one that is
    refused (not frozen, not a Struct, its name taken) is skipped with a one-line warning naming
    it, the registry's other names still work, and looking the refused name up fails with it."""
    import msgspec

    import mutualrl.registry as registry
    from mutualrl.exchange.kinds import check_record_type

    class Loose(msgspec.Struct):  # not frozen
        text: str

    class Frozen(msgspec.Struct, frozen=True):
        text: str

    def fresh(*points):
        monkeypatch.setattr(registry, "entry_points", lambda group: list(points))
        reg = Registry("experience type", entry_point_group="g", check=check_record_type)
        reg.register("critique", Frozen)
        return reg

    for point, why in [
        (_EntryPoint("loose", Loose), "must be declared frozen=True"),
        (_EntryPoint("bad", dict), "must be a msgspec.Struct"),
        (_EntryPoint("critique", Loose), "already registered"),
    ]:
        caplog.clear()
        reg = fresh(point)
        assert reg.get("critique") is Frozen and reg.names() == ["critique"]
        [record] = caplog.records
        line = record.getMessage()
        assert "\n" not in line and f"plug-in {point.name!r}" in line and why in line, line
        assert f"plugin:{point.name}" in line and "package unknown" in line, line
        if point.name != "critique":
            with pytest.raises(RegistryError, match=f"plug-in {point.name!r}.*{why}"):
                reg.get(point.name)
    assert fresh(_EntryPoint("critique", Frozen)).get("critique") is Frozen  # the same: fine
