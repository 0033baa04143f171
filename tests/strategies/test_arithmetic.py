"""Strategy arithmetic on hand-built batches: advantages, pooled baselines, weights, SFT
selection."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from mutualrl.config import ConfigError, GRPOConfig, load_config
from mutualrl.exchange import prompt_id as hash_prompt
from mutualrl.grpo import truncated_ratio
from mutualrl.strategies import STRATEGIES, build_strategy
from mutualrl.strategies.none import Independent
from mutualrl.strategies.prp import PeerRolloutPooling, PRPParams
from mutualrl.strategies.sgt import SGTParams, SuccessBuffer, SuccessGatedTransfer
from mutualrl.strategies.xgrpo import CrossPolicyAdvantages, XGRPOParams

from .helpers import (
    PA,
    PB,
    PC,
    PD,
    PEER,
    RECV,
    LogprobStub,
    encoder,
    group,
    make_ctx,
    rollout,
    stats,
    zscores,
)

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
EPS = 1e-4


def advs(batch) -> list[float]:
    return [s.advantage for s in batch.sequences]


# ---- none ----------------------------------------------------------------------------------
@pytest.mark.parametrize("skip", [False, True])
def test_none_gives_group_zscores_and_skips_constant_groups_when_asked(handles, skip):
    rewards = {0: [1.0, 0.0, 0.0, 1.0], 1: [1.0, 1.0, 1.0, 1.0], 2: [0.0, 0.5, 1.0, 0.5]}
    own = group(PA, 0, rewards[0]) + group(PB, 1, rewards[1]) + group(PC, 2, rewards[2])
    own[1] = replace(own[1], finish_reason="length")
    ctx = make_ctx(handles, grpo=GRPOConfig(num_generations=4, skip_zero_std_groups=skip))
    [batch] = Independent().build_batches(ctx, RECV, own)
    kept = [s for s in own if not (skip and s.group == 1)]
    expected = np.concatenate([zscores(rewards[g]) for g in (0, 1, 2) if not (skip and g == 1)])
    assert len(batch.sequences) == len(kept) == (8 if skip else 12)
    np.testing.assert_allclose(advs(batch), expected, rtol=1e-6, atol=1e-7)
    assert advs(batch)[0] == pytest.approx(0.5 / (0.5 + EPS))  # [1,0,0,1]: mean .5, std .5
    for seq, s in zip(batch.sequences, kept):
        assert seq.completion_ids == s.completion_ids and seq.old_logprobs == s.logprobs
        assert seq.prompt_ids == s.prompt_ids and seq.weight == 1.0 and seq.source == ""
        assert seq.truncated == (s.finish_reason == "length")
    if not skip:
        assert advs(batch)[4:8] == [0.0] * 4  # exact zeros, not eps noise


def test_none_with_only_constant_groups_and_skip_builds_no_batch(handles):
    ctx = make_ctx(handles, grpo=GRPOConfig(num_generations=2, skip_zero_std_groups=True))
    assert Independent().build_batches(ctx, RECV, group(PA, 0, [1.0, 1.0])) == []


# ---- xgrpo -----------------------------------------------------------------------------------
def xgrpo_setup(handles):
    # own:  A [1, 0]   B [0, 0]        C [1, 1]
    # peer: A [1,1,1,1] B [1, 0, 0, 0] C [1, 1, 1, 1]
    # The exchange carries every producer's stats, the receiver's own included.
    own = group(PA, 0, [1.0, 0.0]) + group(PB, 1, [0.0, 0.0]) + group(PC, 2, [1.0, 1.0])
    exp = [
        stats(RECV, PA, [1, 0]),
        stats(RECV, PB, [0, 0]),
        stats(RECV, PC, [1, 1]),
        stats(PEER, PA, [1, 1, 1, 1]),
        stats(PEER, PB, [1, 0, 0, 0]),
        stats(PEER, PC, [1, 1, 1, 1]),
        stats(PEER, PD, [1, 0]),
    ]  # a prompt not ours: ignored
    return own, exp


@pytest.mark.parametrize("skip", [False, True])
def test_xgrpo_zscore_uses_the_pooled_moments_of_all_rewards(handles, skip):
    own, exp = xgrpo_setup(handles)
    ctx = make_ctx(handles, exp, grpo=GRPOConfig(num_generations=2, skip_zero_std_groups=skip))
    [batch] = CrossPolicyAdvantages(XGRPOParams()).build_batches(ctx, RECV, own)
    union_a = np.array([1, 0, 1, 1, 1, 1], dtype=np.float64)  # all 6 rewards for A
    union_b = np.array([0, 0, 1, 0, 0, 0], dtype=np.float64)
    mean_a, std_a = 5 / 6, math.sqrt(5 / 36)  # by hand
    assert union_a.mean() == pytest.approx(mean_a) and union_a.std() == pytest.approx(std_a)
    expected = [
        (1 - mean_a) / (std_a + EPS),
        (0 - mean_a) / (std_a + EPS),
        (0 - union_b.mean()) / (union_b.std() + EPS),
        (0 - union_b.mean()) / (union_b.std() + EPS),
    ]
    if not skip:
        expected += [0.0, 0.0]  # C: pooled std 0
    np.testing.assert_allclose(advs(batch), expected, rtol=1e-9)
    # B's own rewards are constant (no signal alone) but the pooled std is not: peers rescue it.
    assert advs(batch)[2] < 0
    m = ctx.metrics[RECV]
    assert m["xgrpo/groups_with_signal_from_peers"] == 1
    assert m["xgrpo/frac_pooled_zero_std"] == pytest.approx(2 / 6)
    for seq, s in zip(batch.sequences, own):
        assert seq.old_logprobs == s.logprobs and seq.source == "" and seq.weight == 1.0


def test_xgrpo_zscore_with_one_policy_equals_none(handles):
    own = group(PA, 0, [1.0, 0.0, 0.0, 1.0]) + group(PB, 1, [0.0, 1.0, 1.0, 1.0])
    exp = [stats(RECV, PA, [1, 0, 0, 1]), stats(RECV, PB, [0, 1, 1, 1])]
    ctx = make_ctx(handles, exp, grpo=GRPOConfig(num_generations=4))
    [x] = CrossPolicyAdvantages(XGRPOParams()).build_batches(ctx, RECV, own)
    [n] = Independent().build_batches(ctx, RECV, own)
    np.testing.assert_allclose(advs(x), advs(n), rtol=1e-6)


def test_xgrpo_rank_estimator_ranks_own_rewards_in_the_union(handles):
    # A: own [0.2, 0.9] + peer [0.5, 0.9, 0.1]; the rank estimator reads every producer's rollouts.
    own = group(PA, 0, [0.2, 0.9])
    exp = [
        rollout(RECV, handles[RECV], PA, " a", 0.2),
        rollout(RECV, handles[RECV], PA, " b", 0.9),
        rollout(PEER, handles[PEER], PA, " c", 0.5),
        rollout(PEER, handles[PEER], PA, " d", 0.9),
        rollout(PEER, handles[PEER], PA, " e", 0.1),
        rollout(PEER, handles[PEER], PB, " f", 1.0),
    ]  # other prompt: ignored
    ctx = make_ctx(handles, exp, grpo=GRPOConfig(num_generations=2))
    [batch] = CrossPolicyAdvantages(XGRPOParams(estimator="rank")).build_batches(ctx, RECV, own)
    # union sorted: 0.1 0.2 0.5 0.9 0.9 -> ranks 0, 1/4, 2/4, and the tie (3+4)/2/4 = 7/8 twice
    ranks = np.array([0, 0.25, 0.5, 0.875, 0.875])
    mean, std = ranks.mean(), ranks.std()
    assert mean == pytest.approx(0.5)
    expected = [(0.25 - mean) / (std + EPS), (0.875 - mean) / (std + EPS)]
    np.testing.assert_allclose(advs(batch), expected, rtol=1e-9)


def test_every_zscore_honours_advantage_std(handles):
    """none, xgrpo (pooled M2 and ranks) and prp (mixed groups) all divide by the sample std
    (n - 1, TRL's) under ``advantage_std = "sample"``."""
    grpo = GRPOConfig(num_generations=2, advantage_std="sample")
    own, exp = xgrpo_setup(handles)
    [n] = Independent().build_batches(make_ctx(handles, grpo=grpo), RECV, own)
    np.testing.assert_allclose(advs(n), [*zscores([1, 0], ddof=1), 0, 0, 0, 0], rtol=1e-6)
    [x] = CrossPolicyAdvantages(XGRPOParams()).build_batches(
        make_ctx(handles, exp, grpo=grpo), RECV, own
    )
    union_a, union_b = [1, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]
    np.testing.assert_allclose(
        advs(x), [*zscores(union_a, ddof=1)[:2], *zscores(union_b, ddof=1)[:2], 0, 0], rtol=1e-9
    )
    assert advs(x)[0] != pytest.approx(zscores(union_a)[0], rel=1e-3)  # not the population's
    own, exp = prp_setup(handles)
    [p] = PeerRolloutPooling(PRPParams(peer_ratio="on_receiver")).build_batches(
        make_ctx(handles, exp, grpo=grpo), RECV, own
    )
    za, zb = zscores([1.0, 0.0, 1.0, 0.0], ddof=1), zscores([0.0, 0.0, 1.0], ddof=1)
    np.testing.assert_allclose(
        advs(p), [za[0], za[1], zb[0], zb[1], za[2], za[3], zb[2]], rtol=1e-6
    )


def test_xgrpo_rank_estimator_honours_advantage_std(handles):
    own = group(PA, 0, [0.2, 0.9])
    exp = [
        rollout(RECV, handles[RECV], PA, " a", 0.2),
        rollout(RECV, handles[RECV], PA, " b", 0.9),
        rollout(PEER, handles[PEER], PA, " c", 0.5),
    ]
    ctx = make_ctx(handles, exp, grpo=GRPOConfig(num_generations=2, advantage_std="sample"))
    [batch] = CrossPolicyAdvantages(XGRPOParams(estimator="rank")).build_batches(ctx, RECV, own)
    ranks = np.array([0, 1.0, 0.5])  # 0.2, 0.9, 0.5 in the union
    np.testing.assert_allclose(advs(batch), zscores(ranks, ddof=1)[:2], rtol=1e-9)


# ---- prp ------------------------------------------------------------------------------------
def prp_setup(handles):
    # Receiver groups: A [1, 0] (group 0), B [0, 0] (group 1).
    own = group(PA, 0, [1.0, 0.0]) + group(PB, 1, [0.0, 0.0])
    hp = handles[PEER]
    exp = [
        rollout(PEER, hp, PA, " cat", 1.0, logprob_total=-2.0, seq=0),
        rollout(PEER, hp, PA, " dog", 0.0, logprob_total=-1.5, seq=1, finish="length"),
        rollout(PEER, hp, PB, " fish", 1.0, logprob_total=-3.0, seq=2),
        rollout(PEER, hp, PC, " king", 1.0, logprob_total=-1.0, seq=3),  # prompt not ours
        rollout(RECV, handles[RECV], PA, " cat", 1.0, seq=4),  # own: never pooled
        stats(PEER, PA, [1, 0], seq=5),
    ]
    return own, exp


def test_prp_pools_peer_rollouts_into_mixed_groups_with_truncated_is_weights(handles):
    own, exp = prp_setup(handles)
    recv_logp = [-1.0, -1.0, -0.5]  # log p_recv of the three pooled texts
    stub = LogprobStub(recv_logp)
    ctx = make_ctx(handles, exp, logprobs={RECV: stub, PEER: stub})
    [batch] = PeerRolloutPooling(PRPParams(ratio_cap=2.0)).build_batches(ctx, RECV, own)
    seqs = batch.sequences
    assert len(seqs) == 4 + 3  # C's rollout and own rollout ignored
    mixed_a, mixed_b = [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0]  # own + peer rewards per prompt
    za, zb = zscores(mixed_a), zscores(mixed_b)
    expected = [za[0], za[1], zb[0], zb[1], za[2], za[3], zb[2]]
    np.testing.assert_allclose(advs(batch), expected, rtol=1e-6)
    # weights: min(exp(log p_recv - sum of the peer's log-probs), cap)
    peer_logp = [-2.0, -1.5, -3.0]
    w = [min(math.exp(r - p), 2.0) for r, p in zip(recv_logp, peer_logp)]
    assert w[1] < 2.0 and w[0] == w[2] == 2.0  # one below, two at the cap
    np.testing.assert_allclose([s.weight for s in seqs[4:]], w, rtol=1e-6)
    assert [s.weight for s in seqs[:4]] == [1.0] * 4
    # own rows keep their behaviour log-probs; peer rows have none and name their source
    for s, o in zip(seqs[:4], own):
        assert (
            s.old_logprobs == o.logprobs and s.source == "" and s.completion_ids == o.completion_ids
        )
    enc = encoder(handles[RECV])
    rt = ctx.retokenizers[RECV]
    for s, (prompt, text, stop) in zip(
        seqs[4:], [(PA, " cat", True), (PA, " dog", False), (PB, " fish", True)]
    ):
        assert s.old_logprobs is None and s.source == PEER
        assert s.prompt_ids == enc(prompt.text) and s.prompt_ids[0] == 1  # Mistral BOS
        target = tuple(int(t) for t in rt.retokenize(text, ends_with_eos=stop).target_ids)
        assert s.completion_ids == target
        assert (s.completion_ids[-1] == 2) == stop and s.truncated == (not stop)
    # the stub saw the receiver-side prompts and retokenized completions of the pooled texts
    [(prompts, completions)] = stub.calls
    assert prompts == [s.prompt_ids for s in seqs[4:]]
    assert completions == [s.completion_ids for s in seqs[4:]]
    m = ctx.metrics[RECV]
    assert m["prp/density_ratio_var"] == pytest.approx(np.var(w), rel=1e-6)
    assert m["prp/density_ratio_mean"] == pytest.approx(np.mean(w), rel=1e-6)
    assert m["prp/truncated_frac"] == pytest.approx(2 / 3)
    assert m["prp/peer_share"] == pytest.approx(3 / 7)
    assert m["prp/peer_samples"] == 3
    assert m["thl/count"] == 3
    assert m["prp/frac_reward_zero_std_mixed"] == 0.0  # B is rescued by the peer's success


def test_prp_on_receiver_weights_are_one_and_need_no_logprobs(handles):
    own, exp = prp_setup(handles)
    ctx = make_ctx(handles, exp)  # sequence_logprobs refuses calls
    [batch] = PeerRolloutPooling(PRPParams(peer_ratio="on_receiver")).build_batches(ctx, RECV, own)
    assert [s.weight for s in batch.sequences] == [1.0] * 7
    assert "prp/density_ratio_var" not in ctx.metrics[RECV]


def test_prp_max_peer_per_group_caps_pooled_samples_per_prompt(handles):
    own, exp = prp_setup(handles)
    ctx = make_ctx(handles, exp, logprobs={RECV: LogprobStub([-1.0, -1.0])})
    [batch] = PeerRolloutPooling(PRPParams(max_peer_per_group=1)).build_batches(ctx, RECV, own)
    peers = batch.sequences[4:]
    assert len(peers) == 2  # first of A (" cat"), B (" fish")
    mixed_a, mixed_b = zscores([1.0, 0.0, 1.0]), zscores([0.0, 0.0, 1.0])
    np.testing.assert_allclose(
        advs(batch), [*mixed_a[:2], *mixed_b[:2], mixed_a[2], mixed_b[2]], rtol=1e-6
    )
    ctx0 = make_ctx(handles, exp)
    [batch0] = PeerRolloutPooling(PRPParams(max_peer_per_group=0)).build_batches(ctx0, RECV, own)
    assert len(batch0.sequences) == 4 and ctx0.metrics[RECV]["prp/peer_share"] == 0.0


def test_prp_skip_zero_std_drops_groups_constant_after_mixing(handles):
    own = group(PA, 0, [1.0, 0.0]) + group(PD, 1, [1.0, 1.0]) + group(PB, 2, [0.0, 0.0])
    exp = [
        rollout(PEER, handles[PEER], PB, " fish", 1.0),  # rescues B
        rollout(PEER, handles[PEER], PD, " fire", 1.0),
    ]  # D stays constant: [1, 1, 1]
    ctx = make_ctx(
        handles,
        exp,
        grpo=GRPOConfig(num_generations=2, skip_zero_std_groups=True),
        logprobs={RECV: LogprobStub([-1.0, -1.0])},
    )
    [batch] = PeerRolloutPooling(PRPParams()).build_batches(ctx, RECV, own)
    kept = [(s.prompt_ids, s.source) for s in batch.sequences]
    assert len(kept) == 2 + 2 + 1  # A own, B own, B's peer sample
    assert sum(1 for _, src in kept if src == PEER) == 1
    assert all(s.advantage != 0 for s in batch.sequences)


def test_prp_without_peers_equals_none(handles):
    own = group(PA, 0, [1.0, 0.0, 0.0, 1.0]) + group(PB, 1, [0.0, 1.0, 1.0, 1.0])
    ctx = make_ctx(handles, [stats(RECV, PA, [1, 0, 0, 1])])
    [p] = PeerRolloutPooling(PRPParams()).build_batches(ctx, RECV, own)
    [n] = Independent().build_batches(ctx, RECV, own)
    assert p.sequences == n.sequences


def test_prp_handles_a_prompt_sampled_twice_in_one_step(handles):
    own = group(PA, 0, [1.0, 0.0]) + group(PA, 1, [0.0, 0.0])
    ctx = make_ctx(handles, [])
    [batch] = PeerRolloutPooling(PRPParams()).build_batches(ctx, RECV, own)
    assert len(batch.sequences) == 4


def test_truncated_ratio_is_exp_of_the_log_ratio_capped():
    recv = torch.tensor([0.0, -1.0, -5.0, 3.0], dtype=torch.float64)
    peer = torch.tensor([0.0, -2.0, -1.0, 0.0], dtype=torch.float64)
    w = truncated_ratio(recv, peer, 2.0)
    np.testing.assert_allclose(w.numpy(), [1.0, 2.0, math.exp(-4.0), 2.0])
    np.testing.assert_allclose(
        truncated_ratio(recv, peer, 100.0).numpy(), [1.0, math.e, math.exp(-4.0), math.exp(3.0)]
    )


# ---- sgt ------------------------------------------------------------------------------------
def test_success_buffer_dedups_caps_newest_and_ages(handles):
    hp = handles[PEER]
    buf = SuccessBuffer(max_per_prompt=2, max_age=3)
    buf.add(rollout(PEER, hp, PA, " cat", 1.0), step=0)
    buf.add(rollout(PEER, hp, PA, " cat", 1.0, seq=1), step=0)  # exact duplicate: dropped
    assert len(buf) == 1 and buf.duplicates == 1
    buf.add(rollout(PEER, hp, PA, " cat!", 1.0), step=1)
    buf.add(rollout(PEER, hp, PA, " cat?", 1.0), step=2)  # cap 2: the oldest goes
    assert [e.delivery.record.completion for e in buf.by_prompt[hash_prompt(PA.text)]] == [
        " cat!",
        " cat?",
    ]
    buf.add(rollout(PEER, hp, PB, " fish", 1.0), step=2)
    buf.age(3)  # step-1 entry: age 2 < 3, kept
    assert len(buf) == 3
    buf.age(4)  # step-1 entry is 3 old: gone
    assert [e.delivery.record.completion for e in buf.available(RECV, None)] == [" cat?", " fish"]
    buf.age(5)
    assert len(buf) == 0 and buf.by_prompt == {}
    assert buf.available(RECV, None) == []


def sgt_step(handles, params: SGTParams, *, step=0, strategy=None):
    """Receiver failed A and solved B; the peer solved both (two successes for A, one for B)."""
    hr, hp = handles[RECV], handles[PEER]
    samples = {
        RECV: group(PA, 0, [0.0, 0.0]) + group(PB, 1, [1.0, 0.0]),
        PEER: group(PA, 0, [1.0, 1.0]) + group(PB, 1, [1.0, 0.0]),
    }
    exp = [
        rollout(RECV, hr, PA, " dog", 0.0),
        rollout(RECV, hr, PA, " sun", 0.0),
        rollout(RECV, hr, PB, " fish", 1.0),
        rollout(RECV, hr, PB, " red", 0.0),
        rollout(PEER, hp, PA, " cat", 1.0),
        rollout(PEER, hp, PA, " cat.", 1.0),
        rollout(PEER, hp, PB, " fish", 1.0),
        rollout(PEER, hp, PB, " car", 0.0),
    ]
    ctx = make_ctx(handles, exp, step=step)
    sgt = strategy or SuccessGatedTransfer(params)
    sgt.observe(ctx, samples)
    return sgt, ctx, samples


def sft_texts(ctx, batches, receiver=RECV):
    rt = ctx.retokenizers[receiver]
    by_ids = {
        tuple(int(t) for t in rt.retokenize(t, ends_with_eos=True).target_ids): t
        for t in (" cat", " cat.", " fish", " dog", " sun")
    }
    return sorted(by_ids[e.completion_ids] for b in batches for e in b.sft)


def test_sgt_buffer_holds_successes_at_or_above_tau(handles):
    sgt, ctx, _ = sgt_step(handles, SGTParams())
    assert len(sgt.buffer) == 4  # 1 own + 3 peer successes
    assert sgt.buffer.duplicates == 0  # same text, other source: kept
    sgt.observe(ctx, {})  # the same deliveries again
    assert len(sgt.buffer) == 4 and sgt.buffer.duplicates == 4
    low, _, _ = sgt_step(handles, SGTParams(tau=0.5))
    assert len(low.buffer) == 4
    assert sgt.failed[RECV] == {hash_prompt(PA.text)} and sgt.failed[PEER] == set()


def test_sgt_receiver_failed_gate_uses_peer_successes_only_where_the_receiver_failed(handles):
    sgt, ctx, samples = sgt_step(handles, SGTParams())
    [batch] = sgt.build_batches(ctx, RECV, samples[RECV])
    assert sft_texts(ctx, [batch]) == [" cat", " cat."]  # A only; B was solved
    assert {e.source for e in batch.sft} == {PEER}
    assert batch.sft_coef == 0.5 and batch.tag == "grpo"
    assert all(e.prompt_ids == encoder(handles[RECV])(PA.text) for e in batch.sft)
    np.testing.assert_allclose(advs(batch), [0, 0, *zscores([1.0, 0.0])], rtol=1e-6)
    m = ctx.metrics[RECV]
    assert m["sgt/sft_examples"] == 2 and m["sgt/rescued_prompts"] == 1
    assert m["sgt/buffer_size"] == 4 and m[f"sgt/received/{PEER}"] == 2
    # the peer solved everything: nothing to learn; and never from its own successes
    [peer_batch] = sgt.build_batches(ctx, PEER, samples[PEER])
    assert peer_batch.sft == ()


def test_sgt_always_gate_uses_any_peer_success_but_never_the_receivers_own(handles):
    sgt, ctx, samples = sgt_step(handles, SGTParams(gate="always", alpha=0.25))
    [batch] = sgt.build_batches(ctx, RECV, samples[RECV])
    assert sft_texts(ctx, [batch]) == [
        " cat",
        " cat.",
        " fish",
    ]  # the peer's three, not own " fish"
    assert {e.source for e in batch.sft} == {PEER} and batch.sft_coef == 0.25
    [peer_batch] = sgt.build_batches(ctx, PEER, samples[PEER])
    assert [e.source for e in peer_batch.sft] == [RECV]  # the receiver's one success
    assert sft_texts(ctx, [peer_batch], PEER) == [" fish"]


def test_sgt_interval_one_takes_min_of_batch_size_and_available(handles):
    sgt, ctx, samples = sgt_step(handles, SGTParams(gate="always", sft_batch_size=2))
    [batch] = sgt.build_batches(ctx, RECV, samples[RECV])
    assert len(batch.sft) == 2 and batch.sft_coef == 0.5 and len(batch.sequences) == 4


def test_sgt_interval_runs_sft_only_batches_on_interval_steps_and_stops_early(handles):
    params = SGTParams(gate="always", interval=2, sft_batch_size=2, sft_steps=4, max_uses=1)
    sgt, ctx, samples = sgt_step(handles, params, step=0)
    batches = sgt.build_batches(ctx, RECV, samples[RECV])
    assert [b.tag for b in batches] == ["grpo", "sft", "sft"]
    assert [len(b.sft) for b in batches] == [0, 2, 1]  # 3 available: 2 then 1, stop
    assert batches[0].sft_coef == 0.0 and [b.sft_coef for b in batches[1:]] == [1.0, 1.0]
    assert all(b.sequences == () for b in batches[1:])
    assert sft_texts(ctx, batches) == [" cat", " cat.", " fish"]  # each used once
    # step 1 is no SFT step; at step 2 every success was already used once by this receiver
    for step in (1, 2):
        _, ctx2, _ = sgt_step(handles, params, step=step, strategy=sgt)
        assert [b.tag for b in sgt.build_batches(ctx2, RECV, samples[RECV])] == ["grpo"]


def test_sgt_sft_only_steps_run_at_the_sft_learning_rate(handles):
    params = SGTParams(gate="always", interval=2, sft_batch_size=2, sft_steps=1)
    sgt, ctx, samples = sgt_step(
        handles, params, strategy=SuccessGatedTransfer(params, sft_learning_rate=3e-3)
    )
    grpo, sft = sgt.build_batches(ctx, RECV, samples[RECV])
    assert (grpo.learning_rate, sft.learning_rate) == (None, 3e-3)  # GRPO keeps the policy's
    explicit = SGTParams(gate="always", interval=2, sft_steps=1, sft_learning_rate=5e-4)
    sgt, ctx, samples = sgt_step(handles, explicit, strategy=SuccessGatedTransfer(explicit, 3e-3))
    assert sgt.build_batches(ctx, RECV, samples[RECV])[1].learning_rate == 5e-4


def test_sgt_sft_learning_rate_defaults_to_the_runs_supervised_one():
    sgt = build_strategy(load_config(TINY, ['strategy="sgt"', "strategies.sgt.interval=2"]))
    assert sgt.sft_learning_rate == load_config(TINY).warmup.learning_rate
    with pytest.raises(ConfigError, match="which need interval > 1"):
        build_strategy(
            load_config(TINY, ['strategy="sgt"', "strategies.sgt.sft_learning_rate=1e-3"])
        )
    with pytest.raises(ConfigError, match="sft_learning_rate must be > 0"):
        build_strategy(
            load_config(
                TINY,
                [
                    'strategy="sgt"',
                    "strategies.sgt.interval=2",
                    "strategies.sgt.sft_learning_rate=0.0",
                ],
            )
        )


def test_sgt_interval_without_max_uses_redraws_available_successes(handles):
    """Documented: a success stays drawable until it ages out unless ``max_uses`` caps it."""
    sgt, ctx, samples = sgt_step(
        handles, SGTParams(gate="always", interval=2, sft_batch_size=2, sft_steps=3)
    )
    batches = sgt.build_batches(ctx, RECV, samples[RECV])
    assert [len(b.sft) for b in batches] == [0, 2, 2, 2]
    assert ctx.metrics[RECV]["sgt/sft_examples"] == 6


def test_sgt_successes_age_out_after_max_age_steps(handles):
    params = SGTParams(gate="always", max_age=2)
    sgt, ctx, samples = sgt_step(handles, params, step=0)
    for step in (0, 1):  # available at steps 0 and 1
        ctx_s = make_ctx(handles, [], step=step)
        sgt.observe(ctx_s, {})  # ageing happens here
        assert len(sgt.buffer) == 4
        assert sgt.build_batches(ctx_s, RECV, samples[RECV])[0].sft != ()
        sgt.after_update(ctx_s, RECV)  # updates never age the buffer
        sgt.after_update(ctx_s, PEER)
        assert len(sgt.buffer) == 4
    ctx_2 = make_ctx(handles, [], step=2)
    sgt.observe(ctx_2, {})  # step-0 entries are 2 old: gone
    assert len(sgt.buffer) == 0
    assert sgt.build_batches(ctx_2, RECV, samples[RECV])[0].sft == ()


def test_sgt_draws_are_deterministic_per_step_seed(handles):
    params = SGTParams(gate="always", sft_batch_size=2)
    picks = []
    for _ in range(2):
        sgt, ctx, samples = sgt_step(handles, params)
        picks.append([e.completion_ids for e in sgt.build_batches(ctx, RECV, samples[RECV])[0].sft])
    assert picks[0] == picks[1]


# ---- parameter validation -------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, name",
    [
        ("strategies.sgt.alpha=-1", "sgt"),
        ("strategies.sgt.tau=-0.5", "sgt"),
        ("strategies.sgt.interval=0", "sgt"),
        ("strategies.sgt.bogus=1", "sgt"),
        ('strategies.sgt.sft_steps="four"', "sgt"),
        ("strategies.prp.ratio_cap=0", "prp"),
        ('strategies.prp.peer_ratio="exact"', "prp"),
        ("strategies.prp.max_peer_per_group=-1", "prp"),
        ('strategies.xgrpo.estimator="median"', "xgrpo"),
        ("strategies.none.anything=1", "none"),
    ],
)
def test_bad_strategy_parameters_fail_naming_the_strategy(override, name):
    cfg = load_config(TINY, [f'strategy="{name}"', override])
    with pytest.raises(ConfigError, match=rf"^strategies\.{name}: "):
        build_strategy(cfg)


def test_a_bad_field_type_names_its_full_json_path():
    cfg = load_config(TINY, ['strategy="sgt"', 'strategies.sgt.sft_steps="four"'])
    with pytest.raises(ConfigError, match=r"at `\$\.strategies\.sgt\.sft_steps`"):
        build_strategy(cfg)


@pytest.mark.parametrize(
    "override, name",
    [
        ("strategies.sgt.alpha=-1", "sgt"),
        ("strategies.sgt.tau=-0.5", "sgt"),
        ("strategies.sgt.bogus=1", "sgt"),
        ("strategies.prp.ratio_cap=0", "prp"),
    ],
)
def test_root_level_parameter_errors_name_the_json_path(override, name):
    cfg = load_config(TINY, [f'strategy="{name}"', override])
    with pytest.raises(ConfigError, match=rf"at `\$\.strategies\.{name}`"):
        build_strategy(cfg)


def test_sgt_parameter_messages_say_what_is_wrong():
    with pytest.raises(ConfigError, match="alpha must be >= 0"):
        build_strategy(load_config(TINY, ['strategy="sgt"', "strategies.sgt.alpha=-1"]))
    with pytest.raises(ConfigError, match=r"tau must be > 0"):
        build_strategy(load_config(TINY, ['strategy="sgt"', "strategies.sgt.tau=0"]))
    # a combined reward (task.reward_weights) may exceed 1: a threshold above 1 is accepted
    accepted = build_strategy(load_config(TINY, ['strategy="sgt"', "strategies.sgt.tau=1.1"]))
    assert accepted.params.tau == 1.1
    with pytest.raises(ConfigError, match="bogus"):
        build_strategy(load_config(TINY, ['strategy="sgt"', "strategies.sgt.bogus=1"]))
    with pytest.raises(ConfigError, match="Expected `int`"):
        build_strategy(load_config(TINY, ['strategy="sgt"', 'strategies.sgt.sft_steps="four"']))


def test_parameters_of_other_strategies_are_not_checked_by_the_run_strategy():
    cfg = load_config(TINY, ['strategy="none"', "strategies.sgt.alpha=0.1"])
    assert isinstance(build_strategy(cfg), Independent)
    sgt = build_strategy(
        load_config(
            TINY, ['strategy="sgt"', "strategies.sgt.alpha=0.1", "strategies.sgt.interval=3"]
        )
    )
    assert sgt.params.alpha == 0.1 and sgt.params.interval == 3


def test_unknown_strategy_lists_the_known_ones():
    cfg = load_config(TINY, ['strategy="telepathy"'])
    with pytest.raises(ConfigError, match="telepathy") as info:
        build_strategy(cfg)
    for known in ("none", "prp", "sgt", "xgrpo"):
        assert known in str(info.value)
    assert set(STRATEGIES.names()) >= {"none", "prp", "sgt", "xgrpo"}
