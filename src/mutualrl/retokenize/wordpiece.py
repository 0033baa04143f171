"""Byte ends of WordPiece ids read from the text itself, without encoding the text again.

WordPiece ids do not spell their text: whitespace has no token, the normaliser lower-cases,
strips accents and drops control characters, and ``[UNK]`` stands for a whole word. So their
byte ends came from the tokenizer's own encoding of the text, with offsets: a second Rust encode
of every text and a Python read of every offset, which for a WordPiece *sender* was most of what
moving a batch cost. But BERT's normaliser works character by character and its pre-tokeniser
cuts words at whitespace and punctuation, so the text can be *folded*: each character replaced
by what the normaliser makes of it, whitespace and removed characters left out, and the start of
every word marked. WordPiece ids of the text then spell its folded words one after the other:
a word is one ``[UNK]``, or pieces whose bytes (``##`` dropped) spell it, the first without
``##`` and the others with it. Walking the ids along the folded text checks that, and a token
ends where the character of its last folded byte ends in the text (an ``[UNK]``, where its
word's last character ends).

A character's class comes from the normaliser and the pre-tokeniser themselves, asked once for
each character the first time a batch holds it (``FoldTable``, kept on the profile):

* ``KEEP``     its output joins the word around it: ``A`` -> ``a``, ``é`` -> ``e``, a Hangul
  syllable -> its three jamo;
* ``ALONE``    its output is a word of its own: punctuation, and BERT's CJK characters;
* ``SPACE``    its output is whitespace only: it ends a word;
* ``REMOVED``  its output is empty (control characters; combining accents under accent stripping);
* ``COMPLEX``  anything else: an output holding a combining mark (canonical reordering could
  move it) or a character Python's Unicode tables do not know, a character past the table.

A text holding a ``COMPLEX`` character, or whose ids do not walk, takes the encoding path as
before (``sources.read_sources``). For ids that are the tokenizer's own encoding of the text the
walk gives the ends its offsets give (``encoding.ends_from_offsets``, tokens inside one
character sharing out its bytes as there); the tests compare the two over the benchmark corpus
and random texts of tricky characters. Ids that are not its own encoding but walk (another split
of a word into pieces) get exact ends too, where the encoding path could only borrow the
encoding's ends and report a source mismatch.

The walk is a compiled loop where the kernels run (``kernels``), else the Python loop
``_walk``; both give the same arrays.
"""

from __future__ import annotations

import threading
import unicodedata
from typing import NamedTuple

import numpy as np

from mutualrl.retokenize import kernels
from mutualrl.retokenize.normalize import TABLE_SIZE
from mutualrl.retokenize.profile import TokenizerProfile
from mutualrl.retokenize.spans import settle_batch_ends

UNSEEN, KEEP, ALONE, SPACE, REMOVED, COMPLEX = range(6)
# Normalisers whose output for a text is each character's output in turn, up to the canonical
# reordering of combining marks (which ``KEEP`` excludes); NFC and NFKC compose across characters.
_PER_CHAR = frozenset({"BertNormalizer", "Lowercase", "StripAccents", "NFD", "NFKD"})
# Pre-tokenisers whose words are what ``FoldTable`` learns: cut at whitespace and at each
# character that splits off alone (``Whitespace`` keeps runs of punctuation together: not these).
_PRE_TOKENIZERS = frozenset({"BertPreTokenizer", "WhitespaceSplit"})


class _Tables(NamedTuple):
    cls: np.ndarray  # uint8 per code point: its class
    off: np.ndarray  # where its folded characters start in ``chars``
    count: np.ndarray  # how many folded characters
    n_folded: np.ndarray  # their UTF-8 bytes
    chars: np.ndarray  # uint32: every learnt code point's folded characters, end to end


class FoldTable:
    """Per code point: its class and the characters it folds to, learnt as characters are met
    (``_Tables``). The last entry stands for every code point past the table and is ``COMPLEX``.

    Learning replaces the arrays with new ones under a lock, never writes into them: a profile
    may be shared across threads, and a compiled fold running without the interpreter lock keeps
    reading the arrays it was given, each consistent with the others."""

    def __init__(self, profile: TokenizerProfile) -> None:
        self.normalizer = profile.continuation.normalizer
        self.pre_tokenizer = profile.continuation.pre_tokenizer
        cls = np.zeros(TABLE_SIZE, dtype=np.uint8)
        cls[TABLE_SIZE - 1] = COMPLEX
        cls[0xD800:0xE000] = COMPLEX
        none = np.zeros(TABLE_SIZE, dtype=np.int64)
        self.tables = _Tables(cls, none, none, none, np.zeros(0, dtype=np.uint32))
        self._lock = threading.Lock()

    def arrays(self) -> tuple:
        """The current arrays as ``numba_loops.fold_texts`` takes them, with the class codes."""
        t = self.tables
        return (t.cls, t.off, t.count, t.chars, t.n_folded, KEEP, ALONE, SPACE, COMPLEX)

    def learn(self, cps: np.ndarray) -> _Tables:
        """Learn the classes of the code points in ``cps`` not in the table yet; the arrays that
        hold them all."""
        idx = np.minimum(cps, TABLE_SIZE - 1)
        t = self.tables
        if not (t.cls[idx] == UNSEEN).any():
            return t
        with self._lock:
            t = self.tables
            unseen = t.cls[idx] == UNSEEN
            if not unseen.any():
                return t
            cls, off, count, n_folded = (a.copy() for a in t[:4])
            added: list[int] = []
            start = t.chars.size
            for cp in np.unique(idx[unseen]).tolist():
                kind, folded = self._learn(chr(cp))
                cls[cp], off[cp], count[cp] = kind, start, len(folded)
                n_folded[cp] = len(folded.encode())
                added.extend(map(ord, folded))
                start += len(folded)
            chars = np.concatenate([t.chars, np.array(added, dtype=np.uint32)])
            self.tables = t = _Tables(cls, off, count, n_folded, chars)
        return t

    def _learn(self, char: str) -> tuple[int, str]:
        out = self.normalizer.normalize_str(char) if self.normalizer is not None else char
        if not out:
            return REMOVED, ""
        if not self.pre_tokenizer.pre_tokenize_str(out):
            return SPACE, ""
        # Between two letters: one word with them (KEEP), or a word of its own (ALONE).
        words = [w for w, _ in self.pre_tokenizer.pre_tokenize_str(f"a{out}a")]
        if any(unicodedata.combining(c) or unicodedata.category(c) == "Cn" for c in out):
            return COMPLEX, ""  # canonical reordering could move it (or Python cannot tell)
        if words == [f"a{out}a"]:
            return KEEP, out
        if len(words) == 3 and words[0] == words[2] == "a" and words[1] == out.strip():
            return ALONE, words[1]
        return COMPLEX, ""


def fold_table(profile: TokenizerProfile) -> FoldTable | None:
    """The profile's ``FoldTable`` (made on first use), or None where ``folded_ends`` does not
    apply: not WordPiece, a normaliser not made of per-character steps, another pre-tokeniser."""
    table = profile.__dict__.get("_fold_table", False)
    if table is False:
        pre = profile.continuation.pre_tokenizer
        usable = (
            profile.continuing is not None
            and profile.unk_id is not None
            and type(pre).__name__ in _PRE_TOKENIZERS
            and profile.normalizer_types <= _PER_CHAR
        )
        table = profile.__dict__["_fold_table"] = FoldTable(profile) if usable else None
    return table


def _utf8_len(cps: np.ndarray) -> np.ndarray:
    return 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)


def _segment_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive segments of ``values``, ``counts[i]`` values each (empty ones 0)."""
    cum = np.concatenate(([0], np.cumsum(values)))
    stops = np.cumsum(counts)
    return cum[stops] - cum[stops - counts]


def folded_ends(
    profile: TokenizerProfile,
    flat: np.ndarray,
    sizes: np.ndarray,
    texts: list[str],
    datas: list[bytes],
) -> tuple[np.ndarray, np.ndarray] | None:
    """Id sequences laid end to end (``flat``; ``sizes`` ids per text) walked along their texts
    folded (see the module docstring): (``spells`` (N,) bool, each token's byte end within its own
    text, aligned with ``flat``, read-only and meaningful where ``spells``), or None where the
    profile has no fold table (``fold_table``)."""
    table = fold_table(profile)
    if table is None:
        return None
    n = len(texts)
    cps = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    n_chars = np.fromiter(map(len, texts), dtype=np.int64, count=n)
    n_bytes = np.fromiter(map(len, datas), dtype=np.int64, count=n)
    done = kernels.fold_texts(cps, n_chars, table, flat.size)
    folded, f_off, word_start, byte_start, byte_end, complex_ = (
        done if done is not None else _fold(table, cps, n_chars, n_bytes)
    )
    buf, piece_start = profile.piece_table()
    args = (
        flat,
        sizes,
        folded,
        f_off,
        word_start,
        byte_start,
        byte_end,
        n_bytes,
        complex_,
        profile.piece_len,
        buf,
        piece_start,
        profile.continuing,
        profile.unk_id,
    )
    walked = kernels.folded_walk(*args)
    spells, ends = walked if walked is not None else _walk(*args)
    ends.flags.writeable = False
    return spells, ends


def _fold(table: FoldTable, cps: np.ndarray, n_chars: np.ndarray, n_bytes: np.ndarray):
    """The texts folded, in numpy passes (the reference for ``numba_loops.fold_texts``): (the
    folded bytes, where each text starts in them (N + 1), word starts (one per folded byte and
    a last 1), the start and the end in its own text's bytes of each folded byte's character,
    texts holding a ``COMPLEX`` character)."""
    t = table.learn(cps)
    idx = np.minimum(cps, TABLE_SIZE - 1)
    cls = t.cls[idx]
    keep = (cls == KEEP) | (cls == ALONE)
    kidx = idx[keep]
    count = t.count[kidx]  # folded characters per kept character
    first = np.cumsum(count) - count
    chars = t.chars[np.repeat(t.off[kidx] - first, count) + np.arange(int(count.sum()))]
    folded = np.frombuffer(
        chars.astype("<u4").tobytes().decode("utf-32-le").encode("utf-8"), dtype=np.uint8
    )
    k_bytes = _segment_sums(_utf8_len(chars), count)  # folded bytes per kept character
    kept_per_text = _segment_sums(keep.astype(np.int64), n_chars)
    f_off = np.zeros(n_chars.size + 1, dtype=np.int64)
    np.cumsum(_segment_sums(k_bytes, kept_per_text), out=f_off[1:])
    c_len = _utf8_len(cps)
    c_end = np.cumsum(c_len) - np.repeat(np.cumsum(n_bytes) - n_bytes, n_chars)
    byte_start = np.repeat((c_end - c_len)[keep], k_bytes)
    byte_end = np.repeat(c_end[keep], k_bytes)
    # Word starts, at a kept character's first folded byte: its text's first kept character,
    # one after whitespace, an ALONE character and the one after it.
    spaces = np.cumsum(cls == SPACE)[keep]
    alone = cls[keep] == ALONE
    start = alone.copy()
    start[(np.cumsum(kept_per_text) - kept_per_text)[kept_per_text > 0]] = True
    start[1:] |= (spaces[1:] != spaces[:-1]) | alone[:-1]
    word_start = np.zeros(folded.size + 1, dtype=np.uint8)
    word_start[np.cumsum(k_bytes) - k_bytes] = start
    word_start[-1] = 1
    complex_ = _segment_sums((cls == COMPLEX).astype(np.int64), n_chars) > 0
    return folded, f_off, word_start, byte_start, byte_end, complex_


def _walk(
    flat,
    sizes,
    folded,
    f_off,
    word_start,
    byte_start,
    byte_end,
    n_bytes,
    complex_,
    piece_len,
    buf,
    piece_start,
    continuing,
    unk,
):
    """The walk of ``folded_ends`` in numpy passes (the reference for
    ``numba_loops.folded_walk``). The ids' words (a token without ``##`` starts one) must be the
    text's words in number and in bytes, an ``[UNK]`` a word alone, and every other piece equal
    to the folded bytes under it; then each token's span (the characters its folded bytes came
    from) gives its end (``spans.settle_batch_ends``)."""
    n_tok = flat.size
    ok = ~complex_
    w_pos = np.flatnonzero(word_start[:-1])  # where each of the text's words starts
    if not w_pos.size:  # no text has a word: only texts without ids walk
        return ok & (sizes == 0), np.zeros(n_tok, dtype=np.int64)
    w_len = np.diff(np.append(w_pos, folded.size))
    w_first = np.searchsorted(w_pos, f_off)  # each text's first word
    lens = piece_len[flat]
    unk_tok = flat == unk
    opens = ~continuing[flat] | unk_tok  # a token that starts a word
    has = sizes > 0
    ok[has] &= opens[(np.cumsum(sizes) - sizes)[has]]
    ok &= _segment_sums((lens == 0) & ~unk_tok, sizes) == 0
    per_text = _segment_sums(opens, sizes)
    ok &= np.diff(w_first) == per_text
    # Each token's word, and the first token of its word (garbage in a failed text, unused).
    word = np.repeat(w_first[:-1] - (np.cumsum(per_text) - per_text), sizes) + np.cumsum(opens) - 1
    live = np.repeat(ok, sizes)
    word = np.where(live, word, 0)
    opener = np.maximum.accumulate(np.where(opens, np.arange(n_tok), 0))
    size = np.where(unk_tok, w_len[word], lens)  # an [UNK] takes its whole word
    in_word = np.bincount(word[live], minlength=w_pos.size)
    filled = np.bincount(word[live], weights=size[live], minlength=w_pos.size)
    bad = (filled != w_len)[word] | (unk_tok & (in_word[word] != 1))
    # Where each token starts: its word's start plus the tokens before it in the word.
    before = np.cumsum(size) - size
    pos = w_pos[word] + before - before[opener]
    piece = live & ~unk_tok & ~bad & (pos >= 0) & (pos + lens <= folded.size)
    k_lens = np.where(piece, lens, 0)
    first = np.cumsum(k_lens) - k_lens
    total = int(k_lens.sum())
    got = buf[np.repeat(piece_start[flat] - first, k_lens) + np.arange(total)]
    want = folded[np.repeat(pos - first, k_lens) + np.arange(total)]
    wrong = np.concatenate(([0], np.cumsum(got != want)))
    bad |= (wrong[first + k_lens] - wrong[first]) > 0
    ok &= _segment_sums(bad, sizes) == 0
    top, live = folded.size - 1, np.repeat(ok, sizes)
    # A failed text's spans are 0: its garbage must not carry into the next text's running max.
    span_start = np.where(live, byte_start[np.clip(pos, 0, top)], 0)
    span_end = np.where(live, byte_end[np.clip(pos + size - 1, 0, top)], 0)
    ends = settle_batch_ends(span_start, span_end, lens, sizes, n_bytes)
    ends[~live] = 0
    return ok, ends
