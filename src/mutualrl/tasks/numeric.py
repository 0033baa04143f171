"""The number a free-form completion states as its answer, for tasks with integer answers.

Small pretrained models answer "What is 17 + 25?" in many styles: ``42``, ``42.``, ``**42**``,
``\\boxed{42}``, ``The answer is 42``, ``17 + 25 = 42.``, and a base model goes on with a new
question of its own. ``final_answer(completion, question)`` takes the answer as follows:

1. **Cut.** The text ends at the first chat-turn token (``<|im_end|>``, ``<end_of_turn>``, ...)
   and before the first line that starts a new question or turn (``Question:``, ``Q:``,
   ``Problem:``, ``Example:``, ``User:``, ``What is``, ``How many``, ...). A first line that
   restates the question (it holds every number of the question) is kept. A line starting with
   ``Answer:`` or ``A:`` once an answer is stated also ends it (``42\nAnswer: 7``: a base model
   repeating the pattern).
2. **Boxed.** With a ``\\boxed{...}``, the answer is that of its content (rules 3-4 on the last
box).
3. **Marker.** Otherwise the last ``=``, ``equals``, ``answer is``/``answer:`` or
   ``result is``/``result:`` followed on its line by a number that is not an operand: the first such
   number
   after it. ``17 + 25 = 32`` is judged by 32.
4. **First sentence.** Otherwise the first sentence (lines split at ``.``/``!``/``?``) holding a
   number that is not an operand: its last such number that is not a restatement of a number of
   the question (one occurrence of each question number is set aside); if all restate one, the
   last of them. ``The digit 7 appears 3 times in 370717`` gives 3.

An *operand* is a number joined to another by ``+``, ``-``, ``*``, ``x``, ``×``, ``/``, ``plus``,
``minus``, ``times``, ``multiplied by`` or ``divided by``, or followed by ``+``, ``-``, ``*``,
``x``,
``×`` or ``/`` at the end of its line (a cut-off ``17 +``): ``17 + 25`` alone states no answer (not
25). Numbers keep a leading minus where it is a sign (``-5``, ``= -8``), not a subtraction
(``17-25``); thousands separators are dropped (``1,234`` is 1234). No number: no answer.

``clean_number(completion)`` says whether the whole completion is one number and nothing else
(``42``, ``-5``, ``1,234``, ``42.``, ``**42**``, ``\\boxed{42}``): the ``number_format`` reward.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

from mutualrl.tasks.answers import last_boxed

MINUSES = "-\u2212"  # ASCII hyphen-minus and the Unicode minus sign
_NUMBER = re.compile(r"(?<![\d.])([-\u2212]?)(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")
_OPERATOR = r"(?:[-+*/x\u00d7\u00f7\u00b7\u2212]|plus|minus|times|multiplied by|divided by)"
_LEFT_OPERAND = re.compile(rf"(?:\d|\))\s*{_OPERATOR}\s*\(?\s*$", re.IGNORECASE)
# "17 +" at the end of a cut-off completion is an operand too; "3 times in" is not
_RIGHT_OPERAND = re.compile(
    rf"^\s*\)?\s*(?:{_OPERATOR}\s*\(?\s*[-\u2212]?\d|[-+*/x\u00d7\u00f7\u2212]\s*$)", re.IGNORECASE
)
_MARKER = re.compile(
    r"=|\bequals?\b|\bis equal to\b|\banswer\s*(?:is\b|:)|\bresult\s*(?:is\b|:)", re.IGNORECASE
)
_TURN_END = re.compile(
    r"<\|im_end\|>|<\|im_start\|>|<end_of_turn>|<start_of_turn>|<\|endoftext\|>"
    r"|<eos>|</s>"
)
_NEW_QUESTION = re.compile(
    r"^[\s#*>_]*(?:(?:question|q|problem|example|exercise|user|human)"
    r"\s*\d*\s*[:.)]|what is\b|how many\b)",
    re.IGNORECASE,
)
_NEW_ANSWER = re.compile(r"^[\s#*>_]*(?:answer|a)\s*:", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_CLEAN = re.compile(r"[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_WRAPPERS = (
    re.compile(r"^\*\*(.*)\*\*$", re.S),
    re.compile(r"^\\boxed\{(.*)\}$", re.S),
    re.compile(r"^\$(.*)\$$", re.S),
)


def numbers_in(text: str) -> list[tuple[int, int, str]]:
    """Every number of ``text`` as (start, end, normalised value): signs kept where they are
    signs, thousands separators dropped, the Unicode minus made ASCII."""
    out = []
    for m in _NUMBER.finditer(text):
        sign, start = m.group(1), m.start()
        before = text[start - 1] if start > 0 else ""
        if sign and (before.isalnum() or before == ")"):  # "17-25": a subtraction, not -25
            sign, start = "", start + 1
        value = ("-" if sign else "") + m.group(2).replace(",", "") + (m.group(3) or "")
        out.append((start, m.end(), value))
    return out


def _is_operand(line: str, start: int, end: int) -> bool:
    return bool(_LEFT_OPERAND.search(line[:start]) or _RIGHT_OPERAND.match(line[end:]))


def _answers(line: str) -> list[tuple[int, str]]:
    """(start, value) of the numbers of ``line`` that are not operands."""
    return [(s, v) for s, e, v in numbers_in(line) if not _is_operand(line, s, e)]


def answer_region(completion: str, question: str = "") -> str:
    """The part of ``completion`` that answers (rule 1 of the module's docstring)."""
    text = _TURN_END.split(completion, maxsplit=1)[0]
    asked = Counter(v for _, _, v in numbers_in(question))
    kept: list[str] = []
    for line in text.split("\n"):
        if _NEW_QUESTION.match(line):
            # the first line may restate the question (all its numbers), then answer it
            restates = (
                bool(asked)
                and not any(k.strip() for k in kept)
                and not asked - Counter(v for _, _, v in numbers_in(line))
            )
            if not restates:
                break
        # a base model repeats the pattern: "42\nAnswer: 7\nAnswer: 9"; its first answer counts
        if _NEW_ANSWER.match(line) and _answer_in("\n".join(kept), question) is not None:
            break
        kept.append(line)
    return "\n".join(kept)


def _after_marker(region: str) -> str | None:
    for marker in reversed(list(_MARKER.finditer(region))):
        line_end = region.find("\n", marker.end())
        rest = region[marker.end() :] if line_end < 0 else region[marker.end() : line_end]
        found = _answers(rest)
        if found:
            return found[0][1]
    return None


def _first_sentence(region: str, question: str) -> str | None:
    asked = Counter(v for _, _, v in numbers_in(question))
    for line in region.split("\n"):
        for sentence in _SENTENCE_END.split(line):
            found = [v for _, v in _answers(sentence)]
            if not found:
                continue
            left, fresh = asked.copy(), []
            for v in found:
                if left[v] > 0:
                    left[v] -= 1
                else:
                    fresh.append(v)
            return (fresh or found)[-1]
    return None


def _answer_in(region: str, question: str) -> str | None:
    return _after_marker(region) or _first_sentence(region, question)


def final_answer(completion: str, question: str = "") -> str | None:
    """The number ``completion`` states as its answer to ``question`` (see the module's
    docstring), as a plain decimal string (``"1234"``, ``"-5"``), or None."""
    region = answer_region(completion, question)
    boxed = last_boxed(region)
    if boxed is not None:
        return _answer_in(boxed, question)
    return _answer_in(region, question)


def same_number(got: str | None, want: str) -> bool:
    """``got`` (a ``final_answer``) equals the reference ``want`` exactly (``42.0`` is 42)."""
    return got is not None and Fraction(got) == Fraction(want)


def clean_number(completion: str) -> bool:
    """The whole completion is one number, optionally bold, boxed or in ``$``, with at most a
    final period."""
    s = completion.strip().removesuffix(".").strip()
    for _ in range(2):  # "$\\boxed{42}$", "**\\boxed{42}**"
        for wrapper in _WRAPPERS:
            m = wrapper.match(s)
            if m:
                s = m.group(1).strip()
    return _CLEAN.fullmatch(s) is not None
