"""The update engine's config fields: defaults keep the single pass; bad values name their path."""

import pytest

from mutualrl.config import ConfigError, config_from_dict
from mutualrl.config.load import ConfigPathMoved

BASE = {"policies": [{"name": "a"}]}


def with_training(**training):
    return config_from_dict({**BASE, "training": training})


def test_defaults_are_the_single_pass_in_fp32_at_a_constant_rate():
    cfg = with_training()
    g = cfg.training
    assert (g.per_device_train_batch_size, g.gradient_accumulation_steps, g.logprob_chunk_size) == (
        None,
        1,
        None,
    )
    assert (g.gradient_checkpointing, g.lr_scheduler_type, g.warmup_ratio, g.weight_decay) == (
        False,
        "constant",
        0.0,
        0.01,
    )
    assert cfg.policies[0].dtype == "auto"  # resolved by the run (policies.precision)


@pytest.mark.parametrize(
    "field, value, path",
    [
        ("per_device_train_batch_size", 0, "$.training"),
        ("gradient_accumulation_steps", 0, "$.training"),
        ("logprob_chunk_size", 0, "$.training"),
        ("warmup_ratio", 1.0, "$.training"),
        ("weight_decay", -0.1, "$.training"),
        ("lr_scheduler_type", "step", "$.training.lr_scheduler_type"),
    ],
)
def test_bad_values_name_the_field(field, value, path):
    with pytest.raises(
        ConfigError, match=field if field != "lr_scheduler_type" else "Invalid enum value"
    ) as err:
        with_training(**{field: value})
    assert path in str(err.value)


def test_warmup_needs_a_schedule_with_warmup():
    with pytest.raises(ConfigError, match="constant_with_warmup"):
        with_training(warmup_ratio=0.1)
    assert with_training(warmup_ratio=0.1, lr_scheduler_type="cosine").training.warmup_ratio == 0.1


def test_policy_dtype_is_fp32_or_bf16():
    assert (
        config_from_dict({"policies": [{"name": "a", "dtype": "bf16"}]}).policies[0].dtype == "bf16"
    )
    with pytest.raises(ConfigError, match=r"\$\.policies\[0\]\.dtype"):
        config_from_dict({"policies": [{"name": "a", "dtype": "fp16"}]})


def test_moved_paths_keep_working_with_a_warning_naming_the_new_one():
    with pytest.warns(
        ConfigPathMoved,
        match=r"grpo.per_device_train_batch_size is now "
        r"training.per_device_train_batch_size",
    ):
        cfg = config_from_dict({**BASE, "grpo": {"per_device_train_batch_size": 4, "beta": 0.1}})
    assert cfg.training.per_device_train_batch_size == 4 and cfg.grpo.beta == 0.1


def test_a_moved_path_set_twice_is_refused_naming_both():
    with pytest.raises(
        ConfigError, match="grpo.weight_decay and training.weight_decay are both set"
    ):
        config_from_dict({**BASE, "grpo": {"weight_decay": 0.1}, "training": {"weight_decay": 0.2}})


def test_a_key_renamed_within_its_table_keeps_working_with_a_warning():
    # TRL renamed vllm_importance_sampling_cap to vllm_importance_sampling_clip_max
    with pytest.warns(
        ConfigPathMoved,
        match=r"grpo.vllm_importance_sampling_cap is now "
        r"grpo.vllm_importance_sampling_clip_max",
    ):
        cfg = config_from_dict({**BASE, "grpo": {"vllm_importance_sampling_cap": 2.5, "beta": 0.1}})
    assert cfg.grpo.vllm_importance_sampling_clip_max == 2.5 and cfg.grpo.beta == 0.1
    with pytest.raises(
        ConfigError,
        match="grpo.vllm_importance_sampling_cap and "
        "grpo.vllm_importance_sampling_clip_max are both set",
    ):
        config_from_dict(
            {
                **BASE,
                "grpo": {
                    "vllm_importance_sampling_cap": 2.5,
                    "vllm_importance_sampling_clip_max": 2.0,
                },
            }
        )


@pytest.mark.parametrize(
    "grpo,message",
    [
        ({"vllm_importance_sampling_clip_max": 0.5}, "clip_max must be >= 1"),
        ({"vllm_importance_sampling_clip_min": 1.5}, r"clip_min must be in \[0, 1\]"),
        (
            {"vllm_importance_sampling_clip_min": 1.0, "vllm_importance_sampling_clip_max": 1.0},
            "clip_min must be below",
        ),
        (
            {
                "vllm_importance_sampling_mode": "token_truncate",
                "vllm_importance_sampling_clip_max": None,
            },
            "needs vllm_importance_sampling_clip_max or _clip_min",
        ),
    ],
)
def test_sampler_correction_bounds_are_checked(grpo, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**BASE, "grpo": grpo})


def test_the_chunked_head_refuses_truncated_sampling_naming_both_sections():
    with pytest.raises(ConfigError, match="training.logprob_chunk_size.*grpo.top_k"):
        config_from_dict({**BASE, "grpo": {"top_k": 5}, "training": {"logprob_chunk_size": 8}})
