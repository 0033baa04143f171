"""bf16 on a CPU without bf16 matrix instructions: a warning before training, naming the
policies."""

import json
import warnings

import msgspec
import pytest
import torch

from mutualrl.config import PolicyConfig, load_config
from mutualrl.policies.precision import (
    BF16_MIN_WIDTH,
    SlowPrecisionWarning,
    check_precision,
    compute_dtype,
)
from mutualrl.run.build import prepare
from tests.test_paced import TINY


def policies(*dtypes: str) -> list[PolicyConfig]:
    return [
        PolicyConfig(name=f"p{i}", architecture="llama", tokenizer="mistral-v1", dtype=d)
        for i, d in enumerate(dtypes)
    ]


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


def said(policies: list[PolicyConfig], device: str) -> list[str]:
    """The SlowPrecisionWarning messages ``check_precision`` gives (every other warning too)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_precision(policies, device)
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_bf16_policies_on_a_cpu_that_emulates_bf16_are_named(cpu_without_bf16):
    [message] = said(policies("fp32", "bf16", "bf16"), "cpu")
    assert message.startswith("SlowPrecisionWarning: policies ['p1', 'p2']: ")
    assert 'set dtype = "fp32"' in message


@pytest.mark.parametrize(
    "dtypes, device", [(("fp32", "fp32"), "cpu"), (("bf16",), "cuda"), (("bf16",), "cuda:1")]
)
def test_no_warning_for_fp32_or_a_gpu(cpu_without_bf16, dtypes, device):
    assert said(policies(*dtypes), device) == []


def test_no_warning_where_the_cpu_multiplies_bf16(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert said(policies("bf16"), "cpu") == []


def test_a_run_warns_before_it_writes_anything(cpu_without_bf16, tmp_path):
    cfg = load_config(TINY, [f'output_dir="{tmp_path / "run"}"', 'policies.0.dtype="bf16"'])
    with pytest.warns(SlowPrecisionWarning, match="llama-mistral"):
        prepare(cfg)
    assert not (tmp_path / "run").exists()


# ---- dtype = "auto" ---------------------------------------------------------------------------
@pytest.fixture
def cpu_with_bf16(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)


def auto(hidden: int) -> PolicyConfig:
    return PolicyConfig(name="p", tokenizer="mistral-v1", hidden_size=hidden, num_heads=4)


def test_auto_is_the_default():
    assert PolicyConfig(name="p").dtype == "auto"


def test_auto_chooses_bf16_for_a_wide_model_where_the_cpu_multiplies_bf16(cpu_with_bf16):
    assert compute_dtype(auto(BF16_MIN_WIDTH), "cpu") == "bf16"
    assert compute_dtype(auto(64), "cpu") == "fp32"  # the embedded default's width: no gain


def test_auto_never_chooses_bf16_on_a_cpu_that_emulates_it(cpu_without_bf16):
    assert compute_dtype(auto(1024), "cpu") == "fp32"


def test_an_explicit_dtype_is_kept(cpu_without_bf16):
    p = msgspec.structs.replace(auto(1024), dtype="bf16")
    assert compute_dtype(p, "cpu") == "bf16"


def test_auto_reads_a_checkpoints_width_from_its_config(cpu_with_bf16, tmp_path):
    from transformers import LlamaConfig

    for width, want in ((64, "fp32"), (512, "bf16")):
        folder = tmp_path / str(width)
        LlamaConfig(hidden_size=width, num_attention_heads=4).save_pretrained(folder)
        p = PolicyConfig(name="p", tokenizer="mistral-v1", checkpoint=str(folder))
        assert compute_dtype(p, "cpu") == want


def test_the_run_folder_says_which_precision_was_chosen(cpu_with_bf16, tmp_path):
    from tests.test_paced import run_tiny

    out = tmp_path / "run"
    run_tiny(out, "steps=1", "policies.1.hidden_size=256", "policies.1.num_heads=4")
    saved = json.loads((out / "config.json").read_text())
    assert [p["dtype"] for p in saved["policies"]] == ["fp32", "bf16"]
    plan = json.loads((out / "plan.json").read_text())
    assert any("compute precision" in n and "bf16" in n for n in plan["notes"])
