"""WordPiece ids walked along their folded text (``wordpiece.folded_ends``) against the sender's
own encoding with offsets, which is what a WordPiece sender's byte ends came from before: the
same ends wherever the walk accepts the tokenizer's own ids, the encoding path wherever it does
not, and exact ends for ids that are not the tokenizer's own but are shaped as WordPiece shapes
them."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mutualrl.bench.retokenize import load_corpus
from mutualrl.retokenize import wordpiece
from mutualrl.retokenize.encoded import offset_ends_batch
from mutualrl.retokenize.encoding import rust_encode, utf8

TRICKY = [
    *"aAbZ ,.-'\t\n\x00\x0bé É中国한ΣΑς\u0301\u0308İﬁ½—✓×−\u2028\u3000ا्ाท😀",
    "##",
    "[UNK]",
    "  ",
    "don't",
    "Hello",
    "xylophone",
    "unaffable",
    "a" * 120,
]


@pytest.fixture(scope="module")
def bert(retokenizers):
    return retokenizers["bert-wordpiece"].profile_for(retokenizers["bert-wordpiece"].target)


def _texts() -> list[str]:
    rng = random.Random(0)
    texts = load_corpus()
    texts += ["".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 30))) for _ in range(1500)]
    return texts + ["", " ", "abc ", " abc", "\x00", "中", "a\x00b", "e\u0301x", "✓✓ ✓"]


def _walk(prof, texts):
    datas = [utf8(t) for t in texts]
    encs = prof.continuation.encode_batch(texts, add_special_tokens=False)  # with offsets
    flat, ends, sizes = offset_ends_batch(prof, encs, texts, datas)
    spells, walked = wordpiece.folded_ends(prof, flat, sizes, texts, datas)
    return spells, walked, ends, sizes, flat


def test_the_tokenizers_own_ids_walk_to_its_offsets_ends(bert):
    texts = _texts()
    spells, walked, ends, sizes, _ = _walk(bert, texts)
    rows = np.repeat(spells, sizes)
    assert np.array_equal(walked[rows], ends[rows])
    # Every text walks (Hangul included: a syllable folds to its three jamo) but one holding a
    # character the fold leaves to the encoding.
    assert spells.all()
    past = ["ok \U00030000 ok", "ok"]
    spells, walked, ends, _, _ = _walk(bert, past)
    assert spells.tolist() == [False, True] and np.array_equal(walked[-1:], ends[-1:])


def test_characters_are_classed_by_the_normaliser_and_pre_tokeniser(bert, retokenizers):
    table = wordpiece.fold_table(bert)
    chars = "Aé,中\t\x00\u0301한\U00030000"
    table.learn(np.frombuffer(chars.encode("utf-32-le"), np.uint32))
    idx = np.minimum([ord(c) for c in chars], wordpiece.TABLE_SIZE - 1)
    t = table.tables
    got = {
        c: (int(t.cls[i]), "".join(map(chr, t.chars[t.off[i] : t.off[i] + t.count[i]])))
        for c, i in zip(chars, idx.tolist())
    }
    w = wordpiece
    assert got == {
        "A": (w.KEEP, "a"),
        "é": (w.KEEP, "e"),
        ",": (w.ALONE, ","),
        "中": (w.ALONE, "中"),
        "\t": (w.SPACE, ""),
        "\x00": (w.REMOVED, ""),
        "\u0301": (w.REMOVED, ""),
        "한": (w.KEEP, "\u1112\u1161\u11ab"),
        "\U00030000": (w.COMPLEX, ""),
    }
    lossless = retokenizers["deepseek-v3"].profile
    assert wordpiece.fold_table(lossless) is None  # only WordPiece walks
    assert (
        wordpiece.folded_ends(lossless, np.zeros(0, np.int64), np.zeros(1, np.int64), [""], [b""])
        is None
    )


def _ids(prof, *tokens: str) -> np.ndarray:
    vocab = prof.continuation.get_vocab()
    return np.array([vocab[t] for t in tokens], dtype=np.int64)


def test_other_splits_of_a_word_walk_and_misshapen_ids_do_not(bert):
    cases = [  # (text, tokens, walks, byte ends where it walks)
        ("Playing now", ["play", "##ing", "now"], True, [4, 7, 11]),
        ("Playing now", ["playing", "now"], True, [7, 11]),
        ("✓✓ ok.", ["[UNK]", "ok", "."], True, [6, 9, 10]),  # [UNK]: the whole word
        ("Café au lait", ["cafe", "au", "lai", "##t"], True, [5, 8, 12, 13]),
        ("play ing", ["play", "##ing"], False, None),  # '##' at a word start
        ("playing", ["play", "ing"], False, None),  # a word start inside a word
        ("a b", ["ab"], False, None),  # a token across whitespace
        ("ok ✓✓", ["ok", "[UNK]", "[UNK]"], False, None),  # [UNK] inside a word
        ("playing", ["play", "##in"], False, None),  # the text not spelled
        ("ok", ["ok", "[UNK]"], False, None),  # a token past the text
        ("한국 ok", ["[UNK]", "ok"], True, [6, 9]),  # jamo, in one word
        ("한 ok", ["ᄒ", "##ᅡ", "##ᆫ", "ok"], True, [3, 3, 3, 6]),  # one syllable's bytes
        ("ok \U00030000", ["ok", "[UNK]"], False, None),  # past the fold table
    ]
    texts = [c[0] for c in cases]
    id_rows = [_ids(bert, *c[1]) for c in cases]
    sizes = np.array([r.size for r in id_rows])
    spells, ends = wordpiece.folded_ends(
        bert, np.concatenate(id_rows), sizes, texts, [utf8(t) for t in texts]
    )
    assert spells.tolist() == [c[2] for c in cases]
    stops = np.cumsum(sizes)
    for (_, _, walks, want), lo, hi in zip(cases, stops - sizes, stops):
        assert ends[lo:hi].tolist() == (want if walks else [0] * (hi - lo))


def test_a_wordpiece_sender_gets_exact_ends_for_another_split(retokenizers):
    """Through the retokenizer: ids split otherwise than the sender's own encoding are moved with
    their own ends and no source mismatch; the encoding path borrowed the encoding's ends."""
    rt = retokenizers["deepseek-v3"]
    source = retokenizers["bert-wordpiece"].target
    prof = rt.profile_for(source)
    out = rt.retokenize(
        "Playing now",
        source=source,
        source_ids=_ids(prof, "play", "##ing", "now"),
        source_logprobs=[-0.5, -0.25, -1.0],
    )
    assert not out.residuals.source_mismatch
    assert out.groups.byte_end.tolist()[-1] == 11
    assert out.group_logprob_sums.sum() == pytest.approx(-1.75)
    # A sender's ids that do not walk still take its encoding, as before.
    odd = rt.retokenize("play ing", source=source, source_ids=_ids(prof, "play", "##ing"))
    assert odd.residuals.source_mismatch
    for text in ("한국어 ok", "ok \U00030000 ok"):  # walked; the encoding path
        ids = prof.continuation.encode(text, add_special_tokens=False).ids
        out = rt.retokenize(text, source=source, source_ids=ids)
        assert not out.residuals.source_mismatch
        assert out.groups.byte_end[-1] == len(text.encode())


def test_ids_out_of_shape_walk_to_ends_that_tile_the_text_or_not_at_all(bert):
    """Seeded perturbations of the tokenizer's own ids (a token dropped, doubled, swapped with its
    neighbour, replaced by [UNK] or by another id): some still walk, some do not; the ends of a
    text that walks tile its bytes (non-decreasing, the last one its length), those of one that
    does not are 0, and ids out of the vocabulary are refused."""
    rng = np.random.default_rng(1)
    texts = _texts()[:600]
    datas = [utf8(t) for t in texts]
    rows = []
    for enc in rust_encode(bert, texts):
        ids = list(enc.ids)
        if ids:
            k = int(rng.integers(len(ids)))
            kind = int(rng.integers(5))
            if kind == 0:
                del ids[k]
            elif kind == 1:
                ids.insert(k, ids[k])
            elif kind == 2 and k + 1 < len(ids):
                ids[k], ids[k + 1] = ids[k + 1], ids[k]
            elif kind == 3:
                ids[k] = bert.unk_id
            else:
                ids[k] = int(rng.integers(bert.piece_len.size))
        rows.append(np.array(ids, dtype=np.int64))
    flat, sizes = np.concatenate(rows), np.array([r.size for r in rows])
    spells, ends = wordpiece.folded_ends(bert, flat, sizes, texts, datas)
    assert 0 < spells.sum() < len(texts)  # some still walk, some do not
    stops = np.cumsum(sizes)
    for ok, lo, hi, data in zip(spells.tolist(), (stops - sizes).tolist(), stops.tolist(), datas):
        row = ends[lo:hi]
        if not ok:
            assert not row.any()
        elif hi > lo:
            assert (np.diff(row) >= 0).all() and row[-1] == len(data)
    for bad in (bert.piece_len.size, -1):
        with pytest.raises(IndexError, match="ids: expected ids in"):
            wordpiece.folded_ends(bert, np.array([5, bad]), np.array([2]), ["ab"], [b"ab"])


def test_a_batch_of_hangul_folds_to_more_bytes_than_it_holds(bert):
    """A Hangul syllable folds to three jamo (9 bytes for 3): the compiled fold's first guess of
    4 bytes per character is too small for such a batch, and it folds again at the right size."""
    texts = ["배추 김치를 만들려면 먼저 배추를 반으로 갈라 소금물에 절입니다" * 3, "한국어"]
    spells, walked, ends, _, _ = _walk(bert, texts)
    assert spells.all() and np.array_equal(walked, ends)


def test_threads_learning_at_once_leave_one_consistent_table(bert):
    """A profile (and its fold table) may be shared across threads: learning swaps in new arrays
    under a lock, so threads learning different characters at once lose none of them."""
    import threading

    texts = _texts()[:400]
    parts = [np.frombuffer("".join(texts[k::4]).encode("utf-32-le"), np.uint32) for k in range(4)]
    alone, shared = wordpiece.FoldTable(bert), wordpiece.FoldTable(bert)
    for cps in parts:
        before = alone.tables
        kept = [a.copy() for a in before]
        alone.learn(cps)
        # copy-on-write: arrays a compiled fold may still be reading are never written into
        assert alone.tables is not before
        assert all(np.array_equal(a, b) for a, b in zip(before, kept))
    threads = [threading.Thread(target=shared.learn, args=(cps,)) for cps in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = alone.tables, shared.tables
    assert np.array_equal(a.cls, b.cls) and np.array_equal(a.n_folded, b.n_folded)
    for cp in np.flatnonzero(a.count).tolist():  # the same folded characters, wherever stored
        assert (
            a.chars[a.off[cp] : a.off[cp] + a.count[cp]].tolist()
            == b.chars[b.off[cp] : b.off[cp] + b.count[cp]].tolist()
        )
