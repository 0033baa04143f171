"""Held-out evaluation: pass@1 and pass@k per prompt family."""

from __future__ import annotations

import numpy as np

from mutualrl.policies.policy import Sample
from mutualrl.tasks.base import GuardedVerifier, Prompt


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def score_evaluation(prompts: list[Prompt], greedy: list[Sample], sampled: list[Sample],
                     verifier: GuardedVerifier, *, k: int) -> dict[str, float]:
    """``heldout/<family>/pass@1`` (greedy), ``.../pass@k`` and ``heldout/pass@1`` from one greedy
    and k sampled completions per prompt, generated wherever the policy lives; the verifier runs
    here."""
    out: dict[str, float] = {}
    families = sorted({p.family for p in prompts})
    correct_greedy = np.array([verifier(s.prompt, s.text) > 0 for s in greedy])
    correct_k = np.array([verifier(s.prompt, s.text) > 0 for s in sampled]).reshape(len(prompts), -1)
    fam = np.array([p.family for p in prompts])
    for f in families:
        sel = fam == f
        out[f"heldout/{f}/pass@1"] = float(correct_greedy[sel].mean())
        out[f"heldout/{f}/pass@{k}"] = float(np.mean([pass_at_k(correct_k.shape[1], int(c), k)
                                                      for c in correct_k[sel].sum(1)]))
    out["heldout/pass@1"] = float(correct_greedy.mean())
    return out


def accuracy(samples: list[Sample], verifier: GuardedVerifier) -> float:
    """The fraction of ``samples`` the verifier accepts."""
    return float(np.mean([verifier(s.prompt, s.text) > 0 for s in samples]))
