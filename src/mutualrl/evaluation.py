"""Held-out evaluation: pass@1 and pass@k per prompt family, and every prompt's own result.

The per-prompt results (greedy correct or not, and how many of the k samples were correct) go to
``heldout.jsonl`` in the run directory, one line per evaluation and policy, in the same prompt
order at every evaluation and for every run of a seed: a compare's statistics resample prompts
from them (``mutualrl.report.stats``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mutualrl.policies.policy import Sample
from mutualrl.tasks.base import GuardedVerifier, Prompt

HELDOUT_FILE = "heldout.jsonl"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@dataclass(frozen=True)
class Correctness:
    """One policy's held-out results: per prompt, greedy correct (n,) and correct samples (n, k)."""

    greedy: np.ndarray        # (n,) bool
    sampled: np.ndarray       # (n, k) bool
    greedy_text: list[str]


def correctness(prompts: list[Prompt], greedy: list[Sample], sampled: list[Sample],
                verifier: GuardedVerifier) -> Correctness:
    """Verify one greedy and k sampled completions per prompt, each exactly once."""
    ok_greedy = np.array([verifier(s.prompt, s.text) > 0 for s in greedy])
    ok_k = np.array([verifier(s.prompt, s.text) > 0 for s in sampled]).reshape(len(prompts), -1)
    return Correctness(ok_greedy, ok_k, [s.text for s in greedy])


def score_correctness(prompts: list[Prompt], c: Correctness, *, k: int) -> dict[str, float]:
    """``heldout/<family>/pass@1`` (greedy), ``.../pass@k`` and ``heldout/pass@1``."""
    out: dict[str, float] = {}
    fam = np.array([p.family for p in prompts])
    for f in sorted(set(fam.tolist())):
        sel = fam == f
        out[f"heldout/{f}/pass@1"] = float(c.greedy[sel].mean())
        out[f"heldout/{f}/pass@{k}"] = float(np.mean([pass_at_k(c.sampled.shape[1], int(n), k)
                                                      for n in c.sampled[sel].sum(1)]))
    out["heldout/pass@1"] = float(c.greedy.mean())
    return out


def score_evaluation(prompts: list[Prompt], greedy: list[Sample], sampled: list[Sample],
                     verifier: GuardedVerifier, *, k: int) -> dict[str, float]:
    """Scores from one greedy and k sampled completions per prompt, generated wherever the
    policy lives; the verifier runs here."""
    return score_correctness(prompts, correctness(prompts, greedy, sampled, verifier), k=k)


def heldout_record(step: int, policy: str, prompts: list[Prompt], c: Correctness) -> dict:
    """One line of ``heldout.jsonl``: every prompt's result, in evaluation order."""
    return {"step": step, "policy": policy, "k": int(c.sampled.shape[1]),
            "prompt_ids": [p.id for p in prompts], "families": [p.family for p in prompts],
            "greedy": c.greedy.astype(int).tolist(), "sampled": c.sampled.sum(1).astype(int).tolist(),
            "greedy_text": c.greedy_text}


def append_heldout(run_dir: str | Path, records: list[dict]) -> None:
    with (Path(run_dir) / HELDOUT_FILE).open("a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_heldout(run_dir: str | Path) -> list[dict]:
    """Every per-prompt record a run wrote ([] for a run made before the file existed)."""
    path = Path(run_dir) / HELDOUT_FILE
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def accuracy(samples: list[Sample], verifier: GuardedVerifier) -> float:
    """The fraction of ``samples`` the verifier accepts."""
    return float(np.mean([verifier(s.prompt, s.text) > 0 for s in samples]))
