"""A policy: a tokenizer view, a learner (model, optimizer, reference, version) and a sampler.

It samples completions with behaviour log-probs, takes GRPO (+SFT) updates on ``TrainBatch``es,
and saves/loads itself. It knows nothing of strategies or other policies.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from mutualrl.config import ConfigError, GRPOConfig, PolicyConfig, TrainingConfig
from mutualrl.policies.batch import SFTExample, TrainBatch, stale_rows
from mutualrl.policies.checkpoints import save_pretrained_quietly
from mutualrl.policies.dcp import is_sharded_checkpoint, load_sharded
from mutualrl.policies.device_memory import peak_memory_stats
from mutualrl.policies.generation import (
    SamplingSettings,
    build_backend,
    close_backend,
    generation_stats,
)
from mutualrl.policies.learner import Learner
from mutualrl.policies.models import TokenizerFacts
from mutualrl.policies.prompting import chat_prompt
from mutualrl.policies.samples import Sample
from mutualrl.retokenize.loaders import TokenizerHandle, TokenizerLoadError, load_tokenizer
from mutualrl.storage import atomic_folder
from mutualrl.tasks.base import Prompt

if TYPE_CHECKING:
    from peft import PeftModel


class PolicyView:
    """The run's side of a policy: its config, tokenizer and prompt encodings. No model: the run
    holds one of these for every policy, wherever its worker lives (the versions of the weights
    are the run's record, ``Run.versions``)."""

    def __init__(self, cfg: PolicyConfig, handle: TokenizerHandle) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.handle = handle
        self.tokenizer = handle.tokenizer
        self.chat = chat_prompt(cfg, self.tokenizer)  # None: raw text (the default)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def encode_prompt(self, text: str, prefill: str = "") -> tuple[int, ...]:
        """The policy's prompt for a question, and the start of its answer (``prefill``) when
        one is given: after the question in raw text, after the assistant turn's opening under
        a chat template. ``policies.*.prompt_prefix`` goes before the question in either."""
        text = self.cfg.prompt_prefix + text
        if self.chat is not None:
            return self.chat.encode(text, prefill)
        ids = self.tokenizer(text + prefill, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        return tuple(([bos] if bos is not None else []) + ids)

    def encode_completion(self, text: str, eos: bool = True) -> tuple[int, ...]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return tuple(ids + ([self.tokenizer.eos_token_id] if eos else []))


def tokenizer_spec(cfg: PolicyConfig) -> str:
    """The policy's tokenizer spec: ``PolicyConfig`` sets it when parsed (the field's None only
    means "not given")."""
    return cast(str, cfg.tokenizer)


def load_handles(cfgs: list[PolicyConfig]) -> dict[str, TokenizerHandle]:
    """Each distinct tokenizer of ``cfgs`` loaded once, by its spec; a failure names the field
    (``policies.<name>.tokenizer``) of the first policy that asks for it."""
    handles = {}
    for p in cfgs:
        spec = tokenizer_spec(p)
        if spec not in handles:
            try:
                handles[spec] = load_tokenizer(spec)
            except TokenizerLoadError as exc:
                raise ConfigError(f"policies.{p.name}.tokenizer: {exc}") from None
    return handles


class Policy(PolicyView):
    """A policy worker: its view (tokenizer, prompt encodings), its ``Learner`` (model, optimizer,
    schedule, reference, version) and its generation backend with the sampler's generator.

    The run reaches it only through the typed calls of ``policies.worker`` (``PolicyWorker``),
    wherever the executor keeps it."""

    def __init__(
        self,
        cfg: PolicyConfig,
        grpo: GRPOConfig,
        seed: int,
        device: str = "cpu",
        handle: TokenizerHandle | None = None,
        total_steps: int | None = None,
        training: TrainingConfig | None = None,
    ) -> None:
        super().__init__(cfg, handle or load_tokenizer(tokenizer_spec(cfg)))
        self.grpo = grpo
        self.learner = Learner(
            cfg, grpo, TokenizerFacts.of(self.tokenizer), seed, device, total_steps, training
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.backend = build_backend(self, self.learner, self.generator)

    def close(self) -> None:
        """The run is done with this policy: its backend releases what it keeps outside the
        process (``close_backend``). Executors call it once when they are done with the
        worker; a worker process killed after a failure cannot, and ``ScratchFolder`` covers
        that."""
        close_backend(self.backend)

    @property
    def model(self) -> torch.nn.Module:
        """The learner's model (read it, e.g. in tests; the learner owns it)."""
        return self.learner.model

    @property
    def version(self) -> int:
        """The version of the learner's weights."""
        return self.learner.version

    # ---- sampling -------------------------------------------------------------------------
    def generate(
        self, prompts: list[Prompt], num_generations: int, max_new_tokens: int, temperature: float
    ) -> list[Sample]:
        """Sample ``num_generations`` completions per prompt with this policy's generation
        backend (``cfg.generation.backend``); temperature 0 is greedy."""
        return sample(
            self, self.backend, self.grpo, prompts, num_generations, max_new_tokens, temperature
        )

    def sequence_logprobs(
        self, prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]]
    ) -> torch.Tensor:
        """Total log-prob of each completion under the current policy: (B,). Used for off-policy
        ratios."""
        return self.learner.sequence_logprobs(prompts, completions)

    # ---- updates --------------------------------------------------------------------------
    def train_step(
        self, batch: TrainBatch, push: bool = True, step_version: int | None = None
    ) -> dict[str, float]:
        """One update (``num_iterations`` optimizer steps) on a batch; NaN losses are skipped,
        counted.

        Own samples drawn by older weights than the learner's (generation overlapped an update)
        are corrected as an inexact sampler's: the trainer's log-probs before the update become
        the ratio's denominator and ``pi_trainer / pi_behaviour`` weights the policy term
        (``grpo.vllm_importance_sampling_*``). ``push``: hand the new weights to the generation
        backend now (False while it is sampling; the caller pushes once it is done).
        ``step_version``: the learner's version when the step began (default: now); a step of
        several batches moves the version between them, which does not make its samples stale."""
        began = self.version if step_version is None else step_version
        inexact = not self.backend.exact_logprobs or stale_rows(batch, began)
        stats = self.learner.train_step(batch, correct_mismatch=inexact)
        if push:  # the generation engine samples the new weights; an engine reports its probe gap
            stats.update(self.backend.load_weights(self.version) or {})
        return stats

    def train_steps(self, batches: list[TrainBatch], push: bool = True) -> dict[str, float]:
        """Every batch of one step in order; later batches' stats are prefixed by their tag."""
        began = self.version
        return step_stats(batches, lambda batch: self.train_step(batch, push, began), self.learner)

    def update(self, batches: list[TrainBatch]) -> tuple[dict[str, float], int]:
        """``train_steps``, and the version of the weights after it (for the run, wherever this
        policy lives), with the process's peak accelerator memory since the last update
        (``policies.device_memory``; nothing on a CPU), and what compiled decoding cost since
        the last update (``generation_stats``; nothing when it is off)."""
        stats = self.train_steps(batches)
        stats.update(peak_memory_stats(self.learner.device))
        stats.update(generation_stats(self.backend))
        return stats, self.version

    def update_and_generate(
        self,
        batches: list[TrainBatch],
        prompts: list[Prompt],
        num_generations: int,
        max_new_tokens: int,
        temperature: float,
    ) -> tuple[dict[str, float], int, list[Sample]]:
        """``update``, while the next step's samples are drawn from the weights as they were
        before it (``allocation.async_generation``): (stats, version after, samples).

        The sampler works on the backend's overlap view (``overlap_sampler``: a copy of the
        weights for the torch sampler, the engine's own for vLLM) in a thread of its own, so
        the samples are one version behind the learner when it trains on them; their behaviour
        log-probs are recorded and the update corrects for the lag (``train_step``). The new
        weights reach the backend once both are done."""
        sampler = self.backend.overlap_sampler()

        def draw() -> tuple[list[Sample], float]:
            t0 = time.perf_counter()
            drawn = sample(
                self, sampler, self.grpo, prompts, num_generations, max_new_tokens, temperature
            )
            return drawn, time.perf_counter() - t0

        with cf.ThreadPoolExecutor(1, thread_name_prefix=f"mutualrl-sample-{self.name}") as pool:
            drawn = pool.submit(draw)
            stats = self.train_steps(batches, push=False)
            samples, seconds = drawn.result()
        stats.update(self.backend.load_weights(self.version) or {})
        stats["async/generate_time_s"] = seconds
        stats.update(peak_memory_stats(self.learner.device))
        stats.update(generation_stats(self.backend))
        return stats, self.version, samples

    def sft_step(
        self, examples: tuple[SFTExample, ...], learning_rate: float | None = None
    ) -> float:
        """A plain supervised step (warm start); ``learning_rate`` overrides the optimizer's for
        it."""
        loss = self.learner.sft_step(examples, learning_rate)
        self.backend.load_weights(self.version)
        return loss

    def freeze_reference(self) -> None:
        self.learner.freeze_reference()

    # ---- persistence ----------------------------------------------------------------------
    def save_state(self, path: str | Path) -> None:
        """Everything a later run needs to continue exactly from here: the learner's state and
        the sampler's generator (one torch file; readers ignore keys they do not know)."""
        torch.save(
            {
                "name": self.name,
                **self.learner.state_dict(),
                "generator": self.generator.get_state(),
            },
            path,
        )

    def load_state(self, path: str | Path) -> None:
        """Continue from a ``save_state`` file of a policy with the same config."""
        try:
            state = torch.load(path, map_location=self.learner.device, weights_only=True)
        except Exception as exc:  # unpickling errors have no common base; name the file
            raise ValueError(
                f"{path}: not a policy state file ({type(exc).__name__}: {exc})"
            ) from exc
        if not isinstance(state, dict) or state.get("name") != self.name:
            held = state.get("name") if isinstance(state, dict) else None
            raise ValueError(f"{path}: holds the state of policy {held!r}, not {self.name!r}")
        self.learner.load_state_dict(state)
        self.generator.set_state(state["generator"].cpu())
        self.backend.load_weights(self.version)

    def save_checkpoint(self, directory: str | Path) -> None:
        """This policy's part of a run checkpoint: ``save_state`` plus the frozen KL reference."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.save_state(d / "state.pt")
        self.learner.save_reference(d / "reference.pt")

    def restore_checkpoint(self, directory: str | Path) -> None:
        """Continue from ``save_checkpoint``: weights, optimizer, sampler, version, reference;
        or from the checkpoint of a sharded learner of this policy (``policies.dcp``),
        whose shards are read whole."""
        d = Path(directory)
        if is_sharded_checkpoint(d):
            meta = load_sharded(self.learner, d)
            self.generator.set_state(meta["generator"].cpu())
            self.backend.load_weights(self.version)
            return
        self.load_state(d / "state.pt")
        self.learner.load_reference(d / "reference.pt")

    def save(self, directory: str | Path) -> Path:
        """The policy as a ``from_pretrained`` folder ``directory/<name>`` (model and tokenizer),
        complete or absent: written under a temporary name, then renamed."""
        path = Path(directory) / self.name
        model = self.model
        if self.cfg.lora is not None and not self.cfg.checkpoint:
            # A random base exists nowhere else: saving only the adapter would lose it. Merge the
            # adapter into a copy and save a whole model.
            model = cast("PeftModel", copy.deepcopy(self.model)).merge_and_unload()
        with atomic_folder(path, f"policy {self.name!r}", within=directory) as tmp:
            save_pretrained_quietly(model, tmp, self.tokenizer)
        return path


def sample(
    view: PolicyView,
    backend,
    grpo: GRPOConfig,
    prompts: list[Prompt],
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
) -> list[Sample]:
    """``num_generations`` completions per prompt from ``backend``, prompts encoded by ``view``."""
    settings = sampling_settings(grpo, num_generations, max_new_tokens, temperature)
    return backend.generate(
        prompts, [view.encode_prompt(p.text, p.prefill) for p in prompts], settings
    )


def sampling_settings(
    grpo: GRPOConfig, num_generations: int, max_new_tokens: int, temperature: float
) -> SamplingSettings:
    return SamplingSettings(
        num_generations,
        max_new_tokens,
        temperature,
        top_p=grpo.top_p,
        top_k=grpo.top_k,
        batch_size=grpo.generation_batch_size,
        cache_implementation=grpo.cache_implementation,
        generation_compile=grpo.generation_compile,
        stop_strings=grpo.stop_strings,
    )


def step_stats(batches: list[TrainBatch], train_step, learner) -> dict[str, float]:
    """``train_step`` on every batch of one step in order; later batches' stats are prefixed by
    their tag; the learner's running count of skipped steps last."""
    merged: dict[str, float] = {}
    for batch in batches:
        for k, v in train_step(batch).items():
            merged[k if batch.tag == "grpo" else f"{batch.tag}/{k}"] = v
    merged["skipped_nan_total"] = learner.skipped_nan_steps
    return merged
