"""--sparsity auto: the pilot's masks and its choice, against hand-made scores; and a locate
run's pilot."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import LASSO_ONLY, harness, read_run, shown_bars, strict_json, tiny_args

from lm_eval_headloc.method.pilot import (
    FLOOR_KEY,
    PILOT_MASKS,
    PILOT_SPARSITIES,
    choose_sparsity,
    pilot_design,
)


def test_pilot_masks_per_level_and_a_half_floor_mask():
    keys, levels, matrix = pilot_design(270, seed=3, never_ablate=[0, 1])
    assert len(keys) == len(levels) == len(matrix) == PILOT_MASKS * len(PILOT_SPARSITIES) + 1
    assert keys[-1] == FLOOR_KEY and levels[-1] == 0.5
    counts = matrix.sum(axis=1)
    assert list(counts[:-1]) == [5, 5, 13, 13, 27, 27, 54, 54]  # round(p * 268)
    assert counts[-1] == 134
    assert not matrix[:, [0, 1]].any()
    again = pilot_design(270, seed=3, never_ablate=[0, 1])
    np.testing.assert_array_equal(again[2], matrix)
    assert not np.array_equal(pilot_design(270, seed=4)[2], matrix)
    # 8 heads: 0.02, 0.05 and 0.1 all knock out one head; measured once.
    small_keys, small_levels, small = pilot_design(8, seed=0)
    assert small_levels == [0.02, 0.02, 0.2, 0.2, 0.5]
    assert list(small.sum(axis=1)) == [1, 1, 2, 2, 4]


def records_for(levels, keys, by_level, floor, baseline=0.6, higher=True):
    records = {"baseline": {"scores": {"t": baseline}, "higher_is_better": {"t": higher}},
               FLOOR_KEY: {"scores": {"t": floor}}}
    for key, level in zip(keys, levels, strict=True):
        if key != FLOOR_KEY:
            records[key] = {"scores": {"t": by_level[level]}}
    return records


def test_choice_is_the_largest_level_keeping_half_the_way_to_the_floor():
    keys, levels, _ = pilot_design(270, seed=0)
    # Distance to the floor: 0.5; kept: 0.9, 0.7, 0.4, 0.1 of it.
    records = records_for(levels, keys, {0.02: 0.55, 0.05: 0.45, 0.1: 0.3, 0.2: 0.15}, 0.1)
    chosen, kept = choose_sparsity(levels, keys, records, ["t"])
    assert chosen == 0.05
    assert kept["0.1"]["t"] == pytest.approx(0.4)
    # Lower is better (perplexity): the same shares mirrored.
    mirrored = records_for(levels, keys, {0.02: 0.65, 0.05: 0.75, 0.1: 0.9, 0.2: 1.05}, 1.1,
                           higher=False)
    assert choose_sparsity(levels, keys, mirrored, ["t"])[0] == 0.05
    # Nothing moves the score: the largest level.
    flat = records_for(levels, keys, dict.fromkeys(PILOT_SPARSITIES, 0.6), 0.6)
    assert choose_sparsity(levels, keys, flat, ["t"])[0] == 0.2
    # Every level at the floor: the smallest.
    floored = records_for(levels, keys, dict.fromkeys(PILOT_SPARSITIES, 0.1), 0.1)
    assert choose_sparsity(levels, keys, floored, ["t"])[0] == 0.02


# --- a locate run's pilot -----------------------------------------------------------------

def test_sparsity_auto_runs_a_pilot_that_joins_the_fit(tiny_model_dir, tmp_path):
    from lm_eval_headloc.method.designs import knockouts_per_mask

    out = tmp_path / "pilot"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--sparsity", "auto", "--masks", "16", "--num-samples", "6", *LASSO_ONLY,
                   "--out", str(out)) == 0
    config = strict_json(out / "config.json")
    records, heads = read_run(out)
    assert len(records) == 1 + 16  # baseline + 16 measurements, the pilot's included
    chosen = config["pilot"]["sparsity"]
    assert chosen in (0.02, 0.2) and config["masks_used"] == 16
    matrix = np.load(out / "design_matrix.npy")
    assert len(matrix) == heads["measurements"] == 15  # the floor mask is not fitted
    assert config["row_keys"][:4] == ["pilot-p0.02-0", "pilot-p0.02-1", "pilot-p0.2-0",
                                      "pilot-p0.2-1"]
    assert (matrix[4:].sum(axis=1) == knockouts_per_mask(chosen, 8)).all()
    report = (out / "report.md").read_text()
    assert "sparsity auto: " in report
    # The design's line said "16 masks" beside the fit's "over 15 measurements": it says
    # which one the fit leaves out.
    assert ("- design: stratified, 16 masks (15 of them fitted: the pilot's floor mask, half "
            "the heads knocked out, only chooses the sparsity), sparsity auto: ") in report
    assert "Fit R² = " in report and " over 15 measurements" in report


def test_the_pilots_bar_and_the_masks_bar_count_the_masks_asked(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """--masks 8 drew "pilot 6/6" (the baseline with the pilot's 5) and "locate 8/8" (the
    pilot's again with the baseline): each bar counts the masks it measures, together the 8
    asked, the floor mask among them."""
    with shown_bars(monkeypatch) as shown:
        assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                       "--sparsity", "auto", "--masks", "8", "--num-samples", "4",
                       *LASSO_ONLY, "--out", str(tmp_path / "pilot")) == 0
    assert shown == [("pilot", 5, 5), ("locate", 3, 3)], shown
