"""The strategy contract: how experience is shared between policies, as a plug-in.

The loop calls a strategy at three fixed points of every step:

1. ``observe(ctx, samples)``    after all policies sampled and were verified (fill buffers,
                                 pool statistics, read peer experience from the exchange);
2. ``build_batches(ctx, receiver, own)``  when a receiver's update is assembled: its own GRPO
                                 sequences, possibly adapted peer sequences (retokenized through
                                 THL, with importance weights) and extra loss terms (SFT);
3. ``after_update(ctx, receiver)`` after that receiver's update (age buffers, etc.).

A strategy that keeps state across steps (buffers, pooled statistics, counters) also has
``state_dict() -> dict`` and ``load_state_dict(dict)``: a run checkpoint stores the dict as data
(``run.state_codec``: dicts with str or int keys, lists, tuples, sets, str, numbers, bool, None,
tensors, numpy arrays and registered experience records or their ``Delivery``; never pickled,
so a resume runs no code from the folder) and a resumed run loads it before its next step. A
strategy without these two methods has no state to keep.

Strategies transform data and add loss terms; they never own models, optimizers or devices.
Each strategy validates its own parameters (``[strategies.<name>]`` in the run config) when built,
so a bad parameter fails before any work starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np
import torch

from mutualrl.config import ConfigError, GRPOConfig, RunConfig
from mutualrl.exchange import Delivery
from mutualrl.policies.batch import TrainBatch
from mutualrl.policies.policy import Sample
from mutualrl.registry import Registry, RegistryError
from mutualrl.retokenize import AlignmentResiduals, RetokenizedTrajectory, TokenizerHandle
from mutualrl.tasks import Prompt

TokenIds = tuple[int, ...]
# A receiver's (prompts, completions) in its own tokens -> (B,) total log p of each completion.
ReceiverLogprobs = Callable[[list[TokenIds], list[TokenIds]], torch.Tensor]
# A receiver's sampler: (prompts, num_generations) -> num_generations samples per prompt.
ReceiverSampler = Callable[[list[Prompt], int], list[Sample]]


class StrategyRetokenizer(Protocol):
    """What a strategy may use of a receiver's THL retokenizer: ``retokenize.Retokenizer`` is one;
    the run hands strategies one whose retokenize calls count as the step's strategy time."""

    target: TokenizerHandle  # the receiver's tokenizer
    max_length: int | None

    def encode_prompt(
        self, prompt: str | list[dict], *, add_generation_prompt: bool = True
    ) -> np.ndarray: ...

    def encode_completion(self, text: str) -> np.ndarray: ...

    def retokenize(
        self,
        text: str,
        *,
        source: TokenizerHandle | None = None,
        source_ids: Sequence[int] | np.ndarray | None = None,
        source_logprobs: Sequence[float] | np.ndarray | None = None,
        ends_with_eos: bool = False,
    ) -> RetokenizedTrajectory: ...

    def retokenize_batch(
        self,
        texts: Sequence[str],
        *,
        source: TokenizerHandle | None = None,
        source_ids: Sequence | None = None,
        source_logprobs: Sequence | None = None,
        ends_with_eos: bool | Sequence[bool] = False,
    ) -> list[RetokenizedTrajectory]: ...


@dataclass
class StrategyContext:
    """What a strategy may see and use during one step."""

    step: int
    grpo: GRPOConfig
    policy_names: list[str]
    rng: np.random.Generator  # seeded per step: same seed, same choices
    encode_prompt: dict[str, Callable[[str], TokenIds]]  # receiver's own prompt format
    sequence_logprobs: dict[str, ReceiverLogprobs]  # receiver-side log p(text), (B,)
    retokenizers: dict[str, StrategyRetokenizer] = field(default_factory=dict)  # per receiver
    tokenizers: dict[str, TokenizerHandle] = field(default_factory=dict)  # by fingerprint
    # Deliveries (kind, producer, record) from the exchange this step, live peers and replayed logs.
    peer_experience: list[Delivery] = field(default_factory=list)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # per receiver
    # Publish a record to the exchange on a receiver's behalf (e.g. THL residuals); None: drop.
    publish: Callable[[msgspec.Struct, str], object] | None = None
    # Receiver-side sampling, as ``sequence_logprobs``: (prompts, num_generations) -> [Sample]
    # drawn at the run's temperature and completion length (e.g. on hinted prompts); and the
    # task's verifier, (Prompt, completion text) -> reward. Empty / None: not offered.
    generate: dict[str, ReceiverSampler] = field(default_factory=dict)
    verify: Callable[[Prompt, str], float] | None = None
    # THL residuals of what was moved this step, per (receiver, metric prefix): the logged
    # residual metrics cover all of it (``common.log_residuals``).
    moved: dict[tuple[str, str], list[AlignmentResiduals]] = field(default_factory=dict)

    def log(self, receiver: str, key: str, value: float) -> None:
        self.metrics.setdefault(receiver, {})[key] = float(value)


class Strategy(Protocol):
    """What the loop calls. Each ``TrainBatch`` of ``build_batches`` is one update; a strategy
    that makes several a step also has ``updates_per_step`` (an int), the number the run sizes its
    learning-rate schedules by (``run.build.optimizer_steps``); without it, one."""

    name: str

    def observe(self, ctx: StrategyContext, samples: dict[str, list[Sample]]) -> None: ...

    def build_batches(
        self, ctx: StrategyContext, receiver: str, own: list[Sample]
    ) -> list[TrainBatch]: ...

    def after_update(self, ctx: StrategyContext, receiver: str) -> None: ...


class StatefulStrategy(Strategy, Protocol):
    """A strategy that keeps state across steps (buffers, pooled statistics, counters): what a
    run checkpoint stores of it (see the module docstring)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


StrategyFactory = Callable[[Any, RunConfig], Strategy]


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy: its parameter struct and a factory taking (params, run config)."""

    params: type
    factory: StrategyFactory
    summary: str
    # Why the strategy cannot run paced (allocation.max_staleness >= 1), where each policy has a
    # strategy object of its own that sees its own samples and the experience that has arrived;
    # None: it can.
    needs_lock_step: str | None = None


def _check_spec(name: str, obj: object) -> None:
    if not isinstance(obj, StrategySpec):
        raise RegistryError(
            f"strategy {name!r}: expected a mutualrl.strategies.StrategySpec, got "
            f"{type(obj).__name__} {obj!r:.80}"
        )


STRATEGIES: Registry[StrategySpec] = Registry(
    "strategy", entry_point_group="mutualrl.strategies", check=_check_spec
)


def register_strategy(name: str, params: type, summary: str, *, needs_lock_step: str | None = None):
    """Decorator: ``@register_strategy("mine", MyParams, "one line")`` on a factory.
    ``needs_lock_step``: why it cannot run paced, if it cannot (see ``StrategySpec``)."""

    def decorator(factory: StrategyFactory) -> StrategyFactory:
        STRATEGIES.register(
            name,
            StrategySpec(
                params=params, factory=factory, summary=summary, needs_lock_step=needs_lock_step
            ),
        )
        return factory

    return decorator


def build_strategy(cfg: RunConfig, name: str | None = None) -> Strategy:
    """Build the run's strategy with its validated parameters (errors name
    ``$.strategies.<name>``)."""
    name = name or cfg.strategy
    try:
        spec = STRATEGIES.get(name)
    except KeyError as exc:
        raise ConfigError(f"strategy: {exc}") from None
    raw = cfg.strategies.get(name, {})
    try:
        params: object = msgspec.convert(raw, spec.params, strict=True)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        # msgspec gives a path only for errors inside a field; root-level ones get the table's.
        msg = (
            msg.replace("at `$", f"at `$.strategies.{name}")
            if "at `$" in msg
            else f"{msg} - at `$.strategies.{name}`"
        )
        raise ConfigError(f"strategies.{name}: {msg}") from None
    from mutualrl.strategies.diversity import with_diversity

    return with_diversity(spec.factory(params, cfg), getattr(cfg, "diversity", None))
