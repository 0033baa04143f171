"""A policy's device from the run's device and its learner's planned GPUs."""

from mutualrl.allocation.placement import policy_device
from mutualrl.allocation.planner import Assignment, GpuSlot


def learner(gpus) -> Assignment:
    return Assignment(
        worker="a/learner",
        role="learner",
        policy="a",
        group="a",
        num_parameters=1,
        tokens_per_step=1,
        cost=1.0,
        cost_share=1.0,
        memory_bytes=1,
        node=0,
        gpus=gpus,
        threads=1,
    )


def test_cpu_stays_cpu_and_cuda_follows_the_plan():
    class P:  # the one attribute policy_device reads
        assignments = (learner((GpuSlot(0, 3), GpuSlot(0, 4))),)

    assert policy_device("a", "cpu", P, "local") == "cpu"
    assert policy_device("a", "cuda", P, "local") == "cuda:3"
    assert policy_device("a", "cuda", P, "ray") == "cuda:0"
    assert policy_device("b", "cuda", P, "local") == "cuda"  # no assignment: as given
    assert policy_device("a", "cuda:1", P, "local") == "cuda:1"
    assert policy_device("a", "cuda", None, "local") == "cuda"
