"""Invariant checks shared by the property and hand-written tests."""

from __future__ import annotations

import unicodedata

import numpy as np

from mutualrl.retokenize import RetokenizedTrajectory, Retokenizer

NAMES = ("deepseek-v3", "mistral-v1", "bert-wordpiece")
PAIRS = [(s, t) for s in NAMES for t in NAMES]


def source_ids(retokenizers, name: str, text: str) -> np.ndarray:
    """The ids the sender would have sampled for ``text`` (its own continuation encoding)."""
    return retokenizers[name].encode_completion(text)


def check_tiling(out: RetokenizedTrajectory, n_src: int, n_bytes: int, eos_group: bool) -> None:
    """Groups cover every byte and every token of both sides exactly once, in order."""
    g = out.groups
    body = len(g) - int(eos_group)
    if n_bytes == 0 and body == 0:
        return
    for start, end, total in (
        (g.byte_start, g.byte_end, n_bytes),
        (g.src_start, g.src_end, n_src),
        (g.tgt_start, g.tgt_end, out.target_ids.size - int(eos_group)),
    ):
        assert start[0] == 0
        assert np.array_equal(start[1:body], end[: body - 1])
        assert end[body - 1] == total
        assert np.all(end[:body] >= start[:body])
    assert np.all(g.byte_end[:body] > g.byte_start[:body]) or n_bytes == 0


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def wordpiece_surface(rt: Retokenizer, ids) -> str | None:
    """What WordPiece tokens spell (``##`` stripped); None if an [UNK] hides the text."""
    prof = rt.profile
    if prof.unk_id is not None and any(int(i) == prof.unk_id for i in ids):
        return None
    tokens = [prof.standard.id_to_token(int(i)) for i in ids]
    return "".join(t[2:] if t.startswith("##") else t for t in tokens)


def group_text_equal(
    rt_src: Retokenizer,
    rt_tgt: Retokenizer,
    out: RetokenizedTrajectory,
    src: np.ndarray,
    data: bytes,
) -> None:
    """Each group's source and target tokens spell the group's bytes of the text.

    Lossless sides spell them byte for byte; a WordPiece side spells the group text after its own
    normaliser, whitespace removed (the documented normaliser residual), unless an [UNK] hides it.
    """
    g = out.groups
    # A SentencePiece side cannot tell a literal '▁' from a space: that side is then flagged as
    # a mismatch (residual) and its spans come from offsets, so only tiling is checked for it.
    sides = [
        (rt, ids)
        for rt, ids, bad in (
            (rt_src, src, out.residuals.source_mismatch),
            (rt_tgt, out.target_ids, out.residuals.roundtrip_mismatch),
        )
        if not (bad and rt.profile.lossless)
    ]
    for k in range(len(g)):
        chunk = data[g.byte_start[k] : g.byte_end[k]]
        for rt, ids in sides:
            ids = ids[
                (g.src_start if ids is src else g.tgt_start)[k] : (
                    g.src_end if ids is src else g.tgt_end
                )[k]
            ]
            if rt.profile.lossless:
                assert rt.profile.text_bytes(ids.tolist()) == chunk, (k, chunk)
                continue
            surface = wordpiece_surface(rt, ids)
            if surface is None:
                continue
            normalised = rt.profile.standard.normalizer.normalize_str(chunk.decode("utf-8"))
            expected = "".join(normalised.split())
            assert nfc(surface) == nfc(expected), (k, chunk, surface)
