"""The vectorised aligner against a Python two-pointer walk and a binary-search formulation."""

from __future__ import annotations

import numpy as np
import pytest

from mutualrl.bench.baselines import two_pointer_walk
from mutualrl.retokenize.align import AlignmentGroups, align_ends, align_many


def _random_ends(rng, total: int, n: int, duplicates: bool) -> np.ndarray:
    """n token ends in [1, total], the last == total; with ``duplicates``, zero-length tokens."""
    inner = rng.choice(np.arange(1, total), size=min(n - 1, total - 1), replace=duplicates)
    return np.sort(np.concatenate([inner, [total]])).astype(np.int64)


def _by_binary_search(src: np.ndarray, tgt: np.ndarray) -> list[tuple[int, ...]]:
    """Groups from the common ends, each side's range found by searchsorted (right side)."""
    bounds = np.intersect1d(src, tgt)
    s = np.searchsorted(src, bounds, side="right")
    t = np.searchsorted(tgt, bounds, side="right")
    s0, t0, b0 = np.r_[0, s[:-1]], np.r_[0, t[:-1]], np.r_[0, bounds[:-1]]
    return list(zip(s0.tolist(), s.tolist(), t0.tolist(), t.tolist(), b0.tolist(), bounds.tolist()))


def _rows(g: AlignmentGroups) -> list[tuple[int, ...]]:
    return list(
        zip(
            *(
                a.tolist()
                for a in (g.src_start, g.src_end, g.tgt_start, g.tgt_end, g.byte_start, g.byte_end)
            )
        )
    )


@pytest.mark.parametrize("seed", range(20))
def test_strictly_increasing_ends_group_as_the_two_pointer_walk(seed):
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 300))
    src = _random_ends(rng, total, int(rng.integers(1, total + 1)), duplicates=False)
    tgt = _random_ends(rng, total, int(rng.integers(1, total + 1)), duplicates=False)
    g = align_ends(src, tgt, total)
    assert [r[:4] for r in _rows(g)] == two_pointer_walk(src.tolist(), tgt.tolist())
    assert _rows(g) == _by_binary_search(src, tgt)  # byte ranges too
    assert all(a.dtype == np.int64 for a in g.columns())


@pytest.mark.parametrize(
    ("src", "tgt"),
    [([0, 3, 5], [0, 5]), ([0, 5], [2, 5]), ([1, 2, 3, 4, 5], [5]), ([2, 4, 5], [1, 3, 5])],
)
def test_marking_and_counting_paths_agree_at_the_edges(src, tgt):
    """Strictly increasing ends, and ends with a repeat (zero-length tokens: the last of each run
    counts), take the marking path; a token ending at offset 0 and one-token sides group as the
    binary-search formulation does either way."""
    src, tgt = np.array(src, dtype=np.int64), np.array(tgt, dtype=np.int64)
    assert _rows(align_ends(src, tgt, 5)) == _by_binary_search(src, tgt)
    dup = np.insert(src, 0, src[0])  # a zero-length first token
    assert _rows(align_ends(dup, tgt, 5)) == _by_binary_search(dup, tgt)


@pytest.mark.parametrize("seed", range(20))
def test_zero_length_tokens_join_the_group_they_end_in(seed):
    rng = np.random.default_rng(100 + seed)
    total = int(rng.integers(1, 200))
    src = _random_ends(rng, total, int(rng.integers(1, 2 * total + 2)), duplicates=True)
    tgt = _random_ends(rng, total, int(rng.integers(1, 2 * total + 2)), duplicates=True)
    assert _rows(align_ends(src, tgt, total)) == _by_binary_search(src, tgt)


def test_a_batch_aligns_each_text_as_alone():
    rng = np.random.default_rng(7)
    totals = [int(t) for t in rng.integers(1, 120, size=30)] + [0, 5]
    src = [_random_ends(rng, t, int(rng.integers(1, t + 1)), duplicates=True) for t in totals[:-2]]
    tgt = [_random_ends(rng, t, int(rng.integers(1, t + 1)), duplicates=True) for t in totals[:-2]]
    src += [np.zeros(0, np.int64), np.zeros(0, np.int64)]  # an empty text; a side without tokens
    tgt += [np.zeros(0, np.int64), np.array([2, 5])]
    batch = align_many(src, tgt, totals)
    for s, t, total, g in zip(src, tgt, totals, batch):
        assert _rows(g) == _rows(align_ends(s, t, total))
    assert _rows(batch[-1]) == [(0, 0, 0, 2, 0, 5)]


def test_a_batch_with_empty_sides_between_its_texts_aligns_each_text_as_alone():
    rng = np.random.default_rng(11)
    totals = [int(t) for t in rng.integers(1, 60, size=12)]
    src = [_random_ends(rng, t, int(rng.integers(1, t + 1)), duplicates=False) for t in totals]
    tgt = [_random_ends(rng, t, int(rng.integers(1, t + 1)), duplicates=True) for t in totals]
    src[3], tgt[7] = np.zeros(0, np.int64), np.zeros(0, np.int64)
    for s, t, total, g in zip(src, tgt, totals, align_many(src, tgt, totals)):
        assert _rows(g) == _rows(align_ends(s, t, total))
    assert align_many([], [], []) == []


@pytest.mark.parametrize("name", ["qwen2.5", "mistral-v1"])
def test_batch_spelling_check_and_ends_equal_the_per_text_ones(name):
    """``spelled_ends`` over a whole batch equals ``text_bytes(ids) == data`` and the per-text
    cumsum of piece lengths, including texts whose ids do not spell them and empty ones."""
    from mutualrl.retokenize.encoded import spelled_ends
    from mutualrl.retokenize.loaders import load_tokenizer
    from mutualrl.retokenize.retokenizer import Retokenizer

    prof = Retokenizer(load_tokenizer(name)).profile
    texts = ["the cat sat", "naïve café ✓", "x = 1 + 2\n", "", "  two  spaces", "漢字 and ascii"]
    ids = [
        np.array(e.ids, dtype=np.int64)
        for e in prof.continuation.encode_batch(texts, add_special_tokens=False)
    ]
    datas = [t.encode() for t in texts]
    ids[0] = ids[0][::-1].copy()  # same bytes in another order: wrong spelling
    ids[2] = ids[2][:-1].copy()  # one token short
    ids.append(np.zeros(0, np.int64))  # no ids for a non-empty text
    datas.append(b"x")
    sizes = np.array([a.size for a in ids])
    spells, ends = spelled_ends(prof, np.concatenate(ids), sizes, datas)
    assert spells.tolist() == [prof.text_bytes(a.tolist()) == d for a, d in zip(ids, datas)]
    assert spells.tolist()[1] and not spells.tolist()[0] and not spells.tolist()[2]
    assert not ends.flags.writeable
    lo = 0
    for a in ids:
        assert ends[lo : lo + a.size].tolist() == np.cumsum(prof.piece_len[a]).tolist()
        lo += a.size
