"""The per-source gradient diagnostic of a pooled batch: own and peer parts sum to the full
gradient."""

from __future__ import annotations

import math

import pytest
import torch

from mutualrl.config import GRPOConfig, PolicyConfig
from mutualrl.grpo import completion_mask
from mutualrl.policies.batch import TrainBatch, TrainSequence, collate_sequences
from mutualrl.policies.policy import Policy
from mutualrl.policies.update import GRPOParts

GRPO = GRPOConfig(num_generations=2, max_completion_length=4, temperature=0.7, learning_rate=1e-2)


@pytest.fixture
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


def pooled_batch(policy, with_peers: bool = True) -> TrainBatch:
    enc = policy.encode_prompt
    own = (
        TrainSequence(enc("first: cat dog ="), (5255, 2), 1.0, (-1.2, -0.7)),
        TrainSequence(enc("first: cat dog ="), (8006, 2), -1.0, (-2.0, -0.4)),
        TrainSequence(
            enc("last: sun tree ="), (5255, 8006, 2), 0.5, (-1.0, -1.5, -0.3), truncated=False
        ),
    )
    peer = (
        TrainSequence(enc("first: cat dog ="), (5255, 2), 0.8, None, weight=1.7, source="qwen"),
        TrainSequence(
            enc("last: sun tree ="), (8006,), -0.6, None, weight=0.4, source="qwen", truncated=True
        ),
    )
    return TrainBatch(sequences=own + (peer if with_peers else ()), diagnose_sources=True)


def flat_grad(policy, c, mask, old, weights) -> torch.Tensor:
    params = [p for p in policy.model.parameters() if p.requires_grad]
    policy.learner.optimizer.zero_grad(set_to_none=True)
    parts = GRPOParts(c, mask, old, [None], None, [slice(0, len(weights))])
    out, _ = policy.learner.objective.grpo_loss(policy.model, parts, 0, weights)
    out.loss.backward()
    g = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]
    )
    policy.learner.optimizer.zero_grad(set_to_none=True)
    return g.detach().clone()


def test_own_and_peer_gradients_sum_to_the_full_gradient_and_are_reported(policy):
    batch = pooled_batch(policy)
    policy.model.train()
    c = collate_sequences(batch.sequences, policy.pad_id)
    mask = completion_mask(c.completion_ids, c.lengths, c.seq.truncated, False)
    old, w, is_peer = c.seq.old_logprobs, c.seq.weights, c.seq.is_peer
    assert is_peer.tolist() == [False, False, False, True, True]
    full = flat_grad(policy, c, mask, old, w)
    own = flat_grad(policy, c, mask, old, w * (~is_peer).float())
    peer = flat_grad(policy, c, mask, old, w * is_peer.float())
    assert own.norm() > 0 and peer.norm() > 0
    torch.testing.assert_close(own + peer, full, atol=1e-5, rtol=0)
    assert (own - full).abs().max() > 1e-4  # the peer part is not negligible

    before = [p.detach().clone() for p in policy.model.parameters()]
    stats = policy.train_step(batch)
    assert stats["grad/own_norm"] == pytest.approx(float(own.norm()), rel=1e-4)
    assert stats["grad/peer_norm"] == pytest.approx(float(peer.norm()), rel=1e-4)
    cos = float(torch.nn.functional.cosine_similarity(own, peer, dim=0))
    assert stats["grad/own_peer_cosine"] == pytest.approx(cos, abs=1e-4)
    assert -1 <= stats["grad/own_peer_cosine"] <= 1
    # the diagnostic leaves the update itself alone: the step still happened on the full loss
    assert math.isfinite(stats["loss"]) and stats["skipped_nan"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))


def test_diagnostic_without_peers_reports_zero_peer_gradient(policy):
    stats = policy.train_step(pooled_batch(policy, with_peers=False))
    assert stats["grad/own_norm"] > 0
    assert stats["grad/peer_norm"] == 0.0 and stats["grad/own_peer_cosine"] == 0.0


def test_no_diagnostic_unless_asked(policy):
    batch = pooled_batch(policy)
    stats = policy.train_step(TrainBatch(sequences=batch.sequences))
    assert not any(k.startswith("grad/") for k in stats)
