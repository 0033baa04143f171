"""Planning sharded learners: memory divided by the ranks (activations per rank), one GPU per
rank, every rank's share on its GPU; the big configs plan only with sharding; bad rank counts
are refused naming the field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mutualrl.allocation import Inventory, PlanError, WorkerSpec, plan, worker_specs_from_config
from mutualrl.allocation.cli import configure
from mutualrl.allocation.dims import dims_from_policy
from mutualrl.allocation.specs import gathered_bytes, learner_memory_bytes
from mutualrl.config import ConfigError, MemoryModel, config_from_dict, load_config
from mutualrl.run.build import check_rank_groups
from mutualrl.run.plan_cli import run
from mutualrl.run.resume import config_differences

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3
BIG = ("gpu8-two-8b.toml", "cluster-2x8-4policy.toml")


def inv(nodes=1, gpus=8) -> Inventory:
    return Inventory(
        nodes=nodes,
        gpus_per_node=gpus,
        gpu_memory_bytes=80 * GIB,
        cpus_per_node=16,
        host_memory_bytes=64 * GIB,
    )


def spec(name, role="learner", mem_gib=1.0, ranks=1, group=None) -> WorkerSpec:
    return WorkerSpec(
        name=name,
        role=role,
        policy=name.split("/")[0],
        num_parameters=10**9,
        tokens_per_step=1000,
        memory_bytes=int(mem_gib * GIB),
        group=group or name.split("/")[0],
        ranks=ranks,
    )


def test_learner_state_is_divided_by_the_ranks():
    mem = MemoryModel(weight_bytes=2, grad_bytes=2, optimizer_bytes=12)
    whole = learner_memory_bytes(8_000_000_001, mem, reference=True, lora=False)
    assert whole == 8_000_000_001 * 18
    assert learner_memory_bytes(8_000_000_001, mem, reference=True, lora=False, ranks=4) == -(
        -whole // 4
    )


def test_activations_are_per_rank_and_the_rest_per_shard():
    cfg = config_from_dict(
        {
            "policies": [
                {"name": "a", "hidden_size": 64, "num_layers": 2},
                {"name": "b", "hidden_size": 64, "num_layers": 2, "learner_ranks": 4},
            ],
            "grpo": {"prompts_per_step": 4, "num_generations": 8},
        }
    )
    specs = {
        s.name: s
        for s in worker_specs_from_config(
            cfg, count_params=lambda p, v: 10**6, vocab_size=lambda t: 32000
        )
    }
    one, four = specs["a/learner"], specs["b/learner"]
    assert (one.ranks, four.ranks, specs["b/generator"].ranks) == (1, 4, 1)
    # 32 rows in one micro-batch on one rank, 8 on each of four; state / 4
    mem = cfg.allocation.memory
    state = learner_memory_bytes(10**6, mem, reference=False, lora=False)
    # the sharded learner also holds its largest unit gathered: here the tied embedding
    gathered = gathered_bytes(dims_from_policy(cfg.policies[1], 32000), True, mem)
    assert gathered == (32000 * 64 + 64) * (4 + 4 + 4)
    act_one, act_four = one.memory_bytes - state, four.memory_bytes - -(-state // 4) - gathered
    assert act_one == pytest.approx(4 * act_four, rel=1e-9)


def test_a_sharded_vllm_policy_plans_its_engine_and_rank_0s_whole_copy():
    """The engine reserves its share of the GPU; a sharded learner's rank 0 also keeps the whole
    copy of the weights that the engine reloads from (``policies.sharded.mirror``)."""
    vllm = {"backend": "vllm", "gpu_memory_utilization": 0.25}
    cfg = config_from_dict(
        {
            "policies": [
                {"name": "a", "generation": vllm},
                {"name": "b", "generation": vllm, "learner_ranks": 2},
            ],
            "grpo": {"prompts_per_step": 4, "num_generations": 8},
            "allocation": {
                "executor": "process",
                "inventory": {"gpus_per_node": 4, "gpu_memory_gb": 80},
            },
        }
    )
    specs = {
        s.name: s
        for s in worker_specs_from_config(
            cfg, count_params=lambda p, v: 10**9, vocab_size=lambda t: 32000
        )
    }
    engine = int(0.25 * 80 * GIB)
    assert specs["a/generator"].memory_bytes == engine
    assert specs["b/generator"].memory_bytes == engine + 10**9 * cfg.allocation.memory.weight_bytes


def test_a_group_of_ranks_gets_one_gpu_per_rank_and_its_first_gpu_holds_rank_0s_share():
    p = plan(
        [
            spec("a/learner", mem_gib=40, ranks=4),
            spec("a/generator", "generator", 20),
            spec("b/learner", mem_gib=30),
        ],
        inv(),
    )
    assert len(p["a/learner"].gpus) == 4 and p["a/generator"].gpus == p["a/learner"].gpus
    assert len(p["b/learner"].gpus) == 1
    assert p.notes and "3 of 8 GPUs stay free" in p.notes[0]
    with pytest.raises(
        PlanError,
        match=r"(?s)a/learner .* needs 60.0 GiB on each of 4 GPUs.*"
        r"group 'a': 80.0 GiB on its first GPU, of 72.0 GiB usable",
    ):
        plan([spec("a/learner", mem_gib=60, ranks=4), spec("a/generator", "generator", 20)], inv())


def test_more_ranks_than_gpus_is_refused_naming_the_worker():
    with pytest.raises(
        PlanError,
        match=r"(?s)needs more GPUs than exist.*big/learner .* on each of "
        r"16 GPUs.*1 node\(s\) x 8 GPU",
    ):
        plan([spec("big/learner", mem_gib=10, ranks=16)], inv())


def test_a_one_rank_learner_must_fit_one_gpu():
    with pytest.raises(
        PlanError, match=r"(?s)x/learner .* needs 100.0 GiB on one GPU.*more learner ranks"
    ):
        plan([spec("x/learner", mem_gib=100)], inv())


def _plan_cli(path: Path, *sets: str) -> int:
    parser = argparse.ArgumentParser()
    configure(parser)
    return run(parser.parse_args(["--config", str(path), *[a for s in sets for a in ("--set", s)]]))


@pytest.mark.parametrize("name", BIG)
def test_big_configs_plan_with_sharding_and_not_without(name, capsys):
    path = ROOT / "configs" / name
    assert _plan_cli(path) == 0
    out = capsys.readouterr().out
    assert "GiB x 4" in out  # per-GPU memory on 4 ranks
    cfg = load_config(path)
    unsharded = [f"policies.{i}.learner_ranks=1" for i in range(len(cfg.policies))]
    with pytest.raises(PlanError, match=r"needs .* GiB on one GPU") as err:
        _plan_cli(path, *unsharded)
    assert all(f"{p.name}/learner" in str(err.value) for p in cfg.policies if "3b" not in p.name)


@pytest.mark.parametrize(
    "settings, match",
    [
        (
            {"learner_ranks": 3},
            r"policies.a.learner_ranks: 3 ranks do not divide the step's own sequences",
        ),
        ({"learner_ranks": 0}, r"learner_ranks must be >= 1"),
        ({"learner_ranks": 2, "lora": {}}, r"a LoRA policy runs on one rank"),
    ],
)
def test_bad_rank_counts_name_the_field(settings, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(
            {
                "policies": [{"name": "a", **settings}],
                "grpo": {"prompts_per_step": 2, "num_generations": 4},
            }
        )
    with pytest.raises(ConfigError, match=r"learner_ranks: training.logprob_chunk_size"):
        config_from_dict(
            {
                "policies": [{"name": "a", "learner_ranks": 2}],
                "training": {"logprob_chunk_size": 64},
            }
        )
    with pytest.raises(ConfigError, match=r"do not divide warmup.batch_size = 6"):
        config_from_dict(
            {"policies": [{"name": "a", "learner_ranks": 4}], "warmup": {"batch_size": 6}}
        )


def test_the_local_executor_refuses_a_group_naming_the_fix():
    cfg = config_from_dict({"policies": [{"name": "a", "learner_ranks": 2}]})
    with pytest.raises(
        ConfigError, match=r'policies.a.learner_ranks = 2 .* allocation.executor = "process"'
    ):
        check_rank_groups(cfg)
    check_rank_groups(
        config_from_dict(
            {"policies": [{"name": "a", "learner_ranks": 2}], "allocation": {"executor": "process"}}
        )
    )


def test_a_resumed_run_may_reshard_but_not_change_what_it_computes():
    old = {
        "policies": [{"learner_ranks": 2, "hidden_size": 8}],
        "allocation": {"executor": "process"},
    }
    new = {
        "policies": [{"learner_ranks": 1, "hidden_size": 8}],
        "allocation": {"executor": "local"},
    }
    refused, harmless = config_differences(old, new)
    assert refused == [] and harmless == ["allocation.executor", "policies.0.learner_ranks"]
    refused, _ = config_differences(
        old, {**new, "policies": [{"learner_ranks": 1, "hidden_size": 16}]}
    )
    assert refused == ["policies.0.hidden_size"]
