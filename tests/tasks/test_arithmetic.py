"""The arithmetic task: seeded, disjoint splits, families, answer reading in real models' styles,
rewards and config errors."""

from __future__ import annotations

import re

import msgspec
import numpy as np
import pytest

from mutualrl.config import ConfigError, TaskConfig, load_config
from mutualrl.tasks import TASKS, TaskError, build_task
from mutualrl.tasks.arithmetic import FAMILIES, PROMPT_STYLES, ArithmeticTask
from mutualrl.tasks.base import Prompt
from mutualrl.tasks.numeric import clean_number, final_answer
from mutualrl.tasks.rewards import REWARD_FUNCS, WeightedReward

QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
COUNT = re.compile(r"How many times does the digit (\d) appear in (\d+)\?")


def solve(text: str) -> int:
    """The answer of a generated question, worked out from its text alone."""
    if m := QUESTION.search(text):
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    m = COUNT.search(text)
    return m.group(2).count(m.group(1))


def test_registered_and_built_from_config():
    assert "arithmetic" in TASKS.names()
    task = build_task(TaskConfig(name="arithmetic"))
    assert task.families == ("add", "sub", "mul", "count")
    task = build_task(
        TaskConfig(
            name="arithmetic",
            families=["mul"],
            digits={"mul": 1},
            prompt_style="completion",
            heldout_size=10,
            heldout_seed=3,
        )
    )
    p = task.sample(np.random.default_rng(0), 1, "train")[0]
    assert re.fullmatch(r"Question: What is [1-9] \* [1-9]\?\nAnswer:", p.text)
    assert len(task.heldout["mul"]) == 10


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_answers_its_question(family):
    task = ArithmeticTask(families=(family,))
    prompts = task.sample(np.random.default_rng(0), 200, "train")
    assert {p.family for p in prompts} == {family}
    for p in prompts:
        assert int(p.answer) == solve(p.text)
        assert task.demonstration(p) == " " + p.answer
        assert task.verifier(p, task.demonstration(p)) == 1.0
        assert task.verifier(p, f" {int(p.answer) + 1}") == 0.0
    answers = [int(p.answer) for p in prompts]
    if family == "sub":
        assert min(answers) >= 0
    if family == "sub_signed":
        assert min(answers) < 0 < max(answers)
    if family == "count":  # a 6-digit string holds the digit 1 to 3 times, all three seen
        assert set(answers) == {1, 2, 3}
        assert all(len(COUNT.search(p.text).group(2)) == 6 for p in prompts)


@pytest.mark.parametrize(
    "family, digits, pattern",
    [
        ("add", 1, r"What is [1-9] \+ [1-9]\?"),
        ("add", 3, r"What is [1-9]\d\d \+ [1-9]\d\d\?"),
        ("sub", 2, r"What is [1-9]\d - [1-9]\d\?"),
        ("mul", 2, r"What is [1-9]\d \* [1-9]\?"),
        ("mul", 1, r"What is [1-9] \* [1-9]\?"),
        ("count", 4, r"How many times does the digit \d appear in [1-9]\d{3}\?"),
    ],
)
def test_digits_set_the_operand_sizes(family, digits, pattern):
    task = ArithmeticTask(families=(family,), digits={family: digits}, prompt_style="instruction")
    for p in task.sample(np.random.default_rng(1), 50, "train"):
        assert re.fullmatch(pattern + " Answer with the number only.", p.text), p.text


def test_same_seed_same_prompts_and_heldout_set_is_fixed_by_heldout_seed():
    a, b = ArithmeticTask(), ArithmeticTask()

    def draw(t, seed, split):
        return [
            (p.text, p.answer, p.family) for p in t.sample(np.random.default_rng(seed), 40, split)
        ]

    assert draw(a, 7, "train") == draw(b, 7, "train")
    assert draw(a, 7, "train") != draw(a, 8, "train")
    # The held-out set does not depend on the run's generator, only on heldout_seed.
    assert a.heldout == b.heldout
    other = ArithmeticTask(heldout_seed=1)
    assert {p.text for p in other.heldout["add"]} != {p.text for p in a.heldout["add"]}


def test_heldout_draw_is_the_fixed_set_without_repeats():
    task = ArithmeticTask(families=("add", "count"), heldout_size=64)
    for family in ("add", "count"):
        got = task.sample(np.random.default_rng(5), 64, "heldout", [family])
        texts = [p.text for p in got]
        assert len(set(texts)) == 64  # distinct prompts
        assert set(texts) == {p.text for p in task.heldout[family]}  # the whole set
        again = task.sample(np.random.default_rng(5), 64, "heldout", [family])
        assert texts == [p.text for p in again]  # every evaluation sees the same order
    # Past the set's size it starts over, in the same order.
    over = [p.text for p in task.sample(np.random.default_rng(5), 130, "heldout", ["add"])]
    assert over[64:128] == over[:64]


def test_train_validation_and_heldout_are_disjoint():
    task = ArithmeticTask(families=("add", "mul"), digits={"add": 1, "mul": 1}, heldout_size=64)
    # Small spaces: 81 problems each, so at most a quarter (20) is held out, another validates.
    held = {p.text for f in task.families for p in task.heldout[f]}
    valid = {p.text for f in task.families for p in task.validation[f]}
    assert len(held) == 40 and len(valid) == 40 and not held & valid
    train = {p.text for p in task.sample(np.random.default_rng(0), 3000, "train")}
    assert len(train) == 2 * 81 - 80  # every other problem is trained on
    assert not train & held and not train & valid
    drawn = task.sample(np.random.default_rng(5), 20, "validation", ["mul"])
    assert {p.text for p in drawn} == {p.text for p in task.validation["mul"]}  # each once
    # the validation set is fixed by heldout_seed, as the held-out set is
    assert (
        ArithmeticTask(families=("add",)).validation["add"]
        == ArithmeticTask(families=("add",)).validation["add"]
    )


def test_families_are_stratified_and_restricted():
    task = ArithmeticTask()
    prompts = task.sample(np.random.default_rng(2), 8, "train")
    fams = [p.family for p in prompts]
    assert sorted(fams) == sorted(["add", "sub", "mul", "count"] * 2)
    only = task.sample(np.random.default_rng(2), 10, "train", families=["count"])
    assert {p.family for p in only} == {"count"}
    with pytest.raises(TaskError, match="not in this task"):
        ArithmeticTask(families=("add",)).sample(np.random.default_rng(0), 2, "train", ["mul"])


@pytest.mark.parametrize("style", sorted(PROMPT_STYLES))
def test_prompt_styles(style):
    p = ArithmeticTask(families=("add",), prompt_style=style).sample(
        np.random.default_rng(0), 1, "train"
    )[0]
    question = QUESTION.search(p.text).group(0)
    assert p.text == PROMPT_STYLES[style].format(question=question)
    assert p.prefill == ""  # the hint strategy owns prefill
    assert p.text.endswith("Answer:") == (style != "instruction")


Q = "Question: What is 17 + 25? Answer with the number only.\nAnswer:"
EXTRACT = [
    # chat-model and base-model styles of a right answer
    ("42", "42"),
    (" 42", "42"),
    ("42.", "42"),
    ("The answer is 42", "42"),
    ("17 + 25 = 42.", "42"),
    (r"\boxed{42}", "42"),
    (r"$\boxed{42}$", "42"),
    ("**42**", "42"),
    ("The answer is: **42**", "42"),
    ("**Answer:** 42", "42"),
    ("Answer: 42", "42"),
    ("The sum of 17 and 25 is 42.", "42"),
    ("17 plus 25 equals 42", "42"),
    ("17 + 25 = 40 + 2 = 42", "42"),
    ("42.0", "42.0"),
    ("To add them: 7 + 5 = 12, carry 1.\nSo the answer is 42.", "42"),
    (r"We get \boxed{17 + 25 = 42}", "42"),
    # a wrong answer stated after the operands is judged by the answer, not the operands
    ("17 + 25 = 32", "32"),
    ("17 + 25 = 32.", "32"),
    ("17+25=32", "32"),
    # operands alone state no answer
    ("17 + 25", None),
    ("17 + 25 =", None),
    ("x = 17 + 25", None),
    ("17 + 25 = ?", None),
    ("", None),
    ("no idea", None),
    # an answer on the next line after an unfinished equation
    ("17 + 25 = ?\n42", "42"),
    # signs and separators
    ("-5", "-5"),
    ("17 - 25 = -8", "-8"),
    ("17-25=-8", "-8"),
    ("17-25", None),
    ("1,234", "1234"),
    ("The answer is 1,234.", "1234"),
    ("\u22125", "-5"),
    # a base model's ramble: a new question ends the answer
    (" 42\n\nQuestion: What is 3 + 4?\nAnswer: 7", "42"),
    (" 42\nQ: 3 + 4 = 7", "42"),
    (" 42\n\nWhat is 3 + 4? 7", "42"),
    ("\nQuestion: What is 3 + 4?\nAnswer: 7", None),
    ("42<|im_end|>\nAnswer: 7", "42"),
    (" 30<eos>", "30"),
    # a base model repeating the answer pattern: its first answer counts; a cut-off "17 +" is an
    # operand
    (" 42\nAnswer: 7\nAnswer: 9", "42"),
    ("Let me see.\nAnswer: 42", "42"),
    (" 17 + 25 = 17 +", None),
    # a first line restating the question is not a new question
    ("Question: What is 17 + 25?\nAnswer: 42", "42"),
    ("What is 17 + 25? It is 42.", "42"),
    # the first sentence with an answer decides, not a later one
    ("42\nExplanation: 17 + 25 makes 43", "42"),
    ("It is 42. Then 3 more is 45", "42"),
]


@pytest.mark.parametrize("completion, want", EXTRACT)
def test_final_answer(completion, want):
    assert final_answer(completion, Q) == want


# Greedy completions of SmolLM2-135M-Instruct (its chat template) and Gemma 3 270M (raw text) to
# this task's "both" prompts, as they came (transformers 5.24, the packages' GGUF files, fp32).
SMOL, GEMMA = "smollm2", "gemma3"
RECORDED = [
    (SMOL, "What is 98 + 78?", "98 + 78 = 166\n\nThis is a classic example of how", "166"),
    (SMOL, "What is 43 + 20?", "43 + 20 = 63", "63"),
    (SMOL, "What is 7 * 4?", "7 * 4 = 28\n\nThe answer is 28.", "28"),
    (SMOL, "What is 91 * 3?", "91 * 3 = 273.", "273"),
    (
        SMOL,
        "How many times does the digit 7 appear in 274370?",
        "7 * 274370 = 19327\n\nThe answer",
        "19327",
    ),
    (
        SMOL,
        "How many times does the digit 8 appear in 589885?",
        "The digit 8 appears in 589885, which is 8 times.",
        "8",
    ),
    (
        SMOL,
        "How many times does the digit 1 appear in 136034?",
        "136034 is a multiple of 13, so it has a remainder of",
        "13",
    ),
    (GEMMA, "What is 90 + 98?", " 90 + 98 = 188\nAnswer: 90 + ", "188"),
    (GEMMA, "What is 94 + 36?", " 100 + 36 = 114\nAnswer: 100", "114"),
    (GEMMA, "What is 43 + 20?", " 43 + 20 = 43 + 20 = 43 +", None),
    (GEMMA, "What is 88 - 27?", " 88 - 27 = 100 - 27 = 75", "75"),
    (GEMMA, "What is 68 - 41?", " 68 - 41 = 41 - 68 = 17 -", None),
    (GEMMA, "What is 61 - 67?", " 61 - 67 = 61 + 67 = 133", "133"),
    (GEMMA, "What is 7 * 4?", " 4\nQuestion: What is 4 * 2? Answer with the number only.\n", "4"),
    (GEMMA, "What is 4 * 5?", " 4 * 5 = 20\nQuestion: What is 4 * 5?", "20"),
    (GEMMA, "What is 76 * 2?", " 76\nAnswer: 2\nAnswer: 2\nAnswer: 2\nAnswer", "76"),
    (
        GEMMA,
        "How many times does the digit 7 appear in 274370?",
        " 1\nAnswer: 2\nAnswer: 3\nAnswer: 4\nAnswer:",
        "1",
    ),
]


@pytest.mark.parametrize("model, question, completion, want", RECORDED)
def test_final_answer_of_recorded_completions(model, question, completion, want):
    prompt = PROMPT_STYLES["both"].format(question=question)
    assert final_answer(completion, prompt) == want


@pytest.mark.parametrize(
    "completion, want",
    [
        ("3", "3"),
        ("The digit 7 appears 3 times in 370717.", "3"),
        ("3 times", "3"),
        ("It appears 3 times.", "3"),
        ("7 appears in 370717 three times", "370717"),
    ],
)  # no number but the question's: the last
def test_count_answers_skip_the_question_numbers(completion, want):
    q = "How many times does the digit 7 appear in 370717?"
    assert final_answer(completion, q) == want


def test_count_answer_equal_to_the_asked_digit():
    q = "How many times does the digit 2 appear in 212345?"
    assert final_answer("2", q) == "2"
    assert final_answer("The digit 2 appears 2 times in 212345.", q) == "2"


def test_verifier_rewards_only_the_right_number():
    p = Prompt(text=Q, answer="42", family="add")
    v = ArithmeticTask().verifier
    right = [
        "42",
        "The answer is 42",
        "17 + 25 = 42.",
        r"\boxed{42}",
        "**42**",
        "42\nQuestion: 1 + 1?",
    ]
    wrong = ["17 + 25 = 32", "17 + 25", "25", "4 2", "420", "-42", "", "42.5"]
    assert [v(p, c) for c in right] == [1.0] * len(right)
    assert [v(p, c) for c in wrong] == [0.0] * len(wrong)
    neg = Prompt(text="What is 17 - 22?", answer="-5", family="sub_signed")
    assert v(neg, "-5") == v(neg, "17 - 22 = -5") == 1.0 and v(neg, "5") == 0.0
    big = Prompt(text="What is 617 * 2?", answer="1234", family="mul")
    assert v(big, "1,234") == v(big, "617 * 2 = 1234") == 1.0


@pytest.mark.parametrize(
    "completion, clean",
    [
        ("42", True),
        (" 42\n", True),
        ("42.", True),
        ("-5", True),
        ("1,234", True),
        ("**42**", True),
        (r"\boxed{42}", True),
        (r"$\boxed{42}$", True),
        ("The answer is 42", False),
        ("17 + 25 = 42", False),
        ("42\nQuestion: What is 3 + 4?", False),
        ("42 apples", False),
        ("", False),
        ("4 2", False),
    ],
)
def test_clean_number(completion, clean):
    assert clean_number(completion) is clean


def test_weighted_reward_correct_plus_small_format_bonus():
    task = ArithmeticTask()
    reward = WeightedReward(task, ["correctness", "number_format"], [1.0, 0.1], timeout_s=5.0)
    p = Prompt(text=Q, answer="42", family="add")
    try:
        assert reward.score(p, " 42") == (
            pytest.approx(1.1),
            {"correctness": 1.0, "number_format": 1.0},
        )
        assert reward(p, "17 + 25 = 42.") == 1.0
        assert reward(p, " 32") == pytest.approx(0.1)
        assert reward(p, "17 + 25 = 32") == 0.0
    finally:
        reward.close()
    assert "number_format" in REWARD_FUNCS.names()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"families": ("add", "div")},
            r"^task\.families: unknown arithmetic families \['div'\]; known: ",
        ),
        ({"digits": {"pow": 2}}, r"^task\.digits: unknown arithmetic families \['pow'\]"),
        ({"digits": {"add": 0}}, r"^task\.digits\.add must be in \[1, 6\], got 0$"),
        ({"digits": {"count": 1}}, r"^task\.digits\.count must be in \[2, 20\], got 1$"),
        ({"prompt_style": "chat"}, r"^task\.prompt_style: unknown style 'chat'; known: "),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(TaskError, match=message) as err:
        ArithmeticTask(**kwargs)
    assert "\n" not in str(err.value)


def test_config_fields_parse_and_are_checked(tmp_path):
    cfg = load_config(
        "configs/tiny.toml",
        [
            'task.name="arithmetic"',
            'task.families=["add", "count"]',
            "task.digits={add = 1, count = 4}",
            "task.heldout_size=32",
        ],
    )
    task = build_task(cfg.task)
    assert (
        task.families == ("add", "count") and task.digits["add"] == 1 and task.digits["count"] == 4
    )
    assert len(task.heldout["add"]) == 20 and len(task.heldout["count"]) == 32
    with pytest.raises(ConfigError, match="heldout_size must be >= 1"):
        load_config("configs/tiny.toml", ["task.heldout_size=0"])
    with pytest.raises((ConfigError, msgspec.ValidationError), match="digits"):
        load_config("configs/tiny.toml", ['task.digits={add = "two"}'])
