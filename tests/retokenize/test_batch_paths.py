"""The whole-batch fast paths equal the per-text code they replace, on the benchmark corpus and on
texts that exercise their edge cases (shared character spans, whitespace-only and empty texts,
normaliser rewrites, [UNK])."""

from __future__ import annotations

import numpy as np
import pytest

from mutualrl.retokenize.benchmark import load_corpus
from mutualrl.retokenize.encoding import (EncodingCache, encode_from, encode_from_batch,
                                          encode_texts, ends_from_offsets, offset_ends_batch, utf8)

from .helpers import NAMES

EDGE = ["", "   ", "\n\n", "x", "Hello WORLD", "Ünïcödé ÀÉÎ", "한국어 텍스트 입니다", "😀😀 🤖x",
        "日本語のテキスト", "a\u0301b\u0323\u0301", "\x00ctrl\x07", "word " * 40 + "z" * 150,
        "İstanbul ǅ ﬁ", "tab\tsep\r\nline", "ﾊﾝｶｸ ＦＵＬＬ"]


def _texts() -> list[str]:
    return load_corpus() + EDGE


@pytest.mark.parametrize("name", NAMES)
def test_offset_ends_batch_equals_per_text(retokenizers, name):
    prof = retokenizers[name].profile
    texts = _texts()
    datas = [utf8(t) for t in texts]
    encs = prof.continuation.encode_batch(texts, add_special_tokens=False)
    flat, ends, sizes = offset_ends_batch(prof, encs, texts, datas)
    lo = 0
    for enc, text, data, size in zip(encs, texts, datas, sizes.tolist()):
        ids = np.array(enc.ids, dtype=np.int64)
        want = ends_from_offsets(enc.offsets, text, len(data), prof.piece_len[ids])
        assert np.array_equal(flat[lo:lo + size], ids)
        assert np.array_equal(ends[lo:lo + size], want), text
        lo += size
    assert lo == flat.size == ends.size


@pytest.mark.parametrize("name", NAMES)
def test_encode_from_batch_equals_encode_from(retokenizers, name):
    prof = retokenizers[name].profile
    texts = _texts()
    datas = [utf8(t) for t in texts]
    encs = prof.continuation.encode_batch(texts, add_special_tokens=False)
    for got, enc, text, data in zip(encode_from_batch(prof, encs, texts, datas), encs, texts,
                                    datas):
        want = encode_from(prof, enc, text, data)
        assert np.array_equal(got.ids, want.ids) and np.array_equal(got.ends, want.ends)
        assert not got.ids.flags.writeable and not got.ends.flags.writeable
        assert (got.mismatch, got.edit_distance, got.normalizer_changed) == (
            want.mismatch, want.edit_distance, want.normalizer_changed), text


@pytest.mark.parametrize("name", NAMES)
def test_a_batch_encoded_without_offsets_equals_per_text_encodings(retokenizers, name):
    # A lossless side's batch comes from encode_batch_fast (no offsets); a text whose ids do not
    # spell it must still get its byte ends from offsets, as encoded on its own.
    prof = retokenizers[name].profile
    texts = _texts() + ["a\u2581b \u2581\u2581", "\u2581lead"]
    datas = [utf8(t) for t in texts]
    got = encode_texts(prof, texts, datas, EncodingCache(0))
    unspelled = 0
    for item, text, data in zip(got, texts, datas):
        want = encode_from(prof, prof.continuation.encode(text, add_special_tokens=False), text, data)
        assert np.array_equal(item.ids, want.ids) and np.array_equal(item.ends, want.ends), text
        assert (item.mismatch, item.edit_distance, item.normalizer_changed) == (
            want.mismatch, want.edit_distance, want.normalizer_changed), text
        unspelled += prof.lossless and prof.text_bytes(want.ids.tolist()) != data
    if name == "mistral-v1":      # the path is taken: its byte fallback cannot spell every text
        assert unspelled >= 1


def test_normaliser_check_by_character_matches_the_normaliser(retokenizers):
    """Texts decided from the per-character table, and those left to the normaliser, agree with
    ``normalize_str(t) != t`` on the corpus and on random texts mixing cased letters, accents,
    combining marks in and out of canonical order, CJK, controls, astral characters."""
    from mutualrl.retokenize.encoding import _SEP, normalizer_changes

    prof = retokenizers["bert-wordpiece"].profile
    norm = prof.continuation.normalizer
    rng = np.random.default_rng(0)
    pools = [range(0x20, 0x7F), range(0xC0, 0x250), range(0x300, 0x370), range(0x370, 0x500),
             range(0x4E00, 0x4E40), range(0xAC00, 0xAC20), range(0x1F600, 0x1F610),
             range(0x0, 0x20), range(0x2000, 0x2070), range(0x30000, 0x30005), range(0x1D165, 0x1D16A)]
    texts = load_corpus() + EDGE + ["ok", "lower only", "a\u0323\u0301", "a\u0301\u0323", _SEP]
    for _ in range(400):
        chosen = [pools[k] for k in rng.choice(len(pools), size=rng.integers(1, 3), replace=False)]
        texts.append("".join(chr(int(rng.choice(chosen[int(rng.integers(len(chosen)))])))
                             for _ in range(int(rng.integers(0, 12)))))
    texts += ["", ""]                  # empty texts last: no character of theirs to reduce
    assert normalizer_changes(prof, texts) == [norm.normalize_str(t) != t for t in texts]
    assert normalizer_changes(prof, ["", ""]) == [False, False]



def test_batched_steps_beside_the_rust_pool_use_its_thread_count(monkeypatch):
    from mutualrl.retokenize.encoding import rust_threads

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    assert rust_threads() == 3
    monkeypatch.setenv("RAYON_NUM_THREADS", "0")       # rayon's own default: one per core
    assert rust_threads() >= 1
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert rust_threads() == 1
