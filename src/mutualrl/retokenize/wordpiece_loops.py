"""The WordPiece walk's two loops, compiled by numba (imported on a WordPiece batch's first use,
cached on disk, run without the GIL); see ``wordpiece``.

``fold_texts`` folds the texts. ``folded_walk`` walks the ids (``flat``, ``sizes`` per text)
along them: a text holding a COMPLEX character does not walk, nor do ids whose words are not the
text's words in number and in bytes (an ``[UNK]`` a whole word, every other piece equal to the
folded bytes under it, the first of a word without ``##``, the others with it). A token ends
where the character of its last folded byte ends in the text; tokens out of one character share
out its bytes, and the ends are made non-decreasing with the last ones pinned to the text's end
(``encoded.pin_last``). A text that does not walk gets ends of 0.
"""

from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True)


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
    """(spells per text, byte end of each token in its text): the module docstring's walk."""
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
            for k in range(lo, hi):  # ``encoded.pin_last``
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
    """The texts folded, in one pass over their code points: (status, folded bytes, where each
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


@_jit
def _same(a, i, b, j, length):
    for k in range(length):
        if a[i + k] != b[j + k]:
            return False
    return True
