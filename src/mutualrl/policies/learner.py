"""A policy's learner: the one owner of its model, optimizer, schedule, KL reference and version.

Everything that changes the weights goes through here: GRPO (+SFT) updates on ``TrainBatch``es and
plain supervised steps, each bumping nothing but this object's state. Its ``UpdateEngine``
(``policies.update``) is how a batch becomes optimizer steps within bounded memory; generation
backends and the mismatch correction get the log-prob functions they need from here, never the
whole policy. A learner knows nothing of tokenizers beyond the facts its model is built from, of
sampling, or of other policies.

Where its model lives is its *placement*, asked once when the learner is built: ``OnDevice`` (the
whole model on one device, the default) or a rank of a sharded learner
(``policies.sharded.fsdp.Sharded``), which also says which micro-batches of each step are this
rank's (``policies.ranks``). Everything else is the same code for both.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from pathlib import Path
from typing import Protocol

import torch

from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig
from mutualrl.policies.batch import SFTExample, TrainBatch
from mutualrl.policies.models import TokenizerFacts, build_model
from mutualrl.policies.ranks import ONE_RANK, RankShare
from mutualrl.policies.sampling import truncate_logits, truncates
from mutualrl.policies.update import UpdateEngine, make_optimizer, prepare_model

# Seeded initialisation draws from torch's global RNG (forked, seeded per policy); learners built
# concurrently in threads would interleave their draws, so building is serialised.
_BUILD_LOCK = threading.Lock()


def _on_device(cfg: PolicyConfig, facts: TokenizerFacts, seed: int,
               device: torch.device) -> torch.nn.Module:
    """The seeded model (random or the checkpoint), with its LoRA adapter when asked for."""
    model = build_model(cfg, facts, seed).to(device)
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model
        # the adapter's initialisation is seeded by the policy too, wherever it is built
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, LoraConfig(
                r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM"))
    return model


class Placement(Protocol):
    """Where a learner's model lives: built once, with its KL reference; which micro-batches are
    this process's; whether forward passes run under bf16 autocast (a bf16 policy on one device)
    or the model casts itself."""

    share: RankShare
    autocast: bool

    def build(self, learner: Learner, facts: TokenizerFacts,
              seed: int) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """(model, frozen KL reference or None), each on ``learner.device``."""
        ...


class OnDevice:
    """The whole model on the learner's device, in this process."""

    share = ONE_RANK
    autocast = True

    def build(self, learner: Learner, facts: TokenizerFacts, seed: int):
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
    def __init__(self, cfg: PolicyConfig, grpo: GRPOConfig, facts: TokenizerFacts, seed: int,
                 device: str = "cpu", total_steps: int | None = None,
                 training: TrainingConfig | None = None, placement: Placement | None = None) -> None:
        """``total_steps``: the optimizer steps the learning-rate schedule spans (the run's
        steps x num_iterations); only a schedule other than "constant" needs it. ``training``:
        optimizer, schedule and memory settings (None: the defaults). ``placement``: where the
        model lives (None: ``OnDevice``)."""
        self.cfg, self.grpo, self.name = cfg, grpo, cfg.name
        self.training = training or TrainingConfig()
        self.pad_id = facts.pad_token_id
        self.device = torch.device(device)
        self.placement = placement or OnDevice()
        self.model, self.reference = self.placement.build(self, facts, seed)
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg, grpo, self.training,
                                                        total_steps)
        self.version = 0               # of the weights: +1 per update (not per SFT step)
        self.skipped_nan_steps = 0
        self.engine = UpdateEngine(self)

    # ---- log-probs ------------------------------------------------------------------------
    def completion_logits(self, c, model=None, temperature: float | None = None) -> torch.Tensor:
        """Logits predicting each completion token: (B, T, V), computed only at those positions.

        Divided by ``temperature`` (default: the sampling temperature, so log-probs are those of
        the distribution the samples came from; SFT passes 1)."""
        model = model or self.model
        L, T = c.input_ids.shape[1], c.completion_len
        # The logits at positions L-T-1 .. L-2 predict the T completion tokens. Asking the model
        # for exactly those (not the last T+1, then slicing) spares a (B, T+1, V) copy forward
        # and a zero-filled one in backward: with a 129k vocabulary these passes cost as much
        # as the LM head itself.
        keep = torch.arange(L - T - 1, L - 1, device=self.device)
        out = model(input_ids=c.input_ids.to(self.device), attention_mask=c.attention_mask.to(self.device),
                    position_ids=c.position_ids.to(self.device), logits_to_keep=keep)
        logits = out.logits.float()
        g = self.grpo
        if temperature is None and truncates(g.top_k, g.top_p):
            # the sampling distribution is truncated: take log-probs under the same truncation
            return truncate_logits(logits.div_(g.temperature), g.top_k, g.top_p,
                                   keep=c.completion_ids.to(self.device))
        temperature = temperature or g.temperature
        # In place: the LM head's backward needs its input and weight, not its output.
        return logits.div_(temperature) if temperature != 1 else logits

    def sequence_logprobs(self, prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]]) -> torch.Tensor:
        """Total log-prob of each completion under the current weights: (B,). Off-policy ratios."""
        return self.engine.sequence_logprobs(prompts, completions)

    def batch_logprobs(self, c) -> torch.Tensor:
        """(B, T) log-probs of a whole collated batch, micro-batch by micro-batch (no grad)."""
        return self.engine.batch_logprobs(c)

    def autocast(self):
        """The policy's compute precision for a forward pass (bf16 autocast or nothing)."""
        return self.engine.autocast()

    # ---- updates --------------------------------------------------------------------------
    def sft_loss(self, examples: tuple[SFTExample, ...]) -> torch.Tensor:
        """Mean token negative log-likelihood of ``examples`` (completion tokens only)."""
        return self.engine.sft_total_loss(examples)

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

    def train_step(self, batch: TrainBatch, correct_mismatch: bool = False) -> dict[str, float]:
        """One update (``num_iterations`` optimizer steps) on a batch; NaN losses are skipped,
        counted. ``correct_mismatch``: the behaviour log-probs came from an inexact sampler."""
        with self.learning_rate(batch.learning_rate):
            return self.engine.train_step(batch, correct_mismatch)

    def sft_step(self, examples: tuple[SFTExample, ...], learning_rate: float | None = None) -> float:
        """A plain supervised step (warm start); ``learning_rate`` overrides the optimizer's for it."""
        self.model.train()
        with self.learning_rate(learning_rate):
            return self.engine.sft_step(examples)

    def freeze_reference(self) -> None:
        """Make the KL reference the policy as it is now: RL's reference is the model RL starts
        from, i.e. after the warm start, as TRL's is the model handed to the trainer. A LoRA
        policy's reference stays its base (the adapter disabled)."""
        if self.reference is not None:
            self.reference.load_state_dict(self.model.state_dict())

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Weights, optimizer moments, the schedule, the version and the skipped-step count."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "version": self.version,
                "skipped_nan_steps": self.skipped_nan_steps}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:   # files written before schedules existed have none
            self.scheduler.load_state_dict(state["scheduler"])
        self.version, self.skipped_nan_steps = int(state["version"]), int(state["skipped_nan_steps"])

    def save_reference(self, path: Path) -> None:
        """The frozen KL reference (after the warm start it differs from every other weights)."""
        if self.reference is not None:
            torch.save(self.reference.state_dict(), path)

    def load_reference(self, path: Path) -> None:
        if self.reference is not None:
            self.reference.load_state_dict(torch.load(path, map_location=self.device, weights_only=True))
