"""Session-wide fixtures: the real packaged tokenizers are loaded once per test session.

Loading ``deepseek-v3`` takes ~1.5 s and ``mistral-v1`` ~2 s, so every test that needs one takes
it from here (pass ``handle=`` to ``Policy``). ``fast_run_builds`` makes whole training runs reuse
these handles and the retokenizer byte tables instead of rebuilding them per run.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from mutualrl.retokenize.loaders import TokenizerHandle, load_tokenizer

PACKAGED = ("mistral-v1", "deepseek-v3")


class _Handles(dict):
    """Short repr: a failing test prints its fixtures, and tokenizers are huge."""

    def __repr__(self) -> str:
        return f"<tokenizer handles {sorted(self)}>"


@pytest.fixture(scope="session")
def tokenizer_handles() -> dict[str, TokenizerHandle]:
    return _Handles({name: load_tokenizer(name) for name in PACKAGED})


@pytest.fixture(scope="session")
def mistral(tokenizer_handles) -> TokenizerHandle:
    return tokenizer_handles["mistral-v1"]


@pytest.fixture(scope="session")
def deepseek(tokenizer_handles) -> TokenizerHandle:
    return tokenizer_handles["deepseek-v3"]


@pytest.fixture(scope="session")
def _profile_cache() -> dict:
    return {}


def install_fast_run_builds(mp: pytest.MonkeyPatch, handles: dict, profiles: dict) -> None:
    """Make training runs take packaged tokenizers and THL byte tables from the session.

    Only the loading is shortcut: the handles are the very objects ``load_tokenizer`` returns,
    and the byte tables are built by ``TokenizerProfile.build``, once per tokenizer fingerprint.
    """
    import mutualrl.policies.policy as policy_mod
    from mutualrl.retokenize import retokenizer as retok_mod

    real_load = policy_mod.load_tokenizer
    real_build = retok_mod.TokenizerProfile.build

    def load(spec: str) -> TokenizerHandle:
        return handles[spec] if spec in handles else real_load(spec)

    def build(handle):
        if handle.fingerprint not in profiles:
            profiles[handle.fingerprint] = real_build(handle)
        return profiles[handle.fingerprint]

    mp.setattr(policy_mod, "load_tokenizer", load)
    mp.setattr(retok_mod.TokenizerProfile, "build", staticmethod(build))


@pytest.fixture
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine torch's
    spinning worker threads can make a step 5x slower; the previous count is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fast_run_builds(monkeypatch, tokenizer_handles, _profile_cache):
    """Training runs in this test reuse the session's tokenizers (see install_fast_run_builds).

    ``train`` applies the config's ``torch_threads`` process-wide; the count is restored after.
    """
    install_fast_run_builds(monkeypatch, tokenizer_handles, _profile_cache)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory):
    """``module_tmp(name)``: a new folder for a module-scoped fixture, as
    ``tmp_path_factory.mktemp`` makes it, removed at the module's end when none of the module's
    tests failed (a failed one's folders are kept to look into). pytest keeps a module fixture's
    folders to the session's end: the suite's runs and checkpoints added up to more than a CI
    machine's free disk."""
    made = []
    failed_before = request.session.testsfailed

    def mktemp(name: str):
        folder = tmp_path_factory.mktemp(name)
        made.append(folder)
        return folder

    yield mktemp
    if request.session.testsfailed == failed_before:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def fast_run_builds_module(tokenizer_handles, _profile_cache):
    """As ``fast_run_builds``, for module-scoped fixtures that run training once."""
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        install_fast_run_builds(mp, tokenizer_handles, _profile_cache)
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def uninterrupted_default(tmp_path_factory):
    """The shortened CPU default (``test_resume.shortened``) run once, uninterrupted, in a
    subprocess as a user runs it: (its folder, its warm-start cache, its wall seconds). The
    kill-and-resume tests (test_resume.py, test_chaos.py) compare their runs with it; its cache is
    theirs too, filled by this first run."""
    import time

    from test_resume import run, shortened

    base = tmp_path_factory.mktemp("uninterrupted")
    out, cache = base / "run", base / "warmstart"
    t0 = time.monotonic()
    run(shortened(out, cache))
    return out, cache, time.monotonic() - t0
