"""The example configs ``mutualrl`` ships: ``--config tiny`` from any folder after ``pip install``.

They live in the repository's ``configs/`` folder, the one copy in git. ``src/mutualrl/configs``
is a symbolic link to it: an editable install reads through the link, and building a wheel or an
sdist copies the files the link reaches into the package (``[tool.setuptools.package-data]``), so
an installed ``mutualrl/configs/`` holds plain files and no link.

A bare name (no ``/``, ``\\`` or ``.``: ``tiny``) names a packaged config; anything else is a
path (``tiny.toml``, ``./tiny``). Paths written inside a config (a task's data file, a chat
template file) are read relative to the folder the command runs in, whichever way the config was
found, so a packaged config and its copy from ``mutualrl configs show`` read the same files.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from mutualrl.config.base import ConfigError

SUFFIX = ".toml"


def packaged_folder() -> Path:
    """The installed ``mutualrl/configs`` folder (it may be missing: then no names are packaged)."""
    # An on-disk install (wheel or editable) gives a pathlib.Path; the CLI reads files by path.
    return Path(str(resources.files("mutualrl") / "configs"))


def packaged_names() -> list[str]:
    """The packaged configs' names, sorted: ``default``, ``tiny``, ..."""
    folder = packaged_folder()
    if not folder.is_dir():
        return []
    return sorted(
        p.name[: -len(SUFFIX)] for p in folder.iterdir() if p.name.endswith(SUFFIX) and p.is_file()
    )


def is_config_name(text: str) -> bool:
    """``text`` names a packaged config rather than a file: no folder part and no suffix."""
    return bool(text) and not any(ch in text for ch in "/\\.")


def packaged_config(name: str) -> Path:
    """The file of the packaged config ``name``; an unknown name is a one-line ``ConfigError``
    listing the packaged ones."""
    if name in packaged_names():
        return packaged_folder() / f"{name}{SUFFIX}"
    known = ", ".join(packaged_names()) or "none are installed"
    raise ConfigError(
        f"config {name!r}: no packaged config has that name (packaged: {known}); "
        f"give one of those names or a TOML file's path, e.g. ./{name}{SUFFIX}"
    )


def resolve_config(path: str | Path) -> Path:
    """The file a ``--config`` value names: a packaged config for a bare name, else the path."""
    if isinstance(path, str) and is_config_name(path):
        return packaged_config(path)
    path = Path(path)
    # ``--config tiny.toml`` from a folder without that file most likely meant the packaged one.
    if (
        path.name == str(path)
        and path.suffix == SUFFIX
        and not path.exists()
        and path.stem in packaged_names()
    ):
        raise ConfigError(
            f"config file not found: {path} (expected a TOML file; the packaged "
            f"config of that name is --config {path.stem})"
        )
    return path
