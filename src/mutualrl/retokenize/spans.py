"""Token byte ends from the spans of text each token came from, as the Rust tokenizers report
them in offsets (``encoding``) or as a WordPiece walk finds them (``wordpiece``).

A span is the characters a token came from, in bytes. A token ends where its span ends, except
in a run of tokens reporting the same span (several tokens out of one character: byte-fallback
bytes, a Hangul syllable's jamo under NFD), where each but the last ends its piece's bytes after
the span's start, at most at its end. Then the ends are made non-decreasing and the last ones
extended to the end of the text (``pin_last``), so the tokens tile every byte exactly once.
"""

from __future__ import annotations

import numpy as np


def split_shared_spans(starts, ends, same, piece_len) -> np.ndarray:
    """Within each run of tokens reporting the same span, end token k at start + its run cumsum
    (``same[k]``: tokens k and k + 1 report the same span)."""
    new_run = np.concatenate(([True], ~same))
    run_id = np.cumsum(new_run) - 1
    cum = np.cumsum(piece_len)
    before_run = (cum - piece_len)[new_run][run_id]  # bytes before each token's run
    last_in_run = np.concatenate((~same, [True]))
    split = np.minimum(ends, starts + (cum - before_run))
    return np.where(last_in_run, ends, split)


def settle_batch_ends(
    starts: np.ndarray,
    ends: np.ndarray,
    piece_len: np.ndarray,
    sizes: np.ndarray,
    n_bytes: np.ndarray,
) -> np.ndarray:
    """Each token's byte end within its own text, from the spans of a batch's tokens (``starts``
    and ``ends`` in their own texts' bytes; ``sizes`` tokens per text, ``n_bytes`` bytes per text;
    ``piece_len`` each token's piece bytes). The texts are laid end to end with a one-byte gap
    (as in ``align.align_batch``), so no run of tokens sharing a span, no running maximum and no
    pinned last end crosses from one text into the next."""
    text_base = np.cumsum(n_bytes + 1) - (n_bytes + 1)
    base = np.repeat(text_base, sizes)
    starts, ends = starts + base, ends + base
    if ends.size > 1:
        same = (starts[1:] == starts[:-1]) & (ends[1:] == ends[:-1])
        if same.any():
            ends = split_shared_spans(starts, ends, same, piece_len)
    ends = np.maximum.accumulate(ends)
    has = sizes > 0
    if has.any():  # pin_last of every text with tokens
        last = np.repeat(ends[np.cumsum(sizes)[has] - 1], sizes[has])
        pin = ends == last
        ends[pin] = np.repeat((text_base + n_bytes)[has], sizes[has])[pin]
    return ends - base
