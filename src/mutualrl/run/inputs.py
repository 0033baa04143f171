"""The checks of a run config that need more than the config: names looked up in plug-in
registries, the torch device, the packages of the generation backends.

``run.build.prepare`` runs them first, so a bad name or device is a one-line ``ConfigError``
naming its field before any task, tokenizer or worker is built (a ``RegistryError`` deep in a
worker named no field, and a missing vLLM surfaced as a worker's traceback).
"""

from __future__ import annotations

import torch

from mutualrl.config import ConfigError, RunConfig
from mutualrl.grpo import ADVANTAGE_ESTIMATORS, NORMALISERS, REWARD_SCALINGS
from mutualrl.policies.generation import check_backends, check_engine_processes
from mutualrl.policies.models import ARCHITECTURES
from mutualrl.registry import Registry, RegistryError
from mutualrl.tasks import TASKS
from mutualrl.workers import EXECUTORS

# What the device field takes, for the messages (policy_device places "cuda" on planned GPUs).
DEVICES = '"cpu", "cuda" (each learner on its planned GPU) or "cuda:N"'


def check_inputs(cfg: RunConfig, machine: bool = True) -> None:
    """Every name and device of ``cfg`` that this process can check, each failure naming its
    field (``policies.<name>.architecture``, ``task.name``, ``allocation.executor``, ``device``).

    ``machine=False`` (``mutualrl plan``, which plans for machines other than this one) leaves
    out what only this machine can answer: its device and its installed generation backends."""
    if machine:
        check_device(cfg.device)
    registered(TASKS, cfg.task.name, "task.name")
    registered(NORMALISERS, cfg.grpo.loss_type, "grpo.loss_type")
    registered(REWARD_SCALINGS, cfg.grpo.scale_rewards, "grpo.scale_rewards")
    registered(ADVANTAGE_ESTIMATORS, cfg.grpo.advantage_estimator, "grpo.advantage_estimator")
    registered(EXECUTORS, cfg.allocation.executor, "allocation.executor")
    for p in cfg.policies:
        if p.checkpoint is None:  # a checkpoint's own config.json names its architecture
            registered(ARCHITECTURES, p.architecture, f"policies.{p.name}.architecture")
        check_attention(p.attn_implementation, f"policies.{p.name}.attn_implementation")
        check_attention(p.train_attn_implementation, f"policies.{p.name}.train_attn_implementation")
    # What the config asks for first (two vLLM engines in one process is wrong everywhere), then
    # whether this install has the packages it names
    check_engine_processes(cfg.policies, cfg.allocation.executor)
    if machine:
        check_backends(cfg.policies)


def registered(registry: Registry, name: str, field: str) -> None:
    """``name`` is in ``registry``; otherwise a ``ConfigError`` naming ``field`` and the known
    names."""
    try:
        registry.get(name)
    except RegistryError as exc:
        raise ConfigError(f"{field}: {exc}") from None


def check_attention(name: str | None, field: str) -> None:
    """``name`` is an attention kernel transformers knows (its registry, and "eager"); whether
    the machine has the kernel's package (flash-attn) is transformers' to say when it loads."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = sorted({"eager", *ALL_ATTENTION_FUNCTIONS.keys()})
    if name is not None and name not in known:
        raise ConfigError(f"{field}: unknown attention implementation {name!r}; known: {known}")


def check_device(device: str) -> None:
    """``device`` is a torch device this process has: "cpu", or the type of its accelerator with
    an index below the accelerator's device count."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"device: {device!r} is not a torch device ({exc}); expected {DEVICES}"
        ) from None
    if dev.type == "cpu":
        return
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != dev.type:
        found = f"only {acc.type}" if acc is not None else "no accelerator"
        raise ConfigError(
            f"device: {device!r}, but this torch ({torch.__version__}) sees "
            f'{found} on this machine; expected "cpu" here, or {dev.type} where '
            f"torch has it"
        )
    count = torch.accelerator.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigError(
            f"device: {device!r}, but this machine has {count} {dev.type} "
            f"device(s); expected an index below {count}"
        )
