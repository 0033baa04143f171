"""The example configs ``mutualrl`` ships: ``--config NAME`` from any folder, ``mutualrl configs``,
and the files inside a built wheel and sdist (not only through the editable install's link)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from mutualrl.cli import main
from mutualrl.config import ConfigError, load_config, to_dict
from mutualrl.config.packaged import is_config_name, packaged_names, resolve_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
NAMES = sorted(p.stem for p in CONFIGS.glob("*.toml"))


def test_every_config_in_the_repository_is_packaged_under_its_stem():
    assert packaged_names() == NAMES
    assert {"default", "tiny"} <= set(NAMES)


@pytest.mark.parametrize("name", ["tiny", "default"])
def test_a_bare_name_loads_the_packaged_config_from_any_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert to_dict(load_config(name)) == to_dict(load_config(CONFIGS / f"{name}.toml"))


def test_paths_and_names_are_told_apart():
    assert is_config_name("tiny") and is_config_name("gpu8-two-8b")
    for path in ("tiny.toml", "./tiny", "configs/tiny", "a\\b", "", "."):
        assert not is_config_name(path), path
    assert resolve_config("configs/tiny.toml") == Path("configs/tiny.toml")


def test_an_unknown_name_is_one_line_listing_the_packaged_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config("tinyy")
    msg = str(info.value)
    assert "\n" not in msg and "'tinyy'" in msg
    assert all(name in msg for name in NAMES)


def test_a_missing_toml_file_named_like_a_packaged_config_points_at_the_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="packaged config of that name is --config tiny"):
        load_config("tiny.toml")
    (tmp_path / "tiny.toml").write_text((CONFIGS / "tiny.toml").read_text())
    assert load_config("tiny.toml").steps == 2  # a file that is there is read as before


def test_configs_list_names_each_config_with_its_purpose(capsys):
    assert main(["configs", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == NAMES
    assert all(len(line.split()) > 1 for line in lines)


def test_configs_show_prints_the_file_to_copy_and_edit(capsys, tmp_path):
    assert main(["configs", "show", "tiny"]) == 0
    text = capsys.readouterr().out
    assert text == (CONFIGS / "tiny.toml").read_text(encoding="utf-8")
    copy = tmp_path / "mine.toml"
    copy.write_text(text)
    assert to_dict(load_config(copy)) == to_dict(load_config("tiny"))


def test_configs_show_of_an_unknown_name_exits_2_with_one_line(capsys):
    assert main(["configs", "show", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tiny" in err


def test_train_with_a_packaged_name_from_another_folder(
    tmp_path, monkeypatch, fast_run_builds, capsys
):
    monkeypatch.chdir(tmp_path)
    assert (
        main(["train", "--config", "tiny", "--output-dir", "run", "--steps", "1", "--no-progress"])
        == 0
    )
    assert (tmp_path / "run" / "summary.json").is_file()


def _source_tree(dest: Path) -> Path:
    """The files a build reads, copied with the configs link kept a link."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(CONFIGS, dest / "configs")
    shutil.copytree(
        ROOT / "src",
        dest / "src",
        symlinks=True,
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    assert (dest / "src" / "mutualrl" / "configs").is_symlink()
    return dest


def _build(args: list[str], cwd: Path) -> None:
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_wheel_and_an_sdist_hold_the_configs_as_files(tmp_path):
    src = _source_tree(tmp_path / "tree")
    _build(
        [
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        tmp_path,
    )
    _build(["-c", "from setuptools import build_meta; build_meta.build_sdist('../sdist')"], src)
    wheel = next((tmp_path / "dist").glob("mutualrl-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {n: zf.read(n) for n in zf.namelist() if n.startswith("mutualrl/configs/")}
    assert in_wheel == {
        f"mutualrl/configs/{n}.toml": (CONFIGS / f"{n}.toml").read_bytes() for n in NAMES
    }
    with tarfile.open(next((tmp_path / "sdist").glob("mutualrl-*.tar.gz"))) as tf:
        members = [m for m in tf.getmembers() if "/src/mutualrl/configs/" in m.name]
    assert sorted(Path(m.name).stem for m in members) == NAMES
    assert all(m.isfile() for m in members)  # files, not the link

    # Installed from the wheel (not editable), a bare name is found in site-packages.
    target = tmp_path / "site"
    _build(
        [
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        tmp_path,
    )
    code = (
        "import mutualrl, mutualrl.config.packaged as p; from mutualrl.config import "
        "load_config; print(mutualrl.__file__); print(load_config('default').steps);"
        "print(p.packaged_folder().is_symlink())"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    where, steps, link = done.stdout.split()
    assert Path(where).is_relative_to(target) and link == "False"
    assert int(steps) == load_config(CONFIGS / "default.toml").steps
