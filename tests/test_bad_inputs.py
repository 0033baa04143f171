"""Every bad input is one line: ``mutualrl: error: ...`` on stderr naming the field, file or
plug-in and what was expected, exit 2, and nothing written to the output folder.

The walk at the end tries 0, -1, NaN and inf in every numeric field of ``RunConfig`` (found by
introspection, nested tables and one policy entry included) through the path ``mutualrl train``
takes before it writes anything: ``load_config`` with the value as a ``--set`` override, then
``run.build.prepare``.
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import msgspec.inspect as mi
import pytest
import torch

from mutualrl.cli import main
from mutualrl.config import ConfigError, RunConfig, load_config
from mutualrl.registry import RegistryError

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("mutualrl: error: ") and "Traceback" not in err[0]
    return err[0]


def train(tmp_path, *sets: str) -> list[str]:
    args = ["train", "--config", TINY, "--output-dir", str(tmp_path / "out"), "--no-progress"]
    for item in sets:
        args += ["--set", item]
    return args


NO_CUDA = pytest.mark.skipif(torch.accelerator.is_available(), reason="this torch has a device")
NO_VLLM = pytest.mark.skipif(find_spec("vllm") is not None, reason="vLLM is installed here")

# (overrides, what the one line must hold)
BAD_SETTINGS = [
    pytest.param(["grpo=1"], ["tiny.toml", "`$.grpo`", "Expected `object`"], id="table-replaced"),
    pytest.param(
        ['policies.0.architecture="nope"'],
        ["policies.llama-mistral.architecture", "'nope'", "llama, mistral, qwen2"],
        id="architecture",
    ),
    pytest.param(
        ['policies.0.attn_implementation="flash"'],
        ["policies.llama-mistral.attn_implementation", "'flash'", "eager", "sdpa"],
        id="attn_implementation",
    ),
    pytest.param(
        ['policies.0.train_attn_implementation="flash"'],
        ["policies.llama-mistral.train_attn_implementation", "'flash'", "eager", "sdpa"],
        id="train_attn_implementation",
    ),
    pytest.param(['task.name="nope"'], ["task.name", "'nope'", "pointer"], id="task-name"),
    pytest.param(['allocation.executor="nope"'], ["allocation.executor", "local"], id="executor"),
    pytest.param(
        ["policies.0.learning_rate=-1"],
        ["`$.policies[0]`", "learning_rate must be > 0"],
        id="policy-lr-negative",
    ),
    pytest.param(
        ["policies.0.learning_rate=0"],
        ["`$.policies[0]`", "learning_rate must be > 0"],
        id="policy-lr-zero",
    ),
    pytest.param(
        ["policies.1.num_heads=0"], ["`$.policies[1]`", "num_heads must be >= 1"], id="num-heads"
    ),
    pytest.param(
        ["policies.0.hidden_size=0"],
        ["`$.policies[0]`", "hidden_size must be >= 1"],
        id="hidden-size",
    ),
    pytest.param(
        ["torch_threads=-2"], ["tiny.toml", "torch_threads must be >= 1"], id="threads-negative"
    ),
    pytest.param(
        ["torch_threads=0"], ["tiny.toml", "torch_threads must be >= 1"], id="threads-zero"
    ),
    pytest.param(["seed=-1"], ["tiny.toml", "seed must be in [0, 2**32 - 1]"], id="seed"),
    pytest.param(
        ['device="tpu9"'], ["device: 'tpu9' is not a torch device", '"cuda:N"'], id="device-unknown"
    ),
    pytest.param(
        ['device="cuda"'], ["device: 'cuda'", 'expected "cpu"'], id="device-absent", marks=NO_CUDA
    ),
    pytest.param(
        ['policies.0.generation.backend="vllm"'],
        ["policies.llama-mistral.generation.backend", "pip install 'mutualrl[vllm"],
        id="vllm-missing",
        marks=NO_VLLM,
    ),
]


@pytest.mark.parametrize("sets,expected", BAD_SETTINGS)
def test_bad_setting_is_one_line_and_writes_nothing(
    sets, expected, tmp_path, capsys, fast_run_builds
):
    assert main(train(tmp_path, *sets)) == 2
    line = one_error_line(capsys)
    for part in expected:
        assert part in line, (part, line)
    assert not (tmp_path / "out").exists()


def test_compare_checks_every_name_before_writing(tmp_path, capsys):
    out = tmp_path / "report"
    assert (
        main(
            [
                "compare",
                "--config",
                TINY,
                "--strategies",
                "none",
                "--seeds",
                "1",
                "--output-dir",
                str(out),
                "--no-progress",
                "--set",
                'policies.0.architecture="nope"',
            ]
        )
        == 2
    )
    assert "policies.llama-mistral.architecture" in one_error_line(capsys)
    assert not out.exists()


def test_task_path_that_is_a_folder(tmp_path, capsys, fast_run_builds):
    folder = tmp_path / "data"
    folder.mkdir()
    assert main(train(tmp_path, 'task.name="jsonl"', f'task.path="{folder}"')) == 2
    line = one_error_line(capsys)
    assert "task.path" in line and str(folder) in line and "folder" in line
    assert not (tmp_path / "out").exists()


def test_binary_config_file_is_named(tmp_path, capsys):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary")
    assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    line = one_error_line(capsys)
    assert str(path) in line and "UTF-8" in line and "TOML" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_garbage_config_json_on_resume_is_named(text, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(text)
    before = sorted((p.name, p.read_bytes()) for p in run.iterdir())
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert str(run / "config.json") in line and "JSON" in line
    assert sorted((p.name, p.read_bytes()) for p in run.iterdir()) == before


def test_unknown_exchange_kind_is_refused(tmp_path, capsys):
    assert (
        main(
            ["exchange", "inspect", str(tmp_path), "--dump", "--kind", "rollout", "--kind", "nope"]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mutualrl: error: --kind 'nope'")
    assert "rollout" in err[0] and "group_stats" in err[0]


def test_a_registry_error_no_check_named_is_still_one_line(tmp_path, capsys, monkeypatch):
    import mutualrl.cli as cli

    def fail(args):
        raise RegistryError("unknown widget 'x'; known: a, b")

    monkeypatch.setattr(cli, "_train_config", fail)
    assert main(train(tmp_path)) == 2
    assert one_error_line(capsys) == "mutualrl: error: unknown widget 'x'; known: a, b"


def test_ctrl_c_while_starting_is_one_line(tmp_path):
    """SIGINT half a second in, while the CLI still imports torch and transformers."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mutualrl.cli",
            "train",
            "--config",
            TINY,
            "--output-dir",
            str(tmp_path / "out"),
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mutualrl: interrupted"), err
    assert not (tmp_path / "out").exists()


# ---- the walk over every numeric field ------------------------------------------------------

NUMBERS = (mi.IntType, mi.FloatType)
# Tables keyed by a name: the key used, and the entries' required fields.
KEYS = {
    ("allocation", "num_parameters"): "llama-mistral",
    ("allocation", "architectures"): "llama-mistral",
    ("allocation", "workers"): "llama-mistral/learner",
}
ANY_KEY = "k"  # the key of any other name-keyed table
REQUIRED = {
    ("allocation", "architectures"): "num_hidden_layers = 2, hidden_size = 32, "
    "num_attention_heads = 4, vocab_size = 32000"
}


def _numeric(t) -> bool:
    return isinstance(t, NUMBERS) or (
        isinstance(t, mi.UnionType) and any(isinstance(x, NUMBERS) for x in t.types)
    )


def _struct(t):
    if isinstance(t, mi.StructType):
        return t
    if isinstance(t, mi.UnionType):  # an optional table ([policies.lora], [allocation.inventory])
        return next((x for x in t.types if isinstance(x, mi.StructType)), None)
    return None


def numeric_fields(t: mi.StructType, path: tuple[str, ...] = ()):
    """Every numeric field under ``t`` as a path; lists of tables at entry 0, name-keyed tables
    (``dict[str, ...]``) at one entry."""
    for f in t.fields:
        p, ft = (*path, f.name), f.type
        if _numeric(ft):
            yield p
        elif (st := _struct(ft)) is not None:
            yield from numeric_fields(st, p)
        elif isinstance(ft, mi.ListType) and isinstance(ft.item_type, mi.StructType):
            yield from numeric_fields(ft.item_type, (*p, "0"))
        elif isinstance(ft, mi.DictType) and _numeric(ft.value_type):
            yield p + (KEYS.get(p, ANY_KEY),)
        elif isinstance(ft, mi.DictType) and isinstance(ft.value_type, mi.StructType):
            yield from (
                (*p, KEYS.get(p, ANY_KEY), *sub[len(p) :])
                for sub in numeric_fields(ft.value_type, p)
            )


FIELDS = list(numeric_fields(mi.type_info(RunConfig)))
VALUES = {"0": 0, "-1": -1, "nan": math.nan, "inf": math.inf}

# Documented acceptances: settings whose 0 (or -1) means something, each with why.
ACCEPTED = {
    ("seed", "0"),  # any seed in [0, 2**32)
    ("task.heldout_seed", "0"),  # as seed
    ("steps", "0"),  # warm start and evaluation only
    ("save_steps", "0"),  # no checkpoints
    ("save_total_limit", "0"),  # keep every checkpoint
    ("grpo.beta", "0"),  # no KL term, no reference model
    ("grpo.top_k", "0"),  # no top-k truncation
    ("grpo.vllm_importance_sampling_clip_min", "0"),  # mask/truncate from 0: no lower bound
    ("training.max_grad_norm", "0"),  # no gradient clipping
    ("training.warmup_ratio", "0"),  # no learning-rate warmup
    ("training.weight_decay", "0"),  # plain Adam
    ("warmup.max_steps", "0"),  # no warm start
    ("warmup.target_accuracy", "0"),  # stop the warm start at its first probe
    ("eval.every", "0"),  # evaluate at the start and the end only
    ("allocation.max_restarts", "0"),  # a failed worker is not restarted
    ("allocation.max_staleness", "0"),  # lock-step
    ("allocation.verifier_threads", "0"),  # one sample verified at a time
    ("allocation.memory.grad_bytes", "0"),  # a memory model without gradients...
    ("allocation.memory.optimizer_bytes", "0"),  # ...or optimizer state (plain SGD)
    ("allocation.inventory.gpus_per_node", "0"),  # a CPU-only cluster
    # A worker said to process no tokens or need no memory (the planner gives it the least).
    ("allocation.workers.llama-mistral/learner.tokens_per_step", "0"),
    ("allocation.workers.llama-mistral/learner.memory_gb", "0"),
    # Rewards are weighted sums of reward functions, negative ones included: any threshold is one.
    ("exchange.success_threshold", "0"),
    ("exchange.success_threshold", "-1"),
    ("diversity.coef", "0"),  # the diversity regulariser off
    ("policies.0.lora.dropout", "0"),  # no dropout on the adapter's input
}


def _override(path: tuple[str, ...], value: str) -> str:
    """The ``--set`` override putting ``value`` at ``path`` (a whole entry of a name-keyed table
    of structs, with its required fields)."""
    table = path[:2]
    if table in REQUIRED:
        key = ".".join(path[:3])
        return f"{key}={{{REQUIRED[table]}, {path[3]} = {value}}}"
    return ".".join(path) + f"={value}"


@pytest.fixture(scope="module")
def prepare_here(fast_run_builds_module):
    from mutualrl.run.build import prepare

    return prepare


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("path", FIELDS, ids=".".join)
def test_every_numeric_field_refuses_nonsense(path, value, tmp_path, prepare_here):
    name = ".".join(path)
    out = tmp_path / "out"
    try:
        cfg = load_config(TINY, [_override(path, value), f'output_dir="{out}"'])
        prepare_here(cfg)
    except ConfigError as exc:
        assert (name, value) not in ACCEPTED, f"{name}={value} is documented as accepted: {exc}"
        msg = str(exc)
        assert "\n" not in msg
        assert re.search(rf"\b{re.escape(path[-1])}\b", msg), (name, msg)
        parent = [p for p in path[:-1] if not p.isdigit() and p not in (*KEYS.values(), ANY_KEY)]
        assert not parent or parent[-1] in msg, (name, msg)
    else:
        assert (name, value) in ACCEPTED, f"{name}={value} is accepted without a documented reason"
    assert not out.exists()


def test_the_walk_covers_nested_tables_and_a_policy():
    names = {".".join(p) for p in FIELDS}
    assert {
        "grpo.beta",
        "allocation.memory.weight_bytes",
        "allocation.inventory.nodes",
        "policies.0.learning_rate",
        "policies.0.lora.r",
        "policies.0.generation.gpu_memory_utilization",
        "scenarios.overlap.peer_share",
        "allocation.architectures.llama-mistral.head_dim",
    } <= names
    assert len(FIELDS) > 80


# The strategies' parameter tables ([strategies.<name>]) are typed by each strategy's own struct,
# so they are walked from the registry, each with its strategy chosen.
def _strategy_fields():
    from mutualrl.strategies import STRATEGIES

    return [
        (name, path)
        for name in STRATEGIES.names()
        for path in numeric_fields(mi.type_info(STRATEGIES.get(name).params))
    ]


# Each an explicit ">= 0" of the strategy's struct: 0 turns its sharing term off.
STRATEGY_ACCEPTED = {
    ("codistill", "kd_coef", "0"),  # no distillation reward
    ("sgt", "alpha", "0"),  # no SFT term on peer successes
    ("hacpo", "alpha", "0"),  # the detached ratio factor is 1
    ("hacpo", "cross_clip_delta", "0"),  # a peer ratio's lower clamp at 1
    ("hacpo", "cross_clip_step", "0"),  # the clamp does not rise within a step
    ("hacpo", "max_peer_per_group", "0"),  # no peer samples join a group
    ("prp", "max_peer_per_group", "0"),  # no peer rollouts join a group
}


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize(
    "name,path", _strategy_fields(), ids=lambda x: x if isinstance(x, str) else ".".join(x)
)
def test_every_numeric_strategy_parameter_refuses_nonsense(
    name, path, value, tmp_path, prepare_here
):
    field = ".".join(path)
    out = tmp_path / "out"
    try:
        cfg = load_config(
            TINY,
            [f'strategy="{name}"', f"strategies.{name}.{field}={value}", f'output_dir="{out}"'],
        )
        prepare_here(cfg)
    except ConfigError as exc:
        assert (name, field, value) not in STRATEGY_ACCEPTED, str(exc)
        assert "\n" not in str(exc) and f"strategies.{name}" in str(exc) and path[-1] in str(exc)
    else:
        assert (name, field, value) in STRATEGY_ACCEPTED, f"{name}.{field}={value} accepted"
    assert not out.exists()
