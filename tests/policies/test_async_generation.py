"""``Policy.update_and_generate`` (``allocation.async_generation``): the next samples come from the
weights before the update, exactly as ``generate`` would have drawn them there, and an update on
samples behind the learner's version corrects them as an inexact sampler's."""

from __future__ import annotations

import copy

import pytest
import torch

from mutualrl.policies.batch import TrainBatch, TrainSequence, stale_rows
from tests.policies.test_policy import PROMPTS, make_policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def own_batch(samples, version=None) -> TrainBatch:
    adv = torch.linspace(-1, 1, len(samples)).tolist()
    return TrainBatch(
        sequences=tuple(
            TrainSequence(
                prompt_ids=s.prompt_ids,
                completion_ids=s.completion_ids,
                advantage=a,
                old_logprobs=s.logprobs,
                behaviour_version=s.policy_version if version is None else version,
            )
            for s, a in zip(samples, adv)
        )
    )


@pytest.mark.parametrize("arch_tok", [("llama", "mistral-v1"), ("qwen2", "deepseek-v3")])
def test_samples_drawn_during_an_update_are_those_of_the_weights_before_it(
    tokenizer_handles, arch_tok
):
    policy = make_policy(tokenizer_handles, *arch_tok)
    batch = own_batch(policy.generate(PROMPTS, 4, 4, 0.7))
    twin = copy.deepcopy(policy)  # the same weights, optimizer and sampler state
    expected = twin.generate(PROMPTS, 4, 4, 1.0)
    twin.update([batch])
    stats, version, samples = policy.update_and_generate([batch], PROMPTS, 4, 4, 1.0)
    assert version == policy.version == twin.version == 1
    assert [s.completion_ids for s in samples] == [s.completion_ids for s in expected]
    # to float rounding: the sampler's copy of the weights computes the same distribution, its
    # last bits not always the same (seen: 1e-6 on a log-prob of -10)
    for s, e in zip(samples, expected):
        assert s.logprobs == pytest.approx(e.logprobs, abs=1e-5)
    assert {s.policy_version for s in samples} == {0}  # one version behind the learner
    assert stats["async/generate_time_s"] > 0
    # the update itself is the plain one: same weights as the twin's after ``update``
    for a, b in zip(policy.model.parameters(), twin.model.parameters()):
        assert torch.equal(a, b)
    # the sampler's copy is refreshed, not rebuilt, at the next overlap
    frozen = policy.backend._frozen
    policy.update_and_generate([own_batch(samples)], PROMPTS, 4, 4, 1.0)
    assert policy.backend._frozen is frozen and frozen.version == 1


def test_an_update_on_stale_samples_is_corrected_as_an_inexact_samplers(tokenizer_handles):
    policy = make_policy(tokenizer_handles, "llama", "mistral-v1")
    samples = policy.generate(PROMPTS, 4, 4, 0.7)
    assert not stale_rows(own_batch(samples), policy.version)
    plain = policy.train_step(own_batch(samples))
    assert not any(k.startswith("mismatch/") for k in plain)  # on-policy: nothing to correct
    stale = own_batch(samples)  # drawn at version 0, now 1
    assert stale_rows(stale, policy.version)
    corrected = policy.train_step(stale)
    assert 0 < corrected["mismatch/is_weight_mean"] and corrected["mismatch/logp_abs_diff_max"] > 0


def test_the_batches_of_one_step_are_not_stale_to_each_other(tokenizer_handles):
    # A step of several batches (hacpo's updates_per_step) moves the version between them; its
    # own samples, drawn at the step's start, are on-policy for each batch.
    policy = make_policy(tokenizer_handles, "llama", "mistral-v1")
    samples = policy.generate(PROMPTS, 4, 4, 0.7)
    first, again = own_batch(samples), own_batch(samples)
    again = TrainBatch(sequences=again.sequences, tag="again")
    stats = policy.train_steps([first, again])
    assert policy.version == 2
    assert not any("mismatch/" in k for k in stats), sorted(k for k in stats if "mismatch" in k)
