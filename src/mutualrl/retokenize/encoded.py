"""What one side's encoding of a text is: ``Encoded``, its ids and the byte end of every token
with its round-trip residuals (computed on first use where the ids did not spell the text), and
``EncodedList``, a batch's encodings with the batch's arrays laid end to end. ``encoding`` makes
them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mutualrl.retokenize.residuals import byte_edit_distance


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
