"""Compiled loops of the retokenizer's batch path (numba), each equal to a numpy pass it replaces.

The batch path's numpy passes each cost a call and a pass over the batch: fine for one large
array, but the spelling check of a batch is about ten of them over every byte, and the alignment
and its per-text statistics as many again. Here each is one loop over the batch's tokens, compiled
by numba and cached on disk (``cache=True``), run without the GIL.

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

MIN_TOKENS = 8192      # tokens of a batch (both sides) from which ``auto`` uses the kernels
_MODES = ("auto", "numba", "numpy")


def mode() -> str:
    """``MUTUALRL_KERNELS``: auto (default), numba or numpy."""
    value = os.environ.get("MUTUALRL_KERNELS", "").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"MUTUALRL_KERNELS: expected one of {', '.join(_MODES)}, got {value!r}")
    return value


@functools.cache
def _compiled():
    """The compiled kernels, or None when numba is missing."""
    try:
        import numba
    except ImportError:
        return None
    jit = numba.njit(cache=True, nogil=True)
    return {"spelled": jit(_spelled), "align": jit(_align)}


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


def spelled_ends(flat: np.ndarray, sizes: np.ndarray, piece_len: np.ndarray, buf: np.ndarray,
                 start: np.ndarray, datas: list[bytes]):
    """``encoding.spelled_ends`` in one pass: (spells, ends), or None where the kernels are not
    used. ``buf`` / ``start`` are the profile's piece table (``TokenizerProfile.piece_table``)."""
    k = _for(flat.size)
    if k is None:
        return None
    n = len(datas)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, datas), dtype=np.int64, count=n), out=off[1:])
    data = np.frombuffer(b"".join(datas), dtype=np.uint8)
    return k["spelled"](flat, sizes, piece_len, buf, start, data, off)


def align(s_all: np.ndarray, s_sizes: np.ndarray, t_all: np.ndarray, t_sizes: np.ndarray,
          totals: np.ndarray):
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
    ok, local, split, stats = k["align"](s_all, s_sizes, t_all, t_sizes, totals)
    return (local, split, stats) if ok else None


def _spelled(flat, sizes, piece_len, buf, start, data, off):  # pragma: no cover - compiled
    n = sizes.size
    ends = np.empty(flat.size, np.int64)
    spells = np.empty(n, np.bool_)
    k = 0
    for i in range(n):
        base = off[i]
        want = off[i + 1] - base
        pos = 0
        ok = True
        for _ in range(sizes[i]):
            t = flat[k]
            length = piece_len[t]
            if ok:
                if pos + length > want:
                    ok = False
                else:
                    s = start[t]
                    for b in range(length):
                        if buf[s + b] != data[base + pos + b]:
                            ok = False
                            break
            pos += length
            ends[k] = pos
            k += 1
        spells[i] = ok and pos == want
    return spells, ends


def _align(s_all, s_sizes, t_all, t_sizes, totals):  # pragma: no cover - compiled
    n = totals.size
    cap = 0
    s_lo = 0
    t_lo = 0
    for i in range(n):   # the precondition; then a group has >= 1 token on each side
        for side in range(2):   # non-decreasing from >= 0, the last end == the text's length
            ends, lo, size = (s_all, s_lo, s_sizes[i]) if side == 0 else (t_all, t_lo, t_sizes[i])
            prev = 0
            for j in range(lo, lo + size):
                if ends[j] < prev:
                    prev = -1
                    break
                prev = ends[j]
            if prev != totals[i]:
                return (False, np.empty((6, 0), np.int64), np.empty(0, np.int64),
                        np.empty((9, 0), np.int64))
        cap += min(s_sizes[i], t_sizes[i])
        s_lo += s_sizes[i]
        t_lo += t_sizes[i]
    local = np.empty((6, cap), np.int64)
    split = np.empty(n, np.int64)
    stats = np.zeros((9, n), np.int64)
    g = 0
    s_lo = 0
    t_lo = 0
    for i in range(n):
        s_hi = s_lo + s_sizes[i]
        t_hi = t_lo + t_sizes[i]
        si, ti = s_lo, t_lo
        ps, pt, pb = 0, 0, 0
        c11, c1n, cn1, big_s, big_t, big_b = 0, 0, 0, 0, 0, 0
        g0 = g
        while si < s_hi and ti < t_hi:
            a = s_all[si]
            b = t_all[ti]
            if a < b:
                si += 1
            elif b < a:
                ti += 1
            else:   # a common boundary: the group takes every token ending at it on each side
                while si < s_hi and s_all[si] == a:
                    si += 1
                while ti < t_hi and t_all[ti] == a:
                    ti += 1
                es, et = si - s_lo, ti - t_lo
                local[0, g], local[1, g], local[2, g] = ps, es, pt
                local[3, g], local[4, g], local[5, g] = et, pb, a
                ns, nt = es - ps, et - pt
                if ns == 1 and nt == 1:
                    c11 += 1
                elif ns == 1 and nt > 1:
                    c1n += 1
                elif ns > 1 and nt == 1:
                    cn1 += 1
                big_s = max(big_s, ns)
                big_t = max(big_t, nt)
                big_b = max(big_b, a - pb)
                ps, pt, pb = es, et, a
                g += 1
        split[i] = g
        stats[0, i], stats[1, i], stats[2, i], stats[3, i] = g - g0, c11, c1n, cn1
        stats[4, i], stats[5, i], stats[6, i] = big_s, big_t, big_b
        u = 1
        for j in range(s_lo + 1, s_hi):
            if s_all[j] != s_all[j - 1]:
                u += 1
        stats[7, i] = u
        u = 1
        for j in range(t_lo + 1, t_hi):
            if t_all[j] != t_all[j - 1]:
                u += 1
        stats[8, i] = u
        s_lo, t_lo = s_hi, t_hi
    return True, local[:, :g], split, stats
