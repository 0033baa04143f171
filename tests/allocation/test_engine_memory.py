"""The plan counts a vLLM engine's memory: its gpu_memory_utilization share of a GPU."""

from __future__ import annotations

import pytest

from mutualrl.allocation import worker_specs_from_config
from mutualrl.allocation.specs import GIB
from mutualrl.config import ConfigError, config_from_dict


def _cfg(generation):
    return config_from_dict(
        {
            "policies": [{"name": "a"}, {"name": "b", "generation": generation}],
            "allocation": {
                "inventory": {
                    "nodes": 1,
                    "gpus_per_node": 2,
                    "gpu_memory_gb": 80,
                    "cpus_per_node": 16,
                    "host_memory_gb": 256,
                }
            },
        }
    )


def test_vllm_generator_reserves_its_share_of_the_gpu():
    cfg = _cfg({"backend": "vllm", "gpu_memory_utilization": 0.25})
    specs = {
        s.name: s
        for s in worker_specs_from_config(
            cfg, cfg.allocation, count_params=lambda p, v: 1000, vocab_size=lambda t: 10
        )
    }
    assert specs["b/generator"].memory_bytes == int(0.25 * 80 * GIB)
    assert specs["a/generator"].memory_bytes < GIB  # the torch sampler's estimate


@pytest.mark.parametrize(
    "generation,match",
    [
        ({"backend": "sglang"}, r"\$\.policies\[1\]\.generation\.backend"),
        (
            {"gpu_memory_utilization": 1.5},
            r"gpu_memory_utilization must be in \(0, 1\].*generation",
        ),
    ],
)
def test_bad_generation_settings_name_the_field(generation, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(generation)


@pytest.mark.parametrize(
    "grpo,match",
    [
        ({"top_p": 0}, r"top_p must be in \(0, 1\].*\$\.grpo"),
        ({"top_k": -1}, r"top_k must be >= 0.*\$\.grpo"),
        ({"generation_batch_size": 0}, r"generation_batch_size must be >= 1.*\$\.grpo"),
        ({"vllm_importance_sampling_mode": "sum"}, r"\$\.grpo\.vllm_importance_sampling_mode"),
    ],
)
def test_bad_sampling_settings_name_the_field(grpo, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"policies": [{"name": "a"}], "grpo": grpo})


def test_an_engine_share_too_small_for_the_weights_is_refused():
    cfg = _cfg({"backend": "vllm", "gpu_memory_utilization": 0.01})  # 0.8 GiB of 80
    with pytest.raises(
        ConfigError,
        match=r"\$\.policies\[1\]\.generation\.gpu_memory_utilization "
        r"reserves 0\.80 GiB.*3\.73 GiB of weights",
    ):
        worker_specs_from_config(
            cfg, cfg.allocation, count_params=lambda p, v: 10**9, vocab_size=lambda t: 10
        )


def test_an_engine_with_a_kv_cache_of_fixed_bytes_takes_its_weights_and_those_bytes():
    # vLLM's CPU build sizes its KV cache in bytes (kv_cache_memory_bytes); gpu_memory_utilization
    # is not read, so a share too small for the weights is no reason to refuse
    kv = 256 * 2**20
    cfg = _cfg({"backend": "vllm", "gpu_memory_utilization": 0.01, "kv_cache_memory_bytes": kv})
    specs = {
        s.name: s
        for s in worker_specs_from_config(
            cfg, cfg.allocation, count_params=lambda p, v: 10**9, vocab_size=lambda t: 10
        )
    }
    weights = 10**9 * cfg.allocation.memory.weight_bytes
    assert specs["b/generator"].memory_bytes == weights + kv
