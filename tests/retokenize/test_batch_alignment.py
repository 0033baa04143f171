"""A batch's whole-batch passes against each text alone: the alignment of ends laid end to end
(``align_flat``) and of a list per side (``align_batch``), the per-text statistics the residuals
need (``BatchAlignment.statistics``) against each text's own groups, and the spelling check of
ids laid end to end (``spelled_ends``) against each text's bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mutualrl.retokenize.align import align_batch, align_ends, align_flat
from mutualrl.retokenize.encoded import spelled_ends


def _ends(draw, total: int, pinned: bool) -> np.ndarray:
    """Non-decreasing ends in [0, total] (zero-length tokens included); the last == total when
    ``pinned`` (as the retokenizer makes them)."""
    n = draw(st.integers(1, 12))
    ends = sorted(draw(st.lists(st.integers(0, total), min_size=n, max_size=n)))
    if pinned:
        ends[-1] = total
    return np.array(ends, dtype=np.int64)


@st.composite
def batches(draw, pinned: bool = True):
    k = draw(st.integers(1, 6))
    totals = [draw(st.integers(0, 30)) for _ in range(k)]
    src = [_ends(draw, t, pinned) for t in totals]
    tgt = [_ends(draw, t, pinned) for t in totals]
    for i in draw(st.lists(st.integers(0, k - 1), max_size=2)):  # texts with an empty side
        (src if draw(st.booleans()) else tgt)[i] = np.zeros(0, dtype=np.int64)
    return src, tgt, totals


@settings(max_examples=300, deadline=None)
@given(batch=batches(pinned=True))
def test_batch_statistics_are_each_texts_own(batch):
    """Per text: its groups; groups 1:1, 1:n, n:1; the largest group's source tokens, target
    tokens and bytes; the distinct ends of each side, as counted on the text's own groups."""
    src, tgt, totals = batch
    got = align_batch(src, tgt, totals)
    if got is None:
        return
    stats = got.statistics()
    for j, k in enumerate(got.full):
        g = align_ends(src[k], tgt[k], totals[k])
        ns, nt = g.source_sizes(), g.target_sizes()
        want = [
            len(g),
            int(((ns == 1) & (nt == 1)).sum()),
            int(((ns == 1) & (nt > 1)).sum()),
            int(((ns > 1) & (nt == 1)).sum()),
            int(ns.max()),
            int(nt.max()),
            int((g.byte_end - g.byte_start).max()),
            np.unique(src[k]).size,
            np.unique(tgt[k]).size,
        ]
        assert stats[:, j].tolist() == want


@settings(max_examples=200, deadline=None)
@given(batch=batches(pinned=True))
def test_ends_laid_end_to_end_align_as_the_list_of_arrays_does(batch):
    """``align_flat`` (a batch's sides as whole-batch arrays) against ``align_batch`` (a list per
    side), texts with an empty side included; the arrays given are left as they were."""
    src, tgt, totals = batch
    flat = [(np.concatenate(side), np.array([e.size for e in side])) for side in (src, tgt)]
    for a, _ in flat:
        a.flags.writeable = False
    want = align_batch(src, tgt, totals)
    got = align_flat(*flat[0], *flat[1], np.array(totals, dtype=np.int64))
    if want is None:
        assert got is None
        return
    assert got.full == want.full and np.array_equal(got.local, want.local)
    assert np.array_equal(got.split, want.split)
    assert np.array_equal(got.statistics(), want.statistics())
    assert np.array_equal(got.src_offset, want.src_offset)
    assert np.array_equal(got.tgt_offset, want.tgt_offset)


@pytest.mark.parametrize("name", ["qwen2.5", "mistral-v1"])
def test_spelling_check_of_a_batch_is_each_texts_own(name):
    from mutualrl.retokenize.loaders import load_tokenizer
    from mutualrl.retokenize.retokenizer import Retokenizer

    prof = Retokenizer(load_tokenizer(name)).profile
    rng = np.random.default_rng(0)
    texts = ["the cat sat", "naïve café ✓", "x = 1 + 2\n", "", "  two  spaces", "漢字 and ascii"]
    ids = [
        np.array(e.ids, dtype=np.int64)
        for e in prof.continuation.encode_batch(texts, add_special_tokens=False)
    ]
    datas = [t.encode() for t in texts]
    ids[0] = ids[0][::-1].copy()  # the same bytes in another order
    ids[2] = ids[2][:-1].copy()  # one token short
    ids.append(np.zeros(0, np.int64))  # no ids for a non-empty text
    datas.append(b"x")
    for _ in range(40):  # random ids, their own bytes, one changed
        a = rng.integers(0, prof.piece_len.size, size=int(rng.integers(1, 30)))
        d = bytearray(prof.text_bytes(a.tolist()))
        if d and rng.random() < 0.5:
            d[int(rng.integers(len(d)))] ^= 1
        ids.append(a.astype(np.int64))
        datas.append(bytes(d))
    sizes = np.array([a.size for a in ids])
    flat = np.concatenate(ids)
    spells, ends = spelled_ends(prof, flat, sizes, datas)
    assert spells.tolist() == [prof.text_bytes(a.tolist()) == d for a, d in zip(ids, datas)]
    want = np.concatenate([np.cumsum(prof.piece_len[a]) for a in ids])
    assert np.array_equal(ends, want) and not ends.flags.writeable
    assert 0 < spells.sum() < spells.size


def test_an_id_out_of_range_is_refused():
    from mutualrl.retokenize.loaders import load_tokenizer
    from mutualrl.retokenize.retokenizer import Retokenizer

    prof = Retokenizer(load_tokenizer("mistral-v1")).profile
    for bad in (prof.piece_len.size, -prof.piece_len.size - 1):
        with pytest.raises(IndexError):
            spelled_ends(prof, np.array([5, bad], dtype=np.int64), np.array([2]), [b"ab"])
