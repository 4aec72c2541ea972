"""Confirmation in rounds and the screen's order, against answers worked out by hand; and
locate --confirm on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import harness, measurement_lines, read_run, shown_bars, strict_json, tiny_args

from lm_eval_headloc.intervention.components import Head
from lm_eval_headloc.method.budget import (
    DEFAULT_ALONE,
    DEFAULT_BUDGET,
    DEFAULT_MASKS,
    budget_split,
    default_split,
)
from lm_eval_headloc.method.confirm import (
    alternated,
    confirmation,
    marginal_contrast,
    prior_penalty_weights,
    prior_rankings,
    prior_weights,
    screen,
)
from lm_eval_headloc.method.designs import design_matrix
from lm_eval_headloc.method.rank import (
    confirmed_order,
    confirmed_top,
    logprob_changes,
    measured_changes,
    rank_measured,
    tied_with_above,
)


def test_marginal_contrast_by_hand():
    design = np.array([[1, 0, 1], [1, 1, 0], [0, 1, 0], [0, 0, 0]], dtype=bool)
    scores = np.array([1.0, 2.0, 4.0, 8.0])
    # head 0: in rows 0,1 (mean 1.5), out rows 2,3 (mean 6) -> -4.5
    # head 1: in rows 1,2 (mean 3), out rows 0,3 (mean 4.5) -> -1.5
    # head 2: in row 0 (1), out rows 1-3 (mean 14/3) -> -11/3
    np.testing.assert_allclose(marginal_contrast(design, scores), [-4.5, -1.5, -11 / 3])
    # A head in every mask or in none has no evidence either way.
    both = np.array([[1, 0], [1, 0]], dtype=bool)
    np.testing.assert_array_equal(marginal_contrast(both, np.array([1.0, 3.0])), [0, 0])


def test_the_screens_order_is_informative_after_the_fits_zeros():
    """Where the Lasso leaves heads at 0 (a large alpha: all of them), they are ordered by
    the marginal contrast, never by head index."""
    design = np.array([[1, 0, 0, 1], [0, 1, 0, 1], [0, 0, 1, 0], [1, 1, 0, 0]], dtype=bool)
    scores = np.array([5.0, 6.0, 9.0, 4.0])
    fit = screen(design, scores, True, alpha=100.0)
    assert np.all(fit.effects == 0)
    # Contrasts by hand: head 0: (5+4)/2 - (6+9)/2 = -3; head 1: (6+4)/2 - (5+9)/2 = -2;
    # head 2: 9 - 5 = +4; head 3: (5+6)/2 - (9+4)/2 = -1. Most harmful (most negative) first.
    assert fit.order == [0, 1, 3, 2]
    # Lower is better: the largest rise is the most harmful.
    assert screen(design, scores, False, alpha=100.0).order == [2, 3, 1, 0]
    # Excluded heads are not ranked.
    assert screen(design, scores, True, alpha=100.0, exclude=[1]).order == [0, 3, 2]


def test_the_screen_with_confirmed_heads_held_fixed_points_at_what_is_left():
    """Two planted heads, one strong (0) and one weaker (5) that shares its masks with a
    decoy (3) more often than not. Holding head 0 at its measured change leaves a residual
    that only head 5 explains."""
    design = np.zeros((8, 8), dtype=bool)
    for row, heads in enumerate([[0, 3], [0, 5], [0, 3, 5], [5, 1], [3, 2], [1, 2],
                                 [4, 6], [6, 7]]):
        design[row, heads] = True
    truth = np.zeros(8)
    truth[0], truth[5] = -4.0, -1.0
    scores = 10.0 + design @ truth
    fit = screen(design, scores, True, alpha=1e-3, fixed={0: -4.0})
    assert 0 not in fit.order
    assert fit.effects[0] == -4.0
    assert fit.order[0] == 5
    # The residual is exactly 10 + (-1)·[head 5 in mask]: its fit recovers -1 for head 5.
    assert fit.effects[5] == pytest.approx(-1.0, abs=0.01)


def test_rounds_take_turns_across_sources_and_rounds():
    """One task, a prior ranking and a screen; rounds of 2, budget 5. Turns go on across
    rounds: prior, screen | prior, screen | prior."""
    prior = [9, 8, 7, 6, 5]
    screen_order = [0, 9, 1, 2, 3]
    seen = []

    def measure(heads):
        seen.append(list(heads))
        return {"t": {h: (-1.0, 0.0) for h in heads}}

    done = confirmation({"t": [prior]}, {"t": lambda _changes: screen_order}, measure, 5,
                        round_size=2)
    assert done.rounds == [[9, 0], [8, 1], [7]]
    assert seen == [[9, 0], [9, 0, 8, 1], [9, 0, 8, 1, 7]]  # all so far, after each round
    assert done.picked_by == {"t": [9, 0, 8, 1, 7]}


def test_what_a_round_measured_steers_the_next_picks():
    """The screen sees the changes measured so far: once head 1 measured harmless, this
    screen puts head 6 first, so round 2's screen pick is 6 (not the 2 it named before)."""
    def screen_of(changes):
        if 1 in changes and changes[1][0] == 0.0:
            return [6, 2, 3]
        return [1, 2, 3]

    def measure(heads):
        return {"t": {h: (0.0 if h == 1 else -1.0, 0.0) for h in heads}}

    done = confirmation({"t": [[4, 5]]}, {"t": screen_of}, measure, 4, round_size=2)
    assert done.heads == [4, 1, 5, 6]


def test_a_larger_budget_extends_the_same_picks():
    rng = np.random.default_rng(0)
    design = design_matrix("stratified", 10, 30, 0.2, seed=1)
    truth = np.zeros(30)
    truth[[3, 17, 22]] = [-3.0, -2.0, -1.5]
    scores = 5 + design @ truth + 0.1 * rng.standard_normal(10)
    prior = list(rng.permutation(30))

    def screen_of(changes):
        return screen(design, scores, True, fixed={h: c[0] for h, c in changes.items()}).order

    def measure(heads):
        return {"t": {h: (float(truth[h]), 0.0) for h in heads}}

    short = confirmation({"t": [prior]}, {"t": screen_of}, measure, 7, round_size=3)
    long = confirmation({"t": [prior]}, {"t": screen_of}, measure, 16, round_size=3)
    assert long.heads[:7] == short.heads
    assert len(long.heads) == 16


def test_tasks_share_the_budget_and_skip_heads_already_picked():
    done = confirmation({"a": [[1, 2, 3, 4]], "b": [[2, 5, 6]]}, {},
                        lambda heads: {}, 5, round_size=5, skip=[3])
    # a: 1, b: 2, a: 2 taken -> its next, 4 (3 is skipped), b: 5, a: nothing left, b: 6.
    assert done.heads == [1, 2, 4, 5, 6]
    assert done.picked_by == {"a": [1, 4], "b": [2, 5, 6]}


def test_confirmation_stops_when_every_head_is_taken():
    done = confirmation({"t": [[0, 1, 2]]}, {}, lambda heads: {}, 10, round_size=2,
                        skip=[1])
    assert done.heads == [0, 2]


def test_confirmation_finds_a_strong_head_the_prior_ranks_last():
    """A world where the truth is known: 60 heads, four planted, additive scores. The
    prior ranks one planted head (11) last; 16 stratified masks and the residual screen
    find it among 16 heads measured alone, so the confirmed top-4 is exactly the planted
    set."""
    total = 60
    truth = np.zeros(total)
    planted = {11: -0.30, 25: -0.25, 40: -0.20, 52: -0.15}
    for head, change in planted.items():
        truth[head] = change
    design = design_matrix("stratified", 16, total, 0.1, seed=4)
    scores = 0.8 + design @ truth
    prior = [h for h in range(total) if h != 11] + [11]  # blind to head 11
    prior = [25, 40, 52] + [h for h in prior if h not in (25, 40, 52)]

    def screen_of(changes):
        return screen(design, scores, True, fixed={h: c[0] for h, c in changes.items()}).order

    def measure(heads):
        return {"t": {h: (float(truth[h]), 0.0) for h in heads}}

    done = confirmation({"t": [prior]}, {"t": screen_of}, measure, 16)
    alone = measure(done.heads)["t"]
    assert confirmed_top(alone, done.heads, 4, True) == [11, 25, 40, 52]
    # Without the screen the prior alone would not reach head 11 within the budget.
    alone_prior = confirmation({"t": [prior]}, {}, measure, 16).heads
    assert 11 not in alone_prior


def test_confirmed_order_ranks_measured_heads_first():
    alone = {4: (-0.10, -0.5), 2: (-0.30, -0.1), 7: (-0.10, -0.9), 5: (0.02, 0.1)}
    # harm: 2 (0.30), then 7 and 4 tie at 0.10 -> bigger logprob drop first (7), then 5.
    assert confirmed_order(alone, [9, 4, 0, 2, 1], True) == [2, 7, 4, 5, 9, 0, 1]
    # Lower is better (a perplexity): a rise is harmful.
    assert confirmed_order({1: (0.5, 0.0), 3: (-0.2, 0.0)}, [0], False)[:2] == [1, 3]
    assert confirmed_order(alone, [9, 4, 0], True, exclude=[2, 0]) == [7, 4, 5, 9]
    assert confirmed_top(alone, [4, 5, 2], 5, True) == [2, 4]  # 5 helps: left out


def test_a_head_measured_harmless_ranks_below_heads_the_screen_implicates():
    # Measured alone: 2 hurts, 5 helps, 6 changes nothing. Not measured: the screen
    # estimates 9 and 1 to hurt (in its order 9, 0, 1, 3), 0 and 3 not.
    alone = {2: (-0.3, -0.1), 5: (0.02, 0.1), 6: (0.0, 0.0)}
    effects = np.zeros(10)
    effects[[9, 1, 0, 3]] = [-0.05, -0.01, 0.0, 0.04]
    order = confirmed_order(alone, [9, 0, 1, 3], True, screen_effects=effects)
    # hurts (2), implicated (9, 1), measured harmless (6 then 5: 5 helps), the rest (0, 3).
    assert order == [2, 9, 1, 6, 5, 0, 3]
    # Lower is better: a positive effect hurts, so 3 is implicated, 9 and 1 are not.
    lower = {2: (0.3, 0.0), 5: (-0.02, 0.0)}
    assert confirmed_order(lower, [3, 0, 9, 1], False, screen_effects=effects) == \
        [2, 3, 5, 0, 9, 1]
    # An excluded head stays out of every group.
    assert 9 not in confirmed_order(alone, [9, 0, 1, 3], True, [9], effects)


def test_ties_are_equal_evidence_not_equal_rank():
    # Heads 0 and 1 are in exactly the same masks: no measurement tells them apart.
    design = np.array([[1, 1, 0, 0], [0, 0, 1, 0], [1, 1, 0, 1], [0, 0, 0, 1]], dtype=bool)
    scores = np.array([1.0, 3.0, 0.5, 2.5])
    fit = screen(design, scores, True, alpha=100.0)  # every effect 0: contrasts decide
    order = confirmed_order({}, fit.order, True)
    assert order[:2] == [0, 1] and tied_with_above(order, {}, fit) == [1]
    # Measured alone, equal score and logprob changes are a tie; a different logprob is not.
    alone = {2: (-0.1, -0.5), 3: (-0.1, -0.5), 0: (-0.1, -0.7)}
    order = confirmed_order(alone, fit.order, True)
    assert order[:3] == [0, 2, 3]
    assert tied_with_above(order, alone, fit) == [3]


def test_rank_measured_by_hand():
    changes = {3: (-0.02, -0.4), 0: (-0.05, -0.1), 8: (-0.02, -0.9), 5: (0.01, -2.0),
               1: (-0.02, -0.4)}
    # harm: 0 (0.05); 8, 3, 1 (0.02: by the logprob's drop, 8's -0.9 first; 3 and 1 the
    # same -0.4: by index, 1 then 3); 5 helps (-0.01) whatever its logprob.
    assert rank_measured(changes, True) == [0, 8, 1, 3, 5]
    # Lower is better: a rise is harmful, so 5 leads; the rest fall, 0 the most.
    assert rank_measured(changes, False) == [5, 8, 1, 3, 0]
    assert rank_measured({}, True) == []
    # The measured part of confirmed_order is this rule.
    assert confirmed_order(changes, [7, 0], True)[:5] == rank_measured(changes, True)


def test_the_logprob_change_is_the_scores_under_the_logprob_signal_and_none_unrecorded():
    """heads.json's logprob_change was 0.0 for every head of a --signal logprob run (and of
    a task without gold answers): the log-likelihood is the score there, or unknown."""
    def record(score: float, metric: str, logprob: float | None = None) -> dict:
        return {"scores": {"t": score}, "metrics": {"t": metric},
                **({} if logprob is None else {"logprob": {"t": logprob}})}

    by_logprob = measured_changes(record(-2.0, "logprob"), {4: record(-2.5, "logprob")}, "t")
    assert by_logprob == {4: (-0.5, -0.5)}
    by_metric = measured_changes(record(0.5, "acc,none", -1.0),
                                 {4: record(0.25, "acc,none", -1.75)}, "t")
    assert by_metric == {4: (-0.25, -0.75)}
    no_gold = measured_changes(record(1.0, "rhyme_acc,none"),
                               {4: record(0.0, "rhyme_acc,none"),
                                2: record(1.0, "rhyme_acc,none")}, "t")
    assert no_gold == {4: (-1.0, None), 2: (0.0, None)}
    assert rank_measured(no_gold, True) == [4, 2]  # ordered without it
    assert np.isnan(logprob_changes(no_gold, 5)).all()
    assert logprob_changes(by_metric, 5)[4] == -0.75


def test_the_logprob_change_a_logprob_run_writes_is_each_heads_measured_change(
        tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--signal", "logprob", "--num-samples", "6", "--out", str(out)) == 0
    entries = strict_json(out / "heads.json")["heads"]
    alone = [e for e in entries if e.get("measured_alone")]
    assert len(alone) == 8  # a tiny model's default: every head alone
    assert all(e["logprob_change"] == pytest.approx(e["effect"], abs=1e-9) for e in alone)
    assert any(e["logprob_change"] != 0 for e in alone)


def test_rank_measured_is_greedys_old_rule_on_ties():
    """The rule greedy wrote out twice (a lexsort of the ranking, a max for the winner)
    gives the same order and winner as rank_measured, on changes with many ties."""
    rng = np.random.default_rng(0)
    for higher in (True, False):
        score = rng.integers(-3, 2, 40) / 100  # accuracy steps: many equal changes
        logprob = rng.integers(-2, 1, 40) / 10
        changes = {h: (float(score[h]), float(logprob[h])) for h in range(40)}
        harmful = -score if higher else score
        assert rank_measured(changes, higher) == [
            int(i) for i in np.lexsort((np.arange(40), logprob, -harmful))]
        winner = max(range(40), key=lambda h: (harmful[h], -logprob[h], -h))
        assert rank_measured(changes, higher)[0] == winner


def test_measured_changes_against_a_reference_record():
    reference = {"scores": {"a": 0.5, "b": 2.0}, "logprob": {"a": -1.0}}
    measured = {4: {"scores": {"a": 0.25, "b": 3.0}, "logprob": {"a": -1.5}},
                2: {"scores": {"a": 0.75, "b": 2.0}}}
    # 2 records no logprob: its change is unknown (it was read as 0, a change of +1.0).
    assert measured_changes(reference, measured, "a") == {4: (-0.25, -0.5), 2: (0.25, None)}
    # b has no logprob anywhere: unknown (it was 0 - 0, "the log-likelihood did not move").
    assert measured_changes(reference, measured, "b") == {4: (1.0, None), 2: (0.0, None)}


def test_alternated_takes_turns_and_skips_what_is_taken():
    # 1 (first), 2 (second), first: 2 taken -> 3, second: 2, 4 -> 4, first: 5 ...
    assert alternated([[1, 2, 3, 5], [2, 4, 5, 6]], 5) == [1, 2, 3, 4, 5]
    # An order with nothing left passes its turn; the count stops at what there is.
    assert alternated([[0], [1, 2, 3]], 10) == [0, 1, 2, 3]
    assert alternated([[7, 8]], 1) == [7]
    assert alternated([], 3) == [] and alternated([[1, 2]], 0) == []


def test_budget_split_by_hand():
    # The defaults: 54 - 8 (atp-path) = 46 -> 12 masks, 34 alone.
    assert DEFAULT_BUDGET == 54 and (DEFAULT_MASKS, DEFAULT_ALONE) == (12, 34)
    assert budget_split(54) == (12, 34)
    assert budget_split(100) == (24, 68)  # 92 * 12/46 = 24
    assert budget_split(30) == (6, 16)  # 22 * 12/46 = 5.74
    assert budget_split(54, "atp") == (13, 37)  # 50 * 12/46 = 13.04
    # Without a prior nothing is set aside and half the budget goes on masks.
    assert budget_split(54, "none") == (27, 27)
    assert budget_split(46, "none") == (23, 23)
    assert budget_split(55, "none") == (28, 27)  # 27.5 rounds to even: 28
    # Another share, for comparing splits (benchmarks/budget_split.py): 40.5 rounds to 40.
    assert budget_split(54, "none", 3 / 4) == (40, 14)
    assert budget_split(54, "atp-path", 1 / 2) == (23, 23)
    with pytest.raises(ValueError, match="prior='auto'"):
        budget_split(54, "auto")


def test_the_defaults_split_the_default_budget_by_whether_the_run_has_a_prior():
    from lm_eval_headloc.runs.spec import RunSpec

    # Left out, --masks and --confirm are decided by the run's prior.
    assert (RunSpec().masks, RunSpec().confirm) == (None, None)
    assert not RunSpec().budget_given and RunSpec(masks=5, confirm=0).budget_given
    # With any prior: atp-path's split of 54 (8 + 12 + 34); without one: 27 + 27.
    for prior in ("atp-path", "atp", "ig"):
        assert default_split(prior) == (12, 34)
        assert (RunSpec().budgeted(prior).masks, RunSpec().budgeted(prior).confirm) == (12, 34)
    assert default_split(None) == (27, 27) == (DEFAULT_BUDGET // 2, DEFAULT_BUDGET // 2)
    assert default_split("none") == (27, 27)
    # --group-tests left out stays None: group tests until certified, within
    # --max-measurements (also left out: auto).
    assert RunSpec().budgeted(None) == RunSpec(masks=27, confirm=27)
    assert RunSpec().budgeted(None).group_tests is None
    assert RunSpec().budgeted(None).max_measurements is None
    # What is given stays; only what is left out is filled.
    assert RunSpec(masks=100).budgeted(None) == RunSpec(masks=100, confirm=27)
    assert RunSpec(confirm=0).budgeted("atp-path") == RunSpec(masks=12, confirm=0)
    assert RunSpec(group_tests=6).budgeted("atp-path").group_tests == 6
    assert RunSpec(masks="auto").budgeted("atp-path").masks == "auto"
    # A resumed run keeps its own where they are left out, whatever the prior.
    stored = RunSpec(masks=100, confirm=60, group_tests=8, max_measurements=200)
    assert RunSpec().budgeted(None, stored) == stored
    assert RunSpec(masks=40).budgeted("atp-path", stored) == RunSpec(
        masks=40, confirm=60, group_tests=8, max_measurements=200)
    # ...unless it never decided them (stopped before its prior): then the defaults.
    assert RunSpec().budgeted(None, RunSpec()) == RunSpec(masks=27, confirm=27)


def test_the_measurement_cap_is_half_the_ranked_columns_unless_given():
    from lm_eval_headloc.runs.spec import RunSpec

    assert RunSpec().measurement_cap(270) == 135
    assert RunSpec().measurement_cap(1025) == 513  # rounded up
    assert RunSpec(max_measurements="auto").measurement_cap(270) == 135
    assert RunSpec(max_measurements=80).measurement_cap(270) == 80


def test_a_default_run_measures_every_head_alone_where_half_the_heads_is_below_the_plan():
    """Up to 108 heads the automatic cap (half of them, rounded up) does not exceed the
    default plan's 54 measurement-equivalents, so that plan ends with no group test and
    uncertified: a default run there measures each head alone after the 2 masks the fit
    takes. Derived here from the rule's arithmetic, not from the module's constants."""
    import math

    from lm_eval_headloc.method.budget import ALL_ALONE_UP_TO, measures_all_alone
    from lm_eval_headloc.runs.spec import RunSpec

    assert [n for n in range(1, 400) if measures_all_alone(n)] == [
        n for n in range(1, 400) if math.ceil(n / 2) <= 54]
    assert ALL_ALONE_UP_TO == 108 and measures_all_alone(48) and not measures_all_alone(109)
    assert RunSpec().measuring_all_alone(48) == RunSpec(masks=2, confirm=48)
    assert RunSpec().measuring_all_alone(108) == RunSpec(masks=2, confirm=108)
    assert RunSpec().measuring_all_alone(109) == RunSpec()  # the default plan, then groups
    # The rule reads the model's heads (the automatic cap is half of those); the heads
    # measured alone are those it ranks: 10 of 48 excluded leaves 38; 200 of 270 excluded
    # (the cap still 135) keeps the default plan, which has group tests there.
    assert RunSpec().measuring_all_alone(48, 38) == RunSpec(masks=2, confirm=38)
    assert RunSpec().measuring_all_alone(270, 70) == RunSpec()
    # Any budget option given keeps its meaning; so does --sparsity auto (its pilot takes
    # more masks than 2) and a run that ranks neurons.
    for given in (dict(masks=12), dict(confirm=5), dict(group_tests=3),
                  dict(max_measurements=60), dict(masks="auto"), dict(sparsity="auto"),
                  dict(components="heads+neurons")):
        assert RunSpec(**given).measuring_all_alone(48) == RunSpec(**given), given
    # The options that do not touch the budget do not stop it.
    assert RunSpec(prior="atp").measuring_all_alone(8) == RunSpec(prior="atp", masks=2,
                                                                   confirm=8)


@pytest.mark.parametrize("allowance, alone_at_most, least, named", [
    (8, None, 54, "12 masks and 34 heads measured alone with the prior's 8"),
    (0, None, 46, "12 masks and 34 heads measured alone"),
    # On a model of 8 heads the confirmation measures 8 of the 34 asked.
    (0, 8, 20, "12 masks and 8 heads measured alone"),
])
def test_a_cap_below_the_runs_fixed_part_is_refused(allowance, alone_at_most, least, named):
    from helpers import raises_naming

    from lm_eval_headloc.runs.spec import RunSpec, UsageError

    def check(cap: int) -> None:
        RunSpec(masks=12, confirm=34, max_measurements=cap).check_cap(
            allowance, alone_at_most=alone_at_most)

    check(least)
    with raises_naming(UsageError, f"--max-measurements {least - 1}", named,
                       f"take {least}"):
        check(least - 1)


def test_a_cap_is_not_checked_before_the_heads_are_known():
    """RunSpec.validate refused --masks 6 --confirm 20 --max-measurements 14, counting
    the 20 heads whole: on a model of 8 heads the run measures 6 + 8 = 14. The cap is
    checked where the model's heads are known (locate, before the weights load)."""
    from lm_eval_headloc.runs.spec import RunSpec

    RunSpec(masks=6, confirm=20, max_measurements=14, prior="none").validate()


def test_prior_rankings_and_weights_by_hand():
    estimates = np.array([[-0.1, -0.4, 0.2, -0.4], [0.0, -0.3, -0.5, 0.1]])
    # Most negative first; equal estimates (heads 1 and 3) in head order.
    assert prior_rankings(estimates) == [[1, 3, 0, 2], [2, 1, 0, 3]]
    assert prior_rankings(estimates[0]) == [[1, 3, 0, 2]]
    assert prior_rankings(None) == [] and prior_weights(None) is None
    # The first point's harm (0.1, 0.4, 0 (a rise), 0.4) over the largest, 0.4: weights
    # 1 / (1 + share).
    np.testing.assert_allclose(prior_weights(estimates), [1 / 1.25, 0.5, 1.0, 0.5])
    np.testing.assert_allclose(prior_penalty_weights(np.zeros(3)), [1.0, 1.0, 1.0])


def test_the_prior_penalty_rule_lives_in_the_method_alone():
    """One rule: the penalty weights are the method's (numpy); the attribution module
    (torch, the measurement layer) computes estimates and no weights of its own."""
    from lm_eval_headloc.measurement import attribution
    from lm_eval_headloc.method import confirm

    assert not hasattr(attribution, "prior_penalty_weights")
    assert confirm.PRIOR_EASE == 1.0


def test_locate_ranks_an_implicated_head_above_one_measured_harmless():
    """fit_rankings hands the screen's estimates to the ranking: a head the masks show
    to hurt outranks a head measured alone to change nothing."""
    from lm_eval_headloc.method.rank import fit_rankings

    rng = np.random.default_rng(0)
    design = rng.random((30, 6)) < 0.3
    scores = 0.9 - 0.4 * design[:, 4]  # L1H1 (flat 4) hurts; nothing else does
    base = {"scores": {"t": 0.9}, "higher_is_better": {"t": True}, "metrics": {"t": "acc"}}
    records = {"baseline": base, "alone-L0H0": {"scores": {"t": 0.9}},
               **{f"mask-{i:04d}": {"scores": {"t": float(y)}} for i, y in enumerate(scores)}}
    ranking = fit_rankings(design, records, ["t"], 3, 0.01, bootstrap=50, top_k=2,
                           confirmed={"heads": ["L0H0"], "never": []})["t"]
    assert [str(h) for h in ranking.top(2)] == ["L1H1", "L0H0"]
    assert ranking.facts.confirmed == ["L0H0"] and ranking.facts.implicated == ["L1H1"]
    # Its stability is the screen's: every resample's screen implicates it (the only head
    # whose masks score lower), so every replay's top-2 holds it; none holds L0H0, which
    # measured no harm.
    assert ranking.stability.selected[4] == 1.0 and ranking.stability.selected[0] == 0.0
    # L0H0 fills the 2nd place without hurting: said so (harmless), not called unstable, and
    # the top-2 is not settled (--masks auto would go on measuring).
    assert ranking.harmless(2) == [Head(0, 0)] and ranking.unstable(2) == []
    assert not ranking.settled(2) and ranking.settled(1)


def _confirming_records(design, scores, alone):
    base = {"scores": {"t": 0.9}, "higher_is_better": {"t": True}, "metrics": {"t": "acc"}}
    return {"baseline": base,
            **{f"alone-{name}": {"scores": {"t": 0.9 + change}} for name, change in alone.items()},
            **{f"mask-{i:04d}": {"scores": {"t": float(y)}} for i, y in enumerate(scores)}}


def test_a_confirming_runs_interval_is_the_spread_of_the_estimate_beside_it():
    """Heads 1 and 4 are knocked out in exactly the same masks (the first one only); the
    prior eases head 1's penalty, so a fit with nothing held fixed credits mask 0's drop
    to head 1. Head 1 was measured alone to do nothing: the run's screen (head 1 held at
    0) credits head 4, and so must the bootstrap refits whose interval is printed beside
    head 4's estimate (they credited head 1, giving head 4 the interval [0, 0])."""
    from lm_eval_headloc.method.rank import fit_rankings

    design = np.zeros((8, 6), dtype=bool)
    design[0, [1, 4]] = True
    design[1:, :] = np.random.default_rng(3).random((7, 6)) < 0.3
    design[1:, [1, 4]] = False
    scores = 0.9 - 0.5 * design[:, 4] + 0.001 * np.arange(8)
    records = _confirming_records(design, scores, {"L0H1": 0.0})
    prior = {"t": [[0.0, 1.0, 0.0, 0.0, 0.2, 0.0]]}  # head 1 likeliest, then head 4
    ranking = fit_rankings(design, records, ["t"], 3, 0.01, bootstrap=60, top_k=2,
                           priors=prior, confirmed={"heads": ["L0H1"], "never": []})["t"]
    effect = ranking.effect(Head(1, 1))
    assert effect < -0.1 and ranking.top(1) == [Head(1, 1)]
    low, high = ranking.confidence(Head(1, 1))["effect_interval"]
    assert low <= effect <= high and low < -0.1
    # The masks cannot tell head 4 from head 1, which was measured: nothing to report.
    assert ranking.facts.same_masks == {}


def test_a_top_head_the_masks_cannot_tell_from_others_is_named_with_them():
    from lm_eval_headloc.method.rank import fit_rankings
    from lm_eval_headloc.report.locate_report import same_masks_words

    design = np.zeros((8, 6), dtype=bool)
    design[0, [1, 2, 4]] = True
    design[1:, :] = np.random.default_rng(3).random((7, 6)) < 0.3
    design[1:, [1, 2, 4]] = False
    scores = 0.9 - 0.5 * design[:, 4]
    records = _confirming_records(design, scores, {"L1H0": 0.0})  # head 3: elsewhere
    ranking = fit_rankings(design, records, ["t"], 3, 0.01, bootstrap=None, top_k=2,
                           confirmed={"heads": ["L1H0"], "never": []})["t"]
    top = str(ranking.top(1)[0])
    alike = {"L0H1", "L0H2", "L1H1"}  # flat 1, 2, 4: the same single mask
    assert top in alike
    named = ranking.facts.same_masks
    assert top in named and set(named) <= alike  # the top-2's implicated ones, no other
    for head, others in named.items():
        assert others == sorted(alike - {head}, key=lambda n: (n[1], n[3]))
    words = " ".join(same_masks_words(ranking.facts, "head", uses_prior=False))
    assert f"{top} was knocked out in exactly the same masks as" in words
    # No rule claimed for the fit's credit among identical columns: the solver splits it.
    assert "how the fit shares the credit among them follows the solver's order, not the " \
        "masks" in words and "lowest index" not in words
    # Measured alone, a head is told apart: with every one of them measured, none is named.
    measured = _confirming_records(design, scores, {"L0H1": 0.0, "L0H2": 0.0, "L1H1": -0.5})
    ranking = fit_rankings(design, measured, ["t"], 3, 0.01, bootstrap=None, top_k=2,
                           confirmed={"heads": ["L0H1", "L0H2", "L1H1"], "never": []})["t"]
    assert ranking.top(1) == [Head(1, 1)] and ranking.facts.same_masks == {}


def test_the_terminal_marks_top_heads_the_masks_cannot_tell_apart_or_that_do_not_hurt(
        monkeypatch, capsys):
    from types import SimpleNamespace

    from lm_eval_headloc.cli import main as cli
    from lm_eval_headloc.method.rank import fit_rankings

    design = np.zeros((8, 6), dtype=bool)
    design[0, [1, 2, 4]] = True
    design[1:, :] = np.random.default_rng(3).random((7, 6)) < 0.3
    design[1:, [1, 2, 4]] = False
    scores = 0.9 - 0.5 * design[:, 4]
    records = _confirming_records(design, scores, {"L0H0": 0.0, "L1H0": 0.0})
    rankings = fit_rankings(design, records, ["t"], 3, 0.01, bootstrap=None, top_k=4,
                            confirmed={"heads": ["L0H0", "L1H0"], "never": []})
    monkeypatch.setattr(cli, "load_run", lambda out: SimpleNamespace(
        spec=SimpleNamespace(top_k=4), masks_per_pass=None))
    cli._print_rankings(rankings, "out")
    lines = capsys.readouterr().out.splitlines()[1:5]
    ranking = rankings["t"]
    alike = ranking.facts.same_masks
    harmless = {str(h) for h in ranking.harmless(4)}
    assert harmless >= {"L0H0", "L1H0"} and alike
    for line, head in zip(lines, ranking.top(4), strict=True):
        assert (f"knocked out in the same masks as {len(alike.get(str(head), []))} other"
                in line) == (str(head) in alike)
        assert line.endswith("(does not hurt)") == (str(head) in harmless)


def test_the_report_gives_the_held_out_r2_beside_the_in_sample_one():
    from lm_eval_headloc.method.lasso import HeadLasso, held_out_r2
    from lm_eval_headloc.method.rank import fit_rankings
    from lm_eval_headloc.method.ranking import Ranking, RankingFacts
    from lm_eval_headloc.report.locate_report import held_out_words

    design = np.random.default_rng(5).random((12, 6)) < 0.4
    scores = 0.9 - 0.3 * design[:, 2] + 0.01 * np.random.default_rng(6).normal(size=12)
    records = _confirming_records(design, scores, {"L0H0": 0.0})
    ranking = fit_rankings(design, records, ["t"], 3, 0.01, bootstrap=None, top_k=2,
                           confirmed={"heads": ["L0H0"], "never": []})["t"]
    assert ranking.facts.r2_held_out == pytest.approx(held_out_r2(
        HeadLasso(fixed_effects={0: 0.0}), design, scores))
    words = held_out_words(ranking)
    # 6 heads, 12 measurements: no crowding to warn of; heads measured alone are said apart.
    assert words.startswith(", in-sample; each measurement predicted by a fit on the others: "
                            f"R² = {ranking.facts.r2_held_out:.2f}; the heads measured")
    crowded = Ranking("t", "acc", True, 0.5, np.zeros(30), list(range(30)), 3,
                          facts=RankingFacts(measurements=4, alpha=0.01, r2_held_out=None))
    assert held_out_words(crowded) == (
        ", in-sample (30 heads, 4 measurements: a fit comes close whatever the truth); each "
        "measurement predicted by a fit on the others: R² = n/a (too few measurements, or "
        "none that vary)")
    assert held_out_words(Ranking("t", "acc", True, 0.5, np.zeros(3), [0, 1, 2], 3)) == ""


def test_a_head_another_tasks_picks_brought_is_as_stable_as_their_replay():
    """Two tasks share the confirmation: 'a' picked L0H0, which its masks show clearly;
    'b', whose scores are noise, picked L1H0, which measured alone also hurts 'a'. On a
    resample of the masks 'b''s screen picks other heads, so 'a''s top-2 holds L1H0 only
    as often as the whole confirmation's replay picks it again: it was 100 % stable,
    always in 'a''s pool as a head 'a' did not pick, while 'a''s own picks were replayed."""
    from lm_eval_headloc.method.rank import fit_rankings

    rng = np.random.default_rng(0)
    design = rng.random((24, 6)) < 0.3
    scores = {"a": 0.9 - 0.4 * design[:, 0], "b": 0.5 + 0.05 * rng.standard_normal(24)}
    base = {"scores": {"a": 0.9, "b": 0.5}, "higher_is_better": {"a": True, "b": True},
            "metrics": {"a": "acc", "b": "acc"}}
    alone = {"L0H0": {"a": 0.5, "b": 0.5}, "L1H0": {"a": 0.7, "b": 0.5}}
    records = {"baseline": base,
               **{f"alone-{name}": {"scores": s} for name, s in alone.items()},
               **{f"mask-{i:04d}": {"scores": {t: float(scores[t][i]) for t in scores}}
                  for i in range(24)}}
    confirmed = {"heads": ["L0H0", "L1H0"], "picked_by": {"a": ["L0H0"], "b": ["L1H0"]},
                 "round_size": 5, "never": []}
    ranking = fit_rankings(design, records, ["a", "b"], 3, 0.01, bootstrap=60, top_k=2,
                           confirmed=confirmed)["a"]
    assert ranking.top(2) == [Head(0, 0), Head(1, 0)]  # measured alone: -0.4, -0.2
    stable = ranking.stability.selected
    assert stable[0] > 0.95  # the masks show it in (nearly) every resample
    assert 0.0 < stable[3] < 0.9, stable  # only where 'b''s replay picks it again
    # A run from before picked_by replays each task alone, as a run of that task alone.
    del confirmed["picked_by"]
    together = fit_rankings(design, records, ["a", "b"], 3, 0.01, bootstrap=60, top_k=2,
                            confirmed=confirmed)
    for task in ("a", "b"):
        alone = fit_rankings(design, records, [task], 3, 0.01, bootstrap=60, top_k=2,
                             confirmed=confirmed)[task]
        np.testing.assert_array_equal(together[task].stability.selected,
                                      alone.stability.selected, err_msg=task)


# --- locate --confirm on a tiny model -----------------------------------------------------

def test_the_confirmation_draws_one_progress_bar_for_all_its_rounds(tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """The default job drew a new bar for each of the confirmation's rounds. One
    bar per phase (as lm-eval draws one per request type): the masks, then the
    confirmation's heads alone (7: rounds of 5 and 2), each bar filled once. The masks'
    bar counts the 6 masks, not the baseline measured with them."""
    with shown_bars(monkeypatch) as shown:
        assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                       "--masks", "6", "--sparsity", "0.25", "--num-samples", "6",
                       "--prior", "none", "--confirm", "7", "--out",
                       str(tmp_path / "run")) == 0
    assert shown == [("locate", 6, 6), ("confirm", 7, 7)], shown
    rounds = strict_json(tmp_path / "run" / "config.json")["confirm"]["rounds"]
    assert [len(r) for r in rounds] == [5, 2]  # two rounds, one bar


def test_the_confirmations_bar_counts_the_heads_it_can_measure(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """On an 8-head model --confirm 34 drew "confirm 0/34", then was cut to what it
    measured: the bar's total is what the stage measures, at most the heads it can
    measure (here 7: one is never knocked out)."""
    with shown_bars(monkeypatch) as shown:
        assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                       "--masks", "4", "--sparsity", "0.25", "--num-samples", "4",
                       "--prior", "none", "--confirm", "34", "--never-ablate", "L0H1",
                       "--out", str(tmp_path / "run")) == 0
    assert shown[-1] == ("confirm", 7, 7), shown
    drawn = shown.drawn[-1]
    assert "0/7" in drawn and "/34" not in drawn, drawn
    assert len(strict_json(tmp_path / "run" / "config.json")["confirm"]["heads"]) == 7


def test_a_phase_cut_short_draws_its_last_line_once(monkeypatch):
    """A phase that measured less than its total was cut to what it measured and drawn
    twice: once cut, once as it closed."""
    from lm_eval_headloc.measurement.store import phase_bar

    with shown_bars(monkeypatch) as shown:
        with phase_bar("confirm", 5) as bar:
            bar.mininterval = float("inf")  # no drawing as it counts: only the last
            bar.update(3)
    assert shown == [("confirm", 3, 3)]
    assert shown.drawn[0].count("3/3") == 1, shown.drawn


def test_confirm_knocks_out_the_likeliest_heads_alone_and_ranks_them_first(
        tiny_model_dir, tmp_path):
    import csv

    from sklearn.linear_model import Lasso

    out = tmp_path / "confirm"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "12", "--sparsity", "0.25", "--num-samples", "8", "--top-k", "2",
            "--signal", "logprob", "--prior", "none", "--confirm", "3", "--out", str(out)]
    assert harness(*args) == 0
    records = {r["key"]: r for r in read_run(out)[0]}
    heads = strict_json(out / "heads.json")
    config = strict_json(out / "config.json")
    # Candidates without a prior: the masks' Lasso's three most harmful heads, fitted
    # here with sklearn directly (scores over their standard deviation, intercept).
    design = np.load(out / "design_matrix.npy")
    y = np.array([records[f"mask-{i:04d}"]["scores"]["tiny_copy"] for i in range(12)])
    coef = Lasso(alpha=0.01, max_iter=10000).fit(design.astype(float), y / y.std()).coef_
    screen = [f"L{i // 4}H{i % 4}" for i in np.argsort(coef, kind="stable")]
    assert config["confirm"]["heads"] == screen[:3]
    assert config["confirm"]["picked_by"] == {"tiny_copy": screen[:3]}
    assert config["confirm"]["rounds"] == [screen[:3]]  # one round (of at most 5)
    # Each was measured alone, and the ranking starts with them by measured change.
    base = records["baseline"]["scores"]["tiny_copy"]
    alone = {h: records[f"alone-{h}"]["scores"]["tiny_copy"] - base for h in screen[:3]}
    assert all(records[f"alone-{h}"]["mask"] == h for h in alone)
    first = [h["head"] for h in heads["heads"][:3]]
    assert sorted(alone.values()) == [alone[h] for h in first]
    # The rest: the masks refitted with the measured heads' changes held fixed (sklearn
    # on the residual), equal fits ordered by the residual's marginal contrast.
    flat = {f"L{i // 4}H{i % 4}": i for i in range(8)}
    held = [flat[h] for h in alone]
    residual = y - design[:, held].astype(float) @ np.array(list(alone.values()))
    free = [i for i in range(8) if i not in held]
    refit_coef = dict(zip(free, Lasso(alpha=0.01, max_iter=10000).fit(
        design[:, free].astype(float), residual / residual.std()).coef_ * residual.std(),
        strict=True))

    def contrast(i):
        inside = [r for r, row in zip(residual, design, strict=True) if row[i]]
        outside = [r for r, row in zip(residual, design, strict=True) if not row[i]]
        return np.mean(inside) - np.mean(outside) if inside and outside else 0.0

    tail = sorted(free, key=lambda i: (refit_coef[i], contrast(i), i))
    assert [h["head"] for h in heads["heads"][3:]] == [f"L{i // 4}H{i % 4}" for i in tail]
    for entry in heads["heads"]:
        assert entry["measured_alone"] == (entry["head"] in alone)
        if entry["measured_alone"]:
            assert entry["effect"] == pytest.approx(alone[entry["head"]])
            assert entry["effect_interval"] is None
        else:
            assert entry["effect"] == pytest.approx(
                refit_coef[flat[entry["head"]]], abs=1e-9)
    with open(out / "heads.csv") as f:
        rows = {row["head"]: row for row in csv.DictReader(f)}
    assert {h for h, row in rows.items() if row["measured_alone"] == "1"} == set(alone)
    report = (out / "report.md").read_text()
    assert "3 heads knocked out one at a time" in report and "measured alone" in report
    # refit measures nothing: the confirmed heads stay, the screen's fit may change.
    assert harness("refit", str(out), "--alpha", "0.05") == 0
    assert strict_json(out / "config.json")["confirm"] == config["confirm"]
    assert [h["head"] for h in strict_json(out / "heads.json")["heads"][:3]] == first
    assert harness("refit", str(out), "--alpha", "0.01") == 0
    assert strict_json(out / "heads.json") == heads


def test_confirm_with_the_prior_alternates_and_covers_small_models(tiny_model_dir, tmp_path):
    out = tmp_path / "both"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "8", "--sparsity", "0.25", "--num-samples", "4",
                   "--prior", "atp", "--confirm", "4", "--out", str(out)) == 0
    from lm_eval_headloc.method.confirm import prior_penalty_weights
    from lm_eval_headloc.method.lasso import HeadLasso

    stored = strict_json(out / "prior.json")["tasks"]["tiny_choice"]["points"][0]
    prior = stored["ranking"]
    records = {r["key"]: r for r in read_run(out)[0]}
    design = np.load(out / "design_matrix.npy")
    y = [records[f"mask-{i:04d}"]["scores"]["tiny_choice"] for i in range(8)]
    # The screen: the prior-eased Lasso (checked against its definition above).
    fit = HeadLasso(penalty_weights=prior_penalty_weights(-np.array(stored["effects"])))
    screen = [f"L{i // 4}H{i % 4}" for i in fit.fit(design, y).ranking()]
    expected = []
    for source in [prior, screen, prior, screen]:  # in turn, skipping what is taken
        expected.append(next(h for h in source if h not in expected))
    assert np.count_nonzero(fit.coef_) >= 2  # the screen's picks are its fit's, not ties
    assert strict_json(out / "config.json")["confirm"]["heads"] == expected
    # --confirm above the model's 8 heads: every head alone (one-shot greedy's ranking).
    every = tmp_path / "every"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "8", "--sparsity", "0.25", "--num-samples", "4",
                   "--out", str(every)) == 0  # the defaults: --confirm 34, --prior auto
    config = strict_json(every / "config.json")
    assert len(config["confirm"]["heads"]) == 8 and config["prior_used"] is True
    records = {r["key"]: r for r in read_run(every)[0]}
    base = records["baseline"]["scores"]["tiny_choice"]
    changes = {h: records[f"alone-{h}"]["scores"]["tiny_choice"] - base
               for h in config["confirm"]["heads"]}
    ranked = [h["head"] for h in strict_json(every / "heads.json")["heads"]]
    assert [changes[h] for h in ranked] == sorted(changes.values())


def heads_top_k(run: Path) -> int:
    return strict_json(run / "config.json")["spec"]["top_k"]


def test_a_run_that_measured_every_head_alone_claims_no_fit(tiny_model_dir, tmp_path, capsys):
    """With more confirmation than heads (a small model, the default budget) every head is
    measured alone: the fit has nothing left and its R² (0) and held-out R² said nothing
    true; the report says why there is none."""
    out = tmp_path / "all"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--num-samples", "6", "--signal", "logprob", "--masks", "4",
                   "--prior", "none", "--confirm", "8", "--out", str(out)) == 0
    heads = strict_json(out / "heads.json")
    assert len(heads["confirmed"]) == 8
    assert heads["r2"] is None and heads["r2_held_out"] is None  # as the report says
    printed = capsys.readouterr().out
    assert "R²" not in printed
    # Every head measured alone: the one whose knockout helps most is the spread, and
    # top heads that hurt by no more are marked so where the ranking is printed.
    assert heads["higher_is_better"] is True  # logprob
    best = max(heads["heads"], key=lambda e: e["effect"])
    assert best["effect"] > 0  # random weights: some knockout helps (else nothing to test)
    assert heads["largest_single_help"] == {"head": best["head"], "change": best["effect"]}
    for entry in heads["heads"][:heads_top_k(out)]:
        line = next(line for line in printed.splitlines()
                    if line.strip().split()[1:2] == [entry["head"]])
        within = entry["effect"] < 0 and -entry["effect"] <= best["effect"]
        assert ("within the spread of single knockouts" in line) == within, line
    report = (out / "report.md").read_text()
    assert "Every head was measured alone, so each ranks by its measurement" in report
    assert "Fit R²" not in report
    some = tmp_path / "some"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--num-samples", "6", "--signal", "logprob", "--masks", "4",
                   "--prior", "none", "--confirm", "2", "--out", str(some)) == 0
    assert "Fit R² = " in (some / "report.md").read_text()
    assert isinstance(strict_json(some / "heads.json")["r2"], float)


def test_the_confirmation_record_reads_and_writes_config_json_as_it_was():
    """config.json's ``confirm`` read as a ``ConfirmRecord`` writes back byte for byte (the
    keys in their order, an unknown key kept), and says what was measured alone and in
    groups the way the run folder's keys name them."""
    from lm_eval_headloc.method.confirm import ConfirmRecord

    written = {"heads": ["L1H0", "L0H2"], "round_size": 5, "rounds": [["L1H0", "L0H2"]],
               "picked_by": {"t": ["L1H0", "L0H2"]}, "next": {"t": ["L0H1"]}, "never": [3],
               "groups": {"cap": 40, "spent_before": 20, "budget": 20, "size": 4,
                          "rounds": [[["L0H0", "L0H1"], ["L1H1"]], [["L0H1"]]],
                          "alone": ["L1H1", "L0H1"], "later": 1},
               "consumed": 7}
    record = ConfirmRecord.from_json(written)
    assert json.dumps(record.to_json()) == json.dumps(written)
    assert record.alone == ["L1H0", "L0H2", "L1H1", "L0H1"]
    assert record.group_sets == [["L0H0", "L0H1"]] and record.groups.tested == 3
    assert (record.groups.cap, record.other) == (40, {"consumed": 7})
    # A run from before rounds, picked_by and group tests: nothing is invented for it.
    earliest = {"heads": ["L0H0"], "never": []}
    assert ConfirmRecord.of(earliest).to_json() == earliest
    assert ConfirmRecord.of(earliest).group_sets == [] and ConfirmRecord.of(None) is None


def test_the_terminal_says_nothing_found_where_no_top_head_hurts(monkeypatch, capsys):
    """report.md said 'Nothing found: none of the top-5 heads hurts the task' while the
    terminal listed five heads, each '(does not hurt)', and no such line."""
    from types import SimpleNamespace

    from lm_eval_headloc.cli import main as cli
    from lm_eval_headloc.method.ranking import Ranking, RankingFacts

    monkeypatch.setattr(cli, "load_run", lambda out: SimpleNamespace(
        spec=SimpleNamespace(top_k=3), masks_per_pass=None))
    effects = np.array([0.0, 0.02, 0.01, 0.0, 0.03, 0.0])  # accuracy never falls
    helps = Ranking("t", "acc", True, 0.5, effects, [4, 1, 2, 0, 3, 5], 3,
                    facts=RankingFacts(method="one-shot greedy"))
    cli._print_rankings({"t": helps}, "out")
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] == ("  nothing found: none of the top-3 heads hurts the task; their "
                          "order is no evidence of a role in it")
    assert all(line.endswith("(does not hurt)") for line in printed[2:5])
    # One head that hurts: no such line.
    effects[4] = -0.2
    cli._print_rankings({"t": helps}, "out")
    assert "nothing found" not in capsys.readouterr().out


def test_the_next_round_leaves_out_what_the_group_tests_measured_alone():
    """'A larger --confirm would measure next: L1H2, ...' named components the group tests
    had since measured alone (one of them ranked 4th, 'measured alone', in the same table):
    the next round was chosen before the group tests and never updated."""
    from lm_eval_headloc.method.rank import fit_rankings
    from lm_eval_headloc.report.locate_report import _unconfirmed_words

    design = np.random.default_rng(5).random((10, 6)) < 0.3
    scores = 0.9 - 0.4 * design[:, 4]
    records = _confirming_records(design, scores, {"L1H0": 0.0, "L0H2": -0.1})
    confirmed = {"heads": ["L1H0"], "round_size": 5, "rounds": [["L1H0"]],
                 "picked_by": {"t": ["L1H0"]}, "next": {"t": ["L0H2", "L1H1"]}, "never": [],
                 "groups": {"cap": 40, "spent_before": 6, "budget": 20, "size": 2,
                            "rounds": [], "alone": ["L0H2"],
                            "later": 0}}
    ranking = fit_rankings(design, records, ["t"], 3, 0.01, bootstrap=None, top_k=2,
                           confirmed=confirmed)["t"]
    assert ranking.measured_alone(Head(0, 2))  # by the group tests' halving
    assert ranking.facts.next == ["L1H1"]
    words = " ".join(_unconfirmed_words(ranking.facts, "head"))
    assert "would measure next: L1H1." in words


def test_the_terminal_says_a_tie_in_the_runs_own_unit(monkeypatch, capsys):
    """A neuron run printed '5. L1N6  +0.0000  (tied with the head above)'."""
    from types import SimpleNamespace

    from lm_eval_headloc.cli import main as cli
    from lm_eval_headloc.method.columns import Columns
    from lm_eval_headloc.method.ranking import Ranking, RankingFacts

    monkeypatch.setattr(cli, "load_run", lambda out: SimpleNamespace(
        spec=SimpleNamespace(top_k=3), masks_per_pass=None))
    columns = Columns.of("neurons", 2, 4, candidates=["L0N1", "L0N2", "L1N3", "L1N4"])
    ranking = Ranking("t", "acc", True, 0.5, np.array([-0.2, -0.1, -0.1, 0.0]), [0, 1, 2, 3],
                      4, columns=columns, facts=RankingFacts(tied_with_above=["L1N3"]))
    cli._print_rankings({"t": ranking}, "out")
    printed = capsys.readouterr().out
    assert "3. L1N3  -0.1000  (tied with the neuron above)" in printed
    assert "head" not in printed.replace("heads.json", "")


def _small_default_run(tiny_model_dir, out, *options: str) -> dict:
    """A default locate on the tiny model's 8 heads (logprob, 6 examples) into ``out``, with
    ``options``; its config.json."""
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--num-samples", "6", "--signal", "logprob", *options,
                   "--out", str(out)) == 0
    return strict_json(out / "config.json")


def test_a_default_run_on_a_small_model_measures_every_head_alone(tiny_model_dir, tmp_path):
    """The tiny model's 8 heads (7 ranked with one excluded): a default run spent the
    prior's 8, 12 masks and measured at most 34 heads alone (28 measurements for 8 heads);
    it now measures the 2 masks the fit takes and each ranked head alone, computes no
    prior, is certified, and its ranking is the one-at-a-time ranking."""
    out = tmp_path / "default"
    config = _small_default_run(tiny_model_dir, out, "--exclude", "L1H3")
    assert (config["spec"]["masks"], config["spec"]["confirm"]) == (2, 7)
    assert config["prior_used"] is False and not (out / "prior.json").exists()
    assert "every head is measured alone" in config["prior_skipped"]
    records, heads = read_run(out)
    keys = [r["key"] for r in records]
    assert sorted(keys) == sorted(["baseline", "mask-0000", "mask-0001",
                                   *(f"alone-L{h // 4}H{h % 4}" for h in range(7))])
    assert heads["certificate"]["certified"] is True
    base = next(r for r in records if r["key"] == "baseline")["scores"]["tiny_copy"]
    changes = {r["key"][len("alone-"):]: r["scores"]["tiny_copy"] - base
               for r in records if r["key"].startswith("alone-")}
    ranked = [e["head"] for e in heads["heads"] if e["head"] in changes]
    assert [changes[h] for h in ranked] == sorted(changes.values())  # higher is better
    report = (out / "report.md").read_text()
    assert ("2 masks, sparsity 0.1, seed 0; the fewest masks the fit takes, then every "
            "head it ranks measured alone") in report
    # Spent: 2 masks and 7 heads, no prior; no cap is said to be passed.
    assert ("- measurements: 9 measurement-equivalents (the prior's allowance, masks, heads "
            "measured alone and group tests): 2 masks and every head it ranks alone") in report
    assert "more than the run's cap" not in report
    # A bare rerun keeps the run's budget and measures nothing more.
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--num-samples", "6", "--signal", "logprob", "--exclude", "L1H3",
                   "--out", str(out)) == 0
    assert [r["key"] for r in read_run(out)[0]] == keys
    # With a budget option given the default plan is kept: the prior and its masks.
    given = tmp_path / "given"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--num-samples", "6", "--signal", "logprob", "--masks", "4",
                   "--out", str(given)) == 0
    config = strict_json(given / "config.json")
    assert config["spec"]["masks"] == 4 and config["prior_used"] is True


def test_a_default_small_model_run_with_a_never_ablated_head_says_it_measured_all_alone(
        tiny_model_dir, tmp_path):
    """--never-ablate L1H1 leaves 7 heads to rank, each measured alone, as --exclude L1H1
    does; its report claimed a fit (its R², "more than the run's cap of 4") and no word of
    the plan, as the never-ablated head was counted among those left unmeasured."""
    out = tmp_path / "never"
    config = _small_default_run(tiny_model_dir, out, "--never-ablate", "L1H1")
    assert (config["spec"]["masks"], config["spec"]["confirm"]) == (2, 7)
    report = (out / "report.md").read_text()
    assert "the fewest masks the fit takes, then every head it ranks measured alone" in report
    assert "left to estimate (no R²)" in report and "Fit R²" not in report
    assert "more than the run's cap" not in report


def test_a_small_model_run_given_a_prior_counts_it_in_its_spent_line(tiny_model_dir,
                                                                     tmp_path):
    """--prior atp-path on 8 heads: every head alone after 2 masks, and the prior. The
    spent line read "18 ...: 2 masks and every head it ranks alone", 8 short of its sum."""
    from lm_eval_headloc.method.budget import PRIOR_ALLOWANCE

    out = tmp_path / "prior"
    _small_default_run(tiny_model_dir, out, "--prior", "atp-path")
    allowance = PRIOR_ALLOWANCE["atp-path"]
    spent = allowance + 2 + 8
    assert strict_json(out / "heads.json")["certificate"]["measurements_spent"] == spent
    assert (f"- measurements: {spent} measurement-equivalents (the prior's allowance, masks, "
            f"heads measured alone and group tests): the prior's {allowance}, 2 masks and "
            "every head it ranks alone") in (out / "report.md").read_text()


@pytest.mark.parametrize("options, least", [
    # The default budget's split, its --confirm at most the model's LAYERS x HEADS = 8
    # heads (it measures no more alone; 34 was counted): 8 + 12 + 8 with atp-path, the
    # smaller of that and 27 + 8 without a prior.
    ([], 28),
    (["--prior", "atp"], 24),  # 4 + 12 + 8
    (["--masks", "6", "--confirm", "4"], 10),  # auto may compute no prior: 6 + 4 at least
    (["--masks", "6", "--prior", "none"], 14),  # 6 + the default 27's 8
])
def test_a_cap_below_the_default_split_is_refused_before_the_model_loads(
        tiny_model_dir, tmp_path, capsys, no_model_loading, options, least):
    """--max-measurements below the default budget's split was refused only after the
    weights had loaded, once --prior auto had decided its prior: both its choices split
    one budget, so the cap fails either way."""
    from helpers import assert_names, last_error

    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy", "--signal",
            "logprob", *options]
    assert harness(*args, "--max-measurements", str(least - 1), "--out",
                   str(tmp_path / "low")) == 2
    assert_names(last_error(capsys), f"--max-measurements {least - 1}",
                 f"give at least {least}")


@pytest.mark.parametrize("confirm", [[], ["--confirm", "20"]])
def test_a_cap_that_holds_the_heads_a_small_model_has_runs(tiny_model_dir, tmp_path,
                                                           confirm):
    """--masks 6 --max-measurements 14 on LAYERS x HEADS = 8 heads: the default
    --confirm 27 (no prior), or a --confirm 20 given, measures the 8 heads alone, 6 + 8 =
    14 in all. The cap was refused as below "6 masks and 27 (20) heads measured alone"
    (33, 26), which the run never measures."""
    out = tmp_path / "capped"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--signal", "logprob", "--prior", "none", "--masks", "6", *confirm,
                   "--max-measurements", "14", "--out", str(out)) == 0
    certificate = strict_json(out / "heads.json")["certificate"]
    assert certificate["measurements_spent"] == 6 + 8
    assert sum(r["key"].startswith("alone-") for r in measurement_lines(out)) == 8
