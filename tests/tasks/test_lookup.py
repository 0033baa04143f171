"""The lookup task: fixed tables per family, disjoint words, split disjointness, one-token words."""

from __future__ import annotations

import numpy as np
import pytest

from mutualrl.config import TaskConfig
from mutualrl.tasks import TaskError, build_task
from mutualrl.tasks.lookup import FACT_WORDS, MAX_KEYS, LookupTask, table
from mutualrl.tasks.pointer import WORDS as CONTEXT_WORDS


def test_answers_are_the_family_table_value_of_the_last_word():
    task = LookupTask(families=("alpha", "beta"), num_words=4, num_keys=8)
    prompts = task.sample(np.random.default_rng(0), 80, "train")
    assert {p.family for p in prompts} == {"alpha", "beta"}
    for p in prompts:
        *context, key, eq = p.text.split(" ")
        assert eq == "=" and len(context) == 3 and set(context) <= set(CONTEXT_WORDS)
        assert p.answer == " " + table(p.family, 8)[key]
        assert task.verifier(p, task.demonstration(p)) == 1.0


def test_hand_example():
    assert table("alpha", 2) == {"apple": "snake", "bread": "salt"}
    task = LookupTask(families=("alpha",), num_keys=2)
    p = task.sample(np.random.default_rng(0), 1, "train")[0]
    assert p.text.split(" ")[-2] in ("apple", "bread")


def test_families_share_no_word_and_use_no_context_word():
    words = [w for ws in FACT_WORDS.values() for w in ws]
    assert len(set(words)) == len(words)
    assert not set(words) & set(CONTEXT_WORDS)
    for family in FACT_WORDS:
        t = table(family, MAX_KEYS)
        assert len(t) == MAX_KEYS and not set(t) & set(t.values())


def test_a_policy_taught_one_table_never_sees_another_tables_values():
    # The property the compare rests on: no alpha prompt or answer contains a beta value.
    task = LookupTask(families=("alpha", "beta"), num_keys=8)
    beta_values = set(table("beta", 8).values())
    for p in task.sample(np.random.default_rng(4), 200, "train", families=["alpha"]):
        assert not set((p.text + p.answer).split()) & beta_values


def test_heldout_and_train_splits_are_disjoint_and_cover_every_key():
    task = LookupTask(num_keys=4, num_words=3)
    train = {p.text for p in task.sample(np.random.default_rng(2), 3000, "train")}
    heldout = task.sample(np.random.default_rng(3), 400, "heldout")
    assert not train & {p.text for p in heldout}
    keys = {p.text.split(" ")[-2] for p in heldout}
    assert keys == {k for f in ("alpha", "beta") for k in table(f, 4)}


def test_sampling_is_deterministic_in_the_rng():
    task = LookupTask()
    assert task.sample(np.random.default_rng(7), 30, "train") == task.sample(
        np.random.default_rng(7), 30, "train"
    )
    assert task.sample(np.random.default_rng(7), 30, "train") != task.sample(
        np.random.default_rng(8), 30, "train"
    )


@pytest.mark.parametrize("name", ["mistral-v1", "deepseek-v3"])
def test_every_fact_word_is_one_token_with_a_leading_space(tokenizer_handles, name):
    tok = tokenizer_handles[name].tokenizer
    base = tok("=", add_special_tokens=False)["input_ids"]
    for word in (w for ws in FACT_WORDS.values() for w in ws):
        both = tok("= " + word, add_special_tokens=False)["input_ids"]
        assert both[: len(base)] == base and len(both) - len(base) == 1, (name, word, both)


def test_bad_parameters_raise_naming_the_field():
    with pytest.raises(TaskError, match="unknown lookup families"):
        LookupTask(families=("first",))
    with pytest.raises(TaskError, match="num_keys"):
        LookupTask(num_keys=MAX_KEYS + 1)
    with pytest.raises(TaskError, match="num_words"):
        LookupTask(num_words=1)
    with pytest.raises(TaskError, match="not in this task"):
        LookupTask(families=("alpha",)).sample(
            np.random.default_rng(0), 2, "train", families=["beta"]
        )


def test_built_from_config():
    task = build_task(TaskConfig(name="lookup", families=["beta", "gamma"], num_keys=3))
    assert task.families == ("beta", "gamma") and len(task.tables["gamma"]) == 3
