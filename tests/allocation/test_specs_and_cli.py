"""Allocation config, worker specs from a run config, and `mutualrl plan` on the cluster configs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mutualrl.allocation import PlanError, plan, worker_specs_from_config
from mutualrl.allocation.cli import configure, format_devices
from mutualrl.allocation.dims import dims_from_policy
from mutualrl.allocation.planner import GpuSlot
from mutualrl.allocation.specs import (
    activation_bytes,
    inventory_from_config,
    kv_cache_bytes,
    learner_memory_bytes,
    tokens_per_step,
)
from mutualrl.config import AllocationConfig, ConfigError, config_from_dict, load_config
from mutualrl.run.plan_cli import run

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_CONFIGS = sorted((ROOT / "configs").glob("cluster-*.toml"))


def _cfg(**allocation):
    return config_from_dict(
        {
            "policies": [
                {"name": "a", "hidden_size": 64, "num_layers": 2},
                {
                    "name": "b",
                    "hidden_size": 128,
                    "num_layers": 4,
                    "tokenizer": "deepseek-v3",
                    "lora": {},
                },
            ],
            "grpo": {
                "prompts_per_step": 4,
                "num_generations": 8,
                "max_completion_length": 6,
                "beta": 0.1,
                "num_iterations": 2,
            },
            "allocation": allocation,
        }
    )


def _fake_count(policy, vocab):
    return policy.hidden_size * 1000 + vocab


def _fake_vocab(name):
    return {"mistral-v1": 32_000, "deepseek-v3": 129_280}[name]


def test_allocation_errors_name_the_field_path():
    with pytest.raises(ConfigError, match=r"\$\.allocation`"):
        _cfg(no_such_field=1)
    with pytest.raises(ConfigError, match=r"max_staleness must be >= 0.*\$\.allocation"):
        _cfg(max_staleness=-1)
    with pytest.raises(ConfigError, match=r"\$\.allocation\.inventory"):
        _cfg(inventory={"nodes": 0})
    with pytest.raises(ConfigError, match=r"\$\.allocation\.on_failure"):
        _cfg(on_failure="retry")
    assert _cfg().allocation == AllocationConfig()


def test_worker_specs_follow_the_documented_estimates():
    cfg = _cfg(prompt_length_estimate=10)
    alloc = cfg.allocation
    specs = worker_specs_from_config(cfg, alloc, count_params=_fake_count, vocab_size=_fake_vocab)
    assert [s.name for s in specs] == [
        "a/learner",
        "a/generator",
        "b/learner",
        "b/generator",
        "verifier",
    ]
    tokens = tokens_per_step(4, 8, 10, 6)
    assert tokens == 4 * 8 * 16
    a_learn, a_gen, b_learn, b_gen, ver = specs
    n_a = 64 * 1000 + 32_000
    assert a_learn.num_parameters == n_a and a_learn.tokens_per_step == 2 * tokens  # 2 iterations
    # activations: 32 rows x 16 tokens, fp32, no checkpointing
    act_a = activation_bytes(dims_from_policy(cfg.policies[0], 32_000), 32, 16, 6, 4, False)
    act_b = activation_bytes(dims_from_policy(cfg.policies[1], 129_280), 32, 16, 6, 4, False)
    assert a_learn.memory_bytes == n_a * (4 + 4 + 8 + 4) + act_a  # beta > 0: a frozen reference too
    assert a_gen.memory_bytes == n_a * 4 + kv_cache_bytes(2, 64, tokens, alloc.memory)
    assert (
        b_learn.memory_bytes
        == learner_memory_bytes(b_learn.num_parameters, alloc.memory, reference=True, lora=True)
        + act_b
    )
    assert b_learn.memory_bytes == b_learn.num_parameters * 4 + act_b  # LoRA: frozen base only
    assert a_learn.cost == 6 * n_a * 2 * tokens and a_gen.cost == 2 * n_a * tokens
    assert a_learn.group == a_gen.group == "a" and ver.cost == 0 and not ver.uses_accelerator


def test_hints_and_overrides_replace_estimates_and_split_groups():
    cfg = _cfg(
        colocate=False,
        num_parameters={"b": 7_000_000_000},
        architectures={
            "b": {
                "num_hidden_layers": 4,
                "hidden_size": 128,
                "num_attention_heads": 4,
                "vocab_size": 129_280,
            }
        },
        workers={"a/generator": {"memory_gb": 2.0, "tokens_per_step": 5}},
    )

    def vocab(name):  # b has a hint: its tokenizer need not be loaded
        assert name != "deepseek-v3", "a num_parameters hint must skip loading the tokenizer"
        return _fake_vocab(name)

    specs = {
        s.name: s for s in worker_specs_from_config(cfg, count_params=_fake_count, vocab_size=vocab)
    }
    assert specs["b/learner"].num_parameters == 7_000_000_000
    assert specs["a/generator"].memory_bytes == 2 * 1024**3
    assert specs["a/generator"].tokens_per_step == 5
    assert specs["a/learner"].group == "a/learner" and specs["a/generator"].group == "a/generator"


def test_default_config_plans_on_a_two_core_cpu_machine():
    cfg = _cfg(inventory={"gpus_per_node": 0, "cpus_per_node": 2, "host_memory_gb": 24})
    alloc = cfg.allocation
    specs = worker_specs_from_config(cfg, alloc, count_params=_fake_count, vocab_size=_fake_vocab)
    p = plan(specs, inventory_from_config(alloc.inventory))
    assert p.mode == "cpu" and not p.oversubscribed
    assert {a.group: a.threads for a in p.assignments} == {"a": 1, "b": 1, "verifier": 0}


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_cluster_configs_parse(path):
    cfg = load_config(path)
    alloc = cfg.allocation
    assert alloc.inventory is not None and alloc.inventory.gpus_per_node == 8


def _run_cli(argv) -> int:
    parser = argparse.ArgumentParser()
    configure(parser)
    return run(parser.parse_args(argv))


def test_plan_cli_prints_every_worker_of_the_4_policy_cluster(capsys):
    assert _run_cli(["--config", str(ROOT / "configs/cluster-2x8-4policy.toml")]) == 0
    out = capsys.readouterr().out
    for name in (
        "llama31-8b/learner",
        "qwen25-7b/generator",
        "mistral-7b/learner",
        "llama32-3b/generator",
        "verifier",
    ):
        assert name in out
    assert "cost share" in out and "n0:g" in out and "n1:g" in out


def test_plan_cli_overrides_and_infeasible_error():
    path = str(ROOT / "configs/cluster-2x8-4policy.toml")
    with pytest.raises(PlanError, match="llama31-8b/learner"):
        _run_cli(["--config", path, "--set", "allocation.inventory.gpus_per_node=2"])


def test_plan_cli_json(capsys):
    path = str(ROOT / "configs/cluster-2x8-4policy.toml")
    assert _run_cli(["--config", path, "--json"]) == 0
    assert '"worker": "llama31-8b/learner"' in capsys.readouterr().out


def test_format_devices():
    assert format_devices(()) == "cpu"
    assert format_devices((GpuSlot(0, 2), GpuSlot(0, 3))) == "n0:g2-3"
    assert format_devices((GpuSlot(0, 7), GpuSlot(1, 0))) == "n0:g7 + n1:g0"
    assert format_devices((GpuSlot(1, 1, 0.25),)) == "n1:g1 (25%)"
