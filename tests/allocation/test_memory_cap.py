"""A policy process that shares its GPU with others caps torch's caching allocator at its planned
memory (``allocation.memory.cap_shared_gpus``): which processes are capped and at what (from the
plan, on CPU), and, on a real GPU (``pytest -m gpu``), that a capped process cannot take more
while one beside it, uncapped, can."""

from __future__ import annotations

import functools
import pickle
import types
from dataclasses import dataclass

import msgspec
import pytest
import torch

from mutualrl.allocation import AllocationConfig
from mutualrl.allocation.placement import policy_memory_cap
from mutualrl.allocation.planner import Assignment, GpuSlot
from mutualrl.config import load_config
from mutualrl.policies import device_memory
from mutualrl.policies.device_memory import GIB, Capped
from mutualrl.policies.policy import load_handles
from mutualrl.run.build import plan_workers, policy_factories
from mutualrl.workers import ProcessExecutor
from mutualrl.workers.ranks import RankGroup


@pytest.fixture(scope="module")
def gpu_config():
    """configs/gpu1-random-1b.toml: two policies, one process each, sharing one 80 GiB GPU."""
    cfg = load_config("configs/gpu1-random-1b.toml")
    handles = load_handles(cfg.policies)
    return cfg, handles, plan_workers(cfg, handles)[1]


def _with(cfg, **alloc):
    memory = alloc.pop("memory", {})
    a = msgspec.structs.replace(
        cfg.allocation, **alloc, memory=msgspec.structs.replace(cfg.allocation.memory, **memory)
    )
    return msgspec.structs.replace(cfg, allocation=a)


def test_each_policy_sharing_a_gpu_is_capped_at_its_planned_memory_over_the_usable_fraction(
    gpu_config,
):
    cfg, _, plan = gpu_config
    caps = {}
    for p in cfg.policies:
        mine = [a for a in plan.assignments if a.policy == p.name]
        assert {a.role for a in mine} == {"learner", "generator"}
        assert all(s.fraction < 1 for a in mine for s in a.gpus)  # the one GPU is shared
        caps[p.name] = policy_memory_cap(p.name, plan, "process", 0.9)
        assert caps[p.name] == int(sum(a.memory_bytes for a in mine) / 0.9)
        assert policy_memory_cap(p.name, plan, "ray", 0.9) == caps[p.name]
    assert sum(caps.values()) <= plan.inventory.gpu_memory_bytes  # the caps fit the card
    # one process for every policy: one allocator, nothing to split
    assert all(policy_memory_cap(p.name, plan, "local", 0.9) is None for p in cfg.policies)


def test_a_policy_with_a_gpu_of_its_own_is_not_capped(gpu_config):
    cfg, handles, _ = gpu_config
    two = _with(cfg, inventory=msgspec.structs.replace(cfg.allocation.inventory, gpus_per_node=2))
    plan = plan_workers(two, handles)[1]
    assert all(s.fraction == 1 for a in plan.assignments for s in a.gpus)
    assert all(policy_memory_cap(p.name, plan, "process", 0.9) is None for p in cfg.policies)


def test_a_sharded_learner_s_ranks_are_each_capped_at_their_shard_and_a_share_of_the_rest():
    slot = (GpuSlot(node=0, gpu=0, fraction=0.5),)
    a = functools.partial(
        Assignment,
        group="g",
        num_parameters=1,
        tokens_per_step=1,
        cost=1.0,
        cost_share=0.5,
        node=0,
        gpus=slot,
        threads=1,
    )
    plan = types.SimpleNamespace(
        mode="gpu",
        assignments=(
            a(worker="p/learner", role="learner", policy="p", memory_bytes=10 * GIB, ranks=2),
            a(worker="p/generator", role="generator", policy="p", memory_bytes=4 * GIB),
        ),
    )
    assert policy_memory_cap("p", plan, "process", 0.8) == int(12 * GIB / 0.8)
    assert (
        policy_memory_cap(
            "p", types.SimpleNamespace(mode="cpu", assignments=plan.assignments), "process", 0.8
        )
        is None
    )


def test_the_factories_of_a_shared_gpu_build_under_their_caps_and_only_there(gpu_config):
    cfg, handles, plan = gpu_config
    factories = policy_factories(cfg, cfg.allocation, handles, plan, total_steps=1)
    for p in cfg.policies:
        f = factories[p.name]
        assert isinstance(f, Capped)
        assert f.cap_bytes == policy_memory_cap(p.name, plan, "process", 0.9)
        assert f.build.keywords["device"] == "cuda:0"
        back = pickle.loads(pickle.dumps(f))  # it travels to the worker's process
        assert back.cap_bytes == f.cap_bytes and back.build.func is f.build.func
    off = _with(cfg, memory={"cap_shared_gpus": False})
    assert not any(
        isinstance(f, Capped)
        for f in policy_factories(off, off.allocation, handles, plan, total_steps=1).values()
    )
    local = _with(cfg, executor="local")
    assert not any(
        isinstance(f, Capped)
        for f in policy_factories(local, local.allocation, handles, plan, total_steps=1).values()
    )
    cpu = msgspec.structs.replace(cfg, device="cpu")
    assert not any(
        isinstance(f, Capped)
        for f in policy_factories(cpu, cpu.allocation, handles, plan, total_steps=1).values()
    )


def test_a_sharded_policy_s_group_stays_a_group_with_each_rank_s_build_capped(gpu_config):
    cfg, handles, plan = gpu_config
    sharded = msgspec.structs.replace(  # a sharded model takes no chunked log-softmax
        cfg,
        training=msgspec.structs.replace(cfg.training, logprob_chunk_size=None),
        policies=[msgspec.structs.replace(cfg.policies[0], learner_ranks=2), *cfg.policies[1:]],
    )
    f = policy_factories(sharded, sharded.allocation, handles, plan, total_steps=1)[
        cfg.policies[0].name
    ]
    assert isinstance(f, RankGroup) and f.ranks == 2 and f.backend == "nccl"
    assert isinstance(f.build, Capped)
    assert f.build.cap_bytes == policy_memory_cap(cfg.policies[0].name, plan, "process", 0.9)


def test_the_cap_is_the_planned_bytes_as_a_fraction_of_the_card_and_kept_for_the_report(
    monkeypatch,
):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=100 * GIB)
    )
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d: seen.append((f, d))
    )
    monkeypatch.setattr(device_memory, "_cap_bytes", None)
    built = Capped(25 * GIB, functools.partial(dict, a=1))(b=2)
    assert built == {"a": 1, "b": 2} and seen == [(0.25, 0)]
    assert device_memory._cap_bytes == 25 * GIB
    assert device_memory.cap_process_memory(300 * GIB) == 1.0  # never more than the card
    assert device_memory._cap_bytes == 100 * GIB


def test_without_cuda_the_cap_is_a_no_op():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert device_memory.cap_process_memory(GIB) is None
    assert Capped(GIB, functools.partial(list, "ab"))() == ["a", "b"]


# ---- on a real GPU -------------------------------------------------------------------------------


class Hog:
    """A worker that takes GPU memory on request and says what its allocator holds."""

    def __init__(self) -> None:
        self.held: list[torch.Tensor] = []

    def take(self, gib: float) -> float:
        self.held.append(torch.empty(int(gib * GIB), dtype=torch.uint8, device="cuda:0"))
        return torch.cuda.memory_reserved(0) / GIB


@dataclass(frozen=True)
class Take:
    gib: float

    def __call__(self, worker):
        return worker.take(self.gib)


@pytest.mark.gpu
def test_on_a_gpu_a_capped_process_cannot_take_more_than_its_cap_and_an_uncapped_one_beside_it_can():  # noqa: E501
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    slot = (GpuSlot(node=0, gpu=0, fraction=0.5),)
    a = functools.partial(
        Assignment,
        role="learner",
        group="g",
        num_parameters=1,
        tokens_per_step=1,
        cost=1.0,
        cost_share=0.5,
        memory_bytes=0,
        node=0,
        gpus=slot,
        threads=1,
    )
    plan = types.SimpleNamespace(
        assignments=(a(worker="capped", policy="capped"), a(worker="free", policy="free"))
    )
    ex = ProcessExecutor(AllocationConfig(call_timeout_s=120.0, on_failure="continue"))
    ex.start({"capped": Capped(2 * GIB, Hog), "free": Hog}, plan)
    try:
        out = ex.call({"capped": Take(1.0), "free": Take(1.0)})
        assert 1.0 <= out["capped"].value <= 2.0
        f = ex.call({"capped": Take(1.5)})["capped"].failure  # 2.5 GiB in all: over its 2 GiB
        assert f is not None and f.exc_type == "OutOfMemoryError", f
        assert ex.call({"free": Take(1.5)})["free"].value >= 2.5  # the card had the room
    finally:
        ex.shutdown()


def test_the_plan_command_says_what_each_shared_gpu_process_is_capped_at(gpu_config, capsys):
    from mutualrl.cli import main

    cfg, _, plan = gpu_config
    assert main(["plan", "--config", "configs/gpu1-random-1b.toml"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for p in cfg.policies:
        assert f"{p.name} {policy_memory_cap(p.name, plan, 'process', 0.9) / GIB:.2f} GiB" in out
    assert (
        main(
            [
                "plan",
                "--config",
                "configs/gpu1-random-1b.toml",
                "--set",
                "allocation.executor=local",
            ]
        )
        == 0
    )
    assert "capped" not in capsys.readouterr().out
