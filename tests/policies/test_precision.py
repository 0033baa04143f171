"""bf16 on a CPU without bf16 matrix instructions: a warning before training, naming the
policies."""

import warnings

import pytest
import torch

from mutualrl.config import PolicyConfig, load_config
from mutualrl.policies.precision import SlowPrecisionWarning, check_precision
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
