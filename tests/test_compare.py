"""`mutualrl compare`: strategies x seeds, the report, and --resume.

One compare trains for real through the CLI (`none` and one sharing strategy, 2 seeds, a shrunken
tiny config). Every registered strategy, the table's shape and --resume are checked with a
stand-in trainer that writes what `train` writes (config.json, metrics.jsonl, summary.json): the
compare's bookkeeping does not depend on how a run learns, and real runs cost seconds each.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from mutualrl.cli import main
from mutualrl.compare import compare, read_state
from mutualrl.config import ConfigError, to_dict
from mutualrl.run import RunSummary
from mutualrl.run.metrics import MetricsWriter, read_metrics
from mutualrl.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
# Fallback if configs/tiny.toml is absent: the same shape built from default.toml.
TINY_FROM_DEFAULT = [
    "steps=2",
    "warmup.max_steps=3",
    "grpo.prompts_per_step=2",
    "grpo.num_generations=4",
    "eval.every=0",
    "eval.num_prompts=4",
    "eval.k=2",
    "policies.0.hidden_size=32",
    "policies.1.hidden_size=32",
]
# Smaller still, so a few real runs fit a CPU test.
SHRINK = [
    "warmup.max_steps=1",
    "warmup.eval_every=1",
    "warmup.eval_prompts=2",
    "warmup.batch_size=4",
    "eval.num_prompts=2",
    "policies.0.hidden_size=16",
    "policies.1.hidden_size=16",
    "policies.0.num_layers=1",
    "policies.1.num_layers=1",
]
SEEDS = 2
ALL = list(STRATEGIES.names())
# The real compare: the control and one sharing strategy (prp logs THL residuals when present).
REAL = ["none"] + ([s for s in ALL if s == "prp"] or [s for s in ALL if s != "none"])[:1]


def _config() -> tuple[str, list[str]]:
    if TINY.exists():
        return str(TINY), list(SHRINK)
    return str(ROOT / "configs" / "default.toml"), TINY_FROM_DEFAULT + SHRINK


def fake_train(cfg, progress) -> RunSummary:
    """Writes a run's files as `train` does, with numbers that depend on strategy and seed."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg)))
    bump = 0.1 * (cfg.strategy != "none") + 0.01 * cfg.seed
    names = [p.name for p in cfg.policies]
    writer = MetricsWriter(out / "metrics.jsonl")
    evals = {}
    for step in range(cfg.steps + 1):
        ev = {"phase": "eval", "step": step}
        for n in names:
            for fam in ("first", "last"):
                ev[f"policy/{n}/heldout/{fam}/pass@1"] = min(1.0, 0.2 * step + bump)
                ev[f"policy/{n}/heldout/{fam}/pass@{cfg.eval.k}"] = min(1.0, 0.3 * step + bump)
            ev[f"policy/{n}/heldout/pass@1"] = min(1.0, 0.2 * step + bump)
        writer.write(ev)
        evals = ev
        if step == cfg.steps:
            break
        rec = {"phase": "train", "step": step, "exchange/bytes": 1000 * (step + 1)}
        for n in names:
            rec[f"policy/{n}/reward/mean"] = 0.1 * step + bump
            rec[f"policy/{n}/completion_length"] = 3.0
            if cfg.strategy == "prp":
                rec[f"policy/{n}/thl/boundary_iou_mean"] = 0.5
                rec[f"policy/{n}/prp/density_ratio_var"] = 0.2 + cfg.seed
        writer.write(rec)
    writer.close()
    final = {k: v for k, v in evals.items() if k not in ("phase", "step")}
    summary = RunSummary(
        str(out),
        {n: 0.0 for n in names},
        {n: 0.5 for n in names},
        final,
        1.5,
        {"warm start": 0.25, "train": 1.0},
    )
    (out / "summary.json").write_bytes(msgspec.json.encode(summary))
    return summary


class Counting:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, cfg, progress) -> RunSummary:
        self.calls.append(Path(cfg.output_dir).name)
        return fake_train(cfg, progress)


def _summaries(out: Path) -> dict[str, int]:
    return {p.parent.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}


def _names(strategies, seeds=SEEDS) -> set[str]:
    return {f"{s}-seed{i}" for s in strategies for i in range(seeds)}


# ---- a real compare through the CLI ---------------------------------------------------------
@pytest.fixture(scope="module")
def real_report(module_tmp, request) -> Path:
    try:  # reuse the session's tokenizers and THL tables across runs (tests/conftest.py)
        request.getfixturevalue("fast_run_builds_module")
    except pytest.FixtureLookupError:
        pass
    out = module_tmp("compare") / "report"
    config, sets = _config()
    argv = [
        "compare",
        "--config",
        config,
        "--strategies",
        ",".join(REAL),
        "--seeds",
        str(SEEDS),
        "--output-dir",
        str(out),
        "--no-progress",
    ]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    return out


def test_real_compare_writes_runs_plots_and_report(real_report):
    assert set(_summaries(real_report)) == _names(REAL)
    for name in _names(REAL):
        run = real_report / "runs" / name
        assert (run / "metrics.jsonl").stat().st_size > 0
        cfg = json.loads((run / "config.json").read_text())
        assert cfg["seed"] == int(name.rsplit("seed", 1)[1])  # seed index replaces seed
        assert cfg["strategy"] == name.rsplit("-seed", 1)[0]
    assert {r["status"] for r in read_state(real_report)["runs"].values()} == {"done"}
    md = (real_report / "report.md").read_text()
    pngs = sorted((real_report / "plots").glob("*.png"))
    assert any(p.name.startswith("reward-") for p in pngs)
    assert any(p.name.startswith("heldout-") for p in pngs)
    for png in pngs:  # every plot is embedded by relative path
        assert png.stat().st_size > 10_000 and f"](plots/{png.name})" in md
    assert "## How to read this" in md and "commit `" in md
    data = json.loads((real_report / "report.json").read_text())
    assert [(r["policy"], r["strategy"]) for r in data["rows"]] == [
        (p, s) for p in data["policies"] for s in REAL
    ]
    for col in ["pass@1/first", "pass@1/last", "pass@1", "pass@2/first", "pass@2/last"]:
        assert col in data["accuracy_columns"]
    for row in data["rows"]:
        assert row["columns"]["tokens"]["mean"] > 0 and row["columns"]["wall_time_s"]["mean"] > 0
        assert row["columns"]["train_time_s"]["mean"] > 0
        assert row["columns"]["bytes_exchanged"]["n"] == SEEDS
        for role in ("peer", "own"):  # each policy of the tiny config warms up on one family
            assert 0 <= row["columns"][f"transfer/{role}/start"]["mean"] <= 1
    assert "## Transfer to peer families" in md


def test_real_compare_warms_up_once_per_seed(real_report):
    """The first run of a seed stores its warm start, the seed's other runs load it: they start
    from identical weights by construction."""
    assert (
        len([p for p in (real_report / "warmstart").iterdir() if not p.name.startswith(".")])
        == SEEDS
    )
    for seed in range(SEEDS):
        runs = [
            read_metrics(real_report / "runs" / f"{s}-seed{seed}" / "metrics.jsonl") for s in REAL
        ]
        assert [[r["hit"] for r in rs if r["phase"] == "warmup_cache"] for rs in runs] == [
            [False]
        ] + [[True]] * (len(REAL) - 1)
        warm = [[r for r in rs if r["phase"] in ("warmup", "warmup_done")] for rs in runs]
        assert warm[0] and all(w == warm[0] for w in warm)
        first_eval = [next(r for r in rs if r["phase"] == "eval") for rs in runs]
        assert all(e == first_eval[0] for e in first_eval)  # step 0: the same policies


# ---- every registered strategy, the table, resume -------------------------------------------
@pytest.fixture
def fake_report(tmp_path) -> tuple[Path, Counting]:
    config, sets = _config()
    trainer = Counting()
    out = tmp_path / "report"
    compare(config, ALL, SEEDS, out, overrides=sets, train_fn=trainer)
    return out, trainer


def test_table_has_one_row_per_policy_and_strategy_with_accuracy_and_cost(fake_report):
    out, trainer = fake_report
    assert sorted(trainer.calls) == sorted(_names(ALL))
    assert trainer.calls[: len(ALL)] == [f"{s}-seed0" for s in ALL]  # whole seeds first
    data = json.loads((out / "report.json").read_text())
    policies = data["policies"]
    assert len(policies) == 2
    assert [(r["policy"], r["strategy"]) for r in data["rows"]] == [
        (p, s) for p in policies for s in ALL
    ]
    expected = ["pass@1/first", "pass@1/last", "pass@1", "pass@2/first", "pass@2/last"]
    assert data["accuracy_columns"][:5] == expected
    assert data["cost_columns"][:4] == ["train_time_s", "wall_time_s", "tokens", "bytes_exchanged"]
    assert data["transfer_columns"] == [
        "transfer/peer/start",
        "transfer/peer/end",
        "transfer/peer/change",
        "delta_vs_none/transfer/peer/end",
        "transfer/own/start",
        "transfer/own/end",
        "transfer/own/change",
    ]
    for row in data["rows"]:
        cols = row["columns"]
        assert row["seeds"] == list(range(SEEDS))
        for col in expected + ["train_time_s", "wall_time_s", "tokens", "bytes_exchanged"]:
            assert (
                cols[col]["n"] == SEEDS
                and cols[col]["min"] <= cols[col]["mean"] <= cols[col]["max"]
            )
        assert cols["pass@1/first"]["values"] == pytest.approx(
            [0.4 + 0.1 * (row["strategy"] != "none") + 0.01 * s for s in range(SEEDS)]
        )
        assert cols["tokens"]["mean"] == 2 * 3.0 * 2 * 4  # steps x length x prompts x G
        assert cols["bytes_exchanged"]["mean"] == 2000  # the cumulative counter's last value
        bump = [0.1 * (row["strategy"] != "none") + 0.01 * s for s in range(SEEDS)]
        # the fake's pass@1 is 0.2 * step + bump on every family: 'first' is its own for the
        # first policy (warm started on it), 'last' its peer's
        assert cols["transfer/peer/start"]["values"] == pytest.approx(bump)
        assert cols["transfer/peer/end"]["values"] == pytest.approx([b + 0.4 for b in bump])
        assert (
            cols["transfer/peer/change"]["mean"]
            == cols["transfer/own/change"]["mean"]
            == pytest.approx(0.4)
        )
        assert cols["train_time_s"]["mean"] == 1.0
        if row["strategy"] != "none":  # paired by seed
            assert cols["delta_vs_none/pass@1"]["mean"] == pytest.approx(0.1)
            assert cols["delta_vs_none/transfer/peer/end"]["mean"] == pytest.approx(0.1)
        else:
            assert "delta_vs_none/transfer/peer/end" not in cols
    md = (out / "report.md").read_text()
    assert md.index("## Transfer to peer families") < md.index("## Final held-out accuracy")
    for p in policies:
        for s in ALL:
            assert md.count(f"| {p} | `{s}` | {SEEDS} |") >= 3  # transfer, accuracy, cost tables
    if "prp" in ALL:
        assert (out / "plots" / f"density-ratio-{policies[0]}.png").exists()
        assert (out / "plots" / f"thl-{policies[0]}.png").exists()
    else:
        assert "no THL plot" in md


def test_resume_keeps_finished_runs_and_redoes_exactly_the_unfinished_one(fake_report):
    out, _ = fake_report
    config, sets = _config()
    before = _summaries(out)
    again = Counting()
    compare(config, ALL, SEEDS, out, overrides=sets, resume=True, train_fn=again)
    assert again.calls == [] and _summaries(out) == before

    victim = f"{ALL[-1]}-seed1"
    (out / "runs" / victim / "summary.json").unlink()  # as if interrupted mid-run
    (out / "runs" / victim / "stale-marker").write_text("x")
    compare(config, ALL, SEEDS, out, overrides=sets, resume=True, train_fn=again)
    assert again.calls == [victim]
    after = _summaries(out)
    assert set(after) == set(before)
    assert {k: v for k, v in after.items() if k != victim} == {
        k: v for k, v in before.items() if k != victim
    }
    assert not (out / "runs" / victim / "stale-marker").exists()  # the unfinished dir was cleared
    assert read_state(out)["runs"][victim]["status"] == "done"


def test_an_interrupted_compare_records_where_it_stopped_and_resumes_there(tmp_path):
    config, sets = _config()
    out = tmp_path / "report"

    def interrupted(cfg, progress):
        if Path(cfg.output_dir).name == "none-seed1":
            raise KeyboardInterrupt
        return fake_train(cfg, progress)

    with pytest.raises(KeyboardInterrupt):
        compare(config, ["none"], 3, out, overrides=sets, train_fn=interrupted)
    status = {k: v["status"] for k, v in read_state(out)["runs"].items()}
    assert status == {"none-seed0": "done", "none-seed1": "interrupted", "none-seed2": "pending"}
    trainer = Counting()
    compare(config, ["none"], 3, out, overrides=sets, resume=True, train_fn=trainer)
    assert trainer.calls == ["none-seed1", "none-seed2"]


def test_first_seed_runs_the_later_seeds_of_a_comparison_and_resumes_as_that_part(tmp_path):
    """--first-seed K: seeds K..K+N-1 (the rest of a comparison whose first seeds ran
    elsewhere); --resume continues that part, and the same folder refuses another part."""
    config, sets = _config()
    out = tmp_path / "report"
    trainer = Counting()
    compare(config, ["none"], 2, out, overrides=sets, train_fn=trainer, first_seed=1)
    assert trainer.calls == ["none-seed1", "none-seed2"]
    assert json.loads((out / "runs" / "none-seed2" / "config.json").read_text())["seed"] == 2
    assert read_state(out)["first_seed"] == 1
    compare(config, ["none"], 2, out, overrides=sets, resume=True, train_fn=trainer, first_seed=1)
    assert trainer.calls == ["none-seed1", "none-seed2"]  # both finished: nothing runs again
    with pytest.raises(ConfigError, match="first_seed"):
        compare(config, ["none"], 2, out, overrides=sets, resume=True, train_fn=trainer)
    with pytest.raises(ConfigError, match="--first-seed must be >= 0"):
        compare(config, ["none"], 1, tmp_path / "x", overrides=sets, first_seed=-1)


def test_a_different_compare_in_the_same_directory_is_refused(fake_report):
    out, _ = fake_report
    config, sets = _config()
    with pytest.raises(ConfigError, match="--resume"):
        compare(config, ALL, SEEDS, out, overrides=sets, train_fn=Counting())
    with pytest.raises(ConfigError, match="seeds"):
        compare(config, ALL, SEEDS + 1, out, overrides=sets, resume=True, train_fn=Counting())
    with pytest.raises(ConfigError, match="config_digest"):
        compare(
            config,
            ALL,
            SEEDS,
            out,
            overrides=[*sets, "grpo.beta=0.5"],
            resume=True,
            train_fn=Counting(),
        )


def test_each_finished_run_is_reported_even_without_a_progress_display(tmp_path):
    import io

    from rich.console import Console

    from mutualrl.compare import CompareProgress

    config, sets = _config()
    text = io.StringIO()
    compare(
        config,
        ["none"],
        2,
        tmp_path / "r",
        overrides=sets,
        train_fn=fake_train,
        progress=CompareProgress(enabled=False, console=Console(file=text, width=200)),
    )
    lines = text.getvalue().splitlines()
    assert [line.split(":")[0].strip() for line in lines] == ["none-seed0", "none-seed1"]


def test_unknown_strategy_fails_before_any_run(tmp_path, capsys):
    out = tmp_path / "r"
    config, _ = _config()
    rc = main(
        [
            "compare",
            "--config",
            config,
            "--strategies",
            "none,no-such",
            "--seeds",
            "1",
            "--output-dir",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "no-such" in err and all(n in err for n in ALL)
    assert not out.exists()


def test_report_only_rebuilds_the_report_from_the_runs(fake_report):
    out, _ = fake_report
    (out / "report.md").unlink()
    (out / "report.json").unlink()
    assert main(["compare", "--output-dir", str(out), "--report-only"]) == 0
    assert (out / "report.md").exists() and (out / "report.json").exists()


# ---- --jobs: runs in worker processes ---------------------------------------------------------
def logged_fake_train(cfg, progress) -> RunSummary:
    """fake_train that also notes when it started and ended and in which process."""
    import os
    import time

    start = time.time()
    summary = fake_train(cfg, progress)
    time.sleep(0.2)
    (Path(cfg.output_dir) / "clock.json").write_text(
        json.dumps({"start": start, "end": time.time(), "pid": os.getpid()})
    )
    return summary


def failing_fake_train(cfg, progress) -> RunSummary:
    if cfg.strategy == ALL[-1] and cfg.seed == 1:
        raise RuntimeError("worker failed on purpose")
    return fake_train(cfg, progress)


def test_parallel_compare_writes_what_the_sequential_one_does_and_waits_for_each_warm_start(
    fake_report, tmp_path
):
    seq, _ = fake_report
    config, sets = _config()
    out = tmp_path / "parallel"
    compare(config, ALL, SEEDS, out, overrides=sets, train_fn=logged_fake_train, jobs=2)
    assert set(_summaries(out)) == _names(ALL)
    strip = lambda d: {k: v for k, v in d.items() if k not in ("commit", "created")}  # noqa: E731
    assert (
        json.loads((out / "report.json").read_text())["rows"]
        == json.loads((seq / "report.json").read_text())["rows"]
    )
    assert {r["status"] for r in read_state(out)["runs"].values()} == {"done"}
    assert strip(read_state(out))["strategies"] == ALL
    clocks = {p.parent.name: json.loads(p.read_text()) for p in (out / "runs").glob("*/clock.json")}
    assert len({c["pid"] for c in clocks.values()}) == 2  # two worker processes
    for seed in range(SEEDS):
        leader = clocks[f"{ALL[0]}-seed{seed}"]
        for s in ALL[1:]:  # the seed's other runs start after its first has ended
            assert clocks[f"{s}-seed{seed}"]["start"] >= leader["end"]
    overlapping = [
        (a, b)
        for a in clocks
        for b in clocks
        if a < b and clocks[a]["start"] < clocks[b]["end"] and clocks[b]["start"] < clocks[a]["end"]
    ]
    assert overlapping  # two runs did run at once


def test_a_failed_parallel_run_is_recorded_and_the_others_are_kept(tmp_path):
    config, sets = _config()
    out = tmp_path / "r"
    with pytest.raises(RuntimeError, match="on purpose"):
        compare(config, ALL, SEEDS, out, overrides=sets, train_fn=failing_fake_train, jobs=2)
    runs = read_state(out)["runs"]
    bad = f"{ALL[-1]}-seed1"
    assert runs[bad]["status"] == "failed" and "on purpose" in runs[bad]["error"]
    done = {n for n, r in runs.items() if r["status"] == "done"}
    assert done == set(_summaries(out)) and f"{ALL[0]}-seed0" in done
    compare(config, ALL, SEEDS, out, overrides=sets, resume=True, train_fn=fake_train, jobs=2)
    assert set(_summaries(out)) == _names(ALL)


def test_real_parallel_compare_reproduces_the_sequential_runs(real_report, tmp_path):
    """Runs in worker processes compute exactly what they compute one after another."""
    config, sets = _config()
    out = tmp_path / "parallel"
    argv = [
        "compare",
        "--config",
        config,
        "--strategies",
        ",".join(REAL),
        "--seeds",
        "1",
        "--output-dir",
        str(out),
        "--no-progress",
        "--jobs",
        "2",
    ]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    timing = ("time_s", "tokens_per_s", "step_time_s")
    for s in REAL:
        recs = [
            read_metrics(d / "runs" / f"{s}-seed0" / "metrics.jsonl") for d in (real_report, out)
        ]
        strip = [
            [
                {k: v for k, v in r.items() if not k.endswith(timing) and k not in ("path",)}
                for r in rs
                if r["phase"] != "warmup_cache"
            ]
            for rs in recs
        ]
        assert strip[0] == strip[1]


@pytest.mark.skipif("prp" not in REAL, reason="prp is not registered")
def test_prp_steps_time_retokenization_and_receiver_logprobs_apart(real_report):
    """The strategy phase's parts: THL and the receiver's log-prob forward, inside its total."""
    recs = [
        r
        for s in range(SEEDS)
        for r in read_metrics(real_report / "runs" / f"prp-seed{s}" / "metrics.jsonl")
        if r["phase"] == "train"
    ]
    pooled = [r for r in recs if any(v > 0 for k, v in r.items() if k.endswith("prp/peer_samples"))]
    assert pooled
    for r in pooled:
        parts = r["phase/strategy.retokenize_time_s"] + r["phase/strategy.logprobs_time_s"]
        assert r["phase/strategy.retokenize_time_s"] > 0 and r["phase/strategy.logprobs_time_s"] > 0
        assert parts <= r["phase/strategy_time_s"]


def test_a_run_finished_before_an_interrupt_carries_no_error_after_resume(tmp_path):
    """Ctrl-C after a run's summary was written marked it interrupted with an error; once resume
    finds it finished it is done, and the stale error goes."""
    config, sets = _config()
    out = tmp_path / "report"

    def late_interrupt(cfg, progress):
        summary = fake_train(cfg, progress)  # the run finished (summary.json written) ...
        if Path(cfg.output_dir).name == "none-seed0":
            raise KeyboardInterrupt  # ... and the interrupt came after
        return summary

    with pytest.raises(KeyboardInterrupt):
        compare(config, ["none"], 2, out, overrides=sets, train_fn=late_interrupt)
    assert read_state(out)["runs"]["none-seed0"]["error"] == "KeyboardInterrupt: "
    compare(config, ["none"], 2, out, overrides=sets, resume=True, train_fn=Counting())
    run = read_state(out)["runs"]["none-seed0"]
    assert run["status"] == "done" and run["error"] is None


def test_two_compares_cannot_write_one_folder(tmp_path):
    from mutualrl.run.folder import claim

    config, sets = _config()
    out = tmp_path / "report"
    with claim(out, what="compare"):
        with pytest.raises(ConfigError, match="another mutualrl process is writing this compare"):
            compare(config, ["none"], 1, out, overrides=sets, train_fn=Counting())
