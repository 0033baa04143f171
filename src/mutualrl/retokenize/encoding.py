"""Encoding texts on one side in batches: their bytes, one Rust call for a batch's cache misses
(made ``encoded.Encoded`` by ``encoded.encode_from_batch``), a bounded LRU cache of encodings,
and the renderings the round-trip residuals of a tokenizer that is not lossless need.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict

from mutualrl.retokenize.encoded import (
    Encoded,
    EncodedList,
    encode_from_batch,
    encodes_without_offsets,
)
from mutualrl.retokenize.normalize import normalizer_changes
from mutualrl.retokenize.profile import TokenizerProfile
from mutualrl.retokenize.residuals import byte_edit_distances


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
    keys = [cache.key(d, profile.fingerprint) for d in datas] if cache.size else None
    out: list[Encoded | None] = [cache.get(k) for k in keys] if keys else [None] * len(texts)
    todo = [i for i, item in enumerate(out) if item is None]
    whole = len(todo) == len(texts)  # every text encoded now (no cache, or no hit)
    if not whole:
        texts, datas = [texts[i] for i in todo], [datas[i] for i in todo]
    done = encode_from_batch(profile, rust_encode(profile, texts), texts, datas, residuals)
    for i, item in zip(todo, done):
        out[i] = item
        if keys is not None:
            cache.put(keys[i], item)
    if residuals:
        add_renderings(profile, out)
    # every text encoded now: the batch's list, with its arrays laid end to end
    return done if whole and isinstance(done, EncodedList) else out


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
