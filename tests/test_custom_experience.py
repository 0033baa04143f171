"""An experience kind a user registers reaches the strategies of a training run.

A strategy publishes a record of its own kind (``ctx.publish``) in one step; the strategies of
the next step find it in ``ctx.peer_experience``, in the lock-step loop and in the paced one. A
checkpoint keeps what is still queued, so a run stopped at a checkpoint and resumed sees the same
records as an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from mutualrl.config import load_config
from mutualrl.exchange.kinds import EXPERIENCE_TYPES
from mutualrl.run import train
from mutualrl.run.metrics import read_metrics
from mutualrl.strategies.base import STRATEGIES, StrategySpec
from mutualrl.strategies.common import batch_of, own_sequences

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
COMMON = (
    "torch_threads=1",
    "allocation.inventory.cpus_per_node=2",
    "allocation.call_timeout_s=120",
    'strategy="critique-test"',
    "save_steps=2",
)


class Critique(msgspec.Struct, frozen=True, kw_only=True):
    prompt_id: str
    critic: str
    step: int
    score: float


class _Params(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class CritiqueStrategy:
    """Independent GRPO; each step every policy publishes a critique of its own samples and
    logs what its peers' critiques said."""

    name = "critique-test"

    def observe(self, ctx, samples) -> None:
        got = [d for d in ctx.peer_experience if d.kind == "test.critique"]
        for name, own in samples.items():
            peers = [d for d in got if d.producer != name]
            ctx.log(name, "critique/received", len(peers))
            ctx.log(name, "critique/from_step", max((d.record.step for d in peers), default=-1))
            ctx.log(name, "critique/score_sum", sum(d.record.score for d in peers))
            assert all(d.record.critic == d.producer for d in peers)
            ctx.publish(
                Critique(
                    prompt_id=own[0].prompt.id,
                    critic=name,
                    step=ctx.step,
                    score=sum(s.reward for s in own) / len(own),
                ),
                name,
            )

    def build_batches(self, ctx, receiver: str, own):
        return batch_of(own_sequences(own, ctx.grpo))

    def after_update(self, ctx, receiver: str) -> None:
        return None


@pytest.fixture
def critique_kind(monkeypatch):
    """The kind and the strategy, registered for this test only."""
    monkeypatch.setitem(EXPERIENCE_TYPES._items, "test.critique", Critique)
    monkeypatch.setitem(
        STRATEGIES._items,
        "critique-test",
        StrategySpec(
            params=_Params, factory=lambda params, cfg: CritiqueStrategy(), summary="test only"
        ),
    )


def run_tiny(out: Path, *sets: str, resume: bool = False) -> None:
    train(load_config(TINY, [f'output_dir="{out}"', *COMMON, *sets]), resume=resume)


def critique_rows(out: Path) -> dict[int, dict]:
    return {
        r["step"]: {k: v for k, v in r.items() if "/critique/" in k}
        for r in read_metrics(out / "metrics.jsonl")
        if r["phase"] == "train"
    }


def test_a_registered_kind_reaches_the_next_step_and_a_resumed_run_sees_it_too(
    tmp_path, fast_run_builds, critique_kind
):
    whole = tmp_path / "whole"
    run_tiny(whole, "steps=4")
    rows = critique_rows(whole)
    assert sorted(rows) == [0, 1, 2, 3]
    for step, row in rows.items():
        for name in ("llama-mistral", "qwen-deepseek"):
            assert row[f"policy/{name}/critique/received"] == (1 if step else 0), (step, row)
            assert row[f"policy/{name}/critique/from_step"] == step - 1
    # stopped at the checkpoint of step 2, with the critiques of step 1 still queued, and resumed
    cut = tmp_path / "cut"
    run_tiny(cut, "steps=2")
    run_tiny(cut, "steps=4", resume=True)
    assert critique_rows(cut) == rows


def test_a_registered_kind_reaches_the_peers_of_a_paced_run(
    tmp_path, fast_run_builds, critique_kind
):
    out = tmp_path / "paced"
    run_tiny(out, "steps=4", "allocation.max_staleness=1")
    rows = critique_rows(out)
    for name in ("llama-mistral", "qwen-deepseek"):
        received = [rows[s][f"policy/{name}/critique/received"] for s in sorted(rows)]
        latest = [rows[s][f"policy/{name}/critique/from_step"] for s in sorted(rows)]
        assert sum(received) >= 1, (name, received)
        # what arrives was published at an earlier step: never the step's own, never the future
        assert all(f < s for s, f in zip(sorted(rows), latest)), (name, latest)


def test_a_checkpoint_holding_a_kind_this_process_has_not_registered_says_so(tmp_path, monkeypatch):
    """A kind defined in a script: its records are in the checkpoint, but another process has
    not registered it. The resume says which file and what to do; it does not skip the
    checkpoint as damaged."""
    from mutualrl.config import ConfigError
    from mutualrl.run.checkpoint import _decode
    from mutualrl.run.state_codec import encode

    class Note(msgspec.Struct, frozen=True):
        text: str

    monkeypatch.setitem(EXPERIENCE_TYPES._items, "script.note", Note)
    path = tmp_path / "run.msgpack"
    path.write_bytes(encode({"bus": {"queued": {"strategy": [Note(text="hi")]}}}, "run"))
    assert _decode(path, "run")["bus"]["queued"]["strategy"][0] == Note(text="hi")
    monkeypatch.delitem(EXPERIENCE_TYPES._items, "script.note")  # the next process: not there
    with pytest.raises(
        ConfigError,
        match=r"--resume: .*run\.msgpack holds records of experience "
        r"kind 'script\.note', which this process has not "
        r"registered; .*entry point",
    ):
        _decode(path, "run")
