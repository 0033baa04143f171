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
        assert time.perf_counter() - t0 < 1.0  # returned at the limit, not after the sleep
        assert v.counters.timeouts == 1 and v.counters.errors == 0
        slow.seconds = 0.0
        assert v(PROMPT, " cat") == 1.0  # a fresh worker, not queued behind the hung one
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


# ---- allocation.verifier_threads: score_many -------------------------------------------------
class ByText:
    """Reward from the completion: "err" raises, "nan" is not finite, "hang" waits for ``release``,
    "meet" waits at ``barrier`` (it returns only when that many calls run at once)."""

    verifier_id, version = "by-text", 1

    def __init__(self, barrier=None, release=None):
        import threading

        self.barrier, self.release = barrier, release or threading.Event()

    def __call__(self, prompt, completion):
        if completion == "err":
            raise ValueError("bad answer")
        if completion == "nan":
            return float("nan")
        if completion == "hang":
            self.release.wait(10)
        if completion == "meet":
            self.barrier.wait(5)
        return float(len(completion))


def test_score_many_gives_what_one_by_one_gives_in_order_with_the_same_counts():
    items = [(PROMPT, t) for t in ("a", "err", "abc", "nan", "ab", "abcd")]
    alone, pooled = GuardedVerifier(ByText(), 5), GuardedVerifier(ByText(), 5, threads=3)
    try:
        assert pooled.score_many(items) == alone.score_many(items) == [1.0, 0.0, 3.0, 0.0, 2.0, 4.0]
        for v in (alone, pooled):
            assert (v.counters.calls, v.counters.errors, v.counters.timeouts) == (6, 2, 0)
    finally:
        alone.close(), pooled.close()


def test_score_many_verifies_threads_samples_at_once():
    import threading

    v = GuardedVerifier(ByText(barrier=threading.Barrier(4)), 10, threads=4)
    try:  # the barrier breaks (an error, reward 0) unless four calls run at the same time
        assert v.score_many([(PROMPT, "meet")] * 4) == [4.0] * 4
        assert v.counters.errors == 0
    finally:
        v.close()


def test_a_hung_call_times_out_alone_and_the_rest_are_verified():
    verifier = ByText()
    v = GuardedVerifier(verifier, timeout_s=0.3, threads=2)
    try:
        items = [(PROMPT, t) for t in ("hang", "a", "ab", "abc", "hang", "abcd")]
        assert v.score_many(items) == [0.0, 1.0, 2.0, 3.0, 0.0, 4.0]
        assert v.counters.timeouts == 2 and v.counters.calls == 6
        assert v.score_many([(PROMPT, "xy")]) == [2.0]  # later calls are not stuck behind it
    finally:
        verifier.release.set()
        v.close()


def test_callers_on_two_threads_take_turns_and_neither_is_timed_out_waiting():
    # 0.3 s a call, 0.5 s allowed: two callers at once must not count one's wait as its time
    import threading

    g = GuardedVerifier(Sleeps(0.3), timeout_s=0.5)
    got = []
    callers = [threading.Thread(target=lambda: got.append(g(PROMPT, " cat"))) for _ in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert got == [1.0, 1.0] and g.counters.timeouts == 0 and g.counters.calls == 2
    g.close()


class RaisesTimeout:
    verifier_id, version = "raises-timeout", 1

    def __call__(self, prompt, completion):
        raise TimeoutError("the sandbox did not answer")


def test_a_verifier_that_raises_timeouterror_is_an_error_not_a_guard_timeout():
    g = GuardedVerifier(RaisesTimeout(), timeout_s=5)
    assert g(PROMPT, " cat") == 0.0
    assert g.counters.errors == 1 and g.counters.timeouts == 0
    assert "TimeoutError: the sandbox did not answer" in g.counters.last_error
    g.close()


@pytest.mark.parametrize("threads", [0, 2])
def test_seconds_in_calls_count_each_callers_time_its_wait_and_the_call_in_progress(threads):
    # what a paced run's step time-out sets aside (pacing.driver, run.paced)
    import threading

    g = GuardedVerifier(Sleeps(0.1), timeout_s=5, threads=threads)
    me = threading.get_ident()
    try:
        g.score_many([(PROMPT, " cat")] * 2)
        mine = g.seconds_in_calls(me)
        assert (0.19 if threads <= 1 else 0.09) < mine < 1.5
        other: list = []
        t = threading.Thread(target=lambda: other.append(g(PROMPT, " cat")))
        with g._turn:  # the other caller waits for its turn, and that wait counts
            t.start()
            time.sleep(0.15)
            assert 0.1 < g.seconds_in_calls(t.ident) < 1.0  # in progress, counted so far
        t.join()
        assert 0.2 < g.seconds_in_calls(t.ident) < 1.5 and other == [1.0]
        assert g.seconds_in_calls(me) == mine  # one thread's time is its own
    finally:
        g.close()
