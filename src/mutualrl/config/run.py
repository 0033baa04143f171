"""``RunConfig``: the whole run, every section typed, checked once when the config is loaded."""

from __future__ import annotations

from typing import Any

import msgspec

from mutualrl.config.allocation import AllocationConfig
from mutualrl.config.base import ConfigStruct, check
from mutualrl.config.grpo import GRPOConfig, TrainingConfig
from mutualrl.config.scenarios import ScenariosConfig
from mutualrl.config.sections import (
    DiversityConfig,
    EvalConfig,
    ExchangeConfig,
    GuardsConfig,
    PolicyConfig,
    TaskConfig,
    WarmupConfig,
)


class RunConfig(ConfigStruct, frozen=True):
    """The whole run. ``strategies`` holds per-strategy parameter tables, checked by each
    strategy."""

    policies: list[PolicyConfig]  # the policies trained side by side (at least one)
    seed: int = 0  # seeds every random choice of the run
    steps: int = 40  # GRPO steps after the warm start
    strategy: str = "none"  # how policies share experience (mutualrl.strategies.STRATEGIES)
    # Where the policies start (mutualrl.run.scenarios): disjoint | overlap | asymmetric, or one
    # that
    # another package registers; parameters in [scenarios.<name>]. The name is checked where the
    # registry lives (mutualrl.run.scenarios.check_scenario).
    scenario: str = "disjoint"  # the scenario that plans every policy's warm start
    output_dir: str = "runs/default"  # the run folder (RUN_DIR)
    device: str = "cpu"  # torch device; "cuda": each learner on its planned GPU
    torch_threads: int | None = None  # None: torch's default
    grpo: GRPOConfig = msgspec.field(default_factory=GRPOConfig)  # GRPO objective and sampling
    training: TrainingConfig = msgspec.field(default_factory=TrainingConfig)  # optimizer, memory
    warmup: WarmupConfig = msgspec.field(default_factory=WarmupConfig)  # supervised warm start
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)  # prompts, verifier, rewards
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)  # held-out pass@k
    strategies: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)  # strategy -> table
    scenarios: ScenariosConfig = msgspec.field(default_factory=ScenariosConfig)  # scenario tables
    allocation: AllocationConfig = msgspec.field(
        default_factory=AllocationConfig
    )  # workers, devices
    exchange: ExchangeConfig = msgspec.field(default_factory=ExchangeConfig)  # the experience bus
    diversity: DiversityConfig = msgspec.field(default_factory=DiversityConfig)  # regulariser
    # Checkpoints (TRL's names): every save_steps GRPO steps under RUN_DIR/checkpoints/ (0: none,
    # and `mutualrl train --resume` has nothing to resume from), keeping the newest
    # save_total_limit: 2 by default, so a long run's disk does not fill with checkpoints and a
    # damaged newest one still leaves one to resume from; 0 (or None from Python): keep all.
    # See mutualrl.run.checkpoint.
    save_steps: int = 0  # checkpoint every N GRPO steps; 0: never
    save_total_limit: int | None = 2  # newest checkpoints kept; 0 or None: all
    report_to: list[str] = msgspec.field(default_factory=list)  # trackers: "tensorboard", "wandb"
    guards: GuardsConfig = msgspec.field(default_factory=GuardsConfig)  # stop a run gone wrong

    def __post_init__(self) -> None:
        check(len(self.policies) >= 1, "policies must list at least one policy")
        # numpy's seed range; every random generator of the run is seeded from it
        check(0 <= self.seed < 2**32, "seed must be in [0, 2**32 - 1]")
        check(
            self.torch_threads is None or self.torch_threads >= 1,
            "torch_threads must be >= 1 (or absent: torch's default)",
        )
        check(self.save_steps >= 0, "save_steps must be >= 0 (0: no checkpoints)")
        check(
            self.save_total_limit is None or self.save_total_limit >= 0,
            "save_total_limit must be >= 0 (0: keep every checkpoint)",
        )
        names = [p.name for p in self.policies]
        check(len(set(names)) == len(names), f"policy names must be unique, got {names}")
        check(self.steps >= 0, "steps must be >= 0")
        check(
            self.training.logprob_chunk_size is None
            or (self.grpo.top_k == 0 and self.grpo.top_p == 1.0),
            "training.logprob_chunk_size takes log-probs of the untruncated distribution; with "
            "grpo.top_k or grpo.top_p truncation unset it (the chunked LM head does not truncate)",
        )
        self._check_learner_ranks()
        check(
            self.allocation.max_staleness == 0 or self.allocation.on_failure != "restart",
            f"allocation.max_staleness = {self.allocation.max_staleness}: a paced run cannot "
            'rebuild a policy mid-loop; allocation.on_failure = "restart" needs '
            'max_staleness = 0 (or use "continue" or "stop")',
        )
        check(
            self.allocation.on_failure != "restart" or self.save_steps >= 1,
            'allocation.on_failure = "restart" takes the run back to its last checkpoint '
            "(run.restarts); save_steps = 0 writes none: set save_steps >= 1, or use "
            '"stop" or "continue"',
        )
        check(
            not self.allocation.async_generation
            or not any(p.generation.enable_sleep_mode for p in self.policies),
            "allocation.async_generation samples while the learner updates, but "
            "generation.enable_sleep_mode releases a vLLM engine's memory for each update; "
            "turn one of them off",
        )
        # Only the scenario the run uses: a table of another one may name policies of a config
        # it was written for.
        weak = self.scenarios.asymmetric.weak
        check(
            self.scenario != "asymmetric" or weak is None or weak in names,
            f"scenarios.asymmetric.weak: {weak!r} is not a policy; policies: {names}",
        )

    def _check_learner_ranks(self) -> None:
        """The rule for a sharded learner: its rank count divides every full batch it trains on,
        so each rank takes an equal share (batches a strategy makes uneven at run time are
        padded with zero-weight passes, ``policies.ranks``)."""
        rows = self.grpo.prompts_per_step * self.grpo.num_generations
        for p in self.policies:
            n, where = p.learner_ranks, f"policies.{p.name}.learner_ranks"
            if n == 1:
                continue
            check(
                rows % n == 0,
                f"{where}: {n} ranks do not divide the step's own sequences "
                f"(grpo.prompts_per_step x num_generations = {rows}); choose a divisor of {rows}",
            )
            check(
                self.warmup.max_steps == 0 or self.warmup.batch_size % n == 0,
                f"{where}: {n} ranks do not divide warmup.batch_size = {self.warmup.batch_size}",
            )
            check(
                self.training.logprob_chunk_size is None,
                f"{where}: training.logprob_chunk_size reads the LM head's weight outside the "
                "model's forward, which a sharded model does not allow; unset it (micro-batches "
                "of training.per_device_train_batch_size bound the logits instead)",
            )
            check(
                not self.allocation.async_generation,
                f"{where}: allocation.async_generation samples beside the update in one worker "
                "process, which a learner over several ranks does not offer; set "
                f"learner_ranks = 1 or async_generation = false",
            )
