"""The memory model against hand computation: activations, GQA KV cache, dims from config.json."""

from __future__ import annotations

import json

import pytest

from mutualrl.allocation.dims import Dims, dims_from_config_json, dims_from_hint, resolve_dims
from mutualrl.allocation.specs import activation_bytes, kv_cache_bytes, worker_specs_from_config
from mutualrl.config import (
    AllocationConfig,
    ArchitectureDims,
    ConfigError,
    MemoryModel,
    PolicyConfig,
    config_from_dict,
)

# Qwen2.5-1.5B-Instruct's config.json (published): 28 layers, hidden 1536, 12 heads, 2 KV heads.
QWEN15 = {
    "model_type": "qwen2",
    "num_hidden_layers": 28,
    "hidden_size": 1536,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
}


def test_dims_from_config_json_use_grouped_query_heads():
    d = dims_from_config_json(QWEN15, "x")
    assert d == Dims(layers=28, hidden=1536, kv_width=2 * 128, intermediate=8960, vocab=151936)
    with pytest.raises(ConfigError, match="x: config.json lacks the dims"):
        dims_from_config_json({"hidden_size": 8}, "x")


def test_kv_cache_by_hand():
    d = dims_from_config_json(QWEN15, "x")
    bf16 = MemoryModel(weight_bytes=2)
    # 2 (K,V) x 28 layers x 256 x 2 bytes = 28,672 bytes per token
    assert kv_cache_bytes(d.layers, d.kv_width, 1000, bf16) == 28_672 * 1000
    # without GQA (12 KV heads) it is six times that
    assert kv_cache_bytes(d.layers, d.hidden, 1000, bf16) == 6 * 28_672 * 1000


def test_activations_by_hand():
    d = Dims(layers=2, hidden=10, kv_width=4, intermediate=40, vocab=100)
    per_layer = 6 * 10 + 2 * 4 + 4 * 40  # 228 values per token and layer
    logits = 3 * 5 * 100 * 8  # rows x completion x vocab x fp32 (2 tensors)
    assert (
        activation_bytes(d, rows=3, seq_len=7, completion_len=5, act_bytes=2, checkpointing=False)
        == 3 * 7 * 2 * (2 * per_layer) + logits
    )
    assert (
        activation_bytes(d, rows=3, seq_len=7, completion_len=5, act_bytes=2, checkpointing=True)
        == 3 * 7 * 2 * (2 * 10 + per_layer) + logits
    )


def test_qwen15_learner_estimate_by_hand():
    """bf16 weights+grads, fp32 Adam + master (12 B), 4 rows x 768 tokens, checkpointing."""
    d = dims_from_config_json(QWEN15, "x")
    act = activation_bytes(
        d, rows=4, seq_len=768, completion_len=512, act_bytes=2, checkpointing=True
    )
    per_layer = 6 * 1536 + 2 * 256 + 4 * 8960  # 45,568
    want = 4 * 768 * 2 * (28 * 1536 + per_layer) + 4 * 512 * 151936 * 8
    assert act == want == 544_210_944 + 2_489_319_424


def test_resolve_dims_order(tmp_path):
    alloc = AllocationConfig(
        architectures={
            "p": ArchitectureDims(
                num_hidden_layers=3, hidden_size=8, num_attention_heads=2, vocab_size=50
            )
        }
    )
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN15))
    # a checkpoint on this machine wins over the table
    assert resolve_dims(PolicyConfig(name="p", checkpoint=str(folder)), alloc, None).layers == 28
    # not here: the table
    assert resolve_dims(
        PolicyConfig(name="p", checkpoint="/none/x"), alloc, None
    ) == dims_from_hint(
        ArchitectureDims(num_hidden_layers=3, hidden_size=8, num_attention_heads=2, vocab_size=50)
    )
    # neither: an error naming the table to fill
    with pytest.raises(
        ConfigError, match="allocation.architectures.q: checkpoint '/none/x' is not on"
    ):
        resolve_dims(PolicyConfig(name="q", checkpoint="/none/x"), alloc, None)
    # a random model: its own config, no GQA
    assert resolve_dims(
        PolicyConfig(name="r", hidden_size=16, num_heads=4), alloc, lambda t: 7
    ) == Dims(2, 16, 16, 64, 7)


def test_missing_parameter_count_names_the_field():
    cfg = config_from_dict(
        {
            "policies": [{"name": "p", "checkpoint": "/none/x"}],
            "allocation": {
                "architectures": {
                    "p": {
                        "num_hidden_layers": 3,
                        "hidden_size": 8,
                        "num_attention_heads": 2,
                        "vocab_size": 50,
                    }
                }
            },
        }
    )
    with pytest.raises(ConfigError, match="allocation.num_parameters.p: checkpoint '/none/x'"):
        worker_specs_from_config(cfg, vocab_size=lambda t: 50)


@pytest.mark.parametrize("name", ["gpu1-qwen-llama-1b.toml", "gpu8-four-policies.toml"])
def test_real_model_configs_plan_feasibly(name):
    from pathlib import Path

    from mutualrl.allocation import plan
    from mutualrl.allocation.specs import inventory_from_config
    from mutualrl.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    alloc = cfg.allocation
    specs = worker_specs_from_config(
        cfg, alloc, vocab_size=lambda t: pytest.fail("no tokenizer load")
    )
    p = plan(specs, inventory_from_config(alloc.inventory), alloc.memory.usable_memory_fraction)
    assert p.mode == "gpu"
    assert all(a.gpus for a in p.assignments if a.role != "verifier")
    # the 1-GPU config: both policies' learners and generators share the one GPU
    if name.startswith("gpu1"):
        total = sum(s.memory_bytes for s in specs)
        assert total <= 0.9 * 80 * 1024**3
