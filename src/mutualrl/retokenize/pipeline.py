"""The receiver's encodings of a batch in parts, the Rust encode in a helper thread.

Rust's ``encode_batch`` releases the GIL and runs on the tokenizers' thread pool; while it runs the
caller's thread checks the sender's side, and, part by part, builds each finished part's byte ends,
alignment and results while the next part is encoded. Values are those of ``encode_texts`` (the
cache is read for the whole batch first and written as parts finish, as ``encode_texts`` does,
and only by the caller's thread); only the order of work changes.
"""

from __future__ import annotations

import os
import queue
import threading

import numpy as np

from mutualrl.retokenize.encoding import (Encoded, EncodingCache, add_renderings,
                                          finish_encodings, rust_encode)
from mutualrl.retokenize.profile import TokenizerProfile


def tokenizer_threads() -> int:
    """Threads of the Rust tokenizers' pool as the environment sets it (``TOKENIZERS_PARALLELISM``
    off: 1; ``RAYON_NUM_THREADS``; else one per core)."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "true").lower() in ("", "off", "false", "f",
                                                                     "no", "n", "0"):
        return 1
    try:
        n = int(os.environ.get("RAYON_NUM_THREADS", "0"))
    except ValueError:
        n = 0
    return n if n > 0 else (os.cpu_count() or 1)


def split_by_bytes(datas: list[bytes], parts: int) -> list[list[int]]:
    """Consecutive text indices in ``parts`` groups of about equal bytes (none empty)."""
    n = len(datas)
    parts = max(1, min(parts, n))
    if parts == 1:
        return [list(range(n))]
    cum = np.cumsum(np.fromiter(map(len, datas), dtype=np.int64, count=n))
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, parts) / parts, side="left") + 1
    bounds = [0, *sorted(set(np.clip(cuts, 1, n - 1).tolist())), n]
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]


class EncodeStream:
    """Iterate ``(part, encodings of its texts)`` over ``parts`` (lists of text indices, in
    order); with ``background`` a helper thread runs each part's Rust encode in turn from
    construction on. With ``residuals`` each part's renderings are added as it is taken."""

    def __init__(self, profile: TokenizerProfile, texts: list[str], datas: list[bytes],
                 cache: EncodingCache, parts: list[list[int]], *, background: bool,
                 residuals: bool = True) -> None:
        self.profile, self.texts, self.datas, self.cache = profile, texts, datas, cache
        self.parts, self.residuals = parts, residuals
        self.keys = ([cache.key(d, profile.fingerprint) for d in datas] if cache.size
                     else [None] * len(texts))
        self.out: list[Encoded | None] = [cache.get(k) if k else None for k in self.keys]
        self.todo = [[i for i in part if self.out[i] is None] for part in parts]
        self._queue: queue.SimpleQueue | None = None
        if background:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._produce, daemon=True).start()

    def _encode(self, k: int) -> tuple[list, list | None]:
        """A part's Rust encodings and, when its residuals need them (a non-lossless tokenizer),
        their renderings (the helper thread decodes too, beside the caller's work)."""
        encs = rust_encode(self.profile, [self.texts[i] for i in self.todo[k]])
        if self._queue is None or not self.residuals or self.profile.lossless or len(encs) < 2:
            return encs, None
        return encs, self.profile.continuation.decode_batch([e.ids for e in encs],
                                                            skip_special_tokens=False)

    def _produce(self) -> None:
        for k in range(len(self.parts)):
            try:
                self._queue.put((self._encode(k), None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                self._queue.put((None, exc))
                return

    def __iter__(self):
        for k, part in enumerate(self.parts):
            if self._queue is not None:
                got, exc = self._queue.get()
                if exc is not None:
                    raise exc
            else:
                got = self._encode(k)
            (encs, decoded), todo = got, self.todo[k]
            finish_encodings(self.profile, encs, todo, self.texts, self.datas, self.keys,
                             self.cache, self.out)
            items = [self.out[i] for i in part]
            if self.residuals:
                known = {id(self.out[i]): r for i, r in zip(todo, decoded)} if decoded else None
                add_renderings(self.profile, items, known)
            yield part, items
