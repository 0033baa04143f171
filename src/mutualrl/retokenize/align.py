"""Align two tokenizations of the same bytes by their common token boundaries, vectorised.

Each side is given as the cumulative byte *end* of every token (non-decreasing; the last equals
the text length). Token ``i`` covers bytes ``[end[i-1], end[i])`` — so whitespace a tokenizer
has no token for (WordPiece) belongs to the next token, exactly like a byte-level ``Ġ``. A group
closes wherever both sides have a boundary: the common boundaries are the values present in both
end arrays. This is the classic two-pointer walk over end offsets, done in linear time: each side
marks its ends in a byte-offset array, an end of one side is common where the other side marked
it, and a group's token range on each side ends just past the last token ending at its boundary
there (with zero-length tokens, as WordPiece's NFD makes of a Hangul syllable, several tokens
share an end: the last of each run counts). Ends that are not even non-decreasing (never made by
the retokenizer) are counted per byte offset (``bincount``) instead, a group's token range being
the running count of ends up to its boundary. Either is several times faster than binary
searches of one side's ends in the other's.

Zero-length tokens (none after specials are stripped, but tolerated) join the group their end
falls in. Every group has at least one token on each side, except when one side is empty: then
the whole text is a single group with no tokens on that side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


def _column(i: int, doc: str) -> property:
    return property(lambda self: self._cols[i], doc=doc)


class AlignmentGroups:
    """Aligned groups; all arrays are int64 of length ``len(self)``, ranges half-open.

    ``src_start:src_end`` are indices into the source ids as given by the caller,
    ``tgt_start:tgt_end`` indices into the target ids, ``byte_start:byte_end`` offsets into the
    UTF-8 bytes of the text. A trailing end-of-sequence group, when present, has an empty byte
    range at the end of the text.

    Read-only: the six fields are properties over one column block, either the six arrays given
    to the constructor or, for the texts of a batch, one (6, G) view of the batch's alignment
    (``BatchAlignment.groups``), so a batch makes one view per text, not six; a field is sliced
    from it when read.
    """

    __slots__ = ("_cols",)

    def __init__(
        self,
        src_start: np.ndarray,
        src_end: np.ndarray,
        tgt_start: np.ndarray,
        tgt_end: np.ndarray,
        byte_start: np.ndarray,
        byte_end: np.ndarray,
    ) -> None:
        self._cols = (src_start, src_end, tgt_start, tgt_end, byte_start, byte_end)

    @classmethod
    def _of_block(cls, block: np.ndarray) -> AlignmentGroups:
        """Groups over the rows of a (6, G) int64 array (a view; not copied)."""
        obj = object.__new__(cls)
        obj._cols = block
        return obj

    src_start = _column(0, "first source token of each group")
    src_end = _column(1, "one past the last source token of each group")
    tgt_start = _column(2, "first target token of each group")
    tgt_end = _column(3, "one past the last target token of each group")
    byte_start = _column(4, "first byte of each group")
    byte_end = _column(5, "one past the last byte of each group")

    def columns(self) -> tuple[np.ndarray, ...]:
        """The six fields, in the constructor's order."""
        return tuple(self._cols[i] for i in range(6))

    def __len__(self) -> int:
        return int(self._cols[0].shape[0])

    def __repr__(self) -> str:
        return f"AlignmentGroups({len(self)} groups)"

    def __reduce__(self):
        return AlignmentGroups, self.columns()

    @classmethod
    def empty(cls) -> AlignmentGroups:
        return cls(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)

    def source_sizes(self) -> np.ndarray:
        return self.src_end - self.src_start

    def target_sizes(self) -> np.ndarray:
        return self.tgt_end - self.tgt_start

    def target_group_index(self, n_target: int) -> np.ndarray:
        """Group id of every target token (``-1`` for tokens in no group, e.g. none today)."""
        out = np.full(n_target, -1, dtype=np.int64)
        sizes = self.target_sizes()
        pos = np.repeat(self.tgt_start, sizes) + _ranks(sizes)
        out[pos] = np.repeat(np.arange(len(self), dtype=np.int64), sizes)
        return out

    def source_group_index(self, n_source: int) -> np.ndarray:
        """Group id of every source token; ``-1`` for stripped special tokens outside any group."""
        out = np.full(n_source, -1, dtype=np.int64)
        sizes = self.source_sizes()
        pos = np.repeat(self.src_start, sizes) + _ranks(sizes)
        out[pos] = np.repeat(np.arange(len(self), dtype=np.int64), sizes)
        return out

    def slice(self, stop: int) -> AlignmentGroups:
        """The first ``stop`` groups."""
        return AlignmentGroups(*(a[:stop] for a in self.columns()))


def _ranks(sizes: np.ndarray) -> np.ndarray:
    """[0..s0-1, 0..s1-1, ...] for a vector of sizes, without a Python loop."""
    total = int(sizes.sum())
    starts = np.cumsum(sizes) - sizes
    return np.arange(total, dtype=np.int64) - np.repeat(starts, sizes)


def common_boundaries(src_ends: np.ndarray, tgt_ends: np.ndarray) -> np.ndarray:
    """Sorted unique byte offsets that end a token on both sides."""
    if src_ends.size == 0 or tgt_ends.size == 0:
        return _EMPTY
    idx = np.searchsorted(tgt_ends, src_ends)
    np.minimum(idx, tgt_ends.size - 1, out=idx)
    both = src_ends[tgt_ends[idx] == src_ends]
    if both.size > 1:
        keep = np.empty(both.size, dtype=bool)
        keep[0] = True
        np.not_equal(both[1:], both[:-1], out=keep[1:])
        both = both[keep]
    return both


def align_ends(src_ends: np.ndarray, tgt_ends: np.ndarray, total: int) -> AlignmentGroups:
    """Group tokens of two tokenizations of ``total`` bytes; see the module docstring."""
    n, m = src_ends.size, tgt_ends.size
    if n == 0 or m == 0:
        if n == 0 and m == 0 and total == 0:
            return AlignmentGroups.empty()
        one = lambda v: np.array([v], dtype=np.int64)  # noqa: E731 - tiny local constructor
        return AlignmentGroups(one(0), one(n), one(0), one(m), one(0), one(total))
    src_end, tgt_end, bounds = _common_ends(src_ends, tgt_ends, total)
    return AlignmentGroups(
        src_start=_shift(src_end),
        src_end=src_end,
        tgt_start=_shift(tgt_end),
        tgt_end=tgt_end,
        byte_start=_shift(bounds),
        byte_end=bounds,
    )


def _common_ends(src_ends: np.ndarray, tgt_ends: np.ndarray, total: int):
    """(source token ends, target token ends, byte ends) of the groups of two non-empty sides."""
    s_last, t_last = _last_of_runs(src_ends), _last_of_runs(tgt_ends)
    if s_last is not None and t_last is not None:
        # Non-decreasing ends (always, as the retokenizer builds them): an end is common when the
        # other side marks it, and a group's token range ends just past the last token ending at
        # its boundary on each side (tokens of zero length before it join the group).
        mark = np.zeros(total + 1, dtype=bool)
        mark[tgt_ends] = True
        hit = mark.take(src_ends)
        if s_last is not True:
            hit &= s_last
        src_end = np.flatnonzero(hit)
        bounds = src_ends.take(src_end)
        src_end += 1
        mark = np.zeros(total + 1, dtype=bool)
        mark[bounds] = True
        hit = mark.take(tgt_ends)
        if t_last is not True:
            hit &= t_last
        tgt_end = np.flatnonzero(hit)
        tgt_end += 1
    else:
        s_count = np.bincount(src_ends, minlength=total + 1)  # tokens ending at each byte offset
        t_count = np.bincount(tgt_ends, minlength=total + 1)
        bounds = np.flatnonzero((s_count > 0) & (t_count > 0))
        # tokens ending at or before each boundary (zero-length tokens join the group they end in)
        src_end = np.cumsum(s_count)[bounds]
        tgt_end = np.cumsum(t_count)[bounds]
    return src_end, tgt_end, bounds


def _last_of_runs(ends: np.ndarray):
    """True when the ends strictly increase (every token covers a byte); for non-decreasing ends
    with repeats, a bool mask of the last token of each run of equal ends; None otherwise."""
    step = ends[1:] > ends[:-1]
    if step.all():
        return True
    if not (ends[1:] >= ends[:-1]).all():
        return None
    return np.append(step, True)


def _shift(ends: np.ndarray) -> np.ndarray:
    """Starts of consecutive ranges given their ends (first start is 0)."""
    starts = np.empty_like(ends)
    if ends.size:
        starts[0] = 0
        starts[1:] = ends[:-1]
    return starts


def byte_iou(src_ends: np.ndarray, tgt_ends: np.ndarray, n_common: int) -> float:
    """|common boundaries| / |union of boundaries| (1.0 when both sides are empty)."""
    n_src = _n_unique_sorted(src_ends)
    n_tgt = _n_unique_sorted(tgt_ends)
    union = n_src + n_tgt - n_common
    return 1.0 if union == 0 else n_common / union


def _n_unique_sorted(values: np.ndarray) -> int:
    if values.size == 0:
        return 0
    return int(np.count_nonzero(values[1:] != values[:-1])) + 1


def align_many(
    src_ends: list[np.ndarray], tgt_ends: list[np.ndarray], totals: list[int]
) -> list[AlignmentGroups]:
    """``align_ends`` for many texts in one vectorised pass.

    Texts are laid end to end with a one-byte gap, so every text end is a boundary on both sides
    and no group can span two texts; groups are then shifted back to per-text coordinates. Texts
    with an empty side are aligned on their own (their single group has no common boundary).
    """
    n = len(totals)
    batch = align_batch(src_ends, tgt_ends, totals)
    if batch is not None and len(batch.full) == n:  # every text has tokens on both sides
        return batch.groups()
    out: list[AlignmentGroups | None] = [None] * n
    for k in range(n):
        if not (src_ends[k].size and tgt_ends[k].size):
            out[k] = align_ends(src_ends[k], tgt_ends[k], totals[k])
    if batch is None:
        return out  # type: ignore[return-value]
    for k, g in zip(batch.full, batch.groups()):
        out[k] = g
    return out  # type: ignore[return-value]


def align_sides(
    sources, targets, totals: list[int]
) -> tuple[BatchAlignment | None, list[tuple[int, AlignmentGroups]]]:
    """The groups of a batch's texts from each side's encodings (anything with ``.ends`` per
    text): the batch alignment of the texts with tokens on both sides, from their arrays laid
    end to end where both sides' whole-batch passes kept them (``encoded.EncodedList``,
    ``sources.SourceList``: ``ends`` and ``sizes``); and ``(k, groups)`` of every other text,
    aligned alone (a text with a side without tokens, and the one text of a batch of one,
    which skips the batch bookkeeping)."""
    n = len(totals)
    if n == 1:
        return None, [(0, align_ends(sources[0].ends, targets[0].ends, totals[0]))]
    if getattr(sources, "ends", None) is not None and getattr(targets, "ends", None) is not None:
        batch = align_flat(
            sources.ends,
            sources.sizes,
            targets.ends,
            targets.sizes,
            np.fromiter(totals, dtype=np.int64, count=n),
        )
    else:
        batch = align_batch([s.ends for s in sources], [t.ends for t in targets], totals)
    aligned = set(batch.full) if batch is not None else set()
    alone = [
        (k, align_ends(sources[k].ends, targets[k].ends, totals[k]))
        for k in range(n)
        if k not in aligned
    ]
    return batch, alone


@dataclass(frozen=True)
class BatchAlignment:
    """The groups of the texts ``full`` (both sides non-empty) of a batch, end to end.

    ``local`` is int64 of shape (6, G): the ``AlignmentGroups`` fields in that order, in per-text
    coordinates; text ``full[j]`` owns columns ``split[j-1]:split[j]`` (``split[-1] == G``).
    ``src_offset`` / ``tgt_offset`` give where each text starts in the concatenated ends.
    ``src_all`` / ``tgt_all`` are those ends shifted to batch coordinates.
    """

    full: list[int]
    local: np.ndarray
    split: np.ndarray
    src_offset: np.ndarray
    tgt_offset: np.ndarray
    src_all: np.ndarray
    tgt_all: np.ndarray

    def groups(self) -> list[AlignmentGroups]:
        """Each text's groups, in the order of ``full``: one (6, g) column view of ``local`` per
        text; equal to ``AlignmentGroups(*local[:, lo:hi])``."""
        local, of_block = self.local, AlignmentGroups._of_block
        bounds = self.split.tolist()
        return [of_block(local[:, lo:hi]) for lo, hi in zip([0, *bounds[:-1]], bounds)]

    def statistics(self) -> np.ndarray:
        """int64 (9, len(full)), per text: its groups; groups 1:1, 1:n and n:1 (source:target
        tokens); the largest group's source tokens, target tokens and bytes; the distinct token
        ends of the source and of the target. Every text must have at least one group (as the
        retokenizer's ends, whose last end is the text's length on both sides, always do)."""
        local, split = self.local, self.split
        n_groups = np.diff(split, prepend=0)
        gstart = split - n_groups
        ns, nt = local[1] - local[0], local[3] - local[2]
        one_s, one_t = ns == 1, nt == 1
        card = np.add.reduceat(
            np.stack([one_s & one_t, one_s & (nt > 1), (ns > 1) & one_t]).astype(np.int64),
            gstart,
            axis=1,
        )
        largest = np.maximum.reduceat(np.stack([ns, nt, local[5] - local[4]]), gstart, axis=1)
        uniq = [
            np.add.reduceat(_new_value(a, off), off)
            for a, off in ((self.src_all, self.src_offset), (self.tgt_all, self.tgt_offset))
        ]
        return np.vstack([n_groups, card, largest, *uniq])


def _new_value(ends: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """1 where an end differs from the previous one or starts a text, else 0 (int64)."""
    out = np.ones(ends.size, dtype=np.int64)
    out[1:] = ends[1:] != ends[:-1]
    out[starts] = 1
    return out


def align_batch(
    src_ends: list[np.ndarray], tgt_ends: list[np.ndarray], totals: list[int]
) -> BatchAlignment | None:
    """One alignment over the concatenated ends of the texts with both sides non-empty (None:
    no such text); see ``align_many``: numpy passes over the whole batch."""
    n = len(totals)
    s_sizes = np.fromiter(map(len, src_ends), dtype=np.int64, count=n)
    t_sizes = np.fromiter(map(len, tgt_ends), dtype=np.int64, count=n)
    tot = np.fromiter(totals, dtype=np.int64, count=n)
    if s_sizes.all() and t_sizes.all():
        full, srcs, tgts = list(range(n)), src_ends, tgt_ends
    else:
        keep = (s_sizes > 0) & (t_sizes > 0)
        full = np.flatnonzero(keep).tolist()
        srcs, tgts = [src_ends[k] for k in full], [tgt_ends[k] for k in full]
        s_sizes, t_sizes, tot = s_sizes[keep], t_sizes[keep], tot[keep]
    if not full:
        return None
    return _align_laid(full, np.concatenate(srcs), s_sizes, np.concatenate(tgts), t_sizes, tot)


def align_flat(
    s_all: np.ndarray,
    s_sizes: np.ndarray,
    t_all: np.ndarray,
    t_sizes: np.ndarray,
    totals: np.ndarray,
) -> BatchAlignment | None:
    """``align_batch`` of ends already laid end to end, as a batch's two sides come from their
    whole-batch passes (``encoded.EncodedList``, ``sources.SourceList``): each side's ends in
    per-text coordinates concatenated, ``*_sizes`` ends per text. Nothing is concatenated again;
    the arrays are read, never written."""
    keep = (s_sizes > 0) & (t_sizes > 0)
    if keep.all():
        full = list(range(totals.size))
    else:
        full = np.flatnonzero(keep).tolist()
        s_all, t_all = s_all[np.repeat(keep, s_sizes)], t_all[np.repeat(keep, t_sizes)]
        s_sizes, t_sizes, totals = s_sizes[keep], t_sizes[keep], totals[keep]
    if not full:
        return None
    return _align_laid(full, s_all, s_sizes, t_all, t_sizes, totals)


def _align_laid(
    full: list[int],
    s_all: np.ndarray,
    s_sizes: np.ndarray,
    t_all: np.ndarray,
    t_sizes: np.ndarray,
    tot: np.ndarray,
) -> BatchAlignment:
    """The alignment of the texts ``full``, every one with ends on both sides laid end to end."""
    s_start, t_start = np.cumsum(s_sizes) - s_sizes, np.cumsum(t_sizes) - t_sizes
    byte_off = np.cumsum(tot + 1) - (tot + 1)
    s_all = s_all + np.repeat(byte_off, s_sizes)  # batch coordinates (the inputs are kept)
    t_all = t_all + np.repeat(byte_off, t_sizes)
    src_end, tgt_end, bounds = _common_ends(s_all, t_all, int(byte_off[-1] + tot[-1]))
    split = np.searchsorted(bounds, byte_off + tot, side="right")
    counts = np.diff(split, prepend=0)  # groups per text
    local = np.empty((6, bounds.size), dtype=np.int64)
    # Ends in per-text coordinates; each group starts where the previous one ended, and the first
    # group of each text at 0 on every axis (the byte axis skips the one-byte gap).
    text_off = np.repeat(np.stack((s_start, t_start, byte_off)), counts, axis=1)
    for row, ends in ((1, src_end), (3, tgt_end), (5, bounds)):
        np.subtract(ends, text_off[row // 2], out=local[row])
    local[0::2, 1:] = local[1::2, :-1]
    local[0::2, split - counts] = 0
    return BatchAlignment(full, local, split, s_start, t_start, s_all, t_all)
