"""Real architectures at tiny width through the whole loop: Qwen2 and Llama checkpoint folders
(hidden 64, grouped-query attention) with their families' chat templates, on the GSM8K-style
sample shipped in examples/data, with a weighted format reward; and the bad inputs that must fail
before training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mutualrl.allocation import PlanError
from mutualrl.config import ConfigError, config_from_dict
from mutualrl.retokenize.loaders import load_tokenizer
from mutualrl.run import train
from mutualrl.tasks import TaskError

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
SAMPLE = ROOT / "examples" / "data"


def _save(folder: Path, arch: str, tok, template: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tok.chat_template = (TEMPLATES / template).read_text()
    tok.save_pretrained(folder)
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    # A few spare embedding rows, as real checkpoints have (Qwen2.5 pads 151,665 tokens to
    # 151,936): next to a config.json, AutoTokenizer may pick the family's tokenizer class,
    # which can add a special token or two.
    config = config_cls(
        vocab_size=len(tok) + 16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def checkpoints(module_tmp):
    """Qwen2 and Llama folders on one SentencePiece tokenizer (loading a second real one costs
    seconds), each with its own family's chat template in its tokenizer_config."""
    root = module_tmp("ckpt")
    tok = load_tokenizer("mistral-v1").tokenizer
    return {
        "qwen": _save(root / "qwen2-tiny", "qwen2", tok, "qwen2.5-instruct.jinja"),
        "llama": _save(root / "llama-tiny", "llama", tok, "llama-3.2-instruct.jinja"),
    }


def _cfg(checkpoints, out, data="gsm8k_sample.parquet", **task):
    return {
        "seed": 0,
        "steps": 2,
        "strategy": "none",
        "output_dir": str(out),
        "torch_threads": 1,
        "grpo": {
            "num_generations": 2,
            "prompts_per_step": 2,
            "max_completion_length": 6,
            "temperature": 1.0,
            "learning_rate": 1e-4,
        },
        "warmup": {"max_steps": 1, "batch_size": 2, "eval_every": 1, "eval_prompts": 2},
        "eval": {"every": 0, "num_prompts": 2, "k": 1},
        "exchange": {"log": False},
        "task": {
            "name": "gsm8k",
            "path": str(SAMPLE / data),
            "reward_funcs": ["correctness", "hash_format"],
            "reward_weights": [1.0, 0.5],
            **task,
        },
        "policies": [
            {
                "name": "qwen",
                "checkpoint": checkpoints["qwen"],
                "tokenizer": checkpoints["qwen"],
                "chat_template": True,
                "warmup_families": ["counting"],
            },
            {
                "name": "llama",
                "checkpoint": checkpoints["llama"],
                "tokenizer": checkpoints["llama"],
                "chat_template": True,
                "system_prompt": "Answer after ####.",
                "warmup_families": ["groups"],
            },
        ],
    }


def test_whole_loop_on_tiny_real_architectures_with_chat_templates(checkpoints, tmp_path):
    cfg = config_from_dict(_cfg(checkpoints, tmp_path / "run"))
    # chat_template = true: each folder's own template (a folder without one fails to build)
    assert "<|im_start|>" in (Path(checkpoints["qwen"]) / "chat_template.jinja").read_text()
    summary = train(cfg)
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if r.get("phase") == "train"]
    assert len(steps) == 2
    for r in steps:
        for name in ("qwen", "llama"):
            corr, fmt = (
                r[f"policy/{name}/rewards/correctness/mean"],
                r[f"policy/{name}/rewards/hash_format/mean"],
            )
            assert r[f"policy/{name}/reward/mean"] == pytest.approx(corr + 0.5 * fmt)
        assert r["rewards/errors"] == 0 and r["rewards/timeouts"] == 0
    assert set(summary.final_eval) >= {"qwen/pass@1", "llama/pass@1"} or summary.final_eval
    assert (tmp_path / "run" / "policies").is_dir()


def test_bad_inputs_fail_before_training(checkpoints, tmp_path):
    def run(**changes):
        d = _cfg(checkpoints, tmp_path / "bad")
        for key, value in changes.items():
            if key.startswith("p0_"):
                d["policies"][0][key[3:]] = value
            else:
                d["task"][key] = value
        return train(config_from_dict(d))

    with pytest.raises(ConfigError, match=r"policies.qwen.checkpoint: folder not found: /no/such"):
        run(p0_checkpoint="/no/such/model")
    vit = tmp_path / "vit"  # an image model: no causal LM AutoModelForCausalLM builds
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(
        ConfigError,
        match=r"policies.qwen.checkpoint: model_type 'vit' .* not a "
        r"causal language model this transformers",
    ):
        run(p0_checkpoint=str(vit))
    plain = tmp_path / "plain-tokenizer"  # the qwen folder's tokenizer without its template
    plain.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(checkpoints["qwen"]) / f, plain / f)
    assert "chat_template" not in (plain / "tokenizer_config.json").read_text()
    with pytest.raises(
        ConfigError,
        match=r"policies.qwen.chat_template: tokenizer '.*plain-tokenizer' "
        r"has no chat template",
    ):
        run(p0_tokenizer=str(plain))
    with pytest.raises(
        TaskError,
        match=r"task.answer_column: column 'solution' not found in .*"
        r"gsm8k_sample.parquet; columns present",
    ):
        run(answer_column="solution")
    with pytest.raises(ConfigError, match=r"task.reward_funcs: unknown reward function 'style'"):
        run(reward_funcs=["style"], reward_weights=[])
    d = _cfg(checkpoints, tmp_path / "bad")
    d["allocation"] = {
        "inventory": {"gpus_per_node": 0, "cpus_per_node": 2, "host_memory_gb": 0.01}
    }
    with pytest.raises(PlanError, match="qwen"):
        train(config_from_dict(d))
    assert not (tmp_path / "bad" / "metrics.jsonl").exists() or not any(
        '"phase": "train"' in line
        for line in (tmp_path / "bad" / "metrics.jsonl").read_text().splitlines()
    )
