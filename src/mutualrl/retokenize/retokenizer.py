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

from mutualrl.retokenize.align import (
    AlignmentGroups,
    BatchAlignment,
    align_batch,
    align_ends,
    align_flat,
    byte_iou,
    common_boundaries,
)
from mutualrl.retokenize.encoding import Encoded, EncodingCache, encode_texts, utf8, utf8_all
from mutualrl.retokenize.inputs import check_len
from mutualrl.retokenize.loaders import TokenizerHandle
from mutualrl.retokenize.profile import TokenizerProfile
from mutualrl.retokenize.residuals import AlignmentResiduals
from mutualrl.retokenize.sources import _NO_TOKENS, Source, read_sources


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
        sources: list[Source | None] = [None] * n
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
        totals = [len(d) for d in datas]
        out: list[RetokenizedTrajectory | None] = [None] * n
        groups: list[AlignmentGroups | None] = [AlignmentGroups.empty()] * n
        if source is not None and n == 1:  # one text: skip the batch bookkeeping
            groups = [align_ends(sources[0].ends, targets[0].ends, totals[0])]
        elif source is not None:
            groups = [None] * n
            batch = _align(sources, targets, totals)
            if batch is not None:
                self._assemble_batch(batch, texts, totals, targets, sources, flags, out, groups)
        for i in range(n):
            if out[i] is None:
                g = groups[i]
                if g is None:  # a side with no tokens: not in the batch alignment
                    g = align_ends(sources[i].ends, targets[i].ends, totals[i])
                out[i] = self._assemble(texts[i], totals[i], targets[i], sources[i], g, flags[i])
        return out  # type: ignore[return-value]

    def _assemble_batch(
        self, batch: BatchAlignment, texts, totals, targets, sources, flags, out: list, groups: list
    ) -> None:
        """Results of the batch texts that need no per-text edit of their groups (no source
        specials, no EOS group, no truncation), from segment reductions over the whole batch.

        Fills ``out`` for those texts and ``groups`` (views of the batch alignment) for the
        others, which go through ``_assemble``. Field values equal ``_assemble``'s exactly.
        """
        prof, full, split = self.profile, batch.full, batch.split
        cols, tgt_ids, gsums, mass_errors = self._batch_columns(batch, targets, sources)
        # The caller's target ids: slices of the fresh batch concatenation (writeable, and never
        # the cached arrays), one slice per text instead of one copy per text.
        tgt_stop = (batch.tgt_offset + np.diff(batch.tgt_offset, append=tgt_ids.size)).tolist()
        eos = self.profile.eos_id is not None
        max_len = self.max_length
        has_unk = prof.unk_id is not None
        lo = 0
        for (
            k,
            g,
            hi,
            t0,
            t1,
            mass_error,
            plain,
            n_src,
            s_mismatch,
            s_distance,
            ng,
            c11,
            c1n,
            cn1,
            big_s,
            big_t,
            big_b,
            us,
            ut,
            n_unk,
            n_fb,
        ) in zip(
            full,
            batch.groups(),
            split.tolist(),
            batch.tgt_offset.tolist(),
            tgt_stop,
            mass_errors,
            *_source_columns(sources, full, gsums is not None),
            *cols,
        ):
            tgt = targets[k]
            m = t1 - t0
            if not plain or (flags[k] and eos) or (max_len is not None and m > max_len):
                groups[k] = g
                lo = hi
                continue
            sums = gsums[lo:hi] if gsums is not None else None
            residuals = AlignmentResiduals(
                n_bytes=totals[k],
                n_source_tokens=n_src,
                n_target_tokens=m,
                n_groups=ng,
                roundtrip_mismatch=tgt.mismatch,
                roundtrip_edit_distance=tgt.edit_distance,
                normalizer_changed_text=tgt.normalizer_changed,
                source_mismatch=s_mismatch,
                source_edit_distance=s_distance,
                boundary_iou=ng / (us + ut - ng),  # the groups' ends are the common boundaries
                groups_1_1=c11,
                groups_1_n=c1n,
                groups_n_1=cn1,
                groups_n_m=ng - c11 - c1n - cn1,
                largest_group_source_tokens=big_s,
                largest_group_target_tokens=big_t,
                largest_group_bytes=big_b,
                length_ratio=m / n_src,
                unknown_rate=n_unk / m if has_unk else 0.0,
                byte_fallback_rate=n_fb / m,
                specials_stripped=0,
                specials_added=0,
                eos_paired=False,
                truncated_tokens=0,
                truncated_bytes=0,
                logprob_mass_error=mass_error,
                logprob_mass_unassigned=0.0,
            )
            out[k] = _trajectory(texts[k], tgt_ids[t0:t1], g, sums, residuals)
            lo = hi

    def _batch_columns(self, batch: BatchAlignment, targets, sources):
        """Per-text residual columns of a whole batch by segment reductions: (columns, the batch's
        target ids concatenated, per-group log-prob sums or None, per-text log-prob mass errors).
        Every per-text total is a segment of one ``np.add.reduceat``, which sums a segment exactly
        as ``_total`` sums it alone, so the values equal ``_assemble``'s."""
        prof, full, local = self.profile, batch.full, batch.local
        stats = batch.statistics()
        n_groups = stats[0]
        gstart = batch.split - n_groups  # every batch text has >= 1 group
        laid = len(full) == len(targets) and getattr(targets, "ids", None) is not None
        tgt_ids = targets.ids.copy() if laid else np.concatenate([targets[k].ids for k in full])
        unk = (
            np.add.reduceat((tgt_ids == prof.unk_id).astype(np.int64), batch.tgt_offset)
            if prof.unk_id is not None
            else None
        )
        fallback = np.add.reduceat(prof.byte_fallback[tgt_ids].astype(np.int64), batch.tgt_offset)
        gsums, mass_errors, lp_all = None, [0.0] * len(full), None
        if len(full) == len(sources) and getattr(sources, "logprobs", None) is not None:
            lp_all = sources.logprobs  # the usual batch's, laid end to end (``SourceList``)
        elif all(sources[k].logprobs is not None for k in full):
            # Texts with specials have more log-probs than ends: placeholders keep the layout.
            lp_all = np.concatenate(
                [
                    sources[k].logprobs
                    if not sources[k].n_specials
                    else np.zeros(sources[k].ends.size)
                    for k in full
                ]
            )
        if lp_all is not None:
            gsums = np.add.reduceat(lp_all, local[0] + np.repeat(batch.src_offset, n_groups))
            mass_errors = np.abs(
                np.add.reduceat(lp_all, batch.src_offset) - np.add.reduceat(gsums, gstart)
            ).tolist()
        cols = (
            *stats.tolist(),
            unk.tolist() if unk is not None else [0] * len(full),
            fallback.tolist(),
        )
        return cols, tgt_ids, gsums, mass_errors

    def _assemble(
        self,
        text: str,
        total: int,
        tgt: Encoded,
        src: Source | None,
        groups: AlignmentGroups,
        ends_with_eos: bool,
    ) -> RetokenizedTrajectory:
        src_ends = src.ends if src is not None else _NO_TOKENS
        if src is not None and src.kept_index is not None and src.kept_index.size:
            groups = _remap_source(groups, src.kept_index)
        target_ids = tgt.ids
        eos_id = self.profile.eos_id
        paired = False
        if ends_with_eos and eos_id is not None:
            paired = src is not None and src.eos_index is not None
            start = src.eos_index if paired else (src.ids.size if src is not None else 0)
            groups = _append_group(groups, start, start + int(paired), target_ids.size, total)
            target_ids = np.append(target_ids, np.int64(eos_id))
        sums, lp_total, stripped_mass = _group_sums(src, groups, paired)
        mass_error = abs(lp_total - _total(sums)) if sums is not None else 0.0
        n_all = target_ids.size
        groups, target_ids, truncated_mass = self._truncate(groups, target_ids, sums)
        if sums is not None:
            sums = sums[: len(groups)]
        residuals = _residuals(
            self.profile,
            tgt,
            src,
            src_ends,
            groups,
            total,
            n_all,
            target_ids,
            paired,
            ends_with_eos,
            mass_error,
            stripped_mass + truncated_mass,
        )
        return RetokenizedTrajectory(text, target_ids.copy(), groups, sums, residuals)

    def _truncate(self, groups: AlignmentGroups, target_ids: np.ndarray, sums):
        """Cut at the last group boundary that fits ``max_length``; return the dropped mass."""
        if self.max_length is None or target_ids.size <= self.max_length:
            return groups, target_ids, 0.0
        keep = int(np.searchsorted(groups.tgt_end, self.max_length, side="right"))
        cut = int(groups.tgt_end[keep - 1]) if keep else 0
        lost = 0.0 if sums is None else abs(float(sums[keep:].sum()))
        return groups.slice(keep), target_ids[:cut], lost


def _source_columns(sources, full: list[int], summed: bool) -> tuple[list, ...]:
    """Per text of ``full``, its source side: (plain: no specials, and its log-probs summed with
    the batch's if it has any; tokens; mismatch; edit distance). A ``SourceList`` answers from
    its arrays, without making its texts' ``Source`` objects."""
    n = len(full)
    if getattr(sources, "sizes", None) is not None:  # the usual batch: no specials, all spelled
        sizes = sources.sizes if n == len(sources) else sources.sizes[full]
        return [True] * n, sizes.tolist(), [False] * n, [0] * n
    srcs = [sources[k] for k in full]
    return (
        [not s.n_specials and (summed or s.logprobs is None) for s in srcs],
        [s.ends.size for s in srcs],
        [bool(s.mismatch) for s in srcs],
        [s.edit_distance for s in srcs],
    )


def _align(sources, targets, totals: list[int]) -> BatchAlignment | None:
    """The batch alignment of both sides: from their arrays laid end to end where both sides'
    whole-batch passes kept them (``SourceList``, ``EncodedList``), else from each text's ends."""
    if getattr(sources, "ends", None) is not None and getattr(targets, "ends", None) is not None:
        return align_flat(
            sources.ends,
            sources.sizes,
            targets.ends,
            targets.sizes,
            np.fromiter(totals, dtype=np.int64, count=len(totals)),
        )
    return align_batch([src.ends for src in sources], [t.ends for t in targets], totals)


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


def _remap_source(groups: AlignmentGroups, kept_index: np.ndarray) -> AlignmentGroups:
    """Map source ranges over non-special tokens back to positions in the ids as given."""
    nonempty = groups.src_end > groups.src_start
    start = np.where(nonempty, kept_index[np.minimum(groups.src_start, kept_index.size - 1)], 0)
    end = np.where(nonempty, kept_index[np.maximum(groups.src_end - 1, 0)] + 1, 0)
    return AlignmentGroups(
        start, end, groups.tgt_start, groups.tgt_end, groups.byte_start, groups.byte_end
    )


def _append_group(groups: AlignmentGroups, s0: int, s1: int, t0: int, byte: int):
    add = lambda a, v: np.append(a, np.int64(v))  # noqa: E731 - tiny local helper
    return AlignmentGroups(
        add(groups.src_start, s0),
        add(groups.src_end, s1),
        add(groups.tgt_start, t0),
        add(groups.tgt_end, t0 + 1),
        add(groups.byte_start, byte),
        add(groups.byte_end, byte),
    )


def _group_sums(src: Source | None, groups: AlignmentGroups, paired: bool):
    """(per-group sums, assigned total, |mass of stripped specials|); sums None without lps."""
    if src is None or src.logprobs is None:
        return None, 0.0, 0.0
    lp = src.logprobs
    stripped = 0.0
    if src.n_specials:
        lp = lp.copy()
        mask = np.ones(lp.size, dtype=bool)
        if src.kept_index is not None:
            mask[src.kept_index] = False
        if paired:
            mask[src.eos_index] = False
        stripped = abs(float(lp[mask].sum()))
        lp[mask] = 0.0
    sums = np.zeros(len(groups), dtype=np.float64)
    nonempty = groups.src_end > groups.src_start
    if lp.size and nonempty.any():
        # reduceat sums start[i]..start[i+1]-1; any gap in between holds only zeroed specials.
        sums[nonempty] = np.add.reduceat(lp, groups.src_start[nonempty])
    return sums, _total(lp), stripped


def _total(values: np.ndarray) -> float:
    """The sum of ``values`` as one segment of an ``np.add.reduceat`` (as the batch path sums
    every text's at once; ``ndarray.sum``'s pairwise order would differ in the last bits)."""
    return float(np.add.reduceat(values, [0])[0]) if values.size else 0.0


def _cardinality(groups: AlignmentGroups):
    ns, nt = groups.source_sizes(), groups.target_sizes()
    one_s, one_t = ns == 1, nt == 1
    c11 = int(np.count_nonzero(one_s & one_t))
    c1n = int(np.count_nonzero(one_s & (nt > 1)))
    cn1 = int(np.count_nonzero((ns > 1) & one_t))
    return c11, c1n, cn1, len(groups) - c11 - c1n - cn1, ns, nt


def _residuals(
    prof,
    tgt: Encoded,
    src: Source | None,
    src_ends,
    groups,
    total,
    n_all,
    target_ids,
    paired,
    ends_with_eos,
    mass_error,
    unassigned,
) -> AlignmentResiduals:
    c11, c1n, cn1, cnm, ns, nt = _cardinality(groups)
    m = tgt.ids.size
    n_src = src_ends.size
    n_common = common_boundaries(src_ends, tgt.ends).size if src is not None else 0
    extra_target_special = int(ends_with_eos and prof.eos_id is not None and not paired)
    return AlignmentResiduals(
        n_bytes=total,
        n_source_tokens=n_src,
        n_target_tokens=m,
        n_groups=len(groups),
        roundtrip_mismatch=tgt.mismatch,
        roundtrip_edit_distance=tgt.edit_distance,
        normalizer_changed_text=tgt.normalizer_changed,
        source_mismatch=bool(src is not None and src.mismatch),
        source_edit_distance=src.edit_distance if src is not None else 0,
        boundary_iou=byte_iou(src_ends, tgt.ends, n_common) if src is not None else 0.0,
        groups_1_1=c11,
        groups_1_n=c1n,
        groups_n_1=cn1,
        groups_n_m=cnm,
        largest_group_source_tokens=int(ns.max()) if ns.size else 0,
        largest_group_target_tokens=int(nt.max()) if nt.size else 0,
        largest_group_bytes=int((groups.byte_end - groups.byte_start).max()) if len(groups) else 0,
        length_ratio=m / n_src if n_src else 0.0,
        unknown_rate=(
            float(np.count_nonzero(tgt.ids == prof.unk_id)) / m
            if m and prof.unk_id is not None
            else 0.0
        ),
        byte_fallback_rate=float(np.count_nonzero(prof.byte_fallback[tgt.ids])) / m if m else 0.0,
        specials_stripped=(src.n_specials - int(paired)) if src is not None else 0,
        specials_added=extra_target_special,
        eos_paired=paired,
        truncated_tokens=n_all - target_ids.size,
        truncated_bytes=total - (int(groups.byte_end[-1]) if len(groups) else 0)
        if n_all != target_ids.size
        else 0,
        logprob_mass_error=mass_error,
        logprob_mass_unassigned=unassigned,
    )
