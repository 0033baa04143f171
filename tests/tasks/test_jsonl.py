"""JSONL (GSM8K-style) tasks: parsing, splits, answer extraction and errors naming file:line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mutualrl.config import TaskConfig
from mutualrl.tasks import TaskError, build_task
from mutualrl.tasks.base import Prompt
from mutualrl.tasks.jsonl import JsonlTask, NumericAnswerVerifier, extract_final_number


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize(
    "text, want",
    [
        ("The answer is 1,234.", "1234"),
        ("... is 1,234.", "1234"),
        ("3 apples and 4 pears make 7", "7"),
        ("it is -12 degrees", "-12"),
        ("pi is about 3.14", "3.14"),
        ("#### 42", "42"),
        ("no number here", None),
    ],
)
def test_extract_final_number(text, want):
    assert extract_final_number(text) == want


def test_numeric_verifier_compares_final_numbers():
    v = NumericAnswerVerifier()
    p = Prompt(text="q", answer="She has 3 + 4 = 7 apples.\n#### 1,007", family="default")
    assert v(p, "so the total is 1007") == 1.0
    assert v(p, "1,007.") == 1.0
    assert v(p, "1007.0") == 1.0
    assert v(p, "7") == 0.0
    assert v(p, "I don't know") == 0.0


def test_parsing_families_and_splits(tmp_path):
    rows = [
        {"question": f"q{i}", "answer": f"#### {i}", "family": "add" if i % 2 else "mul"}
        for i in range(1, 17)
    ]
    rows[2]["split"] = "heldout"  # line 3 fixed to held-out
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = JsonlTask(path)
    assert task.families == ("add", "mul")
    held = {p.text for p in task.splits["heldout"]}
    assert held == {"q3", "q8", "q16"}  # explicit split plus every 8th line
    assert len(task.splits["train"]) == 13
    p = task.splits["train"][0]
    assert p == Prompt(text="q1", answer="#### 1", family="add")
    assert task.demonstration(p) == " #### 1"
    assert task.verifier(p, task.demonstration(p)) == 1.0
    sampled = task.sample(np.random.default_rng(0), 20, "train", ["mul"])
    assert {s.family for s in sampled} == {"mul"}
    assert all(s in task.splits["train"] for s in sampled)


def test_blank_lines_are_skipped_and_default_family(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"question": "a", "answer": "#### 1"}, "", {"question": "b", "answer": "#### 2"}],
    )
    task = JsonlTask(path)
    assert task.families == ("default",)
    assert [p.text for p in task.splits["train"]] == ["a", "b"]


@pytest.mark.parametrize("bad", ["{not json", '{"question": "q"}', "[1, 2]"])
def test_bad_line_raises_task_error_naming_file_and_line(tmp_path, bad):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "#### 1"}, bad])
    with pytest.raises(TaskError) as info:
        JsonlTask(path)
    assert f"{path}:2:" in str(info.value)


def test_bad_split_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1", "split": "dev"}])
    with pytest.raises(TaskError, match=r"d\.jsonl:1: split must be"):
        JsonlTask(path)


def test_missing_file_raises_task_error(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(TaskError, match="file not found") as info:
        JsonlTask(missing)
    assert str(missing) in str(info.value)


def test_unknown_family_and_no_training_prompts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1", "family": "x"}])
    with pytest.raises(TaskError, match=r"\['y'\] not found"):
        JsonlTask(path, families=["y"])
    only_held = write_jsonl(
        tmp_path / "h.jsonl", [{"question": "a", "answer": "1", "split": "heldout"}]
    )
    with pytest.raises(TaskError, match="no training prompts"):
        JsonlTask(only_held)


def test_empty_split_sample_raises(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}])
    task = JsonlTask(path)
    with pytest.raises(TaskError, match="no heldout prompts"):
        task.sample(np.random.default_rng(0), 1, "heldout")


def test_built_from_config_needs_a_path(tmp_path):
    with pytest.raises(TaskError, match="task.path"):
        build_task(TaskConfig(name="jsonl"))
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}])
    assert isinstance(build_task(TaskConfig(name="jsonl", path=str(path))), JsonlTask)
