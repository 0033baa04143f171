"""The training loop end to end on configs/tiny.toml: metrics, summary, saved policies, seeding."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mutualrl.config import ConfigError, load_config
from mutualrl.run import train
from mutualrl.run.metrics import read_metrics

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
POLICIES = ("llama-mistral", "qwen-deepseek")
PER_POLICY = (
    "reward/mean",
    "frac_reward_zero_std",
    "kl",
    "clip_ratio_low",
    "entropy",
    "completion_length",
    "tokens_per_s",
    "step_time_s",
)
TIMING = ("time_s", "tokens_per_s", "step_time_s")


def run_tiny(out: Path, *overrides: str):
    return train(load_config(TINY, [f'output_dir="{out}"', *overrides]))


@pytest.fixture(scope="module")
def tiny_run(module_tmp, fast_run_builds_module):
    out = module_tmp("tiny") / "run"
    return out, run_tiny(out)


def train_records(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]


def untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith(TIMING)}


def test_tiny_run_writes_metrics_for_both_policies(tiny_run):
    out, _ = tiny_run
    records = train_records(out)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        for name in POLICIES:
            for key in PER_POLICY:
                value = r[f"policy/{name}/{key}"]
                assert isinstance(value, (int, float)) and math.isfinite(value), (name, key, value)
            assert 0 <= r[f"policy/{name}/reward/mean"] <= 1
            assert 0 <= r[f"policy/{name}/frac_reward_zero_std"] <= 1
            assert 1 <= r[f"policy/{name}/completion_length"] <= 4
            assert r[f"policy/{name}/entropy"] > 0
            assert r[f"policy/{name}/kl"] == 0.0  # beta 0: no reference
        assert r["verifier/errors"] == 0 and r["verifier/timeouts"] == 0
        steps = [
            r[f"phase/{p}_time_s"] for p in ("generate", "verify", "publish", "strategy", "update")
        ]
        assert all(t >= 0 for t in steps) and sum(steps) <= r["time_s"]
    phases = [r["phase"] for r in read_metrics(out / "metrics.jsonl")]
    assert phases.count("warmup_done") == 2  # the warm start is part of the run
    assert phases[-1] == "eval"  # eval every 0: only at the end


def test_tiny_run_writes_summary_config_and_policies(tiny_run):
    out, summary = tiny_run
    data = json.loads((out / "summary.json").read_text())
    assert data["output_dir"] == str(out) == summary.output_dir
    assert set(data["reward_first"]) == set(data["reward_last"]) == set(POLICIES)
    for name in POLICIES:
        assert f"policy/{name}/heldout/pass@1" in data["final_eval"]
        assert f"policy/{name}/heldout/first/pass@2" in data["final_eval"]  # k = 2
        saved = out / "policies" / name
        assert (saved / "config.json").is_file() and (saved / "tokenizer.json").is_file()
        assert any(saved.glob("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert config["output_dir"] == str(out) and config["steps"] == 2


def test_same_seed_same_metrics(tiny_run, tmp_path, fast_run_builds):
    first, _ = tiny_run
    run_tiny(tmp_path / "again")
    a, b = train_records(first), train_records(tmp_path / "again")
    assert [untimed(r) for r in a] == [untimed(r) for r in b]
    for name in POLICIES:  # sampled quantities, not only all-zero rewards, were compared
        assert f"policy/{name}/entropy" in untimed(a[0])
        assert f"policy/{name}/loss" in untimed(a[0])


def test_unknown_strategy_fails_before_anything_is_written(tmp_path):
    out = tmp_path / "never"
    cfg = load_config(TINY, [f'output_dir="{out}"', 'strategy="bogus"'])
    with pytest.raises(ConfigError) as info:
        train(cfg)
    text = str(info.value)
    assert "bogus" in text and "known:" in text and "none" in text
    assert not out.exists()


def test_bad_warmup_family_fails_before_training(tmp_path):
    out = tmp_path / "never"
    cfg = load_config(TINY, [f'output_dir="{out}"', 'policies.0.warmup_families=["third"]'])
    with pytest.raises(ValueError, match="warmup_families"):
        train(cfg)
    assert not out.exists()


def test_tiny_run_on_the_lookup_task_evaluates_each_family(tmp_path, fast_run_builds):
    out = tmp_path / "lookup"
    run_tiny(
        out,
        'task.name="lookup"',
        'task.families=["alpha", "beta"]',
        "task.num_keys=2",
        'policies.0.warmup_families=["alpha"]',
        'policies.1.warmup_families=["beta"]',
        'strategy="sgt"',
    )
    final = read_metrics(out / "metrics.jsonl")[-1]
    for name in POLICIES:
        for family in ("alpha", "beta"):
            assert 0 <= final[f"policy/{name}/heldout/{family}/pass@1"] <= 1


def test_a_run_that_retokenizes_reports_each_receivers_encoding_cache(tmp_path, fast_run_builds):
    out = tmp_path / "prp"
    summary = run_tiny(out, 'strategy="prp"')  # each peer rollout retokenized for each receiver
    cache = json.loads((out / "summary.json").read_text())["retokenize_cache"]
    assert cache == summary.retokenize_cache and set(cache) == set(POLICIES)
    assert all(c["lookups"] > 0 and 0 <= c["hits"] <= c["lookups"] for c in cache.values())


def test_a_run_that_retokenizes_nothing_reports_an_unused_cache(tiny_run):
    out, summary = tiny_run  # strategy none
    assert summary.retokenize_cache == {n: {"lookups": 0, "hits": 0} for n in POLICIES}
    assert (
        json.loads((out / "summary.json").read_text())["retokenize_cache"]
        == summary.retokenize_cache
    )


def test_a_prompt_prefix_changes_its_policys_prompt_alone(tmp_path, fast_run_builds):
    """policies.*.prompt_prefix (few-shot examples): the policy samples from the prefix and the
    question, its peer from the question alone, while the experience both publish names the
    task's question under the same ids."""
    from mutualrl.exchange import read_log
    from mutualrl.exchange.records import Rollout
    from mutualrl.run.build import build_run
    from mutualrl.run.phases import generate, sample_prompts

    shots = "Examples first. "
    cfg = load_config(
        TINY, [f'output_dir="{tmp_path / "built"}"', f'policies.0.prompt_prefix="{shots}"']
    )
    run = build_run(cfg)
    try:
        samples, _ = generate(run, sample_prompts(run, 0))
        for name, ss in samples.items():
            tok = run.policies[name].tokenizer
            for s in ss:
                text = (shots if name == POLICIES[0] else "") + s.prompt.text
                ids = tok(text, add_special_tokens=False)["input_ids"]
                assert s.prompt_ids == (tok.bos_token_id, *ids), name
    finally:
        run.close()

    out = tmp_path / "prefixed"
    run_tiny(out, 'strategy="prp"', f'policies.0.prompt_prefix="{shots}"', "steps=1")
    rollouts = [d.record for d in read_log(out) if isinstance(d.record, Rollout)]
    by_producer: dict[str, set] = {}
    for r in rollouts:
        assert not r.prompt.startswith(shots)
        by_producer.setdefault(r.producer, set()).add((r.prompt_id, r.prompt))
    assert set(by_producer) == set(POLICIES)
    # the same questions under the same ids from both: peers find each other's groups
    assert by_producer[POLICIES[0]] == by_producer[POLICIES[1]]
    config = json.loads((out / "config.json").read_text())
    assert [p["prompt_prefix"] for p in config["policies"]] == [shots, ""]
