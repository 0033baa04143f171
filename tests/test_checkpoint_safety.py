"""Checkpoints hold data, never code: a run folder someone else wrote (or rewrote, manifest and
all) can be resumed without running anything from it; a file that does not load is skipped for
the previous checkpoint; old pickled checkpoints are refused; checkpoints are pruned by default;
a disk that fills at the first checkpoint gives advice that works."""

from __future__ import annotations

import errno
import hashlib
import json
import pickle
import shutil
from pathlib import Path

import msgspec
import pytest

from mutualrl.config import ConfigError, load_config
from mutualrl.run import checkpoint, train
from mutualrl.run.metrics import read_metrics
from mutualrl.storage import StorageError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def tiny(out: Path, *sets: str):
    return load_config(TINY, [f'output_dir="{out}"', "save_steps=1", 'strategy="sgt"', *sets])


@pytest.fixture(scope="module")
def tiny_run(module_tmp, fast_run_builds_module) -> Path:
    """Two steps of SGT (a success buffer of records in its state), a checkpoint after each."""
    out = module_tmp("safety") / "run"
    train(tiny(out))
    return out


@pytest.fixture
def run_dir(tiny_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)
    return out


class Hostile:
    """What a hostile pickle does when read: here, create a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def rewrite_manifest(ckpt: Path, **fields) -> None:
    """Recompute the manifest over the files now in ``ckpt``, as whoever replaced one can."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest["files"] = {
        str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files
    }
    manifest.update(fields)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def newest(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step-000002"


def test_a_pickled_checkpoint_is_refused_unread(run_dir, tmp_path):
    """The format before this one: run.pkl, a hostile one, with its manifest recomputed."""
    marker = tmp_path / "ran"
    for ckpt in sorted((run_dir / "checkpoints").iterdir()):
        (ckpt / "run.msgpack").unlink(missing_ok=True)  # (the old version wrote no such file)
        (ckpt / "run.pkl").write_bytes(pickle.dumps(Hostile(marker)))
        rewrite_manifest(ckpt, format=1)
    with pytest.raises(ConfigError) as caught:
        train(tiny(run_dir), resume=True)
    message = str(caught.value)
    assert "\n" not in message and str(newest(run_dir)) in message
    assert "older version" in message and "can run code" in message and "--overwrite" in message
    assert not marker.exists()


@pytest.mark.parametrize("payload", ["pickle", "ext-class", "garbage"])
def test_a_hostile_or_damaged_run_state_runs_nothing_and_the_previous_checkpoint_is_used(
    run_dir, tmp_path, payload
):
    marker, Ext = tmp_path / "ran", msgspec.msgpack.Ext
    crafted = {
        "pickle": pickle.dumps(Hostile(marker)),
        # a plain-data extension naming a class outside the codec's table
        "ext-class": msgspec.msgpack.encode(
            {
                "format": 2,
                "what": "run",
                "state": Ext(
                    8, msgspec.msgpack.encode(["os.system", {"command": f"touch {marker}"}])
                ),
            }
        ),
        "garbage": b"\x93\x01\x02",
    }[payload]
    (newest(run_dir) / "run.msgpack").write_bytes(crafted)
    rewrite_manifest(newest(run_dir))
    notes: list[str] = []
    found = checkpoint.latest(run_dir, report=notes.append)
    assert found is not None and found.step == 1
    [note] = notes
    assert "\n" not in note and "step-000002" in note and "run.msgpack" in note
    assert not marker.exists()


def test_a_cut_policy_state_with_its_manifest_recomputed_falls_back_to_the_previous_checkpoint(
    run_dir, fast_run_builds, capfd
):
    state = newest(run_dir) / "policies" / "llama-mistral" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    rewrite_manifest(newest(run_dir))
    notes: list[str] = []
    found = checkpoint.latest(run_dir, report=notes.append)
    assert found is not None and found.step == 1
    [note] = notes
    assert "\n" not in note and "policies/llama-mistral/state.pt does not load" in note
    train(tiny(run_dir), resume=True)  # resumes after step 1 and trains step 1 again
    err = capfd.readouterr().err
    assert "state.pt does not load" in err and "Traceback" not in err
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if r["phase"] == "resume"] == [1]
    assert [r["step"] for r in records if r["phase"] == "train"] == [0, 1]


def test_a_hostile_sharded_checkpoint_metadata_runs_nothing(run_dir, tmp_path):
    """torch.distributed.checkpoint reads ``.metadata`` with pickle; ours does not."""
    from mutualrl.policies.dcp_reader import read_metadata

    marker = tmp_path / "ran"
    dcp_dir = newest(run_dir) / "policies" / "llama-mistral" / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    rewrite_manifest(newest(run_dir))
    notes: list[str] = []
    found = checkpoint.latest(run_dir, report=notes.append)
    assert found is not None and found.step == 1
    [note] = notes
    assert "\n" not in note and "dcp/.metadata does not load" in note and "names io.open" in note
    with pytest.raises(pickle.UnpicklingError):
        read_metadata(dcp_dir / ".metadata")
    assert not marker.exists()


def test_sharded_checkpoint_metadata_reads_back(tmp_path):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from mutualrl.policies.dcp_reader import SafeFileSystemReader

    def state(model):
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(1, 3)).sum().backward()
        opt.step()
        return {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt),
        }

    torch.manual_seed(0)
    saved, loaded = state(torch.nn.Linear(3, 2)), state(torch.nn.Linear(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
        dcp.load(
            loaded,
            checkpoint_id=str(tmp_path),
            no_dist=True,
            storage_reader=SafeFileSystemReader(tmp_path),
        )
    assert torch.equal(loaded["model"]["weight"], saved["model"]["weight"])
    assert torch.equal(
        loaded["optimizer"]["state"]["weight"]["exp_avg"],
        saved["optimizer"]["state"]["weight"]["exp_avg"],
    )


def test_checkpoints_are_pruned_to_the_newest_two_by_default(tmp_path, fast_run_builds):
    assert tiny(tmp_path).save_total_limit == 2
    out = tmp_path / "run"
    train(tiny(out, "steps=3"))
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == [
        "step-000002",
        "step-000003",
    ]
    checkpoint.prune(out / "checkpoints", 0)  # 0: keep every checkpoint
    assert len(list((out / "checkpoints").iterdir())) == 2


def test_a_disk_full_at_the_first_checkpoint_advises_a_fresh_run_which_works(
    tmp_path, monkeypatch, fast_run_builds
):
    out = tmp_path / "run"
    write = checkpoint._write

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "_write", full)
    with pytest.raises(StorageError) as caught:
        train(tiny(out))
    message = str(caught.value)
    assert "no space left on device" in message and "--resume" not in message
    assert "no checkpoint was completed" in message and "--overwrite" in message
    monkeypatch.setattr(checkpoint, "_write", write)  # space freed; the advice, followed
    train(tiny(out), overwrite=True)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["phase"] == "train"] == [0, 1]


def test_a_disk_full_after_a_complete_checkpoint_advises_resuming(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    (root / "step-000001").mkdir(parents=True)
    assert "--overwrite" in checkpoint._disk_full_advice(root, tmp_path / "run", 1)
    (root / "step-000001" / "manifest.json").write_text("{}")
    advice = checkpoint._disk_full_advice(root, tmp_path / "run", 2)
    assert f"`mutualrl train --resume {tmp_path / 'run'}`" in advice and "--overwrite" not in advice
