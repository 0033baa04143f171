"""The process executor: one spawned process per worker, exact thread shares, planned GPUs in the
environment, hung workers killed, dead workers reported, the failure policies as elsewhere."""

from __future__ import annotations

import functools
import os
import signal
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from mutualrl.allocation import AllocationConfig
from mutualrl.allocation.planner import Assignment, GpuSlot
from mutualrl.workers import EXECUTORS, ProcessExecutor, WorkerFailedError, make_executor
from mutualrl.workers.processes import worker_env
from tests.allocation.test_local_executor import (
    Boom,
    Closes,
    Echo,
    Nope,
    SlowToClose,
    Work,
    closes,
    removal_beside,
)


class Facts:
    """What a worker process sees of itself."""

    def __init__(self, name: str) -> None:
        self.name = name

    def facts(self) -> dict:
        import torch

        return {
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def sleep(self, s: float) -> str:
        time.sleep(s)
        return self.name

    def die(self) -> None:
        os._exit(7)


@dataclass(frozen=True)
class Ask:
    def __call__(self, worker):
        return worker.facts()


@dataclass(frozen=True)
class Sleep:
    s: float

    def __call__(self, worker):
        return worker.sleep(self.s)


@dataclass(frozen=True)
class Snooze:
    """Any worker, asleep for ``s`` seconds."""

    s: float

    def __call__(self, worker):
        time.sleep(self.s)


@dataclass(frozen=True)
class Die:
    def __call__(self, worker):
        return worker.die()


def _ex(**kw) -> ProcessExecutor:
    return ProcessExecutor(AllocationConfig(call_timeout_s=60.0, **kw))


def _assignment(worker: str, threads: int, gpus=()) -> Assignment:
    return Assignment(
        worker=worker,
        role="learner",
        policy=worker,
        group=worker,
        num_parameters=1,
        tokens_per_step=1,
        cost=1.0,
        cost_share=0.5,
        memory_bytes=0,
        node=0,
        gpus=gpus,
        threads=threads,
    )


def _plan(*assignments: Assignment):
    return types.SimpleNamespace(assignments=assignments)  # all the executor reads of a plan


@pytest.fixture
def facts_pair():
    ex = _ex()
    plan = _plan(_assignment("a", 1), _assignment("b", 2, (GpuSlot(node=0, gpu=3, fraction=1.0),)))
    ex.start({n: functools.partial(Facts, n) for n in ("a", "b")}, plan)
    yield ex
    ex.shutdown()


def test_each_worker_runs_in_its_own_process_with_its_planned_threads_and_gpus(facts_pair):
    out = facts_pair.call({"a": Ask(), "b": Ask()})
    a, b = out["a"].value, out["b"].value
    assert len({a["pid"], b["pid"], os.getpid()}) == 3
    assert (a["threads"], a["omp"], a["gpus"]) == (1, "1", None)
    assert (b["threads"], b["omp"], b["gpus"]) == (2, "2", "3")


def test_calls_run_at_once(facts_pair):
    t0 = time.monotonic()
    out = facts_pair.call({"a": Sleep(1.0), "b": Sleep(1.0)})
    assert [r.value for r in out.values()] == ["a", "b"]
    assert time.monotonic() - t0 < 1.8


def test_results_and_raised_errors_come_back_with_their_tracebacks():
    ex = _ex(on_failure="stop")
    ex.start({n: functools.partial(Echo, n) for n in ("a", "b")})
    assert {n: r.value for n, r in ex.call({"a": Work(1), "b": Work(2)}).items()} == {
        "a": ("a", 2),
        "b": ("b", 4),
    }
    with pytest.raises(WorkerFailedError) as err:
        ex.call({"a": Boom()})
    f = err.value.failures[0]
    assert (f.worker, f.method, f.kind, f.exc_type) == ("a", "Boom", "raised", "RuntimeError")
    assert "a exploded" in f.message and "in boom" in f.traceback
    ex.shutdown()


def test_a_hung_worker_is_killed_at_its_timeout_and_the_others_go_on():
    ex = _ex(on_failure="continue")
    ex.start({n: functools.partial(Facts, n) for n in ("fast", "hung")})
    pid = ex.call({"hung": Ask()})["hung"].value["pid"]
    t0 = time.monotonic()
    out = ex.call({"fast": Sleep(0.0), "hung": Sleep(60.0)}, timeout_s=1.0)
    assert time.monotonic() - t0 < 5.0
    assert out["fast"].value == "fast" and out["hung"].failure.kind == "timeout"
    assert "killed" in out["hung"].failure.message
    with pytest.raises(ProcessLookupError):  # really gone, not abandoned
        os.kill(pid, 0)
    again = ex.call({"fast": Sleep(0.0), "hung": Sleep(0.0)})
    assert again["fast"].value == "fast" and again["hung"].failure.kind == "unavailable"
    assert ex.live_workers() == ["fast"]
    assert list(ex.removed()) == ["hung"] and "killed" in ex.removed()["hung"].message  # the cause
    ex.shutdown()


def test_a_worker_process_that_dies_is_that_workers_failure():
    ex = _ex(on_failure="continue")
    ex.start({"a": functools.partial(Facts, "a"), "b": functools.partial(Facts, "b")})
    try:
        out = ex.call({"a": Die()})
        assert out["a"].failure.exc_type == "WorkerDied" and "code 7" in out["a"].failure.message
        assert ex.live_workers() == ["b"] and ex.call({"b": Ask()})["b"].ok
    finally:
        ex.shutdown()


def test_removing_a_failed_worker_does_not_hold_up_the_other_workers_calls():
    ex = _ex(on_failure="continue")
    ex.start({"a": functools.partial(SlowToClose, "a", 3.0), "b": functools.partial(Echo, "b")})
    try:
        out, took, during = removal_beside(ex, "a", Boom(), "b", Work(3), timeout_s=30.0)
        assert out.value == ("b", 6), out.failure
        assert during and took < 1.5, took
    finally:
        ex.shutdown()


def test_constructor_failures_unknown_names_and_missing_methods_are_explained():
    ex = _ex()
    with pytest.raises(WorkerFailedError, match="__init__.*ZeroDivisionError"):
        ex.start({"bad": functools.partial(divmod, 1, 0)})
    ex = _ex()
    ex.start({"a": functools.partial(Echo, "a")})
    with pytest.raises(ValueError, match=r"unknown worker\(s\) \['z'\]; started: \['a'\]"):
        ex.call({"z": Work(1)})
    with pytest.raises(WorkerFailedError, match="Nope\\(\\): raised: AttributeError: .*'nope'"):
        ex.call({"a": Nope()})
    ex.shutdown()


def test_shutdown_ends_every_worker_process():
    ex = _ex()
    ex.start({n: functools.partial(Facts, n) for n in ("a", "b")})
    pids = [r.value["pid"] for r in ex.call({"a": Ask(), "b": Ask()}).values()]
    ex.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_process_closes_its_worker_before_it_ends(tmp_path):
    """What a worker keeps outside its process (a vLLM engine's scratch folder) is released in
    the worker's process when the run is done with it, as on the local executor. A hung
    worker is killed: it never gets to close, and ``continue`` drops it without waiting for it."""
    ex = _ex()
    ex.start({n: functools.partial(Closes, n, str(tmp_path)) for n in ("a", "b")})
    ex.call({"a": Work(1), "b": Work(2)})
    ex.shutdown()
    assert closes(tmp_path) == {"a": 1, "b": 1}
    marks = tmp_path / "continue"
    marks.mkdir()
    ex = _ex(on_failure="continue")
    ex.start({n: functools.partial(Closes, n, str(marks)) for n in ("a", "b", "c")})
    try:  # worker processes are not daemonic: a failed assertion must not leave them running
        t0 = time.monotonic()
        out = ex.call({"a": Boom(), "b": Snooze(60.0), "c": Work(1)}, timeout_s=2.0)
        assert [out[n].failure.kind for n in "ab"] == ["raised", "timeout"] and out["c"].ok
        # 2 s here; asking the hung one to stop as well would wait 10 s for it, then end it
        assert time.monotonic() - t0 < 8.0
        assert closes(marks) == {"a": 1}
    finally:
        ex.shutdown()
    assert closes(marks) == {"a": 1, "c": 1}


class HoldsScratch(Echo):
    """A worker with a ``ScratchFolder`` in its process's TMPDIR, as a vLLM engine has, whose
    ``close()`` takes ``close_s`` seconds before it removes the folder."""

    def __init__(self, name: str, close_s: float) -> None:
        from mutualrl.storage import ScratchFolder

        super().__init__(name)
        self.scratch, self.close_s = ScratchFolder(f"mutualrl-{name}-"), close_s

    def close(self) -> None:
        time.sleep(self.close_s)
        self.scratch.cleanup()


@dataclass(frozen=True)
class ScratchPath:
    def __call__(self, worker):
        return str(worker.scratch.path)


def test_a_worker_killed_before_it_could_close_leaves_no_scratch_folder(tmp_path, monkeypatch):
    """A worker slower to close than the executor waits for (an engine's shutdown on a loaded
    machine), and one killed at its call's timeout, cannot remove their scratch folders: the
    executor removes them once their processes are gone. The folder of a worker still running
    is kept, and one that closed in time removed its own."""
    from mutualrl.workers import processes

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the worker processes' TMPDIR
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(processes, "_EXIT_GRACE_S", 0.5)
    ex = _ex(on_failure="continue")
    ex.start(
        {
            "slow": functools.partial(HoldsScratch, "slow", 60.0),
            "hung": functools.partial(HoldsScratch, "hung", 0.0),
            "quick": functools.partial(HoldsScratch, "quick", 0.0),
        }
    )
    try:
        paths = {
            n: Path(r.value)
            for n, r in ex.call({n: ScratchPath() for n in ("slow", "hung", "quick")}).items()
        }
        assert all(p.is_dir() and p.parent == tmp_path for p in paths.values())
        out = ex.call({"hung": Snooze(60.0)}, timeout_s=1.0)
        assert out["hung"].failure.kind == "timeout"
        assert not paths["hung"].exists()  # killed at its timeout: removed
        assert paths["slow"].is_dir() and paths["quick"].is_dir()  # still running: kept
    finally:
        ex.shutdown()
    assert not paths["slow"].exists() and not paths["quick"].exists()
    assert list(tmp_path.iterdir()) == []


def test_the_registry_builds_it_and_the_environment_is_planned():
    assert "process" in EXECUTORS.names()
    assert isinstance(make_executor(AllocationConfig(executor="process")), ProcessExecutor)
    assert worker_env(0, None) == {}
    assert worker_env(4, (0, 2)) == {"OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "0,2"}


def test_a_worker_process_killed_between_calls_is_reported_as_its_death():
    """SIGKILLed while idle (the OOM killer), its pipe breaks at the next call: the failure is
    ``WorkerDied`` with the exit code, as when it dies during a call (it was BrokenPipeError)."""
    ex = _ex()
    ex.start({"a": functools.partial(Facts, "a")})
    try:
        pid = ex.call({"a": Ask()})["a"].value["pid"]
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(WorkerFailedError) as info:
            ex.call({"a": Ask()})
        [failure] = info.value.failures
        assert failure.exc_type == "WorkerDied" and "code -9" in failure.message
    finally:
        ex.shutdown()
