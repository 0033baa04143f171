"""The same tiny run on every executor gives the same numbers (and sharded learners the same up to
float rounding).

``mutualrl train`` reaches its policies only through the executor (generate, update, the warm
start's SFT steps and probes, evaluation, the PRP strategy's receiver-side log-probs, saving), so
with one seed and one torch thread per worker the sequential and threaded local executors and the
Ray executor (one actor per policy) and the process executor (one process per policy) must
write identical metrics: every record of every phase,
timing fields aside.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mutualrl.config import AllocationConfig, load_config
from mutualrl.exchange.log import read_log
from mutualrl.policies.worker import SequenceLogprobs
from mutualrl.run import train
from mutualrl.run.metrics import read_metrics
from mutualrl.workers import LocalExecutor, WorkerUnavailable, call_one
from tests.policies.draws import assert_same_up_to_a_rounding_flip

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
TIMING = ("time_s", "tokens_per_s", "step_time_s")
# A described two-core machine: the same plan (one thread per policy) wherever the test runs.
COMMON = (
    "torch_threads=1",
    "allocation.inventory.cpus_per_node=2",
    "allocation.call_timeout_s=120",
)
LOCAL = {
    "sequential": ('allocation.local_mode="sequential"',),
    "threads": ('allocation.local_mode="threads"',),
}


def run_tiny(out: Path, strategy: str, *overrides: str) -> list[dict]:
    train(load_config(TINY, [f'output_dir="{out}"', f'strategy="{strategy}"', *COMMON, *overrides]))
    return [
        {k: v for k, v in r.items() if not k.endswith(TIMING)}
        for r in read_metrics(out / "metrics.jsonl")
    ]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert [r["phase"] for r in a] == [r["phase"] for r in b]
    for ra, rb in zip(a, b):
        assert ra == rb, json.dumps(
            {k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)},
            default=str,
        )


@pytest.fixture(scope="module")
def local_root(module_tmp) -> Path:
    """The folder of the local runs: one run folder ``{strategy}-{mode}`` each."""
    return module_tmp("executors")


@pytest.fixture(scope="module")
def local_runs(local_root, fast_run_builds_module):
    root = local_root
    return {
        (s, mode): run_tiny(root / f"{s}-{mode}", s, *LOCAL[mode])
        for s in ("none", "prp")
        for mode in LOCAL
    }


def test_every_phase_is_recorded(local_runs):
    records = local_runs["prp", "sequential"]
    phases = [r["phase"] for r in records]
    assert phases.count("warmup_done") == 2 and phases.count("train") == 2
    assert phases[-1] == "eval" and "eval" in phases[:-1]  # step 0 and the end
    train = [r for r in records if r["phase"] == "train"]
    for name in ("llama-mistral", "qwen-deepseek"):
        p = f"policy/{name}/"
        for key in ("reward/mean", "loss", "entropy", "grad_norm", "completion_length"):
            assert p + key in train[0], key
        assert train[0][p + "prp/peer_samples"] > 0  # receiver-side log-probs were computed


@pytest.mark.parametrize("strategy", ["none", "prp"])
def test_threads_match_sequential(local_runs, strategy):
    assert_same(local_runs[strategy, "sequential"], local_runs[strategy, "threads"])


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.mark.ray
@pytest.mark.parametrize("strategy", ["none", "prp"])
def test_ray_matches_local(local_runs, ray_cluster, tmp_path, strategy):
    """Policies built inside their actors from picklable factories; the driver keeps tokenizers."""
    records = run_tiny(tmp_path / "ray", strategy, 'allocation.executor="ray"')
    assert_same(local_runs[strategy, "sequential"], records)
    for name in ("llama-mistral", "qwen-deepseek"):
        assert any((tmp_path / "ray" / "policies" / name).glob("*.safetensors"))


@pytest.mark.ray
def test_ray_places_a_sharded_learner_as_one_actor_per_rank(
    local_runs, local_root, ray_cluster, tmp_path
):
    """One policy's learner on 2 ranks, each rank an actor of its placement group (gloo across
    the actors): the same records as one rank up to float rounding."""
    records = run_tiny(
        tmp_path / "ray-sharded", "none", 'allocation.executor="ray"', "policies.0.learner_ranks=2"
    )
    flip = first_rounding_flip(local_root / "none-sequential", tmp_path / "ray-sharded")
    assert_close(local_runs["none", "sequential"], records, flip)


@pytest.mark.parametrize("strategy", ["none", "prp"])
def test_process_executor_matches_local(local_runs, tmp_path, strategy):
    """One spawned process per policy, built from the same factories as Ray's actors."""
    records = run_tiny(tmp_path / "process", strategy, 'allocation.executor="process"')
    assert_same(local_runs[strategy, "sequential"], records)
    for name in ("llama-mistral", "qwen-deepseek"):
        assert any((tmp_path / "process" / "policies" / name).glob("*.safetensors"))


SHARDED = (
    'allocation.executor="process"',
    "policies.0.learner_ranks=2",
    "policies.1.learner_ranks=2",
)


def _rollouts(folder: Path) -> dict:
    """The run's sampled completions from its experience log: (producer, version, prompt) ->
    [(ids, behaviour log-probs), ...] in sampling order."""
    out: dict = {}
    for d in read_log(folder, kinds=["rollout"]):
        r = d.record
        out.setdefault((r.producer, r.policy_version, r.prompt_id), []).append(
            (r.token_array.tolist(), r.logprob_array)
        )
    return out


def first_rounding_flip(one: Path, sharded: Path, atol: float = 1e-5) -> int | None:
    """The first policy version at which the sharded run sampled a completion the one-rank run
    did not, after checking that the two runs' policies were the same up to float rounding until
    then; None if every completion is the same.

    Weights equal up to rounding still sample differently now and then (tests/policies/draws.py).
    So up to that version every completion's behaviour log-probs agree (to ``atol``; 9.5e-7 seen,
    and a 1% larger learning rate gives 1.9e-4) on the ids the two runs share, and where ids
    part, they are neighbours. After it the runs train on different batches: nothing more is
    compared."""
    a, b = _rollouts(one), _rollouts(sharded)
    assert a.keys() == b.keys()
    flips = [k[1] for k in a for (x, _), (y, _) in zip(a[k], b[k]) if x != y]
    flip = min(flips, default=None)
    for k in a:
        if flip is None or k[1] <= flip:
            assert len(a[k]) == len(b[k]), k
            for (x, lx), (y, ly) in zip(a[k], b[k]):
                assert_same_up_to_a_rounding_flip(x, lx, y, ly, atol, where=k)
    return flip


def assert_close(a: list[dict], b: list[dict], flip: int | None = None, rel: float = 1e-5) -> None:
    """The same records up to float rounding (a sharded learner sums over ranks in another
    order); ``b``'s own keys (the shard probe's gap) aside. From step ``flip`` on (the first
    version whose completions differ by a rounding flip: ``first_rounding_flip``) the runs train
    on different samples, and only the records' phases and keys are compared."""
    assert [r["phase"] for r in a] == [r["phase"] for r in b]
    for ra, rb in zip(a, b):
        assert set(ra) == {k for k in rb if "shard_probe_gap" not in k}
        if flip is not None and ra["phase"] in ("train", "eval") and ra["step"] >= flip:
            continue
        for k, va in ra.items():
            if isinstance(va, float):
                assert rb[k] == pytest.approx(va, rel=rel, abs=1e-6), (ra["phase"], k)
            else:
                assert rb[k] == va, (ra["phase"], k)


def test_sharded_policies_train_like_one_rank(local_runs, local_root, tmp_path):
    """PRP with both policies' learners on 2 ranks each (four rank processes, gloo): every
    record equals the one-rank run's up to float rounding (until sampling parts at a rounding
    flip, on some CPUs at step 1: ``first_rounding_flip``); rank 0's copy passed every probe."""
    records = run_tiny(tmp_path / "sharded", "prp", *SHARDED)
    flip = first_rounding_flip(local_root / "prp-sequential", tmp_path / "sharded")
    assert_close(local_runs["prp", "sequential"], records, flip)
    train = [r for r in records if r["phase"] == "train"]
    for name in ("llama-mistral", "qwen-deepseek"):
        assert all(0 <= r[f"policy/{name}/sync/shard_probe_gap"] < 1e-5 for r in train)
        assert any((tmp_path / "sharded" / "policies" / name).glob("*.safetensors"))


class _Flaky:
    def sequence_logprobs(self, prompts, completions):
        raise ValueError("no weights here")


def test_a_failed_call_kept_going_by_on_failure_is_unavailable_to_the_loop():
    ex = LocalExecutor(AllocationConfig(on_failure="continue", local_mode="sequential"))
    ex.start({"a": _Flaky})
    with pytest.raises(WorkerUnavailable, match="no weights here"):
        call_one(ex, "a", SequenceLogprobs(prompts=[], completions=[]))
    assert ex.live_workers() == []  # removed, as on_failure says
