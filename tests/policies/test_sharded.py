"""A learner sharded over two ranks (FSDP2, gloo, two real processes) against one rank.

One update on 2 ranks equals the one-rank update of the same batch: gradients within float
rounding, parameters after two AdamW steps within a fraction of a step, statistics within float
rounding, for every loss_type, with an SFT term (one example: rank 1 runs a padding pass), the
KL term, per-sequence importance weights, micro-batches and gradient checkpointing. Then the
state crosses rank counts both ways, exactly: DCP checkpoints (2 -> 1 and 1 -> 2), whole-state
files, the ``from_pretrained`` folder, and rank 0's generation copy samples what one rank does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from mutualrl.config import AllocationConfig, GRPOConfig, PolicyConfig, TrainingConfig
from mutualrl.policies.batch import TrainBatch
from mutualrl.policies.models import TokenizerFacts
from mutualrl.policies.policy import Policy
from mutualrl.policies.sharded.worker import build_rank
from mutualrl.policies.worker import (
    FreezeReference,
    Generate,
    LoadState,
    RestoreCheckpoint,
    SaveCheckpoint,
    SavePretrained,
    SaveState,
    SequenceLogprobs,
    Update,
)
from mutualrl.tasks.base import Prompt
from mutualrl.workers import ProcessExecutor, call_one
from mutualrl.workers.ranks import RankGroup
from tests.policies.batches import mixed_batch

# Gradients: the two ranks' micro-batches are cut differently from one rank's and summed by the
# reduction, so they agree to float rounding. Parameters after two AdamW steps (lr 1e-3): Adam's
# first steps move near-zero gradients by ~lr, amplifying rounding, so 5% of a step.
GRAD_RTOL = 1e-5
PARAM_ATOL = 5e-5
STATS = (
    "loss",
    "grpo_loss",
    "sft_loss",
    "kl",
    "entropy",
    "clip_ratio_low",
    "clip_ratio_high",
    "grad_norm",
    "grad/own_norm",
    "grad/peer_norm",
    "grad/own_peer_cosine",
)
CFG = PolicyConfig(
    name="p",
    architecture="llama",
    tokenizer="mistral-v1",
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    learner_ranks=2,
)
GRPO = GRPOConfig(
    num_generations=4,
    temperature=0.7,
    beta=0.04,
    epsilon_high=0.28,
    mask_truncated_completions=True,
    max_completion_length=5,
)
TRAINING = TrainingConfig(
    per_device_train_batch_size=3, gradient_checkpointing=True, entropy_sample_size=None
)


@dataclass(frozen=True)
class Snapshot:
    """Every parameter and its gradient, whole (a sharded worker gathers them: every rank)."""

    def __call__(self, worker) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        out = {}
        for name, p in worker.learner.model.named_parameters():
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = (whole.detach().clone(), None if grad is None else grad.detach().clone())
        return out


@dataclass(frozen=True)
class UseLossType:
    """Switch the worker's loss_type (a test's shortcut: one group serves every loss_type)."""

    loss_type: str

    def __call__(self, worker) -> None:
        import msgspec

        g = msgspec.structs.replace(worker.grpo, loss_type=self.loss_type)
        worker.grpo = worker.learner.grpo = worker.learner.objective.grpo = g


@dataclass(frozen=True)
class PoisonOn:
    """Rank ``rank``'s next forward pass returns NaN logits (once); the others' stay finite."""

    rank: int

    def __call__(self, worker) -> None:
        logprobs = worker.learner.logprobs
        real = logprobs.completion_logits
        if worker.rank != self.rank:
            return

        def poisoned(model, c, **kw):
            logprobs.completion_logits = real
            return real(model, c, **kw) * float("nan")

        logprobs.completion_logits = poisoned


def batch_for(p: Policy) -> TrainBatch:
    """8 rows (a multiple of the ranks) of every kind, one SFT example, source diagnostics on."""
    return mixed_batch(p, rows=8, sft_examples=1, diagnose=True)


@pytest.fixture(scope="module")
def pair(tokenizer_handles, module_tmp):
    """(one-rank Policy, executor holding the same policy on 2 ranks, a folder)."""
    handle = tokenizer_handles["mistral-v1"]
    torch.set_num_threads(1)
    one = Policy(CFG, GRPO, seed=3, handle=handle, training=TRAINING)
    ex = ProcessExecutor(AllocationConfig(call_timeout_s=300, process_group_timeout_s=60))
    facts = TokenizerFacts.of(handle.tokenizer)
    ex.start(
        {
            "p": RankGroup(
                2, functools.partial(build_rank, CFG, GRPO, 3, facts, "cpu", None, TRAINING)
            )
        }
    )
    yield one, ex, module_tmp("sharded")
    ex.shutdown()


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def test_two_ranks_start_from_the_one_rank_weights(pair):
    one, ex, _ = pair
    two = call_one(ex, "p", Snapshot())
    mine = Snapshot()(one)
    assert two.keys() == mine.keys()
    for name, (p, _) in mine.items():
        assert torch.equal(two[name][0], p), name


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_two_ranks_update_like_one(pair, loss_type, record_property):
    one, ex, tmp = pair
    init = tmp / "init.pt"
    if not init.exists():
        one.save_state(init)
    UseLossType(loss_type)(one)
    one.load_state(init)
    call_one(ex, "p", UseLossType(loss_type))
    call_one(ex, "p", LoadState(str(init)))  # a one-rank state file into 2 ranks
    batch = batch_for(one)
    worst = {"grad": 0.0, "param": 0.0}
    for _ in range(2):  # two AdamW steps
        s1, v1 = one.update([batch])
        s2, v2 = call_one(ex, "p", Update([batch]))
        assert v1 == v2
        for key in STATS:
            assert s2[key] == pytest.approx(s1[key], rel=1e-4, abs=1e-6), key
        assert 0 <= s2["sync/shard_probe_gap"] < 1e-5
        two, mine = call_one(ex, "p", Snapshot()), Snapshot()(one)
        for name, (p, g) in mine.items():
            torch.testing.assert_close(
                two[name][1], g, rtol=GRAD_RTOL, atol=GRAD_RTOL * float(g.abs().max())
            )
            torch.testing.assert_close(two[name][0], p, rtol=0, atol=PARAM_ATOL)
            worst["grad"] = max(worst["grad"], max_rel(two[name][1], g))
            worst["param"] = max(worst["param"], float((two[name][0] - p).abs().max()))
    record_property("max_relative_gradient_difference", worst["grad"])
    record_property("max_parameter_difference", worst["param"])
    print(
        f"\n{loss_type}: gradients max rel diff {worst['grad']:.2e}, parameters max abs diff "
        f"{worst['param']:.2e} after two AdamW steps"
    )


def params(snapshot: dict) -> dict[str, torch.Tensor]:
    return {n: p for n, (p, _) in snapshot.items()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_checkpoints_and_state_files_cross_rank_counts_exactly(pair, tokenizer_handles):
    one, ex, tmp = pair
    handle = tokenizer_handles["mistral-v1"]
    call_one(ex, "p", UseLossType(GRPO.loss_type))  # as the fresh policies below
    call_one(ex, "p", Update([batch_for(one)]))  # moved weights and moments: nothing at init
    sharded = params(call_one(ex, "p", Snapshot()))
    # 2 -> 1: a DCP checkpoint read whole by a one-rank policy in a process without a group
    call_one(ex, "p", SaveCheckpoint(str(tmp / "dcp-ckpt")))
    assert (tmp / "dcp-ckpt" / "dcp" / ".metadata").is_file()
    fresh = Policy(CFG, GRPO, seed=99, handle=handle, training=TRAINING)
    fresh.restore_checkpoint(tmp / "dcp-ckpt")
    assert_same_weights(params(Snapshot()(fresh)), sharded)
    assert fresh.version == call_one(ex, "p", Update([]))[1]
    # the optimizer moments crossed too: the next update is the same on both sides
    s1, _ = fresh.update([batch_for(fresh)])
    s2, _ = call_one(ex, "p", Update([batch_for(fresh)]))
    assert s2["grad_norm"] == pytest.approx(s1["grad_norm"], rel=1e-4)
    # 1 -> 2: a one-rank checkpoint (state.pt + reference.pt) into the two ranks
    fresh.save_checkpoint(tmp / "one-ckpt")
    call_one(ex, "p", RestoreCheckpoint(str(tmp / "one-ckpt")))
    assert_same_weights(params(call_one(ex, "p", Snapshot())), params(Snapshot()(fresh)))
    # whole-state files in the one-rank format, 2 -> 1
    call_one(ex, "p", SaveState(str(tmp / "state.pt")))
    other = Policy(CFG, GRPO, seed=5, handle=handle, training=TRAINING)
    other.load_state(tmp / "state.pt")
    assert_same_weights(params(Snapshot()(other)), params(call_one(ex, "p", Snapshot())))


def test_rank0_saves_a_from_pretrained_folder_and_generates_from_its_copy(pair):
    from transformers import AutoModelForCausalLM

    one, ex, tmp = pair
    call_one(ex, "p", SaveState(str(tmp / "now.pt")))
    one.load_state(tmp / "now.pt")  # the one-rank policy takes the same weights
    path = call_one(ex, "p", SavePretrained(str(tmp / "policies")))
    saved = AutoModelForCausalLM.from_pretrained(path)
    assert_same_weights(
        {n: p for n, p in saved.named_parameters()},
        {
            n: p
            for n, p in params(call_one(ex, "p", Snapshot())).items()
            if n in dict(saved.named_parameters())
        },
    )
    prompts = [
        Prompt(text=t, answer="cat", family="first")
        for t in ("first of cat dog sun:", "first of tree sun cat:")
    ]
    greedy_one = one.generate(prompts, 1, 5, 0.0)
    greedy_two = call_one(ex, "p", Generate(prompts, 1, 5, 0.0))
    assert [s.completion_ids for s in greedy_two] == [s.completion_ids for s in greedy_one]
    ids = [s.prompt_ids for s in greedy_one], [s.completion_ids for s in greedy_one]
    torch.testing.assert_close(
        call_one(ex, "p", SequenceLogprobs(*ids)), one.sequence_logprobs(*ids), rtol=1e-5, atol=1e-5
    )


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(pair):
    one, ex, _ = pair
    before = params(call_one(ex, "p", Snapshot()))
    call_one(ex, "p", PoisonOn(1))
    stats, _ = call_one(ex, "p", Update([batch_for(one)]))
    assert stats["skipped_nan"] == 1.0 and stats["skipped_nan_total"] >= 1
    assert_same_weights(params(call_one(ex, "p", Snapshot())), before)
    stats, _ = call_one(ex, "p", Update([batch_for(one)]))  # the group goes on
    assert stats["skipped_nan"] == 0.0


def test_freezing_the_reference_makes_it_the_current_weights(pair):
    one, ex, _ = pair
    call_one(ex, "p", Update([batch_for(one)]))
    stats, _ = call_one(ex, "p", Update([batch_for(one)]))
    assert stats["kl"] > 1e-6  # the reference is still the initial weights
    call_one(ex, "p", FreezeReference())
    stats, _ = call_one(ex, "p", Update([batch_for(one)]))
    assert stats["kl"] == pytest.approx(0.0, abs=1e-7)
