"""The whole-batch fast paths equal the per-text code they replace, on the benchmark corpus and on
texts that exercise their edge cases (shared character spans, whitespace-only and empty texts,
normaliser rewrites, [UNK])."""

from __future__ import annotations

import numpy as np
import pytest

from mutualrl.retokenize.benchmark import load_corpus
from mutualrl.retokenize.encoding import (encode_from, encode_from_batch, ends_from_offsets,
                                          offset_ends_batch, utf8)

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
