"""The sender's side of a retokenized batch: its ids and log-probs checked, specials set apart,
and each kept token's byte end in the text (``read_sources``), for ``Retokenizer`` to align.

Byte ends come from the ids themselves where they spell the text: a lossless tokenizer's byte
tables (``encoded.spelled_ends``), WordPiece's walk along the folded text
(``wordpiece.folded_ends``). Otherwise from the sender's own encoding of the text, exact when
the ids are that encoding and clipped to the text (a source mismatch) when they are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mutualrl.retokenize.encoded import Encoded, pin_last, spelled_ends
from mutualrl.retokenize.encoding import EncodingCache, encode_texts
from mutualrl.retokenize.inputs import check_id_range, id_arrays, logprob_batch
from mutualrl.retokenize.profile import TokenizerProfile
from mutualrl.retokenize.residuals import byte_edit_distance
from mutualrl.retokenize.wordpiece import folded_ends

_NO_TOKENS = np.zeros(0, dtype=np.int64)
_NO_TOKENS.flags.writeable = False


@dataclass(slots=True)
class Source:
    """One trajectory's source side with specials separated out (internal; not frozen, since a
    batch builds one per text and a frozen dataclass sets each field through ``__setattr__``)."""

    ids: np.ndarray  # as given (or as encoded from the text)
    kept_index: np.ndarray | None  # positions of non-special ids; None = all kept
    ends: np.ndarray  # byte ends of the kept tokens
    eos_index: int | None  # a terminal source EOS that may pair with the target EOS
    n_specials: int  # special ids in ``ids`` (including ``eos_index``)
    logprobs: np.ndarray | None
    mismatch: bool
    edit_distance: int


class SourceList(Sequence):
    """The usual batch's sender side (no specials, every text's ids spell it): the batch's
    arrays laid end to end, read-only (the tokens' byte ``ends``, ``sizes``: tokens per text,
    ``logprobs``: None without), and each text's ``Source`` made from them on first access
    (a batch assembled whole never asks for one). ``read_sources`` returns a plain list of
    ``Source`` for any other batch."""

    def __init__(
        self,
        id_arrs: list,
        lps: list,
        ends: np.ndarray,
        sizes: np.ndarray,
        logprobs: np.ndarray | None,
    ) -> None:
        self._ids, self._lps, self._items = id_arrs, lps, [None] * len(id_arrs)
        self._stops = np.cumsum(sizes).tolist()
        self.ends, self.sizes, self.logprobs = ends, sizes, logprobs

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        item = self._items[k]
        if item is None:
            hi = self._stops[k]
            ends = self.ends[hi - int(self.sizes[k]) : hi]
            item = Source(self._ids[k], None, ends, None, 0, self._lps[k], False, 0)
            self._items[k] = item
        return item


def read_sources(
    prof: TokenizerProfile, texts, datas, source_ids, source_logprobs, flags, cache: EncodingCache
) -> list[Source]:
    """Each text's source side (``Source``) from the sender's ids and log-probs as given (or,
    without ids, from encoding the texts with the sender's tokenizer): the whole batch's checks,
    byte ends from the ids where they spell the text (``_walked_ends``), else from the sender's
    own encoding (``_source_ends``)."""
    if source_ids is None:
        encs = encode_texts(prof, texts, datas, cache, residuals=False)
        lps = logprob_batch(source_logprobs, [e.ids.size for e in encs])[0]
        return [
            Source(enc.ids, None, enc.ends, None, 0, lp, False, 0) for enc, lp in zip(encs, lps)
        ]
    n = len(texts)
    # Whole-batch checks: one range test of every id, one NaN/+inf test of every log-prob,
    # one special-token lookup; a failure is traced back to its text for the message.
    id_arrs = id_arrays(source_ids)
    sizes = np.fromiter(map(len, id_arrs), dtype=np.int64, count=n)
    flat = np.concatenate(id_arrs) if n else _NO_TOKENS
    check_id_range(flat, sizes, prof)
    lps, lp_flat = logprob_batch(source_logprobs, sizes.tolist())
    special = prof.special[flat]
    ends: list = [None] * n
    todo = []  # texts whose ids do not simply spell them: need the source's encoding
    specials = bool(special.any())
    if specials:  # (ids, kept, kept_index, eos_index, n_special, logprobs) per text
        counts, stops = np.concatenate(([0], np.cumsum(special, dtype=np.int64))), np.cumsum(sizes)
        n_specials = (counts[stops] - counts[stops - sizes]).tolist()
        parts = _kept(prof, id_arrs, n_specials, lps, flags)
        sizes = np.fromiter((p[1].size for p in parts), dtype=np.int64, count=n)
        flat = np.concatenate([p[1] for p in parts])
    walked = _walked_ends(prof, flat, sizes, texts, datas) if n else None
    if walked is not None and not specials and walked[0].all():
        # The usual batch: no specials, every text's ids spell it (folded for WordPiece).
        if lp_flat is not None:
            lp_flat.flags.writeable = False
        return SourceList(id_arrs, lps, walked[1], sizes, lp_flat)
    if not specials:
        parts = [(ids, ids, None, None, 0, lp) for ids, lp in zip(id_arrs, lps)]
    if walked is None:
        todo = [(i, None) for i in range(n)]
    else:  # ids that spell their text give their byte ends directly
        spells, rel = walked
        lo = 0
        for i, (hi, ok) in enumerate(zip(np.cumsum(sizes).tolist(), spells.tolist())):
            if ok:
                ends[i] = (rel[lo:hi], False, 0)
            else:
                todo.append((i, prof.text_bytes(parts[i][1].tolist()) if prof.lossless else None))
            lo = hi
    if todo:
        _encoded_ends(prof, todo, texts, datas, parts, cache, ends)
    return [
        Source(ids, kept_index, e[0], eos_index, n_special, lp, e[1], e[2])
        for (ids, _, kept_index, eos_index, n_special, lp), e in zip(parts, ends)
    ]


def _encoded_ends(prof: TokenizerProfile, todo: list, texts, datas, parts, cache, ends: list):
    """``ends[i]`` for each ``(i, rendered)`` of ``todo``, the texts whose ids do not spell them,
    from the sender's own encodings of those texts (one batch)."""
    encs = encode_texts(
        prof, [texts[i] for i, _ in todo], [datas[i] for i, _ in todo], cache, residuals=False
    )
    same = _equal_rows([e.ids for e in encs], [parts[i][1] for i, _ in todo])
    for (i, rendered), enc, ok in zip(todo, encs, same):
        if ok and rendered is None:  # a WordPiece sender's own encoding of its text
            ends[i] = (enc.ends, False, 0)
        else:
            ends[i] = _source_ends(prof, parts[i][1], texts[i], datas[i], enc, rendered)


def _source_ends(
    prof: TokenizerProfile,
    kept: np.ndarray,
    text: str,
    data: bytes,
    enc: Encoded,
    rendered: bytes | None,
):
    """Byte ends of source tokens that do not spell the text, whether they fail to, by how much.

    (Exact from the byte table when the ids spell the text: see ``read_sources``.) Otherwise, if
    the ids are what the source itself makes of the text (WordPiece; SentencePiece given a
    literal '▁'), from that encoding's offsets; else clipped to the text (approximate).
    """
    if np.array_equal(enc.ids, kept):
        # WordPiece cannot spell text by design (that is the receiver-side residual); a
        # lossless tokenizer that could not is a real source mismatch.
        return enc.ends, rendered is not None, enc.edit_distance if rendered is not None else 0
    if rendered is None:
        rendered = prof.continuation.decode(kept.tolist()).encode()
        data = prof.continuation.decode(enc.ids.tolist()).encode()
    ends = (
        enc.ends
        if enc.ids.size == kept.size
        else _clip_ends(np.cumsum(prof.piece_len[kept]), len(text.encode()))
    )
    return ends, True, byte_edit_distance(rendered, data)


def _kept(prof: TokenizerProfile, id_arrs, n_specials, lps, flags) -> list[tuple]:
    """Per text, its ids without specials: (ids, kept, kept_index, eos_index, n_special, lps),
    ``kept_index`` the positions kept (None: all) and ``eos_index`` a final EOS that may pair with
    the receiver's."""
    parts = []
    for i, (ids, n_special, lp) in enumerate(zip(id_arrs, n_specials, lps)):
        kept, kept_index, eos_index = ids, None, None
        if n_special:
            kept_index = np.flatnonzero(~prof.special[ids])
            kept = ids[kept_index]
            if flags[i] and int(ids[-1]) == prof.eos_id:
                eos_index = ids.size - 1
        parts.append((ids, kept, kept_index, eos_index, n_special, lp))
    return parts


def _walked_ends(prof: TokenizerProfile, flat, sizes, texts, datas):
    """(spells, ends) of id sequences laid end to end, from the ids themselves: a lossless
    tokenizer's byte tables (``spelled_ends``), WordPiece's folded walk (``folded_ends``); None
    where neither applies (every text then takes the source's encoding)."""
    if prof.lossless:
        return spelled_ends(prof, flat, sizes, datas)
    return folded_ends(prof, flat, sizes, texts, datas)


def _equal_rows(a: list[np.ndarray], b: list[np.ndarray]) -> list[bool]:
    """``np.array_equal(a[i], b[i])`` for every ``i``, in whole-batch passes."""
    n = len(a)
    size_a = np.fromiter(map(len, a), dtype=np.int64, count=n)
    same = size_a == np.fromiter(map(len, b), dtype=np.int64, count=n)
    rows = np.flatnonzero(same)
    if rows.size:
        rows_l = rows.tolist()
        diff = np.concatenate([a[k] for k in rows_l]) != np.concatenate([b[k] for k in rows_l])
        bad = np.concatenate(([0], np.cumsum(diff)))
        stop = np.cumsum(size_a[rows])
        same[rows] = bad[stop] == bad[stop - size_a[rows]]
    return same.tolist()


def _clip_ends(ends: np.ndarray, total: int) -> np.ndarray:
    # Whatever the source ids did not spell joins the last token.
    return pin_last(np.minimum(ends, total), total)
