"""Tokenizer Heterogeneity Layer: load tokenizers, move trajectories between them, record residuals."""

from mutualrl.retokenize.loaders import TokenizerHandle, TokenizerLoadError, load_tokenizer

__all__ = ["TokenizerHandle", "TokenizerLoadError", "load_tokenizer"]
