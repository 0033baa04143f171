"""Comparing two sets of sampled completions that should be the same up to float rounding.

Our samplers invert the CDF in vocabulary order, so a draw that falls within rounding of the
boundary between two tokens may pick either: the two completions then part at neighbouring ids
(and differ freely after, each following its own token). Which draws part depends on the kernels
a CPU picks (seen with AMX), not on the code under test.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def parted_at(x: Sequence[int], y: Sequence[int]) -> int:
    """Where two id sequences first differ; the shorter one's length if one is the other's start."""
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def assert_same_up_to_a_rounding_flip(
    x: Sequence[int], lx, y: Sequence[int], ly, atol: float, where: object = ""
) -> None:
    """The two draws' log-probs agree to ``atol`` on the ids they share, and where the ids part
    they are neighbours (a boundary, not another draw)."""
    x, y = list(x), list(y)
    n = parted_at(x, y)
    np.testing.assert_allclose(
        np.asarray(ly[:n], dtype=np.float64),
        np.asarray(lx[:n], dtype=np.float64),
        rtol=0,
        atol=atol,
        err_msg=str(where),
    )
    if n < min(len(x), len(y)):
        assert abs(x[n] - y[n]) == 1, (where, n, x[n], y[n])
