"""The built-in arithmetic task: small integer problems with verifiable answers, for real models.

Generated and seeded; each family is a kind of problem, its difficulty set by ``task.digits``:

==============  ==========================================================  ===============
family          question (``digits`` = d)                                   default d
==============  ==========================================================  ===============
``add``         ``What is 17 + 25?``: two d-digit operands                  2
``sub``         ``What is 42 - 17?``: two d-digit operands, larger first    2
                (the answer is never negative)
``sub_signed``  ``What is 17 - 42?``: two d-digit operands in any order     2
                (the answer may be negative)
``mul``         ``What is 23 * 7?``: a d-digit by a one-digit operand        2
                (d = 1: the times table)
``count``       ``How many times does the digit 7 appear in 370717?``: a     6
                d-digit string holding the digit 1 to max(1, d // 2) times
==============  ==========================================================  ===============

A d-digit operand lies in [10^(d-1), 10^d - 1] (d = 1: 1 to 9). Small pretrained models differ
here: one may add but not multiply, another count but not subtract, and each family leaves room to
learn.

**Prompt text** (``task.prompt_style``, ``PROMPT_STYLES``): every policy gets the same text; a
policy with ``chat_template = true`` renders it as the user's turn of its own template, one
without reads it raw and continues it. ``both`` (the default) suits both kinds:
``"Question: What is 17 + 25? Answer with the number only.\\nAnswer:"``: an instruction for a chat
model, a question-answer pattern that a base model completes with `` 42``. ``instruction`` is the
bare instruction, ``completion`` the bare pattern.

**Splits**: each family's held-out set is ``task.heldout_size`` distinct problems (at most a
quarter of the family's problems) drawn with ``task.heldout_seed``, so every run seed evaluates
the same problems; its validation set is as many others (disjoint from the held-out set, at most
another quarter), for choosing settings; training never draws either. A held-out or validation
draw takes the set's problems in a seeded order, each once, and starts over only when ``n``
exceeds the set; the run's evaluation counts each distinct problem once
(``tasks.base.distinct_prompts``): a family with fewer problems than ``eval.num_prompts`` (``mul``
at one digit has 81, so 20 held out) is evaluated on those it has, with a note naming it.

**Reward**: the verifier gives 1 when ``numeric.final_answer`` of the completion equals the
answer (see ``mutualrl.tasks.numeric`` for how the answer is read in each model's style), else 0.
``number_format`` (``tasks.rewards``) adds a small weight for a completion that is only the
number: ``reward_funcs = ["correctness", "number_format"]``, ``reward_weights = [1.0, 0.1]``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mutualrl.tasks.base import TASKS, Prompt, Split, TaskError
from mutualrl.tasks.numeric import final_answer, same_number

PROMPT_STYLES = {
    "both": "Question: {question} Answer with the number only.\nAnswer:",
    "instruction": "{question} Answer with the number only.",
    "completion": "Question: {question}\nAnswer:",
}
MAX_DRAWS = 1000  # attempts per training prompt before a family counts as all held out


def _operand(rng: np.random.Generator, digits: int) -> int:
    return int(rng.integers(10 ** (digits - 1), 10**digits))


def _span(digits: int) -> int:
    """How many d-digit operands there are."""
    return 9 * 10 ** (digits - 1)


def _add(rng: np.random.Generator, d: int) -> tuple[str, int]:
    a, b = _operand(rng, d), _operand(rng, d)
    return f"What is {a} + {b}?", a + b


def _sub(rng: np.random.Generator, d: int) -> tuple[str, int]:
    a, b = sorted((_operand(rng, d), _operand(rng, d)), reverse=True)
    return f"What is {a} - {b}?", a - b


def _sub_signed(rng: np.random.Generator, d: int) -> tuple[str, int]:
    a, b = _operand(rng, d), _operand(rng, d)
    return f"What is {a} - {b}?", a - b


def _mul(rng: np.random.Generator, d: int) -> tuple[str, int]:
    a, b = _operand(rng, d), _operand(rng, 1)
    return f"What is {a} * {b}?", a * b


def _count(rng: np.random.Generator, d: int) -> tuple[str, int]:
    digit = int(rng.integers(10))
    times = int(rng.integers(1, max(1, d // 2) + 1))
    others = [x for x in range(10) if x != digit]
    while True:  # no leading zero, so the string reads as a number too
        chars = [others[i] for i in rng.integers(9, size=d)]
        for i in rng.choice(d, times, replace=False):
            chars[i] = digit
        if chars[0] != 0:
            break
    return (f"How many times does the digit {digit} appear in {''.join(map(str, chars))}?", times)


@dataclass(frozen=True)
class Family:
    draw: Callable[
        [np.random.Generator, int], tuple[str, int]
    ]  # (rng, digits) -> (question, answer)
    default_digits: int
    digit_range: tuple[int, int]  # allowed digits, inclusive
    size: Callable[[int], int]  # distinct problems at ``digits``


FAMILIES = {
    "add": Family(_add, 2, (1, 6), lambda d: _span(d) ** 2),
    "sub": Family(_sub, 2, (1, 6), lambda d: _span(d) * (_span(d) + 1) // 2),
    "sub_signed": Family(_sub_signed, 2, (1, 6), lambda d: _span(d) ** 2),
    "mul": Family(_mul, 2, (1, 6), lambda d: _span(d) * 9),
    "count": Family(_count, 6, (2, 20), lambda d: 10 ** min(d, 12)),
}
DEFAULT_FAMILIES = ("add", "sub", "mul", "count")


def _family_seed(seed: int, family: str) -> list[int]:
    """A seed for one family's held-out draw, independent of the order families are listed in."""
    return [
        seed,
        int.from_bytes(hashlib.blake2b(family.encode(), digest_size=4).digest(), "little"),
    ]


class ArithmeticTask:
    def __init__(
        self,
        families: Sequence[str] = DEFAULT_FAMILIES,
        digits: dict[str, int] | None = None,
        prompt_style: str = "both",
        heldout_size: int = 64,
        heldout_seed: int = 0,
    ) -> None:
        self.families = tuple(families) or DEFAULT_FAMILIES
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown:
            raise TaskError(
                f"task.families: unknown arithmetic families {unknown}; known: {sorted(FAMILIES)}"
            )
        self.digits = self._check_digits(digits or {})
        if prompt_style not in PROMPT_STYLES:
            raise TaskError(
                f"task.prompt_style: unknown style {prompt_style!r}; known: {sorted(PROMPT_STYLES)}"
            )
        if heldout_size < 1:
            raise TaskError(f"task.heldout_size must be >= 1, got {heldout_size}")
        self.template = PROMPT_STYLES[prompt_style]
        self.heldout = {f: self._heldout_set(f, heldout_size, heldout_seed) for f in self.families}
        self.validation = {
            f: self._heldout_set(f, heldout_size, heldout_seed, {p.text for p in self.heldout[f]})
            for f in self.families
        }
        self._held = {
            f: {p.text for p in self.heldout[f]} | {p.text for p in self.validation[f]}
            for f in self.families
        }
        self.verifier = ArithmeticVerifier()

    def _check_digits(self, digits: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(digits) - set(FAMILIES))
        if unknown:
            raise TaskError(
                f"task.digits: unknown arithmetic families {unknown}; known: {sorted(FAMILIES)}"
            )
        for family, d in digits.items():
            lo, hi = FAMILIES[family].digit_range
            if not lo <= d <= hi:
                raise TaskError(f"task.digits.{family} must be in [{lo}, {hi}], got {d}")
        return {f: digits.get(f, spec.default_digits) for f, spec in FAMILIES.items()}

    def _prompt(self, family: str, rng: np.random.Generator) -> Prompt:
        question, answer = FAMILIES[family].draw(rng, self.digits[family])
        return Prompt(
            text=self.template.format(question=question), answer=str(answer), family=family
        )

    def _heldout_set(
        self, family: str, size: int, seed: int, taken: set[str] | None = None
    ) -> list[Prompt]:
        """``size`` distinct problems (at most a quarter of the family's), in drawing order; with
        ``taken`` (the held-out set's texts) the validation set: others, from its own seed."""
        size = min(size, max(1, FAMILIES[family].size(self.digits[family]) // 4))
        key = family if taken is None else f"{family}/validation"
        rng = np.random.default_rng(_family_seed(seed, key))
        chosen: dict[str, Prompt] = {}
        for _ in range(MAX_DRAWS * size):  # half the problems at most are taken: a few draws each
            if len(chosen) == size:
                break
            p = self._prompt(family, rng)
            if taken is None or p.text not in taken:
                chosen.setdefault(p.text, p)
        return list(chosen.values())

    def sample(
        self, rng: np.random.Generator, n: int, split: Split, families: Sequence[str] | None = None
    ) -> list[Prompt]:
        fams = tuple(families) if families else self.families
        unknown = [f for f in fams if f not in self.heldout]
        if unknown:
            raise TaskError(
                f"arithmetic families {unknown} are not in this task's {list(self.families)}"
            )
        # Stratified families (round robin from a random start), as in the pointer task.
        start = int(rng.integers(len(fams)))
        order = [fams[(start + i) % len(fams)] for i in range(n)]
        if split == "heldout":
            return self._set_draw(self.heldout, rng, order)
        if split == "validation":
            return self._set_draw(self.validation, rng, order)
        return [self._train_prompt(f, rng) for f in order]

    def _set_draw(
        self, sets: dict[str, list[Prompt]], rng: np.random.Generator, order: list[str]
    ) -> list[Prompt]:
        perms = {f: rng.permutation(len(sets[f])) for f in dict.fromkeys(order)}
        taken = dict.fromkeys(perms, 0)
        out = []
        for f in order:
            perm = perms[f]
            out.append(sets[f][perm[taken[f] % len(perm)]])
            taken[f] += 1
        return out

    def _train_prompt(self, family: str, rng: np.random.Generator) -> Prompt:
        for _ in range(MAX_DRAWS):
            p = self._prompt(family, rng)
            if p.text not in self._held[family]:
                return p
        raise TaskError(
            f"arithmetic family {family!r}: no training problem left outside the held-out and "
            "validation sets"
        )

    def demonstration(self, prompt: Prompt) -> str:
        return " " + prompt.answer


class ArithmeticVerifier:
    """Reward 1 when the number the completion states (``numeric.final_answer``) is the answer."""

    verifier_id = "arithmetic-answer"
    version = 1

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if same_number(final_answer(completion, prompt.text), prompt.answer) else 0.0


@TASKS.register("arithmetic")
def _make_arithmetic(cfg) -> ArithmeticTask:
    return ArithmeticTask(
        families=cfg.families or DEFAULT_FAMILIES,
        digits=dict(cfg.digits),
        prompt_style=cfg.prompt_style,
        heldout_size=cfg.heldout_size,
        heldout_seed=cfg.heldout_seed,
    )
