"""The loop's side of the Shared Experience Exchange: publish a step's experience, replay peers.

Every rollout, every group's reward statistics, every verified success and each producer's
version watermark go through the ``ExperienceBus`` (and so into the run's experience log);
strategies read peer experience back from a subscription, never from another policy's memory,
and what they publish there themselves (every kind, a user's own included) the next step.
A recorded log can stand in for a live peer (a frozen, reproducible "teacher pool").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from mutualrl.config import ConfigError
from mutualrl.exchange import (
    Delivery,
    ExchangeError,
    ExperienceBus,
    ExperienceLog,
    GroupStats,
    Rollout,
    Subscription,
    VerifiedSuccess,
    Watermark,
    read_log,
)


def open_bus(run_dir: Path, cfg) -> tuple[ExperienceBus, Subscription]:
    """A bus with the run's log attached (if enabled) and the loop's subscription to it: every
    kind, the built-in ones and any a user registered, so what a strategy publishes
    (``ctx.publish``) reaches the strategies of the next step."""
    bus = ExperienceBus(log=ExperienceLog(run_dir) if cfg.log else None)
    sub = bus.subscribe(
        kinds=None,
        name="strategy",
        maxsize=cfg.queue_size,
        overflow=cfg.overflow,
        timeout=cfg.block_timeout_s,
    )
    return bus, sub


def publish_step(
    bus: ExperienceBus,
    policies: dict,
    versions: dict[str, int],
    samples: dict,
    verifier_id: str,
    verifier_version: int,
    success_threshold: float,
) -> None:
    """Publish each policy's rollouts, per-prompt group stats, successes and watermark, under the
    version of its weights (``versions``, the run's record)."""
    for name, ss in samples.items():
        policy = policies[name]
        version = versions[name]
        by_group: dict[int, list] = defaultdict(list)
        for j, s in enumerate(ss):
            by_group[s.group].append(s)
            pid = s.prompt.id
            bus.publish(
                Rollout.create(
                    prompt_id=pid,
                    prompt=s.prompt.text,
                    completion=s.text,
                    producer=name,
                    tokenizer_id=policy.handle.fingerprint,
                    token_ids=list(s.completion_ids),
                    logprobs=list(s.logprobs),
                    reward=float(s.reward),
                    verifier_id=verifier_id,
                    policy_version=version if s.policy_version is None else s.policy_version,
                    finish_reason=s.finish_reason,
                    family=s.prompt.family,
                    group_index=s.group,
                    sample_index=j,
                ),
                producer=name,
                version=version,
            )
            if s.reward >= success_threshold:
                bus.publish(
                    VerifiedSuccess(
                        prompt_id=pid,
                        prompt=s.prompt.text,
                        completion=s.text,
                        reward=float(s.reward),
                        verifier_id=verifier_id,
                        verifier_version=str(verifier_version),
                        source=name,
                        policy_version=version,
                        family=s.prompt.family,
                    ),
                    producer=name,
                    version=version,
                )
        for group in by_group.values():
            bus.publish(
                GroupStats.from_rewards(
                    prompt_id=group[0].prompt.id,
                    producer=name,
                    policy_version=version,
                    rewards=[s.reward for s in group],
                ),
                producer=name,
                version=version,
            )
        bus.publish(Watermark(producer=name, version=version), producer=name, version=version)


class PeerLogPool:
    """Rollouts and group statistics of recorded runs, indexed by prompt id, replayed as peers
    named ``log:<producer>``: strategies that read rollouts (PRP, SGT, xgrpo's rank estimator,
    ...) and those that read group statistics (xgrpo's z-score) both see the frozen peer."""

    def __init__(self, run_dirs: Iterable[str]) -> None:
        self.by_prompt: dict[str, list[Delivery]] = defaultdict(list)
        for run_dir in run_dirs:
            path = Path(run_dir)
            if not (path / "experience").is_dir():
                raise FileNotFoundError(
                    f"exchange.peer_logs: no experience log in {path} "
                    f"(expected {path / 'experience'}/)"
                )
            try:
                for d in read_log(path, kinds={"rollout", "group_stats"}):
                    renamed = Delivery(
                        kind=d.kind,
                        producer=f"log:{d.producer}",
                        producer_version=d.producer_version,
                        seq=d.seq,
                        record=d.record,
                    )
                    self.by_prompt[d.record.prompt_id].append(renamed)
            except ExchangeError as exc:  # a newer protocol, a damaged frame: say which log
                raise ConfigError(
                    f"exchange.peer_logs (--peer-log): {path} cannot be replayed: "
                    f"{exc} (`mutualrl exchange inspect {path}` shows what it "
                    "holds)"
                ) from None

    def for_prompts(self, prompt_ids: Iterable[str]) -> list[Delivery]:
        return [d for pid in dict.fromkeys(prompt_ids) for d in self.by_prompt.get(pid, ())]
