"""A batch's results from its two sides: the alignment, and per text its receiver ids, its groups,
the source log-prob sum of every group and its residual row (``residuals.ResidualRows``), which
``Retokenizer.retokenize_batch`` makes into ``RetokenizedTrajectory`` results.

A text's result is made one of two ways, with equal values:

* from the batch: a text with no source specials, no EOS group and no cut at ``max_length``
  keeps its groups as aligned, and its sums and counts are segments of reductions over the whole
  batch's arrays (``_batch_part``);
* per text: every other text (and every text of a batch of one or without a sender, and a
  text with a side without tokens), whose groups are edited (source positions mapped back past
  specials, an EOS group appended, a cut on a group boundary) and counted on their own
  (``_edit_text``).

Either way the text's counts go into its row, and ``ResidualRows.records`` makes every row's
``AlignmentResiduals``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mutualrl.retokenize.align import (
    AlignmentGroups,
    BatchAlignment,
    align_sides,
    byte_iou,
    common_boundaries,
)
from mutualrl.retokenize.encoded import Encoded
from mutualrl.retokenize.profile import TokenizerProfile
from mutualrl.retokenize.residuals import ResidualRows
from mutualrl.retokenize.sources import _NO_TOKENS, Source


@dataclass(slots=True)
class Assembled:
    """Per text of a batch, in order: receiver ids, groups, per-group source log-prob sums (None
    without log-probs) and the residual rows."""

    target_ids: list[np.ndarray]
    groups: list[AlignmentGroups]
    sums: list[np.ndarray | None]
    rows: ResidualRows

    @classmethod
    def blank(cls, n: int) -> Assembled:
        empty: list[Any] = [None] * n
        return cls(empty.copy(), empty.copy(), empty.copy(), ResidualRows.blank(n))

    def place(self, part: Assembled, where: list[int]) -> None:
        """Text ``where[j]`` from text ``j`` of ``part``, for every ``j``."""
        for j, k in enumerate(where):
            self.target_ids[k], self.groups[k] = part.target_ids[j], part.groups[j]
            self.sums[k] = part.sums[j]
        self.rows.place(part.rows, where)


def assemble(
    prof: TokenizerProfile,
    max_length: int | None,
    targets: Sequence[Encoded],
    sources: Sequence[Source] | None,
    totals: list[int],
    flags: list[bool],
) -> Assembled:
    """The results of a batch's texts (``totals``: bytes per text, ``flags``: ends with EOS) from
    the receiver's encodings and the sender's side (None: no sender, no alignment)."""
    n = len(totals)
    if sources is None:
        out, todo = Assembled.blank(n), [(k, AlignmentGroups.empty()) for k in range(n)]
    else:
        batch, alone = align_sides(sources, targets, totals)
        out, todo = _from_batch(prof, max_length, targets, sources, totals, flags, batch, alone)
    for k, groups in todo:
        source = sources[k] if sources is not None else None
        _edit_text(prof, max_length, targets[k], source, groups, totals[k], flags[k], out, k)
    return out


def _from_batch(
    prof: TokenizerProfile,
    max_length: int | None,
    targets: Sequence[Encoded],
    sources: Sequence[Source],
    totals: list[int],
    flags: list[bool],
    batch: BatchAlignment | None,
    alone: list[tuple[int, AlignmentGroups]],
) -> tuple[Assembled, list[tuple[int, AlignmentGroups]]]:
    """The batch's results as far as its alignment gives them, and the texts left to edit per
    text, each with its groups as aligned (``alone``: the texts outside the batch alignment)."""
    n = len(totals)
    if batch is None:  # no text aligned with the batch
        return Assembled.blank(n), alone
    full = batch.full
    part, plain = _batch_part(prof, batch, targets, sources, totals)
    eos = prof.eos_id is not None
    todo = [
        (k, part.groups[j])
        for j, (k, ok, m) in enumerate(zip(full, plain, part.rows.n_target_tokens))
        if not ok or (eos and flags[k]) or (max_length is not None and m > max_length)
    ]
    if len(full) == n:
        return part, todo
    out = Assembled.blank(n)
    out.place(part, full)
    return out, todo + alone


def _batch_part(
    prof: TokenizerProfile,
    batch: BatchAlignment,
    targets: Sequence[Encoded],
    sources: Sequence[Source],
    totals: list[int],
) -> tuple[Assembled, list[bool]]:
    """The results of the texts ``batch.full``, in that order, from segment reductions over the
    whole batch: each text's receiver ids a slice of the batch's (writeable, and never the cached
    arrays), its groups a view of the batch alignment, its sums a slice of the batch's; and per
    text whether these hold as they are (no source specials, and its log-probs, if any, summed
    with the batch's). Every per-text total is a segment of one ``np.add.reduceat``, which sums a
    segment exactly as ``_total`` sums it alone, so the values equal ``_edit_text``'s."""
    full = batch.full
    stats = batch.statistics()
    tgt_ids, unk, fallback, gsums, mass_errors = _reductions(
        prof, batch, stats[0], targets, sources
    )
    plain, n_src, s_mismatch, s_distance = _source_columns(sources, full, gsums is not None)
    t_sizes = np.diff(batch.tgt_offset, append=tgt_ids.size)
    mismatch, distance, changed = _roundtrip_columns(targets, full)
    n_groups, c11, c1n, cn1, big_s, big_t, big_b = stats[:7].tolist()
    zeros = len(full) * [0]
    rows = ResidualRows(
        n_bytes=[totals[k] for k in full],
        n_source_tokens=n_src,
        n_target_tokens=t_sizes.tolist(),
        n_groups=n_groups,
        roundtrip_mismatch=mismatch,
        roundtrip_edit_distance=distance,
        normalizer_changed_text=changed,
        source_mismatch=s_mismatch,
        source_edit_distance=s_distance,
        # The groups' ends are the common boundaries; distinct ends per side in stats[7:9].
        boundary_iou=(stats[0] / (stats[7] + stats[8] - stats[0])).tolist(),
        groups_1_1=c11,
        groups_1_n=c1n,
        groups_n_1=cn1,
        largest_group_source_tokens=big_s,
        largest_group_target_tokens=big_t,
        largest_group_bytes=big_b,
        unknown_tokens=unk,
        byte_fallback_tokens=fallback,
        specials_stripped=zeros,
        specials_added=zeros.copy(),
        eos_paired=len(full) * [False],
        truncated_tokens=zeros.copy(),
        truncated_bytes=zeros.copy(),
        logprob_mass_error=mass_errors,
        logprob_mass_unassigned=len(full) * [0.0],
    )
    ids = _segments(tgt_ids, (batch.tgt_offset + t_sizes).tolist())
    sums: list[Any] = (
        _segments(gsums, batch.split.tolist()) if gsums is not None else [None] * len(full)
    )
    return Assembled(ids, batch.groups(), sums, rows), plain


def _segments(values: np.ndarray, stops: list[int]) -> list[np.ndarray]:
    """``values`` in consecutive segments ending at ``stops`` (the last, its size): a view each."""
    return [values[lo:hi] for lo, hi in zip([0, *stops[:-1]], stops)]


def _roundtrip_columns(targets: Sequence[Encoded], full: list[int]) -> tuple[list, list, list]:
    """The receiver's round-trip residuals of the texts ``full``: (mismatch, edit distance,
    whether the normaliser changed the text)."""
    texts = targets if len(full) == len(targets) else [targets[k] for k in full]
    return (
        [t.mismatch for t in texts],
        [t.edit_distance for t in texts],
        [t.normalizer_changed for t in texts],
    )


def _reductions(
    prof: TokenizerProfile, batch: BatchAlignment, n_groups: np.ndarray, targets, sources
):
    """Whole-batch columns of the texts ``batch.full`` (``n_groups``: groups per text): (the
    batch's receiver ids end to end, a fresh array; unknown and byte-fallback tokens per text;
    per-group log-prob sums or None; per-text log-prob mass errors)."""
    full, local = batch.full, batch.local
    gstart = batch.split - n_groups  # every batch text has >= 1 group
    laid = len(full) == len(targets) and getattr(targets, "ids", None) is not None
    tgt_ids = targets.ids.copy() if laid else np.concatenate([targets[k].ids for k in full])
    unk = (
        np.add.reduceat((tgt_ids == prof.unk_id).astype(np.int64), batch.tgt_offset).tolist()
        if prof.unk_id is not None
        else len(full) * [0]
    )
    fallback = np.add.reduceat(prof.byte_fallback[tgt_ids].astype(np.int64), batch.tgt_offset)
    gsums, mass_errors, lp_all = None, len(full) * [0.0], None
    if len(full) == len(sources) and getattr(sources, "logprobs", None) is not None:
        lp_all = sources.logprobs  # the usual batch's, laid end to end (``SourceList``)
    elif all(sources[k].logprobs is not None for k in full):
        # Texts with specials have more log-probs than ends: placeholders keep the layout.
        lp_all = np.concatenate(
            [
                sources[k].logprobs if not sources[k].n_specials else np.zeros(sources[k].ends.size)
                for k in full
            ]
        )
    if lp_all is not None:
        gsums = np.add.reduceat(lp_all, local[0] + np.repeat(batch.src_offset, n_groups))
        mass_errors = np.abs(
            np.add.reduceat(lp_all, batch.src_offset) - np.add.reduceat(gsums, gstart)
        ).tolist()
    return tgt_ids, unk, fallback.tolist(), gsums, mass_errors


def _source_columns(sources, full: list[int], summed: bool) -> tuple[list, ...]:
    """Per text of ``full``, its source side: (plain: no specials, and its log-probs summed with
    the batch's if it has any; tokens; mismatch; edit distance). A ``SourceList`` answers from
    its arrays, without making its texts' ``Source`` objects."""
    n = len(full)
    if getattr(sources, "sizes", None) is not None:  # the usual batch: no specials, all spelled
        sizes = sources.sizes if n == len(sources) else sources.sizes[full]
        return [True] * n, sizes.tolist(), [False] * n, [0] * n
    srcs = [sources[k] for k in full]
    return (
        [not s.n_specials and (summed or s.logprobs is None) for s in srcs],
        [s.ends.size for s in srcs],
        [bool(s.mismatch) for s in srcs],
        [s.edit_distance for s in srcs],
    )


def _edit_text(
    prof: TokenizerProfile,
    max_length: int | None,
    tgt: Encoded,
    src: Source | None,
    groups: AlignmentGroups,
    total: int,
    ends_with_eos: bool,
    out: Assembled,
    k: int,
) -> None:
    """Text ``k``'s result in ``out`` from its groups as aligned, edited on their own: source
    positions mapped back past specials, the EOS group appended, the cut at ``max_length``."""
    if src is not None and src.kept_index is not None and src.kept_index.size:
        groups = _remap_source(groups, src.kept_index)
    target_ids = tgt.ids
    paired = False
    if ends_with_eos and prof.eos_id is not None:
        eos_index = src.eos_index if src is not None else None
        paired = eos_index is not None
        start = eos_index if eos_index is not None else (src.ids.size if src is not None else 0)
        groups = _append_group(groups, start, start + int(paired), target_ids.size, total)
        target_ids = np.append(target_ids, np.int64(prof.eos_id))
    sums, lp_total, stripped_mass = _group_sums(src, groups, paired)
    mass_error = abs(lp_total - _total(sums)) if sums is not None else 0.0
    n_all = target_ids.size
    groups, target_ids, truncated_mass = _truncate(max_length, groups, target_ids, sums)
    out.target_ids[k], out.groups[k] = target_ids.copy(), groups
    out.sums[k] = sums[: len(groups)] if sums is not None else None
    out.rows.put(k, _text_counts(prof, tgt, src, groups, total))
    cut = n_all != target_ids.size
    out.rows.put(
        k,
        {
            "specials_stripped": (src.n_specials - int(paired)) if src is not None else 0,
            "specials_added": int(ends_with_eos and prof.eos_id is not None and not paired),
            "eos_paired": paired,
            "truncated_tokens": n_all - target_ids.size,
            "truncated_bytes": total - (int(groups.byte_end[-1]) if len(groups) else 0)
            if cut
            else 0,
            "logprob_mass_error": mass_error,
            "logprob_mass_unassigned": stripped_mass + truncated_mass,
        },
    )


def _text_counts(
    prof: TokenizerProfile, tgt: Encoded, src: Source | None, groups: AlignmentGroups, total: int
) -> dict[str, Any]:
    """The residual row of one text from its encodings and its (edited) groups, but for what the
    edits did."""
    src_ends = src.ends if src is not None else _NO_TOKENS
    ns, nt = groups.source_sizes(), groups.target_sizes()
    one_s, one_t = ns == 1, nt == 1
    ids = tgt.ids
    n_common = common_boundaries(src_ends, tgt.ends).size if src is not None else 0
    return {
        "n_bytes": total,
        "n_source_tokens": src_ends.size,
        "n_target_tokens": ids.size,
        "n_groups": len(groups),
        "roundtrip_mismatch": tgt.mismatch,
        "roundtrip_edit_distance": tgt.edit_distance,
        "normalizer_changed_text": tgt.normalizer_changed,
        "source_mismatch": bool(src is not None and src.mismatch),
        "source_edit_distance": src.edit_distance if src is not None else 0,
        "boundary_iou": byte_iou(src_ends, tgt.ends, n_common) if src is not None else 0.0,
        "groups_1_1": int(np.count_nonzero(one_s & one_t)),
        "groups_1_n": int(np.count_nonzero(one_s & (nt > 1))),
        "groups_n_1": int(np.count_nonzero((ns > 1) & one_t)),
        "largest_group_source_tokens": int(ns.max()) if ns.size else 0,
        "largest_group_target_tokens": int(nt.max()) if nt.size else 0,
        "largest_group_bytes": (
            int((groups.byte_end - groups.byte_start).max()) if len(groups) else 0
        ),
        "unknown_tokens": (
            int(np.count_nonzero(ids == prof.unk_id)) if prof.unk_id is not None else 0
        ),
        "byte_fallback_tokens": int(np.count_nonzero(prof.byte_fallback[ids])),
    }


def _truncate(max_length: int | None, groups: AlignmentGroups, target_ids: np.ndarray, sums):
    """Cut at the last group boundary that fits ``max_length``; return the dropped mass."""
    if max_length is None or target_ids.size <= max_length:
        return groups, target_ids, 0.0
    keep = int(np.searchsorted(groups.tgt_end, max_length, side="right"))
    cut = int(groups.tgt_end[keep - 1]) if keep else 0
    lost = 0.0 if sums is None else abs(float(sums[keep:].sum()))
    return groups.slice(keep), target_ids[:cut], lost


def _remap_source(groups: AlignmentGroups, kept_index: np.ndarray) -> AlignmentGroups:
    """Map source ranges over non-special tokens back to positions in the ids as given."""
    nonempty = groups.src_end > groups.src_start
    start = np.where(nonempty, kept_index[np.minimum(groups.src_start, kept_index.size - 1)], 0)
    end = np.where(nonempty, kept_index[np.maximum(groups.src_end - 1, 0)] + 1, 0)
    return AlignmentGroups(
        start, end, groups.tgt_start, groups.tgt_end, groups.byte_start, groups.byte_end
    )


def _append_group(groups: AlignmentGroups, s0: int, s1: int, t0: int, byte: int):
    add = lambda a, v: np.append(a, np.int64(v))  # noqa: E731 - tiny local helper
    return AlignmentGroups(
        add(groups.src_start, s0),
        add(groups.src_end, s1),
        add(groups.tgt_start, t0),
        add(groups.tgt_end, t0 + 1),
        add(groups.byte_start, byte),
        add(groups.byte_end, byte),
    )


def _group_sums(src: Source | None, groups: AlignmentGroups, paired: bool):
    """(per-group sums, assigned total, |mass of stripped specials|); sums None without lps."""
    if src is None or src.logprobs is None:
        return None, 0.0, 0.0
    lp = src.logprobs
    stripped = 0.0
    if src.n_specials:
        lp = lp.copy()
        mask = np.ones(lp.size, dtype=bool)
        if src.kept_index is not None:
            mask[src.kept_index] = False
        if paired:
            mask[src.eos_index] = False
        stripped = abs(float(lp[mask].sum()))
        lp[mask] = 0.0
    sums = np.zeros(len(groups), dtype=np.float64)
    nonempty = groups.src_end > groups.src_start
    if lp.size and nonempty.any():
        # reduceat sums start[i]..start[i+1]-1; any gap in between holds only zeroed specials.
        sums[nonempty] = np.add.reduceat(lp, groups.src_start[nonempty])
    return sums, _total(lp), stripped


def _total(values: np.ndarray) -> float:
    """The sum of ``values`` as one segment of an ``np.add.reduceat`` (as the batch path sums
    every text's at once; ``ndarray.sum``'s pairwise order would differ in the last bits)."""
    return float(np.add.reduceat(values, [0])[0]) if values.size else 0.0
