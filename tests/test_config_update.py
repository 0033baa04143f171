"""The update engine's config fields: defaults keep the single pass; bad values name their path."""

import pytest

from mutualrl.config import ConfigError, config_from_dict

BASE = {"policies": [{"name": "a"}]}


def with_grpo(**grpo):
    return config_from_dict({**BASE, "grpo": grpo})


def test_defaults_are_the_single_pass_in_fp32_at_a_constant_rate():
    cfg = with_grpo()
    g = cfg.grpo
    assert (g.per_device_train_batch_size, g.gradient_accumulation_steps, g.logprob_chunk_size) == (None, 1, None)
    assert (g.gradient_checkpointing, g.lr_scheduler_type, g.warmup_ratio, g.weight_decay) == (False, "constant", 0.0, 0.01)
    assert cfg.policies[0].dtype == "fp32"


@pytest.mark.parametrize("field, value, path", [
    ("per_device_train_batch_size", 0, "$.grpo"),
    ("gradient_accumulation_steps", 0, "$.grpo"),
    ("logprob_chunk_size", 0, "$.grpo"),
    ("warmup_ratio", 1.0, "$.grpo"),
    ("weight_decay", -0.1, "$.grpo"),
    ("lr_scheduler_type", "step", "$.grpo.lr_scheduler_type"),
])
def test_bad_values_name_the_field(field, value, path):
    with pytest.raises(ConfigError, match=field if field != "lr_scheduler_type" else "Invalid enum value") as err:
        with_grpo(**{field: value})
    assert path in str(err.value)


def test_warmup_needs_a_schedule_with_warmup():
    with pytest.raises(ConfigError, match="constant_with_warmup"):
        with_grpo(warmup_ratio=0.1)
    assert with_grpo(warmup_ratio=0.1, lr_scheduler_type="cosine").grpo.warmup_ratio == 0.1


def test_policy_dtype_is_fp32_or_bf16():
    assert config_from_dict({"policies": [{"name": "a", "dtype": "bf16"}]}).policies[0].dtype == "bf16"
    with pytest.raises(ConfigError, match=r"\$\.policies\[0\]\.dtype"):
        config_from_dict({"policies": [{"name": "a", "dtype": "fp16"}]})
