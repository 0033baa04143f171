"""A run that a policy left under ``allocation.on_failure = "continue"`` resumes without it
(``run.departures``): its checkpoints hold only the policies still in the run, and the resumed run
did start every policy of the config and then asked the checkpoint for all of them, so the resume
that the interrupt message prints always failed ("has no state for policies [...]")."""

from __future__ import annotations

import json

import pytest

from mutualrl.run import train
from tests.test_restarts import config, fail_updates, records

CONTINUE = ('allocation.on_failure="continue"',)
MODES = {"lock-step": (), "paced": ("allocation.max_staleness=1",)}


def comparable(rows: list[dict], mode: str) -> list[dict]:
    """The records two runs must agree on. In a paced run a row is written once every policy
    still in the run has given its part of the step, and the exchange's counters in it are read
    then: how far the policies had got by that moment, as the pace keys (lead, records that had
    arrived) are (test_paced compares the policies' own keys alike). Those are left out there."""
    if mode != "paced":
        return rows
    return [
        {k: v for k, v in r.items() if not k.startswith("exchange/") and "/pace/" not in k}
        for r in rows
    ]


@pytest.mark.parametrize("mode", MODES)
def test_a_run_a_policy_left_resumes_without_it_to_the_uninterrupted_records(
    mode, tmp_path, monkeypatch, fast_run_builds
):
    extra = (*CONTINUE, *MODES[mode])
    fail_updates(monkeypatch, "llama-mistral", {1, 101})  # its first update, in each run
    whole = tmp_path / "whole"
    train(config(whole, *extra, "steps=6"))
    fail_updates(monkeypatch, "llama-mistral", {1})
    out = tmp_path / "resumed"
    train(config(out, *extra))  # four steps, checkpoints at 2 and 4
    assert json.loads((out / "summary.json").read_text())["failed"]["llama-mistral"]
    train(config(out, *extra, "steps=6"), resume=True)
    assert comparable(records(out), mode) == comparable(records(whole), mode)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == json.loads((whole / "summary.json").read_text())["failed"]
    assert not (out / "checkpoints" / "step-000006" / "policies" / "llama-mistral").exists()
