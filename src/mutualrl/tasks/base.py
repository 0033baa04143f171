"""Tasks and verifiers: the plug-in interfaces and the guarded verifier call.

A task yields ``Prompt``s from a train or held-out split, each tagged with a *family* (a kind of
prompt: policies may be good at some families and not others). A verifier maps (prompt,
completion text) to a reward. A verifier that raises or runs past its time limit gives reward 0
and is counted; it never stops the run.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Protocol

import numpy as np

from mutualrl.registry import Registry

Split = Literal["train", "heldout"]


class TaskError(ValueError):
    """A task that cannot be built (bad data file, unknown family)."""


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str
    family: str

    @cached_property
    def id(self) -> str:
        """The prompt's content hash as the exchange names it (same for every policy)."""
        from mutualrl.exchange import prompt_id
        return prompt_id(self.text)


class Verifier(Protocol):
    verifier_id: str
    version: int

    def __call__(self, prompt: Prompt, completion: str) -> float: ...


class Task(Protocol):
    families: Sequence[str]
    verifier: Verifier

    def sample(self, rng: np.random.Generator, n: int, split: Split,
               families: Sequence[str] | None = None) -> list[Prompt]: ...

    def demonstration(self, prompt: Prompt) -> str:
        """A correct completion for ``prompt`` (used by the supervised warm start)."""
        ...


TASKS: Registry[Callable[..., Task]] = Registry("task", entry_point_group="mutualrl.tasks")


@dataclass
class VerifierCounters:
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    last_error: str = ""
    by_family: dict[str, int] = field(default_factory=dict)


class GuardedVerifier:
    """Runs a verifier with a time limit; errors and time-outs give reward 0 and are counted."""

    def __init__(self, verifier: Verifier, timeout_s: float) -> None:
        self.verifier = verifier
        self.timeout_s = timeout_s
        self.counters = VerifierCounters()
        # One worker thread: a verifier that hangs is abandoned (threads cannot be killed) and a
        # fresh pool is made, so later calls are not stuck behind it.
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier")

    def __call__(self, prompt: Prompt, completion: str) -> float:
        self.counters.calls += 1
        future = self._pool.submit(self.verifier, prompt, completion)
        try:
            reward = float(future.result(timeout=self.timeout_s))
        except cf.TimeoutError:
            self.counters.timeouts += 1
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier")
            return 0.0
        except Exception as exc:  # noqa: BLE001 - any verifier failure is a zero reward, counted
            self.counters.errors += 1
            self.counters.last_error = f"{type(exc).__name__}: {exc}"
            return 0.0
        if not np.isfinite(reward):
            self.counters.errors += 1
            self.counters.last_error = f"non-finite reward {reward!r}"
            return 0.0
        return reward

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def sample_split(splits: dict[str, list[Prompt]], default_families: Sequence[str], source: object,
                 rng: np.random.Generator, n: int, split: Split,
                 families: Sequence[str] | None = None) -> list[Prompt]:
    """``n`` prompts drawn with replacement from a file-based task's ``split`` in ``families``."""
    fams = set(families or default_families)
    pool = [p for p in splits[split] if p.family in fams]
    if not pool:
        raise TaskError(f"{source}: no {split} prompts in families {sorted(fams)}")
    return [pool[i] for i in rng.integers(len(pool), size=n)]
