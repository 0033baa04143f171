"""The real packaged models: verified, converted into ordinary folders, reused, rebuilt when
damaged, and loaded by name and by folder."""

from __future__ import annotations

import json
import time

import pytest
import torch

from mutualrl.config import PolicyConfig
from mutualrl.policies import model_cache
from mutualrl.policies.checkpoints import check_checkpoint
from mutualrl.policies.model_cache import ensure_folder, folder_problem, resolve_policies
from mutualrl.policies.packaged import PACKAGED_MODELS, locate, recorded_sha256

pytestmark = pytest.mark.real_models

# What the GGUF files hold (the measurements): family, vocabulary, parameters, template.
EXPECTED = {
    "smollm2-135m-instruct": ("llama", 49_152, 134_515_008, True),
    "gemma-3-270m": ("gemma3_text", 262_144, 268_098_176, False),
}


def test_the_recorded_digests_are_the_packages(converted):
    gemma = PACKAGED_MODELS.get("gemma-3-270m")
    assert recorded_sha256(gemma, locate(gemma)) == (
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    )
    assert len(locate(gemma)) == 4


@pytest.mark.parametrize("name", list(EXPECTED))
def test_converted_into_an_ordinary_folder(converted, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _ = converted[name]
    model_type, vocab, params, template = EXPECTED[name]
    assert folder_problem(folder) is None
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"]) == (
        model_type,
        vocab,
        True,
    )
    assert (folder / "model.safetensors").is_file()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print(f"\n{name}: loaded from the folder in {time.perf_counter() - t0:.1f}s")
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(tokenizer) == vocab
    assert bool(tokenizer.chat_template) == template
    if template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert "<|im_start|>user\nhi<|im_end|>" in text


def test_a_second_request_reuses_the_cache(converted, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("an intact cache folder was rebuilt")

    monkeypatch.setattr(model_cache, "_build", no_build)
    for name, (folder, _) in converted.items():
        assert ensure_folder(name) == folder


def test_names_resolve_to_their_folders_with_their_own_tokenizers(converted):
    policies = [
        PolicyConfig(name="smol", checkpoint="smollm2-135m-instruct"),
        PolicyConfig(name="gemma", checkpoint="gemma-3-270m"),
    ]
    smol, gemma = resolve_policies(policies)
    for p, name in ((smol, "smollm2-135m-instruct"), (gemma, "gemma-3-270m")):
        folder = str(converted[name][0])
        assert (p.checkpoint, p.tokenizer) == (folder, folder)
        assert check_checkpoint(p)["model_type"] == EXPECTED[name][0]  # gemma3_text accepted


def test_a_corrupt_cache_is_rebuilt_not_loaded(converted):
    """The smaller model: one flipped byte in its weights is found and the folder rebuilt."""
    name = "smollm2-135m-instruct"
    folder, _ = converted[name]
    weights = folder / "model.safetensors"
    with weights.open("r+b") as f:
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "model.safetensors does not match" in folder_problem(folder)
    t0 = time.perf_counter()
    assert ensure_folder(name) == folder
    print(f"\n{name}: rebuilt in {time.perf_counter() - t0:.1f}s")
    assert folder_problem(folder) is None
