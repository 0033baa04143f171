"""Move completions from a source tokenizer into a target (receiver) tokenizer.

What "the text" is: the completion string as given (the source's own decode of its sampled ids,
without special tokens), as UTF-8 bytes. Groups tile those bytes exactly once, in order.

How a completion is tokenised for the receiver: on its own, with no special tokens, no
BOS, and *no* dummy prefix space (SentencePiece ``▁`` / ``add_prefix_space``) — i.e. the way the
receiver would have emitted it as the continuation of a prompt, where generation starts at the
prompt/completion boundary. Special-token strings inside the completion are literal text. The
prompt is encoded separately in the receiver's own format (``encode_prompt``); the receiver's
sequence is ``prompt_ids + target_ids``.

Special tokens by role: source specials (BOS, chat markers, ...) are stripped and counted. If
``ends_with_eos`` the target ids end with the receiver's end-of-sequence token (``eos_token``,
else ``sep_token``), and a trailing source EOS id, if present, is paired with it as a 1:1 group
with an empty byte range, so its log-prob mass has a home.

Log-probs: ``group_logprob_sums[g]`` is the sum of the source log-probs of group ``g``'s source
tokens. A group's text is identical on both sides, so its total log-probability is the quantity
that is comparable across the two tokenizations (a receiver-side importance ratio per group is
``exp(target_group_sum - group_logprob_sums)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mutualrl.retokenize.align import AlignmentGroups
from mutualrl.retokenize.assembly import assemble
from mutualrl.retokenize.encoding import EncodingCache, encode_texts, utf8, utf8_all
from mutualrl.retokenize.inputs import check_len
from mutualrl.retokenize.loaders import TokenizerHandle
from mutualrl.retokenize.profile import TokenizerProfile
from mutualrl.retokenize.residuals import AlignmentResiduals
from mutualrl.retokenize.sources import read_sources


@dataclass(frozen=True)
class RetokenizedTrajectory:
    """One completion in the receiver's tokens.

    ``target_ids``          int64 receiver ids of the completion (+ EOS if ``ends_with_eos``),
                            cut on a group boundary to at most ``max_length``.
    ``groups``              ``AlignmentGroups`` (token ranges per side and byte ranges).
    ``group_logprob_sums``  float64 per group, or None when no source log-probs were given.
    ``residuals``           ``AlignmentResiduals``.
    """

    text: str
    target_ids: np.ndarray
    groups: AlignmentGroups
    group_logprob_sums: np.ndarray | None
    residuals: AlignmentResiduals

    def target_group_index(self) -> np.ndarray:
        """Group id of every target token."""
        return self.groups.target_group_index(self.target_ids.shape[0])


class Retokenizer:
    """Retokenize completions into one receiver's tokenizer; holds byte tables and an LRU cache.

    ``max_length`` bounds ``len(target_ids)`` (None: no bound). ``cache_size`` bounds the number of
    cached encodings, keyed by (text hash, tokenizer fingerprint); 0 disables caching. Not
    thread-safe: use one per thread.
    """

    def __init__(
        self,
        target: TokenizerHandle,
        *,
        max_length: int | None = None,
        cache_size: int = 4096,
        profiles: dict[str, TokenizerProfile] | None = None,
    ) -> None:
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length: expected None or an integer >= 1, got {max_length}")
        self.target = target
        self.max_length = max_length
        # Byte tables take seconds to build for a 129k vocabulary; several retokenizers of one
        # run share them by passing the same ``profiles`` dict (keyed by fingerprint).
        self._profiles: dict[str, TokenizerProfile] = profiles if profiles is not None else {}
        self.profile = self.profile_for(target)
        self.cache = EncodingCache(cache_size)

    def __repr__(self) -> str:
        return (
            f"Retokenizer(target={self.target.name!r}, max_length={self.max_length}, "
            f"cache={len(self.cache)}/{self.cache.size})"
        )

    def profile_for(self, handle: TokenizerHandle) -> TokenizerProfile:
        """The (cached) byte tables of a source tokenizer."""
        prof = self._profiles.get(handle.fingerprint)
        if prof is None:
            prof = self._profiles[handle.fingerprint] = TokenizerProfile.build(handle)
        return prof

    def encode_prompt(
        self, prompt: str | list[dict], *, add_generation_prompt: bool = True
    ) -> np.ndarray:
        """Receiver ids of a prompt in its own format: a chat template for a list of messages
        (``{"role", "content"}``), otherwise the text with the receiver's special tokens (BOS)."""
        if isinstance(prompt, str):
            return np.array(
                self.profile.standard.encode(prompt, add_special_tokens=True).ids, dtype=np.int64
            )
        tok = self.target.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(
                f"prompt: tokenizer {self.target.name!r} has no chat template; "
                "expected a str prompt, not a list of messages"
            )
        ids = tok.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def encode_completion(self, text: str) -> np.ndarray:
        """Receiver ids of a completion as a continuation (no specials, no prefix space)."""
        return encode_texts(self.profile, [text], [utf8(text)], self.cache)[0].ids.copy()

    def retokenize(
        self,
        text: str,
        *,
        source: TokenizerHandle | None = None,
        source_ids: Sequence[int] | np.ndarray | None = None,
        source_logprobs: Sequence[float] | np.ndarray | None = None,
        ends_with_eos: bool = False,
    ) -> RetokenizedTrajectory:
        """Retokenize one completion; see the module docstring for the conventions.

        ``source`` is the sender's tokenizer (None: no alignment, only target ids and target-side
        residuals). ``source_ids`` are the sampled ids (None: the text is encoded with ``source``);
        ``source_logprobs`` one per source id.
        """
        return self.retokenize_batch(
            [text],
            source=source,
            source_ids=None if source_ids is None else [source_ids],
            source_logprobs=None if source_logprobs is None else [source_logprobs],
            ends_with_eos=[ends_with_eos],
        )[0]

    def retokenize_batch(
        self,
        texts: Sequence[str],
        *,
        source: TokenizerHandle | None = None,
        source_ids: Sequence | None = None,
        source_logprobs: Sequence | None = None,
        ends_with_eos: bool | Sequence[bool] = False,
    ) -> list[RetokenizedTrajectory]:
        """Retokenize many completions from one sender; encodings are batched in Rust."""
        texts = list(texts)
        n = len(texts)
        flags = (
            [bool(ends_with_eos)] * n if isinstance(ends_with_eos, bool) else list(ends_with_eos)
        )
        check_len("source_ids", source_ids, n)
        check_len("source_logprobs", source_logprobs, n)
        check_len("ends_with_eos", flags, n)
        if source is None and (source_ids is not None or source_logprobs is not None):
            raise ValueError(
                "source: expected the sender's TokenizerHandle when source_ids or "
                "source_logprobs are given"
            )
        datas = utf8_all(texts)
        targets = encode_texts(self.profile, texts, datas, self.cache)
        sources = None
        if source is not None:
            sources = read_sources(
                self.profile_for(source),
                texts,
                datas,
                source_ids,
                source_logprobs,
                flags,
                self.cache,
            )
        out = assemble(
            self.profile, self.max_length, targets, sources, [len(d) for d in datas], flags
        )
        return [
            _trajectory(text, ids, groups, sums, residuals)
            for text, ids, groups, sums, residuals in zip(
                texts, out.target_ids, out.groups, out.sums, out.rows.records()
            )
        ]


def _trajectory(text, target_ids, groups, sums, residuals) -> RetokenizedTrajectory:
    """``RetokenizedTrajectory(...)`` without the frozen dataclass's per-field ``__setattr__``
    (a batch builds one per text)."""
    obj = object.__new__(RetokenizedTrajectory)
    obj.__dict__.update(
        text=text,
        target_ids=target_ids,
        groups=groups,
        group_logprob_sums=sums,
        residuals=residuals,
    )
    return obj
