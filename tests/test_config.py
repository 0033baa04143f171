"""Run configuration: every shipped config parses; overrides; each bad value names its field
path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mutualrl
from mutualrl.config import (
    AllocationConfig,
    ConfigError,
    RunConfig,
    ScenariosConfig,
    apply_override,
    config_from_dict,
    load_config,
    to_dict,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT = CONFIGS / "default.toml"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert len(cfg.policies) >= 1
    assert len({p.name for p in cfg.policies}) == len(cfg.policies)


def test_configs_folder_is_not_empty():
    # The glob above would silently parametrize over nothing if the folder moved.
    names = {p.name for p in CONFIGS.glob("*.toml")}
    assert {"default.toml", "tiny.toml"} <= names


def test_tiny_config_is_the_default_pair_scaled_down():
    tiny, default = load_config(CONFIGS / "tiny.toml"), load_config(DEFAULT)
    assert [(p.name, p.architecture, p.tokenizer) for p in tiny.policies] == [
        (p.name, p.architecture, p.tokenizer) for p in default.policies
    ]
    assert [p.hidden_size for p in tiny.policies] == [32, 32]
    assert (tiny.steps, tiny.warmup.max_steps) == (2, 3)
    assert (tiny.grpo.prompts_per_step, tiny.grpo.num_generations) == (2, 4)
    assert (tiny.eval.every, tiny.eval.num_prompts, tiny.eval.k) == (0, 4, 2)
    assert tiny.output_dir == "runs/tiny"


def test_default_gives_the_policies_complementary_warm_starts():
    # What the compare rests on: each policy is taught a different family, and together they
    # cover every family of the task, so each has a peer family only its peer knows.
    from mutualrl.tasks import build_task

    cfg = load_config(DEFAULT)
    task = build_task(cfg.task)
    warm = [set(p.warmup_families) for p in cfg.policies]
    assert all(warm) and not set.intersection(*warm)
    assert set.union(*warm) == set(task.families)


def test_dotted_overrides_reach_nested_fields_and_list_items():
    cfg = load_config(
        DEFAULT,
        [
            "grpo.beta=0.01",
            'policies.0.tokenizer="deepseek-v3"',
            "steps=3",
            'task.families=["first"]',
            "output_dir=/tmp/bare",
        ],
    )
    assert cfg.grpo.beta == pytest.approx(0.01)
    assert cfg.policies[0].tokenizer == "deepseek-v3"
    assert cfg.policies[1].tokenizer == "deepseek-v3"  # untouched, as in the file
    assert cfg.steps == 3
    assert cfg.task.families == ["first"]
    assert cfg.output_dir == "/tmp/bare"  # not a TOML literal: taken as a bare string
    # the file's other values survive
    assert cfg.grpo.num_generations == load_config(DEFAULT).grpo.num_generations


def test_override_creates_missing_tables():
    data: dict = {}
    apply_override(data, "strategies.prp.pool_size=3")
    assert data == {"strategies": {"prp": {"pool_size": 3}}}


@pytest.mark.parametrize(
    "override, message",
    [
        ("grpo", "expected KEY=VALUE"),
        ('policies.7.name="x"', "index below 2"),
        ("seed.x=1", "seed is a value, not a table"),
    ],
)
def test_malformed_overrides_raise_config_error(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEFAULT, [override])


@pytest.mark.parametrize(
    "override, path, message",
    [
        ('grpo.beta="high"', "$.grpo.beta", "Expected `float`, got `str`"),
        ("grpo.num_generations=2.5", "$.grpo.num_generations", "Expected `int`"),
        ("grpo.bogus=1", "$.grpo", "unknown field `bogus`"),
        ("policies.1.colour=1", "$.policies[1]", "unknown field `colour`"),
        ("grpo.beta=-0.1", "$.grpo", "beta must be >= 0"),
        ("grpo.num_generations=1", "$.grpo", "num_generations must be >= 2"),
        ("grpo.epsilon=1.5", "$.grpo", "epsilon must be in (0, 1)"),
        ("grpo.epsilon=0.0", "$.grpo", "epsilon must be in (0, 1)"),
        ("grpo.epsilon_high=0", "$.grpo", "epsilon_high must be > 0"),
        ('grpo.cache_implementation="offloaded"', "$.grpo.cache_implementation", "offloaded"),
        ("policies.0.hidden_size=30", "$.policies[0]", "divisible by num_heads"),
        ("warmup.target_accuracy=2", "$.warmup", "target_accuracy"),
        ("exchange.queue_size=0", "$.exchange", "queue_size"),
    ],
)
def test_bad_values_name_their_field_path(override, path, message):
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, [override])
    text = str(info.value)
    assert f"`{path}`" in text, text
    assert message in text, text
    assert str(DEFAULT) in text  # and the file it came from


def test_duplicate_policy_names_are_rejected():
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, ['policies.1.name="llama-mistral"'])
    text = str(info.value)
    assert "policy names must be unique" in text
    assert "llama-mistral" in text


def test_missing_policies_is_an_error(tmp_path):
    path = tmp_path / "empty.toml"
    path.write_text("seed = 1\n")
    with pytest.raises(ConfigError, match="policies"):
        load_config(path)


def test_nonexistent_file_names_the_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(missing)
    assert str(missing) in str(info.value)


def test_invalid_toml_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[grpo\nbeta = 0.1\n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(bad)
    assert str(bad) in str(info.value)


def test_config_error_is_a_value_error():
    # The CLI maps ValueError to exit code 2; ConfigError must stay one.
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "override, path",
    [
        ("eval.num_prompts=0", "$.eval"),  # crashes in the final evaluation, after training
        ("eval.k=0", "$.eval"),  # reports a meaningless pass@0
        ("eval.every=-1", "$.eval"),  # (step + 1) % -1 == 0: evaluates every step
        ("warmup.eval_prompts=0", "$.warmup"),  # a warm-start probe of no prompts crashes
        ("warmup.learning_rate=-0.1", "$.warmup"),  # gradient ascent on the demonstrations
        ("task.verifier_timeout_s=0", "$.task"),  # every verifier call times out: reward 0
    ],
)
def test_impossible_values_in_other_sections_are_rejected(override, path):
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, [override])
    assert f"`{path}`" in str(info.value)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_config_json_reads_back_to_an_equal_config(path):
    # A run's config.json is to_dict(cfg) as JSON; --resume and the report read it back.
    cfg = load_config(path)
    assert config_from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg


def test_an_old_run_config_with_plain_allocation_and_scenario_tables_loads():
    # Before the sections were typed, config.json held only what the user wrote in them.
    cfg = config_from_dict(
        {
            "policies": [{"name": "a"}],
            "scenario": "overlap",
            "allocation": {"call_timeout_s": 5.0, "inventory": {"nodes": 2}},
            "scenarios": {"overlap": {"peer_share": 0.25}},
        }
    )
    assert cfg.allocation.call_timeout_s == 5.0 and cfg.allocation.inventory.nodes == 2
    assert cfg.allocation.memory == AllocationConfig().memory
    assert cfg.scenarios.overlap.peer_share == 0.25 and cfg.scenarios.asymmetric.weak is None
    empty = config_from_dict({"policies": [{"name": "a"}], "allocation": {}, "scenarios": {}})
    assert (empty.allocation, empty.scenarios) == (AllocationConfig(), ScenariosConfig())


def test_the_config_package_imports_nothing_else_of_mutualrl():
    # The bottom layer: every other layer may import it, so it may import none of them.
    code = (
        "import sys, mutualrl.config; "
        "print(sorted(m for m in sys.modules if m.startswith('mutualrl.') "
        "and not m.startswith('mutualrl.config')))"
    )
    src = str(Path(mutualrl.__file__).resolve().parents[1])  # this tree's sources, not another
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": src},
    )
    assert out.stdout.strip() == "[]", out.stdout
