"""What generation produces: one completion of one prompt by one policy."""

from __future__ import annotations

from dataclasses import dataclass

from mutualrl.tasks.base import Prompt


@dataclass(frozen=True)
class Sample:
    """One completion of one prompt by one policy."""

    prompt: Prompt
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]  # includes EOS when finish_reason == "stop"
    logprobs: tuple[
        float, ...
    ]  # behaviour log-probs of the (tempered, truncated) distribution sampled
    text: str  # completion text, special tokens removed
    finish_reason: str  # "stop" | "length"
    group: int  # index of the prompt within the step
    reward: float = 0.0
    # Version of the weights that generated it (the engine's, for a vLLM backend); None: the
    # policy's version when published.
    policy_version: int | None = None
