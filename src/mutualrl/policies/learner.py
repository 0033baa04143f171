"""A policy's learner: the one owner of its model, optimizer, schedule, KL reference and version.

Everything that changes the weights goes through here: GRPO (+SFT) updates on ``TrainBatch``es and
plain supervised steps, each changing nothing but this object's state. The learner runs each
optimizer step itself (zero the gradients, accumulate them, clip, step or skip, advance the
schedule), as a training recipe does; what it computes comes from two objects that hold settings
only and are handed the model at every call: its ``LogProbs`` (``policies.logprobs``: logits,
per-token log-probs, precision) and its ``Objective`` (``policies.update``: a batch's parts, the
losses and their gradients within bounded memory). Generation backends and the mismatch
correction get the log-prob functions they need, never the whole policy. A learner knows nothing
of tokenizers beyond the facts its model is built from, of sampling, or of other policies.

Where its model lives is its *placement*, asked once when the learner is built: ``OnDevice`` (the
whole model on one device, the default) or a rank of a sharded learner
(``policies.sharded.fsdp.Sharded``), which also says which micro-batches of each step are this
rank's (``policies.ranks``). Everything else is the same code for both.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch

from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig
from mutualrl.policies.batch import SFTExample, TrainBatch
from mutualrl.policies.logprobs import LogProbs
from mutualrl.policies.models import TokenizerFacts, build_model
from mutualrl.policies.ranks import ONE_RANK, RankShare
from mutualrl.policies.update import (
    GRPOParts,
    Objective,
    SFTParts,
    clip_gradients,
    make_optimizer,
    prepare_model,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Seeded initialisation draws from torch's global RNG (forked, seeded per policy); learners built
# concurrently in threads would interleave their draws, so building is serialised.
_BUILD_LOCK = threading.Lock()


def _on_device(
    cfg: PolicyConfig, facts: TokenizerFacts, seed: int, device: torch.device
) -> torch.nn.Module:
    """The seeded model (random or the checkpoint), with its LoRA adapter when asked for."""
    model = build_model(cfg, facts, seed).to(device)
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        # the adapter's initialisation is seeded by the policy too, wherever it is built
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(
                model,
                LoraConfig(
                    r=cfg.lora.r,
                    lora_alpha=cfg.lora.alpha,
                    lora_dropout=cfg.lora.dropout,
                    target_modules=list(cfg.lora.target_modules),
                    task_type="CAUSAL_LM",
                ),
            )
    return model


class Placement(Protocol):
    """Where a learner's model lives: built once, with its KL reference; which micro-batches are
    this process's; whether forward passes run under bf16 autocast (a bf16 policy on one device)
    or the model casts itself."""

    @property
    def share(self) -> RankShare: ...

    @property
    def autocast(self) -> bool: ...

    @property
    def collective(self) -> bool:
        """Whether a forward pass is a collective call every rank must make alike."""
        ...

    def build(
        self, learner: Learner, facts: TokenizerFacts, seed: int
    ) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """(model, frozen KL reference or None), each on ``learner.device``."""
        ...


class OnDevice:
    """The whole model on the learner's device, in this process."""

    share: RankShare = ONE_RANK
    autocast = True
    collective = False

    def build(
        self, learner: Learner, facts: TokenizerFacts, seed: int
    ) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        # Seeded initialisation draws from torch's global RNG: built one learner at a time.
        with _BUILD_LOCK:
            model = _on_device(learner.cfg, facts, seed, learner.device)
        # beta == 0 builds no reference at all; a LoRA policy's reference is its adapter disabled.
        reference = None
        if learner.grpo.beta > 0 and learner.cfg.lora is None:
            reference = copy.deepcopy(model).eval().requires_grad_(False)
        prepare_model(model, learner.training)
        return model, reference


class Learner:
    def __init__(
        self,
        cfg: PolicyConfig,
        grpo: GRPOConfig,
        facts: TokenizerFacts,
        seed: int,
        device: str = "cpu",
        total_steps: int | None = None,
        training: TrainingConfig | None = None,
        placement: Placement | None = None,
    ) -> None:
        """``total_steps``: the optimizer steps the learning-rate schedule spans (the run's
        steps x num_iterations); only a schedule other than "constant" needs it. ``training``:
        optimizer, schedule and memory settings (None: the defaults). ``placement``: where the
        model lives (None: ``OnDevice``)."""
        self.cfg, self.grpo, self.name = cfg, grpo, cfg.name
        self.training = training or TrainingConfig()
        self.pad_id = facts.pad_token_id
        self.device = torch.device(device)
        self.placement: Placement = placement or OnDevice()
        self.model, self.reference = self.placement.build(self, facts, seed)
        self.optimizer, self.scheduler = make_optimizer(
            self.model, cfg, grpo, self.training, total_steps
        )
        self.version = 0  # of the weights: +1 per update (not per SFT step)
        self.skipped_nan_steps = 0
        # A sharded model casts to bf16 itself (FSDP2's mixed precision): only an unsharded one
        # runs under autocast.
        self.logprobs = LogProbs(
            self.name,
            self.device,
            self.pad_id,
            grpo,
            self.training,
            bf16=cfg.dtype == "bf16" and self.placement.autocast,
            shared_prefix=self.training.shared_prefix
            and not self.training.gradient_checkpointing
            and not self.placement.collective,
        )
        self.objective = Objective(grpo, self.training, self.logprobs, self.placement.share)

    def sequence_logprobs(
        self, prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]]
    ) -> torch.Tensor:
        """Total log-prob of each completion under the current weights: (B,). Off-policy ratios."""
        self.model.eval()
        return self.logprobs.sequence_logprobs(self.model, prompts, completions)

    # ---- updates --------------------------------------------------------------------------
    @contextlib.contextmanager
    def learning_rate(self, learning_rate: float | None):
        """Run the optimizer at ``learning_rate`` inside the block (None: unchanged)."""
        if learning_rate is None:
            # nothing to restore: the schedule may move the rate inside the block
            yield
            return
        saved = [grp["lr"] for grp in self.optimizer.param_groups]
        for grp in self.optimizer.param_groups:
            grp["lr"] = learning_rate
        try:
            yield
        finally:
            for grp, lr in zip(self.optimizer.param_groups, saved):
                grp["lr"] = lr

    @contextlib.contextmanager
    def update_attention(self):
        """The training steps' attention kernel (``policies.*.train_attn_implementation``: GRPO
        updates and SFT steps) inside the block, the model's own again after it (switching is a
        config flag: well under 1 ms)."""
        want = self.cfg.train_attn_implementation
        model = cast("PreTrainedModel", self.model)  # a transformers model (or a PEFT one)
        before = model.config._attn_implementation
        if want is None or want == before:
            yield
            return
        model.set_attn_implementation(want)
        try:
            yield
        finally:
            model.set_attn_implementation(before)

    def train_step(self, batch: TrainBatch, correct_mismatch: bool = False) -> dict[str, float]:
        """One update (``num_iterations`` optimizer steps) on a batch; NaN losses are skipped,
        counted. The schedule advances once per optimizer step at the policy's learning rate
        (not for a batch that sets its own). ``correct_mismatch``: the behaviour log-probs came
        from an inexact sampler (``generation.mismatch``)."""
        with self.learning_rate(batch.learning_rate), self.update_attention():
            self.model.train()
            stats, t0 = {}, time.perf_counter()
            grpo = (
                self.objective.grpo_parts(self.model, self.reference, batch, correct_mismatch)
                if batch.sequences
                else None
            )
            sft = self.objective.sft_parts(batch.sft) if batch.sft and batch.sft_coef > 0 else None
            if grpo is not None:
                stats.update(grpo.stats)
            if grpo is not None and batch.diagnose_sources:
                stats.update(self.objective.source_gradients(self.model, self.optimizer, grpo))
            for _ in range(self.grpo.num_iterations):
                stats.update(self._optimizer_step(grpo, sft, batch.sft_coef))
                if batch.learning_rate is None:
                    self._advance_schedule()
            self.version += 1
            stats["step_time_s"] = time.perf_counter() - t0
            return stats

    def sft_step(
        self, examples: tuple[SFTExample, ...], learning_rate: float | None = None
    ) -> float:
        """A plain supervised step (warm start) at the optimizer's current learning rate, or at
        ``learning_rate`` for this step; the schedule does not advance."""
        self.model.train()
        with self.learning_rate(learning_rate), self.update_attention():
            stats = self._optimizer_step(None, self.objective.sft_parts(examples), 1.0)
        return stats.get("sft_loss", stats["loss"])

    def _optimizer_step(
        self, grpo: GRPOParts | None, sft: SFTParts | None, coef: float
    ) -> dict[str, float]:
        """One optimizer step on the objective's gradients: clipped, then taken, or skipped
        (and counted) when a loss or the gradient norm is not finite."""
        self.optimizer.zero_grad(set_to_none=True)
        grads = self.objective.backward(self.model, grpo, sft, coef)
        stats, loss = grads.stats, grads.stats["loss"]
        if not grads.finite:
            stats.update(self._skip(float("nan")))
        elif not grads.present:
            # nothing in the batch depends on the parameters (no sequences, SFT weight 0)
            stats.update({"loss": loss, "skipped_empty": 1.0})
        else:
            norm = clip_gradients(self.model, self.training.max_grad_norm)
            if not torch.isfinite(norm):
                stats.update(self._skip(loss))
            else:
                self.optimizer.step()
                stats.update({"loss": loss, "grad_norm": float(norm), "skipped_nan": 0.0})
        return stats

    def _skip(self, loss: float) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_nan_steps += 1
        return {"loss": loss, "skipped_nan": 1.0}

    def _advance_schedule(self) -> None:
        # The schedule counts update attempts, skipped ones too (as transformers' Trainer does),
        # so a run's rates do not depend on which steps were skipped; torch warns when a
        # skipped step precedes it (or optimizer.step is wrapped), which is intended here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            warnings.filterwarnings(
                "ignore", message=r"Seems like `optimizer\.step\(\)` has been overridden"
            )
            self.scheduler.step()

    def freeze_reference(self) -> None:
        """Make the KL reference the policy as it is now: RL's reference is the model RL starts
        from, i.e. after the warm start, as TRL's is the model handed to the trainer. A LoRA
        policy's reference stays its base (the adapter disabled)."""
        if self.reference is not None:
            self.reference.load_state_dict(self.model.state_dict())

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Weights, optimizer moments, the schedule, the version and the skipped-step count."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "skipped_nan_steps": self.skipped_nan_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:  # files written before schedules existed have none
            self.scheduler.load_state_dict(state["scheduler"])
        self.version, self.skipped_nan_steps = (
            int(state["version"]),
            int(state["skipped_nan_steps"]),
        )

    def save_reference(self, path: Path) -> None:
        """The frozen KL reference (after the warm start it differs from every other weights)."""
        if self.reference is not None:
            torch.save(self.reference.state_dict(), path)

    def load_reference(self, path: Path) -> None:
        if self.reference is not None:
            self.reference.load_state_dict(
                torch.load(path, map_location=self.device, weights_only=True)
            )
