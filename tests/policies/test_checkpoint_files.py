"""A checkpoint folder that cannot be read is one line per cause, before the run folder exists.

Each case is the real failure on a real (tiny, random) save_pretrained folder: a safetensors file
really cut short, the weights removed, the tokenizer removed, and a pytorch_model.bin whose
pickle really calls os.system (a marker file proves it never ran).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mutualrl.config import ConfigError, PolicyConfig
from mutualrl.policies.checkpoints import check_checkpoints

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(module_tmp) -> Path:
    """A tiny random Llama on Mistral's 32k tokenizer, as save_pretrained writes it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mutualrl.retokenize.loaders import load_tokenizer

    tok = load_tokenizer("mistral-v1").tokenizer
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
    )
    out = module_tmp("ckpt") / "good"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _copy(saved: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    return folder


def _policy(folder: Path) -> PolicyConfig:
    return PolicyConfig(name="p", checkpoint=str(folder), tokenizer=str(folder))


class _Hostile:
    """Unpickling calls os.system: what a hostile pytorch_model.bin does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile(folder: Path, marker: Path) -> None:
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _Hostile(marker)}, folder / "pytorch_model.bin")


def test_a_whole_folder_passes(saved):
    assert check_checkpoints([_policy(saved)])["p"]["model_type"] == "llama"


def test_a_truncated_safetensors_file_is_named(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ConfigError) as caught:
        check_checkpoints([_policy(folder)])
    assert str(caught.value) == (
        f"policies.p.checkpoint: {weights} is truncated or corrupt (safetensors: Error while "
        "deserializing header: incomplete metadata, file not fully covered); copy it again "
        "from where it came from"
    )


def test_no_weights_is_named(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"^policies.p.checkpoint: .*ckpt has no weights "):
        check_checkpoints([_policy(folder)])


def test_no_tokenizer_is_named_on_the_tokenizer_field(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    for f in folder.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ConfigError, match=r"^policies.p.tokenizer: .*ckpt has no tokenizer files"):
        check_checkpoints([_policy(folder)])
    # a tokenizer given elsewhere needs none in the folder
    other = PolicyConfig(name="p", checkpoint=str(folder), tokenizer="mistral-v1")
    assert "p" in check_checkpoints([other])


def test_a_hostile_pickle_is_refused_and_never_runs(saved, tmp_path):
    folder, marker = _copy(saved, tmp_path), tmp_path / "ran"
    _hostile(folder, marker)
    with pytest.raises(ConfigError) as caught:
        check_checkpoints([_policy(folder)])
    assert str(caught.value).startswith(
        f"policies.p.checkpoint: {folder / 'pytorch_model.bin'} holds pickled code, refused by "
        "torch's weights-only loader (it calls posix.system); nothing of it was run; use "
        "weights saved as safetensors"
    )
    assert not marker.exists()


@pytest.mark.parametrize(
    "edit, says",
    [
        (
            {"intermediate_size": 48},
            r"3 tensor\(s\) of another shape than config.json builds "
            r"\(model.layers.0.mlp.down_proj.weight: 16 x 32 in the weights, "
            r"16 x 48 by the config\)",
        ),
        (
            {"num_hidden_layers": 2},
            r"9 tensor\(s\) the config builds are not in the weights \(model.layers.1.",
        ),
    ],
    ids=["shape", "missing"],
)
def test_weights_that_do_not_fit_their_config_are_named(saved, tmp_path, edit, says):
    """config.json edited after the weights were saved: transformers would refuse the first (a
    size mismatch deep in its load) and initialise the second layer at random with a warning."""
    import json

    folder = _copy(saved, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(
        ConfigError,
        match=r"^policies.p.checkpoint: the weights of .*ckpt do not "
        r"fit its config.json: " + says,
    ):
        check_checkpoints([_policy(folder)])


@pytest.mark.parametrize("command", ["train", "plan"])
def test_train_and_plan_refuse_a_hostile_folder_in_one_line_before_writing(
    saved, tmp_path, command
):
    """``mutualrl plan`` runs train's input checks: the same line, and nothing written."""
    folder, marker = _copy(saved, tmp_path), tmp_path / "ran"
    _hostile(folder, marker)
    config = (ROOT / "configs" / "tiny.toml").read_text()
    config = config.replace('architecture = "llama"', f'checkpoint = "{folder}"', 1)
    config = config.replace('tokenizer = "mistral-v1"', f'tokenizer = "{folder}"', 1)
    (tmp_path / "run.toml").write_text(config)
    out = tmp_path / "run"
    more = ["--output-dir", str(out), "--no-progress"] if command == "train" else []
    done = subprocess.run(
        [sys.executable, "-m", "mutualrl.cli", command, "--config", str(tmp_path / "run.toml")]
        + more,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "holds pickled code" in done.stderr and done.stdout == ""
    assert not out.exists() and not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "run.toml"]


def test_a_folder_under_another_naming_refuses_tensors_its_config_builds_and_the_file_lacks(
    tmp_path,
):
    """GPT-NeoX saves its head as ``embed_out`` (transformers maps it on load): a layer the
    config builds and the file lacks is refused before the run (a load onto the meta device) and
    at the worker's load, rather than initialised at random."""
    import json

    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    from mutualrl.policies.models import build_model

    cfg = GPTNeoXConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32,
    )  # fmt: skip
    folder = tmp_path / "neox"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    p = PolicyConfig(name="p", checkpoint=str(folder), tokenizer="mistral-v1")
    assert build_model(p, None, 0) is not None  # type: ignore[arg-type]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match=r"^policies.p.checkpoint: the weights of .*neox do not "
                       r"fit its config.json: \d+ tensor\(s\) the config builds are not in the "
                       r"weights \(gpt_neox.layers.1."):  # fmt: skip
        check_checkpoints([p])  # names transformers maps: judged by its load onto meta
    with pytest.raises(ConfigError, match=r"^policies.p.checkpoint: the weights of .*neox do not "
                       r"fit its config.json: \d+ tensor\(s\) the config builds are not in the "
                       r"weights \(gpt_neox.layers.1."):  # fmt: skip
        build_model(p, None, 0)  # type: ignore[arg-type]
