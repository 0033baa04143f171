"""The pointer task: answers per family, split disjointness, one-token words in both tokenizers."""

from __future__ import annotations

import numpy as np
import pytest

from mutualrl.config import TaskConfig
from mutualrl.tasks import TASKS, TaskError, build_task
from mutualrl.tasks.base import Prompt
from mutualrl.tasks.pointer import POSITIONS, WORDS, ExactMatchVerifier, PointerTask


def words_of(prompt: Prompt) -> tuple[str, ...]:
    family, rest = prompt.text.split(": ", 1)
    assert family == prompt.family
    assert rest.endswith(" =")
    return tuple(rest[:-2].split(" "))


@pytest.mark.parametrize("family", sorted(POSITIONS))
def test_answers_are_the_word_at_the_family_position(family):
    task = PointerTask(families=(family,), num_words=5)
    prompts = task.sample(np.random.default_rng(0), 50, "train")
    index = {"first": 0, "second": 1, "third": 2, "last": 4}[family]
    for p in prompts:
        words = words_of(p)
        assert len(words) == 5 and len(set(words)) == 5
        assert p.family == family
        assert p.answer == " " + words[index]
        assert task.demonstration(p) == p.answer
        assert task.verifier(p, task.demonstration(p)) == 1.0


def test_hand_example():
    p = Prompt(text="last: cat dog sun tree =", answer=" tree", family="last")
    v = ExactMatchVerifier()
    assert v(p, " tree") == 1.0
    assert v(p, "tree\n") == 1.0  # surrounding white space is ignored
    assert v(p, " Tree") == 0.0
    assert v(p, " tree dog") == 0.0
    assert v(p, " cat") == 0.0
    assert v(p, "") == 0.0


def test_families_are_drawn_from_the_requested_ones():
    task = PointerTask(families=("first", "last"))
    prompts = task.sample(np.random.default_rng(1), 200, "train")
    assert {p.family for p in prompts} == {"first", "last"}
    only = task.sample(np.random.default_rng(1), 20, "train", families=["last"])
    assert {p.family for p in only} == {"last"}


def test_heldout_and_train_splits_are_disjoint():
    task = PointerTask(num_words=3)
    train = {words_of(p) for p in task.sample(np.random.default_rng(2), 3000, "train")}
    heldout = {words_of(p) for p in task.sample(np.random.default_rng(3), 400, "heldout")}
    assert len(heldout) > 100 and len(train) > 1000  # many distinct tuples were compared
    assert not train & heldout


def test_sampling_is_deterministic_in_the_rng():
    task = PointerTask()
    a = task.sample(np.random.default_rng(7), 30, "train")
    b = task.sample(np.random.default_rng(7), 30, "train")
    c = task.sample(np.random.default_rng(8), 30, "train")
    assert a == b
    assert a != c


@pytest.mark.parametrize("name", ["mistral-v1", "deepseek-v3"])
def test_every_word_is_one_token_with_a_leading_space(tokenizer_handles, name):
    tok = tokenizer_handles[name].tokenizer
    # as a continuation after "=" (how completions are tokenised) and after "first:" (prompts)
    for word in WORDS:
        base = tok("=", add_special_tokens=False)["input_ids"]
        both = tok("=" + " " + word, add_special_tokens=False)["input_ids"]
        assert both[: len(base)] == base, word
        assert len(both) - len(base) == 1, (name, word, both)
        ids = tok(" " + word, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids).strip() == word


def test_words_are_distinct():
    assert len(set(WORDS)) == len(WORDS)


def test_bad_families_and_word_counts_raise():
    with pytest.raises(TaskError, match="unknown pointer families"):
        PointerTask(families=("middle",))
    with pytest.raises(TaskError, match="num_words"):
        PointerTask(num_words=1)
    with pytest.raises(TaskError, match="num_words"):
        PointerTask(num_words=len(WORDS) + 1)


def test_built_from_config_through_the_registry():
    task = build_task(TaskConfig(name="pointer", families=["second"], num_words=3))
    assert isinstance(task, PointerTask)
    assert task.families == ("second",)
    assert TASKS.get("pointer") is not None
    default = build_task(TaskConfig())
    assert default.families == ("first", "last")
