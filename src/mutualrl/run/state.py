"""The run object: everything one run holds, and the one place its state is saved and restored.

A ``Run`` is built once (``run.build``) and handed to the phases, the warm start, evaluation and
checkpointing. What a resumed run needs of it is ``state_dict()``: the union of its parts' own
state (reward history, phase times, weight versions, verifier counters, the exchange bus, the
guards, the strategy's state, the global RNGs); ``load_state_dict`` puts each part back. The
policies' weights are not here: each worker saves its own (``policies.worker.SaveCheckpoint``).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch

from mutualrl.config import RunConfig
from mutualrl.exchange import ExperienceBus, Subscription
from mutualrl.policies.policy import PolicyView, Sample
from mutualrl.retokenize import Retokenizer
from mutualrl.run.departures import Departures
from mutualrl.run.experience import PeerLogPool
from mutualrl.run.guards import Guards
from mutualrl.run.metrics import MetricsWriter
from mutualrl.run.progress import RunProgress
from mutualrl.run.signals import StopRequests
from mutualrl.strategies import StatefulStrategy, Strategy
from mutualrl.tasks import GuardedVerifier, Task
from mutualrl.tasks.rewards import WeightedReward
from mutualrl.workers import Executor, WorkerCall, call_each


@dataclass
class Prefetched:
    """Samples a policy drew for ``step`` while it updated (``allocation.async_generation``)."""

    step: int
    samples: list[Sample]
    seconds: float  # the sampling's own wall time (it overlapped the update)


class PacedState(Protocol):
    """What the run and its scheduler use of a paced run's own state: ``run.paced.Pace``,
    whose module imports this one (so it is named here by what it offers)."""

    def books(self) -> dict[str, dict[str, dict[str, list[list[int]]]]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Run:
    """Everything one run holds; built once by ``run.build.build_run``.

    ``policies`` are the run's views of the policies (tokenizers, prompt encodings); every call
    that touches weights goes through ``executor``, wherever the policies live. ``versions`` is
    the run's record of each policy's weight version, as its last update reported it.
    """

    cfg: RunConfig
    out: Path
    task: Task
    verifier: GuardedVerifier
    policies: dict[str, PolicyView]
    strategy: Strategy
    writer: MetricsWriter
    progress: RunProgress
    bus: ExperienceBus
    subscription: Subscription
    retokenizers: dict[str, Retokenizer]
    executor: Executor  # where the policies' workers live (workers.make_executor)
    # policies that left under on_failure = "continue" (run.departures)
    departures: Departures
    peer_logs: PeerLogPool | None = None
    rewards: WeightedReward | None = None  # task.reward_funcs; None: the verifier alone
    reward_parts: dict[str, dict[str, float]] = field(default_factory=dict)  # last step's means
    history: dict[str, list[float]] = field(default_factory=dict)
    guards: Guards | None = None
    versions: dict[str, int] = field(default_factory=dict)
    stop: StopRequests = field(default_factory=StopRequests)  # SIGINT/SIGTERM asked to stop
    phase_times: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Wall seconds of the current GRPO step by loop phase, logged as ``phase/<phase>_time_s``.
    step_phases: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Each policy's samples for its next step, drawn during its update (async_generation).
    prefetched: dict[str, Prefetched] = field(default_factory=dict)
    pace: PacedState | None = None  # a paced run's own state (run.paced.Pace); None: lock-step
    restarts: dict[str, int] = field(
        default_factory=dict
    )  # per policy, under "restart" (run.restarts)

    def timed(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """Add the block's wall time to ``phase_times[phase]`` (the run's totals)."""
        return _clocked(self.phase_times, phase)

    def step_phase(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """Add the block's wall time to this step's ``step_phases[phase]``."""
        return _clocked(self.step_phases, phase)

    def live(self) -> list[str]:
        """The policies still in the run: their workers are live (``on_failure`` may have
        removed some), and none has left it (``departures``: a paced policy whose loop failed on
        the driver's side keeps a live worker, and is evaluated, saved and checkpointed no more)."""
        gone = self.departures.seen
        return [n for n in self.executor.live_workers() if n not in gone]

    def call_live(self, call: WorkerCall) -> dict[str, Any]:
        """The same call on every policy still in the run (``live``) at once; the values of
        those that succeeded."""
        return call_each(self.executor, {n: call for n in self.live()})

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's own state, part by part (``strategy`` only for a strategy that keeps any)."""
        state: dict[str, Any] = {
            "history": {n: list(h) for n, h in self.history.items()},
            "phase_times": dict(self.phase_times),
            "versions": dict(self.versions),
            "verifier": vars(self.verifier.counters).copy(),
            "bus": self.bus.state_dict(),
            "guards": self.guards.state_dict() if self.guards is not None else None,
            "departures": self.departures.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }
        strategy_state = getattr(self.strategy, "state_dict", None)
        if strategy_state is not None:
            state["strategy"] = strategy_state()
        if self.prefetched:
            state["prefetched"] = {
                n: (p.step, p.samples, p.seconds) for n, p in self.prefetched.items()
            }
        if self.pace is not None:
            state["pace"] = self.pace.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put every part back; wall time spent before is added to this run's phase times."""
        if state.get("strategy") is not None:
            # it has state_dict, so load_state_dict too (a stateful strategy has both)
            cast(StatefulStrategy, self.strategy).load_state_dict(state["strategy"])
        self.history.update({n: list(h) for n, h in state["history"].items()})
        for phase, seconds in state["phase_times"].items():
            self.phase_times[phase] += seconds
        self.versions.update({n: v for n, v in state["versions"].items() if n in self.policies})
        for k, v in state["verifier"].items():
            setattr(self.verifier.counters, k, v)
        self.bus.load_state_dict(state["bus"])
        if self.guards is not None and state.get("guards") is not None:
            self.guards.load_state_dict(state["guards"])
        self.prefetched = {
            n: Prefetched(*p) for n, p in state.get("prefetched", {}).items() if n in self.policies
        }
        if self.pace is not None and state.get("pace") is not None:
            self.pace.load_state_dict(state["pace"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])

    def close(self) -> None:
        """Stop the workers and flush and close everything the run writes."""
        self.executor.shutdown()
        self.bus.close()  # flushes the experience log
        self.writer.close()
        self.verifier.close()
        if self.rewards is not None:
            self.rewards.close()


@contextlib.contextmanager
def _clocked(bucket: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's wall time to ``bucket[key]``, also when it raises."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        bucket[key] += time.perf_counter() - t0
