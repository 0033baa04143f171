"""The Ray executor on a local CPU cluster with two fake GPUs (resource "GPU_fake")."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from mutualrl.allocation import AllocationConfig, Inventory, WorkerSpec, plan  # noqa: E402

pytestmark = pytest.mark.ray
GIB = 1024**3


@pytest.fixture(scope="module")
def cluster():
    ray.init(
        num_cpus=2,
        resources={"GPU_fake": 2},
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


def _classes():
    # Defined inside a function so cloudpickle ships them by value: Ray's worker processes
    # cannot import this test module.
    import time
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Produce:
        n: int

        def __call__(self, worker):
            return worker.produce(self.n)

    @dataclass(frozen=True)
    class Consume:
        items: object  # a list, or an ObjectRef the actor resolves (a top-level field)

        def __call__(self, worker):
            return worker.consume(self.items)

    @dataclass(frozen=True)
    class Boom:
        def __call__(self, worker):
            return worker.boom()

    @dataclass(frozen=True)
    class Sleep:
        s: float

        def __call__(self, worker):
            return worker.sleep(self.s)

    class Worker:
        def __init__(self, name: str, marks: str | None = None) -> None:
            self.name, self.marks = name, marks

        def close(self) -> None:  # the run is done with it: record it as a file in marks
            if self.marks is not None:
                open(f"{self.marks}/{self.name.replace('/', '-')}", "w").close()

        def produce(self, n: int) -> list[int]:
            return list(range(n))

        def consume(self, items: list[int]) -> tuple[str, int]:
            return self.name, sum(items)

        def boom(self) -> None:
            raise ValueError(f"{self.name} refuses")

        def sleep(self, s: float) -> None:
            time.sleep(s)

    return Worker, Produce, Consume, Boom, Sleep


def _plan(cpus: int = 2, gpus: int = 2):
    specs = [
        WorkerSpec(
            name=f"{p}/{r}",
            role=r,
            policy=p,
            num_parameters=1000,
            tokens_per_step=10,
            memory_bytes=GIB,
            group=p,
        )
        for p in ("a", "b")
        for r in ("learner", "generator")
    ]
    inv = Inventory(
        nodes=1,
        gpus_per_node=gpus,
        gpu_memory_bytes=80 * GIB,
        cpus_per_node=cpus,
        host_memory_bytes=8 * GIB,
    )
    return plan(specs, inv)


def _executor(**kw):
    from mutualrl.workers.ray_executor import RayExecutor

    opts = (
        dict(executor="ray", gpu_resource="GPU_fake", placement_timeout_s=5.0, call_timeout_s=30.0)
        | kw
    )
    return RayExecutor(AllocationConfig(**opts))


def test_actors_in_placement_groups_call_results_failures_and_refs(cluster, tmp_path):
    Worker, Produce, Consume, Boom, Sleep = _classes()
    p = _plan()
    ex = _executor(on_failure="continue")
    names = [a.worker for a in p.assignments]
    ex.start({n: (lambda n=n: Worker(n, str(tmp_path))) for n in names}, p)
    try:
        out = ex.call({n: Consume([1, 2]) for n in names})
        assert {n: r.value for n, r in out.items()} == {n: (n, 3) for n in names}
        # experience as object refs: produced on one actor, consumed on another, not via us
        refs = ex.call({"a/generator": Produce(4)}, fetch=False)
        ref = refs["a/generator"].value
        assert isinstance(ref, ray.ObjectRef)
        got = ex.call({"b/learner": Consume(ref), "a/learner": Consume(ex.put([10, 20]))})
        assert got["b/learner"].value == ("b/learner", 6) and got["a/learner"].value[1] == 30
        # each worker's time inside calls, as its actor timed it: what a paced run's pace
        # statistics read (a worker never called has none)
        before = ex.busy_seconds()
        ex.call({"a/generator": Sleep(0.3)})
        busy = ex.busy_seconds()
        assert 0.3 <= busy["a/generator"] - before["a/generator"] < 5.0
        assert busy["b/learner"] == before["b/learner"] < 0.3
        bad = ex.call({"a/learner": Boom(), "b/learner": Boom()})
        assert all(
            r.failure.kind == "raised" and "refuses" in r.failure.message for r in bad.values()
        )
        assert "in boom" in bad["a/learner"].failure.traceback
        slow = ex.call({"b/generator": Sleep(30.0), "a/generator": Sleep(0.0)}, timeout_s=1.0)
        assert slow["b/generator"].failure.kind == "timeout" and slow["a/generator"].ok
        assert set(ex.live_workers()) == {"a/generator"}
        removed = ex.removed()  # each with the failure that did it
        assert {n: f.kind for n, f in removed.items()} == {
            "a/learner": "raised",
            "b/learner": "raised",
            "b/generator": "timeout",
        }
    finally:
        ex.shutdown()
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())
    # the worker left alive closed before its actor was killed, and so did the two that raised
    # when they were removed; the hung one was killed at its timeout, without a close
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a-generator", "a-learner", "b-learner"]


def test_unplaceable_gangs_are_all_or_nothing_with_a_diagnostic(cluster):
    from mutualrl.workers.ray_executor import PlacementError

    Worker, Produce, Consume, Boom, Sleep = _classes()
    p = _plan(cpus=2, gpus=4)  # the plan believes in 4 GPUs; the cluster has 2 fake ones
    ex = _executor(placement_timeout_s=1.0)
    with pytest.raises(PlacementError) as err:
        ex.start({a.worker: (lambda n=a.worker: Worker(n)) for a in p.assignments}, p)
    msg = str(err.value)
    assert "gang 'a'" in msg or "gang 'b'" in msg
    assert "GPU_fake" in msg and "available now" in msg and "none are kept" in msg
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())


def _rank_classes():
    # shipped by value, as _classes
    import os
    from dataclasses import dataclass

    class Member:
        def __init__(self, ctx) -> None:
            self.ctx = ctx

        def who(self) -> dict:
            return {"rank": self.ctx.rank, "pid": os.getpid(), "env": os.environ.get("RANK")}

        def total(self) -> float:
            import torch
            import torch.distributed as dist

            t = torch.tensor([float(self.ctx.rank + 1)])
            dist.all_reduce(t)
            return float(t)

    @dataclass(frozen=True)
    class Who:
        def __call__(self, worker):
            return worker.who()

    @dataclass(frozen=True)
    class Total:
        def __call__(self, worker):
            return worker.total()

    @dataclass(frozen=True)
    class DieOn:
        rank: int

        def __call__(self, worker):
            if worker.ctx.rank == self.rank:
                os._exit(7)
            return worker.total()

    return Member, Who, Total, DieOn


def test_a_rank_group_is_one_actor_per_rank_in_one_process_group(cluster):
    import time

    from mutualrl.workers.ranks import RankGroup

    Member, Who, Total, DieOn = _rank_classes()
    spec = WorkerSpec(
        name="g",
        role="learner",
        policy="g",
        num_parameters=1000,
        tokens_per_step=10,
        memory_bytes=GIB,
        group="g",
        ranks=2,
    )
    p = plan(
        [spec],
        Inventory(
            nodes=1,
            gpus_per_node=2,
            gpu_memory_bytes=80 * GIB,
            cpus_per_node=2,
            host_memory_bytes=8 * GIB,
        ),
    )
    assert len(p["g"].gpus) == 2
    ex = _executor(on_failure="continue", call_timeout_s=90.0, process_group_timeout_s=60.0)
    ex.start({"g": RankGroup(2, Member)}, p)
    try:
        me = ex.call({"g": Who()})["g"].value
        assert me["rank"] == 0 and me["env"] == "0"  # rank 0 answers
        assert len({ray.get(a.invoke.remote(Who))[1]["pid"] for a in ex._actors["g"]}) == 2
        assert ex.call({"g": Total()})["g"].value == 3.0  # an all-reduce across the actors
        t0 = time.monotonic()
        dead = ex.call({"g": DieOn(1)})["g"]
        assert time.monotonic() - t0 < 60
        assert dead.failure.kind == "raised" and "rank 1 of 2" in dead.failure.message
        assert ex.live_workers() == []  # on_failure = "continue"
        assert "rank 1 of 2" in ex.removed()["g"].message
    finally:
        ex.shutdown()
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())


def _scratch_classes():
    # shipped by value, as _classes
    import time
    from dataclasses import dataclass

    class HoldsScratch:
        """A ``ScratchFolder`` in its actor's TMPDIR, as a vLLM engine has; ``close()`` takes
        ``close_s`` seconds before it removes the folder."""

        def __init__(self, name: str, close_s: float) -> None:
            from mutualrl.storage import ScratchFolder

            self.scratch, self.close_s = ScratchFolder(f"mutualrl-raytest-{name}-"), close_s

        def close(self) -> None:
            time.sleep(self.close_s)
            self.scratch.cleanup()

    @dataclass(frozen=True)
    class ScratchPath:
        def __call__(self, worker):
            return str(worker.scratch.path)

    @dataclass(frozen=True)
    class Snooze:
        s: float

        def __call__(self, worker):
            time.sleep(self.s)

    return HoldsScratch, ScratchPath, Snooze


def test_an_actor_killed_before_it_could_close_leaves_no_scratch_folder(cluster, monkeypatch):
    """As on the process executor: an actor killed at its call's timeout, and one slower to
    close than the executor waits for, cannot remove their scratch folders; the executor has
    them removed on their node once their processes are gone. One still running keeps its
    folder. (Two actors: the test cluster has two CPUs.)"""
    from pathlib import Path

    from mutualrl.workers import ray_executor

    monkeypatch.setattr(ray_executor, "CLOSE_TIMEOUT_S", 1.0)
    HoldsScratch, ScratchPath, Snooze = _scratch_classes()
    ex = _executor(on_failure="continue")
    ex.start(
        {"slow": lambda: HoldsScratch("slow", 60.0), "hung": lambda: HoldsScratch("hung", 0.0)}
    )
    try:
        paths = {
            n: Path(r.value)
            for n, r in ex.call({n: ScratchPath() for n in ("slow", "hung")}).items()
        }
        assert all(p.is_dir() for p in paths.values())
        out = ex.call({"hung": Snooze(60.0)}, timeout_s=2.0)
        assert out["hung"].failure.kind == "timeout"
        assert not paths["hung"].exists()  # killed at its timeout: removed
        assert paths["slow"].is_dir()  # still running: kept
    finally:
        ex.shutdown()  # slow to close: killed, then removed
    assert not paths["slow"].exists()
