"""Arithmetic of hacpo, codistill and hint on hand-built batches against hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mutualrl.config import ConfigError, GRPOConfig, load_config
from mutualrl.policies.policy import Sample
from mutualrl.strategies import build_strategy
from mutualrl.strategies.codistill import CoDistill, CoDistillParams, kd_rewards
from mutualrl.strategies.hacpo import HACPO, HACPOParams, capability_advantages, cross_weights
from mutualrl.strategies.hint import HintParams, PeerHints, hint_prefix

from .helpers import PA, PB, PEER, RECV, encoder, group, make_ctx, peer_tokens, rollout

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
EPS = 1e-4


def per_token_logprobs(mean_of: dict):
    """A receiver's ``sequence_logprobs`` whose total is ``mean * length`` for each completion,
    the mean looked up by the completion's position in the call."""

    def logprobs(prompts, completions):
        return torch.tensor(
            [mean_of[i] * len(c) for i, c in enumerate(completions)], dtype=torch.float64
        )

    return logprobs


# ---- hacpo -----------------------------------------------------------------------------------
def test_capability_advantages_weigh_rewards_by_capability_and_guard_the_baseline():
    # group 0: own [1, 0], peer [1, 0], omega(peer) = 0.5 -> b = (1 + 0 + .5 + 0) / 4 = .375
    # group 1: own [1, 0], peer [1, 1], omega(peer) = 10 -> b = 5.25 > 1 -> own mean .5
    # group 2: all 1 -> plain mean, zero advantages
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    omega = torch.tensor([1, 1, 0.5, 0.5, 1, 1, 10, 10, 1, 1, 10], dtype=torch.float64)
    own = torch.tensor([1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0], dtype=torch.bool)
    adv, base, zero, guarded = capability_advantages(rewards, groups, 3, omega, own, GRPOConfig())
    torch.testing.assert_close(base, torch.tensor([0.375, 0.5, 1.0], dtype=torch.float64))
    assert guarded.tolist() == [False, True, False]
    std1 = math.sqrt(3 / 16)  # [1, 0, 1, 1]: mean .75
    expected = (
        [(1 - 0.375) / (0.5 + EPS), (0 - 0.375) / (0.5 + EPS)] * 2
        + [
            (1 - 0.5) / (std1 + EPS),
            (0 - 0.5) / (std1 + EPS),
            (1 - 0.5) / (std1 + EPS),
            (1 - 0.5) / (std1 + EPS),
        ]
        + [0.0] * 3
    )
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-6)
    assert zero.tolist() == [False] * 8 + [True] * 3


def test_capability_advantages_take_the_sample_std_when_asked():
    # [1, 0, 1, 0], omega 1: baseline .5; sample std sqrt(1/3) (population: .5)
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long)
    ones, own = torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.bool)
    adv, *_ = capability_advantages(
        rewards, groups, 1, ones, own, GRPOConfig(advantage_std="sample")
    )
    s = math.sqrt(1 / 3)
    np.testing.assert_allclose(adv.numpy(), [0.5 / (s + EPS), -0.5 / (s + EPS)] * 2, rtol=1e-6)
    pop, *_ = capability_advantages(rewards, groups, 1, ones, own, GRPOConfig())
    np.testing.assert_allclose(pop.numpy(), [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)] * 2, rtol=1e-6)


def test_cross_weights_are_the_gradient_factor_inside_the_clamp_and_zero_outside():
    log_ratio = torch.log(torch.tensor([0.9, 1.0, 0.5, 1.2, 0.8], dtype=torch.float64))
    coef = torch.tensor([2.0, 1.0, 1.0, 1.0, 3.0], dtype=torch.float64)
    w, clamped = cross_weights(log_ratio, coef, alpha=1.0, lower=0.8)
    torch.testing.assert_close(
        w, torch.tensor([0.81 * 2, 1.0, 0.0, 0.0, 0.64 * 3], dtype=torch.float64)
    )
    assert clamped.tolist() == [False, False, True, True, False]
    w0, _ = cross_weights(log_ratio, coef, alpha=0.0, lower=0.8)  # alpha 0: plain clamped IS
    assert w0[0].item() == pytest.approx(0.9 * 2)


def test_stepwise_clipping_raises_the_lower_bound_per_update_up_to_one():
    p = HACPOParams(cross_clip_delta=0.2, cross_clip_step=0.1)
    assert [round(p.cross_clip_lower(m), 10) for m in range(4)] == [0.8, 0.9, 1.0, 1.0]
    assert HACPOParams().cross_clip_lower(5) == pytest.approx(0.8)


def test_hacpo_batch_pools_peers_with_capability_advantages_and_exponential_weights(handles):
    own = group(PA, 0, [1.0, 0.0])
    n_cat, n_dog = len(peer_tokens(handles[PEER], " cat")), len(peer_tokens(handles[PEER], " dog"))
    # source mean log-probs -0.2 each; receiver means -0.1 (ratio e^.1 > 1: clamped) and -0.3
    peers = [
        rollout(PEER, handles[PEER], PA, " cat", 1.0, logprob_total=-0.2 * n_cat),
        rollout(PEER, handles[PEER], PA, " dog", 0.0, logprob_total=-0.2 * n_dog, seq=1),
    ]
    ctx = make_ctx(handles, peers, logprobs={RECV: per_token_logprobs({0: -0.1, 1: -0.3})})
    s = HACPO(HACPOParams(alpha=1.0))
    s.history = {RECV: [0.5], PEER: [1.0]}  # omega(peer) .5, coefficient 2
    [batch] = s.build_batches(ctx, RECV, own)
    adv = [q.advantage for q in batch.sequences]
    b = (1 + 0 + 0.5 * 1 + 0) / 4
    np.testing.assert_allclose(adv, [(1 - b) / (0.5 + EPS), (0 - b) / (0.5 + EPS)] * 2, rtol=1e-6)
    w = [q.weight for q in batch.sequences]
    assert w[:2] == [1.0, 1.0]
    assert w[2] == 0.0  # ratio > 1: clamped, no gradient
    assert w[3] == pytest.approx(math.exp(-0.1) ** 2 * 2, rel=1e-6)
    m = ctx.metrics[RECV]
    assert m["hacpo/peer_samples"] == 2 and m["hacpo/clamped_frac"] == 0.5
    assert m["hacpo/ratio_mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.1)) / 2, rel=1e-6)
    assert m["hacpo/coef_mean"] == 2.0 and m["hacpo/capability/" + RECV] == 0.5


def test_hacpo_capability_tracks_a_window_of_positive_rates_and_round_trips(handles):
    s = HACPO(HACPOParams(capability_window=2))
    for step, rewards in enumerate(([1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0] * 4)):
        s.observe(make_ctx(handles, step=step), {RECV: group(PA, 0, rewards)})
    assert s.history[RECV] == [0.5, 1e-8]  # window of 2; floor for no success
    assert s.capability(RECV) == pytest.approx(0.25) and s.capability(PEER) == 1.0
    assert s.coefficient(PEER, RECV) == pytest.approx(4.0)
    assert HACPO(HACPOParams(capability_ratio_max=3.0)).coefficient(PEER, RECV) == 1.0
    t = HACPO(HACPOParams())
    t.load_state_dict(s.state_dict())
    assert t.history == s.history


def test_hacpo_updates_per_step_split_sequences_with_stepwise_bounds(handles):
    own = group(PA, 0, [1.0, 0.0, 1.0, 0.0])
    peers = [
        rollout(PEER, handles[PEER], PA, t, 1.0, logprob_total=0.0, seq=i)
        for i, t in enumerate((" cat", " dog"))
    ]
    # receiver mean log-prob -0.15 against 0: ratio .86 inside [.8, 1] at m=0, below .9 at m=1
    ctx = make_ctx(
        handles,
        peers,
        grpo=GRPOConfig(num_generations=4),
        logprobs={RECV: per_token_logprobs({0: -0.15, 1: -0.15})},
    )
    batches = HACPO(HACPOParams(updates_per_step=2, cross_clip_step=0.1)).build_batches(
        ctx, RECV, own
    )
    assert [b.tag for b in batches] == ["grpo", "update1"]
    assert [len(b.sequences) for b in batches] == [3, 3]
    assert batches[0].sequences[-1].weight == pytest.approx(math.exp(-0.15) ** 2)
    assert batches[1].sequences[-1].weight == 0.0


def test_hacpo_params_fail_with_the_field_path():
    with pytest.raises(ConfigError, match=r"cross_clip_delta.*\$\.strategies\.hacpo"):
        build_strategy(
            load_config(TINY, ['strategy="hacpo"', "strategies.hacpo.cross_clip_delta=1.5"])
        )
    with pytest.raises(ConfigError, match="strategies.hacpo"):
        build_strategy(load_config(TINY, ['strategy="hacpo"', "strategies.hacpo.alfa=1.0"]))


# ---- codistill -------------------------------------------------------------------------------
def test_kd_rewards_are_per_token_means_of_the_larger_log_likelihood():
    total, n = torch.tensor([-2.0, -0.3]), torch.tensor([4, 3])
    torch.testing.assert_close(
        kd_rewards(total, n, "mean_logprob"), torch.tensor([-0.5, -0.1], dtype=torch.float64)
    )
    torch.testing.assert_close(
        kd_rewards(total, n, "mean_prob"),
        torch.tensor([math.exp(-0.5), math.exp(-0.1)], dtype=torch.float64),
    )


def codistill(handles, **params) -> CoDistill:
    s = CoDistill(CoDistillParams(**params), [])
    s.larger = PEER
    return s


def test_codistill_smaller_gets_the_shaped_reward_and_its_group_advantages(handles):
    own = group(PA, 0, [1.0, 0.0, 0.0, 0.0], text=" cat")
    means = {0: -0.1, 1: -0.5, 2: -1.0, 3: -2.0}  # larger's per-token log-probs
    calls = []

    def larger_logprobs(prompts, completions):
        calls.append((prompts, completions))
        return per_token_logprobs(means)(prompts, completions)

    ctx = make_ctx(handles, logprobs={PEER: larger_logprobs}, grpo=GRPOConfig(num_generations=4))
    [batch] = codistill(handles, kd_coef=0.5).build_batches(ctx, RECV, own)
    kd = np.exp([-0.1, -0.5, -1.0, -2.0])
    shaped = np.array([1.0, 0, 0, 0]) + 0.5 * kd
    expected = (shaped - shaped.mean()) / (shaped.std() + EPS)
    np.testing.assert_allclose([q.advantage for q in batch.sequences], expected, rtol=1e-5)
    # the larger scored the smaller's text in its own tokens, under its own prompt encoding
    [(prompts, completions)] = calls
    assert completions[0] == tuple(peer_tokens(handles[PEER], " cat"))
    assert prompts[0] == encoder(handles[PEER])(PA.text)
    assert ctx.metrics[RECV]["codistill/is_larger"] == 0
    assert ctx.metrics[RECV]["codistill/kd_reward_mean"] == pytest.approx(kd.mean())


def test_codistill_larger_trains_on_the_smaller_rollouts_with_truncated_weights(handles):
    own = group(PA, 0, [1.0, 0.0])
    peers = [
        rollout(RECV, handles[RECV], PA, " cat", 1.0, logprob_total=-1.0),
        rollout(RECV, handles[RECV], PA, " dog", 0.0, logprob_total=-1.0, seq=1),
        rollout(RECV, handles[RECV], PB, " fish", 1.0, logprob_total=-1.0, seq=2),
        rollout(RECV, handles[RECV], PB, " car", 1.0, logprob_total=-1.0, seq=3),
    ]
    totals = iter([torch.tensor([-0.5, -1.2, -0.8, -1.0], dtype=torch.float64)])
    ctx = make_ctx(handles, peers, logprobs={PEER: lambda p, c: next(totals)})
    [batch] = codistill(handles, ratio_cap=1.5).build_batches(ctx, PEER, own)
    assert all(q.source == RECV and q.old_logprobs is None for q in batch.sequences)  # "peer" only
    np.testing.assert_allclose(
        [q.weight for q in batch.sequences], [1.5, math.exp(-0.2), math.exp(0.2), 1.0], rtol=1e-6
    )
    np.testing.assert_allclose(
        [q.advantage for q in batch.sequences],
        [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0, 0.0],
        rtol=1e-6,
    )
    assert ctx.metrics[PEER]["codistill/truncated_frac"] == 0.25
    both = make_ctx(
        handles, peers, logprobs={PEER: lambda p, c: torch.zeros(len(c), dtype=torch.float64)}
    )
    [batch] = codistill(handles, larger_trains_on="both").build_batches(both, PEER, own)
    assert len(batch.sequences) == 6 and batch.sequences[0].source == ""


def test_codistill_larger_comes_from_parameter_counts_and_a_bad_name_fails():
    cfg = load_config(TINY, ['strategy="codistill"'])
    with pytest.raises(ConfigError, match="strategies.codistill.larger"):
        build_strategy(
            load_config(TINY, ['strategy="codistill"', 'strategies.codistill.larger="nobody"'])
        )
    s = build_strategy(cfg)
    assert s.larger is None and set(s.policy_cfgs) == {p.name for p in cfg.policies}


# ---- hint ------------------------------------------------------------------------------------
def test_hint_prefixes_never_give_the_whole_solution():
    assert hint_prefix(" cat", 0.25) == " " and hint_prefix(" cat", 0.5) == " c"
    assert hint_prefix(" cat", 0.99) == " ca" and hint_prefix("x", 0.5) == ""


def test_hint_params_are_checked():
    with pytest.raises(ConfigError, match="tiers"):
        build_strategy(load_config(TINY, ['strategy="hint"', "strategies.hint.tiers=[0.5, 0.25]"]))
    with pytest.raises(ConfigError, match="patience"):
        build_strategy(load_config(TINY, ['strategy="hint"', "strategies.hint.patience=0"]))


class HintedSampler:
    """``generate`` stub: the given completion texts for each call, in order, recorded."""

    def __init__(self, texts_per_call):
        self.texts = list(texts_per_call)
        self.prompts = []

    def __call__(self, prompts, num_generations):
        [prompt] = prompts
        self.prompts.append(prompt)
        texts = self.texts.pop(0)
        assert len(texts) == num_generations
        return [
            Sample(
                prompt=prompt,
                prompt_ids=(1, 7),
                completion_ids=(40 + i, 2),
                logprobs=(-0.3, -0.1),
                text=t,
                finish_reason="stop",
                group=0,
            )
            for i, t in enumerate(texts)
        ]


def test_hint_escalates_tiers_until_a_hinted_group_succeeds(handles):
    own = group(PA, 0, [0.0, 0.0]) + group(PB, 1, [1.0, 0.0])
    peers = [
        rollout(PEER, handles[PEER], PA, " cat", 1.0),
        rollout(PEER, handles[PEER], PB, " fish", 1.0),
    ]
    sampler = HintedSampler([["x", "y"], ["at", "og"]])  # tier 0 (" ") fails, tier 1 (" c") works
    ctx = make_ctx(handles, peers)
    ctx.generate, ctx.verify = {RECV: sampler}, lambda prompt, text: float(text == prompt.answer)
    s = PeerHints(HintParams(tiers=(0.25, 0.5)))
    s.observe(ctx, {RECV: own})
    assert s.fail_streak[RECV] == {PA.id: 1}  # PB had a success
    [batch] = s.build_batches(ctx, RECV, own)
    assert [(p.text, p.prefill) for p in sampler.prompts] == [(PA.text, " "), (PA.text, " c")]
    assert len(batch.sequences) == 6
    hinted = batch.sequences[4:]
    assert [q.prompt_ids for q in hinted] == [(1, 7)] * 2 and hinted[0].old_logprobs == (-0.3, -0.1)
    np.testing.assert_allclose(
        [q.advantage for q in hinted], [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)], rtol=1e-6
    )
    assert [q.advantage for q in batch.sequences[:2]] == [0.0, 0.0]
    m = ctx.metrics[RECV]
    assert (m["hint/candidates"], m["hint/rescued_prompts"], m["hint/generated"]) == (1, 1, 4)
    assert (m["hint/tier_0_used"], m["hint/tier_1_used"]) == (0, 1)
    t = PeerHints(HintParams())
    t.load_state_dict(s.state_dict())
    assert t.fail_streak == s.fail_streak


def test_hint_waits_for_patience_and_needs_a_peer_success(handles):
    own = group(PA, 0, [0.0, 0.0])
    ctx = make_ctx(handles, [rollout(PEER, handles[PEER], PA, " dog", 0.0)])
    s = PeerHints(HintParams(patience=2))
    s.observe(ctx, {RECV: own})
    s.build_batches(ctx, RECV, own)
    assert ctx.metrics[RECV]["hint/candidates"] == 0  # streak 1 < patience 2
    s.observe(ctx, {RECV: own})
    s.build_batches(ctx, RECV, own)
    assert ctx.metrics[RECV]["hint/candidates"] == 0  # no peer success to hint from


# ---- diversity regulariser -------------------------------------------------------------------
def test_repulsive_term_discounts_successes_where_peers_succeed():
    from mutualrl.strategies.diversity import repulsed_rewards

    assert repulsed_rewards([1.0, 0.0, 1.0, 0.5], [0.5, 1.0, None, 1.0], 0.5) == [
        0.75,
        0.0,
        1.0,
        0.25,
    ]


def test_diversity_wraps_any_strategy_only_when_on(handles):
    from mutualrl.strategies.diversity import DiversityRegularised
    from mutualrl.strategies.none import Independent
    from mutualrl.strategies.sgt import SuccessGatedTransfer

    assert isinstance(build_strategy(load_config(TINY, ['strategy="none"'])), Independent)
    with pytest.raises(ConfigError, match=r"diversity.coef|coef must be"):
        load_config(TINY, ["diversity.coef=2.0"])
    wrapped = build_strategy(load_config(TINY, ['strategy="sgt"', "diversity.coef=0.5"]))
    assert isinstance(wrapped, DiversityRegularised) and isinstance(
        wrapped.inner, SuccessGatedTransfer
    )
    assert wrapped.name == "sgt" and wrapped.params.tau == 1.0  # the inner's parameters
    own = group(PA, 0, [1.0, 0.0])
    peers = [
        rollout(PEER, handles[PEER], PA, " cat", 1.0),
        rollout(PEER, handles[PEER], PA, " dog", 0.0, seq=1),
    ]
    ctx = make_ctx(handles, peers)
    [batch] = DiversityRegularised(Independent(), 0.5).build_batches(ctx, RECV, own)
    # s_peers = .5: rewards [1, 0] -> [.75, 0]; mean .375, std .375
    np.testing.assert_allclose(
        [q.advantage for q in batch.sequences],
        [0.375 / (0.375 + EPS), -0.375 / (0.375 + EPS)],
        rtol=1e-6,
    )
    assert ctx.metrics[RECV]["diversity/reward_shift_mean"] == pytest.approx(-0.125)


def test_diversity_is_refused_for_xgrpo_naming_why():
    # xgrpo's baselines pool verified peer rewards: a shaped own reward raised IndexError under
    # the rank estimator and could fall below the baseline under the z-score
    for estimator in ("zscore", "rank"):
        with pytest.raises(
            ConfigError,
            match=r"diversity.coef = 0.5: strategy 'xgrpo' cannot "
            r"take the regulariser: its baselines pool",
        ):
            build_strategy(
                load_config(
                    TINY,
                    [
                        'strategy="xgrpo"',
                        "diversity.coef=0.5",
                        f'strategies.xgrpo.estimator="{estimator}"',
                    ],
                )
            )


def test_residual_metrics_cover_every_move_of_the_step(handles):
    """Two moves into one receiver in one step (SGT's SFT-only steps make several): the thl/
    metrics are over both (each used to overwrite the last), and each record is published."""
    from mutualrl.strategies.common import adapt_to_receiver

    published = []
    ctx = make_ctx(handles, [])
    ctx.publish = lambda record, receiver: published.append(receiver)
    first = [rollout(PEER, handles[PEER], PA, " cat", 1.0)]
    second = [
        rollout(PEER, handles[PEER], PA, " dog", 1.0, seq=1),
        rollout(PEER, handles[PEER], PA, " sun", 0.0, seq=2),
    ]
    adapt_to_receiver(ctx, RECV, first)
    assert ctx.metrics[RECV]["thl/count"] == 1
    adapt_to_receiver(ctx, RECV, second)
    assert ctx.metrics[RECV]["thl/count"] == 3 and published == [RECV] * 3


def test_a_hint_opens_the_answer_under_a_chat_template_and_follows_the_question_in_raw_text(
    handles,
):
    """``Prompt.prefill`` (the hint strategy's partial solution): raw text encodes question +
    hint as one text, as before; under a chat template the hint follows the assistant turn's
    opening. It was appended to the question, inside the user's message."""
    from dataclasses import replace as with_field
    from pathlib import Path

    import msgspec

    from mutualrl.config import PolicyConfig
    from mutualrl.policies.policy import PolicyView
    from mutualrl.tasks.base import Prompt

    cfg = PolicyConfig(
        name="q",
        architecture="qwen2",
        tokenizer="qwen2.5",
        hidden_size=32,
        num_layers=1,
        num_heads=4,
    )
    from mutualrl.retokenize import load_tokenizer

    handle = load_tokenizer("qwen2.5")
    raw = PolicyView(cfg, handle)
    template = (
        Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "qwen2.5-instruct.jinja"
    )
    chat = PolicyView(msgspec.structs.replace(cfg, chat_template=str(template)), handle)
    q = Prompt(text="What is 2+3?", answer="5", family="sum")
    hinted = with_field(q, prefill="The answ")
    assert raw.encode_prompt(q.text, hinted.prefill) == raw.encode_prompt("What is 2+3?The answ")
    text = handle.tokenizer.decode(chat.encode_prompt(q.text, hinted.prefill))
    assert text.endswith("What is 2+3?<|im_end|>\n<|im_start|>assistant\nThe answ")
    assert hinted.id == q.id
