"""Dataset tasks (gsm8k, math) read with `datasets`: sources, columns, splits, answer checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mutualrl.config import TaskConfig
from mutualrl.tasks import TaskError, build_task
from mutualrl.tasks.answers import (
    extract_hash_answer,
    fallback_equal,
    gsm8k_equal,
    last_boxed,
    math_equal,
    normalise,
)
from mutualrl.tasks.base import Prompt

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_gsm8k_sample_loads_from_jsonl_and_parquet_alike(suffix):
    task = build_task(TaskConfig(name="gsm8k", path=str(DATA / f"gsm8k_sample.{suffix}")))
    assert task.families == ("counting", "groups")
    # 32 rows, every 8th held out by position
    assert len(task.splits["train"]) == 28 and len(task.splits["heldout"]) == 4
    held = task.splits["heldout"][0]
    assert held.text.startswith("Eli has 6 stickers") and held.answer.endswith("#### 7")
    assert held.family == "counting" and task.splits["heldout"][-1].family == "groups"
    assert task.verifier(held, "so the answer is #### 7") == 1.0
    assert task.verifier(held, "#### 8") == 0.0
    assert task.verifier(held, task.demonstration(held)) == 1.0
    got = task.sample(np.random.default_rng(0), 5, "train", ["groups"])
    assert len(got) == 5 and {p.family for p in got} == {"groups"}


def test_math_sample_defaults_to_problem_solution_columns(tmp_path):
    task = build_task(
        TaskConfig(name="math", path=str(DATA / "math_sample.jsonl"), family_column="type")
    )
    assert "Algebra" in task.families and "Prealgebra" in task.families
    every = [p for s in task.splits.values() for p in s]
    assert all(task.verifier(p, task.demonstration(p)) == 1.0 for p in every)
    half = next(p for p in every if "5}{6}" in p.answer)
    assert task.verifier(half, r"The sum is \boxed{\dfrac{5}{6}}.") == 1.0
    assert task.verifier(half, r"The sum is \boxed{\frac{5}{7}}.") == 0.0
    assert task.verifier(half, "5/6 without a box") == 0.0


def test_split_column_and_renamed_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"q": f"{i} + 1?", "a": f"#### {i + 1}", "part": "test" if i < 2 else "train"}
        for i in range(6)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = build_task(
        TaskConfig(
            name="gsm8k",
            path=str(path),
            question_column="q",
            answer_column="a",
            split_column="part",
        )
    )
    assert [p.text for p in task.splits["heldout"]] == ["0 + 1?", "1 + 1?"]
    assert len(task.splits["train"]) == 4 and task.families == ("default",)


def test_missing_column_names_file_column_and_columns_present(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "x", "answer": "#### 1"}) + "\n")
    with pytest.raises(
        TaskError,
        match=r"task.question_column: column 'question' not found in "
        r".*d.jsonl; columns present: \['prompt', 'answer'\]",
    ):
        build_task(TaskConfig(name="gsm8k", path=str(path)))
    with pytest.raises(TaskError, match=r"task.family_column: column 'kind' not found"):
        build_task(
            TaskConfig(name="gsm8k", path=str(path), question_column="prompt", family_column="kind")
        )


def test_bad_sources_fail_with_the_field(tmp_path):
    with pytest.raises(TaskError, match="task.path: file not found"):
        build_task(TaskConfig(name="gsm8k", path=str(tmp_path / "none.parquet")))
    with pytest.raises(TaskError, match="task.path: the gsm8k task needs"):
        build_task(TaskConfig(name="gsm8k"))
    bad = tmp_path / "d.jsonl"
    bad.write_text(json.dumps({"question": "x", "answer": "#### 1", "split": "eval"}) + "\n")
    with pytest.raises(TaskError, match="row 1: column 'split' must be one of"):
        build_task(TaskConfig(name="gsm8k", path=str(bad)))


@pytest.mark.parametrize(
    "text, want",
    [
        ("7 + 5 = 12\n#### 12", "12"),
        ("#### 1,250", "1250"),
        ("no marker, last is 9", "9"),
        ("#### 3 then 4", "4"),
        ("nothing", None),
    ],
)
def test_extract_hash_answer(text, want):
    assert extract_hash_answer(text) == want


def test_gsm8k_equal_is_numeric():
    assert gsm8k_equal("#### 12.0", "x\n#### 12")
    assert not gsm8k_equal("", "#### 12")


@pytest.mark.parametrize(
    "text, want",
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{a} then \boxed{b}", "b"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\fbox{3}", "3"),
        ("no box", None),
        (r"\boxed{1", None),
    ],
)
def test_last_boxed(text, want):
    assert last_boxed(text) == want


@pytest.mark.parametrize(
    "a, b, equal",
    [
        (r"\dfrac{3}{4}", r"\frac{3}{4}", True),
        (r"\frac34", r"\frac{3}{4}", True),
        ("0.75", r"\frac{3}{4}", True),
        ("3/4", "0.75", True),
        (r"\left(1, 2\right)", "(1,2)", True),
        ("5.", "5", True),
        ("1,000", "1000", True),
        (r"50\%", "0.5", True),
        (r"\text{12 }", "12", True),
        ("12^\\circ", "12", True),
        ("-0.5", r"-\frac{1}{2}", True),
        ("2", "3", False),
        (r"\frac{1}{0}", "1", False),
        ("x+1", "1+x", False),
        ("", "", False),
    ],
)
def test_fallback_normaliser(a, b, equal):
    assert fallback_equal(a, b) is equal


def test_normalise_strips_what_the_docs_say():
    assert normalise(r" $\left( \dfrac{1}{2} \right).$ ") == r"(\frac{1}{2})"


def test_math_verify_when_installed_accepts_equivalent_expressions():
    pytest.importorskip("math_verify")
    # math-verify knows algebra the fallback does not; called here off the main thread's
    # signal handler path (timeouts disabled), as the GuardedVerifier runs it.
    assert math_equal("1+x", "x+1")
    assert not math_equal("x+2", "x+1")
    assert math_equal(r"5\sqrt{2}", r"\sqrt{50}")
    assert not math_equal("x+1", "1+x", use_math_verify=False)


def test_math_verifier_in_a_thread():
    import concurrent.futures as cf

    task_kind_check = build_task(TaskConfig(name="math", path=str(DATA / "math_sample.jsonl")))
    p = Prompt(text="q", answer=r"\boxed{\frac{5}{6}}", family="default")
    with cf.ThreadPoolExecutor(1) as pool:
        assert pool.submit(task_kind_check.verifier, p, r"\boxed{10/12}").result() == 1.0


def test_save_to_disk_folder_and_arrow_file(tmp_path):
    import datasets

    rows = [{"question": f"{i} + 2?", "answer": f"#### {i + 2}"} for i in range(4)]
    held = [{"question": "9 + 2?", "answer": "#### 11"}]
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(held)}
    )
    dd.save_to_disk(str(tmp_path / "folder"))
    task = build_task(TaskConfig(name="gsm8k", path=str(tmp_path / "folder"), dataset_split="test"))
    assert [p.text for p in task.splits["train"]] == ["9 + 2?"]
    arrow = next((tmp_path / "folder" / "train").glob("*.arrow"))
    task = build_task(TaskConfig(name="gsm8k", path=str(arrow), heldout_every=2))
    assert [p.text for p in task.splits["heldout"]] == ["1 + 2?", "3 + 2?"]


def test_unreadable_data_files_name_the_file_and_line(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"question": "1+1", "answer": "2"}\n{"question": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(TaskError, match=rf"{bad}:2: not UTF-8 text"):
        build_task(TaskConfig(name="gsm8k", path=str(bad), answer_column="answer"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer"\n')
    with pytest.raises(TaskError, match=rf"{broken}:2: not a JSON value"):
        build_task(TaskConfig(name="gsm8k", path=str(broken)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TaskError, match=rf"{empty} is empty"):
        build_task(TaskConfig(name="gsm8k", path=str(empty)))
    no_rows = tmp_path / "none.parquet"
    import datasets

    datasets.Dataset.from_dict({"question": [], "answer": []}).to_parquet(str(no_rows))
    with pytest.raises(TaskError, match="holds no rows"):
        build_task(TaskConfig(name="gsm8k", path=str(no_rows)))
