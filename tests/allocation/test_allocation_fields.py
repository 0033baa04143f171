"""No ``[allocation]`` field is inert: each one names the test that shows its effect on a run, on
the workers or on the plan, and a field added without one fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from mutualrl.allocation import worker_specs_from_config
from mutualrl.config import AllocationConfig
from tests.allocation.test_specs_and_cli import _cfg, _fake_count, _fake_vocab

TESTS = Path(__file__).resolve().parents[1]

EFFECTS = {
    "executor": "test_train_executors.py::test_process_executor_matches_local",
    "local_mode": "allocation/test_local_executor.py::test_calls_run_concurrently_in_threads_mode",
    "on_failure": "test_train_executors.py::test_a_failed_call_kept_going_by_on_failure_is_unavailable_to_the_loop",
    "max_restarts": "test_restarts.py::test_a_policy_failing_again_after_max_restarts_stops_the_run",
    "call_timeout_s": "test_paced.py::test_under_continue_a_failed_policy_leaves_and_the_other_goes_on",
    "placement_timeout_s": "allocation/test_ray_executor.py::test_unplaceable_gangs_are_all_or_nothing_with_a_diagnostic",
    "process_group_timeout_s": "allocation/test_rank_groups.py::test_a_group_that_does_not_form_fails_at_process_group_timeout_s",
    "master_port": "allocation/test_rank_groups.py::test_a_port_in_use_is_a_named_error_not_a_hang",
    "max_staleness": "test_paced.py::test_no_policy_starts_more_than_k_steps_ahead",
    "async_generation": "test_paced.py::test_async_generation_trains_on_samples_one_version_behind",
    "colocate": "allocation/test_specs_and_cli.py::test_hints_and_overrides_replace_estimates_and_split_groups",
    "prompt_length_estimate": "allocation/test_specs_and_cli.py::test_worker_specs_follow_the_documented_estimates",
    "generation_batch_tokens": "allocation/test_allocation_fields.py::test_generation_batch_tokens_caps_the_planned_kv_cache",
    "verifier_threads": "allocation/test_allocation_fields.py::test_verifier_threads_reach_the_runs_verifier_and_its_plan",
    "gpu_resource": "allocation/test_ray_executor.py::test_actors_in_placement_groups_call_results_failures_and_refs",
    "ray_address": "allocation/test_allocation_fields.py::test_ray_address_is_the_cluster_ray_joins",
    "memory": "allocation/test_specs_and_cli.py::test_worker_specs_follow_the_documented_estimates",
    "inventory": "allocation/test_specs_and_cli.py::test_plan_cli_overrides_and_infeasible_error",
    "num_parameters": "allocation/test_specs_and_cli.py::test_worker_specs_follow_the_documented_estimates",
    "architectures": "allocation/test_specs_and_cli.py::test_hints_and_overrides_replace_estimates_and_split_groups",
    "workers": "allocation/test_specs_and_cli.py::test_hints_and_overrides_replace_estimates_and_split_groups",
}


def test_every_allocation_field_names_a_test_of_its_effect():
    fields = {f.name for f in msgspec.structs.fields(AllocationConfig)}
    assert set(EFFECTS) == fields, (
        f"fields without a test of their effect: {sorted(fields - set(EFFECTS))}"
    )
    for field, node in EFFECTS.items():
        path, name = node.split("::")
        source = (TESTS / path).read_text()
        tests = {f.name for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef)}
        assert name in tests, f"{field}: {node} does not exist"
        assert field in _body(source, name), f"{field}: {node} never mentions it"


def _body(source: str, name: str) -> str:
    """The test's source and that of the module's functions it calls or takes as fixtures."""
    tree = ast.parse(source)
    funcs = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    fn = funcs[name]
    called = {
        c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
    }
    called |= {a.arg for a in fn.args.args}
    return "\n".join(
        ast.get_source_segment(source, funcs[n]) for n in {name} | (called & set(funcs))
    )


def _specs(**allocation):
    return {
        s.name: s
        for s in worker_specs_from_config(
            _cfg(**allocation), count_params=_fake_count, vocab_size=_fake_vocab
        )
    }


def test_generation_batch_tokens_caps_the_planned_kv_cache():
    whole, capped = _specs(), _specs(generation_batch_tokens=8)
    for policy in ("a", "b"):
        w, c = whole[f"{policy}/generator"], capped[f"{policy}/generator"]
        assert c.memory_bytes < w.memory_bytes  # the KV cache of 8 tokens, not of the step
        assert whole[f"{policy}/learner"].memory_bytes == capped[f"{policy}/learner"].memory_bytes


def test_verifier_threads_reach_the_runs_verifier_and_its_plan(tmp_path, fast_run_builds):
    from mutualrl.config import load_config
    from mutualrl.run.build import build_run

    cfg = load_config(
        TESTS.parent / "configs" / "tiny.toml",
        [f'output_dir="{tmp_path}"', "allocation.verifier_threads=3"],
    )
    run = build_run(cfg)
    try:
        assert run.verifier.threads == 3 and run.verifier._pool._max_workers == 3
    finally:
        run.close()
    assert _specs(verifier_threads=3)["verifier"].min_threads == 3


def test_ray_address_is_the_cluster_ray_joins(monkeypatch):
    ray = pytest.importorskip("ray")
    from mutualrl.workers.ray_executor import RayExecutor

    joined = []

    class Joined(Exception):
        pass

    def init(address=None, **kw):
        joined.append(address)
        raise Joined

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Joined):
        RayExecutor(AllocationConfig(executor="ray", ray_address="10.0.0.7:6379")).start({})
    assert joined == ["10.0.0.7:6379"]
