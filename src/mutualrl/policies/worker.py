"""What the run may ask of a policy worker: one typed protocol, one call class per request.

``PolicyWorker`` is the interface a policy worker implements (``Policy`` does); each call below is
a frozen dataclass of the request's arguments that applies itself to a worker. Every executor
kind (local threads, Ray actors) takes the same call objects (``workers.calls``), so the path
of the data can be read from the call sites: ``call_live(executor, Generate(...))`` is
``PolicyWorker.generate`` on every live policy, wherever it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from mutualrl.policies.batch import SFTExample, TrainBatch
    from mutualrl.policies.samples import Sample
    from mutualrl.tasks.base import Prompt


class PolicyWorker(Protocol):
    """The calls a policy worker accepts (``Policy`` implements them)."""

    def generate(
        self, prompts: list[Prompt], num_generations: int, max_new_tokens: int, temperature: float
    ) -> list[Sample]: ...

    def sequence_logprobs(
        self, prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]]
    ) -> torch.Tensor: ...

    def update(self, batches: list[TrainBatch]) -> tuple[dict[str, float], int]: ...

    def update_and_generate(
        self,
        batches: list[TrainBatch],
        prompts: list[Prompt],
        num_generations: int,
        max_new_tokens: int,
        temperature: float,
    ) -> tuple[dict[str, float], int, list[Sample]]: ...

    def sft_step(
        self, examples: tuple[SFTExample, ...], learning_rate: float | None = None
    ) -> float: ...

    def freeze_reference(self) -> None: ...

    def save(self, directory: str | Path) -> Path: ...

    def save_checkpoint(self, directory: str | Path) -> None: ...

    def restore_checkpoint(self, directory: str | Path) -> None: ...

    def save_state(self, path: str | Path) -> None: ...

    def load_state(self, path: str | Path) -> None: ...

    def close(self) -> None:
        """The run is done with the worker (called once by its executor; not in a worker
        process killed after a failure): release what it keeps outside its process. Optional
        for other worker kinds."""


@dataclass(frozen=True)
class Generate:
    """``num_generations`` completions per prompt at ``temperature`` (0: greedy): [Sample]."""

    prompts: list
    num_generations: int
    max_new_tokens: int
    temperature: float

    def __call__(self, worker: PolicyWorker) -> list[Sample]:
        return worker.generate(
            self.prompts, self.num_generations, self.max_new_tokens, self.temperature
        )


@dataclass(frozen=True)
class SequenceLogprobs:
    """Total log-prob of each completion (token ids) after its prompt: (B,) tensor."""

    prompts: list
    completions: list

    def __call__(self, worker: PolicyWorker) -> torch.Tensor:
        return worker.sequence_logprobs(self.prompts, self.completions)


@dataclass(frozen=True)
class Update:
    """One step's batches in order: (merged stats, version of the weights after them)."""

    batches: list

    def __call__(self, worker: PolicyWorker) -> tuple[dict[str, float], int]:
        return worker.update(self.batches)


@dataclass(frozen=True)
class UpdateAndGenerate:
    """``Update``, while ``generate`` draws the next step's samples from the weights before it
    (``allocation.async_generation``): (merged stats, version after, [Sample])."""

    batches: list
    generate: Generate

    def __call__(self, worker: PolicyWorker) -> tuple[dict[str, float], int, list[Sample]]:
        g = self.generate
        return worker.update_and_generate(
            self.batches, g.prompts, g.num_generations, g.max_new_tokens, g.temperature
        )


@dataclass(frozen=True)
class SFTStep:
    """A supervised step on demonstrations, at ``learning_rate`` (None: the optimizer's): loss."""

    examples: tuple
    learning_rate: float | None = None

    def __call__(self, worker: PolicyWorker) -> float:
        return worker.sft_step(self.examples, self.learning_rate)


@dataclass(frozen=True)
class FreezeReference:
    """Make the KL reference the weights as they are now (after the warm start)."""

    def __call__(self, worker: PolicyWorker) -> None:
        return worker.freeze_reference()


@dataclass(frozen=True)
class SavePretrained:
    """The policy as a ``from_pretrained`` folder ``directory/<name>``: its path."""

    directory: str

    def __call__(self, worker: PolicyWorker) -> Path:
        return worker.save(self.directory)


@dataclass(frozen=True)
class SaveCheckpoint:
    """The policy's part of a run checkpoint, into ``directory``."""

    directory: str

    def __call__(self, worker: PolicyWorker) -> None:
        return worker.save_checkpoint(self.directory)


@dataclass(frozen=True)
class RestoreCheckpoint:
    """Continue from the policy's part of a run checkpoint in ``directory``."""

    directory: str

    def __call__(self, worker: PolicyWorker) -> None:
        return worker.restore_checkpoint(self.directory)


@dataclass(frozen=True)
class SaveState:
    """The policy's whole state (learner and sampler) as one file at ``path``."""

    path: str

    def __call__(self, worker: PolicyWorker) -> None:
        return worker.save_state(self.path)


@dataclass(frozen=True)
class LoadState:
    """Continue from a ``SaveState`` file."""

    path: str

    def __call__(self, worker: PolicyWorker) -> None:
        return worker.load_state(self.path)
