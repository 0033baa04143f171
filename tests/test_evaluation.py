"""Per-prompt held-out results: written at every evaluation, consistent with the per-family
means in metrics.jsonl; and runs under the non-default scenarios go through."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mutualrl.config import load_config
from mutualrl.run import train
from mutualrl.run.evaluation import read_heldout
from mutualrl.run.metrics import read_metrics

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
pytestmark = pytest.mark.usefixtures("fast_run_builds")


@pytest.mark.parametrize("scenario", ["overlap", "asymmetric"])
def test_heldout_jsonl_matches_the_eval_records_under_each_scenario(tmp_path, scenario):
    train(
        load_config(
            TINY,
            [
                f'output_dir="{tmp_path}"',
                "steps=1",
                "eval.num_prompts=6",
                "eval.k=3",
                f'scenario="{scenario}"',
            ],
        )
    )
    records = read_metrics(tmp_path / "metrics.jsonl")
    done = [r for r in records if r["phase"] == "warmup_done"]
    assert {r["policy"] for r in done} == {"llama-mistral", "qwen-deepseek"}
    per_prompt = read_heldout(tmp_path)
    evals = [r for r in records if r["phase"] == "eval"]
    assert [(r["step"], r["policy"]) for r in per_prompt] == [
        (0, "llama-mistral"),
        (0, "qwen-deepseek"),
        (1, "llama-mistral"),
        (1, "qwen-deepseek"),
    ]
    for r in per_prompt:
        assert r["k"] == 3 and len(r["prompt_ids"]) == len(r["greedy"]) == len(r["sampled"]) == 12
        assert r["prompt_ids"] == per_prompt[0]["prompt_ids"]  # same prompts, same order
        assert all(0 <= c <= 3 for c in r["sampled"]) and len(r["greedy_text"]) == 12
        record = next(e for e in evals if e["step"] == r["step"])
        fams = np.array(r["families"])
        for f in set(r["families"]):
            greedy = float(np.array(r["greedy"])[fams == f].mean())
            assert record[f"policy/{r['policy']}/heldout/{f}/pass@1"] == greedy
