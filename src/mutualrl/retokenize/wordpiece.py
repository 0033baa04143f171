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
walk gives the ends its offsets give (``encoded.ends_from_offsets``, tokens inside one
character sharing out its bytes as there); the tests compare the two over the benchmark corpus
and random texts of tricky characters. Ids that are not its own encoding but walk (another split
of a word into pieces) get exact ends too, where the encoding path could only borrow the
encoding's ends and report a source mismatch.

The fold and the walk are each one loop over the batch, compiled by numba (``wordpiece_loops``,
imported on the first WordPiece batch of a process: about 0.8 s, once). Measured against the
whole-batch numpy passes they replaced, they are 6 to 10 times faster at every batch size, from
an exchange step's 32 short completions to the benchmark corpus
(``benchmarks/results/kernels.json``), so they are the one implementation.
"""

from __future__ import annotations

import threading
import unicodedata
from typing import NamedTuple

import numpy as np

from mutualrl.retokenize.normalize import TABLE_SIZE
from mutualrl.retokenize.profile import TokenizerProfile

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
        """The current arrays as ``wordpiece_loops.fold_texts`` takes them, with the class codes."""
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
    if flat.size and (flat.min() < 0 or flat.max() >= profile.piece_len.size):
        raise IndexError(
            f"ids: expected ids in [0, {profile.piece_len.size}) for tokenizer "
            f"{profile.handle.name!r}, got {int(flat.min())}..{int(flat.max())}"
        )
    from mutualrl.retokenize import wordpiece_loops as loops  # numba: on first use

    n = len(texts)
    cps = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    n_chars = np.fromiter(map(len, texts), dtype=np.int64, count=n)
    n_bytes = np.fromiter(map(len, datas), dtype=np.int64, count=n)
    folded, f_off, word_start, byte_start, byte_end, complex_ = _fold(loops, table, cps, n_chars)
    buf, piece_start = profile.piece_table()
    spells, ends = loops.folded_walk(
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
    ends.flags.writeable = False
    return spells, ends


def _fold(loops, table: FoldTable, cps: np.ndarray, n_chars: np.ndarray):
    """The texts folded (``wordpiece_loops.fold_texts``'s arrays after its status), the table
    first taught the characters met for the first time, the arrays made large enough."""
    cap = 4 * cps.size  # enough unless many characters fold to several (Hangul: 9 bytes)
    while True:
        arrays = table.arrays()
        status, *done = loops.fold_texts(cps, n_chars, cap, *arrays)
        if status == 0:
            return done
        if status == 1:
            table.learn(cps)
        else:
            n_folded = arrays[4]
            cap = int(n_folded[np.minimum(cps, n_folded.size - 1)].sum())
