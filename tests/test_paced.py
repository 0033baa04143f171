"""``allocation.max_staleness`` and ``allocation.async_generation`` in ``mutualrl train``.

k = 0 (the default) is the lock-step loop. For k >= 1 each policy runs its own step loop: under
``none``, where nothing crosses between policies, each policy must compute exactly what it
computes in lock-step, and its experience must reach the exchange record for record as it does
there; under a sharing strategy every peer record must be consumed, dropped as stale or left
queued, exactly once, and no policy may start a step more than k ahead of the slowest.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from mutualrl.config import AllocationConfig, ConfigError, load_config
from mutualrl.exchange import ReadStats, read_log
from mutualrl.run import train
from mutualrl.run.build import build_run, prepare
from mutualrl.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
COMMON = (
    "torch_threads=1",
    "allocation.inventory.cpus_per_node=2",
    "allocation.call_timeout_s=120",
)
NAMES = ("llama-mistral", "qwen-deepseek")


def run_tiny(out: Path, *overrides: str) -> dict:
    train(load_config(TINY, [f'output_dir="{out}"', *COMMON, *overrides]))
    return msgspec.json.decode((out / "summary.json").read_bytes())


def policy_rows(out: Path) -> dict[int, dict]:
    """Each train step's per-policy numbers, timing and pace keys aside."""
    return {
        r["step"]: {
            k: v
            for k, v in r.items()
            if k.startswith("policy/")
            and "/pace/" not in k
            and "/phase/" not in k
            and not k.endswith(("time_s", "tokens_per_s"))
        }
        for r in read_metrics(out / "metrics.jsonl")
        if r["phase"] == "train"
    }


def experience(out: Path) -> dict[str, list[tuple]]:
    """Each producer's records in its own order: kind, version, seq and the payload's digest."""
    by: dict[str, list[tuple]] = {}
    for d in read_log(out):
        digest = hashlib.sha256(msgspec.msgpack.encode(d.record)).hexdigest()
        by.setdefault(d.producer, []).append((d.kind, d.producer_version, d.seq, digest))
    return by


def test_lock_step_is_the_default_and_of_every_embedded_config():
    assert AllocationConfig().max_staleness == 0 and not AllocationConfig().async_generation
    for name in ("default.toml", "tiny.toml", "llama3-qwen.toml", "three-policies.toml"):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.allocation.max_staleness == 0 and not cfg.allocation.async_generation, name


def test_k0_builds_no_pace_and_k1_builds_one(tmp_path, fast_run_builds):
    for k in (0, 1):
        cfg = load_config(
            TINY, [f'output_dir="{tmp_path / str(k)}"', *COMMON, f"allocation.max_staleness={k}"]
        )
        run = build_run(cfg)
        try:
            assert (run.pace is None) == (k == 0)
        finally:
            run.close()


SLOW = "qwen-deepseek"


@pytest.fixture(scope="module")
def independent(module_tmp, fast_run_builds_module):
    """The tiny run under ``none`` in lock-step and paced at k = 1 and 2 (five steps), with
    ``SLOW``'s updates 0.3 s longer, so that the other policy runs ahead when it may."""
    from mutualrl.policies.policy import Policy

    update = Policy.update

    def slow(self, batches):
        if self.name == SLOW:
            time.sleep(0.3)
        return update(self, batches)

    root = module_tmp("paced")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Policy, "update", slow)
        return {
            k: (
                root / f"k{k}",
                run_tiny(
                    root / f"k{k}", "steps=5", 'strategy="none"', f"allocation.max_staleness={k}"
                ),
            )
            for k in (0, 1, 2)
        }


@pytest.mark.parametrize("k", [1, 2])
def test_paced_policies_compute_what_they_compute_in_lock_step(independent, k):
    lock, _ = independent[0]
    paced, _ = independent[k]
    rows = policy_rows(lock)
    assert sorted(rows) == list(range(5))
    assert all(f"policy/{n}/reward/mean" in r for r in rows.values() for n in NAMES)
    assert set(experience(lock)) == set(NAMES)
    assert policy_rows(paced) == rows
    assert experience(paced) == experience(lock)


@pytest.mark.parametrize("k", [1, 2])
def test_no_policy_starts_more_than_k_steps_ahead(independent, k):
    out, summary = independent[k]
    leads = {
        n: [
            r[f"policy/{n}/pace/lead"]
            for r in read_metrics(out / "metrics.jsonl")
            if r["phase"] == "train"
        ]
        for n in NAMES
    }
    assert all(len(v) == 5 and max(v) <= k for v in leads.values())
    fast = next(n for n in NAMES if n != SLOW)
    assert max(leads[fast]) == k  # it did run ahead, as far as the gate lets it
    for n in NAMES:
        s = summary["pace"][n]
        assert s["steps"] == 5 and 0 <= s["idle_fraction"] < 1 and s["steps_per_min"] > 0
        assert s["busy_s"] <= s["wall_s"] and s["stale_dropped"] == 0


def _assert_books_whole(books: dict, steps: int) -> None:
    """Every step of every peer reached every receiver once: consumed, dropped or queued."""
    assert set(books) == set(NAMES)
    for consumer, by in books.items():
        assert set(by) == set(NAMES) - {consumer}, consumer
        for producer, b in by.items():
            seen = [
                s
                for how in ("consumed", "dropped", "queued")
                for a, z in b[how]
                for s in range(a, z + 1)
            ]
            assert sorted(seen) == list(range(steps)), (consumer, producer, b)


@pytest.mark.parametrize("strategy", ["sgt", "prp"])
def test_paced_sharing_accounts_for_every_peer_record(tmp_path, fast_run_builds, strategy):
    summary = run_tiny(
        tmp_path / strategy,
        "steps=6",
        "save_steps=2",
        f'strategy="{strategy}"',
        "allocation.max_staleness=1",
    )
    _assert_books_whole(summary["pace_books"], 6)
    rows = [r for r in read_metrics(tmp_path / strategy / "metrics.jsonl") if r["phase"] == "train"]
    assert [r["step"] for r in rows] == list(range(6))
    assert all(r["exchange/stale_dropped"] == 0 for r in rows)
    used = sum(r[f"policy/{n}/pace/experience_records"] for r in rows for n in NAMES)
    assert used > 0  # the policies did take up each other's experience


def test_a_strategy_that_needs_lock_step_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "hacpo"
    cfg = load_config(
        TINY, [f'output_dir="{out}"', 'strategy="hacpo"', "allocation.max_staleness=2"]
    )
    with pytest.raises(
        ConfigError, match=r"max_staleness = 2: strategy 'hacpo' needs every policy"
    ):
        prepare(cfg)
    assert not out.exists()


def test_restart_is_refused_for_a_paced_run_naming_both_fields(tmp_path):
    with pytest.raises(ConfigError, match=r'max_staleness = 1: .*on_failure = "restart" needs'):
        load_config(
            TINY,
            [
                f'output_dir="{tmp_path}"',
                "allocation.max_staleness=1",
                'allocation.on_failure="restart"',
            ],
        )


def test_async_generation_trains_on_samples_one_version_behind(tmp_path, fast_run_builds):
    run_tiny(tmp_path / "a", "steps=4", 'strategy="none"', "allocation.async_generation=true")
    rows = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r["phase"] == "train"]
    assert [r["step"] for r in rows] == list(range(4))
    for r in rows:
        for n in NAMES:
            p = f"policy/{n}/"
            assert r[p + "pace/sample_version_lag"] == (0 if r["step"] == 0 else 1)
            # the lag is corrected as an inexact sampler's: importance weights were computed
            assert (p + "mismatch/is_weight_mean" in r) == (r["step"] > 0)
            if r["step"] < 3:
                assert r[p + "async/generate_time_s"] > 0


# ---- kill -9 and resume --------------------------------------------------------------------------
def _command(out: Path, *extra: str) -> list[str]:
    sets = ["steps=8", "save_steps=4", 'strategy="sgt"', *COMMON, *extra]
    return [
        sys.executable,
        "-m",
        "mutualrl.cli",
        "train",
        "--config",
        str(TINY),
        "--no-progress",
        "--output-dir",
        str(out),
        *(a for s in sets for a in ("--set", s)),
    ]


@pytest.mark.slow
def test_a_paced_run_killed_and_resumed_loses_and_replays_nothing(tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(out, "allocation.max_staleness=1"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while (
        len(
            [r for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]
            if (out / "metrics.jsonl").exists()
            else []
        )
        < 5
    ):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # mid-way through the second segment (steps 4-7)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (out / "summary.json").exists()
    assert (out / "checkpoints" / "step-000004").is_dir()
    done = subprocess.run(
        [sys.executable, "-m", "mutualrl.cli", "train", "--resume", str(out), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = msgspec.json.decode((out / "summary.json").read_bytes())
    _assert_books_whole(summary["pace_books"], 8)
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]
    assert steps == list(range(8))
    stats = ReadStats()
    assert sum(1 for _ in read_log(out, stats=stats)) and stats.skipped == 0  # no damaged frame
    for producer, records in experience(out).items():  # no seq lost or written twice
        assert [seq for _, _, seq, _ in records] == list(range(len(records))), producer


# ---- a policy that fails or hangs ----------------------------------------------------------------
def _breaking(
    monkeypatch, how: str, at_version: int = 2, who: tuple[str, ...] = ("qwen-deepseek",)
) -> threading.Event:
    """``who``'s updates raise, or hang until the returned event is set (the test's end)."""
    from mutualrl.policies.policy import Policy

    update, released = Policy.update, threading.Event()

    def broken(self, batches):
        if self.name in who and self.version >= at_version:
            if how == "hang":
                released.wait(300)
            raise RuntimeError("the learner fell over")
        return update(self, batches)

    monkeypatch.setattr(Policy, "update", broken)
    return released


@pytest.mark.parametrize("how", ["raise", "hang"])
def test_under_continue_a_failed_policy_leaves_and_the_other_goes_on(
    tmp_path, fast_run_builds, monkeypatch, request, how, capsys
):
    request.addfinalizer(_breaking(monkeypatch, how).set)
    out = tmp_path / how
    t0 = time.monotonic()
    summary = run_tiny(
        out,
        "steps=6",
        'strategy="sgt"',
        "allocation.max_staleness=1",
        'allocation.on_failure="continue"',
        "allocation.call_timeout_s=3",
    )
    # a hung peer costs its step's time-out (3 calls of 3 s), not the run: the hang lasts
    # until the test ends
    assert time.monotonic() - t0 < 120
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]
    assert [r["step"] for r in rows] == list(range(6))
    assert all("policy/llama-mistral/reward/mean" in r for r in rows)
    assert "policy/qwen-deepseek/reward/mean" not in rows[-1]
    assert summary["pace"]["llama-mistral"]["steps"] == 6
    assert summary["pace"]["qwen-deepseek"]["steps"] < 6
    if how == "raise":
        _assert_departure_said_and_kept(
            out, summary, capsys, "qwen-deepseek", "raised", "the learner fell over"
        )
    else:
        _assert_departure_said_and_kept(out, summary, capsys, "qwen-deepseek", "timeout")


def test_a_paced_step_that_verifies_past_its_calls_budget_is_not_declared_hung(
    tmp_path, fast_run_builds, monkeypatch
):
    # call_timeout_s = 1: a step is hung after 3 s of calls; each policy's 4 samples verify in
    # 3.6 s (0.9 s each, under verifier_timeout_s = 5), and the two policies take turns at the
    # verifier. Before, the watchdog counted that time and abandoned a healthy step.
    from mutualrl.run.schedule import Paced
    from mutualrl.tasks import GuardedVerifier

    slow = threading.Event()

    class Slow:
        def __init__(self, inner):
            self.inner, self.verifier_id, self.version = inner, inner.verifier_id, inner.version

        def __call__(self, prompt, completion):
            if slow.is_set():
                time.sleep(0.9)
            return self.inner(prompt, completion)

    init = GuardedVerifier.__init__
    monkeypatch.setattr(
        GuardedVerifier,
        "__init__",
        lambda self, verifier, *a, **kw: init(self, Slow(verifier), *a, **kw),
    )
    segment = Paced.segment

    def slowed(*args):  # the train steps only, not the warm start and evaluations around them
        slow.set()
        try:
            return segment(*args)
        finally:
            slow.clear()

    monkeypatch.setattr(Paced, "segment", slowed)
    out = tmp_path / "slow-verifier"
    summary = run_tiny(
        out,
        "steps=1",
        "grpo.prompts_per_step=1",
        "allocation.max_staleness=1",
        'allocation.on_failure="continue"',
        "allocation.call_timeout_s=1",
    )
    assert not (out / "failures.jsonl").exists() and not summary.get("failed")
    assert {n: summary["pace"][n]["steps"] for n in NAMES} == {n: 1 for n in NAMES}
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]
    assert all(f"policy/{n}/reward/mean" in rows[0] for n in NAMES)


def _failures(out: Path) -> list[dict]:
    return [
        msgspec.json.decode(line) for line in (out / "failures.jsonl").read_bytes().splitlines()
    ]


def _assert_departure_said_and_kept(
    out: Path, summary: dict, capsys, name: str, kind: str, message: str = ""
) -> None:
    """The policy that left is named once on stderr, in failures.jsonl and in summary.json, with
    the kind of its failure and (where given) its message."""
    said = [line for line in capsys.readouterr().err.splitlines() if "left the run" in line]
    assert len(said) == 1 and repr(name) in said[0] and f": {kind}: " in said[0], said
    [record] = _failures(out)
    assert record["policy"] == name and record["phase"] == "train"
    assert record["failure"]["kind"] == kind and message in record["failure"]["message"]
    assert record["failure"]["traceback"]
    assert list(summary["failed"]) == [name] and summary["failed"][name]["step"] >= 1


@pytest.mark.parametrize("staleness", [0, 1])
def test_under_continue_a_run_every_policy_left_stops_with_their_failures(
    tmp_path, fast_run_builds, monkeypatch, capsys, staleness
):
    # before: the run went on with no policy, logged empty steps, evaluated NaN and said "done"
    from mutualrl.workers import WorkerFailedError

    _breaking(monkeypatch, "raise", at_version=0, who=NAMES)
    out = tmp_path / f"all-{staleness}"
    with pytest.raises(WorkerFailedError, match="the learner fell over") as exc:
        run_tiny(
            out,
            "steps=4",
            'strategy="sgt"',
            f"allocation.max_staleness={staleness}",
            'allocation.on_failure="continue"',
        )
    assert sorted(f.worker for f in exc.value.failures) == sorted(NAMES)
    assert not (out / "summary.json").exists()
    assert sorted(r["policy"] for r in _failures(out)) == sorted(NAMES)
    assert sum("left the run" in line for line in capsys.readouterr().err.splitlines()) == 2


def test_under_continue_a_lock_step_policy_that_fails_is_said_and_kept(
    tmp_path, fast_run_builds, monkeypatch, capsys
):
    _breaking(monkeypatch, "raise")
    out = tmp_path / "lock-step"
    summary = run_tiny(out, "steps=4", 'strategy="sgt"', 'allocation.on_failure="continue"')
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]
    assert "policy/qwen-deepseek/reward/mean" not in rows[-1]
    assert "policy/llama-mistral/reward/mean" in rows[-1]
    _assert_departure_said_and_kept(
        out, summary, capsys, "qwen-deepseek", "raised", "the learner fell over"
    )


def test_under_stop_a_failed_policy_stops_the_run_with_its_traceback(
    tmp_path, fast_run_builds, monkeypatch
):
    from mutualrl.workers import WorkerFailedError

    _breaking(monkeypatch, "raise")
    with pytest.raises(WorkerFailedError, match="the learner fell over"):
        run_tiny(tmp_path / "stop", "steps=6", 'strategy="sgt"', "allocation.max_staleness=1")
    rows = [r for r in read_metrics(tmp_path / "stop" / "metrics.jsonl") if r["phase"] == "train"]
    assert rows and len(rows) < 6  # what was finished is written


@pytest.mark.parametrize("k", [0, 1])
def test_a_stop_asked_for_in_the_segment_before_an_evaluation_keeps_that_evaluation(
    tmp_path, monkeypatch, fast_run_builds, k
):
    """A signal during the last step before an evaluation step: the run evaluates there, then
    checkpoints and stops, lock-step and paced alike (one scheduler: ``run.schedule``); before,
    a paced run stopped first, and the resumed run (which starts after that step) never
    evaluated it."""
    import json
    import signal

    from mutualrl.run.schedule import LockStep, Paced
    from mutualrl.run.signals import RunInterrupted
    from tests.test_restarts import config

    schedule = LockStep if k == 0 else Paced
    segment, asked = schedule.segment, []

    def stopped_in(self, end):
        segment(self, end)
        if end == 2 and not asked:  # as if Ctrl-C came during the segment's last step
            asked.append(end)
            self.run.stop.signum = signal.SIGINT

    monkeypatch.setattr(schedule, "segment", stopped_in)
    out = tmp_path / "run"
    sets = ("eval.every=2", "save_steps=4", f"allocation.max_staleness={k}")
    with pytest.raises(RunInterrupted):
        train(config(out, *sets))
    train(config(out, *sets), resume=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "eval"] == [0, 2, 4]


def test_a_policy_whose_paced_loop_failed_is_not_evaluated_or_saved_after_it_left(
    tmp_path, monkeypatch, fast_run_builds
):
    """A paced policy whose step fails on the driver's side (here its strategy raises) leaves the
    run under ``continue`` with its worker still live; the run's later evaluations and its saved
    policies are of the policies still in it, as when a worker fails (before, the final
    evaluation scored the departed policy and saved it)."""
    import json

    from mutualrl.strategies.none import Independent
    from tests.test_restarts import config

    original = Independent.build_batches

    def failing(self, ctx, receiver, own):
        if receiver == "llama-mistral" and ctx.step == 1:
            raise RuntimeError("injected strategy failure")
        return original(self, ctx, receiver, own)

    monkeypatch.setattr(Independent, "build_batches", failing)
    out = tmp_path / "run"
    train(
        config(
            out, "allocation.max_staleness=1", 'allocation.on_failure="continue"', "save_steps=0"
        )
    )
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["failed"]) == ["llama-mistral"]
    final = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["phase"] == "eval"
    ][-1]
    assert not any(k.startswith("policy/llama-mistral/") for k in final)
    assert any(k.startswith("policy/qwen-deepseek/heldout") for k in final)
    assert not (out / "policies" / "llama-mistral").exists()
    assert (out / "policies" / "qwen-deepseek").is_dir()
