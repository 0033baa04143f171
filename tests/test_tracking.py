"""report_to: metric records mirrored to TensorBoard (read back from the event file) and W&B."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mutualrl.config import ConfigError, load_config
from mutualrl.run import train
from mutualrl.run.metrics import read_metrics
from mutualrl.run.progress import RunProgress
from mutualrl.run.tracking import TrackedWriter, check_trackers, scalars_of

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


class RecordingProgress(RunProgress):
    def __init__(self) -> None:
        super().__init__(enabled=False)
        self.finished: list[str] = []

    def finish_phase(self, message: str) -> None:
        self.finished.append(message)


class ListTracker:
    def __init__(self) -> None:
        self.logged, self.closed = [], False

    def log(self, scalars, step):
        self.logged.append((step, scalars))

    def close(self):
        self.closed = True


def test_scalars_are_keyed_by_metric_name_at_the_record_step():
    scalars, step = scalars_of(
        {
            "phase": "train",
            "step": 3,
            "policy/a/reward/mean": 0.5,
            "policy/a/loss": float("nan"),
            "note": "text",
            "flag": True,
        }
    )
    assert step == 3 and scalars == {"policy/a/reward/mean": 0.5}
    scalars, step = scalars_of({"phase": "eval", "step": 10, "policy/a/heldout/pass@1": 0.25})
    assert (step, scalars) == (10, {"eval/policy/a/heldout/pass@1": 0.25})
    assert scalars_of({"phase": "warmup_cache", "hit": True}) is None


def test_tracked_writer_keeps_the_jsonl_and_sends_every_record(tmp_path):
    tracker = ListTracker()
    writer = TrackedWriter(tmp_path / "metrics.jsonl", [tracker])
    writer.write({"phase": "train", "step": 0, "policy/a/kl": 0.1})
    writer.write({"phase": "train", "step": 1, "policy/a/kl": 0.2})
    writer.close()
    assert [r["policy/a/kl"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.1, 0.2]
    assert tracker.logged == [(0, {"policy/a/kl": 0.1}), (1, {"policy/a/kl": 0.2})]
    assert tracker.closed


def test_unknown_or_missing_tracker_names_report_to(monkeypatch):
    with pytest.raises(ConfigError, match=r"report_to: unknown tracker 'mlflow'"):
        check_trackers(["mlflow"])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"report_to: 'wandb'.*pip install mutualrl\[wandb\]"):
        check_trackers(["wandb"])


def test_tiny_run_writes_tensorboard_scalars(tmp_path, fast_run_builds):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    progress = RecordingProgress()
    train(load_config(TINY, [f'output_dir="{out}"', 'report_to=["tensorboard"]']), progress)
    # The tiny warm start (3 steps, target 0.5) ends at max_steps; each bar says why it closed.
    assert (
        progress.finished[0].startswith("max_steps 3 reached")
        or progress.finished[0] == "target accuracy 0.5 reached at step 3"
    )
    assert progress.finished[1:] == ["2 steps done"]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]
    for name in ("llama-mistral", "qwen-deepseek"):
        key = f"policy/{name}/reward/mean"
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in records]
        assert [e.value for e in events] == pytest.approx([r[key] for r in records])
        assert f"eval/policy/{name}/heldout/pass@1" in tags
        assert f"policy/{name}/adv_var" in tags


def test_wandb_offline_writes_a_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from mutualrl.run.tracking import WandbTracker

    monkeypatch.delenv("WANDB_MODE", raising=False)
    tracker = WandbTracker(tmp_path, "t", {"seed": 0})
    tracker.log({"policy/a/kl": 0.1}, 0)
    tracker.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
