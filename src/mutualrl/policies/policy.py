"""A policy: model + tokenizer + optimizer (+ frozen reference), and what can be done with it.

It samples completions with behaviour log-probs, takes GRPO (+SFT) updates on ``TrainBatch``es,
evaluates pass@k, and saves/loads itself. It knows nothing of strategies or other policies.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from pathlib import Path

import torch

from mutualrl.config import GRPOConfig, PolicyConfig
from mutualrl.policies.batch import SFTExample, TrainBatch
from mutualrl.policies.checkpoints import save_pretrained_quietly
from mutualrl.policies.models import TokenizerFacts, build_model
from mutualrl.policies.prompting import chat_prompt
from mutualrl.policies.generation import SamplingSettings, build_backend
from mutualrl.policies.samples import Sample
from mutualrl.policies.sampling import truncate_logits, truncates
from mutualrl.policies.update import UpdateEngine, make_optimizer, prepare_model
from mutualrl.retokenize.loaders import TokenizerHandle, load_tokenizer
from mutualrl.tasks.base import Prompt


class PolicyView:
    """The driver's side of a policy: its config, tokenizer and prompt encodings, and the version
    of its weights as last reported. No model: the loop holds one of these for every policy whose
    weights live in a worker process; a ``Policy`` is one too (what in-process executors run)."""

    def __init__(self, cfg: PolicyConfig, handle: TokenizerHandle) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.handle = handle
        self.tokenizer = handle.tokenizer
        self.chat = chat_prompt(cfg, self.tokenizer)  # None: raw text (the default)
        self.version = 0

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        if self.chat is not None:
            return self.chat.encode(text)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        return tuple(([bos] if bos is not None else []) + ids)

    def encode_completion(self, text: str, eos: bool = True) -> tuple[int, ...]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return tuple(ids + ([self.tokenizer.eos_token_id] if eos else []))


def load_handles(cfgs: list[PolicyConfig]) -> dict[str, TokenizerHandle]:
    """Each distinct tokenizer of ``cfgs`` loaded once, by its spec."""
    return {spec: load_tokenizer(spec) for spec in dict.fromkeys(p.tokenizer for p in cfgs)}


# Seeded initialisation draws from torch's global RNG (forked, seeded per policy); policies built
# concurrently in threads would interleave their draws, so building is serialised.
_BUILD_LOCK = threading.Lock()


class Policy(PolicyView):
    def __init__(self, cfg: PolicyConfig, grpo: GRPOConfig, seed: int, device: str = "cpu",
                 handle: TokenizerHandle | None = None, total_steps: int | None = None) -> None:
        """``total_steps``: the optimizer steps the learning-rate schedule spans (the run's
        steps x num_iterations); only a schedule other than "constant" needs it."""
        super().__init__(cfg, handle or load_tokenizer(cfg.tokenizer))
        self.grpo = grpo
        self.device = torch.device(device)
        with _BUILD_LOCK:
            self.model = self._build_model(seed)
        # beta == 0 builds no reference at all; a LoRA policy's reference is its adapter disabled.
        self.reference = None
        if grpo.beta > 0 and cfg.lora is None:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        prepare_model(self.model, grpo)
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg, grpo, total_steps)
        self.updater = UpdateEngine(self)
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped_nan_steps = 0
        self.backend = build_backend(self)

    def _build_model(self, seed: int) -> torch.nn.Module:
        cfg = self.cfg
        model = build_model(cfg, TokenizerFacts.of(self.tokenizer), seed).to(self.device)
        if cfg.lora is not None:
            from peft import LoraConfig, get_peft_model
            # the adapter's initialisation is seeded by the policy too, wherever it is built
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = get_peft_model(model, LoraConfig(
                    r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                    target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM"))
        return model

    # ---- sampling -------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt], num_generations: int, max_new_tokens: int,
                 temperature: float) -> list[Sample]:
        """Sample ``num_generations`` completions per prompt with this policy's generation
        backend (``cfg.generation.backend``); temperature 0 is greedy."""
        g = self.grpo
        settings = SamplingSettings(num_generations, max_new_tokens, temperature, top_p=g.top_p,
                                    top_k=g.top_k, batch_size=g.generation_batch_size)
        return self.backend.generate(prompts, [self.encode_prompt(p.text) for p in prompts], settings)

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
        """Total log-prob of each completion under the current policy: (B,). Used for off-policy ratios."""
        return self.updater.sequence_logprobs(prompts, completions)

    # ---- updates --------------------------------------------------------------------------
    def sft_loss(self, examples: tuple[SFTExample, ...]) -> torch.Tensor:
        """Mean token negative log-likelihood of ``examples`` (completion tokens only)."""
        parts = self.updater._sft_parts(examples)
        return sum(self.updater.sft_loss(parts, k) for k in range(len(parts.slices)))

    @contextlib.contextmanager
    def _learning_rate(self, learning_rate: float | None):
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

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One update (``num_iterations`` optimizer steps) on a batch; NaN losses are skipped, counted."""
        with self._learning_rate(batch.learning_rate):
            stats = self.updater.train_step(batch)
        self.backend.load_weights(self.version)   # the generation engine samples the new weights
        return stats

    def train_steps(self, batches: list[TrainBatch]) -> dict[str, float]:
        """Every batch of one step in order; later batches' stats are prefixed by their tag."""
        merged: dict[str, float] = {}
        for batch in batches:
            for k, v in self.train_step(batch).items():
                merged[k if batch.tag == "grpo" else f"{batch.tag}/{k}"] = v
        merged["skipped_nan_total"] = self.skipped_nan_steps
        return merged

    def update(self, batches: list[TrainBatch]) -> tuple[dict[str, float], int]:
        """``train_steps``, and the version of the weights after it (for callers in other processes)."""
        return self.train_steps(batches), self.version

    def sft_step(self, examples: tuple[SFTExample, ...], learning_rate: float | None = None) -> float:
        """A plain supervised step (warm start); ``learning_rate`` overrides the optimizer's for it."""
        self.model.train()
        with self._learning_rate(learning_rate):
            loss = self.updater.sft_step(examples)
        self.backend.load_weights(self.version)
        return loss

    # ---- persistence ----------------------------------------------------------------------
    def save_state(self, path: str | Path) -> None:
        """Everything a later run needs to continue exactly from here: weights, optimizer moments,
        the learning-rate schedule, the sampler's generator, the version and the skipped-step
        count (one torch file; readers ignore keys they do not know)."""
        torch.save({"name": self.name, "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "generator": self.generator.get_state(),
                    "version": self.version, "skipped_nan_steps": self.skipped_nan_steps}, path)

    def load_state(self, path: str | Path) -> None:
        """Continue from a ``save_state`` file of a policy with the same config."""
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)
        except Exception as exc:   # unpickling errors have no common base; name the file
            raise ValueError(f"{path}: not a policy state file ({type(exc).__name__}: {exc})") from exc
        if not isinstance(state, dict) or state.get("name") != self.name:
            held = state.get("name") if isinstance(state, dict) else None
            raise ValueError(f"{path}: holds the state of policy {held!r}, not {self.name!r}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:   # files written before schedules existed have none
            self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"].cpu())
        self.version, self.skipped_nan_steps = int(state["version"]), int(state["skipped_nan_steps"])
        self.backend.load_weights(self.version)

    def save_checkpoint(self, directory: str | Path) -> None:
        """This policy's part of a run checkpoint: ``save_state`` plus the frozen KL reference
        (after the warm start it differs from both the initial and the current weights)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.save_state(d / "state.pt")
        if self.reference is not None:
            torch.save(self.reference.state_dict(), d / "reference.pt")

    def restore_checkpoint(self, directory: str | Path) -> None:
        """Continue from ``save_checkpoint``: weights, optimizer, sampler, version, reference."""
        d = Path(directory)
        self.load_state(d / "state.pt")
        if self.reference is not None:
            self.reference.load_state_dict(
                torch.load(d / "reference.pt", map_location=self.device, weights_only=True))

    def freeze_reference(self) -> None:
        """Make the KL reference the policy as it is now: RL's reference is the model RL starts
        from, i.e. after the warm start, as TRL's is the model handed to the trainer. A LoRA
        policy's reference stays its base (the adapter disabled)."""
        if self.reference is not None:
            self.reference.load_state_dict(self.model.state_dict())

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / self.name
        path.mkdir(parents=True, exist_ok=True)
        model = self.model
        if self.cfg.lora is not None and not self.cfg.checkpoint:
            # A random base exists nowhere else: saving only the adapter would lose it. Merge the
            # adapter into a copy and save a whole model.
            model = copy.deepcopy(self.model).merge_and_unload()
        return save_pretrained_quietly(model, path, self.tokenizer)
