"""``allocation.on_failure = "restart"`` in ``mutualrl train`` (``run.restarts``): a failed worker
takes the run back to its last checkpoint, every worker rebuilt, and the run ends with the
records of an uninterrupted one. Before, only the failed worker was rebuilt, from its factory:
its policy came back with its initial weights (no warm start, no update) and the run went on.

The proof with a real failure is a worker process SIGKILLed mid-run under the process executor,
as the OOM killer would; the in-process tests make a policy's update raise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest

from mutualrl.config import ConfigError, load_config
from mutualrl.policies.policy import Policy
from mutualrl.run import train
from mutualrl.run.metrics import read_metrics
from mutualrl.workers.calls import WorkerFailedError
from tests.workers import kill_one_worker_mid_run

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
TIMING = ("time_s", "tokens_per_s", "step_time_s")
# Four steps, a checkpoint every two; one torch thread per policy on a described two-core
# machine, so every executor computes the same numbers.
COMMON = (
    "steps=4",
    "save_steps=2",
    "torch_threads=1",
    "allocation.inventory.cpus_per_node=2",
    "allocation.call_timeout_s=120",
    'allocation.local_mode="sequential"',
)
RESTART = ('allocation.on_failure="restart"',)


def config(out: Path, *extra: str):
    return load_config(TINY, [f'output_dir="{out}"', *COMMON, *extra])


def records(out: Path) -> list[dict]:
    """The run's train and eval records, timings aside (none before the file exists)."""
    if not (out / "metrics.jsonl").exists():
        return []
    return [
        {k: v for k, v in r.items() if not k.endswith(TIMING)}
        for r in read_metrics(out / "metrics.jsonl")
        if r.get("phase") in ("train", "eval")
    ]


def failures(out: Path) -> list[dict]:
    path = out / "failures.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def reference(module_tmp, fast_run_builds_module) -> Path:
    """The tiny run, four steps, uninterrupted, under ``stop``."""
    out = module_tmp("restarts") / "reference"
    train(config(out))
    assert len([r for r in records(out) if r["phase"] == "train"]) == 4
    return out


def fail_updates(monkeypatch, policy: str, calls: set[int]) -> None:
    """``policy``'s updates numbered in ``calls`` (from 1, over the whole test) raise."""
    original, seen = Policy.update, [0]

    def update(self, batches):
        if self.name == policy:
            seen[0] += 1
            if seen[0] in calls:
                raise RuntimeError(f"injected failure of update {seen[0]}")
        return original(self, batches)

    monkeypatch.setattr(Policy, "update", update)


def test_a_failed_update_restarts_the_run_from_its_checkpoint_to_the_same_records(
    reference, tmp_path, monkeypatch, fast_run_builds, capfd
):
    out = tmp_path / "restarted"
    fail_updates(monkeypatch, "llama-mistral", {3})  # step 2, after the checkpoint of step 2
    train(config(out, *RESTART, "save_total_limit=0"))  # every checkpoint kept, looked at below
    assert records(out) == records(reference)
    [restart] = failures(out)
    assert restart["policy"] == "llama-mistral" and restart["checkpoint_step"] == 2
    assert restart["restart"] == 1 and restart["max_restarts"] == 1
    assert restart["failure"]["method"] == "Update"
    assert "injected failure of update 3" in restart["failure"]["message"]
    assert "injected failure of update 3" in restart["failure"]["traceback"]
    logged = [r for r in read_metrics(out / "metrics.jsonl") if r.get("phase") == "restart"]
    assert [(r["step"], r["restarts"]) for r in logged] == [(2, {"llama-mistral": 1})]
    err = capfd.readouterr().err
    assert "policy 'llama-mistral' failed: Update(): raised: RuntimeError" in err
    assert "restarting the run from its checkpoint after step 2 (restart 1 of 1" in err
    # the warm start's checkpoint: a failure at the first step has one to go back to too
    assert (out / "checkpoints" / "step-000000" / "manifest.json").is_file()
    assert json.loads((out / "summary.json").read_text())["restarts"] == {"llama-mistral": 1}


def test_a_failure_at_the_first_step_goes_back_to_the_warm_starts_checkpoint(
    reference, tmp_path, monkeypatch, fast_run_builds
):
    out = tmp_path / "first"
    fail_updates(monkeypatch, "qwen-deepseek", {1})
    train(config(out, *RESTART))
    assert records(out) == records(reference)
    assert [f["checkpoint_step"] for f in failures(out)] == [0]


def test_a_policy_failing_again_after_max_restarts_stops_the_run(
    reference, tmp_path, monkeypatch, fast_run_builds, capfd
):
    out = tmp_path / "again"
    fail_updates(monkeypatch, "llama-mistral", {3, 4})  # the replayed step fails once more
    with pytest.raises(WorkerFailedError, match="injected failure of update 4"):
        train(config(out, *RESTART))
    assert [f["restart"] for f in failures(out)] == [1]
    assert (
        "have failed again after 1 restart(s) (allocation.max_restarts)" in capfd.readouterr().err
    )
    # what the run wrote before stays: the steps up to its checkpoint, and the replayed one's
    # records that were written before the second failure
    assert [r["step"] for r in records(out) if r["phase"] == "train"] == [0, 1]


def test_max_restarts_counts_per_policy(reference, tmp_path, monkeypatch, fast_run_builds):
    out = tmp_path / "twice"
    fail_updates(monkeypatch, "llama-mistral", {2, 5})
    train(config(out, *RESTART, "allocation.max_restarts=2"))
    assert records(out) == records(reference)
    assert [(f["restart"], f["checkpoint_step"]) for f in failures(out)] == [(1, 0), (2, 2)]


def test_a_failure_before_the_first_checkpoint_stops_the_run(
    tmp_path, monkeypatch, fast_run_builds, capfd
):
    def sft_step(self, examples, learning_rate=None):
        raise RuntimeError("injected warm-start failure")

    monkeypatch.setattr(Policy, "sft_step", sft_step)
    with pytest.raises(WorkerFailedError, match="injected warm-start failure"):
        train(config(tmp_path / "early", *RESTART))
    assert failures(tmp_path / "early") == []
    assert "before the run's first checkpoint" in capfd.readouterr().err


def test_restart_without_checkpoints_is_refused_naming_both_fields(tmp_path):
    with pytest.raises(ConfigError, match=r'on_failure = "restart" .*save_steps = 0'):
        load_config(TINY, [f'output_dir="{tmp_path}"', *RESTART])


def test_the_executor_stops_and_the_run_restarts():
    from mutualrl.run.restarts import executor_allocation

    alloc = config(Path("unused"), *RESTART).allocation
    assert executor_allocation(alloc).on_failure == "stop"
    assert (
        executor_allocation(msgspec.structs.replace(alloc, on_failure="continue")).on_failure
        == "continue"
    )


@pytest.mark.slow
def test_a_worker_process_killed_mid_run_restarts_the_run_to_the_same_records(reference, tmp_path):
    """``mutualrl train`` as a user runs it, one process per policy; one of them SIGKILLed once
    three steps are logged, as the OOM killer would. The run goes back to its last checkpoint
    (step 2, or step 4 if the kill lands after the last step), ends with the uninterrupted run's
    records, and leaves no process behind."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "killed"
    sets = [f'output_dir="{out}"', *COMMON, *RESTART, 'allocation.executor="process"']
    cmd = [
        sys.executable,
        "-m",
        "mutualrl.cli",
        "train",
        "--config",
        str(TINY),
        "--no-progress",
        *(a for s in sets for a in ("--set", s)),
    ]
    log = tmp_path / "run.log"
    started = kill_one_worker_mid_run(
        cmd, log, lambda: len([r for r in records(out) if r["phase"] == "train"]) >= 3
    )
    assert records(out) == records(reference)
    [restart] = failures(out)
    assert restart["checkpoint_step"] in (2, 4)
    assert restart["failure"]["exc_type"] == "WorkerDied"
    said = log.read_text()
    assert "restarting the run from its checkpoint after step" in said
    assert f"{restart['policy']}: failed 1 time(s); the run restarted from its last" in said
    _, alive = psutil.wait_procs(started, timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
