"""The strategy kit (``strategies.common``): the mixed group, peer sequences, which rows train."""

from __future__ import annotations

import pytest
import torch

from mutualrl.config import GRPOConfig
from mutualrl.strategies import STRATEGIES
from mutualrl.strategies.common import (
    batch_of,
    group_count,
    kept_rows,
    mixed_group,
    own_sequences,
    receive_peers,
    sequences_from_samples,
)

from .helpers import PA, PB, PC, PEER, RECV, encoder, group, make_ctx, rollout


def test_kept_rows_drop_zero_std_rows_only_when_asked():
    zero = torch.tensor([True, False, True])
    assert kept_rows(zero, GRPOConfig(skip_zero_std_groups=False)) == [True, True, True]
    assert kept_rows(zero, GRPOConfig(skip_zero_std_groups=True)) == [False, True, False]


def test_sequences_from_samples_keep_own_behaviour_logprobs():
    own = group(PA, 0, [1.0, 0.0]) + group(PB, 1, [1.0, 1.0])
    grpo = GRPOConfig(skip_zero_std_groups=True)
    seqs = sequences_from_samples(
        own, torch.tensor([1.0, -1.0, 0.0, 0.0]), torch.tensor([False, False, True, True]), grpo
    )
    assert [s.advantage for s in seqs] == [1.0, -1.0]
    assert [s.old_logprobs for s in seqs] == [own[0].logprobs, own[1].logprobs]
    assert own_sequences([], grpo) == [] and batch_of([]) == [] and group_count([]) == 0
    assert [len(b.sequences) for b in batch_of(seqs, tag="x")] == [2]


def test_mixed_group_joins_peers_to_the_receivers_groups(handles):
    own = group(PA, 0, [1.0, 0.0]) + group(PB, 1, [0.0, 0.0])
    hp = handles[PEER]
    exp = [
        rollout(PEER, hp, PB, " fish", 1.0, seq=0),
        rollout(PEER, hp, PA, " cat", 0.5, seq=1),
        rollout(PEER, hp, PA, " dog", 0.0, seq=2),
        rollout(PEER, hp, PC, " king", 1.0, seq=3),
    ]
    ctx = make_ctx(handles, exp)
    mixed = mixed_group(ctx, RECV, own, max_per_group=None)
    assert mixed.n_own == 4 and len(mixed.peers) == 3 and mixed.num_groups == 2  # C is not ours
    assert mixed.rewards.dtype == torch.float32 and mixed.groups.dtype == torch.long
    assert mixed.rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0]
    assert mixed.groups.tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert mixed.peers.sources == [PEER] * 3
    assert mixed.peers.prompts[0] == encoder(handles[RECV])(PB.text)
    capped = mixed_group(make_ctx(handles, exp), RECV, own, max_per_group=1)
    assert capped.groups.tolist() == [0, 0, 1, 1, 1, 0]
    # peer rows: no behaviour log-probs, their weight and source; ``select`` picks rows
    adv = torch.arange(7, dtype=torch.float32)
    zero = torch.tensor([False] * 4 + [False, True, False])
    w = torch.tensor([0.5, 1.0, 2.0])
    seqs = mixed.peer_sequences(adv, zero, w, GRPOConfig(skip_zero_std_groups=True))
    assert [(s.advantage, s.weight, s.old_logprobs, s.source) for s in seqs] == [
        (4.0, 0.5, None, PEER),
        (6.0, 2.0, None, PEER),
    ]
    picked = mixed.peer_sequences(
        adv, zero, w, GRPOConfig(), select=torch.tensor([False, True, True])
    )
    assert [s.advantage for s in picked] == [5.0, 6.0]
    assert [s.advantage for s in mixed.own_sequences(adv, zero, GRPOConfig())] == [
        0.0,
        1.0,
        2.0,
        3.0,
    ]


def test_received_peers_as_sft_examples(handles):
    exp = [rollout(PEER, handles[PEER], PA, " cat", 1.0)]
    peers = receive_peers(make_ctx(handles, exp), RECV, exp)
    [ex] = peers.sft_examples()
    assert (ex.prompt_ids, ex.completion_ids, ex.source) == (
        peers.prompts[0],
        peers.completions[0],
        PEER,
    )
    assert receive_peers(make_ctx(handles), RECV, []).sft_examples() == ()


@pytest.mark.parametrize("estimator", ["zscore", "rank"])
@pytest.mark.parametrize("name", ["none", "prp", "xgrpo", "sgt", "hacpo", "codistill", "hint"])
def test_a_receiver_without_samples_gets_no_batch(handles, name, estimator):
    spec = STRATEGIES.get(name)
    params = spec.params(
        **({"larger_trains_on": "both", "larger": RECV} if name == "codistill" else {})
    )
    strategy = spec.factory(params, None)
    ctx = make_ctx(handles, grpo=GRPOConfig(advantage_estimator=estimator))
    assert [b for b in strategy.build_batches(ctx, RECV, []) if b.sequences] == []
