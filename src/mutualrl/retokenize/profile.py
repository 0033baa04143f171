"""Per-tokenizer tables that turn token ids into UTF-8 byte spans without per-token Python.

A ``TokenizerProfile`` is built once per tokenizer (a per-vocabulary Python loop is fine there)
and holds:

* ``pieces[id]``  the exact bytes a token contributes to the text, and ``piece_len`` as a numpy
  array, so a sequence's byte ends are ``np.cumsum(piece_len[ids])``. Byte-level BPE pieces are
  decoded through the GPT-2 ``bytes_to_unicode`` map; SentencePiece pieces map ``▁`` to a space
  and ``<0xNN>`` to the single byte ``NN``; special tokens contribute no bytes.
* ``lossless``   whether the concatenated pieces of an encoding reproduce the input text
  byte-for-byte (byte-level BPE, or SentencePiece with byte fallback, and no text-changing
  normaliser). WordPiece is never lossless: its normaliser may lower-case, strip accents and drop
  control characters, and whitespace has no token at all. For such tokenizers byte spans come from
  the fast tokenizer's character offsets instead (see ``Retokenizer``).
* two Rust backends: ``standard`` (the tokenizer as shipped, minus padding/truncation; built on
  first use) for prompts,
  and ``continuation`` which also never prepends a prefix space (SentencePiece ``Metaspace``
  ``prepend_scheme``, ``ByteLevel`` ``add_prefix_space``, a ``Prepend`` normaliser). A completion
  continues a prompt, so a receiver generating it would never have emitted that dummy space.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from mutualrl.retokenize.loaders import TokenizerHandle, config_head

SP_SPACE = "\u2581"  # SentencePiece's visible space '▁'


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_DECODER = {ch: b for b, ch in bytes_to_unicode().items()}
_BYTE_ALPHABET = frozenset(_BYTE_DECODER)
# For str.translate: each alphabet character to the character whose code is its byte, so that
# ``token.translate(_BYTE_TRANSLATION).encode("latin-1")`` is the token's bytes (in C, per token).
_BYTE_TRANSLATION = {ord(ch): b for ch, b in _BYTE_DECODER.items()}


def _walk_types(node, kind: str):
    """Yield every dict in a serialized tokenizer component whose ``type`` is ``kind``."""
    if isinstance(node, dict):
        if node.get("type") == kind:
            yield node
        for value in node.values():
            yield from _walk_types(value, kind)
    elif isinstance(node, list):
        for value in node:
            yield from _walk_types(value, kind)


def _drop_prepend(normalizer):
    """Remove ``Prepend`` normalisers (legacy Llama/Mistral dummy prefix) from a normaliser tree."""
    if not isinstance(normalizer, dict):
        return normalizer
    if normalizer.get("type") == "Prepend":
        return None
    if normalizer.get("type") == "Sequence":
        kept = [_drop_prepend(n) for n in normalizer.get("normalizers", [])]
        normalizer["normalizers"] = [n for n in kept if n is not None]
    return normalizer


def build_backends(handle: TokenizerHandle) -> tuple[Tokenizer, dict]:
    """Return the continuation Rust tokenizer and the head of the serialized config it came from
    (``loaders.config_head``: normaliser, pre-tokeniser, the model's kind and flags).

    The vocabulary is parsed by Rust from the shipped JSON once; only the small
    normaliser/pre-tokeniser components are rewritten in Python (through a vocabulary-free
    tokenizer), so a 129k vocabulary is never re-serialised. The standard copy (prompts with
    their special tokens) is built on first use: ``TokenizerProfile.standard``.
    """
    text = handle.backend.to_str()
    config = config_head(text)
    pre = json.loads(json.dumps(config.get("pre_tokenizer")))
    norm = json.loads(json.dumps(config.get("normalizer")))
    changed = False
    for node in _walk_types(pre, "Metaspace"):
        changed |= (
            node.get("prepend_scheme") != "never" or node.get("add_prefix_space") is not False
        )
        node["prepend_scheme"] = "never"
        node["add_prefix_space"] = False
    for node in _walk_types(pre, "ByteLevel"):
        changed |= node.get("add_prefix_space") is not False
        node["add_prefix_space"] = False
    norm_before = json.dumps(norm)
    norm = _drop_prepend(norm)
    changed |= json.dumps(norm) != norm_before
    continuation = _without_padding(Tokenizer.from_str(text))
    if changed:
        parts = Tokenizer.from_str(
            json.dumps(
                {
                    "version": config.get("version", "1.0"),
                    "truncation": None,
                    "padding": None,
                    "added_tokens": [],
                    "normalizer": norm,
                    "pre_tokenizer": pre,
                    "post_processor": None,
                    "decoder": None,
                    "model": {"type": "WordLevel", "vocab": {}, "unk_token": "[UNK]"},
                }
            )
        )
        continuation.normalizer = parts.normalizer
        continuation.pre_tokenizer = parts.pre_tokenizer
    # Completion text is literal: a "</s>" typed by another model is text, not this model's EOS.
    continuation.encode_special_tokens = True
    return continuation, config


def standard_backend(handle: TokenizerHandle) -> Tokenizer:
    """A private copy of the tokenizer as shipped (specials, prefix space), never padding."""
    return _without_padding(Tokenizer.from_str(handle.backend.to_str()))


def _without_padding(tok: Tokenizer) -> Tokenizer:
    # A shared tokenizer may carry padding/truncation settings (the packaged BERT pads to 128);
    # either would corrupt byte spans, so our private copies never pad or truncate.
    if tok.padding is not None:
        tok.no_padding()
    if tok.truncation is not None:
        tok.no_truncation()
    return tok


def _normalizer_types(normalizer) -> frozenset:
    """Every component ``type`` of a serialized normaliser (``Sequence`` itself excluded)."""
    if not isinstance(normalizer, dict):
        return frozenset()
    if normalizer.get("type") == "Sequence":
        return frozenset().union(*(_normalizer_types(n) for n in normalizer.get("normalizers", [])))
    return frozenset({normalizer.get("type")})


def _is_byte_level(config: dict) -> bool:
    return any(True for _ in _walk_types(config.get("pre_tokenizer"), "ByteLevel"))


def _normalizer_changes_text(config: dict) -> bool:
    """True unless the normaliser is absent, an empty sequence, or only a Prepend/Replace('▁')."""
    norm = config.get("normalizer")
    if norm is None:
        return False
    parts = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
    for part in parts:
        if part.get("type") == "Prepend":
            continue
        if part.get("type") == "Replace" and part.get("content") == SP_SPACE:
            continue  # legacy SentencePiece: ' ' -> '▁', undone by our piece map
        if part.get("type") == "NFC":
            # Qwen: identity on NFC text, which nearly all text is. Every use of ``lossless``
            # compares the rendered pieces with the input bytes first, so a text that NFC does
            # change still takes the offsets path.
            continue
        return True
    return False


def _piece_bytes(token: str, byte_level: bool, byte_fallback: bool, wordpiece_prefix: str | None):
    """The bytes one vocabulary entry contributes to the text (None: not representable)."""
    if byte_level:
        if _BYTE_ALPHABET.issuperset(token):
            return token.translate(_BYTE_TRANSLATION).encode("latin-1")
        return None
    if byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    if wordpiece_prefix and token.startswith(wordpiece_prefix):
        token = token[len(wordpiece_prefix) :]
    return token.replace(SP_SPACE, " ").encode("utf-8")


@dataclass
class TokenizerProfile:
    """Byte tables and private backends for one tokenizer; build with ``TokenizerProfile.build``."""

    handle: TokenizerHandle
    continuation: Tokenizer
    pieces: list[bytes]
    piece_len: np.ndarray  # int64 [vocab]: bytes each id contributes (0 for specials)
    special: np.ndarray  # bool [vocab]: added tokens flagged special (BOS/EOS/PAD/...)
    byte_fallback: np.ndarray  # bool [vocab]: SentencePiece <0xNN> tokens
    unk_id: int | None
    eos_id: int | None  # end-of-sequence by role: eos_token, else sep_token (BERT)
    lossless: bool
    family: str = field(default="unknown")
    normalizer_types: frozenset = field(default=frozenset())  # ``type``s in the normaliser tree
    continuing: np.ndarray | None = None  # bool [vocab]: WordPiece '##' pieces (else None)

    @property
    def fingerprint(self) -> str:
        return self.handle.fingerprint

    @functools.cached_property
    def standard(self) -> Tokenizer:
        """The tokenizer as shipped, for prompts with their special tokens: built on first use (a
        run's policies encode their prompts with their own tokenizers, so most profiles never
        need it; a 150k vocabulary takes about 0.6 s to parse)."""
        return standard_backend(self.handle)

    @classmethod
    def build(cls, handle: TokenizerHandle) -> TokenizerProfile:
        cont, config = build_backends(handle)
        cont_norm = _drop_prepend(json.loads(json.dumps(config.get("normalizer"))))
        model = config.get("model", {})
        byte_level = _is_byte_level(config)
        byte_fallback = bool(model.get("byte_fallback"))
        wp_prefix = (
            model.get("continuing_subword_prefix") if model.get("type") == "WordPiece" else None
        )
        vocab = cont.get_vocab(with_added_tokens=True)  # the same vocabulary and added tokens
        size = max(vocab.values()) + 1
        pieces: list[bytes] = [b""] * size
        special = np.zeros(size, dtype=bool)
        fallback = np.zeros(size, dtype=bool)
        continuing = np.zeros(size, dtype=bool) if wp_prefix else None
        representable = True
        added = cont.get_added_tokens_decoder()
        for token, idx in vocab.items():
            if idx in added:
                # Added tokens are matched before the model runs: literal text unless special.
                special[idx] = added[idx].special
                pieces[idx] = b"" if added[idx].special else token.encode("utf-8")
                continue
            piece = _piece_bytes(token, byte_level, byte_fallback, wp_prefix)
            if continuing is not None and wp_prefix:  # continuing is made iff wp_prefix
                continuing[idx] = token.startswith(wp_prefix)
            if piece is None:
                representable, piece = False, token.encode("utf-8")
            pieces[idx] = piece
            fallback[idx] = byte_fallback and len(piece) == 1 and token.startswith("<0x")
        unk = model.get("unk_token")
        unk_id = vocab.get(unk) if unk else None
        if unk_id is not None:
            special[unk_id] = False  # [UNK] stands for content: it is aligned, never stripped
        piece_len = np.fromiter(map(len, pieces), dtype=np.int64, count=size)
        lossless = (
            representable
            and model.get("type") != "WordPiece"
            and (byte_level or byte_fallback)
            and not _normalizer_changes_text(config)
        )
        tok = handle.tokenizer
        eos = (
            tok.eos_token_id if tok.eos_token_id is not None else getattr(tok, "sep_token_id", None)
        )
        return cls(
            handle=handle,
            continuation=cont,
            pieces=pieces,
            piece_len=piece_len,
            special=special,
            byte_fallback=fallback,
            unk_id=unk_id,
            eos_id=eos,
            lossless=lossless,
            family=handle.family,
            normalizer_types=_normalizer_types(cont_norm),
            continuing=continuing,
        )

    def text_bytes(self, ids) -> bytes:
        """The bytes a sequence of ids spells (specials contribute nothing)."""
        return b"".join(map(self.pieces.__getitem__, ids))

    def piece_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Every id's piece end to end as one uint8 array, and where each id's piece starts in it;
        built on first use (``text_bytes`` for whole batches in numpy, see ``encoding``)."""
        table = self.__dict__.get("_piece_table")
        if table is None:
            table = (
                np.frombuffer(b"".join(self.pieces), dtype=np.uint8),
                np.cumsum(self.piece_len) - self.piece_len,
            )
            self.__dict__["_piece_table"] = table
        return table
