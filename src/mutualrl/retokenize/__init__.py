"""Tokenizer Heterogeneity Layer: load tokenizers, move trajectories between them, record residuals.

``Retokenizer(target).retokenize(text, source=..., source_ids=..., source_logprobs=...)`` turns a
completion sampled by one policy into another policy's token ids, with the byte-exact alignment
between the two tokenizations, per-group sums of the source log-probs, and ``AlignmentResiduals``
saying what the move cost. See ``docs/retokenization.md``.
"""

from mutualrl.retokenize.align import AlignmentGroups, align_ends
from mutualrl.retokenize.loaders import TokenizerHandle, TokenizerLoadError, load_tokenizer
from mutualrl.retokenize.profile import TokenizerProfile
from mutualrl.retokenize.residuals import AlignmentResiduals, aggregate_residuals
from mutualrl.retokenize.retokenizer import RetokenizedTrajectory, Retokenizer

__all__ = [
    "AlignmentGroups",
    "AlignmentResiduals",
    "RetokenizedTrajectory",
    "Retokenizer",
    "TokenizerHandle",
    "TokenizerLoadError",
    "TokenizerProfile",
    "aggregate_residuals",
    "align_ends",
    "load_tokenizer",
]
