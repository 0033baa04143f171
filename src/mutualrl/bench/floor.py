"""The floors the retokenization benchmark holds ``Retokenizer.retokenize_batch`` against.

Each floor is written apart from the code it measures, from the library's primitives (the Rust
encode, the byte tables, the WordPiece walk, the aligner), doing as little as its result allows.
Each takes the benchmark's ``PairData`` of a pair and returns the function the benchmark times:

* ``floor``: what any byte-offset retokenizer of a batch must do at least, the receiver's encode,
  both sides' byte ends and one alignment. No checks, no log-prob sums, no residuals, no per-text
  results. With ``rendered`` / ``residuals`` it adds a WordPiece receiver's decode and its
  round-trip residuals (``floor_rendered``, ``floor_residuals``).
* ``floor_results``: the least work the retokenizer's *result* needs: the same, plus the checks
  every bad input must fail (ids one-dimensional and in the vocabulary, one finite log-prob per
  id, ids that spell their text, else byte ends from an encoding with offsets), the log-prob sum
  of every group, every residual, and one ``RetokenizedTrajectory`` per text. All of it in
  whole-batch passes, with no per-text objects but the results themselves. It gives exactly the
  retokenizer's results (``tests/retokenize/test_benchmark.py``), for batches like the
  benchmark's: ids as the sender's own encoding gives them, without specials, EOS or truncation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from mutualrl.retokenize.align import BatchAlignment, align_batch, align_flat
from mutualrl.retokenize.encoded import (
    batch_ends,
    encode_from,
    encodes_without_offsets,
    laid_ids,
    offset_ends_batch,
    spelled_ends,
)
from mutualrl.retokenize.encoding import EncodingCache, rust_encode, rust_threads, utf8
from mutualrl.retokenize.normalize import normalizer_changes
from mutualrl.retokenize.residuals import AlignmentResiduals, byte_edit_distances
from mutualrl.retokenize.retokenizer import _trajectory
from mutualrl.retokenize.sources import read_sources
from mutualrl.retokenize.wordpiece import folded_ends

if TYPE_CHECKING:
    from mutualrl.retokenize.profile import TokenizerProfile

_NO_CACHE = EncodingCache(0)


def floor(d, rendered: bool = False, residuals: bool = False):
    """What any byte-offset retokenizer of the batch must do at least: the receiver's Rust encode
    (without offsets where its byte ends come from its table: ``encode_batch_fast``) with its ids
    read into one array, byte ends of both sides, and one alignment over the batch.
    No checks (ids in range, finite log-probs, ids that spell the text), no log-prob sums, no
    residuals, no per-text results. A lossless side's byte ends come from its byte-length table.
    A WordPiece side's come from walking its ids along the folded text
    (``wordpiece.folded_ends``; the receiver's ids from ``encode_batch_fast``, as the
    retokenizer's), and, for texts whose ids do not walk, from encoding those texts again with
    offsets (``offset_ends_batch``), as the retokenizer does. With ``rendered`` it
    also decodes the receiver's ids when the receiver is not lossless: the rendering its round-trip
    residuals compare with the text, which only its decoder gives (``floor_rendered``); with
    ``residuals`` as well, the two round-trip residuals the result holds for each text: the
    rendering's byte edit distance to the text (rapidfuzz, one call for the batch) and whether
    the normaliser rewrote the text (``floor_residuals``)."""
    prof, sprof = d.tgt.profile, d.tgt.profile_for(d.src.target)
    backend = prof.continuation
    src_flat = np.concatenate(d.src_ids)
    src_sizes = np.fromiter(map(len, d.src_ids), dtype=np.int64, count=len(d.src_ids))
    datas = [utf8(t) for t in d.texts]

    def side(p, encs):
        """Byte ends of one side: (ids, ends, sizes) of its encodings of the texts."""
        ids = [e.ids for e in encs]
        flat, sizes = laid_ids(ids)
        if p.lossless:
            return flat, batch_ends(p.piece_len[flat], sizes)[0], sizes
        if not encodes_without_offsets(p):
            return offset_ends_batch(p, encs, d.texts, datas, ids)
        return flat, np.concatenate(wordpiece_ends(p, flat, sizes, d.texts, datas)), sizes

    def run():
        encs = rust_encode(prof, d.texts)
        _, t_ends, t_sizes = side(prof, encs)
        if (rendered or residuals) and not prof.lossless:
            texts = backend.decode_batch([e.ids for e in encs], skip_special_tokens=False)
            if residuals:
                byte_edit_distances([t.encode() for t in texts], datas, rust_threads())
                normalizer_changes(prof, d.texts)
        if sprof.lossless:
            s_ends = split_ends(batch_ends(sprof.piece_len[src_flat], src_sizes)[0], src_sizes)
        else:
            s_ends = wordpiece_ends(sprof, src_flat, src_sizes, d.texts, datas)
        return align_batch(s_ends, split_ends(t_ends, t_sizes), d.totals)

    return run


def split_ends(ends: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    return np.split(ends, np.cumsum(sizes)[:-1])


def wordpiece_ends(
    p, flat: np.ndarray, sizes: np.ndarray, texts: list[str], datas: list[bytes]
) -> list[np.ndarray]:
    """The floor's WordPiece byte ends per text: the folded walk of the ids (``folded_ends``),
    and the texts' encoding's offsets where the ids do not walk (every text where it does not
    apply)."""
    walked = folded_ends(p, flat, sizes, texts, datas)
    spells, ends = walked if walked is not None else (np.zeros(len(texts), bool), None)
    out: list[np.ndarray | None] = (
        list(split_ends(ends, sizes)) if ends is not None else [None] * len(texts)
    )
    todo = np.flatnonzero(~spells).tolist()
    if todo:
        some = [texts[i] for i in todo]
        encs = p.continuation.encode_batch(some, add_special_tokens=False)
        _, e_ends, e_sizes = offset_ends_batch(p, encs, some, [datas[i] for i in todo])
        for i, e in zip(todo, split_ends(e_ends, e_sizes)):
            out[i] = e
    return cast(list[np.ndarray], out)  # every text the walk left (None) was encoded above


def floor_results(d):
    """The least work ``retokenize_batch``'s result needs (module docstring): a function that
    returns the same ``RetokenizedTrajectory`` per text as the retokenizer with its cache off."""
    prof, sprof = d.tgt.profile, d.tgt.profile_for(d.src.target)
    texts, src_ids, src_lps = d.texts, d.src_ids, d.src_lps

    def run():
        datas = [utf8(t) for t in texts]
        n = len(datas)
        totals = np.fromiter(map(len, datas), dtype=np.int64, count=n)
        t_flat, t_ends, t_sizes, t_res = _receiver(prof, texts, datas)
        s_ends, s_sizes, lps, s_res = _sender(sprof, texts, datas, src_ids, src_lps)
        if not (s_sizes.all() and t_sizes.all()):
            raise ValueError("floor_results: expected tokens on both sides of every text")
        # every text has ends on both sides (checked above): the batch aligns them all
        batch = cast(BatchAlignment, align_flat(s_ends, s_sizes, t_ends, t_sizes, totals))
        return _results(prof, texts, totals, batch, t_flat, t_sizes, t_res, s_sizes, lps, s_res)

    return run


def _receiver(prof: TokenizerProfile, texts: list[str], datas: list[bytes]):
    """(ids, byte ends, sizes, (mismatch, edit distance, normaliser changed) per text) of the
    receiver's encoding, its byte ends checked against the text (spelled or walked); a text that
    does not check takes the encoding with offsets, as it must."""
    n = len(texts)
    encs = rust_encode(prof, texts)
    ids = [e.ids for e in encs]
    flat, sizes = laid_ids(ids)
    if not prof.lossless:  # the round-trip residuals from the decoder, and the walk's ends
        rendered = [
            t.encode() for t in prof.continuation.decode_batch(ids, skip_special_tokens=False)
        ]
        dist = byte_edit_distances(rendered, datas, rust_threads())
        res = ([x > 0 for x in dist], dist, normalizer_changes(prof, texts))
        return flat, np.concatenate(wordpiece_ends(prof, flat, sizes, texts, datas)), sizes, res
    spells, ends = spelled_ends(prof, flat, sizes, datas)
    res = ([False] * n, [0] * n, [False] * n)
    bad = np.flatnonzero(~spells).tolist()
    if bad:
        ends, start = ends.copy(), np.cumsum(sizes) - sizes
        for i in bad:
            enc = encode_from(
                prof,
                prof.continuation.encode(texts[i], add_special_tokens=False),
                texts[i],
                datas[i],
            )
            ends[start[i] : start[i] + sizes[i]] = enc.ends
            res[0][i], res[1][i], res[2][i] = (
                enc.mismatch,
                enc.edit_distance,
                enc.normalizer_changed,
            )
    return flat, ends, sizes, res


def _sender(sprof: TokenizerProfile, texts, datas, src_ids, src_lps):
    """(byte ends, sizes, log-probs, (mismatch, edit distance) per text) of the sender's ids,
    checked: one-dimensional integers in its vocabulary, no specials, one finite log-prob each;
    ids that do not spell (or walk) their text take the retokenizer's own path for the sender."""
    n = len(texts)
    sizes = np.fromiter(map(len, src_ids), dtype=np.int64, count=n)
    flat = np.concatenate(src_ids)
    lps = np.concatenate(src_lps)
    if (
        flat.ndim != 1
        or flat.dtype != np.int64
        or flat.min() < 0
        or flat.max() >= sprof.piece_len.size
        or sprof.special[flat].any()
    ):
        raise ValueError(
            "floor_results: expected int64 ids in the sender's vocabulary, no specials"
        )
    if (
        lps.dtype != np.float64
        or not np.array_equal(np.fromiter(map(len, src_lps), dtype=np.int64, count=n), sizes)
        or (np.isnan(lps) | (lps == np.inf)).any()
    ):
        raise ValueError("floor_results: expected one finite float64 log-prob per id")
    walked = (
        spelled_ends(sprof, flat, sizes, datas)
        if sprof.lossless
        else folded_ends(sprof, flat, sizes, texts, datas)
    )
    if walked is None:
        raise ValueError("floor_results: expected a lossless or WordPiece sender")
    spells, ends = walked
    res = ([False] * n, [0] * n)
    bad = np.flatnonzero(~spells).tolist()
    if bad:
        ends, start = ends.copy(), np.cumsum(sizes) - sizes
        some = read_sources(
            sprof,
            [texts[i] for i in bad],
            [datas[i] for i in bad],
            [src_ids[i] for i in bad],
            None,
            [False] * len(bad),
            _NO_CACHE,
        )
        for i, src in zip(bad, some):
            ends[start[i] : start[i] + sizes[i]] = src.ends
            res[0][i], res[1][i] = bool(src.mismatch), src.edit_distance
    return ends, sizes, lps, res


def _results(
    prof, texts, totals, batch: BatchAlignment, t_flat, t_sizes, t_res, s_sizes, lps, s_res
) -> list:
    """One ``RetokenizedTrajectory`` per text from whole-batch columns: the kernel's statistics,
    segment sums of the log-probs per group and per text, unknown and byte-fallback counts."""
    stats, local, split = batch.statistics(), batch.local, batch.split
    t_off, s_off = batch.tgt_offset, batch.src_offset
    n_groups = stats[0]
    gsums = np.add.reduceat(lps, local[0] + np.repeat(s_off, n_groups))
    mass = np.abs(np.add.reduceat(lps, s_off) - np.add.reduceat(gsums, split - n_groups)).tolist()
    unk = (
        np.add.reduceat((t_flat == prof.unk_id).astype(np.int64), t_off).tolist()
        if prof.unk_id is not None
        else None
    )
    fallback = np.add.reduceat(prof.byte_fallback[t_flat].astype(np.int64), t_off).tolist()
    t_stop = (t_off + t_sizes).tolist()
    out, lo = [], 0
    for k, (
        hi,
        t0,
        t1,
        total,
        n_src,
        g,
        ng,
        c11,
        c1n,
        cn1,
        big_s,
        big_t,
        big_b,
        us,
        ut,
    ) in enumerate(
        zip(
            split.tolist(),
            t_off.tolist(),
            t_stop,
            totals.tolist(),
            s_sizes.tolist(),
            batch.groups(),
            *stats.tolist(),
        )
    ):
        m = t1 - t0
        residuals = AlignmentResiduals(
            n_bytes=total,
            n_source_tokens=n_src,
            n_target_tokens=m,
            n_groups=ng,
            roundtrip_mismatch=t_res[0][k],
            roundtrip_edit_distance=t_res[1][k],
            normalizer_changed_text=t_res[2][k],
            source_mismatch=s_res[0][k],
            source_edit_distance=s_res[1][k],
            boundary_iou=ng / (us + ut - ng),
            groups_1_1=c11,
            groups_1_n=c1n,
            groups_n_1=cn1,
            groups_n_m=ng - c11 - c1n - cn1,
            largest_group_source_tokens=big_s,
            largest_group_target_tokens=big_t,
            largest_group_bytes=big_b,
            length_ratio=m / n_src,
            unknown_rate=unk[k] / m if unk is not None else 0.0,
            byte_fallback_rate=fallback[k] / m,
            specials_stripped=0,
            specials_added=0,
            eos_paired=False,
            truncated_tokens=0,
            truncated_bytes=0,
            logprob_mass_error=mass[k],
            logprob_mass_unassigned=0.0,
        )
        out.append(_trajectory(texts[k], t_flat[t0:t1], g, gsums[lo:hi], residuals))
        lo = hi
    return out
