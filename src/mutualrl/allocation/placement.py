"""Which torch device a policy's weights live on, from the run's device and the allocation plan.

``device = "cpu"`` keeps every policy on the CPU whatever the plan says. ``device = "cuda"``
places each policy on its learner's first planned GPU: ``cuda:<gpu index>`` when the policy is
built in the driver's process (local executor), ``cuda:0`` in a Ray actor or a worker process of
the ``process`` executor, where the actor's or process's planned GPUs are the only visible ones. Any
other value (``"cuda:1"``, ``"mps"``) is used as
given; so is ``"cuda"`` for a policy the plan gave no GPU.

``policy_memory_cap``: what a policy's process may take of a GPU it shares with other processes;
``process_memory_cap``: that cap where a run sets it (the run's build and ``mutualrl plan`` both
ask it).
"""

from __future__ import annotations

from mutualrl.allocation.planner import Plan
from mutualrl.config import AllocationConfig


def policy_device(name: str, device: str, plan: Plan | None, executor: str) -> str:
    if device != "cuda" or plan is None:
        return device
    gpus = next((a.gpus for a in plan.assignments if a.role == "learner" and a.policy == name), ())
    if not gpus:
        return device
    # ray and process workers see only their planned GPUs (CUDA_VISIBLE_DEVICES): cuda:0 is theirs
    return "cuda:0" if executor in ("ray", "process") else f"cuda:{gpus[0].gpu}"


def policy_memory_cap(
    name: str, plan: Plan | None, executor: str, usable_memory_fraction: float
) -> int | None:
    """The bytes a policy's process (each rank's, for a sharded learner) may take of its GPU when
    that GPU is shared with other processes: its planned memory (learner, and the generator that
    runs with it) over ``usable_memory_fraction``, its share of the card's headroom. None where
    nothing needs capping: no GPU plan, one process for every policy (``local``), or a GPU the
    policy has to itself. The planner fits the planned memory of a GPU's workers in its usable
    memory, so the caps of one GPU add up to at most the card."""
    if plan is None or plan.mode != "gpu" or executor not in ("process", "ray"):
        return None
    mine = [a for a in plan.assignments if a.policy == name]
    learner = next((a for a in mine if a.role == "learner"), None)
    if learner is None or not learner.gpus or all(s.fraction >= 1.0 for s in learner.gpus):
        return None
    ranks = learner.ranks or 1
    rest = sum(a.memory_bytes for a in mine if a is not learner)  # spread over the ranks
    return int((learner.memory_bytes + -(-rest // ranks)) / usable_memory_fraction)


def process_memory_cap(
    name: str, device: str, plan: Plan | None, alloc: AllocationConfig
) -> int | None:
    """``policy_memory_cap`` where the run sets it: ``allocation.memory.cap_shared_gpus`` on and
    the policy on CUDA (``device`` as ``policy_device`` places it); else None."""
    if not alloc.memory.cap_shared_gpus or not device.startswith("cuda"):
        return None
    return policy_memory_cap(name, plan, alloc.executor, alloc.memory.usable_memory_fraction)
