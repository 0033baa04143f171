"""Retokenization benchmark: encode vs alignment vs end to end, ours vs peers, per tokenizer pair.

Used by ``mutualrl bench retokenize`` (``retokenize_cli.py``) and
``benchmarks/bench_retokenize.py``.
Throughput is always *receiver (target) tokens per second* over the whole corpus, so every row of
a pair is directly comparable. Each measurement is a full pass over the corpus, repeated; we report
the median pass time and its spread (min, max, interquartile range), after one warm-up pass.

Measurements per (source -> target) pair:

* ``encode`` / ``encode_batch``  the receiver's Rust encode alone (per text / one batch call).
* ``encode_batch_fast``  a lossless receiver's ``encode_batch_fast``: the same ids without
  offsets, which is what the retokenizer calls for such a receiver (``encoding.rust_encode``).
* ``align`` / ``align_per_text``  our vectorised alignment from byte-end arrays (one call for the
  corpus / one per text); inputs precomputed, as for every aligner below.
* ``align_trl``  TRL's Python walk over the same byte offsets (as ``(start, end)`` lists).
* ``align_spacy``  spacy-alignments over the two token-string lists.
* ``align_naive``  decode-prefix + two-pointer walk, on the first ``naive_texts`` texts only
  (it is quadratic); its inputs are the ids, since finding ends *is* its cost.
* ``end_to_end`` / ``end_to_end_batch``  ``Retokenizer.retokenize`` / ``retokenize_batch`` with
  the cache off: target encode + source spans + alignment + log-prob sums + residuals.
* ``e2e_target``, ``e2e_source``  two stages of ``end_to_end_batch`` timed alone: the target side
  (Rust ``encode_batch`` plus the ids as arrays, byte ends and the byte-exact spelling check per
  text) and the source side (checking the caller's ids and log-probs, byte ends of the ids and
  their spelling check); what ``end_to_end_batch`` adds beyond them is alignment, log-prob sums
  and residual records.

The two goal ratios are also taken *paired*: the contenders alternate call by call (encode_batch,
floor, end_to_end_batch, encode_batch, ...; our align, TRL's, ...) and each round gives one ratio,
whose median and range are reported under ``paired`` — robust to the machine's speed drifting
between the separate passes above. TRL's walk takes about 20 times as long as ours, so call by
call ours always runs right after 10 ms of other work, which on a shared VM slows a short call by
itself (``benchmarks/cold_call.py``); ``align_speedup_vs_trl_turns`` alternates turns of at least
``ALIGN_TURN_S`` each (a few calls of TRL's, a few tens of ours; ``provenance.time_turns``).
``floor`` is the least any byte-offset retokenizer of the batch
does (see ``_floor``): end_to_end_batch over it is what the checks, log-prob sums, residuals and
per-text results cost. For a receiver that is not lossless (WordPiece) a fourth contender,
``floor_rendered``, adds the decode of its ids that the round-trip residuals need, and a fifth,
``floor_residuals``, those residuals from it (edit distances, normaliser check); for a lossless
one, ``encode_batch_fast`` joins the round and end_to_end_batch is also given over it.
``cache_all_miss_over_cache_off`` and ``cache_all_hit_over_cache_off`` (``_bench_cache``) are
end_to_end_batch with the default encoding cache over it with the cache off, every text a miss
and every text a hit.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mutualrl.bench import baselines
from mutualrl.bench.floor import floor, floor_results
from mutualrl.provenance import time_alternating, time_calls, time_turns
from mutualrl.retokenize.align import align_ends, align_many
from mutualrl.retokenize.encoded import encodes_without_offsets
from mutualrl.retokenize.encoding import encode_texts, rust_encode, utf8
from mutualrl.retokenize.loaders import TokenizerHandle, load_tokenizer
from mutualrl.retokenize.residuals import aggregate_residuals
from mutualrl.retokenize.retokenizer import Retokenizer
from mutualrl.retokenize.sources import read_sources

DEFAULT_PAIRS = (
    ("deepseek-v3", "mistral-v1"),
    ("mistral-v1", "deepseek-v3"),
    ("deepseek-v3", "bert-wordpiece"),
    ("bert-wordpiece", "deepseek-v3"),
    ("mistral-v1", "bert-wordpiece"),
    ("bert-wordpiece", "mistral-v1"),
)
ALIGN_TURN_S = 0.02  # each side's turn when the aligners alternate in turns (``time_turns``)
RESIDUAL_KEYS = (
    "frac_groups_1_1",
    "boundary_iou_mean",
    "roundtrip_mismatch_frac",
    "roundtrip_edit_rate",
    "largest_group_bytes_max",
    "length_ratio_pooled",
    "unknown_rate",
    "byte_fallback_rate",
    "logprob_mass_error_max",
)


def default_corpus_dir() -> Path:
    """``benchmarks/corpus`` of the source checkout, else of the current directory."""
    here = Path(__file__).resolve().parents[3] / "benchmarks" / "corpus"
    return here if here.is_dir() else Path.cwd() / "benchmarks" / "corpus"


def load_corpus(path: Path | str | None = None) -> list[str]:
    """The ``completion`` field of every line of every ``*.jsonl`` file in ``path``, in order."""
    folder = Path(path) if path is not None else default_corpus_dir()
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"corpus folder {folder}: expected *.jsonl files with a 'completion' field, found none"
        )
    texts = []
    for file in files:
        for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    texts.append(json.loads(line)["completion"])
                except (json.JSONDecodeError, KeyError) as exc:
                    raise ValueError(
                        f"{file}:{n}: expected a JSON object with a 'completion' string ({exc})"
                    ) from exc
    return texts


@dataclass
class Timing:
    """Pass times (seconds) of one measurement and the receiver tokens one pass processes."""

    name: str
    seconds: list[float]
    tokens: int
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median if self.median > 0 else float("inf")

    def to_dict(self) -> dict:
        q = np.percentile(self.seconds, [25, 75])
        return {
            "median_s": self.median,
            "min_s": min(self.seconds),
            "max_s": max(self.seconds),
            "iqr_s": float(q[1] - q[0]),
            "repeats": len(self.seconds),
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
            "note": self.note,
        }


@dataclass
class PairData:
    """Everything precomputed for one pair, so each timed pass measures one thing only."""

    texts: list[str]
    src: Retokenizer  # profile of the source tokenizer (its own Retokenizer)
    tgt: Retokenizer  # the receiver, cache off
    src_ids: list[np.ndarray]
    src_lps: list[np.ndarray]
    src_ends: list[np.ndarray]
    tgt_ids: list[np.ndarray]
    tgt_ends: list[np.ndarray]
    totals: list[int]
    extra: dict = field(default_factory=dict)

    @classmethod
    def build(cls, src: Retokenizer, tgt: Retokenizer, texts: list[str]) -> PairData:
        datas = [utf8(t) for t in texts]
        s = encode_texts(src.profile, texts, datas, src.cache)
        t = encode_texts(tgt.profile, texts, datas, tgt.cache)
        rng = np.random.default_rng(0)
        return cls(
            texts,
            src,
            tgt,
            [e.ids for e in s],
            [-rng.exponential(size=e.ids.size) for e in s],
            [e.ends for e in s],
            [e.ids for e in t],
            [e.ends for e in t],
            [len(d) for d in datas],
        )

    @property
    def target_tokens(self) -> int:
        return int(sum(ids.size for ids in self.tgt_ids))


def _offsets(ends: np.ndarray) -> list[tuple[int, int]]:
    starts = np.concatenate(([0], ends[:-1]))
    return list(zip(starts.tolist(), ends.tolist()))


def _token_strings(prof, ids: np.ndarray) -> list[str]:
    return [prof.pieces[i].decode("utf-8", errors="replace") for i in ids.tolist()]


def _bench_ours(d: PairData, repeats: int) -> list[Timing]:
    backend, n = d.tgt.profile.continuation, d.target_tokens
    source = d.src.target
    datas = [utf8(t) for t in d.texts]
    src_prof = d.tgt.profile_for(source)
    fast = _fast_encode(d)
    return [
        Timing(
            "encode",
            time_calls(
                lambda: [backend.encode(t, add_special_tokens=False).ids for t in d.texts], repeats
            ),
            n,
        ),
        Timing(
            "encode_batch",
            time_calls(
                lambda: [e.ids for e in backend.encode_batch(d.texts, add_special_tokens=False)],
                repeats,
            ),
            n,
        ),
        *([Timing("encode_batch_fast", time_calls(fast, repeats), n)] if fast else []),
        Timing(
            "align", time_calls(lambda: align_many(d.src_ends, d.tgt_ends, d.totals), repeats), n
        ),
        Timing(
            "align_per_text",
            time_calls(
                lambda: [align_ends(a, b, c) for a, b, c in zip(d.src_ends, d.tgt_ends, d.totals)],
                repeats,
            ),
            n,
        ),
        Timing(
            "end_to_end",
            time_calls(
                lambda: [
                    d.tgt.retokenize(t, source=source, source_ids=i, source_logprobs=lp)
                    for t, i, lp in zip(d.texts, d.src_ids, d.src_lps)
                ],
                repeats,
            ),
            n,
        ),
        Timing(
            "end_to_end_batch",
            time_calls(
                lambda: d.tgt.retokenize_batch(
                    d.texts, source=source, source_ids=d.src_ids, source_logprobs=d.src_lps
                ),
                repeats,
            ),
            n,
        ),
        Timing(
            "e2e_target",
            time_calls(lambda: encode_texts(d.tgt.profile, d.texts, datas, d.tgt.cache), repeats),
            n,
        ),
        Timing(
            "e2e_source",
            time_calls(
                lambda: read_sources(
                    src_prof,
                    d.texts,
                    datas,
                    d.src_ids,
                    d.src_lps,
                    [False] * len(d.texts),
                    d.tgt.cache,
                ),
                repeats,
            ),
            n,
        ),
    ]


def _bench_peers(d: PairData, repeats: int, naive_texts: int) -> list[Timing]:
    out = []
    n = d.target_tokens
    trl = baselines.trl_align_fn()
    if trl is not None:
        s_off = [_offsets(e) for e in d.src_ends]
        t_off = [_offsets(e) for e in d.tgt_ends]
        out.append(
            Timing(
                "align_trl",
                time_calls(lambda: [trl(a, b) for a, b in zip(s_off, t_off)], repeats),
                n,
            )
        )
    spacy = baselines.spacy_align_fn()
    if spacy is not None:
        s_tok = [_token_strings(d.src.profile, ids) for ids in d.src_ids]
        t_tok = [_token_strings(d.tgt.profile, ids) for ids in d.tgt_ids]
        out.append(
            Timing(
                "align_spacy",
                time_calls(lambda: [spacy(a, b) for a, b in zip(s_tok, t_tok)], repeats),
                n,
            )
        )
    if naive_texts > 0:
        k = min(naive_texts, len(d.texts))
        sdec, tdec = d.src.profile.continuation.decode, d.tgt.profile.continuation.decode
        s_ids = [ids.tolist() for ids in d.src_ids[:k]]
        t_ids = [ids.tolist() for ids in d.tgt_ids[:k]]
        out.append(
            Timing(
                "align_naive",
                time_calls(
                    lambda: [
                        baselines.naive_decode_prefix_align(sdec, a, tdec, b)
                        for a, b in zip(s_ids, t_ids)
                    ],
                    max(1, repeats // 2),
                ),
                int(sum(len(b) for b in t_ids)),
                note=f"first {k} texts",
            )
        )
    return out


def _fast_encode(d: PairData):
    """The receiver's encode as the retokenizer calls it (``encoding.rust_encode``), ids read,
    when that is ``encode_batch_fast`` (a lossless receiver); else None."""
    prof = d.tgt.profile
    if not encodes_without_offsets(prof):
        return None
    return lambda: [e.ids for e in rust_encode(prof, d.texts)]


def _ratio_summary(num: list[float], den: list[float]) -> dict:
    r = [a / b for a, b in zip(num, den)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "pairs": len(r)}


def _bench_paired(d: PairData, repeats: int, peers: bool) -> dict:
    """The goal ratios from alternating calls (see the module docstring)."""
    backend, source = d.tgt.profile.continuation, d.src.target
    contenders = [
        lambda: [e.ids for e in backend.encode_batch(d.texts, add_special_tokens=False)],
        floor(d),
        lambda: d.tgt.retokenize_batch(
            d.texts, source=source, source_ids=d.src_ids, source_logprobs=d.src_lps
        ),
        floor_results(d),
    ]
    fast = _fast_encode(d)
    if not d.tgt.profile.lossless:  # the floor plus the rendering, plus the residuals from it
        contenders += [floor(d, rendered=True), floor(d, residuals=True)]
    elif fast is not None:  # the receiver's encode as the retokenizer calls it
        contenders.append(fast)
    enc, least, e2e, results, *rest = time_alternating(contenders, repeats)
    out = {
        "end_to_end_batch_over_encode_batch": _ratio_summary(e2e, enc),
        "floor_over_encode_batch": _ratio_summary(least, enc),
        "end_to_end_batch_over_floor": _ratio_summary(e2e, least),
        "floor_results_over_encode_batch": _ratio_summary(results, enc),
        "end_to_end_batch_over_floor_results": _ratio_summary(e2e, results),
    }
    if rest and not d.tgt.profile.lossless:
        for name, times in zip(("floor_rendered", "floor_residuals"), rest):
            out[f"{name}_over_encode_batch"] = _ratio_summary(times, enc)
            out[f"end_to_end_batch_over_{name}"] = _ratio_summary(e2e, times)
    elif rest:
        out["encode_batch_fast_over_encode_batch"] = _ratio_summary(rest[0], enc)
        out["end_to_end_batch_over_encode_batch_fast"] = _ratio_summary(e2e, rest[0])
    out.update(_bench_cache(d, repeats))
    trl = baselines.trl_align_fn() if peers else None
    if trl is not None:
        s_off = [_offsets(e) for e in d.src_ends]
        t_off = [_offsets(e) for e in d.tgt_ends]
        walk = lambda: [trl(a, b) for a, b in zip(s_off, t_off)]  # noqa: E731
        align = lambda: align_many(d.src_ends, d.tgt_ends, d.totals)  # noqa: E731
        theirs, ours = time_alternating((walk, align), repeats)
        out["align_speedup_vs_trl"] = _ratio_summary(theirs, ours)
        (theirs, ours), calls = time_turns((walk, align), repeats, ALIGN_TURN_S)
        out["align_speedup_vs_trl_turns"] = {
            **_ratio_summary(theirs, ours),
            "calls_per_turn": calls,
        }
    return out


def _bench_cache(d: PairData, repeats: int) -> dict:
    """What the encoding cache costs and saves: ``end_to_end_batch`` with the default cache
    (``Retokenizer``'s ``cache_size``) over the same call with the cache off, alternating call by
    call, once with every text a miss (the cache emptied before the call, as a run whose
    completions are all new pays for the hashing, the stores and the evictions) and once with
    every text a hit (the call repeated). Timed apart from the goal ratios' rounds, so their
    contenders stay as they were."""
    source = d.src.target
    profiles = {
        d.tgt.target.fingerprint: d.tgt.profile,
        source.fingerprint: d.tgt.profile_for(source),
    }
    cached = Retokenizer(d.tgt.target, max_length=d.tgt.max_length, profiles=profiles)

    def call(rt):
        return rt.retokenize_batch(
            d.texts, source=source, source_ids=d.src_ids, source_logprobs=d.src_lps
        )

    def miss():
        cached.cache.clear()
        return call(cached)

    off, all_miss, all_hit = time_alternating(
        [lambda: call(d.tgt), miss, lambda: call(cached)], repeats
    )
    # what was timed: every lookup of the miss calls missed, every one of the hit calls hit
    return {
        "cache_all_miss_over_cache_off": {
            **_ratio_summary(all_miss, off),
            "lookups_missed": cached.cache.misses,
        },
        "cache_all_hit_over_cache_off": {
            **_ratio_summary(all_hit, off),
            "lookups_hit": cached.cache.hits,
        },
    }


def bench_pair(
    src: Retokenizer,
    tgt: Retokenizer,
    texts: list[str],
    *,
    repeats: int = 5,
    naive_texts: int = 8,
    peers: bool = True,
) -> dict:
    """All measurements, speed ratios and a residual summary for one (source -> target) pair."""
    d = PairData.build(src, tgt, texts)
    timings = _bench_ours(d, repeats) + (_bench_peers(d, repeats, naive_texts) if peers else [])
    by = {t.name: t for t in timings}
    outs = tgt.retokenize_batch(
        d.texts, source=src.target, source_ids=d.src_ids, source_logprobs=d.src_lps
    )
    agg = aggregate_residuals([o.residuals for o in outs])
    ratios = {
        "end_to_end_over_encode": by["end_to_end"].median / by["encode"].median,
        "end_to_end_batch_over_encode_batch": by["end_to_end_batch"].median
        / by["encode_batch"].median,
    }
    # end_to_end_batch in parts, each over encode_batch: where the time beyond encoding goes
    enc = by["encode_batch"].median
    parts = {
        "target_side": by["e2e_target"].median / enc,
        "source_side": by["e2e_source"].median / enc,
        "align_and_assemble": (
            by["end_to_end_batch"].median - by["e2e_target"].median - by["e2e_source"].median
        )
        / enc,
    }
    for peer in ("align_trl", "align_spacy", "align_naive"):
        if peer in by:  # per token, since the naive peer runs on a subset
            ratios[f"align_speedup_vs_{peer[6:]}"] = (
                by["align"].tokens_per_s / by[peer].tokens_per_s
            )
    return {
        "source": src.target.name,
        "target": tgt.target.name,
        "texts": len(texts),
        "bytes": int(sum(d.totals)),
        "source_tokens": int(sum(i.size for i in d.src_ids)),
        "target_tokens": d.target_tokens,
        "timings": {t.name: t.to_dict() for t in timings},
        "ratios": ratios,
        "end_to_end_batch_parts_over_encode_batch": parts,
        "paired": _bench_paired(d, repeats, peers),
        "residuals": {k: agg[k] for k in RESIDUAL_KEYS},
    }


def run_benchmark(
    pairs=DEFAULT_PAIRS,
    *,
    corpus: Path | str | None = None,
    repeats: int = 5,
    naive_texts: int = 8,
    peers: bool = True,
    handles: dict[str, TokenizerHandle] | None = None,
) -> dict:
    """Benchmark every pair; tokenizers are loaded (or taken from ``handles``) once each."""
    texts = load_corpus(corpus)
    handles = dict(handles or {})
    for name in {n for pair in pairs for n in pair}:
        if name not in handles:
            handles[name] = load_tokenizer(name)
    rts = {name: Retokenizer(h, cache_size=0) for name, h in handles.items()}
    results = [
        bench_pair(rts[s], rts[t], texts, repeats=repeats, naive_texts=naive_texts, peers=peers)
        for s, t in pairs
    ]
    return {
        "corpus": {"texts": len(texts), "bytes": sum(len(t.encode()) for t in texts)},
        "peers": baselines.available() if peers else {},
        "pairs": results,
    }
