"""Tasks and verifiers: the plug-in interfaces and the guarded verifier call.

A task yields ``Prompt``s from a train, validation or held-out split, each tagged with a
*family* (a kind of prompt: policies may be good at some families and not others). A verifier
maps (prompt, completion text) to a reward. A verifier that raises or runs past its time limit
gives reward 0 and is counted; it never stops the run.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Protocol

import numpy as np

from mutualrl.registry import Registry

# "validation": disjoint from both others, for choosing settings (learning rates, recipes) so
# that the held-out test never chooses anything; tasks without one refuse it in one line.
Split = Literal["train", "validation", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "validation", "heldout")


class TaskError(ValueError):
    """A task that cannot be built (bad data file, unknown family)."""


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str
    family: str
    # The start of the answer, given to the policy: generation continues it. Raw text follows
    # the question; under a chat template it opens the assistant's turn (the hint strategy's
    # partial solutions). It is not part of the prompt's id.
    prefill: str = ""

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
    # read-only here, so a task may hold a narrower type (a tuple, its own verifier class)
    @property
    def families(self) -> Sequence[str]: ...

    @property
    def verifier(self) -> Verifier: ...

    def sample(
        self, rng: np.random.Generator, n: int, split: Split, families: Sequence[str] | None = None
    ) -> list[Prompt]: ...

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
    """Runs a verifier with a time limit; errors and time-outs give reward 0 and are counted.

    ``threads`` (``allocation.verifier_threads``): how many samples ``score_many`` verifies at
    once; 0 or 1, one after another. Each call keeps its own time limit, counted from when it
    starts. Concurrent calls share the verifier object, which must then be thread-safe (the
    built-in ones keep no state). Callers on several threads (a paced run's policies) take turns:
    no call waits in the pool behind another caller's, and a hung call abandons only its own."""

    def __init__(self, verifier: Verifier, timeout_s: float, threads: int = 0) -> None:
        self.verifier = verifier
        self.timeout_s = timeout_s
        self.threads = threads
        self.counters = VerifierCounters()
        self._turn = threading.RLock()
        self._clock = threading.Lock()
        self._spent: dict[int, float] = {}  # thread ident -> seconds inside finished calls
        self._since: dict[int, float] = {}  # thread ident -> start of its call in progress
        # A verifier that hangs is abandoned (threads cannot be killed) with its pool, and a
        # fresh pool is made, so later calls are not stuck behind it.
        self._pool = self._new_pool()

    def _new_pool(self) -> cf.ThreadPoolExecutor:
        return cf.ThreadPoolExecutor(
            max_workers=max(1, self.threads), thread_name_prefix="verifier"
        )

    def _abandon_pool(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._new_pool()

    def seconds_in_calls(self, ident: int) -> float:
        """Seconds the thread ``ident`` has spent in this verifier's calls so far, its waits for
        its turn and the call in progress included. Each call is bounded by ``timeout_s``, so a
        paced run's step time-out sets these seconds aside (``pacing.driver``)."""
        with self._clock:
            spent, since = self._spent.get(ident, 0.0), self._since.get(ident)
            return spent if since is None else spent + time.monotonic() - since

    @contextlib.contextmanager
    def _clocked(self):
        ident = threading.get_ident()
        with self._clock:
            outer = ident not in self._since  # score_many's per-sample calls count once
            if outer:
                self._since[ident] = time.monotonic()
        try:
            yield
        finally:
            if outer:
                with self._clock:
                    start = self._since.pop(ident)
                    self._spent[ident] = self._spent.get(ident, 0.0) + time.monotonic() - start

    def __call__(self, prompt: Prompt, completion: str) -> float:
        with self._clocked(), self._turn:
            self.counters.calls += 1
            future = self._pool.submit(self.verifier, prompt, completion)
            if not cf.wait([future], timeout=self.timeout_s).done:
                self.counters.timeouts += 1
                self._abandon_pool()
                return 0.0
            return self._settle(future)

    def _settle(self, future: cf.Future) -> float:
        """A finished call's reward; an error or a non-finite value is 0, counted."""
        try:
            reward = float(future.result(timeout=0))
        except Exception as exc:  # noqa: BLE001 - any verifier failure is a zero reward, counted
            self.counters.errors += 1
            self.counters.last_error = f"{type(exc).__name__}: {exc}"
            return 0.0
        if not np.isfinite(reward):
            self.counters.errors += 1
            self.counters.last_error = f"non-finite reward {reward!r}"
            return 0.0
        return reward

    def score_many(self, items: Sequence[tuple[Prompt, str]]) -> list[float]:
        """The rewards of (prompt, completion) pairs, in order, ``threads`` verified at once."""
        with self._clocked():
            if self.threads <= 1:
                return [self(p, c) for p, c in items]
            with self._turn:
                return self._score_threaded(items)

    def _score_threaded(self, items: Sequence[tuple[Prompt, str]]) -> list[float]:
        self.counters.calls += len(items)
        out = [0.0] * len(items)
        started: dict[int, float] = {}

        def run(i: int) -> float:
            started[i] = time.monotonic()
            return self.verifier(*items[i])

        todo = list(range(len(items)))
        while todo:
            futures = {self._pool.submit(run, i): i for i in todo}
            todo = self._collect(futures, started, out)
        return out

    def _collect(
        self, futures: dict[cf.Future, int], started: dict[int, float], out: list[float]
    ) -> list[int]:
        """Settle ``futures`` into ``out``; calls past their time limit count as time-outs and
        their pool is abandoned. Returns the calls that had not started then (to resubmit)."""
        pending, todo = set(futures), []
        while pending:
            done, pending = cf.wait(pending, timeout=0.05, return_when=cf.FIRST_COMPLETED)
            for f in done:
                out[futures[f]] = self._settle(f)
            now = time.monotonic()
            hung = {
                f
                for f in pending
                if not f.done() and now - started.get(futures[f], now) > self.timeout_s
            }
            if hung:
                self.counters.timeouts += len(hung)
                pending -= hung
                todo += [futures[f] for f in pending if f.cancel()]
                pending = {f for f in pending if not f.cancelled()}
                self._abandon_pool()
        return todo

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# Draws of a split tried before a family's distinct problems count as all there are: the
# arithmetic task's held-out draw gives all of them in its first, a file's pool with replacement
# a few more each.
DISTINCT_ROUNDS = 8


def distinct_prompts(
    task: Task, seed: Sequence[int], n: int, split: Split, family: str
) -> list[Prompt]:
    """Up to ``n`` distinct problems of ``family`` in ``split`` (by prompt id), in drawing order:
    the task's draw of ``n`` from ``seed``'s generator with its repeats left out, then further
    draws from the same generator while they bring new problems. Fewer than ``n`` means the
    split holds no more (or the draws found no more in ``DISTINCT_ROUNDS`` tries): evaluation
    counts each problem once, never a repeat as another sample."""
    rng = np.random.default_rng(list(seed))
    found: dict[str, Prompt] = {}
    for _ in range(DISTINCT_ROUNDS):
        before = len(found)
        for p in task.sample(rng, n, split, [family]):
            if len(found) < n:
                found.setdefault(p.id, p)
        if len(found) >= n or len(found) == before:
            break
    return list(found.values())


def sample_split(
    splits: dict[str, list[Prompt]],
    default_families: Sequence[str],
    source: object,
    rng: np.random.Generator,
    n: int,
    split: Split,
    families: Sequence[str] | None = None,
) -> list[Prompt]:
    """``n`` prompts drawn with replacement from a file-based task's ``split`` in ``families``."""
    fams = set(families or default_families)
    pool = [p for p in splits.get(split, []) if p.family in fams]
    if not pool:
        how = " (mark rows with split 'validation')" if split == "validation" else ""
        raise TaskError(f"{source}: no {split} prompts in families {sorted(fams)}{how}")
    return [pool[i] for i in rng.integers(len(pool), size=n)]
