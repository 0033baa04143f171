"""``ResidualRows``: every ``AlignmentResiduals`` is built there from a row of counts, whichever
path (whole batch or per text) filled the row."""

from __future__ import annotations

import pytest

from mutualrl.retokenize.residuals import AlignmentResiduals, ResidualRows

COUNTS = {
    "n_bytes": 12,
    "n_source_tokens": 4,
    "n_target_tokens": 5,
    "n_groups": 3,
    "roundtrip_mismatch": False,
    "roundtrip_edit_distance": 0,
    "normalizer_changed_text": False,
    "source_mismatch": True,
    "source_edit_distance": 2,
    "boundary_iou": 0.5,
    "groups_1_1": 1,
    "groups_1_n": 1,
    "groups_n_1": 0,
    "largest_group_source_tokens": 2,
    "largest_group_target_tokens": 3,
    "largest_group_bytes": 7,
    "unknown_tokens": 1,
    "byte_fallback_tokens": 2,
    "specials_stripped": 1,
    "specials_added": 0,
    "eos_paired": True,
    "truncated_tokens": 0,
    "truncated_bytes": 0,
    "logprob_mass_error": 0.0,
    "logprob_mass_unassigned": 0.25,
}


def test_a_row_of_counts_gives_its_residuals_with_the_rates_derived():
    rows = ResidualRows.blank(2)
    rows.put(1, COUNTS)
    rows.put(0, {**COUNTS, "n_source_tokens": 0, "n_target_tokens": 0, "unknown_tokens": 0})
    empty, full = rows.records()
    kept = {k: v for k, v in COUNTS.items() if k not in ("unknown_tokens", "byte_fallback_tokens")}
    assert full == AlignmentResiduals(
        **kept, groups_n_m=1, length_ratio=5 / 4, unknown_rate=1 / 5, byte_fallback_rate=2 / 5
    )
    # No tokens on a side: the ratios are 0.0, not a division by zero.
    assert (empty.length_ratio, empty.unknown_rate, empty.byte_fallback_rate) == (0.0, 0.0, 0.0)


def test_rows_are_placed_by_text_and_a_row_left_blank_fails():
    part = ResidualRows.blank(1)
    part.put(0, COUNTS)
    rows = ResidualRows.blank(3)
    rows.place(part, [2])
    assert rows.n_bytes == [None, None, 12] and rows.eos_paired == [None, None, True]
    with pytest.raises(TypeError):  # rows 0 and 1 were never filled
        rows.records()
