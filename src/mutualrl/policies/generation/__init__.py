"""Generation backends: how a policy samples completions, behind one interface.

``torch`` is the hand-written KV-cache sampler (CPU, tests, tiny models; exact behaviour
log-probs, reproducible from the policy's own generator); ``vllm`` runs a vLLM engine per policy
(GPUs). A policy owns one backend, chosen by ``[[policies]] generation.backend``; the loop only
ever calls ``Policy.generate``. Backends register on ``GENERATION_BACKENDS`` as builders
``(view, learner, generator) -> GenerationBackend``: the policy's tokenizer view, the learner
whose weights it samples (model, version, precision, trainer log-probs) and the sampler's
``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mutualrl.registry import Registry

if TYPE_CHECKING:
    from mutualrl.policies.samples import Sample
    from mutualrl.tasks.base import Prompt


@dataclass(frozen=True)
class SamplingSettings:
    num_generations: int              # completions per prompt
    max_new_tokens: int
    temperature: float                # 0: greedy
    top_p: float = 1.0                # 1: no nucleus truncation
    top_k: int = 0                    # 0: no top-k truncation
    batch_size: int | None = None     # sequences per generation pass; None: all at once


class GenerationBackend(Protocol):
    """Prompts (with their token ids) and sampling settings in, ``Sample``s out.

    Every sample carries the token ids, the per-token behaviour log-probs of the distribution
    actually sampled from (after temperature, top-k, top-p), its text and finish reason, and the
    version of the weights that produced it.
    """

    #: True when the behaviour log-probs are the trainer's own (no mismatch to correct).
    exact_logprobs: bool

    def generate(self, prompts: list[Prompt], prompt_ids: list[tuple[int, ...]],
                 settings: SamplingSettings) -> list[Sample]: ...

    def load_weights(self, version: int) -> None:
        """Make the policy's current weights (now at ``version``) the ones sampled from."""

    def sync_check(self) -> dict[str, float]:
        """Verify the sampler serves the trainer's weights; raise if not. Returns the gap."""


GENERATION_BACKENDS: Registry = Registry("generation backend", "mutualrl.generation_backends")


def build_backend(view, learner, generator) -> GenerationBackend:
    """The backend ``view.cfg.generation.backend`` names, sampling ``learner``'s weights."""
    # Imported for their registrations; vllm itself is imported only when that backend is built.
    from mutualrl.policies.generation import torch as _torch, vllm as _vllm  # noqa: F401
    return GENERATION_BACKENDS.get(view.cfg.generation.backend)(view, learner, generator)
