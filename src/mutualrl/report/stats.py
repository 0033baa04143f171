"""Statistics of a compare, as pure functions on arrays: paired differences with a hierarchical
bootstrap, a plain verdict, and sample efficiency.

**The paired, hierarchical bootstrap.** A compare's runs are paired twice: runs of one seed start
from the same weights and see the same prompts, and every evaluation asks the same held-out
prompts in the same order. So for a metric measured per prompt, the difference ``d[s, p] =
strategy[s, p] - none[s, p]`` is taken first (seed ``s``, prompt ``p``), and the uncertainty of
its mean comes from resampling *both* levels: each replicate draws seeds with replacement, and
within each drawn seed draws prompts with replacement, then averages ``d`` over what it drew. The
percentile interval of the replicates is the confidence interval. Resampling seeds covers
training noise (different initial weights and prompt streams); resampling prompts covers the
finite evaluation set. With 3 seeds the seed level has only 10 distinct multisets, so the interval
is coarse: it is honest about that rather than precise. A metric measured once per run (tokens,
a curve's area) is the special case of one "prompt" per seed.

The generator is seeded (``seed``), so a report is reproducible. Verdicts: ``better`` when the whole
interval is above zero (for a metric where higher is better), ``worse`` when it is below, else
``no difference at 95%``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

NO_DIFFERENCE = "no difference at 95%"


@dataclass(frozen=True)
class PairedDiff:
    mean: float  # mean over seeds and prompts of strategy - control
    lo: float  # confidence interval bounds (percentile bootstrap)
    hi: float
    level: float
    n_seeds: int
    n_prompts: int
    verdict: str

    def as_dict(self) -> dict:
        return asdict(self)


def bootstrap_means(diff: np.ndarray, *, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """Hierarchical bootstrap replicates of ``diff.mean()`` for ``diff`` of shape (S seeds, P
    prompts).

    Returns (n_boot,): each replicate resamples seeds, then prompts within each drawn seed."""
    d = np.asarray(diff, float)
    if d.ndim != 2 or d.size == 0:
        raise ValueError(f"diff must be a non-empty (seeds, prompts) array, got shape {d.shape}")
    s, p = d.shape
    rng = np.random.default_rng(seed)
    seeds = rng.integers(s, size=(n_boot, s))  # (B, S)
    prompts = rng.integers(p, size=(n_boot, s, p))  # (B, S, P)
    return d[seeds[:, :, None], prompts].mean(axis=(1, 2))  # (B,)


def verdict(lo: float, hi: float, higher_is_better: bool = True) -> str:
    """``better`` / ``worse`` when the interval excludes zero, else ``no difference at 95%``."""
    if lo > 0:
        return "better" if higher_is_better else "worse"
    if hi < 0:
        return "worse" if higher_is_better else "better"
    return NO_DIFFERENCE


def paired_difference(
    treat: np.ndarray,
    control: np.ndarray,
    *,
    level: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
    higher_is_better: bool = True,
) -> PairedDiff:
    """Paired difference ``treat - control`` (both (S, P), aligned by seed and prompt) with its
    hierarchical bootstrap interval and verdict. 1-D inputs are one value per seed."""
    t, c = np.asarray(treat, float), np.asarray(control, float)
    if t.shape != c.shape:
        raise ValueError(
            f"treat and control must be paired (same shape), got {t.shape} and {c.shape}"
        )
    if t.ndim == 1:
        t, c = t[:, None], c[:, None]
    d = t - c  # (S, P)
    reps = bootstrap_means(d, n_boot=n_boot, seed=seed)
    alpha = (1 - level) / 2
    lo, hi = (float(x) for x in np.quantile(reps, [alpha, 1 - alpha]))
    # An interval of identical replicates is a point; floating noise must not make it "better".
    if np.ptp(reps) < 1e-12:
        lo = hi = float(reps[0])
    return PairedDiff(
        float(d.mean()), lo, hi, level, d.shape[0], d.shape[1], verdict(lo, hi, higher_is_better)
    )


def wilson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a success rate ``successes / n`` over ``n`` prompts.

    Not the normal approximation: at the rates small pretrained models start from (0-10% on a
    family) that one reaches below 0 and is far too narrow; Wilson's stays in [0, 1] and keeps
    its coverage near the stated level."""
    if n <= 0:
        raise ValueError(f"n must be >= 1, got {n}")
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


# ---- sample efficiency ------------------------------------------------------------------------
def curve_area(steps: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Normalised area under a curve over its step span (trapezoids): the curve's mean height.

    ``values`` is (T,) or (T, P) for T evaluation points (P prompts); returns a scalar or (P,).
    A single point is its own area."""
    x = np.asarray(steps, float)
    y = np.asarray(values, float)
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(
            f"steps and values must have the same non-zero length, got {len(x)} and {len(y)}"
        )
    if len(x) == 1 or x[-1] == x[0]:
        return y[0]
    widths = np.diff(x)  # (T-1,)
    mids = (y[1:] + y[:-1]) / 2  # (T-1, ...)
    return np.tensordot(widths, mids, axes=1) / (x[-1] - x[0])


def cost_to_target(cost: np.ndarray, accuracy: np.ndarray, target: float) -> float | None:
    """The cost (cumulative tokens, or steps) at the first evaluation whose accuracy reaches
    ``target``; None when it never does."""
    a = np.asarray(accuracy, float)
    hit = np.flatnonzero(a >= target)
    return float(np.asarray(cost, float)[hit[0]]) if len(hit) else None
