"""The warm start: policies warm up together, independently of each other, and a cache lets runs
share one warm start and continue exactly as if each had warmed up itself."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from mutualrl.config import load_config
from mutualrl.run import train
from mutualrl.run.metrics import read_metrics
from mutualrl.run.warmup import cache_key
from mutualrl.workers.calls import WorkerFailedError

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
TIMING = ("time_s", "tokens_per_s", "step_time_s")
pytestmark = pytest.mark.usefixtures("fast_run_builds")


def config(out: Path, *overrides: str):
    return load_config(TINY, [f'output_dir="{out}"', "torch_threads=1", *overrides])


def records(out: Path, *phases: str) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.endswith(TIMING)}
        for r in read_metrics(out / "metrics.jsonl")
        if r["phase"] in phases
    ]


def test_a_cached_warm_start_continues_exactly(tmp_path):
    cache = f'warmup.cache_dir="{tmp_path / "cache"}"'
    train(config(tmp_path / "plain"))
    train(config(tmp_path / "stores", cache))
    train(config(tmp_path / "loads", cache))
    train(config(tmp_path / "loads-prp", cache, 'strategy="prp"'))
    entries = [p for p in (tmp_path / "cache").iterdir()]
    assert len(entries) == 1 and not entries[0].name.startswith(".")  # one key, no leftovers
    assert sorted(p.name for p in entries[0].iterdir()) == [
        "key.json",
        "llama-mistral.pt",
        "metrics.jsonl",
        "qwen-deepseek.pt",
    ]
    hits = {
        name: [r["hit"] for r in records(tmp_path / name, "warmup_cache")]
        for name in ("plain", "stores", "loads", "loads-prp")
    }
    assert hits == {"plain": [], "stores": [False], "loads": [True], "loads-prp": [True]}
    warm = records(tmp_path / "plain", "warmup", "warmup_done")
    assert [r["phase"] for r in warm].count("warmup_done") == 2
    for name in ("stores", "loads", "loads-prp"):
        assert records(tmp_path / name, "warmup", "warmup_done") == warm
    after = records(tmp_path / "plain", "train", "eval")
    assert records(tmp_path / "loads", "train", "eval") == after  # bit for bit, every metric
    assert records(tmp_path / "stores", "train", "eval") == after


def test_the_key_ignores_what_only_later_phases_read(tmp_path):
    base, _ = cache_key(config(tmp_path))
    for same in (
        'strategy="sgt"',
        "steps=7",
        "eval.k=3",
        'output_dir="elsewhere"',
        "exchange.log=false",
        "strategies.sgt.interval=2",
        'warmup.cache_dir="x"',
    ):
        assert cache_key(config(tmp_path, same))[0] == base, same
    for other in (
        "seed=1",
        "warmup.learning_rate=0.01",
        "warmup.max_steps=4",
        "policies.0.hidden_size=16",
        "training.max_grad_norm=0.5",
        'task.families=["first"]',
    ):
        assert cache_key(config(tmp_path, other))[0] != base, other


def test_one_policys_warm_start_does_not_depend_on_the_others(tmp_path):
    both = config(tmp_path / "both", "steps=0", "eval.num_prompts=1")
    alone = msgspec.structs.replace(
        config(tmp_path / "alone", "steps=0", "eval.num_prompts=1"), policies=both.policies[:1]
    )
    train(both)
    train(alone)
    name = both.policies[0].name
    mine = [r for r in records(tmp_path / "both", "warmup", "warmup_done") if r["policy"] == name]
    assert mine and mine == records(tmp_path / "alone", "warmup", "warmup_done")


def test_a_damaged_cache_entry_is_reported_by_file(tmp_path):
    cache = f'warmup.cache_dir="{tmp_path / "cache"}"'
    train(config(tmp_path / "stores", cache, "steps=0"))
    [entry] = (tmp_path / "cache").iterdir()
    (entry / "qwen-deepseek.pt").write_bytes(b"not a state")
    with pytest.raises(WorkerFailedError, match=r"qwen-deepseek\.pt: not a policy state file"):
        train(config(tmp_path / "loads", cache, "steps=0"))
    assert json.loads((entry / "key.json").read_text())["seed"] == 0  # the entry is left to inspect
