"""Building a run: validate everything, plan the workers, start them, and assemble the ``Run``.

Everything that can fail on bad input fails here, before any training work and before anything
but the run's folder, ``config.json`` and ``plan.json`` is written.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

from mutualrl.allocation import plan, resolve_inventory, worker_specs_from_config
from mutualrl.allocation.placement import policy_device, process_memory_cap
from mutualrl.allocation.planner import Plan
from mutualrl.config import AllocationConfig, ConfigError, RunConfig, to_dict
from mutualrl.policies.checkpoints import check_checkpoints, check_policies
from mutualrl.policies.device_memory import Capped
from mutualrl.policies.models import TokenizerFacts
from mutualrl.policies.policy import Policy, PolicyView, load_handles
from mutualrl.policies.precision import check_precision, precision_notes, resolve_precision
from mutualrl.retokenize import Retokenizer
from mutualrl.run.departures import Departures
from mutualrl.run.evaluation import eval_notes
from mutualrl.run.experience import PeerLogPool, open_bus
from mutualrl.run.guards import Guards
from mutualrl.run.inputs import check_inputs
from mutualrl.run.paced import Pace, check_paced
from mutualrl.run.progress import RunProgress
from mutualrl.run.restarts import executor_allocation
from mutualrl.run.scenarios import check_scenario
from mutualrl.run.state import Run
from mutualrl.run.tracking import check_trackers, make_writer
from mutualrl.strategies import Strategy, build_strategy
from mutualrl.tasks import GuardedVerifier, Task, build_task
from mutualrl.tasks.rewards import WeightedReward, build_rewards
from mutualrl.workers import make_executor
from mutualrl.workers.ranks import RankGroup


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


@dataclass
class Prepared:
    """What building a run needs, checked and loaded, with nothing written yet."""

    strategy: Strategy
    task: Task
    rewards: WeightedReward | None
    peer_logs: PeerLogPool | None
    handles: dict
    alloc: AllocationConfig
    plan: Plan


def prepare(cfg: RunConfig, planning: bool = False) -> Prepared:
    """Validate everything that can fail on bad input, before anything is written anywhere.

    ``planning``: what ``mutualrl plan`` checks. Every input check of a run, but not what only
    the machine that trains can answer (its device, its backend packages, the executor's process
    layout) nor what ``plan`` may show and ``train`` refuses (``colocate = false``); notes go into
    the plan alone."""
    check_inputs(cfg, machine=not planning)  # registry names, the device, backend packages
    seed_everything(cfg.seed)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    strategy = build_strategy(cfg)  # bad strategy parameters fail here, first
    check_trackers(cfg.report_to)  # a missing tracker package fails before any work
    check_scenario(cfg)  # registered, its table fits, warm plans can be made
    task = build_task(cfg.task)
    rewards = build_rewards(
        cfg.task, task, cfg.allocation.verifier_threads
    )  # unknown ones fail here
    checkpoints = check_checkpoints(cfg.policies)  # present, a causal LM transformers builds
    for p in cfg.policies:
        bad = [f for f in p.warmup_families if f not in task.families]
        if bad:
            raise ConfigError(
                f"policies.{p.name}.warmup_families: {bad} not in task families "
                f"{list(task.families)}"
            )
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"output_dir (--output-dir): {out} is an existing file; expected a "
            "directory to write the run into (or a path that does not exist yet)"
        )
    peer_logs = PeerLogPool(cfg.exchange.peer_logs) if cfg.exchange.peer_logs else None
    handles = load_handles(cfg.policies)  # each tokenizer once; the driver encodes prompts
    check_policies(cfg.policies, handles, checkpoints)  # chat templates present, vocab fits
    check_paced(cfg)  # the strategy can run at its own pace, if asked
    if not planning:
        check_precision(cfg.policies, cfg.device)  # bf16 on a CPU that emulates it: a warning
        check_rank_groups(cfg)  # sharded learners need one process per rank
        check_colocated(cfg)  # generators run with their learners
    alloc, the_plan = plan_workers(cfg, handles)  # an infeasible plan fails here
    capped = eval_notes(task, cfg)  # families with fewer held-out problems than num_prompts
    for line in () if planning else capped:
        print(f"mutualrl: note: {line}", file=sys.stderr)
    the_plan = msgspec.structs.replace(the_plan, notes=the_plan.notes + capped)
    return Prepared(strategy, task, rewards, peer_logs, handles, alloc, the_plan)


def build_run(
    cfg: RunConfig,
    progress: RunProgress | None = None,
    prepared: Prepared | None = None,
    departed: dict | None = None,
) -> Run:
    """Validate (``prepare``) and build everything before any training work: the run folder
    gets ``config.json`` and ``plan.json``, the workers start, the exchange opens.

    ``departed``: the policies a resumed run's checkpoint says left it under ``on_failure =
    "continue"`` (``Departures.state_dict``); their workers are not started again."""
    cfg = resolve_precision(cfg)  # config.json says which precision each policy computes in
    prep = prepared or prepare(cfg)
    departed = departed or {}
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    (out / "plan.json").write_bytes(msgspec.json.format(msgspec.json.encode(prep.plan), indent=2))
    bus, sub = open_bus(out, cfg.exchange)
    executor = make_executor(executor_allocation(prep.alloc))  # restarts: run.restarts
    factories = policy_factories(
        cfg, prep.alloc, prep.handles, prep.plan, optimizer_steps(cfg, prep.strategy)
    )
    executor.start(
        {n: f for n, f in factories.items() if n not in departed},
        policy_plan(prep.plan, cfg, exclude=departed),
    )
    policies = driver_policies(cfg, executor, prep.handles)
    profiles: dict = {}
    run = Run(
        cfg=cfg,
        out=out,
        task=prep.task,
        verifier=GuardedVerifier(
            prep.task.verifier, cfg.task.verifier_timeout_s, cfg.allocation.verifier_threads
        ),
        policies=policies,
        strategy=prep.strategy,
        writer=make_writer(out / "metrics.jsonl", cfg.report_to, out.name, to_dict(cfg)),
        progress=progress or RunProgress(enabled=False),
        bus=bus,
        subscription=sub,
        retokenizers={
            n: Retokenizer(p.handle, max_length=cfg.grpo.max_completion_length, profiles=profiles)
            for n, p in policies.items()
        },
        peer_logs=prep.peer_logs,
        executor=executor,
        departures=Departures(out),
        rewards=prep.rewards,
        guards=Guards(cfg.guards),
        versions={n: 0 for n in policies},
    )
    run.departures.load_state_dict(departed)
    if cfg.allocation.max_staleness >= 1:
        run.pace = Pace(run)  # built before a resume loads its state into it
    return run


def plan_workers(cfg: RunConfig, handles: dict) -> tuple[AllocationConfig, Plan]:
    """The resource plan for the run's workers. Each policy is one worker, built by the executor
    from its factory (in this process for ``local``, in its own actor for ``ray``); the run
    reaches it only through typed calls (``policies.worker``)."""
    alloc = cfg.allocation
    vocab = {spec: h.vocab_size for spec, h in handles.items()}
    specs = worker_specs_from_config(cfg, alloc, vocab_size=vocab.__getitem__)
    p = plan(specs, resolve_inventory(alloc), alloc.memory.usable_memory_fraction)
    return alloc, msgspec.structs.replace(p, notes=p.notes + precision_notes(cfg))


def check_colocated(cfg: RunConfig) -> None:
    """``mutualrl train`` runs each policy's generator in its learner's worker, on the learner's
    devices (``policy_plan``). A plan with the generators elsewhere (``colocate = false``) would
    leave their devices idle and put memory the plan never counted on the learners': refused."""
    if not cfg.allocation.colocate:
        raise ConfigError(
            "allocation.colocate = false: mutualrl train runs each policy's "
            "generator in its learner's worker, on the learner's devices, so a plan "
            "that puts the generators on devices of their own cannot be run (`mutualrl "
            "plan` still plans it); set allocation.colocate = true to train"
        )


def check_rank_groups(cfg: RunConfig) -> None:
    """A learner of several ranks needs an executor that starts one process per rank."""
    if cfg.allocation.executor != "local":
        return
    for p in cfg.policies:
        if p.learner_ranks > 1:
            raise ConfigError(
                f"policies.{p.name}.learner_ranks = {p.learner_ranks} runs the learner as "
                f"{p.learner_ranks} processes, and the local executor runs every policy in threads "
                'of this one: set allocation.executor = "process" (this machine) or "ray"'
            )


def optimizer_steps(cfg: RunConfig, strategy: Strategy | None = None) -> int:
    """The optimizer steps each policy takes over the run, its learning-rate schedule's horizon:
    GRPO steps x the strategy's updates per step (``updates_per_step``, e.g. HACPO's; 1 when it
    has none) x ``num_iterations``."""
    per_step = int(getattr(strategy, "updates_per_step", 1))
    return cfg.steps * per_step * cfg.grpo.num_iterations


def policy_factories(
    cfg: RunConfig,
    alloc: AllocationConfig,
    handles: dict,
    the_plan: Plan | None = None,
    total_steps: int | None = None,
) -> dict:
    """Picklable factories, one per policy. In process they reuse the driver's tokenizers;
    elsewhere each worker loads its own. Each is placed by ``policy_device``; its learning-rate
    schedule spans ``total_steps`` optimizer steps (default: ``optimizer_steps`` of a strategy
    with one update a step). A policy of
    ``learner_ranks`` > 1 is a ``RankGroup``: one ``ShardedPolicy`` per rank, gloo on CPU,
    NCCL on GPUs. A policy whose process shares its GPU with others builds under its cap
    (``process_memory_cap``)."""
    in_process = alloc.executor == "local"
    out: dict = {}
    for i, p in enumerate(cfg.policies):
        device = policy_device(p.name, cfg.device, the_plan, alloc.executor)
        seed = cfg.seed * 1000 + i
        total = optimizer_steps(cfg) if total_steps is None else total_steps
        if p.learner_ranks > 1:
            # FSDP and its checkpoint support load only for a run that shards a policy
            from mutualrl.policies.sharded.worker import build_rank

            facts = TokenizerFacts.of(handles[p.tokenizer].tokenizer)
            out[p.name] = RankGroup(
                p.learner_ranks,
                functools.partial(
                    build_rank, p, cfg.grpo, seed, facts, device, total, cfg.training
                ),
                backend="nccl" if device.startswith("cuda") else "gloo",
            )
        else:
            out[p.name] = functools.partial(
                Policy,
                p,
                cfg.grpo,
                seed=seed,
                device=device,
                handle=handles[p.tokenizer] if in_process else None,
                total_steps=total,
                training=cfg.training,
            )
        cap = process_memory_cap(p.name, device, the_plan, alloc)
        if cap is not None:
            f = out[p.name]
            out[p.name] = (
                dataclasses.replace(f, build=Capped(cap, f.build))
                if isinstance(f, RankGroup)
                else Capped(cap, f)
            )
    return out


def policy_plan(the_plan: Plan, cfg: RunConfig, exclude=()) -> Plan:
    """The plan as the executor sees the loop's workers: a policy's learner and generator are one
    object, named after the policy, on its learner's devices. Its CPU threads are capped at
    ``torch_threads`` when that is set, so every executor kind computes with the same count.
    Policies in ``exclude`` (left the run before a resume) get no worker."""
    names = {p.name for p in cfg.policies} - set(exclude)
    cap = cfg.torch_threads or None
    merged = tuple(
        msgspec.structs.replace(a, worker=a.policy, threads=min(a.threads, cap or a.threads))
        for a in the_plan.assignments
        if a.role == "learner" and a.policy in names
    )
    return msgspec.structs.replace(the_plan, assignments=merged)


def driver_policies(cfg: RunConfig, executor, handles: dict) -> dict[str, PolicyView]:
    """The run's view of each policy. An in-process executor's worker is a Policy, which is its
    own view (tests may reach its model); otherwise a tokenizer-only ``PolicyView``."""
    worker, live = getattr(executor, "worker", None), set(executor.live_workers())
    return {
        p.name: worker(p.name) if worker and p.name in live else PolicyView(p, handles[p.tokenizer])
        for p in cfg.policies
    }
