"""Math tasks read with Hugging Face ``datasets``: ``gsm8k`` and ``math`` (MATH-style
``\\boxed{}``).

Sources (``task.path``): a local ``.jsonl``/``.json``, ``.parquet``, ``.arrow`` or ``.csv`` file, a
folder written by ``Dataset.save_to_disk``, or a hub name (``openai/gsm8k`` with
``dataset_config = "main"``) read with ``load_dataset(name, dataset_config, split=dataset_split)``
where a hub is reachable. Nothing is downloaded implicitly: an unreachable hub is an error that
says so.

Columns (``task.*_column``; None: the task's default):

==========  ==============  ==============  =========================================
task        question        answer          reference answer
==========  ==============  ==============  =========================================
gsm8k       ``question``    ``answer``      the number after ``####``
math        ``problem``     ``solution``    the last ``\\boxed{}`` (else the whole text)
==========  ==============  ==============  =========================================

``split_column`` (default ``split``, optional) holds ``train``, ``validation`` (or ``valid``,
``dev``) or ``heldout`` (``test`` also means held out); rows without one are split by position:
the 1-based row ``i`` is held out when ``i % heldout_every == 0``, so the split is fixed by the
file, not by the seed. ``family_column`` (default ``family``, optional; MATH's ``type`` is a
natural choice) tags prompt families; rows without one are family ``default``. A column named
explicitly that the data lacks is an error naming the file, the column and the columns present.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mutualrl.tasks.answers import gsm8k_equal, last_boxed, math_equal, math_reference
from mutualrl.tasks.base import SPLITS, TASKS, Prompt, Split, TaskError, sample_split

FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}
HELDOUT_NAMES = {
    "heldout": "heldout",
    "test": "heldout",
    "train": "train",
    "validation": "validation",
    "valid": "validation",
    "dev": "validation",
}


@dataclass(frozen=True)
class Columns:
    question: str
    answer: str
    split: str | None
    family: str | None


def load_rows(
    path: str, split: str = "train", config: str | None = None
) -> tuple[list[dict], list[str]]:
    """Every row of the source as a dict, and the column names; errors name ``task.path``."""
    try:
        import datasets
    except ImportError:
        raise TaskError(
            "task.path: dataset tasks need the `datasets` package (pip install datasets)"
        ) from None
    p = Path(path)
    looks_local = p.suffix in FILE_BUILDERS or path.startswith((".", "/", "~")) or p.exists()
    if looks_local and not p.exists():
        raise TaskError(
            f"task.path: file not found: {path} (expected one of "
            f"{sorted(FILE_BUILDERS)} or a save_to_disk folder)"
        )
    try:
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        elif p.is_file():
            if p.suffix not in FILE_BUILDERS:
                raise TaskError(
                    f"task.path: {path}: unknown file type {p.suffix!r}; "
                    f"expected one of {sorted(FILE_BUILDERS)}"
                )
            check_text_file(p)
            ds = datasets.load_dataset(FILE_BUILDERS[p.suffix], data_files=str(p), split="train")
        else:
            ds = datasets.load_dataset(path, config, split=split)
    except TaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; all mean "unusable"
        if "corresponds to no data" in str(exc):  # datasets' word for an empty file or split
            raise TaskError(
                f"task.path: {path} (split {split!r}) holds no rows; expected "
                "question and answer rows"
            ) from None
        where = "file" if p.exists() else "hub dataset (is the hub reachable from here?)"
        raise TaskError(
            f"task.path: cannot read {where} {path!r} "
            f"(split {split!r}): {type(exc).__name__}: {exc}"
        ) from None
    if len(ds) == 0:
        raise TaskError(
            f"task.path: {path} (split {split!r}) holds no rows; expected question and answer rows"
        )
    return ds.to_list(), list(ds.column_names)


def check_text_file(p: Path) -> None:
    """A local text data file must be UTF-8 and, as JSON Lines, one JSON value a line: the error
    names the file and the line (``datasets``' own errors name neither)."""
    if p.suffix not in (".jsonl", ".json", ".csv"):
        return
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TaskError(
            f"task.path: {p}:{line}: not UTF-8 text (byte {exc.start}: "
            f"{exc.reason}); expected a UTF-8 encoded file"
        ) from None
    if not text.strip():
        raise TaskError(f"task.path: {p} is empty; expected question and answer rows")
    if p.suffix == ".jsonl":
        for number, row in enumerate(text.splitlines(), start=1):
            if row.strip():
                try:
                    json.loads(row)
                except json.JSONDecodeError as exc:
                    raise TaskError(
                        f"task.path: {p}:{number}: not a JSON value ({exc}); "
                        "expected one JSON object a line"
                    ) from None


def _column(cfg_value: str | None, default: str, present: list[str], path: str, field: str) -> str:
    """The column the config names, else the task's default; an error when the data lacks it."""
    name = cfg_value or default
    if name not in present:
        raise TaskError(
            f"task.{field}: column {name!r} not found in {path}; columns present: {present}"
        )
    return name


def _optional_column(
    cfg_value: str | None, default: str, present: list[str], path: str, field: str
) -> str | None:
    """As ``_column`` for a column the data may lack: None where the default is absent (a column
    the config names must be there)."""
    if cfg_value is None and default not in present:
        return None
    return _column(cfg_value, default, present, path, field)


class DatasetTask:
    """Prompts from rows of a dataset; the reward is the answer check of the task kind."""

    def __init__(self, path: str, kind: TaskKind, cfg) -> None:
        self.path, self.kind = path, kind
        rows, present = load_rows(path, cfg.dataset_split, cfg.dataset_config)
        cols = Columns(
            question=_column(cfg.question_column, kind.question, present, path, "question_column"),
            answer=_column(cfg.answer_column, kind.answer, present, path, "answer_column"),
            split=_optional_column(cfg.split_column, "split", present, path, "split_column"),
            family=_optional_column(cfg.family_column, "family", present, path, "family_column"),
        )
        self.splits = split_rows(rows, cols, cfg.heldout_every, path)
        known = sorted({p.family for s in self.splits.values() for p in s})
        missing = [f for f in cfg.families if f not in known]
        if missing:
            raise TaskError(f"task.families: {missing} not found in {path}; present: {known}")
        self.families = tuple(cfg.families) or tuple(known)
        self.verifier = AnswerVerifier(kind)

    def sample(
        self, rng: np.random.Generator, n: int, split: Split, families: Sequence[str] | None = None
    ) -> list[Prompt]:
        return sample_split(self.splits, self.families, self.path, rng, n, split, families)

    def demonstration(self, prompt: Prompt) -> str:
        return " " + prompt.answer


def split_rows(
    rows: list[dict], cols: Columns, heldout_every: int, path: str
) -> dict[str, list[Prompt]]:
    splits: dict[str, list[Prompt]] = {s: [] for s in SPLITS}
    for i, row in enumerate(rows, start=1):
        tag = row.get(cols.split) if cols.split else None
        if tag is None:
            split = "heldout" if i % heldout_every == 0 else "train"
        elif str(tag) in HELDOUT_NAMES:
            split = HELDOUT_NAMES[str(tag)]
        else:
            raise TaskError(
                f"{path}: row {i}: column {cols.split!r} must be one of "
                f"{sorted(HELDOUT_NAMES)}, got {tag!r}"
            )
        family = row.get(cols.family) if cols.family else None
        splits[split].append(
            Prompt(
                text=str(row[cols.question]),
                answer=str(row[cols.answer]),
                family=str(family) if family is not None else "default",
            )
        )
    if not splits["train"]:
        raise TaskError(f"{path}: no training rows")
    return splits


@dataclass(frozen=True)
class TaskKind:
    name: str
    question: str
    answer: str
    equal: Callable[[str, str], bool]  # (completion, reference answer column) -> correct?
    version: int = 1


def _math_check(completion: str, reference: str) -> bool:
    got = last_boxed(completion)
    return got is not None and math_equal(got, math_reference(reference))


KINDS = {
    "gsm8k": TaskKind("gsm8k", "question", "answer", gsm8k_equal),
    "math": TaskKind("math", "problem", "solution", _math_check),
}


class AnswerVerifier:
    """Reward 1 when the completion's final answer equals the reference's, else 0."""

    def __init__(self, kind: TaskKind) -> None:
        self.kind = kind
        self.verifier_id = f"{kind.name}-answer"
        self.version = kind.version

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if self.kind.equal(completion, prompt.answer) else 0.0


def _register(name: str) -> None:
    @TASKS.register(name)
    def _make(cfg) -> DatasetTask:
        if not cfg.path:
            raise TaskError(f"task.path: the {name} task needs a data file, folder or hub name")
        return DatasetTask(cfg.path, KINDS[name], cfg)


for _name in KINDS:
    _register(_name)
