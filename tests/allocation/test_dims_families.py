"""Checkpoints of families that name their dims otherwise (GPT-2's n_layer, OPT's ffn_dim, ...):
the planner reads them through transformers' config classes, and such a folder trains."""

from __future__ import annotations

import json

import pytest
import torch

from mutualrl.allocation.dims import dims_from_config_json, resolve_dims
from mutualrl.config import AllocationConfig, ConfigError, PolicyConfig

VOCAB = 32000  # the mistral-v1 tokenizer's


def _configs():
    from transformers import GPT2Config, GPTNeoXConfig, OPTConfig, PhiConfig

    w = 64
    return {
        "gpt2": (GPT2Config(vocab_size=VOCAB, n_embd=w, n_layer=2, n_head=4), 4 * w),
        "gpt_neox": (
            GPTNeoXConfig(
                vocab_size=VOCAB,
                hidden_size=w,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
            ),
            128,
        ),
        "opt": (
            OPTConfig(
                vocab_size=VOCAB,
                hidden_size=w,
                word_embed_proj_dim=w,
                num_hidden_layers=2,
                num_attention_heads=4,
                ffn_dim=96,
            ),
            96,
        ),
        "phi": (
            PhiConfig(
                vocab_size=VOCAB,
                hidden_size=w,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=160,
            ),
            160,
        ),
    }


@pytest.fixture(scope="module")
def folders(module_tmp):
    from transformers import AutoModelForCausalLM

    out = {}
    for name, (config, mlp) in _configs().items():
        torch.manual_seed(0)
        folder = module_tmp(name)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        out[name] = (folder, mlp)
    return out


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "opt", "phi"])
def test_the_planner_reads_each_familys_dims(folders, family):
    folder, mlp = folders[family]
    p = PolicyConfig(name="p", tokenizer="mistral-v1", checkpoint=str(folder))
    d = resolve_dims(p, AllocationConfig(), lambda _: VOCAB)
    assert (d.layers, d.hidden, d.kv_width, d.intermediate, d.vocab) == (2, 64, 64, mlp, VOCAB)


def test_a_config_without_dims_is_one_line():
    with pytest.raises(ConfigError) as err:
        dims_from_config_json({"model_type": "no-such-family"}, "policies.p.checkpoint")
    assert "lacks the dims a memory estimate needs" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "opt", "phi"])
def test_each_family_trains_two_steps(folders, family, tmp_path):
    from tests.test_paced import run_tiny

    folder, _ = folders[family]
    out = tmp_path / "run"
    summary = run_tiny(
        out,
        "steps=2",
        f'policies.0.checkpoint="{folder}"',
        'policies.0.tokenizer="mistral-v1"',
    )
    assert summary is not None
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # both GRPO steps updated the family's policy: a finite loss logged at each
    losses = {
        r["step"]: r["policy/llama-mistral/loss"] for r in rows if "policy/llama-mistral/loss" in r
    }
    assert sorted(losses) == [0, 1]
    assert all(v == v for v in losses.values())
