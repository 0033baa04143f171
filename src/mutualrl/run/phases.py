"""The phases of one GRPO step, in order; each takes the run and the policies it acts for.

    sample prompts -> generate -> verify -> publish -> strategy context -> build batches
    -> update -> log

Every phase takes ``names``, the policies of this step (default: every live one), so one policy's
step (generate, verify, publish, build its batches, update) can run on its own; the lock-step
loop (``run.loop``) runs them for all policies at once. Policies learn from verifiable rewards
with GRPO; the strategy decides what, if anything, they share. No phase branches on a strategy's
name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ParamSpec, TypeVar

import numpy as np
import torch

from mutualrl.policies.samples import Sample
from mutualrl.policies.worker import Generate, SequenceLogprobs, Update, UpdateAndGenerate
from mutualrl.retokenize import Retokenizer
from mutualrl.run.experience import publish_step
from mutualrl.run.metrics import namespaced
from mutualrl.run.state import Prefetched, Run
from mutualrl.strategies import StrategyContext
from mutualrl.strategies.base import ReceiverLogprobs, ReceiverSampler, TokenIds
from mutualrl.strategies.common import own_advantages
from mutualrl.tasks import Prompt
from mutualrl.tasks.rewards import WeightedReward, mean_parts
from mutualrl.workers import WorkerUnavailable, call_each, call_one


def sample_prompts(run: Run, step: int):
    rng = np.random.default_rng([run.cfg.seed, 3, step])
    return run.task.sample(rng, run.cfg.grpo.prompts_per_step, "train")


def generate(
    run: Run, prompts, names: list[str] | None = None, step: int | None = None
) -> tuple[dict[str, list[Sample]], dict[str, float]]:
    """Each policy samples its group for each prompt, concurrently through the executor; a
    policy that drew its samples for ``step`` during its last update takes those."""
    names = names or run.live()
    ready = {
        n: p
        for n, p in ((n, run.prefetched.pop(n, None)) for n in names)
        if p is not None and p.step == step
    }
    t0 = time.perf_counter()
    samples = call_each(
        run.executor, {n: sampling_call(run, prompts) for n in names if n not in ready}
    )
    elapsed = time.perf_counter() - t0
    times = {n: elapsed for n in samples}
    for n, p in ready.items():
        samples[n], times[n] = p.samples, p.seconds
    return {n: samples[n] for n in names if n in samples}, times


def sampling_call(run: Run, prompts) -> Generate:
    """The call that draws every policy's groups for ``prompts`` at the run's settings."""
    g = run.cfg.grpo
    return Generate(prompts, g.num_generations, g.max_completion_length, g.temperature)


def verify(run: Run, samples: dict[str, list[Sample]]) -> dict[str, list[Sample]]:
    if run.rewards is not None:
        return verify_weighted(run, run.rewards, samples)
    return {
        name: [
            replace(s, reward=r)
            for s, r in zip(ss, run.verifier.score_many([(s.prompt, s.text) for s in ss]))
        ]
        for name, ss in samples.items()
    }


def verify_weighted(
    run: Run, rewards: WeightedReward, samples: dict[str, list[Sample]]
) -> dict[str, list[Sample]]:
    """Rewards as the weighted sum of ``task.reward_funcs``; each function's mean is kept for the
    log."""
    out = {}
    for name, ss in samples.items():
        scored = rewards.score_many([(s.prompt, s.text) for s in ss])
        run.reward_parts[name] = mean_parts([parts for _, parts in scored])
        out[name] = [replace(s, reward=total) for s, (total, _) in zip(ss, scored)]
    return out


def publish(run: Run, samples: dict[str, list[Sample]]) -> None:
    v = run.rewards or run.task.verifier
    publish_step(
        run.bus,
        run.policies,
        run.versions,
        samples,
        v.verifier_id,
        v.version,
        run.cfg.exchange.success_threshold,
    )


# ---- the strategy's view of the step ----------------------------------------------------------
def make_context(run: Run, step: int, prompts, experience: list | None = None) -> StrategyContext:
    """The strategy's view of this step: peer experience comes from the exchange only (what the
    run's subscription holds, or ``experience`` as a paced run hands it over)."""
    ps = run.policies
    if experience is None:
        experience = run.subscription.drain_deliveries()
    if run.peer_logs is not None:
        experience += run.peer_logs.for_prompts(p.id for p in prompts)
    ctx = StrategyContext(
        step=step,
        grpo=run.cfg.grpo,
        policy_names=list(ps),
        rng=np.random.default_rng([run.cfg.seed, 4, step]),
        encode_prompt={n: p.encode_prompt for n, p in ps.items()},
        # The strategy phase's model compute and THL, timed apart (phase/strategy.<part>_time_s).
        sequence_logprobs={
            n: _timed(remote_logprobs(run, n), run, "strategy.logprobs") for n in ps
        },
        retokenizers={n: _TimedRetokenizer(rt, run) for n, rt in run.retokenizers.items()},
        tokenizers={p.handle.fingerprint: p.handle for p in ps.values()},
        peer_experience=experience,
        generate={n: _timed(remote_generate(run, n), run, "strategy.generate") for n in ps},
        verify=run.verifier,
        publish=lambda record, producer: run.bus.publish(
            record, producer=producer, version=run.versions[producer]
        ),
    )
    for n, fn in ctx.generate.items():
        ctx.generate[n] = _counting_tokens(fn, ctx, n)
    return ctx


def remote_generate(run: Run, name: str) -> ReceiverSampler:
    """A policy's sampler for the strategy (e.g. on hinted prompts), run where its weights are."""
    g = run.cfg.grpo

    def generate(prompts: list[Prompt], num_generations: int) -> list[Sample]:
        return call_one(
            run.executor,
            name,
            Generate(prompts, num_generations, g.max_completion_length, g.temperature),
        )

    return generate


def remote_logprobs(run: Run, name: str) -> ReceiverLogprobs:
    """A policy's ``sequence_logprobs`` for the strategy, computed where its weights are."""

    def sequence_logprobs(prompts: list[TokenIds], completions: list[TokenIds]) -> torch.Tensor:
        return call_one(run.executor, name, SequenceLogprobs(prompts, completions))

    return sequence_logprobs


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _timed(fn: Callable[_P, _T], run: Run, part: str) -> Callable[_P, _T]:
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        with run.step_phase(part):
            return fn(*args, **kwargs)

    return call


def _counting_tokens(
    generate: ReceiverSampler, ctx: StrategyContext, receiver: str
) -> ReceiverSampler:
    """The strategy's extra sampling, counted in ``strategy/generated_tokens`` (completion tokens
    beyond the step's own groups: rollouts are paid for wherever they are drawn)."""

    def call(prompts: list[Prompt], num_generations: int) -> list[Sample]:
        samples = generate(prompts, num_generations)
        m = ctx.metrics.setdefault(receiver, {})
        m["strategy/generated_tokens"] = m.get("strategy/generated_tokens", 0.0) + float(
            sum(len(s.completion_ids) for s in samples)
        )
        return samples

    return call


class _TimedRetokenizer:
    """A receiver's Retokenizer whose retokenize calls count as ``strategy.retokenize`` time
    (a ``strategies.StrategyRetokenizer``)."""

    def __init__(self, rt: Retokenizer, run: Run) -> None:
        self.target, self.max_length = rt.target, rt.max_length
        self.encode_prompt, self.encode_completion = rt.encode_prompt, rt.encode_completion
        self.retokenize = _timed(rt.retokenize, run, "strategy.retokenize")
        self.retokenize_batch = _timed(rt.retokenize_batch, run, "strategy.retokenize")


# ---- batches and updates ----------------------------------------------------------------------
def build_batches(
    run: Run, ctx: StrategyContext, samples: dict[str, list[Sample]]
) -> dict[str, list]:
    """The strategy assembles each receiver's batches from its own samples and the exchange."""
    batches = {}
    with run.step_phase("strategy"):  # includes its retokenize, logprobs and generate parts
        for name, own in samples.items():
            try:
                batches[name] = run.strategy.build_batches(ctx, name, own)
            except WorkerUnavailable:  # its receiver-side call failed; on_failure has dealt with it
                continue
    return batches


def update(run: Run, ctx: StrategyContext, batches: dict[str, list]) -> dict[str, dict]:
    """The policies train on their batches concurrently; each reports its new weight version.
    With ``allocation.async_generation`` each also draws its next step's samples meanwhile."""
    nxt = ctx.step + 1
    ahead = run.cfg.allocation.async_generation and nxt < run.cfg.steps
    gen = sampling_call(run, sample_prompts(run, nxt)) if ahead else None
    with run.step_phase("update"):
        results = run.executor.call(
            {n: Update(b) if gen is None else UpdateAndGenerate(b, gen) for n, b in batches.items()}
        )
    for name in results:
        run.strategy.after_update(ctx, name)
    stats = {}
    for n, r in results.items():
        if r.ok:
            stats[n], run.versions[n] = r.value[:2]
            if gen is not None:
                run.prefetched[n] = Prefetched(nxt, r.value[2], stats[n]["async/generate_time_s"])
    return stats


# ---- a step's two halves, as both schedulers run them ------------------------------------------
@dataclass(frozen=True)
class Produced:
    """The first half of a step for the policies it acted for: the prompts, each policy's
    verified samples (published to the exchange) and its generation seconds."""

    step: int
    prompts: list[Prompt]
    samples: dict[str, list[Sample]]
    gen_time: dict[str, float]


def produce(run: Run, step: int, names: list[str] | None = None) -> Produced:
    """sample prompts -> generate -> verify -> publish, for ``names`` (default: every live
    policy). A policy whose generation failed (and that ``on_failure`` let go) has no samples."""
    clock = run.step_phase
    prompts = sample_prompts(run, step)
    with clock("generate"):
        samples, gen_time = generate(run, prompts, names, step)
    with clock("verify"):
        samples = verify(run, samples)
    with clock("publish"):
        publish(run, samples)
    return Produced(step, prompts, samples, gen_time)


def learn(
    run: Run, made: Produced, experience: list | None = None
) -> tuple[StrategyContext, dict[str, dict]]:
    """strategy context -> observe -> build batches -> update, for the policies of ``made``;
    the context (its metrics go into the step's record) and each policy's update stats.
    ``experience``: the peer experience a paced run hands over (default: the run's
    subscription)."""
    with run.step_phase("strategy"):  # with build_batches: routing, THL, buffers
        ctx = make_context(run, made.step, made.prompts, experience)
        run.strategy.observe(ctx, made.samples)
    return ctx, update(run, ctx, build_batches(run, ctx, made.samples))


# ---- logging ----------------------------------------------------------------------------------
def sample_metrics(samples: list[Sample], elapsed: float, g) -> dict[str, float]:
    rewards = np.array([s.reward for s in samples])
    groups = rewards.reshape(-1, g.num_generations)
    lengths = np.array([len(s.completion_ids) for s in samples])
    out = {
        "reward/mean": rewards.mean(),
        "reward/std": rewards.std(),
        "frac_reward_zero_std": float((groups.std(1) == 0).mean()),
        "completion_length": lengths.mean(),
        "truncated_frac": float(np.mean([s.finish_reason == "length" for s in samples])),
        "tokens_per_s": lengths.sum() / max(elapsed, 1e-9),
        # GRPO guides aim for about 0.5-1.5; near 0 means the groups carry no signal.
        "adv_var": float(own_advantages(samples, g)[0].var(unbiased=False)),
    }
    for fam in sorted({s.prompt.family for s in samples}):
        out[f"reward/{fam}/mean"] = float(
            np.mean([s.reward for s in samples if s.prompt.family == fam])
        )
    return out


def log_step(run: Run, step: int, samples, gen_time, update_stats, ctx, step_time) -> dict:
    record: dict = {"phase": "train", "step": step, "time_s": step_time}
    for name, ss in samples.items():
        record.update(
            policy_metrics(run, name, ss, gen_time[name], update_stats.get(name, {}), ctx)
        )
    record.update(run_metrics(run))
    record.update({f"phase/{k}_time_s": v for k, v in run.step_phases.items()})
    run.writer.write(record)
    return record


def policy_metrics(
    run: Run, name: str, samples: list[Sample], gen_time: float, update_stats: dict, ctx
) -> dict:
    """One policy's part of a step's record (namespaced); its reward joins the run's history."""
    m = sample_metrics(samples, gen_time, run.cfg.grpo)
    m.update(update_stats)
    m.update(ctx.metrics.get(name, {}))
    m.update(run.reward_parts.get(name, {}))
    run.history.setdefault(name, []).append(m["reward/mean"])
    return namespaced(name, m)


def run_metrics(run: Run) -> dict:
    """The run's counters as a step's record carries them: verifier failures and the exchange."""
    c = run.verifier.counters
    record = {"verifier/errors": c.errors, "verifier/timeouts": c.timeouts}
    if run.rewards is not None:
        errors, timeouts = run.rewards.failures()
        record.update({"rewards/errors": errors, "rewards/timeouts": timeouts})
    bus = run.bus.stats()
    record.update(
        {
            "exchange/published": bus["published"],
            "exchange/bytes": bus["bytes_written"],
            "exchange/raw_bytes": bus["raw_bytes_written"],
            "exchange/dropped": bus["dropped"],
            "exchange/duplicates": bus["duplicates"],
        }
    )
    return record


def log_pace(
    run: Run,
    ctx: StrategyContext,
    samples: dict[str, list[Sample]],
    busy: dict[str, float],
    versions: dict[str, int],
) -> None:
    """Per policy: seconds its worker was busy during the step (the rest of the step it idled)
    and, when its samples were drawn during its last update, how many versions they lag behind
    the weights they were trained from (``versions``: the run's record before the update)."""
    for name, ss in samples.items():
        if name in busy:
            ctx.log(name, "pace/busy_time_s", busy[name])
        if run.cfg.allocation.async_generation and ss:
            drawn = min(
                (s.policy_version for s in ss if s.policy_version is not None),
                default=versions[name],
            )
            ctx.log(name, "pace/sample_version_lag", versions[name] - drawn)


def check_guards(run: Run, record: dict) -> None:
    """After a finished step: record and raise the first guard it tripped, if any."""
    tripped = run.guards.observe(record, list(run.policies)) if run.guards else None
    if tripped is not None:
        run.writer.write(tripped.record())
        run.progress.finish_phase(f"stopped: {tripped.guard} tripped for {tripped.policy}")
        raise tripped
