"""The real models train: the training forward's log-probs equal the sampler's (fp32 exactly up
to float rounding, bf16 within autocast's rounding), an update moves the weights, and one GRPO
step of each runs through the project's own train entry point (one by name, one by folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig, config_from_dict
from mutualrl.grpo import selective_log_softmax
from mutualrl.policies.batch import TrainBatch, TrainSequence, collate
from mutualrl.policies.policy import Policy
from mutualrl.run import train
from mutualrl.tasks.base import Prompt

pytestmark = pytest.mark.real_models

ROOT = Path(__file__).resolve().parents[2]
GRPO = GRPOConfig(
    num_generations=2,
    prompts_per_step=2,
    max_completion_length=8,
    temperature=1.0,
    learning_rate=1e-5,
)
PROMPTS = [
    Prompt(text="Question: What is 17 + 25?\nAnswer:", answer="42", family="add"),
    Prompt(text="Question: What is 9 - 4?\nAnswer:", answer="5", family="sub"),
]
# fp32: the sampler's KV-cache steps and the training forward differ only in summation order.
# bf16 autocast: both round to bf16 in different places (one token at a time against the whole
# sequence), which moves a token's log-prob by up to ~0.1 on SmolLM2 (measured max 0.12).
TOLERANCE = {"fp32": dict(max=1e-4, mean=1e-4), "bf16": dict(max=0.3, mean=0.08)}


def _gaps(policy: Policy, samples, logp: torch.Tensor) -> torch.Tensor:
    return torch.cat(
        [
            (logp[i, : len(s.completion_ids)].float() - torch.tensor(s.logprobs)).abs()
            for i, s in enumerate(samples)
        ]
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_training_logprobs_equal_the_samplers_and_an_update_moves_the_weights(
    converted, name, dtype
):
    torch.set_num_threads(2)
    folder = str(converted[name][0])
    # logprob_chunk_size: the update path that takes the LM head's weight itself (chunked)
    policy = Policy(
        PolicyConfig(name="p", checkpoint=folder, dtype=dtype),
        GRPO,
        seed=0,
        training=TrainingConfig(logprob_chunk_size=8),
    )
    samples = policy.generate(PROMPTS, 2, 8, temperature=1.0)
    c = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], policy.pad_id)
    policy.model.eval()
    logprobs = policy.learner.logprobs
    with torch.no_grad(), logprobs.autocast():
        plain = selective_log_softmax(
            logprobs.completion_logits(policy.model, c).float(), c.completion_ids
        )
    chunked = logprobs.plain_logprobs(policy.model, c)
    limit = TOLERANCE[dtype]
    for logp in (plain, chunked):
        gaps = _gaps(policy, samples, logp)
        assert gaps.max() <= limit["max"] and gaps.mean() <= limit["mean"], (name, dtype, gaps)
    if dtype == "bf16":
        return  # one update per model is enough (fp32, below)
    head = policy.model.get_output_embeddings().weight
    before = head.detach().clone()
    sequences = tuple(
        TrainSequence(
            prompt_ids=s.prompt_ids,
            completion_ids=s.completion_ids,
            advantage=a,
            old_logprobs=s.logprobs,
            truncated=s.finish_reason == "length",
        )
        for s, a in zip(samples, [1.0, -1.0, 1.0, -1.0])
    )
    stats = policy.train_step(TrainBatch(sequences=sequences))
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values() if isinstance(v, float))
    assert not torch.equal(before, head.detach())  # the tied head moved: so did the embedding
    assert head is policy.model.get_input_embeddings().weight


def test_one_grpo_step_of_each_through_train(converted, tmp_path):
    """SmolLM2 by name with its chat template, Gemma 3 by folder on raw prompts."""
    gemma = str(converted["gemma-3-270m"][0])
    out = tmp_path / "run"
    cfg = config_from_dict(
        {
            "seed": 0,
            "steps": 1,
            "strategy": "none",
            "output_dir": str(out),
            "torch_threads": 2,
            "grpo": {
                "num_generations": 2,
                "prompts_per_step": 2,
                "max_completion_length": 8,
                "temperature": 1.0,
                "learning_rate": 1e-5,
            },
            "warmup": {"max_steps": 0},
            "eval": {"every": 0, "num_prompts": 1, "k": 1},
            "exchange": {"log": False},
            "task": {
                "name": "gsm8k",
                "path": str(ROOT / "examples" / "data" / "gsm8k_sample.parquet"),
            },
            "policies": [
                {"name": "smol", "checkpoint": "smollm2-135m-instruct", "chat_template": True},
                {"name": "gemma", "checkpoint": gemma},
            ],
        }
    )
    summary = train(cfg)
    assert set(summary.reward_last) == {"smol", "gemma"}
    saved = json.loads((out / "config.json").read_text())
    smol = str(converted["smollm2-135m-instruct"][0])
    assert [(p["checkpoint"], p["tokenizer"]) for p in saved["policies"]] == [
        (smol, smol),
        (gemma, gemma),
    ]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("phase") == "train"]
    assert steps and all(f"policy/{n}/reward/mean" in steps[-1] for n in ("smol", "gemma"))
    for name in ("smol", "gemma"):
        assert (out / "policies" / name / "config.json").is_file()


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_each_prompt_once_gives_the_log_probs_and_gradients_of_every_row(converted, name):
    """training.shared_prefix on the real checkpoints (SmolLM2's chat-rendered prompts, Gemma
    3's sliding-window layers): the shared pass equals the unshared one."""
    torch.set_num_threads(2)
    folder = str(converted[name][0])
    grpo = GRPOConfig(num_generations=4, max_completion_length=8, temperature=1.0)
    policy = Policy(
        PolicyConfig(name="p", checkpoint=folder, dtype="fp32", chat_template=name.startswith("s")),
        grpo,
        seed=0,
    )
    samples = policy.generate(PROMPTS, 4, 8, temperature=1.0)
    c = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], policy.pad_id)
    valid = torch.arange(c.completion_len) < c.lengths.unsqueeze(1)
    logprobs, model = policy.learner.logprobs, policy.model
    model.eval()
    results = []
    for shared in (False, True):
        logprobs.shared_prefix = shared
        model.zero_grad()
        logp, _ = logprobs.token_logprobs(model, c, entropy=False)
        (logp * valid).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append(((logp.detach() * valid), grads))
    (plain, plain_grad), (shared_logp, shared_grad) = results
    torch.testing.assert_close(shared_logp, plain, atol=1e-4, rtol=0)
    assert (shared_grad - plain_grad).norm() < 1e-5 * plain_grad.norm()
