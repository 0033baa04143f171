"""Held-out evaluation: pass@1 and pass@k per prompt family, and every prompt's own result.

The per-prompt results (greedy correct or not, and how many of the k samples were correct) go to
``heldout.jsonl`` in the run directory, one line per evaluation and policy, in the same prompt
order at every evaluation and for every run of a seed: a compare's statistics resample prompts
from them (``mutualrl.report.stats``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mutualrl.policies.samples import Sample
from mutualrl.policies.worker import Generate
from mutualrl.run.jsonl import read_jsonl
from mutualrl.run.metrics import namespaced
from mutualrl.storage import append_whole
from mutualrl.tasks.base import GuardedVerifier, Prompt, distinct_prompts

if TYPE_CHECKING:
    from mutualrl.run.state import Run

HELDOUT_FILE = "heldout.jsonl"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@dataclass(frozen=True)
class Correctness:
    """One policy's held-out results: per prompt, greedy correct (n,) and correct samples (n, k)."""

    greedy: np.ndarray  # (n,) bool
    sampled: np.ndarray  # (n, k) bool
    greedy_text: list[str]


def correctness(
    prompts: list[Prompt], greedy: list[Sample], sampled: list[Sample], verifier: GuardedVerifier
) -> Correctness:
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
        out[f"heldout/{f}/pass@{k}"] = float(
            np.mean([pass_at_k(c.sampled.shape[1], int(n), k) for n in c.sampled[sel].sum(1)])
        )
    out["heldout/pass@1"] = float(c.greedy.mean())
    return out


def score_evaluation(
    prompts: list[Prompt],
    greedy: list[Sample],
    sampled: list[Sample],
    verifier: GuardedVerifier,
    *,
    k: int,
) -> dict[str, float]:
    """Scores from one greedy and k sampled completions per prompt, generated wherever the
    policy lives; the verifier runs here."""
    return score_correctness(prompts, correctness(prompts, greedy, sampled, verifier), k=k)


def heldout_record(
    step: int, policy: str, prompts: list[Prompt], c: Correctness, split: str = "heldout"
) -> dict:
    """One line of ``heldout.jsonl``: every prompt's result, in evaluation order, and the split
    evaluated (``eval.split``)."""
    return {
        "step": step,
        "policy": policy,
        "split": split,
        "k": int(c.sampled.shape[1]),
        "prompt_ids": [p.id for p in prompts],
        "families": [p.family for p in prompts],
        "greedy": c.greedy.astype(int).tolist(),
        "sampled": c.sampled.sum(1).astype(int).tolist(),
        "greedy_text": c.greedy_text,
    }


def append_heldout(run_dir: str | Path, records: list[dict]) -> None:
    """One evaluation's per-prompt records, appended whole or not at all."""
    path = Path(run_dir) / HELDOUT_FILE
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        append_whole(
            fd,
            "".join(json.dumps(r) + "\n" for r in records).encode("utf-8"),
            path,
            "this evaluation's per-prompt records were not written; earlier ones are kept",
        )
    finally:
        os.close(fd)


def read_heldout(run_dir: str | Path) -> list[dict]:
    """Every per-prompt record a run wrote ([] for a run made before the file existed)."""
    path = Path(run_dir) / HELDOUT_FILE
    if not path.exists():
        return []
    return read_jsonl(path)  # a damaged line: an error naming the file and byte offset


def accuracy(samples: list[Sample], verifier: GuardedVerifier) -> float:
    """The fraction of ``samples`` the verifier accepts."""
    return float(np.mean([verifier(s.prompt, s.text) > 0 for s in samples]))


# ---- the run's evaluation phase ----------------------------------------------------------------
def eval_prompts(task, cfg) -> dict[str, list[Prompt]]:
    """Each family's problems of ``eval.split`` the run evaluates: ``eval.num_prompts`` distinct
    ones, or all the family has when it has fewer (``eval_notes`` says so), the same at every
    evaluation of the run."""
    e = cfg.eval
    return {
        f: distinct_prompts(task, [cfg.seed, 5], e.num_prompts, e.split, f) for f in task.families
    }


def eval_notes(task, cfg) -> tuple[str, ...]:
    """One line per family whose ``eval.split`` set is smaller than ``eval.num_prompts``."""
    n, split = cfg.eval.num_prompts, cfg.eval.split
    return tuple(
        f"eval.num_prompts = {n}: family {f!r} has {len(ps)} distinct {split} problems; "
        f"it is evaluated on those {len(ps)}, each counted once"
        for f, ps in eval_prompts(task, cfg).items()
        if len(ps) < n
    )


def evaluate(run: Run, step: int) -> dict[str, float]:
    """Held-out pass@1 (greedy) and pass@k of every live policy; samples come from the workers,
    the verifier runs here."""
    with run.timed("eval"):
        return _evaluate(run, step)


def _evaluate(run: Run, step: int) -> dict[str, float]:
    e, g = run.cfg.eval, run.cfg.grpo
    prompts = [p for ps in eval_prompts(run.task, run.cfg).values() for p in ps]
    greedy = run.call_live(Generate(prompts, 1, g.max_completion_length, 0.0))
    sampled = (
        run.call_live(Generate(prompts, e.k, g.max_completion_length, g.temperature))
        if e.k > 1
        else greedy
    )
    record: dict = {"phase": "eval", "step": step}
    per_prompt = []
    for name in run.policies:
        if name in greedy and name in sampled:
            c = correctness(prompts, greedy[name], sampled[name], run.verifier)
            record.update(namespaced(name, score_correctness(prompts, c, k=e.k)))
            per_prompt.append(heldout_record(step, name, prompts, c, e.split))
    run.writer.write(record)
    append_heldout(run.out, per_prompt)
    return record
