"""``sgt`` — Success-Gated Transfer (outcome level).

Every verified success (reward >= ``tau``) enters a shared success buffer with its source.
Hygiene: exact duplicates from one source per prompt are dropped, each prompt keeps at most
``max_per_prompt``
(newest kept), and entries older than ``max_age`` steps age out. A receiver learns from *peer*
successes (source != receiver), by default only for prompts where its own group had no success
(``gate = "receiver_failed"``, the rescue set). A success stays available until it ages out,
so it can be drawn at several steps; ``max_uses`` caps how often one receiver uses it.

* ``interval == 1``: each step's loss is ``L_GRPO + alpha * L_SFT``, the SFT term a mean token NLL
  on ``min(sft_batch_size, available)`` peer successes, retokenized into the receiver (THL).
* ``interval > 1``: every ``interval`` steps, up to ``sft_steps`` SFT-only steps on such batches,
  stopping early when none is available. These steps run at ``sft_learning_rate``; by default the
  run's supervised learning rate (``warmup.learning_rate``): imitating verified demonstrations is
  supervised learning, which tolerates a larger step than the policy-gradient update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec

from mutualrl.exchange import Delivery
from mutualrl.policies.batch import SFTExample, TrainBatch
from mutualrl.strategies.base import StrategyContext, register_strategy
from mutualrl.strategies.common import own_sequences, receive_peers


class SGTParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # success threshold on the step's reward: built-in verifiers reward in [0, 1]; with
    # task.reward_weights, the combined reward a success must reach (it may exceed 1)
    tau: float = 1.0  # success threshold (reward >= tau)
    gate: Literal["receiver_failed", "always"] = (
        "receiver_failed"  # use peers' successes where it failed, or always
    )
    interval: int = 1  # s: 1 adds the SFT term to every step; > 1 SFT-only steps every s
    alpha: float = 0.5  # SFT weight when interval == 1
    sft_batch_size: int = 16  # peer successes per SFT batch (fewer when fewer are available)
    sft_steps: int = 4  # SFT-only steps every `interval` steps when interval > 1
    max_per_prompt: int = 4  # successes kept per prompt in the buffer (newest kept)
    max_age: int = 20  # steps
    max_uses: int | None = None  # per success and receiver; None: until it ages out
    # SFT-only steps (interval > 1); None: the run's warmup.learning_rate. With interval == 1 the
    # SFT term is part of the GRPO step and takes its learning rate.
    sft_learning_rate: float | None = None

    def __post_init__(self) -> None:
        if not self.tau > 0:
            raise ValueError("tau must be > 0 (a success is a reward >= tau)")
        if self.alpha < 0:
            raise ValueError("alpha must be >= 0")
        for name in ("interval", "sft_batch_size", "sft_steps", "max_per_prompt", "max_age"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_uses is not None and self.max_uses < 1:
            raise ValueError("max_uses must be >= 1 (or absent: unlimited)")
        if self.sft_learning_rate is not None:
            if not self.sft_learning_rate > 0:
                raise ValueError("sft_learning_rate must be > 0 (or absent: warmup.learning_rate)")
            if self.interval == 1:
                raise ValueError(
                    "sft_learning_rate applies to SFT-only steps, which need interval > 1; "
                    "with interval = 1 the SFT term shares the GRPO step's learning rate"
                )


@dataclass
class Success:
    delivery: Delivery  # the rollout's (producer, record)
    step: int
    uses: dict[str, int] = field(default_factory=dict)  # receiver -> times drawn

    @property
    def source(self) -> str:
        return self.delivery.producer


class SuccessBuffer:
    """Successes per prompt id, deduplicated, capped and aged."""

    def __init__(self, max_per_prompt: int, max_age: int) -> None:
        self.max_per_prompt, self.max_age = max_per_prompt, max_age
        self.by_prompt: dict[str, list[Success]] = {}
        self.duplicates = 0

    def add(self, delivery, step: int) -> None:
        rec = delivery.record
        entries = self.by_prompt.setdefault(rec.prompt_id, [])
        if any(
            e.delivery.record.completion == rec.completion and e.source == delivery.producer
            for e in entries
        ):
            self.duplicates += 1
            return
        entries.append(Success(delivery, step))
        del entries[: -self.max_per_prompt]  # keep the newest

    def age(self, step: int) -> None:
        for pid in list(self.by_prompt):
            kept = [e for e in self.by_prompt[pid] if step - e.step < self.max_age]
            if kept:
                self.by_prompt[pid] = kept
            else:
                del self.by_prompt[pid]

    def available(
        self, receiver: str, prompt_ids: set[str] | None, max_uses: int | None = None
    ) -> list[Success]:
        return [
            e
            for pid, entries in self.by_prompt.items()
            if prompt_ids is None or pid in prompt_ids
            for e in entries
            if e.source != receiver and (max_uses is None or e.uses.get(receiver, 0) < max_uses)
        ]

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_prompt.values())


class SuccessGatedTransfer:
    name = "sgt"

    def __init__(self, params: SGTParams, sft_learning_rate: float | None = None) -> None:
        self.params = params
        self.sft_learning_rate = params.sft_learning_rate or sft_learning_rate
        self.buffer = SuccessBuffer(params.max_per_prompt, params.max_age)
        self.failed: dict[str, set[str]] = {}  # receiver -> prompts whose latest own group failed

    def observe(self, ctx: StrategyContext, samples) -> None:
        # Age once per step, here: it depends on no particular receiver having been updated.
        self.buffer.age(ctx.step)
        for d in ctx.peer_experience:
            if d.kind == "rollout" and d.record.reward >= self.params.tau:
                self.buffer.add(d, ctx.step)
        for name, own in samples.items():
            solved: dict[str, bool] = {}
            for s in own:
                pid = s.prompt.id
                solved[pid] = solved.get(pid, False) or s.reward >= self.params.tau
            failed = self.failed.setdefault(name, set())
            failed.difference_update(p for p, ok in solved.items() if ok)
            failed.update(p for p, ok in solved.items() if not ok)

    def _draw(self, ctx: StrategyContext, receiver: str) -> list[Success]:
        gate = self.failed.get(receiver, set()) if self.params.gate == "receiver_failed" else None
        pool = self.buffer.available(receiver, gate, self.params.max_uses)
        if not pool:
            return []
        take = min(self.params.sft_batch_size, len(pool))
        chosen = [pool[i] for i in sorted(ctx.rng.choice(len(pool), take, replace=False))]
        for e in chosen:
            e.uses[receiver] = e.uses.get(receiver, 0) + 1
        return chosen

    def _examples(
        self, ctx: StrategyContext, receiver: str, chosen: list[Success]
    ) -> tuple[SFTExample, ...]:
        peers = receive_peers(ctx, receiver, [e.delivery for e in chosen])
        for e in chosen:
            key = f"sgt/received/{e.source}"
            ctx.metrics.setdefault(receiver, {})[key] = (
                ctx.metrics.get(receiver, {}).get(key, 0.0) + 1
            )
        return peers.sft_examples()

    def build_batches(self, ctx: StrategyContext, receiver: str, own) -> list[TrainBatch]:
        seqs = tuple(own_sequences(own, ctx.grpo))
        batches: list[TrainBatch] = []
        rescued: set[str] = set()
        if self.params.interval == 1:
            chosen = self._draw(ctx, receiver)
            rescued |= {e.delivery.record.prompt_id for e in chosen}
            sft = self._examples(ctx, receiver, chosen) if chosen else ()
            if seqs or sft:
                batches.append(TrainBatch(sequences=seqs, sft=sft, sft_coef=self.params.alpha))
        else:
            if seqs:
                batches.append(TrainBatch(sequences=seqs))
            if ctx.step % self.params.interval == 0:
                for _ in range(self.params.sft_steps):
                    chosen = self._draw(ctx, receiver)
                    if not chosen:
                        break  # early stop: nothing (left) to learn from
                    rescued |= {e.delivery.record.prompt_id for e in chosen}
                    batches.append(
                        TrainBatch(
                            sft=self._examples(ctx, receiver, chosen),
                            sft_coef=1.0,
                            tag="sft",
                            learning_rate=self.sft_learning_rate,
                        )
                    )
        ctx.log(receiver, "sgt/buffer_size", len(self.buffer))
        ctx.log(receiver, "sgt/rescued_prompts", len(rescued))
        ctx.log(receiver, "sgt/sft_examples", sum(len(b.sft) for b in batches))
        ctx.log(receiver, "sgt/duplicates_dropped", self.buffer.duplicates)
        return batches

    def after_update(self, ctx: StrategyContext, receiver: str) -> None:
        return None

    # ---- checkpoint state (the optional strategy state contract, see strategies.base) --------
    def state_dict(self) -> dict:
        """The success buffer (entries in order, with their step and use counts), its duplicate
        count, and each receiver's failed prompts: everything later draws depend on."""
        return {
            "buffer": {
                pid: [(e.delivery, e.step, dict(e.uses)) for e in entries]
                for pid, entries in self.buffer.by_prompt.items()
            },
            "duplicates": self.buffer.duplicates,
            "failed": {n: sorted(s) for n, s in self.failed.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.buffer.by_prompt = {
            pid: [Success(d, step, dict(uses)) for d, step, uses in entries]
            for pid, entries in state["buffer"].items()
        }
        self.buffer.duplicates = int(state["duplicates"])
        self.failed = {n: set(s) for n, s in state["failed"].items()}


@register_strategy("sgt", SGTParams, "success-gated transfer: SFT on peers' verified successes")
def _make_sgt(params: SGTParams, cfg) -> SuccessGatedTransfer:
    return SuccessGatedTransfer(params, sft_learning_rate=cfg.warmup.learning_rate if cfg else None)
