"""The compiled kernels of the batch path against the numpy passes they replace: the same groups,
statistics, spelling verdicts and byte ends, and the numpy pass wherever a kernel's precondition
does not hold (or numba is turned off)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mutualrl.retokenize import kernels
from mutualrl.retokenize.align import align_batch, align_flat
from mutualrl.retokenize.encoding import spelled_ends

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba not installed")


@pytest.fixture(autouse=True)
def every_batch(monkeypatch):
    """The kernels for batches of any size (``auto`` keeps small ones on the numpy passes)."""
    monkeypatch.setenv("MUTUALRL_KERNELS", "numba")


@pytest.fixture
def numpy_only(monkeypatch):
    """Run the callers' numpy passes, as without numba."""

    def off():
        monkeypatch.setenv("MUTUALRL_KERNELS", "numpy")

    return off


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
def test_walked_alignment_and_statistics_equal_the_numpy_passes(batch):
    src, tgt, totals = batch
    walked = align_batch(src, tgt, totals)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MUTUALRL_KERNELS", "numpy")
        passes = align_batch(src, tgt, totals)
    if passes is None:
        assert walked is None
        return
    assert walked.stats is not None and passes.stats is None
    assert walked.full == passes.full
    assert np.array_equal(walked.split, passes.split)
    assert np.array_equal(walked.local, passes.local)
    assert np.array_equal(walked.src_offset, passes.src_offset)
    assert np.array_equal(walked.tgt_offset, passes.tgt_offset)
    assert np.array_equal(walked.statistics(), passes.statistics())
    for x, y in zip(walked.groups(), passes.groups(), strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(x.columns(), y.columns(), strict=True))


@settings(max_examples=200, deadline=None)
@given(batch=batches(pinned=True), numpy_pass=st.booleans())
def test_ends_laid_end_to_end_align_as_the_list_of_arrays_does(batch, numpy_pass):
    """``align_flat`` (a batch's sides as whole-batch arrays) against ``align_batch`` (a list per
    side), texts with an empty side included, by the kernel and by the numpy pass; the arrays
    given are left as they were."""
    src, tgt, totals = batch
    flat = [(np.concatenate(side), np.array([e.size for e in side])) for side in (src, tgt)]
    for a, _ in flat:
        a.flags.writeable = False
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MUTUALRL_KERNELS", "numpy" if numpy_pass else "numba")
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


@settings(max_examples=100, deadline=None)
@given(batch=batches(pinned=False))
def test_ends_short_of_the_text_take_the_numpy_pass(batch):
    """Outside the aligner's contract (a last end short of the text's length) the kernel steps
    aside, so both paths behave alike, whatever the numpy pass makes of such ends."""
    src, tgt, totals = batch
    full = [k for k in range(len(totals)) if src[k].size and tgt[k].size]
    if not full or all(src[k][-1] == totals[k] == tgt[k][-1] for k in full):
        return

    def cat(ends):
        return np.concatenate([ends[k] for k in full]), np.array([ends[k].size for k in full])

    assert kernels.align(*cat(src), *cat(tgt), np.array([totals[k] for k in full])) is None


def test_ends_out_of_order_or_past_the_text_take_the_numpy_pass():
    s = [np.array([3, 1, 5], dtype=np.int64), np.array([2, 4], dtype=np.int64)]
    t = [np.array([1, 3, 5], dtype=np.int64), np.array([4], dtype=np.int64)]
    assert (
        kernels.align(
            np.concatenate(s),
            np.array([3, 2]),
            np.concatenate(t),
            np.array([3, 1]),
            np.array([5, 4]),
        )
        is None
    )
    batch = align_batch(s, t, [5, 4])
    assert batch.stats is None and batch.src_all is not None  # aligned by the numpy pass
    past = [np.array([2, 9], dtype=np.int64)]
    assert (
        kernels.align(
            past[0], np.array([2]), np.array([9], dtype=np.int64), np.array([1]), np.array([5])
        )
        is None
    )


@pytest.mark.parametrize("name", ["qwen2.5", "mistral-v1"])
def test_walked_spelling_check_equals_the_numpy_passes(name, numpy_only):
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
    numpy_only()
    want_spells, want_ends = spelled_ends(prof, flat, sizes, datas)
    assert spells.tolist() == want_spells.tolist()
    assert spells.tolist() == [prof.text_bytes(a.tolist()) == d for a, d in zip(ids, datas)]
    assert np.array_equal(ends, want_ends) and not ends.flags.writeable
    assert 0 < spells.sum() < spells.size


def test_an_id_out_of_range_is_refused_as_by_the_numpy_pass():
    from mutualrl.retokenize.loaders import load_tokenizer
    from mutualrl.retokenize.retokenizer import Retokenizer

    prof = Retokenizer(load_tokenizer("mistral-v1")).profile
    for bad in (prof.piece_len.size, -prof.piece_len.size - 1):
        with pytest.raises(IndexError):
            spelled_ends(prof, np.array([5, bad], dtype=np.int64), np.array([2]), [b"ab"])


def test_auto_uses_the_kernels_from_a_batch_size_on(monkeypatch):
    monkeypatch.setenv("MUTUALRL_KERNELS", "auto")
    half = kernels.MIN_TOKENS // 2
    small = [np.arange(1, half // 2 + 1, dtype=np.int64)]
    assert align_batch(small, small, [half // 2]).stats is None  # numpy passes
    big = [np.arange(1, half + 1, dtype=np.int64)]
    assert align_batch(big, big, [half]).stats is not None  # the kernel
    monkeypatch.setenv("MUTUALRL_KERNELS", "numpy")
    assert align_batch(big, big, [half]).stats is None
    monkeypatch.setenv("MUTUALRL_KERNELS", "fast")
    with pytest.raises(ValueError, match="MUTUALRL_KERNELS: expected one of auto, numba, numpy"):
        align_batch(big, big, [half])


def test_the_environment_turns_the_kernels_off():
    code = "from mutualrl.retokenize import kernels; print(kernels.available())"
    env = {**os.environ, "MUTUALRL_KERNELS": "numpy"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
