"""Compiled loops of the retokenizer's batch path (numba), each equal to a numpy pass it replaces.

The batch path's numpy passes each cost a call and a pass over the batch: fine for one large
array, but the spelling check of a batch is about ten of them over every byte, and the alignment
and its per-text statistics as many again. Here each is one loop over the batch's tokens, compiled
by numba and cached on disk (``numba_loops``, imported on first use), run without the GIL.

When they are used (``MUTUALRL_KERNELS``):

* ``auto`` (the default): for a batch of at least ``MIN_TOKENS`` tokens. A process pays once for
  the first use: numba's import and loading the cached machine code, about 0.8 s on a 2-core VM
  (about 3 s more the first time after an install, when it is compiled). A short CPU run that
  moves a few completions a step would lose more there than the kernels save it, and its small
  batches are quick in numpy; large batches are where the numpy passes' cost is.
* ``numba``: for every batch. ``numpy``: never.

Without numba installed the callers always take their numpy passes, which stay the reference:
the tests check that both give the same arrays.
"""

from __future__ import annotations

import functools
import os

import numpy as np

MIN_TOKENS = 8192  # tokens of a batch (both sides) from which ``auto`` uses the kernels
_MODES = ("auto", "numba", "numpy")


def mode() -> str:
    """``MUTUALRL_KERNELS``: auto (default), numba or numpy."""
    value = os.environ.get("MUTUALRL_KERNELS", "").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"MUTUALRL_KERNELS: expected one of {', '.join(_MODES)}, got {value!r}")
    return value


@functools.cache
def _compiled():
    """The module of compiled loops (``numba_loops``), or None when numba is missing."""
    try:
        from mutualrl.retokenize import numba_loops
    except ImportError:
        return None
    return numba_loops


def available() -> bool:
    """Whether the kernels can be used: numba is installed and ``MUTUALRL_KERNELS`` is not
    ``numpy`` (imports numba)."""
    return mode() != "numpy" and _compiled() is not None


def _for(tokens: int):
    """The kernels for a batch of ``tokens`` tokens, or None (see the module docstring)."""
    m = mode()
    if m == "numpy" or (m == "auto" and tokens < MIN_TOKENS):
        return None
    return _compiled()


def spelled_ends(
    flat: np.ndarray,
    sizes: np.ndarray,
    piece_len: np.ndarray,
    buf: np.ndarray,
    start: np.ndarray,
    datas: list[bytes],
):
    """``encoding.spelled_ends`` in one pass: (spells, ends), or None where the kernels are not
    used or an id is out of the vocabulary. ``buf`` / ``start`` are the profile's piece table
    (``TokenizerProfile.piece_table``)."""
    k = _for(flat.size)
    if k is None or (flat.size and (flat.min() < 0 or flat.max() >= piece_len.size)):
        return None  # an id out of range: the numpy pass raises for it, as it always did
    n = len(datas)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, datas), dtype=np.int64, count=n), out=off[1:])
    data = np.frombuffer(b"".join(datas), dtype=np.uint8)
    return k.spelled(flat, sizes, piece_len, buf, start, data, off)


def align(
    s_all: np.ndarray,
    s_sizes: np.ndarray,
    t_all: np.ndarray,
    t_sizes: np.ndarray,
    totals: np.ndarray,
):
    """The groups of texts laid end to end in per-text coordinates, and their statistics, from
    each side's ends concatenated (``s_all`` / ``t_all``, per-text coordinates, ``*_sizes`` ends
    per text, every text with at least one on each side). Returns (local (6, G), split (n,),
    stats (9, n)), or None where the kernels are not used or some text's ends break the
    aligner's contract (non-decreasing from 0, the last one the text's length; ``align``): the
    numpy pass then handles them as it always did.

    ``stats`` rows per text: groups, groups 1:1, 1:n, n:1, the largest group's source tokens,
    target tokens and bytes, and the distinct ends of each side."""
    k = _for(s_all.size + t_all.size)
    if k is None:
        return None
    ok, local, split, stats = k.align(s_all, s_sizes, t_all, t_sizes, totals)
    return (local, split, stats) if ok else None


def folded_walk(
    flat,
    sizes,
    folded,
    f_off,
    word_start,
    byte_start,
    byte_end,
    n_bytes,
    complex_,
    piece_len,
    buf,
    piece_start,
    continuing,
    unk: int,
):
    """``wordpiece._walk`` in one compiled pass: (spells, ends), or None where the kernels are
    not used or an id is out of the vocabulary."""
    k = _for(flat.size)
    if k is None or (flat.size and (flat.min() < 0 or flat.max() >= piece_len.size)):
        return None
    return k.folded_walk(
        flat,
        sizes,
        folded,
        f_off,
        word_start,
        byte_start,
        byte_end,
        n_bytes,
        complex_,
        piece_len,
        buf,
        piece_start,
        continuing,
        unk,
    )


def fold_texts(cps: np.ndarray, n_chars: np.ndarray, table, tokens: int):
    """``wordpiece._fold`` in one compiled pass (``numba_loops.fold_texts``) over the code points
    ``cps`` of texts of ``n_chars`` characters, with ``table`` (a ``wordpiece.FoldTable``, which
    learns the characters met for the first time), or None where the kernels are not used for a
    batch of ``tokens`` tokens. Returns the arrays after the status."""
    k = _for(tokens)
    if k is None:
        return None
    cap = 4 * cps.size  # enough unless many characters fold to several (Hangul: 9 bytes)
    while True:
        arrays = table.arrays()
        status, *done = k.fold_texts(cps, n_chars, cap, *arrays)
        if status == 0:
            return done
        if status == 1:
            table.learn(cps)
        else:
            n_folded = arrays[4]
            cap = int(n_folded[np.minimum(cps, n_folded.size - 1)].sum())
