"""Checks of what a caller hands the retokenizer: one entry per text, token ids in the sender's
vocabulary, finite log-probs one per id. Whole-batch passes (one range test over every id, one
NaN/+inf test over every log-prob) with a failure traced back to the text and position it names.
"""

from __future__ import annotations

import numpy as np

from mutualrl.retokenize.profile import TokenizerProfile


def check_len(field: str, values, n: int) -> None:
    if values is not None and len(values) != n:
        raise ValueError(f"{field}: expected one entry per text ({n}), got {len(values)}")


def as_id_array(ids, field: str) -> np.ndarray:
    """A text's ids as int64, checked for shape and type (their range: ``check_id_range``)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(
            f"{field}: expected a 1-D sequence of integer token ids, "
            f"got shape {arr.shape} dtype {arr.dtype}"
        )
    return arr.astype(np.int64, copy=False)


def id_arrays(source_ids) -> list[np.ndarray]:
    """``as_id_array`` of every text's ids; a batch of 1-D int64 arrays (what a run hands over)
    passes as given after one type test per text, without a call per text."""
    if all(type(a) is np.ndarray and a.ndim == 1 and a.dtype == np.int64 for a in source_ids):
        return list(source_ids)
    return [as_id_array(a, f"source_ids[{i}]") for i, a in enumerate(source_ids)]


def check_id_range(flat: np.ndarray, sizes: np.ndarray, prof: TokenizerProfile) -> None:
    """Every id of the batch (``flat``: the texts' ids end to end, ``sizes`` per text) inside the
    vocabulary, or an error naming the first text with one outside."""
    vocab = prof.piece_len.size
    if not flat.size or (flat.min() >= 0 and flat.max() < vocab):
        return
    i, start, stop = _locate(np.flatnonzero((flat < 0) | (flat >= vocab))[0], sizes)
    arr = flat[start:stop]
    raise ValueError(
        f"source_ids[{i}]: expected ids in [0, {vocab}) for tokenizer "
        f"{prof.handle.name!r}, got range [{arr.min()}, {arr.max()}]"
    )


def logprob_batch(source_logprobs, sizes: list[int]) -> tuple[list, np.ndarray | None]:
    """Each text's log-probs as float64, one per source id, with no NaN or +inf anywhere in the
    batch (such a value would flow silently into every moved log-prob and importance ratio);
    an error names the first offending text and position. Returns them, and the batch's laid end
    to end; ``([None] * n, None)`` without log-probs."""
    if source_logprobs is None:
        return [None] * len(sizes), None
    if all(
        type(a) is np.ndarray and a.dtype == np.float64 and a.shape == (n,)
        for a, n in zip(source_logprobs, sizes)
    ):
        out = list(source_logprobs)  # as np.asarray would give them, without a call per text
    else:
        out = []
        for i, n in enumerate(sizes):
            arr = np.asarray(source_logprobs[i], dtype=np.float64)
            if arr.shape != (n,):
                raise ValueError(
                    f"source_logprobs[{i}]: expected {n} log-probs (one per source "
                    f"id), got shape {arr.shape}"
                )
            out.append(arr)
    flat = np.concatenate(out) if out else np.zeros(0)
    bad = np.flatnonzero(np.isnan(flat) | (flat == np.inf))
    if bad.size:
        i, start, stop = _locate(bad[0], np.array(sizes, dtype=np.int64))
        here = bad[(bad >= start) & (bad < stop)] - start
        raise ValueError(
            f"source_logprobs[{i}]: log-prob at position {int(here[0])} is "
            f"{flat[start + here[0]]}; expected a number <= 0 ({here.size} such "
            f"value(s))"
        )
    return out, flat


def _locate(position: int, sizes: np.ndarray) -> tuple[int, int, int]:
    """Which text of a batch laid end to end holds ``position``, and its [start, stop)."""
    stops = np.cumsum(sizes)
    i = int(np.searchsorted(stops, position, side="right"))
    return i, int(stops[i] - sizes[i]), int(stops[i])
