"""Encoding texts on one side: ids plus the byte end of every token (``encoded.Encoded``), a
batch of texts in one Rust call, and a bounded LRU cache of encodings.

Byte ends come from the profile's per-id byte-length table when the tokenizer is lossless and its
pieces spell the text exactly (the usual case: one table lookup and a cumsum). Otherwise —
WordPiece, or a lossless tokenizer whose normaliser rewrote this particular text — they come from
the fast tokenizer's *character* offsets converted to byte offsets, made non-decreasing, with the
last end pinned to the text length so the tokens still tile every byte exactly once.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import OrderedDict

import numpy as np

from mutualrl.retokenize.encoded import Encoded, EncodedList
from mutualrl.retokenize.normalize import normalizer_changes
from mutualrl.retokenize.profile import TokenizerProfile
from mutualrl.retokenize.residuals import byte_edit_distances
from mutualrl.retokenize.spans import settle_batch_ends, split_shared_spans
from mutualrl.retokenize.wordpiece import fold_table, folded_ends


def utf8(text: str, field: str = "text") -> bytes:
    """UTF-8 bytes of ``text``; a lone surrogate is an error naming the field."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{field}: expected valid Unicode text, got {exc.reason} at character {exc.start}"
        ) from exc
    except AttributeError as exc:
        raise TypeError(f"{field}: expected str, got {type(text).__name__}") from exc


def utf8_all(texts, field: str = "texts") -> list[bytes]:
    """``utf8`` of every text in one pass; a text that fails is named ``field[i]``."""
    try:
        return [text.encode("utf-8") for text in texts]
    except (UnicodeEncodeError, AttributeError):
        return [utf8(text, f"{field}[{i}]") for i, text in enumerate(texts)]


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
        walked, ends = folded_ends(profile, flat, sizes, texts, datas)
        spells = walked.tolist()
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


class EncodingCache:
    """Bounded LRU of ``Encoded`` keyed by (text hash, tokenizer fingerprint); size 0 disables."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"cache_size: expected an integer >= 0, got {size}")
        self.size = size
        self._items: OrderedDict[tuple[bytes, str], Encoded] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(data: bytes, fingerprint: str) -> tuple[bytes, str]:
        return hashlib.blake2b(data, digest_size=16).digest(), fingerprint

    def get(self, key) -> Encoded | None:
        if self.size == 0:
            return None
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item

    def put(self, key, item: Encoded) -> None:
        if self.size == 0:
            return
        self._items[key] = item
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry (the hit and miss counts stay)."""
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def encode_texts(
    profile: TokenizerProfile,
    texts: list[str],
    datas: list[bytes],
    cache: EncodingCache,
    *,
    residuals: bool = True,
) -> list[Encoded]:
    """Encode many texts with one profile, batching cache misses into one Rust ``encode_batch``.

    With ``residuals`` the renderings that the round-trip residuals need (non-lossless
    tokenizers) are decoded in one ``decode_batch``; without, they are left to be computed on use.
    """
    if not cache.size:  # no cache: every text is encoded, no lookups to make
        done = encode_from_batch(profile, rust_encode(profile, texts), texts, datas, residuals)
        if residuals:
            add_renderings(profile, done)
        return done
    keys = [cache.key(d, profile.fingerprint) for d in datas]
    out: list[Encoded | None] = [cache.get(k) for k in keys]
    todo = [i for i, item in enumerate(out) if item is None]
    done = finish_encodings(
        profile,
        rust_encode(profile, [texts[i] for i in todo]),
        todo,
        texts,
        datas,
        keys,
        cache,
        out,
        render=residuals,
    )
    if residuals:
        add_renderings(profile, out)
    # every text encoded now: the batch's list, with its arrays laid end to end
    return done if len(todo) == len(texts) and isinstance(done, EncodedList) else out


def rust_encode(profile: TokenizerProfile, texts: list[str]) -> list:
    """The continuation backend's Rust encodings of ``texts`` (one call).

    A lossless tokenizer's byte ends come from its byte-length table, and WordPiece's from walking
    its ids along the text (``wordpiece``), not from offsets, so their batches are encoded by
    ``encode_batch_fast`` (the same ids, no offsets tracked: 0.54-0.92 of
    ``encode_batch``'s time on the packaged tokenizers, docs/results/performance.md);
    ``encode_from_batch`` encodes again, with offsets, the rare text whose ids do not spell it."""
    backend = profile.continuation
    if len(texts) == 1:
        return [backend.encode(texts[0], add_special_tokens=False)]
    if not texts:
        return []
    if encodes_without_offsets(profile):
        return backend.encode_batch_fast(texts, add_special_tokens=False)
    return backend.encode_batch(texts, add_special_tokens=False)


def encodes_without_offsets(profile: TokenizerProfile) -> bool:
    """Whether ``rust_encode`` encodes a batch with ``encode_batch_fast`` (recent ``tokenizers``
    releases): a tokenizer whose byte ends come without offsets, a lossless one's from its
    byte-length table and WordPiece's from walking its ids (``wordpiece.fold_table``)."""
    return (profile.lossless or fold_table(profile) is not None) and hasattr(
        profile.continuation, "encode_batch_fast"
    )


def finish_encodings(
    profile: TokenizerProfile,
    encs,
    todo: list[int],
    texts,
    datas,
    keys,
    cache: EncodingCache,
    out: list,
    render: bool = False,
) -> list[Encoded]:
    """``out[i]`` for each ``i`` of ``todo`` from its Rust encoding, cached under ``keys[i]``
    (``render``: see ``encode_from_batch``); returns ``encode_from_batch``'s list."""
    done = encode_from_batch(
        profile, encs, [texts[i] for i in todo], [datas[i] for i in todo], render
    )
    for i, item in zip(todo, done):
        out[i] = item
        if keys[i] is not None:
            cache.put(keys[i], item)
    return done


def add_renderings(profile: TokenizerProfile, encoded: list[Encoded]) -> None:
    """The renderings and normaliser checks the round-trip residuals of a non-lossless tokenizer
    need, for every encoding in ``encoded`` still without them: one ``decode_batch`` of those
    not decoded as they were encoded (``encode_from_batch``'s ``render``), one batched
    normaliser check and one batched edit distance."""
    if profile.lossless:
        return
    lazy = [e for e in encoded if e.pending is not None]
    if len(lazy) > 1:
        todo = [e for e in lazy if e.pending[3] is None]
        if todo:
            texts = profile.continuation.decode_batch(
                [e.ids.tolist() for e in todo], skip_special_tokens=False
            )
            for e, t in zip(todo, texts):
                e.with_rendering(t.encode())
        changed = normalizer_changes(profile, [e.pending[1] for e in lazy])
        rendered = [e.pending[3] for e in lazy]
        distances = byte_edit_distances(rendered, [e.pending[2] for e in lazy], rust_threads())
        for e, r, ch, dist in zip(lazy, rendered, changed, distances):
            e.with_rendering(r, ch, dist)


def rust_threads() -> int:
    """The threads of the Rust tokenizers' pool, which a batched step beside it may use alike:
    ``RAYON_NUM_THREADS``, else one per core; 1 with ``TOKENIZERS_PARALLELISM`` off."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "true").strip().lower() in (
        "",
        "off",
        "false",
        "f",
        "no",
        "n",
        "0",
    ):
        return 1
    try:
        n = int(os.environ.get("RAYON_NUM_THREADS", ""))
    except ValueError:
        n = 0
    if n > 0:
        return n
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
