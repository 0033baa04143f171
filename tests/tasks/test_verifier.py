"""GuardedVerifier: failures, time-outs and non-finite rewards give 0 and are counted."""

from __future__ import annotations

import time

import pytest

from mutualrl.tasks import GuardedVerifier, Prompt

PROMPT = Prompt(text="first: cat dog =", answer=" cat", family="first")


class Const:
    verifier_id, version = "const", 1

    def __init__(self, value):
        self.value = value

    def __call__(self, prompt, completion):
        return self.value


class Raises:
    verifier_id, version = "raises", 1

    def __call__(self, prompt, completion):
        raise RuntimeError("boom")


class Sleeps:
    verifier_id, version = "sleeps", 1

    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, prompt, completion):
        time.sleep(self.seconds)
        return 1.0


def test_passes_rewards_through_and_counts_calls():
    v = GuardedVerifier(Const(0.75), timeout_s=5)
    try:
        assert v(PROMPT, "x") == 0.75
        assert v(PROMPT, "y") == 0.75
        assert (v.counters.calls, v.counters.errors, v.counters.timeouts) == (2, 0, 0)
    finally:
        v.close()


def test_raising_verifier_gives_zero_and_counts_an_error():
    v = GuardedVerifier(Raises(), timeout_s=5)
    try:
        assert v(PROMPT, " cat") == 0.0
        assert v.counters.errors == 1 and v.counters.timeouts == 0
        assert v.counters.last_error == "RuntimeError: boom"
    finally:
        v.close()


def test_slow_verifier_gives_zero_counts_a_timeout_and_later_calls_are_not_stuck():
    slow = Sleeps(1.5)
    v = GuardedVerifier(slow, timeout_s=0.2)
    try:
        t0 = time.perf_counter()
        assert v(PROMPT, " cat") == 0.0
        assert time.perf_counter() - t0 < 1.0   # returned at the limit, not after the sleep
        assert v.counters.timeouts == 1 and v.counters.errors == 0
        slow.seconds = 0.0
        assert v(PROMPT, " cat") == 1.0          # a fresh worker, not queued behind the hung one
        assert v.counters.calls == 2 and v.counters.timeouts == 1
    finally:
        v.close()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward_gives_zero_and_is_counted(value):
    v = GuardedVerifier(Const(value), timeout_s=5)
    try:
        assert v(PROMPT, "x") == 0.0
        assert v.counters.errors == 1
        assert "non-finite" in v.counters.last_error
    finally:
        v.close()


def test_non_numeric_reward_is_an_error():
    v = GuardedVerifier(Const("yes"), timeout_s=5)
    try:
        assert v(PROMPT, "x") == 0.0
        assert v.counters.errors == 1
    finally:
        v.close()
