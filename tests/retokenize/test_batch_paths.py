"""The whole-batch fast paths equal the per-text code they replace, on the benchmark corpus and on
texts that exercise their edge cases (shared character spans, whitespace-only and empty texts,
normaliser rewrites, [UNK])."""

from __future__ import annotations

import numpy as np
import pytest

from mutualrl.bench.retokenize import load_corpus
from mutualrl.retokenize import align, assembly
from mutualrl.retokenize.encoded import (
    EncodedList,
    encode_from,
    encode_from_batch,
    ends_from_offsets,
    offset_ends_batch,
)
from mutualrl.retokenize.encoding import EncodingCache, encode_texts, utf8
from mutualrl.retokenize.sources import SourceList, read_sources

from .helpers import NAMES

EDGE = [
    "",
    "   ",
    "\n\n",
    "x",
    "Hello WORLD",
    "Ünïcödé ÀÉÎ",
    "한국어 텍스트 입니다",
    "😀😀 🤖x",
    "日本語のテキスト",
    "a\u0301b\u0323\u0301",
    "\x00ctrl\x07",
    "word " * 40 + "z" * 150,
    "İstanbul ǅ ﬁ",
    "tab\tsep\r\nline",
    "ﾊﾝｶｸ ＦＵＬＬ",
]


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
        assert np.array_equal(flat[lo : lo + size], ids)
        assert np.array_equal(ends[lo : lo + size], want), text
        lo += size
    assert lo == flat.size == ends.size


@pytest.mark.parametrize("name", NAMES)
def test_encode_from_batch_equals_encode_from(retokenizers, name):
    prof = retokenizers[name].profile
    texts = _texts()
    datas = [utf8(t) for t in texts]
    encs = prof.continuation.encode_batch(texts, add_special_tokens=False)
    for got, enc, text, data in zip(
        encode_from_batch(prof, encs, texts, datas), encs, texts, datas
    ):
        want = encode_from(prof, enc, text, data)
        assert np.array_equal(got.ids, want.ids) and np.array_equal(got.ends, want.ends)
        assert not got.ids.flags.writeable and not got.ends.flags.writeable
        assert (got.mismatch, got.edit_distance, got.normalizer_changed) == (
            want.mismatch,
            want.edit_distance,
            want.normalizer_changed,
        ), text


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
        want = encode_from(
            prof, prof.continuation.encode(text, add_special_tokens=False), text, data
        )
        assert np.array_equal(item.ids, want.ids) and np.array_equal(item.ends, want.ends), text
        assert (item.mismatch, item.edit_distance, item.normalizer_changed) == (
            want.mismatch,
            want.edit_distance,
            want.normalizer_changed,
        ), text
        unspelled += prof.lossless and prof.text_bytes(want.ids.tolist()) != data
    if name == "mistral-v1":  # the path is taken: its byte fallback cannot spell every text
        assert unspelled >= 1


def test_normaliser_check_by_character_matches_the_normaliser(retokenizers):
    """Texts decided from the per-character table, and those left to the normaliser, agree with
    ``normalize_str(t) != t`` on the corpus and on random texts mixing cased letters, accents,
    combining marks in and out of canonical order, CJK, controls, astral characters."""
    from mutualrl.retokenize.normalize import _SEP, normalizer_changes

    prof = retokenizers["bert-wordpiece"].profile
    norm = prof.continuation.normalizer
    rng = np.random.default_rng(0)
    pools = [
        range(0x20, 0x7F),
        range(0xC0, 0x250),
        range(0x300, 0x370),
        range(0x370, 0x500),
        range(0x4E00, 0x4E40),
        range(0xAC00, 0xAC20),
        range(0x1F600, 0x1F610),
        range(0x0, 0x20),
        range(0x2000, 0x2070),
        range(0x30000, 0x30005),
        range(0x1D165, 0x1D16A),
    ]
    texts = load_corpus() + EDGE + ["ok", "lower only", "a\u0323\u0301", "a\u0301\u0323", _SEP]
    for _ in range(400):
        chosen = [pools[k] for k in rng.choice(len(pools), size=rng.integers(1, 3), replace=False)]
        texts.append(
            "".join(
                chr(int(rng.choice(chosen[int(rng.integers(len(chosen)))])))
                for _ in range(int(rng.integers(0, 12)))
            )
        )
    texts += ["", ""]  # empty texts last: no character of theirs to reduce
    assert normalizer_changes(prof, texts) == [norm.normalize_str(t) != t for t in texts]
    assert normalizer_changes(prof, ["", ""]) == [False, False]


def test_batched_steps_beside_the_rust_pool_use_its_thread_count(monkeypatch):
    from mutualrl.retokenize.encoding import rust_threads

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    assert rust_threads() == 3
    monkeypatch.setenv("RAYON_NUM_THREADS", "0")  # rayon's own default: one per core
    assert rust_threads() >= 1
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert rust_threads() == 1


@pytest.mark.parametrize("name", NAMES)
def test_a_batch_keeps_its_arrays_laid_end_to_end_equal_to_its_texts(retokenizers, name):
    """``EncodedList`` / ``SourceList``: the whole-batch arrays are every text's, those of the
    texts encoded again with offsets (a literal '▁' for Mistral) included; a batch with a cache
    hit, or a sender's batch with a special, keeps none."""
    prof = retokenizers[name].profile
    texts = _texts() + ["a\u2581b \u2581\u2581"]
    datas = [utf8(t) for t in texts]
    got = encode_texts(prof, texts, datas, EncodingCache(0))
    assert isinstance(got, EncodedList) and got.ids is not None
    assert np.array_equal(got.sizes, [e.ids.size for e in got])
    assert np.array_equal(got.ids, np.concatenate([e.ids for e in got]))
    assert np.array_equal(got.ends, np.concatenate([e.ends for e in got]))
    assert not got.ids.flags.writeable and not got.ends.flags.writeable
    cache = EncodingCache(8)
    encode_texts(prof, texts[:1], datas[:1], cache)
    assert getattr(encode_texts(prof, texts[:3], datas[:3], cache), "ids", None) is None
    ids = [e.ids for e in got if e.ids.size]
    kept = [t for t, e in zip(texts, got) if e.ids.size]
    if prof.lossless:  # ids that spell their text: the sender's usual batch
        keep = [
            i for i, (t, d) in enumerate(zip(kept, ids)) if prof.text_bytes(d.tolist()) == utf8(t)
        ]
        kept, ids = [kept[i] for i in keep], [ids[i] for i in keep]
    lps = [-np.linspace(0.1, 1.0, i.size) for i in ids]
    srcs = read_sources(
        prof, kept, [utf8(t) for t in kept], ids, lps, [False] * len(ids), EncodingCache(0)
    )
    assert isinstance(srcs, SourceList) and srcs.ends is not None
    assert (
        np.array_equal(srcs[-1].ends, srcs[len(srcs) - 1].ends) and srcs[-1] is srcs[len(srcs) - 1]
    )
    assert [s.ids.size for s in srcs[1:3]] == [ids[1].size, ids[2].size]
    assert np.array_equal(srcs.ends, np.concatenate([s.ends for s in srcs]))
    assert np.array_equal(srcs.sizes, [s.ends.size for s in srcs])
    assert np.array_equal(srcs.logprobs, np.concatenate(lps))
    if prof.eos_id is not None:
        ids[0] = np.append(ids[0], prof.eos_id)
        lps[0] = np.append(lps[0], -1.0)
        srcs = read_sources(
            prof,
            kept,
            [utf8(t) for t in kept],
            ids,
            lps,
            [True] + [False] * (len(ids) - 1),
            EncodingCache(0),
        )
        assert getattr(srcs, "ends", None) is None


@pytest.mark.parametrize(
    "pair",
    [
        ("deepseek-v3", "mistral-v1"),
        ("bert-wordpiece", "deepseek-v3"),
        ("mistral-v1", "bert-wordpiece"),
    ],
)
def test_a_plain_batch_is_assembled_whole_from_its_laid_arrays(monkeypatch, handles, pair):
    """Without specials, EOS or truncation every text of the corpus is assembled by the batch's
    segment reductions over the arrays both sides laid end to end (``align_flat``): none takes
    the per-text ``_edit_text``, and the results are the per-text calls'."""
    from mutualrl.retokenize import Retokenizer

    texts = load_corpus()[::2]
    rt = Retokenizer(handles[pair[1]], cache_size=0)
    sprof = rt.profile_for(handles[pair[0]])
    ids = [np.array(sprof.continuation.encode(t, add_special_tokens=False).ids) for t in texts]
    lps = [-np.linspace(0.1, 2.0, i.size) for i in ids]
    seen = {"flat": 0, "one": 0}
    flat, one = align.align_flat, assembly._edit_text
    monkeypatch.setattr(
        align,
        "align_flat",
        lambda *a: seen.__setitem__("flat", seen["flat"] + 1) or flat(*a),
    )
    monkeypatch.setattr(
        assembly,
        "_edit_text",
        lambda *a: seen.__setitem__("one", seen["one"] + 1) or one(*a),
    )
    batch = rt.retokenize_batch(texts, source=handles[pair[0]], source_ids=ids, source_logprobs=lps)
    assert seen == {"flat": 1, "one": 0}
    for k in (0, len(texts) // 2, len(texts) - 1):
        single = rt.retokenize(
            texts[k], source=handles[pair[0]], source_ids=ids[k], source_logprobs=lps[k]
        )
        assert np.array_equal(single.target_ids, batch[k].target_ids)
        assert single.group_logprob_sums.tobytes() == batch[k].group_logprob_sums.tobytes()
        assert single.residuals == batch[k].residuals
