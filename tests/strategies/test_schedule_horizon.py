"""A learning-rate schedule spans the optimizer steps a run takes (``run.build.optimizer_steps``),
also for a strategy that makes several updates a step: HACPO with ``updates_per_step = 2`` ran
a linear schedule down to 0 halfway through the run and trained at LR 0 after that."""

from __future__ import annotations

import pytest

from mutualrl.config import load_config
from mutualrl.policies.learner import Learner
from mutualrl.run import train
from mutualrl.run.build import optimizer_steps
from mutualrl.strategies import build_strategy
from tests.test_restarts import TINY


@pytest.mark.parametrize("per_step", [1, 2])
def test_the_schedule_spans_every_update_of_the_run(per_step, tmp_path, monkeypatch):
    cfg = load_config(
        TINY,
        [
            f'output_dir="{tmp_path / "run"}"',
            "steps=3",
            'strategy="hacpo"',
            f"strategies.hacpo.updates_per_step={per_step}",
            'training.lr_scheduler_type="linear"',
            "grpo.num_iterations=2",
            'allocation.local_mode="sequential"',
        ],
    )
    assert optimizer_steps(cfg, build_strategy(cfg)) == 3 * per_step * 2
    used: list[float] = []
    advance = Learner._advance_schedule

    def recording(self):
        if self.name == "llama-mistral":
            used.append(self.scheduler.get_last_lr()[0])
        advance(self)

    monkeypatch.setattr(Learner, "_advance_schedule", recording)
    train(cfg)
    # one LR per optimizer step, decaying linearly over all of them and ending above 0
    n = 3 * per_step * 2
    assert used == pytest.approx([1e-3 * (n - k) / n for k in range(n)])
