"""Whether a per-character normaliser rewrites each text of a batch, mostly without running it.

A normaliser built only of per-character steps (``_PER_CHAR_NORMALIZERS``) maps a text
to the concatenation of what it makes of each character, up to NFD's canonical reordering of
combining marks. So, from what it makes of every character once (a table over all of Unicode,
built on first use and kept on the profile; ``TABLE_SIZE``):

* a text holding a character that the normaliser changes and that appears in *no* character's
  output is changed: the output is made only of characters' outputs, reordered at most;
* a text whose characters all map to themselves, none of them decomposing into a combining
  mark that NFD could reorder (or unassigned in Python's Unicode tables), is unchanged;
* any other text (say, CJK padded with spaces) is left to the normaliser itself (``None``).
"""

from __future__ import annotations

import unicodedata
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mutualrl.retokenize.profile import TokenizerProfile

_SURROGATES = range(0xD800, 0xE000)  # not text: never in a valid str we are given
# The table covers the BMP and the next two planes (CJK extensions included); a character past
# it leaves its text to the normaliser. Its last entry stands for every such character.
TABLE_SIZE = 0x30000
WITNESS, FIXED, UNKNOWN = 1, 2, 4  # a code point's flags in the table (``char_table``)


def char_table(normalizer, sep: str) -> np.ndarray:
    """One uint8 per code point: ``WITNESS`` (changed, and in no character's output), ``FIXED``
    (maps to itself and cannot be reordered), ``UNKNOWN`` (``sep``, and the last entry, which
    stands for every character past the table); see the module docstring."""
    cps = [c for c in range(TABLE_SIZE - 1) if c not in _SURROGATES and chr(c) != sep]
    chars = list(map(chr, cps))
    outs = normalizer.normalize_str(sep.join(chars)).split(sep)
    witness = np.zeros(TABLE_SIZE, dtype=bool)
    fixed = np.zeros(TABLE_SIZE, dtype=bool)
    unknown = np.zeros(TABLE_SIZE, dtype=bool)
    unknown[[TABLE_SIZE - 1, min(ord(sep), TABLE_SIZE - 1)]] = True
    if len(outs) == len(chars):  # else the separator did not survive: decide nothing
        seen = set("".join(outs))  # a character past the table maps into the table or past it
        for cp, c, o in zip(cps, chars, outs):
            if o != c:
                witness[cp] = c not in seen
            elif not _may_reorder(c):
                fixed[cp] = True
    return (witness * WITNESS | fixed * FIXED | unknown * UNKNOWN).astype(np.uint8)


def _may_reorder(c: str) -> bool:
    if unicodedata.category(c) == "Cn":
        return True
    return any(unicodedata.combining(x) for x in unicodedata.normalize("NFD", c))


def decided_by_char(table: np.ndarray, sep: str, texts: list[str]) -> list[bool | None]:
    """Per text: True (changed), False (unchanged) or None (ask the normaliser). A text holding a
    character the table does not cover (past it, or ``sep``) is always None: that character's
    output is unknown, so no other character's absence from outputs says anything.

    One lookup of every character's flags, then one OR and one AND over each text's flags
    (``reduceat``): unknown or witness anywhere, fixed everywhere."""
    n = len(texts)
    raw = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    flags = table[np.minimum(raw, TABLE_SIZE - 1)]
    lens = np.fromiter(map(len, texts), dtype=np.int64, count=n)
    any_ = np.zeros(n, dtype=np.uint8)  # an empty text: nothing changed,
    all_ = np.full(n, FIXED, dtype=np.uint8)  # every (no) character fixed: unchanged
    has = lens > 0
    if has.any():
        starts = (np.cumsum(lens) - lens)[has]
        any_[has] = np.bitwise_or.reduceat(flags, starts)
        all_[has] = np.bitwise_and.reduceat(flags, starts)
    unknown = (any_ & UNKNOWN).astype(bool).tolist()
    changed = (any_ & WITNESS).astype(bool).tolist()
    unchanged = (all_ & FIXED).astype(bool).tolist()
    return [
        None if x else (True if c else (False if u else None))
        for x, c, u in zip(unknown, changed, unchanged)
    ]


# Normalisers that act on each character independently (up to canonical reordering, which a
# separator that is a Unicode starter blocks): normalising texts joined by such a separator and
# splitting the result gives each text's own normalisation.
_PER_CHAR_NORMALIZERS = frozenset(
    {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents"}
)
_SEP = "\u2e3b"  # THREE-EM DASH: a starter no per-character normaliser above changes


def normalizer_changes(profile: TokenizerProfile, texts: list[str]) -> list[bool]:
    """Whether the continuation normaliser rewrites each text. For a per-character normaliser
    most texts are decided from a per-character table (``normalize.decided_by_char``) and the
    rest take one Rust call over the texts joined."""
    normalizer = profile.continuation.normalizer
    if normalizer is None:
        return [False] * len(texts)
    if not (profile.normalizer_types and profile.normalizer_types <= _PER_CHAR_NORMALIZERS):
        return [normalizer.normalize_str(t) != t for t in texts]
    table = profile.__dict__.get("_char_table")
    if table is None:
        table = profile.__dict__["_char_table"] = char_table(normalizer, _SEP)
    out = decided_by_char(table, _SEP, texts)
    todo = [i for i, v in enumerate(out) if v is None]
    for i, v in zip(todo, _joined_changes(normalizer, [texts[i] for i in todo])):
        out[i] = v
    return out  # type: ignore[return-value]


def _joined_changes(normalizer, texts: list[str]) -> list[bool]:
    """``normalize_str(t) != t`` per text, in one call over the texts joined when that is safe."""
    if not texts:
        return []
    joined = _SEP.join(texts)
    if joined.count(_SEP) == len(texts) - 1:
        parts = normalizer.normalize_str(joined).split(_SEP)
        if len(parts) == len(texts):
            return [a != b for a, b in zip(parts, texts)]
    return [normalizer.normalize_str(t) != t for t in texts]
