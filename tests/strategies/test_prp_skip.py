"""PRP leaves peer rows whose loss is exactly 0 out of the update; loss and gradient are
unchanged."""

from __future__ import annotations

import msgspec
import pytest
import torch

from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig
from mutualrl.policies.batch import TrainBatch, TrainSequence
from mutualrl.policies.policy import Policy
from mutualrl.strategies.prp import drop_inert_peers

GRPO = GRPOConfig(num_generations=2, max_completion_length=4, temperature=0.7, learning_rate=1e-2)


@pytest.fixture(scope="module")
def policy(tokenizer_handles):
    cfg = PolicyConfig(
        name="llama-test",
        architecture="llama",
        tokenizer="mistral-v1",
        hidden_size=32,
        num_layers=1,
        num_heads=4,
    )
    return Policy(cfg, GRPO, seed=3, handle=tokenizer_handles["mistral-v1"])


def sequences(policy) -> list[TrainSequence]:
    a, b = policy.encode_prompt("first: cat dog ="), policy.encode_prompt("last: sun tree =")
    own = [
        TrainSequence(a, (5255, 2), 1.0, (-1.2, -0.7)),
        TrainSequence(a, (8006, 2), -1.0, (-2.0, -0.4)),
        TrainSequence(b, (5255, 8006, 2), 0.0, (-1.0, -1.5, -0.3)),
    ]  # own rows always stay
    peer = [
        TrainSequence(a, (5255, 2), 0.8, None, weight=1.7, source="q"),
        TrainSequence(b, (8006, 5255, 8006, 2), -0.6, None, weight=0.0, source="q"),  # w == 0
        TrainSequence(a, (8006,), 0.0, None, weight=0.9, source="q"),  # A == 0
        TrainSequence(
            b, (5255, 5255, 8006), 0.5, None, weight=1e-46, source="q", truncated=True
        ),  # w -> 0 in f32
        TrainSequence(b, (8006, 2), -0.3, None, weight=0.4, source="q", truncated=True),
    ]
    return own + peer


def loss_and_grad(policy, batch: TrainBatch):
    """The update engine's GRPO loss of ``batch`` (summed over its micro-batches) and gradient."""
    params = [p for p in policy.model.parameters() if p.requires_grad]
    policy.learner.optimizer.zero_grad(set_to_none=True)
    objective = policy.learner.objective
    parts = objective.grpo_parts(policy.model, policy.learner.reference, batch)
    loss = sum(
        objective.grpo_loss(policy.model, parts, k, parts.collated.seq.weights)[0].loss
        for k in range(len(parts.slices))
    )
    loss.backward()
    grad = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]
    )
    policy.learner.optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad.detach().clone()


@pytest.mark.parametrize("micro_batch", [None, 2])
@pytest.mark.parametrize("mask_truncated", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_skipping_inert_peers_keeps_loss_and_gradient(
    policy, loss_type, mask_truncated, micro_batch
):
    policy.grpo = policy.learner.grpo = policy.learner.objective.grpo = msgspec.structs.replace(
        GRPO, loss_type=loss_type, mask_truncated_completions=mask_truncated
    )
    policy.learner.training = policy.learner.objective.training = TrainingConfig(
        per_device_train_batch_size=micro_batch
    )
    policy.model.train()
    seqs = sequences(policy)
    kept, rows, tokens = drop_inert_peers(seqs, 3, policy.grpo)
    assert rows == 3 and len(kept) == len(seqs) - 3
    assert tokens == 4 + 1 + (0 if mask_truncated else 3)
    assert kept[:3] == seqs[:3]  # own rows untouched, even with A == 0
    full_loss, full_grad = loss_and_grad(policy, TrainBatch(sequences=tuple(seqs)))
    loss, grad = loss_and_grad(
        policy, TrainBatch(sequences=tuple(kept), skipped_rows=rows, skipped_tokens=tokens)
    )
    assert full_grad.norm() > 0
    torch.testing.assert_close(loss, full_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, full_grad, atol=1e-6, rtol=1e-5)
    # without the normaliser correction the result would differ: the count matters
    wrong, _ = loss_and_grad(policy, TrainBatch(sequences=tuple(kept)))
    assert abs(float(wrong - full_loss)) > 1e-4


def test_zero_advantage_rows_stay_when_kl_counts(policy):
    seqs = sequences(policy)
    kept, rows, _ = drop_inert_peers(seqs, 3, msgspec.structs.replace(GRPO, beta=0.04))
    assert rows == 2 and any(s.advantage == 0.0 and s.source for s in kept)


def test_nothing_skipped_when_every_row_would_go(policy):
    seqs = [s for s in sequences(policy)[3:] if s.weight == 0.0]
    kept, rows, tokens = drop_inert_peers(seqs, 0, GRPO)
    assert kept == seqs and (rows, tokens) == (0, 0)
