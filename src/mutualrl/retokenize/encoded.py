"""One side's encoding of texts: ``Encoded``, a text's ids with the byte end of every token and
its round-trip residuals (computed on first use where the ids did not spell the text), and
``EncodedList``, a batch's encodings with the batch's arrays laid end to end; and how a batch of
Rust encodings becomes them (``encode_from_batch``), the byte ends read where they are exact
and cheapest:

* a lossless tokenizer's from its per-id byte-length table, where its pieces spell the text
  (the usual case: one table lookup and a cumsum; ``spelled_ends`` checks a whole batch);
* WordPiece's from walking its ids along the folded text (``wordpiece.folded_ends``);
* otherwise from the fast tokenizer's *character* offsets converted to byte offsets.

From offsets, a token ends where the span of text it came from ends, except in a run of tokens
reporting the same span (several tokens out of one character: byte-fallback bytes, a Hangul
syllable's jamo under NFD), where each but the last ends its piece's bytes after the span's
start, at most at its end. Then the ends are made non-decreasing and the last ones extended to
the end of the text (``pin_last``), so the tokens tile every byte exactly once.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from mutualrl.retokenize.profile import TokenizerProfile
from mutualrl.retokenize.residuals import byte_edit_distance
from mutualrl.retokenize.wordpiece import fold_table, folded_ends


class Encoded:
    """A text encoded by one tokenizer in continuation mode (no specials, no prefix space).

    ``ids``                 int64, read-only
    ``ends``                int64 byte end of each token, read-only
    ``mismatch``            the tokenizer's rendering of ``ids`` differs from the text
    ``edit_distance``       byte Levenshtein distance of that rendering to the text
    ``normalizer_changed``  the normaliser rewrote the text (WordPiece)

    The last three are computed on first use when the encoding did not spell the text exactly
    (a source side only needs ``ids`` and ``ends``, and never pays for the decode).
    """

    __slots__ = ("ids", "ends", "_mismatch", "_distance", "_changed", "_lazy")
    # None while ``_lazy`` holds what resolves them; bool, int, bool after.
    _mismatch: Any
    _distance: Any
    _changed: Any

    def __init__(
        self,
        ids: np.ndarray,
        ends: np.ndarray,
        mismatch: bool | None = False,
        edit_distance: int | None = 0,
        normalizer_changed: bool | None = False,
        lazy: tuple | None = None,
    ) -> None:
        self.ids = ids
        self.ends = ends
        self._mismatch = mismatch
        self._distance = edit_distance
        self._changed = normalizer_changed
        self._lazy = lazy  # (profile, text, data, rendered bytes or None)

    @property
    def pending(self) -> tuple | None:
        """(profile, text, its bytes, rendered bytes or None) while the round-trip residuals
        are still to be computed, else None (``encoding.add_renderings`` computes a batch's)."""
        return self._lazy

    def _resolve(self, lazy: tuple) -> None:
        profile, text, data, rendered = lazy
        if rendered is None:
            rendered = profile.continuation.decode(
                self.ids.tolist(), skip_special_tokens=False
            ).encode()
        normalizer = profile.continuation.normalizer
        self._changed = normalizer is not None and normalizer.normalize_str(text) != text
        self._distance = byte_edit_distance(rendered, data)
        self._mismatch = self._distance > 0
        self._lazy = None

    @property
    def mismatch(self) -> bool:
        if self._lazy is not None:
            self._resolve(self._lazy)
        return self._mismatch

    @property
    def edit_distance(self) -> int:
        if self._lazy is not None:
            self._resolve(self._lazy)
        return self._distance

    @property
    def normalizer_changed(self) -> bool:
        if self._lazy is not None:
            self._resolve(self._lazy)
        return self._changed

    def with_rendering(
        self, rendered: bytes, changed: bool | None = None, distance: int | None = None
    ) -> None:
        """Supply the rendering (from a batched decode) and, if known, whether the normaliser
        changed the text (from a batched normalisation) and the rendering's edit distance to the
        text (from a batched distance), before the residuals are read."""
        if self._lazy is None:
            return
        if changed is None:
            self._lazy = (*self._lazy[:3], rendered)
            return
        self._changed = changed
        self._distance = (
            byte_edit_distance(rendered, self._lazy[2]) if distance is None else distance
        )
        self._mismatch = self._distance > 0
        self._lazy = None


class EncodedList(list):
    """``Encoded`` per text, in order, with the batch's arrays laid end to end, read-only:
    ``ids``, ``ends`` (those of the texts that took ``encode_from`` included) and ``sizes``
    (tokens per text), so a batch is aligned and summed without concatenating its texts' arrays
    again. ``encode_texts`` returns one when it encoded the whole batch at once (no cache hit),
    else a plain list; the arrays are None where the texts' ids differ in number from the
    batch's (never seen: the same tokenizer encodes them)."""

    ids: np.ndarray | None = None
    ends: np.ndarray | None = None
    sizes: np.ndarray | None = None

    @classmethod
    def laid_out(
        cls,
        out: list[Encoded],
        flat: np.ndarray,
        ends: np.ndarray,
        sizes: np.ndarray,
        again: list[int],
    ) -> EncodedList:
        """``out`` over the batch's arrays. The texts ``again`` took ``encode_from``: their ends
        are written into a copy of ``ends`` (their ids are the batch's, as the same tokenizer
        gives them; should they differ in number, no arrays are kept)."""
        laid = cls(out)
        if again:
            stops = np.cumsum(sizes).tolist()
            if any(out[i].ids.size != int(sizes[i]) for i in again):
                return laid
            ends = ends.copy()
            for i in again:
                ends[stops[i] - out[i].ids.size : stops[i]] = out[i].ends
            ends.flags.writeable = False
        laid.ids, laid.ends, laid.sizes = flat, ends, sizes
        return laid


def char_to_byte(text: str) -> np.ndarray:
    """Byte offset of every character boundary of ``text`` (length ``len(text) + 1``)."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    lens = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    out = np.zeros(cps.size + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def ends_from_offsets(
    offsets, text: str, n_bytes: int, piece_len: np.ndarray | None = None
) -> np.ndarray:
    """Token byte ends from character offsets, tiling ``[0, n_bytes)`` exactly.

    Several tokens that split one character (byte fallback, byte-level BPE) all report that
    character's offsets; given ``piece_len`` (bytes per token) the character's bytes are shared
    out among them in order, as far as the character reaches.
    """
    if not offsets:
        return np.zeros(0, dtype=np.int64)
    spans = np.array(offsets, dtype=np.int64)
    if n_bytes != len(text):  # non-ASCII: character offsets are not byte offsets
        spans = char_to_byte(text)[spans]
    starts, ends = spans[:, 0], spans[:, 1]
    if piece_len is not None and ends.size > 1:
        same = (starts[1:] == starts[:-1]) & (ends[1:] == ends[:-1])
        if same.any():
            ends = split_shared_spans(starts, ends, same, piece_len)
    ends = np.maximum.accumulate(ends)
    return pin_last(ends, n_bytes)


def pin_last(ends: np.ndarray, n_bytes: int) -> np.ndarray:
    """Extend the last token (and zero-width tokens sharing its end) to the end of the text.

    Trailing bytes no token covers (whitespace for WordPiece) join the last token; moving the whole
    final run of equal ends keeps a character split into several zero-width tokens (Hangul
    syllables become jamo under WordPiece's NFD) inside one token span.
    """
    if ends.size:
        ends[ends == ends[-1]] = n_bytes
    return ends


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def encode_from(profile: TokenizerProfile, enc, text: str, data: bytes) -> Encoded:
    """Build an ``Encoded`` from a Rust ``Encoding`` of ``text`` (whose UTF-8 is ``data``)."""
    ids_list = enc.ids
    ids = np.array(ids_list, dtype=np.int64)
    rendered = None
    if profile.lossless:
        rendered = profile.text_bytes(ids_list)
        if rendered == data:
            return Encoded(
                _frozen(ids), _frozen(np.cumsum(profile.piece_len[ids])), False, 0, False
            )
    ends = ends_from_offsets(enc.offsets, text, len(data), profile.piece_len[ids])
    return Encoded(
        _frozen(ids), _frozen(ends), None, None, None, lazy=(profile, text, data, rendered)
    )


def laid_ids(id_lists) -> tuple[np.ndarray, np.ndarray]:
    """Id lists (a batch's Rust encodings' ``ids``) laid end to end: (the ids as one int64
    array, ids per text)."""
    sizes = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    flat = np.fromiter(
        itertools.chain.from_iterable(id_lists), dtype=np.int64, count=int(sizes.sum())
    )
    return flat, sizes


def batch_ends(lens: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token byte lengths laid end to end (``lens``; ``sizes`` tokens per text) -> each token's
    byte end within its own text (aligned with ``lens``) and each text's total bytes."""
    cum = np.concatenate(([0], np.cumsum(lens)))
    stops = np.cumsum(sizes)
    before = cum[stops - sizes]  # bytes before each text
    return cum[1:] - np.repeat(before, sizes), cum[stops] - before


def spelled_ends(
    profile: TokenizerProfile, flat: np.ndarray, sizes: np.ndarray, datas: list[bytes]
) -> tuple[np.ndarray, np.ndarray]:
    """Id sequences laid end to end (``flat``; ``sizes`` ids per text), checked against their
    texts' bytes in whole-batch numpy passes instead of a join and a cumsum per text.

    Returns ``spells`` (N,) bool: ``profile.text_bytes(ids_i) == datas[i]``; and ``ends``, aligned
    with ``flat``: each token's byte end within its own text (``cumsum(piece_len[ids_i])``),
    read-only.
    """
    n = sizes.size
    lens = profile.piece_len[flat]
    ends, text_bytes = batch_ends(lens, sizes)
    ends.flags.writeable = False
    want = np.fromiter(map(len, datas), dtype=np.int64, count=n)
    spells = text_bytes == want  # the right length first
    check = spells & (want > 0)
    if check.any():  # then the bytes themselves
        buf, start = profile.piece_table()
        keep = np.repeat(check, sizes)
        ids, k_lens = flat[keep], lens[keep]
        shift = start[ids] - (np.cumsum(k_lens) - k_lens)
        got = buf[np.repeat(shift, k_lens) + np.arange(int(k_lens.sum()), dtype=np.int64)]
        data = np.frombuffer(b"".join(itertools.compress(datas, check.tolist())), dtype=np.uint8)
        bad = np.concatenate(([0], np.cumsum(got != data)))
        stop = np.cumsum(want[check])
        spells[check] = bad[stop] == bad[stop - want[check]]
    return spells, ends


def offset_ends_batch(
    profile: TokenizerProfile,
    encs,
    texts: list[str],
    datas: list[bytes],
    id_lists: list | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``ends_from_offsets`` for a whole batch of Rust encodings in numpy passes: (ids end to end,
    each token's byte end within its own text aligned with them, tokens per text).

    The texts are laid end to end with a one-byte gap (as in ``align.align_batch``), so no run of
    tokens sharing a span, no running maximum and no pinned last end crosses from one text into
    the next; each value equals the per-text ``ends_from_offsets``'s. ``id_lists``: the
    encodings' ``ids``, when the caller has read them already.
    """
    n = len(encs)
    if id_lists is None:
        id_lists = [e.ids for e in encs]
    flat, sizes = laid_ids(id_lists)
    total = flat.size
    chain = itertools.chain.from_iterable
    spans = np.fromiter(
        chain(chain(e.offsets for e in encs)), dtype=np.int64, count=2 * total
    ).reshape(total, 2)
    n_bytes = np.fromiter(map(len, datas), dtype=np.int64, count=n)
    n_chars = np.fromiter(map(len, texts), dtype=np.int64, count=n)
    if (n_bytes != n_chars).any():  # non-ASCII: character offsets are not byte offsets
        char_base = np.repeat(np.cumsum(n_chars) - n_chars, sizes)
        spans = char_to_byte("".join(texts))[spans + char_base[:, None]]
        spans -= np.repeat(np.cumsum(n_bytes) - n_bytes, sizes)[:, None]
    ends = settle_batch_ends(spans[:, 0], spans[:, 1], profile.piece_len[flat], sizes, n_bytes)
    return flat, ends, sizes


def encode_from_batch(
    profile: TokenizerProfile, encs, texts: list[str], datas: list[bytes], render: bool = False
) -> list[Encoded]:
    """``encode_from`` for many Rust encodings at once. For a lossless tokenizer the ids, byte ends
    and spelling checks of the whole batch are numpy passes, and each text's ``Encoded`` holds
    views of them; a text whose ids do not spell it takes ``encode_from``, on an encoding made
    again with offsets where the batch's have none (``encodes_without_offsets``). Otherwise
    (WordPiece) see ``_encode_not_lossless``."""
    if len(encs) < 2:
        return [encode_from(profile, e, t, d) for e, t, d in zip(encs, texts, datas)]
    if not profile.lossless:
        return _encode_not_lossless(profile, encs, texts, datas, render)
    flat, sizes = laid_ids([e.ids for e in encs])
    spells, ends = spelled_ends(profile, flat, sizes, datas)
    flat.flags.writeable = False
    fresh = encodes_without_offsets(profile)  # the batch's encodings carry no offsets
    out, lo, again = [], 0, []
    for i, (hi, ok) in enumerate(zip(np.cumsum(sizes).tolist(), spells.tolist())):
        if ok:
            out.append(Encoded(flat[lo:hi], ends[lo:hi], False, 0, False))
        else:
            enc = (
                profile.continuation.encode(texts[i], add_special_tokens=False)
                if fresh
                else encs[i]
            )
            out.append(encode_from(profile, enc, texts[i], datas[i]))
            again.append(i)
        lo = hi
    return EncodedList.laid_out(out, flat, ends, sizes, again)


def _encode_not_lossless(
    profile: TokenizerProfile, encs, texts: list[str], datas: list[bytes], render: bool
) -> EncodedList:
    """``encode_from_batch`` for a tokenizer that is not lossless (WordPiece). The byte ends of
    the whole batch come from walking its ids along the folded texts (``wordpiece.folded_ends``;
    a text whose ids do not walk takes ``encode_from`` on an encoding made again with offsets),
    or from its offsets (``offset_ends_batch``) where the fold does not apply; with ``render``
    its ids are also decoded, in one ``decode_batch`` of the id lists that pass read, for the
    round-trip residuals (``add_renderings``)."""
    id_lists = [e.ids for e in encs]
    rendered = (
        [r.encode() for r in profile.continuation.decode_batch(id_lists, skip_special_tokens=False)]
        if render
        else [None] * len(encs)
    )
    spells = None
    if encodes_without_offsets(profile):  # WordPiece without offsets: its ids walked
        flat, sizes = laid_ids(id_lists)
        walked = folded_ends(profile, flat, sizes, texts, datas)
        assert walked is not None  # encodes_without_offsets: the profile has a fold table
        spells, ends = walked[0].tolist(), walked[1]
    else:
        flat, ends, sizes = offset_ends_batch(profile, encs, texts, datas, id_lists)
    flat.flags.writeable = ends.flags.writeable = False
    out, lo, again = [], 0, []
    for i, (hi, t, d, r) in enumerate(zip(np.cumsum(sizes).tolist(), texts, datas, rendered)):
        if spells is None or spells[i]:
            out.append(Encoded(flat[lo:hi], ends[lo:hi], None, None, None, lazy=(profile, t, d, r)))
        else:  # ids that do not walk (``wordpiece.folded_ends``): encoded again, offsets on
            enc = encode_from(
                profile, profile.continuation.encode(t, add_special_tokens=False), t, d
            )
            if r is not None:
                enc.with_rendering(r)
            out.append(enc)
            again.append(i)
        lo = hi
    return EncodedList.laid_out(out, flat, ends, sizes, again)


def encodes_without_offsets(profile: TokenizerProfile) -> bool:
    """Whether ``rust_encode`` encodes a batch with ``encode_batch_fast`` (recent ``tokenizers``
    releases): a tokenizer whose byte ends come without offsets, a lossless one's from its
    byte-length table and WordPiece's from walking its ids (``wordpiece.fold_table``)."""
    return (profile.lossless or fold_table(profile) is not None) and hasattr(
        profile.continuation, "encode_batch_fast"
    )


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
