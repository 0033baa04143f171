"""Peer aligners the benchmark runs side by side with ours. BASELINES — not used in training.

* ``naive_decode_prefix_align``: the textbook approach — decode every prefix of each side's ids to
  learn where each token ends (quadratic), then walk both end lists with two pointers.
* ``trl_align``: TRL's ``ULDLoss._align_by_byte_offsets`` (``trl.experimental.gold``), a pure
  Python two-pointer walk over ``(start, end)`` byte offsets. TRL's offset extraction
  (``trl.experimental.utils.encode_with_byte_offsets``) only supports ByteLevel tokenizers, so
  ``trl_encode_with_offsets`` is available for byte-level receivers only.
* ``spacy_align``: ``spacy_alignments.get_alignments`` (Rust), which aligns two lists of token
  *strings* by normalised characters.

Each import is guarded: a missing package makes ``available()`` report it instead of failing.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable


def naive_decode_prefix_ends(decode: Callable[[list[int]], str], ids: list[int]) -> list[int]:
    """Byte end of every token, from the UTF-8 length of each decoded prefix (O(n²) decoding)."""
    return [len(decode(ids[: i + 1]).encode("utf-8")) for i in range(len(ids))]


def two_pointer_walk(src_ends: list[int], tgt_ends: list[int]) -> list[tuple[int, int, int, int]]:
    """Groups as (src_start, src_end, tgt_start, tgt_end), closing where both ends agree."""
    groups = []
    s = t = s0 = t0 = 0
    while s < len(src_ends) and t < len(tgt_ends):
        if src_ends[s] < tgt_ends[t]:
            s += 1
        elif src_ends[s] > tgt_ends[t]:
            t += 1
        else:
            s += 1
            t += 1
            groups.append((s0, s, t0, t))
            s0, t0 = s, t
    if s0 < len(src_ends) or t0 < len(tgt_ends):
        groups.append((s0, len(src_ends), t0, len(tgt_ends)))
    return groups


def naive_decode_prefix_align(src_decode, src_ids, tgt_decode, tgt_ids):
    """The textbook baseline: prefix-decode both sides, then a Python two-pointer walk."""
    return two_pointer_walk(
        naive_decode_prefix_ends(src_decode, src_ids), naive_decode_prefix_ends(tgt_decode, tgt_ids)
    )


def _trl_module():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gold import gold_trainer
    return gold_trainer


def trl_align_fn():
    """TRL's walk: ``f(src_offsets, tgt_offsets) -> (src_groups, tgt_groups)`` or None."""
    try:
        return _trl_module().ULDLoss._align_by_byte_offsets
    except Exception:  # noqa: BLE001 - any import failure means "peer not available"
        return None


def spacy_align_fn():
    """``spacy_alignments.get_alignments(a_tokens, b_tokens)`` or None."""
    try:
        import spacy_alignments
    except ImportError:
        return None
    return spacy_alignments.get_alignments


def available() -> dict[str, bool]:
    return {"trl": trl_align_fn() is not None, "spacy-alignments": spacy_align_fn() is not None}
