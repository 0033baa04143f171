"""Records, group statistics and experience-type registration."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mutualrl.exchange import (
    EXPERIENCE_TYPES,
    ExperienceBus,
    FrameCodec,
    GroupStats,
    Rollout,
    UnknownKindError,
    experience_type,
    merge,
    prompt_id,
)
from mutualrl.registry import Registry, RegistryError


def make_rollout(**over: object) -> Rollout:
    fields = dict(
        prompt="2+2=",
        completion="4",
        producer="a",
        tokenizer_id="tok",
        token_ids=[7, 8],
        logprobs=[-0.5, -0.25],
        reward=1.0,
        verifier_id="exact",
        policy_version=0,
        finish_reason="stop",
    )
    fields.update(over)
    return Rollout.create(**fields)


def test_prompt_id_is_a_stable_content_hash() -> None:
    assert prompt_id("2+2=") == prompt_id("2+2=")
    assert prompt_id("2+2=") != prompt_id("2+2= ")
    assert len(prompt_id("x")) == 32
    # Frozen value: changing the hash would orphan every logged prompt id.
    assert prompt_id("first of cat dog sun tree:") == "b9b0e5341c0ef591799108b4f0962f49"


def test_rollout_arrays_round_trip_through_bytes() -> None:
    r = make_rollout(token_ids=np.array([1, 129279, 3]), logprobs=np.array([-0.1, -2.0, 0.0]))
    assert r.prompt_id == prompt_id("2+2=")
    assert r.num_tokens == 3
    assert r.token_array.tolist() == [1, 129279, 3]
    assert r.token_array.dtype == np.dtype("<i4")
    np.testing.assert_allclose(r.logprob_array, [-0.1, -2.0, 0.0], rtol=1e-6)


def test_rollout_rejects_mismatched_arrays() -> None:
    with pytest.raises(ValueError, match="one log-prob per token"):
        make_rollout(token_ids=[1, 2, 3], logprobs=[-1.0])
    with pytest.raises(ValueError, match="token_ids: expected a 1-D sequence of integers"):
        make_rollout(token_ids=[0.5, 1.5])


def test_group_stats_match_numpy_population_variance() -> None:
    rewards = [1.0, 0.0, 0.5, 0.25, 1.0]
    g = GroupStats.from_rewards(
        prompt_id=prompt_id("p"), producer="a", policy_version=1, rewards=rewards
    )
    assert g.count == 5
    assert g.mean == pytest.approx(np.mean(rewards))
    assert g.variance == pytest.approx(np.var(rewards))
    assert g.std == pytest.approx(np.std(rewards))
    empty = GroupStats.from_rewards(
        prompt_id=prompt_id("p"), producer="a", policy_version=1, rewards=[]
    )
    assert (empty.count, empty.variance) == (0, 0.0)


rewards_lists = st.lists(st.floats(-10, 10, allow_nan=False), min_size=0, max_size=20)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rewards_lists, rewards_lists)
def test_merge_equals_stats_of_the_union(a: list[float], b: list[float]) -> None:
    pid = prompt_id("p")
    ga = GroupStats.from_rewards(prompt_id=pid, producer="a", policy_version=1, rewards=a)
    gb = GroupStats.from_rewards(prompt_id=pid, producer="b", policy_version=4, rewards=b)
    m = merge(ga, gb)
    union = a + b
    assert m.count == len(union)
    assert m.producer == "a+b" and m.policy_version == 4
    if union:
        assert m.mean == pytest.approx(np.mean(union), abs=1e-9)
        assert m.variance == pytest.approx(np.var(union), abs=1e-7)


def test_merge_refuses_different_prompts() -> None:
    ga = GroupStats.from_rewards(
        prompt_id=prompt_id("p"), producer="a", policy_version=1, rewards=[1.0]
    )
    gb = GroupStats.from_rewards(
        prompt_id=prompt_id("q"), producer="a", policy_version=1, rewards=[1.0]
    )
    with pytest.raises(ValueError, match="prompt_id differs"):
        merge(ga, gb)


def test_builtin_kinds_are_registered() -> None:
    assert {"rollout", "group_stats", "verified_success", "watermark"} <= set(
        EXPERIENCE_TYPES.names()
    )
    assert EXPERIENCE_TYPES.get("rollout") is Rollout


# An externally defined record, registered the way the THL layer registers AlignmentResiduals.
@experience_type("test.alignment_residuals")
class Residuals(msgspec.Struct, frozen=True, kw_only=True):
    prompt_id: str
    mismatch_bytes: int
    length_ratio: float


def test_external_struct_travels_through_bus_and_wire() -> None:
    bus = ExperienceBus()
    sub = bus.subscribe(kinds={"test.alignment_residuals"})
    rec = Residuals(prompt_id=prompt_id("p"), mismatch_bytes=2, length_ratio=1.25)
    bus.publish(rec, producer="thl", version=0)
    (got,) = sub.drain_deliveries()
    assert got.record is rec and got.kind == "test.alignment_residuals"
    codec = FrameCodec()
    (back,) = codec.decode(codec.encode([got]))
    assert back.record == rec


def test_registration_rejects_bad_types_and_duplicates() -> None:
    reg: Registry = Registry("experience type")

    class Mutable(msgspec.Struct):
        x: int

    class Frozen(msgspec.Struct, frozen=True):
        x: int

    with pytest.raises(RegistryError, match="frozen=True"):
        experience_type("mutable", registry=reg)(Mutable)
    with pytest.raises(RegistryError, match="msgspec.Struct subclass"):
        experience_type("plain", registry=reg)(dict)
    with pytest.raises(RegistryError, match="lower-case"):
        experience_type("Bad Name", registry=reg)(Frozen)
    experience_type("frozen", registry=reg)(Frozen)
    with pytest.raises(RegistryError, match="already registered"):
        experience_type("frozen", registry=reg)(Residuals)


def test_publishing_an_unregistered_type_names_it() -> None:
    class Stray(msgspec.Struct, frozen=True):
        x: int

    with pytest.raises(UnknownKindError, match="Stray is not a registered experience type"):
        ExperienceBus().publish(Stray(x=1), producer="a", version=0)


def test_records_are_frozen_and_finite_stats() -> None:
    r = make_rollout()
    with pytest.raises(AttributeError):
        r.reward = 0.0  # type: ignore[misc]
    g = GroupStats.from_rewards(
        prompt_id=r.prompt_id, producer="a", policy_version=0, rewards=[0.0, 0.0]
    )
    assert g.std == 0.0 and math.isfinite(g.std)


class PluginRecord(msgspec.Struct, frozen=True, kw_only=True):
    score: float


def test_entry_point_registered_type_decodes(monkeypatch) -> None:
    from importlib.metadata import EntryPoint

    import mutualrl.registry as registry_module
    from mutualrl.exchange.codec import RecordCodec

    ep = EntryPoint(
        name="plugin.score", group="mutualrl.experience_types", value=f"{__name__}:PluginRecord"
    )
    monkeypatch.setattr(
        registry_module,
        "entry_points",
        lambda group: [ep] if group == "mutualrl.experience_types" else [],
    )
    reg: Registry = Registry("experience type", entry_point_group="mutualrl.experience_types")
    codec = RecordCodec(reg)
    rec = PluginRecord(score=0.5)
    env = codec.envelope(rec, kind=codec.kind_of(rec), producer="p", version=0, seq=0)
    assert env.kind == "plugin.score"
    assert codec.decode_record(env, where="mem") == rec


def test_frame_codec_refuses_a_kind_that_does_not_match_the_record() -> None:
    from mutualrl.exchange import Delivery

    with pytest.raises(ValueError, match="kind 'rollout' but record is a Residuals"):
        FrameCodec().encode(
            [
                Delivery(
                    kind="rollout",
                    producer="p",
                    producer_version=0,
                    seq=0,
                    record=Residuals(prompt_id="x", mismatch_bytes=0, length_ratio=1.0),
                )
            ]
        )
