"""The local executor: concurrency, failures with tracebacks, timeouts, failure policies."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from mutualrl.allocation import AllocationConfig
from mutualrl.workers import EXECUTORS, LocalExecutor, WorkerFailedError, make_executor


class Echo:
    def __init__(self, name: str, delay_s: float = 0.0) -> None:
        self.name, self.delay_s, self.calls = name, delay_s, 0

    def work(self, x: int) -> tuple[str, int]:
        time.sleep(self.delay_s)
        self.calls += 1
        return self.name, x * 2

    def boom(self) -> None:
        raise RuntimeError(f"{self.name} exploded")


class SlowToClose(Echo):
    """A worker whose ``close()`` (a vLLM engine's shutdown) takes ``close_s``."""

    def __init__(self, name: str, close_s: float = 2.0) -> None:
        super().__init__(name)
        self.close_s = close_s

    def close(self) -> None:
        time.sleep(self.close_s)


def removal_beside(ex, failing: str, fail_call, other: str, other_call, timeout_s: float):
    """Fail ``failing`` (on_failure = "continue") in one driver thread and, while its removal
    (its close) is under way, call ``other`` from this one: (the other's result, seconds it
    took, whether the removal was still going when the other's call returned)."""
    done = threading.Event()

    def fail():
        ex.call({failing: fail_call})
        done.set()

    t = threading.Thread(target=fail)
    t.start()
    time.sleep(0.3)  # the failed call is back and the removal has begun
    t0 = time.monotonic()
    out = ex.call({other: other_call}, timeout_s=timeout_s)[other]
    took, during = time.monotonic() - t0, not done.is_set()
    t.join()
    return out, took, during


class Closes(Echo):
    """A worker that records each ``close()`` as a line of ``marks/<name>``; ``fail`` makes it
    raise instead."""

    def __init__(self, name: str, marks: str, fail: bool = False) -> None:
        super().__init__(name)
        self.marks, self.fail = marks, fail

    def close(self) -> None:
        if self.fail:
            raise OSError("cannot remove the scratch folder")
        with open(f"{self.marks}/{self.name}", "a") as f:
            f.write("closed\n")


def closes(marks) -> dict[str, int]:
    """How many times each worker was closed."""
    return {p.name: len(p.read_text().splitlines()) for p in sorted(marks.iterdir())}


class Hangs(Echo):
    def __init__(self, name: str, release: threading.Event) -> None:
        super().__init__(name)
        self.release = release

    def work(self, x: int) -> tuple[str, int]:
        self.release.wait()  # never set during the call: a hung worker
        return self.name, x


@dataclass(frozen=True)
class Work:
    x: int

    def __call__(self, worker):
        return worker.work(self.x)


@dataclass(frozen=True)
class Boom:
    def __call__(self, worker):
        return worker.boom()


@dataclass(frozen=True)
class Nope:
    def __call__(self, worker):
        return worker.nope()


def _ex(mode="threads", **kw) -> LocalExecutor:
    return LocalExecutor(AllocationConfig(local_mode=mode, call_timeout_s=5.0, **kw))


def test_threads_and_sequential_give_the_same_results():
    results = {}
    for mode in ("threads", "sequential"):
        ex = _ex(mode)
        ex.start({n: (lambda n=n: Echo(n)) for n in ("a", "b", "c")})
        out = ex.call({"a": Work(1), "b": Work(2), "c": Work(3)})
        results[mode] = {n: r.value for n, r in out.items()}
        ex.shutdown()
    assert (
        results["threads"] == results["sequential"] == {"a": ("a", 2), "b": ("b", 4), "c": ("c", 6)}
    )


def test_calls_run_concurrently_in_threads_mode():
    # Four workers meet at a barrier inside their calls: only possible if they run at once.
    barrier = threading.Barrier(4, timeout=2.0)

    class Meets(Echo):
        def work(self, x: int) -> tuple[str, int]:
            barrier.wait()
            return super().work(x)

    ex = _ex()
    ex.start({n: (lambda n=n: Meets(n)) for n in ("a", "b", "c", "d")})
    out = ex.call({n: Work(0) for n in ("a", "b", "c", "d")})
    assert all(r.ok for r in out.values()), out
    ex.shutdown()


def test_a_raising_worker_reports_its_traceback_and_stop_raises_with_all_results():
    ex = _ex(on_failure="stop")
    ex.start({"a": lambda: Echo("a"), "b": lambda: Echo("b")})
    with pytest.raises(WorkerFailedError) as err:
        ex.call({"a": Boom()})
    f = err.value.failures[0]
    assert (f.worker, f.method, f.kind, f.exc_type) == ("a", "Boom", "raised", "RuntimeError")
    assert "a exploded" in f.message and "in boom" in f.traceback
    assert "a exploded" in str(err.value)
    ex.shutdown()


def test_a_hung_worker_times_out_while_the_others_results_come_back():
    release = threading.Event()
    ex = _ex(on_failure="continue")
    ex.start({"fast": lambda: Echo("fast"), "hung": lambda: Hangs("hung", release)})
    t0 = time.monotonic()
    out = ex.call({"fast": Work(1), "hung": Work(1)}, timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0
    assert out["fast"].value == ("fast", 2)
    f = out["hung"].failure
    assert f.kind == "timeout" and "release.wait()" in f.traceback  # where it hangs
    # "continue": the hung worker is removed, later calls say so and the rest go on.
    again = ex.call({"fast": Work(2), "hung": Work(2)}, timeout_s=0.5)
    assert again["fast"].value == ("fast", 4) and again["hung"].failure.kind == "unavailable"
    assert ex.live_workers() == ["fast"]
    assert list(ex.removed()) == ["hung"] and ex.removed()["hung"].kind == "timeout"  # the cause
    release.set()
    ex.shutdown()


def test_an_executor_refuses_restart_which_is_the_runs():
    with pytest.raises(ValueError, match=r'on_failure = "restart" is the run\'s: mutualrl train'):
        _ex(on_failure="restart")


def test_removing_a_failed_worker_does_not_hold_up_the_other_workers_calls():
    # A paced run steps each policy in a thread of its own: closing a failed policy's worker (an
    # engine's shutdown: seconds) must not stall the other's calls, nor time them out.
    ex = _ex(on_failure="continue")
    ex.start({"a": lambda: SlowToClose("a", 2.0), "b": lambda: Echo("b", 0.05)})
    try:
        out, took, during = removal_beside(ex, "a", Boom(), "b", Work(3), timeout_s=1.0)
        assert out.value == ("b", 6), out.failure
        assert during and took < 0.75, took
        assert ex.call({"a": Work(1)})["a"].failure.kind == "unavailable"
    finally:
        ex.shutdown()


def test_a_call_in_flight_when_another_worker_is_removed_is_not_timed_out():
    # The in-flight call's thread records its busy time under the executor's lock when it ends:
    # held while a worker was dropped, that lock once kept the call from returning until it
    # timed out.
    ex = _ex(on_failure="continue")
    ex.start({"a": lambda: SlowToClose("a", 2.0), "b": lambda: Echo("b", 0.5)})
    got = {}
    t = threading.Thread(target=lambda: got.update(ex.call({"b": Work(3)}, timeout_s=1.0)))
    try:
        t.start()
        time.sleep(0.1)  # b's call is under way
        assert ex.call({"a": Boom()})["a"].failure.kind == "raised"  # a is closed (2 s)
        t.join()
        assert got["b"].value == ("b", 6), got["b"].failure
    finally:
        ex.shutdown()


def test_constructor_failures_and_unknown_names_are_explained():
    ex = _ex()
    with pytest.raises(WorkerFailedError, match="__init__"):
        ex.start({"bad": lambda: 1 / 0})
    ex = _ex()
    ex.start({"a": lambda: Echo("a")})
    with pytest.raises(ValueError, match=r"unknown worker\(s\) \['z'\]; started: \['a'\]"):
        ex.call({"z": Work(1)})
    with pytest.raises(WorkerFailedError, match="Nope\\(\\): raised: AttributeError: .*'nope'"):
        ex.call({"a": Nope()})
    assert ex.put(obj := object()) is obj
    ex.shutdown()


def test_shutdown_and_removal_close_each_worker_once_and_a_failed_close_is_a_warning(tmp_path):
    """A policy's vLLM engine removes its scratch folder (a whole copy of the model) in
    ``close``: the run's end closes each worker, and ``continue`` closes the one it drops."""
    for mode in ("threads", "sequential"):
        marks = tmp_path / mode
        marks.mkdir()
        ex = _ex(mode, on_failure="continue")
        # the factories run within this iteration (start now)
        ex.start({n: (lambda n=n: Closes(n, str(marks))) for n in ("a", "b")})  # noqa: B023
        assert ex.call({"a": Boom()})["a"].failure.kind == "raised"  # dropped
        assert closes(marks) == {"a": 1}
        ex.shutdown()
        assert closes(marks) == {"a": 1, "b": 1}
    ex = _ex()
    ex.start({"a": lambda: Closes("a", str(tmp_path), fail=True), "b": lambda: Echo("b")})
    with pytest.warns(RuntimeWarning, match=r"worker 'a': close\(\) failed \(OSError: cannot"):
        ex.shutdown()


def test_executor_registry_has_local_and_ray():
    assert {"local", "ray"} <= set(EXECUTORS.names())
    assert isinstance(make_executor(AllocationConfig()), LocalExecutor)
