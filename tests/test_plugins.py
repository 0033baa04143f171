"""Third-party plug-ins, installed as packages: the two in tests/plugins/ (README.md there).

Each is installed into a temporary folder only: its ``*.dist-info`` (the METADATA and
entry_points.txt pip writes, built here from its pyproject.toml) goes into a folder that, with
the package's source, is put on the PYTHONPATH of a ``mutualrl`` subprocess, where
``importlib.metadata`` finds its entry points as it finds an installed package's. Nothing is
installed into the running environment and nothing is fetched. One test installs the guides'
layout with pip itself (no index, no build isolation) to check that it builds as written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "tests" / "plugins"


def _dist_info(package: Path, site: Path) -> Path:
    """Write ``package``'s dist-info (name, version, entry points) into ``site``; its source
    root."""
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items()) + "\n"
            for group, points in project["entry-points"].items()
        )
    )
    return package


def _mutualrl(args: list[str], paths: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    before = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {
        **os.environ,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPATH": os.pathsep.join([*map(str, paths), *before]),
    }
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def installed(module_tmp) -> list[Path]:
    """Both plug-in packages, installed into a temporary site folder: the PYTHONPATH entries."""
    site = module_tmp("site")
    return [site, *(_dist_info(PLUGINS / name, site) for name in ("echo_plugin", "broken_plugin"))]


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("mutualrl: warning: ")]


def test_broken_plugins_leave_help_working_with_one_named_line_each(installed, tmp_path):
    done = _mutualrl(["-m", "mutualrl.cli", "train", "--help"], installed, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "echo" in done.stdout and "sgt" in done.stdout  # the working plug-in is listed
    lines = {line.split("'")[1]: line for line in _warnings(done.stderr)}
    assert set(lines) == {"broken", "missing", "sgt"}, done.stderr
    for name, why in [
        ("broken", "failed to load (RuntimeError: broken on purpose"),
        ("missing", "failed to load (ModuleNotFoundError"),
        ("sgt", "already registered"),
    ]:
        line = lines[name]
        assert why in line and "package mutualrl-broken-plugin 0.1" in line, line
        assert f"entry point {name} = broken_plugin." in line, line
    assert "broken" not in done.stdout and "missing" not in done.stdout


def test_using_a_broken_plugin_by_name_is_a_one_line_error(installed, tmp_path):
    done = _mutualrl(
        [
            "-m",
            "mutualrl.cli",
            "train",
            "--config",
            str(ROOT / "configs" / "tiny.toml"),
            "--strategy",
            "broken",
            "--steps",
            "1",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        installed,
        tmp_path,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mutualrl: error: ") and "plug-in 'broken'" in last, last
    assert "mutualrl-broken-plugin" in last and "RuntimeError: broken on purpose" in last, last
    assert not (tmp_path / "run").exists()


_CHECK_REGISTRIES = """
from mutualrl.exchange.kinds import EXPERIENCE_TYPES, kind_of
from mutualrl.strategies import STRATEGIES
from mutualrl.tasks import TASKS
from echo_plugin.records import Critique
from echo_plugin.strategy import make_echo
from broken_plugin.records import Renamed

assert STRATEGIES.get("echo").factory is make_echo
assert STRATEGIES.get("sgt").summary != "not the built-in sgt"    # the built-in keeps its name
assert "exits" not in TASKS and "pointer" in TASKS              # sys.exit at import: skipped
assert EXPERIENCE_TYPES.get("critique") is Critique and kind_of(Critique) == "critique"
assert kind_of(Renamed) == "broken.kind" and "broken.renamed" not in EXPERIENCE_TYPES
print("ok")
"""


def test_which_name_counts_and_every_registry_skips_what_fails(installed, tmp_path):
    """The entry point's name, and its module's decorator under the same name, are one plug-in;
    a decorator's different name is the one used; a plug-in that exits at import is skipped."""
    done = _mutualrl(["-c", _CHECK_REGISTRIES], installed, tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    lines = _warnings(done.stderr)
    [renamed] = [line for line in lines if "'broken.renamed'" in line]
    assert "registered as 'broken.kind'" in renamed and "'broken.kind' is the name used" in renamed
    [exits] = [line for line in lines if "'exits'" in line]
    assert "failed to load (SystemExit: broken on purpose" in exits, exits


def test_the_guides_package_layout_installs_with_pip_and_its_strategy_trains(tmp_path):
    pytest.importorskip("setuptools")
    source = tmp_path / "echo_plugin"  # pip builds in the source folder: use a copy
    shutil.copytree(PLUGINS / "echo_plugin", source)
    target = tmp_path / "site"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    done = _mutualrl(["-m", "mutualrl.cli", "train", "--help"], [target], tmp_path)
    assert done.returncode == 0 and not _warnings(done.stderr), done.stderr[-3000:]
    assert "echo" in done.stdout.split("registered:")[1]
    done = _mutualrl(
        [
            "-m",
            "mutualrl.cli",
            "train",
            "--config",
            str(ROOT / "configs" / "tiny.toml"),
            "--strategy",
            "echo",
            "--set",
            "strategies.echo.scale=0.5",
            "--steps",
            "1",
            "--output-dir",
            str(tmp_path / "run"),
            "--no-progress",
        ],
        [target],
        tmp_path,
    )
    assert done.returncode == 0 and not _warnings(done.stderr), done.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()
