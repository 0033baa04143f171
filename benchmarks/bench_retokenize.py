"""Retokenization benchmarks (pytest-benchmark) and a script entry.

    pytest benchmarks/bench_retokenize.py --benchmark-only      # per-pair timings, ours vs peers
    python benchmarks/bench_retokenize.py [--repeats N ...]      # same as `mutualrl bench
    retokenize`

The measurement logic lives in ``mutualrl.bench.retokenize`` (shared with the CLI); peers
(TRL's byte-offset walk, spacy-alignments, a naive decode-prefix aligner) are in
``mutualrl.bench.baselines`` and skipped when their package is missing.
"""

from __future__ import annotations

import pytest

from mutualrl.bench import baselines
from mutualrl.bench.retokenize import DEFAULT_PAIRS, PairData, _offsets, load_corpus
from mutualrl.retokenize import Retokenizer, load_tokenizer
from mutualrl.retokenize.align import align_many

PAIR_IDS = [f"{s}->{t}" for s, t in DEFAULT_PAIRS]


@pytest.fixture(scope="module")
def pair_data():
    texts = load_corpus()
    rts = {
        n: Retokenizer(load_tokenizer(n), cache_size=0)
        for n in {x for p in DEFAULT_PAIRS for x in p}
    }
    return {f"{s}->{t}": PairData.build(rts[s], rts[t], texts) for s, t in DEFAULT_PAIRS}


@pytest.mark.parametrize("pair", PAIR_IDS)
def test_encode_target(benchmark, pair_data, pair):
    d = pair_data[pair]
    backend = d.tgt.profile.continuation
    benchmark(lambda: [backend.encode(t, add_special_tokens=False).ids for t in d.texts])


@pytest.mark.parametrize("pair", PAIR_IDS)
def test_align_ours(benchmark, pair_data, pair):
    d = pair_data[pair]
    benchmark(align_many, d.src_ends, d.tgt_ends, d.totals)


@pytest.mark.parametrize("pair", PAIR_IDS)
def test_align_trl(benchmark, pair_data, pair):
    trl = baselines.trl_align_fn()
    if trl is None:
        pytest.skip("trl not installed")
    d = pair_data[pair]
    s_off, t_off = [_offsets(e) for e in d.src_ends], [_offsets(e) for e in d.tgt_ends]
    benchmark(lambda: [trl(a, b) for a, b in zip(s_off, t_off)])


@pytest.mark.parametrize("pair", PAIR_IDS)
def test_align_spacy(benchmark, pair_data, pair):
    spacy = baselines.spacy_align_fn()
    if spacy is None:
        pytest.skip("spacy-alignments not installed")
    d = pair_data[pair]
    s_tok = [
        [d.src.profile.pieces[i].decode(errors="replace") for i in ids.tolist()]
        for ids in d.src_ids
    ]
    t_tok = [
        [d.tgt.profile.pieces[i].decode(errors="replace") for i in ids.tolist()]
        for ids in d.tgt_ids
    ]
    benchmark(lambda: [spacy(a, b) for a, b in zip(s_tok, t_tok)])


@pytest.mark.parametrize("pair", PAIR_IDS)
def test_align_naive(benchmark, pair_data, pair):
    d = pair_data[pair]
    sdec, tdec = d.src.profile.continuation.decode, d.tgt.profile.continuation.decode
    s_ids = [i.tolist() for i in d.src_ids[:4]]
    t_ids = [i.tolist() for i in d.tgt_ids[:4]]
    benchmark.pedantic(
        lambda: [
            baselines.naive_decode_prefix_align(sdec, a, tdec, b) for a, b in zip(s_ids, t_ids)
        ],
        rounds=3,
    )


@pytest.mark.parametrize("pair", PAIR_IDS)
def test_end_to_end(benchmark, pair_data, pair):
    d = pair_data[pair]
    src = d.src.target
    out = benchmark(
        lambda: d.tgt.retokenize_batch(
            d.texts, source=src, source_ids=d.src_ids, source_logprobs=d.src_lps
        )
    )
    assert max(o.residuals.logprob_mass_error for o in out) < 1e-6


if __name__ == "__main__":
    from mutualrl.bench.retokenize_cli import main

    raise SystemExit(main())
