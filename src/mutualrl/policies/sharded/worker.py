"""One rank of a policy worker whose learner is sharded: ``ShardedPolicy``.

The executor starts one per rank and sends every call to all of them (``workers.ranks``);
each implements the whole ``PolicyWorker`` protocol, and rank 0's answer is the worker's:

* ``generate``: rank 0 samples from its copy of the weights (``mirror``) with the policy's
  generation backend; the other ranks answer nothing and wait for the next call;
* ``update`` / ``sft_step``: every rank takes its share of each step (``policies.ranks``), then
  all refresh rank 0's copy (gathered per parameter) and probe it;
* ``sequence_logprobs``: every rank runs the sharded model on the whole request;
* ``save_checkpoint`` / ``restore_checkpoint``: ``torch.distributed.checkpoint`` (``policies.dcp``);
  a one-rank checkpoint restores too (read by rank 0, broadcast to the shards);
* ``save_state`` / ``load_state``: files in the one-rank format (the warm-start cache);
* ``save``: rank 0 writes its copy as a ``from_pretrained`` folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig
from mutualrl.policies.batch import SFTExample, TrainBatch
from mutualrl.policies.checkpoints import save_pretrained_quietly
from mutualrl.policies.dcp import (
    full_state,
    is_sharded_checkpoint,
    load_full_state,
    load_sharded,
    save_sharded,
)
from mutualrl.policies.device_memory import peak_memory_stats
from mutualrl.policies.generation import GenerationBackend, build_backend, close_backend
from mutualrl.policies.learner import Learner
from mutualrl.policies.models import TokenizerFacts
from mutualrl.policies.policy import PolicyView, sample, step_stats, tokenizer_spec
from mutualrl.policies.sharded.fsdp import Sharded, settle
from mutualrl.policies.sharded.mirror import MirrorSource, WeightMirror
from mutualrl.retokenize.loaders import load_tokenizer
from mutualrl.storage import atomic_folder


class ShardedPolicy:
    """Rank ``rank`` of ``world`` of a policy worker (see the module docstring). Only rank 0
    loads the tokenizer and holds a generation backend; ``facts`` gives the others what the
    model is built from."""

    def __init__(
        self,
        cfg: PolicyConfig,
        grpo: GRPOConfig,
        seed: int,
        facts: TokenizerFacts,
        rank: int,
        world: int,
        device: str = "cpu",
        total_steps: int | None = None,
        training: TrainingConfig | None = None,
    ) -> None:
        self.cfg, self.grpo, self.name, self.rank = cfg, grpo, cfg.name, rank
        self.facts = facts
        placement = Sharded(rank, world, device, cfg.sharding)
        self.learner = Learner(cfg, grpo, facts, seed, device, total_steps, training, placement)
        self.mirror = WeightMirror(self.learner, placement.full)
        self.generator = torch.Generator().manual_seed(seed)
        # rank 0 samples, from its whole copy of the model (placement.full; None elsewhere)
        self.view: PolicyView | None = None
        self.backend: GenerationBackend | None = None
        if rank == 0:
            self.view = PolicyView(cfg, load_tokenizer(tokenizer_spec(cfg)))
            full = cast(torch.nn.Module, placement.full)
            self.backend = build_backend(
                self.view, MirrorSource(self.learner, full), self.generator
            )
        # the mismatch correction recomputes log-probs, a collective: every rank must agree on it
        exact = [self.backend.exact_logprobs if self.backend is not None else None]
        dist.broadcast_object_list(exact, src=0)
        self.inexact_sampler = not exact[0]

    def close(self) -> None:
        """As ``Policy.close``: rank 0's backend releases what it keeps outside the process."""
        if self.backend is not None:
            close_backend(self.backend)

    @property
    def version(self) -> int:
        return self.learner.version

    # ---- sampling -------------------------------------------------------------------------
    def generate(self, prompts, num_generations: int, max_new_tokens: int, temperature: float):
        if self.rank != 0:
            return []
        return sample(
            cast(PolicyView, self.view),
            self.backend,
            self.grpo,
            prompts,
            num_generations,
            max_new_tokens,
            temperature,
        )

    def sequence_logprobs(self, prompts, completions) -> torch.Tensor:
        out = self.learner.sequence_logprobs(prompts, completions)
        settle(self.learner.model)
        return out

    # ---- updates --------------------------------------------------------------------------
    def _sync(self) -> dict[str, float]:
        """Rank 0's copy and its engine take the new weights (every rank gathers)."""
        stats = self.mirror.sync(self.facts.vocab_size)
        if self.backend is not None:
            stats.update(self.backend.load_weights(self.version) or {})
        return stats

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        stats = self.learner.train_step(batch, correct_mismatch=self.inexact_sampler)
        stats.update(self._sync())
        return stats

    def update(self, batches: list[TrainBatch]) -> tuple[dict[str, float], int]:
        """The step's stats (rank 0's peak accelerator memory among them) and the new version."""
        stats = step_stats(batches, self.train_step, self.learner)
        stats.update(peak_memory_stats(self.learner.device))
        return stats, self.version

    def sft_step(
        self, examples: tuple[SFTExample, ...], learning_rate: float | None = None
    ) -> float:
        loss = self.learner.sft_step(examples, learning_rate)
        self._sync()
        return loss

    def freeze_reference(self) -> None:
        self.learner.freeze_reference()

    # ---- persistence ----------------------------------------------------------------------
    def save_state(self, path: str | Path) -> None:
        """The whole state in ``Policy.save_state``'s format, written by rank 0."""
        state = full_state(self.learner)
        if state is not None:
            torch.save({"name": self.name, **state, "generator": self.generator.get_state()}, path)

    def load_state(self, path: str | Path) -> None:
        """Continue from a ``Policy.save_state`` (or ``save_state``) file; rank 0 reads it."""
        state = torch.load(path, map_location="cpu", weights_only=True) if self.rank == 0 else None
        if state is not None and state.get("name") != self.name:
            raise ValueError(
                f"{path}: holds the state of policy {state.get('name')!r}, not {self.name!r}"
            )
        self._loaded(load_full_state(self.learner, state))

    def save_checkpoint(self, directory: str | Path) -> None:
        save_sharded(self.learner, directory, {"generator": self.generator.get_state()})

    def restore_checkpoint(self, directory: str | Path) -> None:
        """From a sharded checkpoint of any rank count, or from a one-rank policy's."""
        d = Path(directory)
        if is_sharded_checkpoint(d):
            self._loaded(load_sharded(self.learner, d))
            return
        first = self.rank == 0
        state = torch.load(d / "state.pt", map_location="cpu", weights_only=True) if first else None
        ref_file = d / "reference.pt"
        reference = (
            torch.load(ref_file, map_location="cpu", weights_only=True)
            if first and ref_file.is_file()
            else None
        )
        self._loaded(load_full_state(self.learner, state, reference))

    def _loaded(self, small: dict) -> None:
        if self.rank == 0:
            self.generator.set_state(small["generator"].cpu())
        self._sync()

    def save(self, directory: str | Path) -> Path:
        """The fp32 weights, gathered whole to rank 0 tensor by tensor, as a ``from_pretrained``
        folder ``directory/<name>`` (rank 0's copy gives the structure), complete or absent."""
        path = Path(directory) / self.name
        state = get_model_state_dict(
            self.learner.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            with atomic_folder(path, f"policy {self.name!r}", within=directory) as tmp:
                view = cast(PolicyView, self.view)
                save_pretrained_quietly(self.mirror.full, tmp, view.tokenizer, state)
        return path


def build_rank(
    cfg: PolicyConfig,
    grpo: GRPOConfig,
    seed: int,
    facts: TokenizerFacts,
    device: str,
    total_steps: int | None,
    training: TrainingConfig | None,
    ctx,
) -> ShardedPolicy:
    """A rank's worker, from the executor's ``RankContext`` (``workers.ranks``): a picklable
    factory with ``functools.partial``."""
    return ShardedPolicy(
        cfg, grpo, seed, facts, ctx.rank, ctx.world_size, device, total_steps, training
    )
