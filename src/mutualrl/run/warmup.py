"""The supervised warm start that opens every run, and a cache through which runs share it.

Each policy with ``warmup_families`` is trained by SFT on demonstrations of those families until
its greedy accuracy on a probe reaches ``warmup.target_accuracy`` (checked every ``eval_every``
steps) or ``max_steps`` have passed. The run's scenario (``mutualrl.run.scenarios``) may change what
each policy is taught and where it stops; the default, ``disjoint``, is exactly this. The policies
warm up at the same time, one executor call per step for all of them, each on its own seeded
prompt stream: they share the machine, and one policy's warm start does not depend on which other
policies the run has.

With ``warmup.cache_dir`` set, the warm start is done once per *key*, a digest of every config
field it can depend on (all but the fields only later phases read). The first run stores each
policy's whole state (weights, optimizer moments, sampler generator) and the warm start's metric
records under ``<cache_dir>/<key>/``; a later run with the same key loads them and writes the same
records, so it continues exactly as if it had warmed up itself. Either way, each policy's KL
reference is then frozen at its warm-started weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import mutualrl
from mutualrl.config import RunConfig, to_dict
from mutualrl.policies.batch import SFTExample
from mutualrl.policies.worker import FreezeReference, Generate, LoadState, SaveState, SFTStep
from mutualrl.provenance import source_digest
from mutualrl.run.evaluation import accuracy
from mutualrl.run.metrics import MetricsWriter, namespaced, read_metrics
from mutualrl.run.scenarios import (
    WarmPlan,
    own_prompts,
    peer_count,
    peer_prompts,
    shared_answers,
    warm_plans,
)
from mutualrl.run.signals import RunInterrupted
from mutualrl.workers import call_each

if TYPE_CHECKING:
    from mutualrl.run.state import Run

# Config fields that only phases after the warm start read: runs differing only in these share it.
AFTER_WARM_START = (
    "steps",
    "strategy",
    "output_dir",
    "strategies",
    "eval",
    "exchange",
    "diversity",
)
CACHE_FORMAT = 1
RECORDS = "metrics.jsonl"


def warm_start(run: Run) -> None:
    """Warm start the run's policies (or load them from the cache), then freeze their references."""
    plans = warm_plans(run.cfg)
    live = set(run.live())
    names = [p.name for p in run.cfg.policies if plans[p.name].families and p.name in live]
    if names and run.cfg.warmup.max_steps > 0:
        cache_dir = run.cfg.warmup.cache_dir
        cache = WarmStartCache(run.cfg, cache_dir) if cache_dir else None
        if cache is not None and cache.load(run, names):
            run.progress.start_phase("warm start", 0)
            run.progress.finish_phase(f"loaded from cache {cache.path}")
        else:
            records, complete = supervised_warm_start(run, names, plans)
            if cache is not None and complete:
                cache.store(run, names, records)
    run.call_live(FreezeReference())


@dataclass
class _Warming:
    """One policy's warm start in progress."""

    policy: Any  # its PolicyView: tokenizer and config
    rng: np.random.Generator  # its demonstration stream
    probe: list  # prompts its accuracy is measured on
    plan: WarmPlan  # what the scenario teaches it, and when it stops
    shared: dict  # peer family -> the answers its peer demonstrations cover
    step: int = 0
    loss: float = math.nan
    accuracy: float = 0.0

    def done_record(self) -> dict:
        name = self.policy.name
        return {
            "phase": "warmup_done",
            "policy": name,
            "step": self.step,
            **namespaced(name, {"steps": self.step, "accuracy": self.accuracy}, "warmup/"),
        }


def supervised_warm_start(
    run: Run, names: list[str], plans: dict[str, WarmPlan]
) -> tuple[list[dict], bool]:
    """SFT steps for every named policy at once until each reaches its plan's target accuracy.

    Returns the metric records written and whether every policy finished (none failed)."""
    w, seed = run.cfg.warmup, run.cfg.seed
    index = {p.name: i for i, p in enumerate(run.cfg.policies)}
    warming = {
        n: _Warming(
            run.policies[n],
            np.random.default_rng([seed, 1, index[n]]),
            own_prompts(run.task, np.random.default_rng([seed, 2]), w.eval_prompts, plans[n]),
            plans[n],
            _shared(run.task, plans[n]),
        )
        for n in names
    }
    records: list[dict] = []

    def write(record: dict) -> None:
        run.writer.write(record)
        records.append(record)

    complete = True
    run.progress.start_phase("warm start", w.max_steps)
    for step in range(1, w.max_steps + 1):
        if run.stop.signum is not None:  # SIGINT/SIGTERM: nothing to checkpoint before GRPO starts
            raise RunInterrupted(run.stop.signum, 0, run.out, None)
        losses = call_each(
            run.executor,
            {n: SFTStep(demonstrations(run, s), w.learning_rate) for n, s in warming.items()},
        )
        complete &= _keep_succeeded(warming, losses)
        for n, loss in losses.items():
            warming[n].step, warming[n].loss = step, loss
        if step % w.eval_every == 0 and warming:
            greedy = call_each(
                run.executor,
                {
                    n: Generate(
                        s.probe,
                        num_generations=1,
                        max_new_tokens=run.cfg.grpo.max_completion_length,
                        temperature=0.0,
                    )
                    for n, s in warming.items()
                },
            )
            complete &= _keep_succeeded(warming, greedy)
            for n, samples in greedy.items():
                s = warming[n]
                s.accuracy = accuracy(samples, run.verifier)
                write(
                    {
                        "phase": "warmup",
                        "step": step,
                        "policy": n,
                        **namespaced(n, {"loss": s.loss, "accuracy": s.accuracy}, "warmup/"),
                    }
                )
                if s.accuracy >= s.plan.target_accuracy:
                    write(warming.pop(n).done_record())
        run.progress.advance(
            " | ".join(f"{n}: loss {s.loss:.3f} acc {s.accuracy:.2f}" for n, s in warming.items())
        )
        if not warming:
            break
    for s in warming.values():
        write(s.done_record())
    run.progress.finish_phase(end_message(w, step, list(warming), complete))
    return records, complete


def end_message(w, step: int, unfinished: list[str], complete: bool) -> str:
    """Why the warm start ended, for its progress bar."""
    if unfinished:
        return f"max_steps {w.max_steps} reached ({', '.join(unfinished)} below target accuracy)"
    if not complete:
        return f"stopped at step {step}: a policy failed"
    return f"target accuracy {w.target_accuracy:g} reached at step {step}"


def demonstrations(run: Run, s: _Warming) -> tuple[SFTExample, ...]:
    """One batch of demonstrations of the policy's warm-up families (and, where the scenario says
    so, a share of its peers' families), in its own tokenization."""
    size = run.cfg.warmup.batch_size
    n_peer = peer_count(s.plan, size)
    prompts = own_prompts(run.task, s.rng, size - n_peer, s.plan)
    if n_peer:
        prompts += peer_prompts(run.task, s.rng, n_peer, s.plan, s.shared)
    return tuple(
        SFTExample(
            s.policy.encode_prompt(p.text), s.policy.encode_completion(run.task.demonstration(p))
        )
        for p in prompts
    )


def _shared(task, plan: WarmPlan) -> dict:
    return {f: shared_answers(task, f, plan.shared_fraction) for f in plan.peer_families}


def _keep_succeeded(warming: dict[str, _Warming], results: dict[str, Any]) -> bool:
    """Drop policies whose call failed (``on_failure`` has dealt with them); True if none did."""
    failed = [n for n in warming if n not in results]
    for n in failed:
        del warming[n]
    return not failed


# ---- the cache ------------------------------------------------------------------------------
def cache_key(cfg: RunConfig) -> tuple[str, dict[str, Any]]:
    """(digest, keyed fields): every config field the warm start may depend on, with the versions
    of the code that ran it. Conservative: a field in doubt is in the key."""
    keyed = {k: v for k, v in to_dict(cfg).items() if k not in AFTER_WARM_START}
    keyed["warmup"] = {k: v for k, v in keyed["warmup"].items() if k != "cache_dir"}
    # The code that ran it, not only the version: a change without a version bump must miss.
    keyed["versions"] = {
        "cache_format": CACHE_FORMAT,
        "mutualrl": mutualrl.__version__,
        "code": source_digest(),
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16], keyed


class WarmStartCache:
    """``<cache_dir>/<key>/``: ``<policy>.pt`` per policy (``Policy.save_state``), the warm start's
    metric records, and ``key.json`` (the keyed fields, to tell what a key stands for)."""

    def __init__(self, cfg: RunConfig, cache_dir: str) -> None:
        self.root = Path(cache_dir)
        self.key, self.keyed = cache_key(cfg)
        self.path = self.root / self.key

    def load(self, run: Run, names: list[str]) -> bool:
        """Load every named policy's warm-started state; False (nothing loaded) on a miss."""
        files = {n: self.path / f"{n}.pt" for n in names}
        if not (self.path / RECORDS).is_file() or not all(f.is_file() for f in files.values()):
            return False
        loaded = call_each(run.executor, {n: LoadState(str(f)) for n, f in files.items()})
        missing = sorted(set(names) - set(loaded))
        if missing:
            raise RuntimeError(
                f"warm-start cache {self.path}: loading {missing} failed; delete that "
                "folder to warm up afresh"
            )
        for record in read_metrics(self.path / RECORDS):
            run.writer.write(record)
        run.writer.write(
            {"phase": "warmup_cache", "hit": True, "key": self.key, "path": str(self.path)}
        )
        return True

    def store(self, run: Run, names: list[str], records: list[dict]) -> None:
        """Save every named policy's state under the key, whole or not at all."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.key}-", dir=self.root))
        try:
            saved = call_each(run.executor, {n: SaveState(str(tmp / f"{n}.pt")) for n in names})
            if set(saved) != set(names):
                return
            writer = MetricsWriter(tmp / RECORDS)
            for record in records:
                writer.write(record)
            writer.close()
            (tmp / "key.json").write_text(json.dumps(self.keyed, indent=2))
            try:
                os.replace(tmp, self.path)  # atomic; if a twin run stored it first, its copy stays
            except OSError:
                return
            run.writer.write(
                {"phase": "warmup_cache", "hit": False, "key": self.key, "path": str(self.path)}
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
