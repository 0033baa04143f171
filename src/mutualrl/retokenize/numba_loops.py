"""The loops behind ``kernels``, compiled by numba (imported only when a kernel is first used).

Each is the numba twin of a numpy pass of the batch path and gives the same arrays; see
``kernels`` for when they run and ``tests/retokenize/test_kernels.py`` for the comparison.
"""

from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True)


@_jit
def spelled(flat, sizes, piece_len, buf, start, data, off):
    """(spells per text, byte end of each token in its text): ``encoding.spelled_ends``. Text
    ``i`` is ``data[off[i]:off[i+1]]``; id ``t``'s piece is
    ``buf[start[t]:start[t]+piece_len[t]]``."""
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
                ok = pos + length <= want and _same(buf, start[t], data, base + pos, length)
            pos += length
            ends[k] = pos
            k += 1
        spells[i] = ok and pos == want
    return spells, ends


@_jit
def _same(a, i, b, j, length):
    for k in range(length):
        if a[i + k] != b[j + k]:
            return False
    return True


@_jit
def _ordered(ends, lo, size, total):
    """Non-decreasing from >= 0 with the last end == ``total``: the aligner's contract."""
    prev = 0
    for j in range(lo, lo + size):
        if ends[j] < prev:
            return False
        prev = ends[j]
    return prev == total


@_jit
def _distinct(ends, lo, hi):
    """Distinct values of a non-decreasing run ``ends[lo:hi]`` (``hi > lo``)."""
    u = 1
    for j in range(lo + 1, hi):
        if ends[j] != ends[j - 1]:
            u += 1
    return u


@_jit
def align(s_all, s_sizes, t_all, t_sizes, totals):
    """(ok, local (6, G), split (n,), stats (9, n)): ``align.align_batch`` and
    ``BatchAlignment.statistics``; ok False (and empty arrays) when some text breaks the
    contract (``_ordered``)."""
    n = totals.size
    cap, s_lo, t_lo = 0, 0, 0
    for i in range(n):  # within the contract, a group has >= 1 token on each side
        if not (
            _ordered(s_all, s_lo, s_sizes[i], totals[i])
            and _ordered(t_all, t_lo, t_sizes[i], totals[i])
        ):
            return (
                False,
                np.empty((6, 0), np.int64),
                np.empty(0, np.int64),
                np.empty((9, 0), np.int64),
            )
        cap += min(s_sizes[i], t_sizes[i])
        s_lo += s_sizes[i]
        t_lo += t_sizes[i]
    local = np.empty((6, cap), np.int64)
    split = np.empty(n, np.int64)
    stats = np.zeros((9, n), np.int64)
    g, s_lo, t_lo = 0, 0, 0
    for i in range(n):
        s_hi, t_hi = s_lo + s_sizes[i], t_lo + t_sizes[i]
        g = _walk(s_all, s_lo, s_hi, t_all, t_lo, t_hi, local, g, stats[:, i])
        split[i] = g
        stats[7, i] = _distinct(s_all, s_lo, s_hi)
        stats[8, i] = _distinct(t_all, t_lo, t_hi)
        s_lo, t_lo = s_hi, t_hi
    return True, local[:, :g], split, stats


@_jit
def _walk(s_all, s_lo, s_hi, t_all, t_lo, t_hi, local, g, stats):
    """One text's groups into ``local`` from column ``g`` on, two pointers over its two sides'
    ends; its counts into ``stats[0:7]``. Returns the next free column."""
    si, ti = s_lo, t_lo
    ps, pt, pb = 0, 0, 0
    g0 = g
    while si < s_hi and ti < t_hi:
        a, b = s_all[si], t_all[ti]
        if a < b:
            si += 1
        elif b < a:
            ti += 1
        else:  # a common boundary: the group takes every token ending at it on each side
            while si < s_hi and s_all[si] == a:
                si += 1
            while ti < t_hi and t_all[ti] == a:
                ti += 1
            es, et = si - s_lo, ti - t_lo
            local[0, g], local[1, g], local[2, g] = ps, es, pt
            local[3, g], local[4, g], local[5, g] = et, pb, a
            ns, nt = es - ps, et - pt
            if ns == 1 and nt == 1:
                stats[1] += 1
            elif ns == 1 and nt > 1:
                stats[2] += 1
            elif ns > 1 and nt == 1:
                stats[3] += 1
            stats[4] = max(stats[4], ns)
            stats[5] = max(stats[5], nt)
            stats[6] = max(stats[6], a - pb)
            ps, pt, pb = es, et, a
            g += 1
    stats[0] = g - g0
    return g


@_jit
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
    unk,
):
    """(spells per text, byte end of each token in its text): ``wordpiece._walk``."""
    n = sizes.size
    ends = np.zeros(flat.size, np.int64)
    spells = np.zeros(n, np.bool_)
    lo = 0
    for i in range(n):
        pos, stop = f_off[i], f_off[i + 1]
        ok = not complex_[i]
        s0, s1, run = -1, -1, 0
        for k in range(lo, lo + sizes[i]):
            if not ok:
                break
            t = flat[k]
            at = pos
            if t == unk:  # a whole word, from a word start to the next
                ok = pos < stop and word_start[pos] == 1
                pos += 1
                while pos < stop and word_start[pos] == 0:
                    pos += 1
            else:
                length = piece_len[t]
                ok = (
                    length > 0
                    and pos + length <= stop
                    and (word_start[pos] == 1) != continuing[t]
                    and _no_mark(word_start, pos + 1, pos + length)
                    and _same(buf, piece_start[t], folded, pos, length)
                )
                pos += length
            if ok:
                a, b = byte_start[at], byte_end[pos - 1]
                if a == s0 and b == s1:
                    run += piece_len[t]
                else:
                    if k > lo:
                        ends[k - 1] = s1  # the last of a run ends where its span does
                    s0, s1, run = a, b, piece_len[t]
                ends[k] = min(s1, s0 + run)
        spells[i] = ok and pos == stop
        hi = lo + sizes[i]
        if not spells[i]:
            ends[lo:hi] = 0
        elif hi > lo:
            ends[hi - 1] = s1
            for k in range(lo + 1, hi):  # non-decreasing, as ``np.maximum.accumulate``
                ends[k] = max(ends[k], ends[k - 1])
            last = ends[hi - 1]
            for k in range(lo, hi):  # ``encoding.pin_last``
                if ends[k] == last:
                    ends[k] = n_bytes[i]
        lo = hi
    return spells, ends


@_jit
def _no_mark(marks, lo, hi):
    for j in range(lo, hi):
        if marks[j] != 0:
            return False
    return True


@_jit
def fold_texts(
    cps,
    n_chars,
    cap,
    cls_table,
    off,
    count,
    chars,
    n_folded,
    keep_cls,
    alone_cls,
    space_cls,
    complex_cls,
):
    """``wordpiece._fold`` in one pass over the code points: (status, folded bytes, where each
    text starts in them, word starts (one more than the bytes), the start and the end in its
    text's bytes of each folded byte's character, texts holding a COMPLEX character), the arrays
    made for at most ``cap`` folded bytes. ``status``: 0 done, 1 a code point not in the table
    yet, 2 more than ``cap`` folded bytes (the arrays are then empty). ``n_folded``: each code
    point's folded UTF-8 bytes."""
    n = n_chars.size
    last = cls_table.size - 1
    out = np.empty(cap, np.uint8)
    marks = np.zeros(cap + 1, np.uint8)
    byte_start = np.empty(cap, np.int64)
    byte_end = np.empty(cap, np.int64)
    f_off = np.zeros(n + 1, np.int64)
    complex_ = np.zeros(n, np.bool_)
    c, j = 0, 0
    for i in range(n):
        f_off[i] = j
        b = 0
        new_word = True
        for _ in range(n_chars[i]):
            cp = cps[c]
            c += 1
            b0 = b
            b += 1 + (cp >= 0x80) + (cp >= 0x800) + (cp >= 0x10000)
            idx = min(cp, last)
            kind = cls_table[idx]
            if kind == keep_cls or kind == alone_cls:
                if j + n_folded[idx] > cap:
                    return 2, out[:0], f_off, marks[:1], byte_start[:0], byte_end[:0], complex_
                j0 = j
                for q in range(off[idx], off[idx] + count[idx]):
                    j = _put_utf8(out, j, chars[q])
                marks[j0] = 1 if (new_word or kind == alone_cls) else 0
                byte_start[j0:j] = b0
                byte_end[j0:j] = b
                new_word = kind == alone_cls
            elif kind == space_cls:
                new_word = True
            elif kind == complex_cls:
                complex_[i] = True
            elif kind == 0:
                return 1, out[:0], f_off, marks[:1], byte_start[:0], byte_end[:0], complex_
    f_off[n] = j
    marks[j] = 1
    return 0, out[:j], f_off, marks[: j + 1], byte_start[:j], byte_end[:j], complex_


@_jit
def _put_utf8(out, j, cp):
    """Write code point ``cp`` as UTF-8 at ``out[j]``; return the next free index."""
    if cp < 0x80:
        out[j] = cp
        return j + 1
    if cp < 0x800:
        out[j] = 0xC0 | (cp >> 6)
        out[j + 1] = 0x80 | (cp & 0x3F)
        return j + 2
    if cp < 0x10000:
        out[j] = 0xE0 | (cp >> 12)
        out[j + 1] = 0x80 | ((cp >> 6) & 0x3F)
        out[j + 2] = 0x80 | (cp & 0x3F)
        return j + 3
    out[j] = 0xF0 | (cp >> 18)
    out[j + 1] = 0x80 | ((cp >> 12) & 0x3F)
    out[j + 2] = 0x80 | ((cp >> 6) & 0x3F)
    out[j + 3] = 0x80 | (cp & 0x3F)
    return j + 4
