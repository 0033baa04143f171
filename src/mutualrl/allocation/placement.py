"""Which torch device a policy's weights live on, from the run's device and the allocation plan.

``device = "cpu"`` keeps every policy on the CPU whatever the plan says. ``device = "cuda"``
places each policy on its learner's first planned GPU: ``cuda:<gpu index>`` when the policy is
built in the driver's process (local executor), ``cuda:0`` in a Ray actor or a worker process of
the ``process`` executor, where the actor's or process's planned GPUs are the only visible ones. Any other value (``"cuda:1"``, ``"mps"``) is used as
given; so is ``"cuda"`` for a policy the plan gave no GPU.
"""

from __future__ import annotations

from mutualrl.allocation.planner import Plan


def policy_device(name: str, device: str, plan: Plan | None, executor: str) -> str:
    if device != "cuda" or plan is None:
        return device
    gpus = next((a.gpus for a in plan.assignments if a.role == "learner" and a.policy == name), ())
    if not gpus:
        return device
    # ray and process workers see only their planned GPUs (CUDA_VISIBLE_DEVICES): cuda:0 is theirs
    return "cuda:0" if executor in ("ray", "process") else f"cuda:{gpus[0].gpu}"
