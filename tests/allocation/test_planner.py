"""The pure planner: proportionality, integrality, feasibility errors, determinism."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mutualrl.allocation import GpuSlot, Inventory, PlanError, WorkerSpec, largest_remainder, plan

GIB = 1024**3


def inv(nodes=1, gpus=8, gpu_gib=80, cpus=16, host_gib=64) -> Inventory:
    return Inventory(
        nodes=nodes,
        gpus_per_node=gpus,
        gpu_memory_bytes=gpu_gib * GIB,
        cpus_per_node=cpus,
        host_memory_bytes=host_gib * GIB,
    )


def spec(
    name,
    role="learner",
    params=1_000_000,
    tokens=1000,
    mem_gib=1.0,
    group=None,
    min_threads=1,
    accel=True,
) -> WorkerSpec:
    return WorkerSpec(
        name=name,
        role=role,
        policy=name.split("/")[0],
        num_parameters=params,
        tokens_per_step=tokens,
        memory_bytes=int(mem_gib * GIB),
        group=group or name,
        min_threads=min_threads,
        uses_accelerator=accel,
    )


# ---- largest remainder --------------------------------------------------------------------------


@given(
    total=st.integers(0, 500),
    weights=st.lists(st.floats(0, 1e12, allow_nan=False), min_size=1, max_size=12),
)
def test_largest_remainder_is_integral_exact_and_within_one_of_quota(total, weights):
    keys = [f"w{i:02d}" for i in range(len(weights))]
    out = largest_remainder(total, weights, keys)
    assert sum(out) == total and all(isinstance(x, int) and x >= 0 for x in out)
    w = [Fraction(x) for x in weights]
    if sum(w) > 0:
        for got, wi in zip(out, w):
            assert abs(got - total * wi / sum(w)) < 1


def test_largest_remainder_ties_go_to_smallest_key_whatever_the_order():
    assert largest_remainder(1, [1.0, 1.0], ["b", "a"]) == [0, 1]
    assert largest_remainder(1, [1.0, 1.0], ["a", "b"]) == [1, 0]
    assert largest_remainder(5, [0.0, 0.0, 0.0], ["a", "b", "c"]) == [2, 2, 1]  # even split


def test_largest_remainder_rejects_negative_weights_and_nobody():
    with pytest.raises(ValueError, match="weights must be >= 0"):
        largest_remainder(3, [1.0, -1.0], ["a", "b"])
    with pytest.raises(ValueError, match="nobody"):
        largest_remainder(3, [], [])


# ---- GPU plans ----------------------------------------------------------------------------------


def _gpu_sets(p):
    return {g: {(s.node, s.gpu) for s in m[0].gpus} for g, m in p.groups().items() if m[0].gpus}


def test_gpu_plan_is_proportional_integral_and_uses_every_gpu_once():
    specs = [
        spec("big/learner", params=8_000_000_000, mem_gib=100),
        spec("mid/learner", params=4_000_000_000, mem_gib=50),
        spec("small/learner", params=1_000_000_000, mem_gib=10),
    ]
    p = plan(specs, inv(nodes=2, gpus=8))
    counts = {a.worker: len(a.gpus) for a in p.assignments}
    assert sum(counts.values()) == 16
    assert counts["big/learner"] > counts["mid/learner"] > counts["small/learner"] >= 1
    sets = list(_gpu_sets(p).values())
    assert sum(len(s) for s in sets) == len(set().union(*sets)) == 16  # no GPU given twice
    for a in p.assignments:  # sharded memory fits every GPU it got
        assert a.memory_bytes / len(a.gpus) <= 0.9 * 80 * GIB
    shares = [a.cost_share for a in p.assignments]
    assert math.isclose(sum(shares), 1.0) and shares[0] == pytest.approx(8 / 13)


def test_memory_minimums_come_first_then_cost():
    # "fat" has tiny cost but needs 3 GPUs of memory; it keeps them even though cost says less.
    specs = [
        spec("fat/generator", role="generator", params=10, mem_gib=200),
        spec("busy/learner", params=1_000_000_000, mem_gib=10),
    ]
    p = plan(specs, inv(gpus=8))
    assert len(p["fat/generator"].gpus) == 3 and len(p["busy/learner"].gpus) == 5


def test_colocated_workers_share_devices_and_threads():
    specs = [
        spec("a/learner", group="a", mem_gib=60),
        spec("a/generator", role="generator", group="a", mem_gib=30),
        spec("b/learner", group="b", mem_gib=10),
    ]
    p = plan(specs, inv(gpus=4, cpus=8))
    assert p["a/learner"].gpus == p["a/generator"].gpus
    assert len(p["a/learner"].gpus) >= 2  # 90 GiB together needs two 72 GiB-usable GPUs
    assert p["a/learner"].threads == p["a/generator"].threads
    assert p["a/learner"].threads + p["b/learner"].threads == 8


def test_fewer_gpus_than_groups_share_gpus_by_memory():
    specs = [
        spec("a/learner", params=3, mem_gib=10),
        spec("b/learner", params=1, mem_gib=10),
        spec("c/learner", params=1, mem_gib=70),
    ]
    p = plan(specs, inv(gpus=2))
    assert len(p["c/learner"].gpus) == 1 and p["c/learner"].gpus[0].fraction == 1.0
    a, b = p["a/learner"].gpus[0], p["b/learner"].gpus[0]
    assert (a.node, a.gpu) == (b.node, b.gpu) and a.fraction + b.fraction == pytest.approx(1.0)
    assert a.fraction == pytest.approx(0.75)
    assert p.notes and "share GPUs" in p.notes[0]


def test_infeasible_plan_names_each_worker_need_and_what_is_available():
    specs = [
        spec("huge/learner", params=70_000_000_000, mem_gib=1200),
        spec("ok/learner", mem_gib=10),
    ]
    with pytest.raises(PlanError) as err:
        plan(specs, inv(nodes=2, gpus=8))
    msg = str(err.value)
    assert "huge/learner" in msg and "1200.0 GiB" in msg and "70,000,000,000" in msg
    assert "2 node(s) x 8 GPU(s) of 80.0 GiB" in msg and "72.0 GiB usable" in msg


def test_infeasible_cpu_plan_is_all_or_nothing():
    specs = [spec("a/learner", mem_gib=20, accel=False), spec("b/learner", mem_gib=20)]
    with pytest.raises(PlanError, match="host memory") as err:
        plan(specs, inv(gpus=0, host_gib=24))
    assert "a/learner" in str(err.value) and "b/learner" in str(err.value)


def test_plan_is_deterministic_and_independent_of_input_order():
    specs = [
        spec(f"p{i}/learner", params=p, mem_gib=m)
        for i, (p, m) in enumerate([(5, 10), (5, 10), (3, 80), (9, 150), (1, 1)])
    ]
    a = plan(specs, inv(nodes=2, gpus=8))
    b = plan(list(reversed(specs)), inv(nodes=2, gpus=8))
    assert a == plan(specs, inv(nodes=2, gpus=8))
    assert {x.worker: (x.gpus, x.threads) for x in a.assignments} == {
        x.worker: (x.gpus, x.threads) for x in b.assignments
    }
    assert [x.worker for x in b.assignments] == [s.name for s in reversed(specs)]


def test_duplicate_worker_names_are_rejected():
    with pytest.raises(PlanError, match="unique"):
        plan([spec("a/learner"), spec("a/learner")], inv())


# ---- CPU-only plans -----------------------------------------------------------------------------


def test_cpu_only_plan_gives_policies_threads():
    specs = [
        spec("small/learner", params=1),
        spec("large/learner", params=3),
        spec("verifier", role="verifier", params=0, mem_gib=0, min_threads=0, accel=False),
    ]
    two = plan(specs, inv(gpus=0, cpus=2))
    assert two.mode == "cpu" and not two.oversubscribed
    assert [a.threads for a in two.assignments] == [1, 1, 0]
    assert all(a.gpus == () for a in two.assignments)
    eight = plan(specs, inv(gpus=0, cpus=8))
    assert [a.threads for a in eight.assignments] == [2, 6, 0]  # 1+1 minimums, 6 split 1:3


def test_cpu_oversubscription_is_reported_not_hidden():
    specs = [spec(f"p{i}/learner") for i in range(4)]
    p = plan(specs, inv(gpus=0, cpus=2))
    assert p.oversubscribed and all(a.threads == 1 for a in p.assignments)
    assert any("time-share" in n for n in p.notes)


def test_gpu_slot_is_hashable_and_ordered_in_output():
    p = plan([spec("a/learner", mem_gib=100)], inv(gpus=4))
    assert p["a/learner"].gpus == tuple(GpuSlot(0, i) for i in range(4))
