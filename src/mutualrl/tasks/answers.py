"""Final answers of math problems: extraction (GSM8K ``#### N``, MATH ``\\boxed{...}``) and
equality.

``math_equal`` uses ``math-verify`` (optional: ``pip install mutualrl[math]``) when it is
installed, else the fallback normaliser below. The fallback is deliberately simple and documented
so a reward is never a mystery:

1. strip white space, ``$``, ``\\left``/``\\right``, ``\\!``/``\\,``/``\\;`` spacing, ``^\\circ``,
   ``\\text{...}`` wrappers (kept content) and one trailing period;
2. ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``\\frac12`` -> ``\\frac{1}{2}``;
3. equal strings are equal; otherwise both sides are read as numbers when they are a plain
   number (``1,000`` ``-0.50`` ``.5``), a fraction ``a/b``, ``\\frac{a}{b}`` or a percentage, and
   compared exactly (``fractions.Fraction``). Anything else (intervals, matrices, expressions)
   counts only when the normalised strings agree.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_hash_answer(text: str) -> str | None:
    """GSM8K: the number after the last ``####``; without one, the last number in ``text``."""
    tail = text.rsplit("####", 1)[-1] if "####" in text else text
    found = _NUMBER.findall(tail)
    return found[-1].replace(",", "").rstrip(".") if found else None


def gsm8k_equal(completion: str, reference: str) -> bool:
    got, want = extract_hash_answer(completion), extract_hash_answer(reference)
    if got is None or want is None:
        return False
    return Fraction(got) == Fraction(want)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if
    absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: no answer rather than a guess


_STRIP = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", "$", "^\\circ", "^{\\circ}", " ")


def normalise(answer: str) -> str:
    s = answer.strip()
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    for token in _STRIP:
        s = s.replace(token, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    return s.rstrip(".")


def _as_number(s: str) -> Fraction | None:
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    percent = s.endswith(r"\%") or s.endswith("%")
    s = s.removesuffix(r"\%").removesuffix("%")
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(
        r"(-?)(-?\d+)/(-?\d+)", s
    )
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
        elif re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", s):
            value = Fraction(s)
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def fallback_equal(got: str, want: str) -> bool:
    a, b = normalise(got), normalise(want)
    if a == b:
        return bool(a)
    x, y = _as_number(a), _as_number(b)
    return x is not None and x == y


def _math_verify_equal(got: str, want: str) -> bool | None:
    """math-verify's verdict, or None when it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    # Timeouts off: they use signal.alarm, which fails outside the main thread; the
    # GuardedVerifier around every reward function bounds the time instead.
    gold = parse(f"${want}$", parsing_timeout=None)
    pred = parse(f"${got}$", parsing_timeout=None)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def math_equal(got: str, want: str, use_math_verify: bool = True) -> bool:
    if use_math_verify:
        verdict = _math_verify_equal(got, want)
        if verdict is not None:
            return verdict or fallback_equal(got, want)
    return fallback_equal(got, want)


def math_reference(solution: str) -> str:
    """The final answer of a MATH reference: its last ``\\boxed{}``, or the text itself."""
    boxed = last_boxed(solution)
    return boxed if boxed is not None else solution.strip()
