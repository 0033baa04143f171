"""The training loop. One iteration, top to bottom:

    sample prompts -> each policy generates -> verify -> publish experience
    -> the strategy routes and adapts peer experience -> each policy updates -> log

Policies learn from verifiable rewards with GRPO; the strategy decides what, if anything, they
share. The loop never branches on a strategy's name.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec
import numpy as np
import torch

from mutualrl import checkpoint
from mutualrl.allocation import make_executor, plan, resolve_inventory, worker_specs_from_config
from mutualrl.allocation.config import AllocationConfig, parse_allocation
from mutualrl.allocation.planner import Plan
from mutualrl.config import ConfigError, RunConfig, to_dict
from mutualrl.evaluation import append_heldout, correctness, heldout_record, score_correctness
from mutualrl.guards import Guards, GuardTripped
from mutualrl.exchange import ExperienceBus
from mutualrl.experience import PeerLogPool, open_bus, publish_step
from mutualrl.retokenize import Retokenizer
from mutualrl.metrics import MetricsWriter, namespaced
from mutualrl.policies.checkpoints import check_checkpoints, check_policies
from mutualrl.policies.placement import policy_device
from mutualrl.policies.policy import Policy, PolicyView, Sample, load_handles
from mutualrl.progress import RunProgress
from mutualrl.strategies import Strategy, StrategyContext, build_strategy
from mutualrl.strategies.common import own_advantages
from mutualrl.tasks import GuardedVerifier, Task, build_task
from mutualrl.tasks.rewards import WeightedReward, build_rewards, mean_parts
from mutualrl.tracking import check_trackers, make_writer
from mutualrl.warmup import warm_start
from mutualrl.workers import WorkerUnavailable, call_live, call_one


@dataclass
class Run:
    """Everything one run holds; built once by ``build_run``.

    ``policies`` are the driver's views of the policies (tokenizers, encodings, versions); every
    call that touches weights goes through ``executor``, wherever the policies live.
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
    subscription: object
    retokenizers: dict[str, Retokenizer]
    executor: object = None
    peer_logs: PeerLogPool | None = None
    rewards: WeightedReward | None = None      # task.reward_funcs; None: the verifier alone
    reward_parts: dict[str, dict[str, float]] = field(default_factory=dict)  # last step's means
    history: dict[str, list[float]] = field(default_factory=dict)
    guards: Guards | None = None
    phase_times: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Wall seconds of the current GRPO step by loop phase, logged as ``phase/<phase>_time_s``.
    step_phases: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def timed(self, phase: str):
        """Add the block's wall time to ``phase_times[phase]`` (the run's totals)."""
        return _clocked(self.phase_times, phase)

    def step_phase(self, phase: str):
        """Add the block's wall time to this step's ``step_phases[phase]``."""
        return _clocked(self.step_phases, phase)


@contextlib.contextmanager
def _clocked(bucket: dict[str, float], key: str):
    """Add the block's wall time to ``bucket[key]``, also when it raises."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        bucket[key] += time.perf_counter() - t0


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def build_run(cfg: RunConfig, progress: RunProgress | None = None) -> Run:
    """Validate and build everything before any training work (fail fast, write nothing odd)."""
    seed_everything(cfg.seed)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    strategy = build_strategy(cfg)           # bad strategy parameters fail here, first
    check_trackers(cfg.report_to)            # a missing tracker package fails before any work
    task = build_task(cfg.task)
    rewards = build_rewards(cfg.task, task)  # unknown reward functions fail here
    checkpoints = check_checkpoints(cfg.policies)  # present, of a registered family
    for p in cfg.policies:
        bad = [f for f in p.warmup_families if f not in task.families]
        if bad:
            raise ConfigError(f"policies.{p.name}.warmup_families: {bad} not in task families "
                              f"{list(task.families)}")
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir (--output-dir): {out} is an existing file; expected a "
                          "directory to write the run into (or a path that does not exist yet)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    peer_logs = PeerLogPool(cfg.exchange.peer_logs) if cfg.exchange.peer_logs else None
    handles = load_handles(cfg.policies)      # each tokenizer once; the driver encodes prompts
    check_policies(cfg.policies, handles, checkpoints)  # chat templates present, vocab fits
    bus, sub = open_bus(out, cfg.exchange)
    executor = start_executor(cfg, out, handles)
    policies = driver_policies(cfg, executor, handles)
    profiles: dict = {}
    return Run(cfg=cfg, out=out, task=task,
               verifier=GuardedVerifier(task.verifier, cfg.task.verifier_timeout_s),
               policies=policies, strategy=strategy,
               writer=make_writer(out / "metrics.jsonl", cfg.report_to, out.name, to_dict(cfg)),
               progress=progress or RunProgress(enabled=False), bus=bus, subscription=sub,
               retokenizers={n: Retokenizer(p.handle, max_length=cfg.grpo.max_completion_length,
                                            profiles=profiles) for n, p in policies.items()},
               peer_logs=peer_logs, executor=executor, rewards=rewards, guards=Guards(cfg.guards))


def start_executor(cfg: RunConfig, out: Path, handles: dict):
    """Plan resources for the run's workers, record the plan, and start the executor on it.

    Each policy is one worker, built by the executor from its factory (in this process for
    ``local``, in its own actor for ``ray``); the loop reaches it only through executor calls.
    """
    alloc = parse_allocation(cfg.allocation)
    vocab = {spec: h.vocab_size for spec, h in handles.items()}
    specs = worker_specs_from_config(cfg, alloc, vocab_size=vocab.__getitem__)
    the_plan = plan(specs, resolve_inventory(alloc), alloc.memory.usable_memory_fraction)
    (out / "plan.json").write_bytes(msgspec.json.format(msgspec.json.encode(the_plan), indent=2))
    executor = make_executor(alloc)
    executor.start(policy_factories(cfg, alloc, handles, the_plan), policy_plan(the_plan, cfg))
    return executor


def policy_factories(cfg: RunConfig, alloc: AllocationConfig, handles: dict,
                     the_plan: Plan | None = None) -> dict:
    """Picklable factories, one per policy. In process they reuse the driver's tokenizers;
    elsewhere each worker loads its own. Each is placed by ``policy_device``; its learning-rate
    schedule spans the run's optimizer steps (steps x num_iterations GRPO updates)."""
    in_process = alloc.executor == "local"
    return {p.name: functools.partial(
                Policy, p, cfg.grpo, seed=cfg.seed * 1000 + i,
                device=policy_device(p.name, cfg.device, the_plan, alloc.executor),
                handle=handles[p.tokenizer] if in_process else None,
                total_steps=cfg.steps * cfg.grpo.num_iterations)
            for i, p in enumerate(cfg.policies)}


def policy_plan(the_plan: Plan, cfg: RunConfig) -> Plan:
    """The plan as the executor sees the loop's workers: a policy's learner and generator are one
    object, named after the policy, on its learner's devices. Its CPU threads are capped at
    ``torch_threads`` when that is set, so every executor kind computes with the same count."""
    names = {p.name for p in cfg.policies}
    cap = cfg.torch_threads or None
    merged = tuple(msgspec.structs.replace(a, worker=a.policy, threads=min(a.threads, cap or a.threads))
                   for a in the_plan.assignments if a.role == "learner" and a.policy in names)
    return msgspec.structs.replace(the_plan, assignments=merged)


def driver_policies(cfg: RunConfig, executor, handles: dict) -> dict[str, PolicyView]:
    """The driver's view of each policy. An in-process executor's worker is a Policy, which is its
    own view (tests may reach its model); otherwise a tokenizer-only ``PolicyView``."""
    worker = getattr(executor, "worker", None)
    return {p.name: worker(p.name) if worker else PolicyView(p, handles[p.tokenizer])
            for p in cfg.policies}


def remote_generate(executor, name: str, g):
    """A policy's sampler for the strategy (e.g. on hinted prompts), run where its weights are."""
    def generate(prompts, num_generations):
        return call_one(executor, name, "generate", prompts=prompts, num_generations=num_generations,
                        max_new_tokens=g.max_completion_length, temperature=g.temperature)
    return generate


def remote_logprobs(executor, name: str):
    """A policy's ``sequence_logprobs`` for the strategy, computed where its weights are."""
    def sequence_logprobs(prompts, completions):
        return call_one(executor, name, "sequence_logprobs", prompts=prompts, completions=completions)
    return sequence_logprobs


# ---- one iteration, phase by phase --------------------------------------------------------
def sample_prompts(run: Run, step: int):
    rng = np.random.default_rng([run.cfg.seed, 3, step])
    return run.task.sample(rng, run.cfg.grpo.prompts_per_step, "train")


def generate(run: Run, prompts) -> tuple[dict[str, list[Sample]], dict[str, float]]:
    """Every live policy samples its group for each prompt, concurrently through the executor."""
    g = run.cfg.grpo
    kwargs = dict(prompts=prompts, num_generations=g.num_generations,
                  max_new_tokens=g.max_completion_length, temperature=g.temperature)
    t0 = time.perf_counter()
    samples = call_live(run.executor, "generate", **kwargs)
    elapsed = time.perf_counter() - t0
    return samples, {n: elapsed for n in samples}


def verify(run: Run, samples: dict[str, list[Sample]]) -> dict[str, list[Sample]]:
    if run.rewards is not None:
        return verify_weighted(run, samples)
    return {name: [replace(s, reward=run.verifier(s.prompt, s.text)) for s in ss]
            for name, ss in samples.items()}


def verify_weighted(run: Run, samples: dict[str, list[Sample]]) -> dict[str, list[Sample]]:
    """Rewards as the weighted sum of ``task.reward_funcs``; each function's mean is kept for the log."""
    out = {}
    for name, ss in samples.items():
        scored = [run.rewards.score(s.prompt, s.text) for s in ss]
        run.reward_parts[name] = mean_parts([parts for _, parts in scored])
        out[name] = [replace(s, reward=total) for s, (total, _) in zip(ss, scored)]
    return out


def publish(run: Run, samples: dict[str, list[Sample]]) -> None:
    v = run.rewards or run.task.verifier
    publish_step(run.bus, run.policies, samples, v.verifier_id, v.version,
                 run.cfg.exchange.success_threshold)


def make_context(run: Run, step: int, prompts) -> StrategyContext:
    """The strategy's view of this step: peer experience comes from the exchange only."""
    ps = run.policies
    experience = run.subscription.drain_deliveries()
    if run.peer_logs is not None:
        experience += run.peer_logs.for_prompts(p.id for p in prompts)
    ctx = StrategyContext(
        step=step, grpo=run.cfg.grpo, policy_names=list(ps),
        rng=np.random.default_rng([run.cfg.seed, 4, step]),
        encode_prompt={n: p.encode_prompt for n, p in ps.items()},
        # The strategy phase's model compute and THL, timed apart (phase/strategy.<part>_time_s).
        sequence_logprobs={n: _timed(remote_logprobs(run.executor, n), run, "strategy.logprobs")
                           for n in ps},
        retokenizers={n: _TimedRetokenizer(rt, run) for n, rt in run.retokenizers.items()},
        tokenizers={p.handle.fingerprint: p.handle for p in ps.values()},
        peer_experience=experience,
        generate={n: _timed(remote_generate(run.executor, n, run.cfg.grpo), run, "strategy.generate")
                  for n in ps},
        verify=run.verifier,
        publish=lambda record, producer: run.bus.publish(
            record, producer=producer, version=ps[producer].version))
    for n, fn in ctx.generate.items():
        ctx.generate[n] = _counting_tokens(fn, ctx, n)
    return ctx


def _timed(fn, run: Run, part: str):
    def call(*args, **kwargs):
        with run.step_phase(part):
            return fn(*args, **kwargs)
    return call


def _counting_tokens(generate, ctx: StrategyContext, receiver: str):
    """The strategy's extra sampling, counted in ``strategy/generated_tokens`` (completion tokens
    beyond the step's own groups: rollouts are paid for wherever they are drawn)."""
    def call(prompts, num_generations):
        samples = generate(prompts, num_generations)
        m = ctx.metrics.setdefault(receiver, {})
        m["strategy/generated_tokens"] = m.get("strategy/generated_tokens", 0.0) + float(
            sum(len(s.completion_ids) for s in samples))
        return samples
    return call


class _TimedRetokenizer:
    """A receiver's Retokenizer whose retokenize calls count as ``strategy.retokenize`` time."""

    def __init__(self, rt: Retokenizer, run: Run) -> None:
        self._rt = rt
        self.retokenize = _timed(rt.retokenize, run, "strategy.retokenize")
        self.retokenize_batch = _timed(rt.retokenize_batch, run, "strategy.retokenize")

    def __getattr__(self, name: str):
        return getattr(self._rt, name)


def update(run: Run, ctx: StrategyContext, samples: dict[str, list[Sample]]) -> dict[str, dict]:
    """The strategy assembles each receiver's batches; the policies train on them concurrently."""
    batches = {}
    with run.step_phase("strategy"):   # includes its retokenize, logprobs and generate parts
        for name, own in samples.items():
            try:
                batches[name] = run.strategy.build_batches(ctx, name, own)
            except WorkerUnavailable:   # its receiver-side call failed; on_failure has dealt with it
                continue
    with run.step_phase("update"):
        results = run.executor.call("update", {n: {"batches": b} for n, b in batches.items()})
    for name in results:
        run.strategy.after_update(ctx, name)
    stats = {}
    for n, r in results.items():
        if r.ok:
            stats[n], run.policies[n].version = r.value
    return stats


def sample_metrics(samples: list[Sample], elapsed: float, g) -> dict[str, float]:
    rewards = np.array([s.reward for s in samples])
    groups = rewards.reshape(-1, g.num_generations)
    lengths = np.array([len(s.completion_ids) for s in samples])
    out = {"reward/mean": rewards.mean(), "reward/std": rewards.std(),
           "frac_reward_zero_std": float((groups.std(1) == 0).mean()),
           "completion_length": lengths.mean(),
           "truncated_frac": float(np.mean([s.finish_reason == "length" for s in samples])),
           "tokens_per_s": lengths.sum() / max(elapsed, 1e-9),
           # GRPO guides aim for about 0.5-1.5; near 0 means the groups carry no signal.
           "adv_var": float(own_advantages(samples, g)[0].var(unbiased=False))}
    for fam in sorted({s.prompt.family for s in samples}):
        out[f"reward/{fam}/mean"] = float(np.mean([s.reward for s in samples if s.prompt.family == fam]))
    return out


def log_step(run: Run, step: int, samples, gen_time, update_stats, ctx, step_time) -> dict:
    record: dict = {"phase": "train", "step": step, "time_s": step_time}
    for name, ss in samples.items():
        m = sample_metrics(ss, gen_time[name], run.cfg.grpo)
        m.update(update_stats.get(name, {}))
        m.update(ctx.metrics.get(name, {}))
        m.update(run.reward_parts.get(name, {}))
        record.update(namespaced(name, m))
        run.history.setdefault(name, []).append(m["reward/mean"])
    c = run.verifier.counters
    record.update({"verifier/errors": c.errors, "verifier/timeouts": c.timeouts})
    if run.rewards is not None:
        errors, timeouts = run.rewards.failures()
        record.update({"rewards/errors": errors, "rewards/timeouts": timeouts})
    bus = run.bus.stats()
    record.update({"exchange/published": bus["published"], "exchange/bytes": bus["bytes_written"],
                   "exchange/raw_bytes": bus["raw_bytes_written"], "exchange/dropped": bus["dropped"],
                   "exchange/duplicates": bus["duplicates"]})
    record.update({f"phase/{k}_time_s": v for k, v in run.step_phases.items()})
    run.writer.write(record)
    return record


def check_guards(run: Run, record: dict) -> None:
    """After a finished step: record and raise the first guard it tripped, if any."""
    tripped = run.guards.observe(record, list(run.policies)) if run.guards else None
    if tripped is not None:
        run.writer.write(tripped.record())
        run.progress.finish_phase(f"stopped: {tripped.guard} tripped for {tripped.policy}")
        raise tripped


def evaluate(run: Run, step: int) -> dict[str, float]:
    """Held-out pass@1 (greedy) and pass@k of every live policy; samples come from the workers,
    the verifier runs here."""
    with run.timed("eval"):
        return _evaluate(run, step)


def _evaluate(run: Run, step: int) -> dict[str, float]:
    e, g = run.cfg.eval, run.cfg.grpo
    prompts = []
    for fam in run.task.families:
        prompts += run.task.sample(np.random.default_rng([run.cfg.seed, 5]), e.num_prompts, "heldout", [fam])
    gen = dict(prompts=prompts, max_new_tokens=g.max_completion_length)
    greedy = call_live(run.executor, "generate", num_generations=1, temperature=0.0, **gen)
    sampled = (call_live(run.executor, "generate", num_generations=e.k, temperature=g.temperature, **gen)
               if e.k > 1 else greedy)
    record: dict = {"phase": "eval", "step": step}
    per_prompt = []
    for name in run.policies:
        if name in greedy and name in sampled:
            c = correctness(prompts, greedy[name], sampled[name], run.verifier)
            record.update(namespaced(name, score_correctness(prompts, c, k=e.k)))
            per_prompt.append(heldout_record(step, name, prompts, c))
    run.writer.write(record)
    append_heldout(run.out, per_prompt)
    return record


def save_checkpoint(run: Run, step: int) -> None:
    """Every ``save_steps`` steps: a complete, atomic checkpoint (``mutualrl.checkpoint``)."""
    if run.cfg.save_steps and step % run.cfg.save_steps == 0:
        with run.timed("save"):
            checkpoint.save(run, step)


def train_loop(run: Run, start: int = 0) -> None:
    run.progress.start_phase("train", run.cfg.steps, completed=start)
    for step in range(start, run.cfg.steps):
        with run.timed("train"):
            t0, clock = time.perf_counter(), run.step_phase
            run.step_phases.clear()
            prompts = sample_prompts(run, step)
            with clock("generate"):
                samples, gen_time = generate(run, prompts)
            with clock("verify"):
                samples = verify(run, samples)
            with clock("publish"):
                publish(run, samples)
            with clock("strategy"):   # with update()'s batch building: routing, THL, buffers
                ctx = make_context(run, step, prompts)
                run.strategy.observe(ctx, samples)
            stats = update(run, ctx, samples)
            # time_s minus the phases is prompt sampling and logging (a record cannot time its own write)
            record = log_step(run, step, samples, gen_time, stats, ctx, time.perf_counter() - t0)
        check_guards(run, record)
        if run.cfg.eval.every and (step + 1) % run.cfg.eval.every == 0 and step + 1 < run.cfg.steps:
            evaluate(run, step + 1)
        save_checkpoint(run, step + 1)
        run.progress.advance(" | ".join(f"{n} r={np.mean(h[-5:]):.2f}" for n, h in run.history.items()))
    run.progress.finish_phase(f"{run.cfg.steps} steps done")


@dataclass(frozen=True)
class RunSummary:
    output_dir: str
    reward_first: dict[str, float]
    reward_last: dict[str, float]
    final_eval: dict[str, float]
    wall_time_s: float
    # Wall seconds by phase: build, warm start, train (GRPO steps), eval, save.
    phase_times_s: dict[str, float] = field(default_factory=dict)


def summarize(run: Run, final_eval: dict, wall: float) -> RunSummary:
    # First and last quarter of the steps: a few prompts per step make single steps noisy.
    window = max(1, len(next(iter(run.history.values()), [])) // 4)
    first = {n: float(np.mean(h[:window])) for n, h in run.history.items()}
    last = {n: float(np.mean(h[-window:])) for n, h in run.history.items()}
    summary = RunSummary(str(run.out), first, last,
                         {k: v for k, v in final_eval.items() if k not in ("phase", "step")}, wall,
                         dict(run.phase_times))
    (run.out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=2))
    return summary


def save_policies(run: Run) -> None:
    with run.timed("save"):
        call_live(run.executor, "save", directory=str(run.out / "policies"))


def open_checkpoint(cfg: RunConfig) -> tuple[checkpoint.Checkpoint, dict]:
    """The checkpoint a resumed run continues from, checked against ``cfg`` before anything is
    written; then the run's files are cut back to it (what follows is moved aside, not lost)."""
    notes: list[str] = []
    ckpt = checkpoint.latest(Path(cfg.output_dir), report=notes.append)
    for line in notes:
        print(f"mutualrl: {line}", file=sys.stderr)
    if ckpt is None:
        raise ConfigError(f"--resume: no complete checkpoint in {Path(cfg.output_dir) / checkpoint.CHECKPOINT_DIR} "
                          "(checkpoints are written every save_steps steps; save_steps = 0 writes none)")
    harmless = checkpoint.check_config(ckpt, cfg)
    moved = checkpoint.cut_back(Path(cfg.output_dir), ckpt)
    return ckpt, {"phase": "resume", "step": ckpt.step, "checkpoint": str(ckpt.path),
                  "skipped_checkpoints": notes, "changed_harmless": harmless, "moved_aside": moved}


def resume_from(run: Run, ckpt: checkpoint.Checkpoint, record: dict) -> int:
    """Load the checkpoint into the freshly built run; returns the next step."""
    start = checkpoint.restore(run, ckpt)
    run.writer.write(record)
    return start


def train(cfg: RunConfig, progress: RunProgress | None = None, resume: bool = False) -> RunSummary:
    """Run the whole job: build, warm start, train, evaluate, save. Metrics are kept on failure.

    ``resume``: continue ``cfg.output_dir`` from its last complete checkpoint instead (no warm
    start; the config may differ only in harmless fields, see ``mutualrl.checkpoint``)."""
    t0 = time.perf_counter()
    opened = open_checkpoint(cfg) if resume else None
    run = build_run(cfg, progress)
    run.phase_times["build"] = time.perf_counter() - t0
    try:
        if opened is None:
            with run.timed("warm start"):
                warm_start(run)
            evaluate(run, 0)   # the starting point every later evaluation is compared with
            start = 0
        else:
            start = resume_from(run, *opened)
        try:
            train_loop(run, start)
        except GuardTripped as exc:   # its record is written; checkpoint what was trained, stop
            checkpoint.save(run, exc.step + 1)
            save_policies(run)
            raise
        final = evaluate(run, cfg.steps)
        save_policies(run)
        return summarize(run, final, time.perf_counter() - t0)
    finally:
        run.executor.shutdown()
        run.bus.close()           # flushes the experience log
        run.writer.close()
        run.verifier.close()
        if run.rewards is not None:
            run.rewards.close()
