"""A recorded run replayed as a frozen peer (``exchange.peer_logs``, ``--peer-log``) reaches
the strategies: its rollouts and its group statistics. xgrpo's default z-score reads only group
statistics, and the replay carried rollouts alone, so a frozen peer changed nothing under it."""

from __future__ import annotations

import pytest

from mutualrl.run import train
from mutualrl.run.experience import PeerLogPool
from tests.test_restarts import config, records


class _AlwaysRight:
    """A verifier that rewards every completion: the recorded peer succeeds everywhere, where the
    tiny policies (which never do) would give the replay nothing to change."""

    verifier_id, version = "always-right", 1

    def __call__(self, prompt, completion) -> float:
        return 1.0


class _Recorded:
    def __init__(self, task) -> None:
        self._task, self.verifier = task, _AlwaysRight()

    def __getattr__(self, name):
        return getattr(self._task, name)


@pytest.fixture(scope="module")
def recorded(module_tmp, fast_run_builds_module):
    from mutualrl.run import build

    out = module_tmp("peer-log") / "recorded"
    with pytest.MonkeyPatch.context() as mp:
        original = build.build_task
        mp.setattr(build, "build_task", lambda cfg: _Recorded(original(cfg)))
        train(config(out, "steps=2", "save_steps=0"))
    return out


def test_the_replay_carries_rollouts_and_group_statistics_under_log_names(recorded):
    pool = PeerLogPool([str(recorded)])
    kinds = {(d.kind, d.producer) for ds in pool.by_prompt.values() for d in ds}
    assert kinds == {
        (k, f"log:{p}")
        for k in ("rollout", "group_stats")
        for p in ("llama-mistral", "qwen-deepseek")
    }


@pytest.mark.parametrize("estimator", ["zscore", "rank"])
def test_a_frozen_peer_changes_what_xgrpo_trains_on(recorded, tmp_path, estimator, fast_run_builds):
    runs = {}
    for name, extra in (("alone", ()), ("frozen", (f'exchange.peer_logs=["{recorded}"]',))):
        out = tmp_path / name
        train(
            config(
                out,
                "steps=2",
                "save_steps=0",
                'strategy="xgrpo"',
                f'strategies.xgrpo.estimator="{estimator}"',
                *extra,
            )
        )
        runs[name] = [r for r in records(out) if r["phase"] == "train"]
    losses = [{k: v for k, v in r.items() if k.endswith("/grpo_loss")} for r in runs["alone"]]
    assert losses != [
        {k: v for k, v in r.items() if k.endswith("/grpo_loss")} for r in runs["frozen"]
    ]
