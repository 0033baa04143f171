"""Built-in tasks and verifiers; third-party tasks register through ``mutualrl.tasks``."""

from mutualrl.tasks import arithmetic, dataset_tasks, jsonl, lookup, pointer, rewards  # noqa: F401 - registers the built-ins
from mutualrl.tasks.base import TASKS, GuardedVerifier, Prompt, Task, TaskError, Verifier

__all__ = ["TASKS", "GuardedVerifier", "Prompt", "Task", "TaskError", "Verifier", "build_task"]


def build_task(cfg) -> Task:
    return TASKS.get(cfg.name)(cfg)
