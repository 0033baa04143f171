"""GSM8K-style JSONL tasks: one ``{"question": ..., "answer": "... #### 42"}`` object per line.

An optional ``"family"`` field tags prompt families; an optional ``"split"`` (``train``,
``validation`` or ``heldout``) fixes the split, otherwise every 8th line is held out (a
validation split exists only where lines are marked so). The verifier compares the last
number in the completion with the number after ``####`` in the answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mutualrl.tasks.base import SPLITS, TASKS, Prompt, Split, TaskError, sample_split

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_number(text: str) -> str | None:
    """The last number in ``text`` with thousands separators removed, or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


class NumericAnswerVerifier:
    verifier_id = "final-number"
    version = 1

    def __call__(self, prompt: Prompt, completion: str) -> float:
        got = extract_final_number(completion)
        want = extract_final_number(prompt.answer.split("####")[-1])
        if got is None or want is None:
            return 0.0
        return 1.0 if float(got) == float(want) else 0.0


class JsonlTask:
    def __init__(self, path: str | Path, families: Sequence[str] = ()) -> None:
        self.path = Path(path)
        self.splits: dict[str, list[Prompt]] = {s: [] for s in SPLITS}
        self._load()
        present = sorted({p.family for s in self.splits.values() for p in s})
        missing = [f for f in families if f not in present]
        if missing:
            raise TaskError(
                f"task.families: {missing} not found in {self.path}; present: {present}"
            )
        self.families = tuple(families) or tuple(present)
        self.verifier = NumericAnswerVerifier()

    def _load(self) -> None:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise TaskError(f"task.path: file not found: {self.path}") from None
        except IsADirectoryError:
            raise TaskError(
                f"task.path: {self.path} is a folder; expected a JSON Lines file"
            ) from None
        except UnicodeDecodeError as exc:
            raise TaskError(
                f"task.path: {self.path}: not UTF-8 text (byte {exc.start}: "
                f"{exc.reason}); expected a UTF-8 encoded JSON Lines file"
            ) from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question, answer = row["question"], row["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise TaskError(
                    f"{self.path}:{number}: expected a JSON object with 'question' "
                    f"and 'answer' ({type(exc).__name__}: {exc})"
                ) from None
            split = row.get("split") or ("heldout" if number % 8 == 0 else "train")
            if split not in self.splits:
                raise TaskError(
                    f"{self.path}:{number}: split must be one of {list(SPLITS)}, got {split!r}"
                )
            self.splits[split].append(
                Prompt(
                    text=str(question), answer=str(answer), family=str(row.get("family", "default"))
                )
            )
        if not self.splits["train"]:
            raise TaskError(f"{self.path}: no training prompts")

    def sample(
        self, rng: np.random.Generator, n: int, split: Split, families: Sequence[str] | None = None
    ) -> list[Prompt]:
        return sample_split(self.splits, self.families, self.path, rng, n, split, families)

    def demonstration(self, prompt: Prompt) -> str:
        return " " + prompt.answer


@TASKS.register("jsonl")
def _make_jsonl(cfg) -> JsonlTask:
    if not cfg.path:
        raise TaskError("task.path: the jsonl task needs a data file")
    return JsonlTask(cfg.path, cfg.families)
