"""Fixtures of the strategy tests (helpers live in ``helpers.py``)."""

from __future__ import annotations

import pytest
import torch

from .helpers import TOKENIZER_OF


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Two shared cores: one intra-op thread is several times faster and keeps runs stable.

    ``build_run`` sets the process-wide thread count from ``torch_threads``; restore it after.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fast_builds(fast_run_builds):
    """Retokenizers and runs in every test take tokenizers and byte tables from the session."""


@pytest.fixture
def handles(tokenizer_handles):
    return {name: tokenizer_handles[tok] for name, tok in TOKENIZER_OF.items()}
