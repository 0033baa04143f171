"""The retokenization benchmark's measurement plumbing, on a few texts (timings not judged)."""

from __future__ import annotations

import gc
import json
import time

import numpy as np
import pytest

from mutualrl.bench import baselines
from mutualrl.bench.floor import floor, floor_results
from mutualrl.bench.retokenize import DEFAULT_PAIRS, PairData, load_corpus, run_benchmark
from mutualrl.provenance import time_alternating, time_calls, time_turns
from mutualrl.retokenize.align import align_batch
from mutualrl.retokenize.residuals import AlignmentResiduals
from mutualrl.retokenize.retokenizer import Retokenizer


def write_corpus(tmp_path, texts: list[str]):
    """A one-file corpus of ``texts`` (the benchmark's JSONL format); its folder."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"completion": t}) + "\n" for t in texts))
    return corpus


def test_time_alternating_takes_the_contenders_in_turn_each_round_starting_one_later():
    calls = []
    a, b = time_alternating((lambda: calls.append("a"), lambda: calls.append("b")), 3)
    assert calls == list("ababbaab")  # one warm-up of each, then A B, B A, A B
    assert len(a) == len(b) == 3 and all(t >= 0 for t in a + b)
    calls.clear()
    times = time_alternating([lambda c=c: calls.append(c) for c in "xyz"], 4)
    assert calls == list("xyzxyzyzxzxyxyz") and [len(t) for t in times] == [4] * 3


def test_each_contenders_times_are_its_own_whatever_the_round_order():
    (slow, fast), _ = time_turns((lambda: time.sleep(0.003), lambda: None), 4)
    assert min(slow) >= 0.003 > max(fast)


def test_time_turns_fills_each_turn_with_calls_and_reports_time_per_call():
    calls = []
    (slow, fast), per_turn = time_turns(
        (lambda: (calls.append("s"), time.sleep(0.004)), lambda: calls.append("f")),
        3,
        min_turn_s=0.004,
    )
    k = per_turn[1]
    assert per_turn[0] == 1 and k > 1  # one call fills the slow side's turn
    turn_s, turn_f = ["s"], ["f"] * k
    assert calls == ["s", "s", "f", "f"] + turn_s + turn_f + turn_f + turn_s + turn_s + turn_f
    assert len(slow) == len(fast) == 3 and min(slow) >= 0.004 > max(fast)
    assert time_turns((lambda: None,), 2)[1] == [1]  # no minimum: one call a turn


def test_the_timers_pause_the_garbage_collector_while_they_time():
    seen = []
    time_calls(lambda: seen.append(gc.isenabled()), 2)
    time_turns((lambda: seen.append(gc.isenabled()),), 2, min_turn_s=0.001)
    assert seen and not any(seen) and gc.isenabled()


def test_benchmark_reports_paired_goal_ratios(handles, tmp_path):
    corpus = write_corpus(
        tmp_path, ["The answer is 42.", "Второй ответ 😀", "def f(x):\n    return x + 1\n"]
    )
    out = run_benchmark(
        [("deepseek-v3", "mistral-v1")],
        corpus=corpus,
        repeats=2,
        naive_texts=0,
        peers=False,
        handles=dict(handles),
    )
    (pair,) = out["pairs"]
    for key in (
        "end_to_end_batch_over_encode_batch",
        "floor_over_encode_batch",
        "end_to_end_batch_over_floor",
        "floor_results_over_encode_batch",
        "end_to_end_batch_over_floor_results",
    ):
        paired = pair["paired"][key]
        assert paired["pairs"] == 2 and 0 < paired["min"] <= paired["median"] <= paired["max"]
    assert "align_speedup_vs_trl" not in pair["paired"]  # peers off: no TRL contender
    assert set(pair["end_to_end_batch_parts_over_encode_batch"]) == {
        "target_side",
        "source_side",
        "align_and_assemble",
    }
    assert pair["residuals"]["logprob_mass_error_max"] < 1e-9


def test_the_cache_is_timed_with_every_text_a_miss_then_a_hit(handles, tmp_path):
    texts = [
        "The Answer is 42.",
        "Второй ответ 😀",
        "def f(x):\n    return x + 1\n",
        "ok \U00030000",
    ]
    corpus = write_corpus(tmp_path, texts)
    out = run_benchmark(
        [("deepseek-v3", "mistral-v1"), ("bert-wordpiece", "mistral-v1")],
        corpus=corpus,
        repeats=2,
        naive_texts=0,
        peers=False,
        handles=dict(handles),
    )
    # The receiver encodes every text; a WordPiece sender only those its ids do not walk along
    # (``wordpiece.folded_ends``): the one with a character past its fold table.
    for pair, encoded in zip(out["pairs"], (len(texts), len(texts) + 1)):
        miss = pair["paired"]["cache_all_miss_over_cache_off"]
        hit = pair["paired"]["cache_all_hit_over_cache_off"]
        assert miss["pairs"] == hit["pairs"] == 2 and miss["min"] > 0 and hit["min"] > 0
        # a warm-up and two timed calls each: every lookup of those calls missed, or hit
        assert miss["lookups_missed"] == hit["lookups_hit"] == 3 * encoded


def test_the_floor_aligns_as_the_retokenizer_does(handles):
    """The benchmark's floor skips the checks but not the work: on texts whose ids spell them,
    its alignment is the retokenizer's."""
    texts = ["The answer is 42.", "Второй ответ 😀", "def f(x):\n    return x + 1\n", "x"]
    src = Retokenizer(handles["deepseek-v3"], cache_size=0)
    tgt = Retokenizer(handles["mistral-v1"], cache_size=0)
    d = PairData.build(src, tgt, texts)
    got, want = floor(d)(), align_batch(d.src_ends, d.tgt_ends, d.totals)
    assert got.full == want.full and (got.local == want.local).all()


def test_the_floor_aligns_as_the_retokenizer_does_with_wordpiece(handles):
    """With a WordPiece side the floor takes that side's byte ends from its encoding's offsets
    (the ids do not spell the text), as the retokenizer does: the same alignment."""
    texts = [
        "The Answer is 42.",
        "Второй ответ 😀",
        "def f(x):\n    return x + 1\n",
        "x",
        "  spaced   out  ",
        "Ünïcödé ÀÉÎ",
    ]
    for src_name, tgt_name in (("bert-wordpiece", "mistral-v1"), ("deepseek-v3", "bert-wordpiece")):
        src = Retokenizer(handles[src_name], cache_size=0)
        tgt = Retokenizer(handles[tgt_name], cache_size=0)
        d = PairData.build(src, tgt, texts)
        want = align_batch(d.src_ends, d.tgt_ends, d.totals)
        for got in (floor(d)(), floor(d, residuals=True)()):
            assert got.full == want.full and (got.local == want.local).all()


def test_a_wordpiece_receiver_also_gets_the_floor_with_its_rendering(handles, tmp_path):
    corpus = write_corpus(tmp_path, ["The Answer is 42.", "Второй ответ 😀"])
    out = run_benchmark(
        [("deepseek-v3", "bert-wordpiece"), ("bert-wordpiece", "mistral-v1")],
        corpus=corpus,
        repeats=2,
        naive_texts=0,
        peers=False,
        handles=dict(handles),
    )
    wordpiece, lossless = (p["paired"] for p in out["pairs"])
    assert wordpiece["floor_rendered_over_encode_batch"]["pairs"] == 2
    assert wordpiece["end_to_end_batch_over_floor_rendered"]["min"] > 0
    assert wordpiece["end_to_end_batch_over_floor_residuals"]["pairs"] == 2
    assert "floor_residuals_over_encode_batch" not in lossless
    assert "floor_rendered_over_encode_batch" not in lossless  # a lossless receiver: no decode
    # ... but its encode as the retokenizer calls it (no offsets), timed and paired
    assert lossless["end_to_end_batch_over_encode_batch_fast"]["pairs"] == 2
    # WordPiece is encoded without offsets too (its ids walked): timed, its round already full
    assert "encode_batch_fast" in out["pairs"][1]["timings"]
    assert "encode_batch_fast" in out["pairs"][0]["timings"]
    assert "end_to_end_batch_over_encode_batch_fast" not in wordpiece


def test_with_trl_the_aligners_alternate_call_by_call_and_in_turns(handles, tmp_path):
    if baselines.trl_align_fn() is None:
        pytest.skip("TRL is not installed")
    corpus = write_corpus(
        tmp_path, ["The answer is 42.", "Второй ответ 😀", "def f(x):\n    return x + 1\n"]
    )
    out = run_benchmark(
        [("deepseek-v3", "mistral-v1")],
        corpus=corpus,
        repeats=2,
        naive_texts=0,
        peers=True,
        handles=dict(handles),
    )
    paired = out["pairs"][0]["paired"]
    assert paired["align_speedup_vs_trl"]["pairs"] == 2
    turns = paired["align_speedup_vs_trl_turns"]
    assert turns["pairs"] == 2 and turns["min"] > 0 and len(turns["calls_per_turn"]) == 2
    assert all(k >= 1 for k in turns["calls_per_turn"])  # each side fills its 20 ms turn


@pytest.mark.parametrize("pair", DEFAULT_PAIRS)
def test_the_results_floor_builds_exactly_the_retokenizers_results(handles, pair):
    """``floor_results`` is the least work the result needs, so it must do all of it: on the
    benchmark corpus (a literal '▁' that Mistral's ids cannot spell, Hangul, emoji, code) its
    trajectories equal ``retokenize_batch``'s, bit for bit and type for type."""
    texts = load_corpus()
    src = Retokenizer(handles[pair[0]], cache_size=0)
    tgt = Retokenizer(handles[pair[1]], cache_size=0)
    d = PairData.build(src, tgt, texts)
    got = floor_results(d)()
    want = tgt.retokenize_batch(
        texts, source=src.target, source_ids=d.src_ids, source_logprobs=d.src_lps
    )
    assert len(got) == len(want) == len(texts)
    for a, b in zip(got, want):
        assert a.text == b.text and np.array_equal(a.target_ids, b.target_ids)
        assert a.group_logprob_sums.tobytes() == b.group_logprob_sums.tobytes()
        for x, y in zip(a.groups.columns(), b.groups.columns()):
            assert np.array_equal(x, y)
        for f in AlignmentResiduals.__struct_fields__:
            x, y = getattr(a.residuals, f), getattr(b.residuals, f)
            assert type(x) is type(y) and x == y, (f, x, y)
    if "mistral-v1" in pair:  # the '▁' text: Mistral's ids do not spell it, on either side
        assert any(r.residuals.roundtrip_mismatch or r.residuals.source_mismatch for r in got)


def test_the_results_floor_refuses_what_it_does_not_handle(handles):
    texts = ["one two", "three"]
    src = Retokenizer(handles["deepseek-v3"], cache_size=0)
    tgt = Retokenizer(handles["mistral-v1"], cache_size=0)
    d = PairData.build(src, tgt, texts)
    d.src_ids[0] = np.append(d.src_ids[0], src.profile.eos_id)  # a special
    with pytest.raises(ValueError, match="no specials"):
        floor_results(d)()
    d = PairData.build(src, tgt, texts)
    d.src_lps[1] = d.src_lps[1][:-1]  # a log-prob short
    with pytest.raises(ValueError, match="one finite float64 log-prob per id"):
        floor_results(d)()
