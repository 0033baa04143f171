"""Every registered strategy in the real training loop, on tiny runs.

Runs skip the warm start (``warmup.max_steps = 0``) and evaluate on one prompt per family: the
loop, the exchange, THL and the policies' updates are what is exercised here, not learning.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import tomllib

from mutualrl.config import config_from_dict
from mutualrl.run import build_run, train
from mutualrl.run.metrics import read_metrics
from mutualrl.run.phases import generate, make_context, publish, sample_prompts, verify
from mutualrl.strategies import STRATEGIES

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
NAMES = STRATEGIES.names()
THIRD = {
    "name": "mistral-third",
    "architecture": "mistral",
    "tokenizer": "mistral-v1",
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
}
COMPARED = (
    "reward/mean",
    "reward/std",
    "loss",
    "grpo_loss",
    "entropy",
    "grad_norm",
    "completion_length",
    "frac_reward_zero_std",
)
TIMING = ("time_s", "tokens_per_s", "step_time_s")


def tiny(
    out: Path,
    strategy: str,
    *,
    policies: int = 2,
    third: bool = False,
    steps: int = 2,
    strategies: dict | None = None,
):
    data = tomllib.loads(TINY.read_text())
    data.update(output_dir=str(out), strategy=strategy, steps=steps, torch_threads=1)
    data["warmup"]["max_steps"] = 0
    data["eval"].update(every=0, num_prompts=1, k=1)
    data["policies"] = data["policies"][:policies] + ([dict(THIRD)] if third else [])
    data["strategies"] = strategies or {}
    return config_from_dict(data)


def train_records(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]


def untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith(TIMING)}


# ---- (a) one policy alone: every strategy is plain GRPO -------------------------------------
@pytest.fixture(scope="module")
def solo_none(module_tmp, fast_run_builds_module):
    out = module_tmp("solo") / "none"
    train(tiny(out, "none", policies=1))
    return train_records(out)


@pytest.mark.parametrize("name", NAMES)
def test_a_single_policy_trains_exactly_as_independent_grpo(name, solo_none, tmp_path):
    train(tiny(tmp_path / name, name, policies=1))
    records = train_records(tmp_path / name)
    assert [r["step"] for r in records] == [r["step"] for r in solo_none] == [0, 1]
    prefix = "policy/llama-mistral/"
    for mine, ref in zip(records, solo_none):
        for key in COMPARED:
            assert mine[prefix + key] == ref[prefix + key], (name, mine["step"], key)
        assert math.isfinite(mine[prefix + "loss"])
        assert not any("qwen" in k for k in mine)


# ---- (b) + three policies: deterministic, and the strategy's metrics are logged ------------
STRATEGY_KEYS = {
    "none": (),
    "prp": ("prp/density_ratio_var", "prp/peer_share", "thl/count"),
    "xgrpo": ("xgrpo/frac_pooled_zero_std", "xgrpo/groups_with_signal_from_peers"),
    "sgt": ("sgt/buffer_size", "sgt/duplicates_dropped", "sgt/sft_examples"),
    "hacpo": (
        "hacpo/peer_samples",
        "hacpo/ratio_mean",
        "hacpo/ratio_var",
        "hacpo/clamped_frac",
        "hacpo/coef_mean",
        "thl/count",
    ),
    "hint": ("hint/candidates", "hint/rescued_prompts", "hint/generated"),
    "codistill": ("codistill/is_larger",),
}
POLICIES3 = ("llama-mistral", "qwen-deepseek", "mistral-third")


@pytest.fixture(scope="module", params=NAMES)
def three_policy_runs(request, module_tmp, fast_run_builds_module):
    name = request.param
    base = module_tmp(f"three-{name}")
    for i in (1, 2):
        train(tiny(base / f"run{i}", name, third=True))
    return name, train_records(base / "run1"), train_records(base / "run2")


def test_same_seed_gives_identical_metrics(three_policy_runs):
    name, first, second = three_policy_runs
    assert len(first) == len(second) == 2
    assert [untimed(r) for r in first] == [untimed(r) for r in second], name


def test_three_policies_log_their_strategy_metrics(three_policy_runs):
    name, records, _ = three_policy_runs
    for r in records:
        for policy in POLICIES3:
            p = f"policy/{policy}/"
            assert math.isfinite(r[p + "loss"]), (name, policy)
            for key in STRATEGY_KEYS.get(name, ()):
                assert isinstance(r.get(p + key), (int, float)), (name, policy, key)
            if name == "prp":
                # two peers publish G samples for each of the step's prompts
                assert r[p + "prp/peer_samples"] == 2 * 2 * 4
                assert r[p + "thl/count"] == 2 * 2 * 4
                assert r[p + "prp/peer_share"] == pytest.approx(2 / 3)
                assert r[p + "prp/density_ratio_var"] >= 0
            if name == "xgrpo":
                assert 0 <= r[p + "xgrpo/frac_pooled_zero_std"] <= 1
            if name == "sgt" and r[p + "sgt/sft_examples"] > 0:
                assert r[p + "thl/count"] == r[p + "sgt/sft_examples"]
            if name == "none":
                assert not any(
                    k.startswith(p + ns)
                    for k in r
                    for ns in ("prp/", "xgrpo/", "sgt/", "thl/", "hacpo/", "hint/", "codistill/")
                )
            if name == "hacpo":
                assert r[p + "hacpo/peer_samples"] == 2 * 2 * 4
                assert 0 <= r[p + "hacpo/clamped_frac"] <= 1 and r[p + "hacpo/ratio_var"] >= 0
                assert r[p + "hacpo/weight_var"] >= 0
            if name == "codistill":
                # the largest policy (the 129k-vocabulary one) trains on the two others' rollouts
                larger = r[p + "codistill/is_larger"] == 1
                assert larger == (policy == "qwen-deepseek")
                key = "codistill/peer_samples" if larger else "codistill/kd_reward_mean"
                assert isinstance(r.get(p + key), (int, float)), (policy, key)
                if larger:
                    assert r[p + key] == 2 * 2 * 4


# ---- (c) what a strategy hands a receiver fits that receiver ---------------------------------
@pytest.fixture(scope="module", params=["prp", "sgt", "hacpo", "codistill", "hint"])
def one_step(request, module_tmp, fast_run_builds_module):
    """One step of the loop, phase by phase; for sgt every other sample is made a success."""
    name = request.param
    params = {
        "sgt": {"gate": "always"},
        "prp": {"grad_diagnostic": True},
        "hacpo": {},
        "codistill": {},
        "hint": {},
    }
    run = build_run(tiny(module_tmp(f"step-{name}") / "run", name, strategies={name: params[name]}))
    try:
        prompts = sample_prompts(run, 0)
        samples, _ = generate(run, prompts)
        samples = verify(run, samples)
        if name == "hint":  # the first policy solves every other sample, the second nothing
            first = next(iter(samples))
            samples = {
                n: [replace(s, reward=float(n == first and i % 2 == 0)) for i, s in enumerate(ss)]
                for n, ss in samples.items()
            }
        if name == "sgt":
            samples = {
                n: [replace(s, reward=float(i % 2 == 0)) for i, s in enumerate(ss)]
                for n, ss in samples.items()
            }
        publish(run, samples)
        ctx = make_context(run, 0, prompts)
        run.strategy.observe(ctx, samples)
        batches = {n: run.strategy.build_batches(ctx, n, own) for n, own in samples.items()}
        stats = {n: run.policies[n].train_steps(b) for n, b in batches.items()}
        yield name, run, samples, batches, stats, ctx
    finally:
        run.executor.shutdown()
        run.bus.close()
        run.writer.close()
        run.verifier.close()


def test_adapted_sequences_fit_the_receiver(one_step):
    name, run, samples, batches, _, _ = one_step
    limit = run.cfg.grpo.max_completion_length  # EOS is one of the generated tokens
    for receiver, bs in batches.items():
        policy = run.policies[receiver]
        vocab = policy.model.get_input_embeddings().weight.shape[0]
        bos = policy.tokenizer.bos_token_id
        items = [(s.prompt_ids, s.completion_ids) for b in bs for s in b.sequences]
        items += [(e.prompt_ids, e.completion_ids) for b in bs for e in b.sft]
        assert items
        for prompt_ids, completion_ids in items:
            assert len(completion_ids) <= limit
            assert prompt_ids[0] == bos
            assert all(0 <= t < vocab for t in prompt_ids + completion_ids)
        for s in (s for b in bs for s in b.sequences):
            if s.old_logprobs is not None:
                assert len(s.old_logprobs) == len(s.completion_ids) and s.source == ""
            else:
                assert s.source and s.source != receiver
        if name == "prp":
            [b] = bs
            peers = [s for s in b.sequences if s.source]
            # the other policy's samples; rows with an exactly-zero loss are counted, not run
            assert len(peers) + b.skipped_rows == len(samples[receiver])
            assert b.diagnose_sources
        if name == "sgt":
            sft = [e for b in bs for e in b.sft]
            assert sft and all(e.source != receiver for e in sft)


def test_adapted_batches_train(one_step):
    name, run, _, _, stats, _ = one_step
    for receiver, st in stats.items():
        assert math.isfinite(st["loss"]) and st["skipped_nan"] == 0.0, receiver
        if name == "sgt":
            assert st["sft_loss"] > 0
        if name == "prp":
            # untrained policies mostly get reward 0 (zero advantages): presence, not size
            assert all(
                math.isfinite(st[f"grad/{k}"]) for k in ("own_norm", "peer_norm", "own_peer_cosine")
            )


def test_hints_are_sampled_on_the_receiver_and_scored_by_the_task(one_step):
    name, run, samples, batches, _, ctx = one_step
    if name != "hint":
        pytest.skip("hint only")
    first, second = list(samples)
    G = run.cfg.grpo.num_generations
    m = ctx.metrics[second]
    # the second policy failed every prompt; the first solved each (every other sample)
    assert m["hint/candidates"] == run.cfg.grpo.prompts_per_step
    assert 0 < m["hint/generated"] <= m["hint/candidates"] * 2 * G
    assert m["hint/generated"] % G == 0
    assert ctx.metrics[first]["hint/candidates"] == 0
    hinted = sum(len(b.sequences) for b in batches[second]) - len(samples[second])
    assert hinted == G * m["hint/rescued_prompts"]


def test_extra_sampling_by_a_strategy_is_counted_in_tokens(one_step):
    """What a strategy samples beyond the step's groups is paid for:
    ``strategy/generated_tokens``."""
    name, run, _, _, _, ctx = one_step
    limit = run.cfg.grpo.max_completion_length
    generated = {n: m.get("hint/generated", 0) for n, m in ctx.metrics.items()}
    if name != "hint":
        assert not any("strategy/generated_tokens" in m for m in ctx.metrics.values())
        return
    assert sum(generated.values()) > 0
    for n, count in generated.items():
        tokens = ctx.metrics[n].get("strategy/generated_tokens", 0.0)
        assert count <= tokens <= count * limit
