"""The planted-sparse simulator (``headloc_bench.simulation``) and its CLI.

The simulator is the yardstick new recovery methods are compared on, so these tests pin
down what its numbers mean: the same seed gives the same answer; a single knockout costs
exactly the planted effect; the noise is the binomial of ``n_examples`` documents (checked
against the closed form acc(1-acc)/n), or fixed documents counted by hand; no mask goes
below the floor; a world the Lasso must solve is solved (and one it cannot is not), which
a flipped sign or misaligned columns would break; and "masks needed" moves the right way
with the target and world.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_names, raises_naming

from headloc_bench.simulation import (
    SATURATIONS,
    coverage_prediction,
    hits_by_budget,
    masks_needed,
    planted_world,
    recovered_top,
    seed_trial,
    simulate_scores,
)
from lm_eval_headloc.method.designs import design_matrix

SMALL_GRID = [4, 8, 12, 16, 24, 32, 48, 64, 96, 128]


def test_same_seed_same_world_design_and_scores():
    first = seed_trial(270, 0.02, 7, 60)
    again = seed_trial(270, 0.02, 7, 60)
    other = seed_trial(270, 0.02, 8, 60)
    np.testing.assert_array_equal(first.world.effects, again.world.effects)
    np.testing.assert_array_equal(first.design, again.design)
    np.testing.assert_array_equal(first.scores, again.scores)
    assert not np.array_equal(first.world.effects, other.world.effects)
    assert not np.array_equal(first.scores, other.scores)
    # simulate_scores draws only from the generator it is given.
    scores = [simulate_scores(first.world, first.design, np.random.default_rng(3))
              for _ in range(2)]
    np.testing.assert_array_equal(*scores)


def test_world_does_not_depend_on_sparsity_or_budget():
    """Common random numbers: every sparsity and budget of a seed faces the same world."""
    a = seed_trial(1024, 0.02, 4, 50)
    b = seed_trial(1024, 0.1, 4, 300)
    np.testing.assert_array_equal(a.world.effects, b.world.effects)


@pytest.mark.parametrize("kind", ["stratified", "bernoulli"])
def test_a_budget_is_a_prefix_of_a_larger_one(kind):
    """masks_needed fits budgets as prefixes; that is only the package's design (and the
    same noise) for M masks if the designs and score draws are prefix-consistent."""
    large = design_matrix(kind, 300, 1024, 0.05, 11)
    np.testing.assert_array_equal(design_matrix(kind, 73, 1024, 0.05, 11), large[:73])
    short, long = seed_trial(270, 0.05, 2, 40, kind=kind), seed_trial(270, 0.05, 2, 200,
                                                                      kind=kind)
    np.testing.assert_array_equal(short.design, long.design[:40])
    np.testing.assert_array_equal(short.scores, long.scores[:40])


@pytest.mark.parametrize("saturation", SATURATIONS)
def test_single_knockouts_cost_exactly_their_effect(saturation):
    world = planted_world(270, np.random.default_rng(0), saturation=saturation)
    single = np.eye(270, dtype=bool)
    np.testing.assert_allclose(world.accuracy(single), world.baseline + world.effects,
                               atol=1e-12)
    np.testing.assert_allclose(world.accuracy(np.zeros((1, 270), bool)), world.baseline)


def test_planted_heads_are_the_exhaustive_top5_and_the_tail_has_its_mass():
    for n_heads in (270, 5120):
        for seed in range(5):
            world = planted_world(n_heads, np.random.default_rng(seed))
            top5 = np.argsort(world.effects, kind="stable")[:5]
            assert set(top5.tolist()) == set(world.planted.tolist())
            drops = -world.effects[world.planted]
            assert (np.diff(drops) <= 0).all()  # most harmful first
            assert drops.min() >= 0.08 - 1e-12 and drops.max() <= 0.45 + 1e-12
            tail = np.delete(world.effects, world.planted)
            assert -tail.min() <= 0.5 * drops.min() + 1e-12  # the cap
            headroom = world.baseline - world.floor
            # Net tail mass is kept at tail_mass (8) even where the cap binds (N = 270).
            assert -np.log1p(tail / headroom).sum() == pytest.approx(8.0, rel=1e-6)
            assert 0.1 < np.mean(tail > 0) < 0.3  # ~20 % helpful heads


@pytest.mark.parametrize("n_examples", [25, 100])
def test_noise_is_binomial_with_variance_acc_times_one_minus_acc_over_n(n_examples):
    world = planted_world(270, np.random.default_rng(1), n_examples=n_examples)
    mask = np.zeros((1, 270), dtype=bool)
    mask[0, world.planted[1]] = True  # a planted head out: accuracy baseline + effect
    accuracy = world.baseline + world.effects[world.planted[1]]
    repeats = 40_000
    scores = simulate_scores(world, np.repeat(mask, repeats, axis=0),
                             np.random.default_rng(2))
    variance = accuracy * (1 - accuracy) / n_examples
    # Standard errors: mean sqrt(var/R); variance ~ var*sqrt(2/R) (0.7 %); 4-5 of them.
    assert scores.mean() == pytest.approx(accuracy, abs=4 * math.sqrt(variance / repeats))
    assert scores.var(ddof=1) == pytest.approx(variance, rel=0.04)
    # Scores are counts of documents over n_examples.
    np.testing.assert_allclose(scores * n_examples, np.round(scores * n_examples))


@pytest.mark.parametrize("saturation", SATURATIONS)
def test_accuracy_never_goes_below_the_floor(saturation):
    world = planted_world(270, np.random.default_rng(3), saturation=saturation)
    rng = np.random.default_rng(4)
    heavy = rng.random((500, 270)) < rng.uniform(0.0, 1.0, (500, 1))  # 0 %..100 % out
    accuracy = world.accuracy(heavy)
    assert accuracy.min() >= world.floor and accuracy.max() <= 1.0
    everything = world.accuracy(np.ones((1, 270), bool))[0]
    assert everything == pytest.approx(world.floor, abs=1e-3)
    # Many heads out does saturate: 10 % of the heads take most of the headroom.
    tenth = world.accuracy(design_matrix("stratified", 200, 270, 0.1, 0)).mean()
    assert tenth < world.floor + 0.5 * (world.baseline - world.floor)


def test_noiseless_big_effects_are_recovered_exactly_by_a_generous_budget_only():
    """No tail, (almost) no noise, planted drops 0.25-0.45: 200 masks must find all five in
    every seed, 5 masks (25 of 270 heads ever knocked out) cannot. A sign flip in the
    ranking or a world whose columns do not line up with the design's finds ~0."""
    options = dict(tail_mass=0.0, n_examples=10**9, planted_drops=(0.25, 0.45))
    generous, tiny = [], []
    for seed in range(5):
        trial = seed_trial(270, 0.02, seed, 200, world_options=options)
        generous.append(recovered_top(trial.world, trial.design, trial.scores))
        tiny.append(recovered_top(trial.world, trial.design[:5], trial.scores[:5]))
        # Scrambled columns: the same scores against another head order find little.
        shuffled = trial.design[:, np.random.default_rng(seed).permutation(270)]
        assert recovered_top(trial.world, shuffled, trial.scores) <= 2
    assert generous == [5] * 5
    assert max(tiny) < 5 and sum(tiny) <= 10


def test_another_estimator_plugs_in_through_rank():
    """``rank`` scores a new method on the same worlds; the Lasso's own ranking passed as
    ``rank`` gives the default's hits, a ranking that ignores the data finds ~nothing."""
    from lm_eval_headloc.method.lasso import HeadLasso

    def lasso(design, scores):
        return HeadLasso(alpha=0.01).fit(design, scores).ranking()

    def blind(design, scores):
        return np.arange(design.shape[1])[::-1]

    default = hits_by_budget(270, 0.05, [100, 200], range(4))
    np.testing.assert_array_equal(hits_by_budget(270, 0.05, [100, 200], range(4), rank=lasso),
                                  default)
    assert hits_by_budget(270, 0.05, [200], range(4), rank=blind).sum() <= 2
    assert masks_needed(40, sparsity=0.1, budgets=SMALL_GRID, seeds=range(5),
                        rank=blind).masks is None


def test_hits_grow_with_the_budget_on_average():
    hits = hits_by_budget(270, 0.05, [10, 60, 300], range(10))
    assert hits.shape == (10, 3) and hits.min() >= 0 and hits.max() <= 5
    means = hits.mean(axis=0)
    assert means[0] < means[1] < means[2]
    assert means[2] >= 3.5


def test_masks_needed_moves_the_right_way_on_a_tiny_model():
    common = dict(sparsity=0.1, budgets=SMALL_GRID, seeds=range(10))
    easy = masks_needed(40, target_hits=2, **common)
    usual = masks_needed(40, **common)
    strict = masks_needed(40, target_hits=5, share=1.0, **common)
    noisy = masks_needed(40, world_options=dict(n_examples=10), **common)
    for result in (easy, usual, strict, noisy):
        assert result.masks is None or result.masks in SMALL_GRID
    assert easy.masks is not None and usual.masks is not None
    assert easy.masks <= usual.masks
    assert strict.masks is None or strict.masks >= usual.masks
    assert noisy.masks is None or noisy.masks >= usual.masks
    # The answer met the target; the budget before it (scanned) did not.
    assert usual.success[0.1][usual.masks] >= 0.8
    earlier = [m for m in usual.success[0.1] if m < usual.masks]
    assert all(usual.success[0.1][m] < 0.8 for m in earlier)
    assert earlier == [m for m in SMALL_GRID if m < usual.masks]  # scanned upwards
    # Same call, same answer.
    assert masks_needed(40, **common) == usual


def test_masks_needed_is_none_when_no_budget_on_the_grid_suffices():
    result = masks_needed(40, sparsity=[0.05, 0.1], budgets=[2, 3], seeds=range(5))
    assert result.masks is None
    assert result.by_sparsity == {0.05: None, 0.1: None}
    assert result.sparsity == 0.05


def test_masks_needed_over_sparsities_reports_the_best():
    result = masks_needed(40, sparsity=[0.025, 0.1], budgets=SMALL_GRID, seeds=range(10))
    found = {p: m for p, m in result.by_sparsity.items() if m is not None}
    assert found and result.masks == min(found.values())
    assert result.by_sparsity[result.sparsity] == result.masks


def test_coverage_rule_by_hand():
    # (1 + 0.75 ln k)/p at 270 heads, p = 0.02: k = 5, 1/p = 54.
    assert coverage_prediction(270, 0.02) == pytest.approx((1 + 0.75 * math.log(5)) * 54)


def test_planted_world_refuses_impossible_parameters():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="planted_drops"):
        planted_world(270, rng, planted_drops=(0.1, 0.6))  # beyond baseline - floor
    with pytest.raises(ValueError, match="saturation"):
        planted_world(270, rng, saturation="sigmoid")
    with pytest.raises(ValueError, match="tail_helpful"):
        planted_world(270, rng, tail_helpful=0.9)
    world = planted_world(20, rng)
    with raises_naming(ValueError, "(masks, 20)", "(3, 21)"):
        world.accuracy(np.zeros((3, 21), bool))


def test_cli_writes_a_table_with_its_command_and_world(tmp_path, capsys):
    from headloc_bench import simulate_recovery as module

    out = tmp_path / "SIM.md"
    argv = ["--n-heads", "40,80", "--sparsities", "0.1", "--seeds", "3", "--budgets",
            "8,16,32,64", "--fixed-budgets", "16", "--no-sensitivity", "--out", str(out)]
    assert module.main(argv) == 0
    text = out.read_text(encoding="utf-8")
    assert "python benchmarks/simulate_recovery.py --n-heads 40,80" in text
    assert "tail_mass=8.0" in text and "saturation=logistic" in text
    rows = [line for line in text.splitlines() if line.startswith("| 40 ") or
            line.startswith("| 80 ")]
    assert len(rows) == 2
    assert rows[0] in capsys.readouterr().out


@pytest.mark.parametrize("method", ["defaults", "before"])
def test_confirming_defaults_in_the_simulator(method):
    """Single knockouts follow the world's own accuracy; confirming every head is the
    exhaustive search (either method); a noise-free prior is the effects themselves."""
    from headloc_bench.defaults import (
        confirmed_masks_needed,
        confirming_run_top,
        exhaustive_top,
        measured_alone,
        simulated_prior,
    )

    trial = seed_trial(40, 0.1, seed=2, max_masks=30)
    world = trial.world
    one_hot = np.eye(world.n_heads, dtype=bool)
    expected = world.accuracy(one_hot)  # the world's own combination rule, one head each
    draws = [measured_alone(world, noise_seed=s) for s in range(400)]
    base = np.mean([b for b, _ in draws])
    single = np.mean([b + c for b, c in draws], axis=0)
    assert base == pytest.approx(world.baseline, abs=0.01)
    np.testing.assert_allclose(single, expected, atol=0.012)  # 4 s.e. of 40,000 documents
    base, changes = measured_alone(world, noise_seed=7)
    assert sorted(exhaustive_top(changes, 5)) == sorted(np.argsort(changes)[:5])
    # Confirming every head ranks exactly as the exhaustive search does.
    top = confirming_run_top(world, trial.design, trial.scores, None, world.n_heads,
                             changes, method=method)
    assert list(top) == list(exhaustive_top(changes, 5))
    perfect = simulated_prior(world, np.random.default_rng(0), noise=0.0, miss=0.0,
                              points=2)
    top = confirming_run_top(world, trial.design, trial.scores, perfect, world.n_heads,
                             changes, method=method)
    assert list(top) == list(exhaustive_top(changes, 5))
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(simulated_prior(world, rng, noise=0.0, miss=0.0),
                                  world.effects[None])
    missed = simulated_prior(world, np.random.default_rng(0), noise=0.0, miss=1.0)
    np.testing.assert_allclose(missed[0, world.planted], 0.02 * world.effects[world.planted])
    # Noise-free, no-miss prior and a world without noise to speak of: found at once
    # (16: the first budget with >= 5 heads confirmed by both methods, 2 + 6 and 6 + 6).
    needed, success = confirmed_masks_needed(
        60, budgets=[16, 20], seeds=range(4), prior_options={"noise": 0.0, "miss": 0.0},
        world_options={"n_examples": 100_000}, against="planted", method=method)
    assert needed == 16 and success == {16: 1.0}
    with pytest.raises(ValueError, match="method='after'"):
        confirming_run_top(world, trial.design, trial.scores, None, 5, changes,
                           method="after")


def test_the_simulated_splits_and_prior_points():
    """How a budget is split (12 + 34 at M = 54 after atp-path's allowance of 8, the rest
    rounded in that ratio; 25 + 25 after atp's 4 before), with and without a prior, and
    how many rankings each method's prior gives (prior.PRIOR_POINTS). That these are the
    package's defaults: test_the_simulated_defaults_are_the_packages_defaults."""
    from headloc_bench.defaults import PRIOR_POINTS as SIMULATED_POINTS
    from headloc_bench.defaults import confirmed_split
    from lm_eval_headloc.measurement.attribution import PRIOR_POINTS

    assert SIMULATED_POINTS == {"defaults": len(PRIOR_POINTS["atp-path"]),
                                "before": len(PRIOR_POINTS["atp"])}
    assert confirmed_split(54) == (12, 34)
    assert confirmed_split(54, "before") == (25, 25)
    assert confirmed_split(100) == (24, 68)  # round(92 * 12 / 46) = round(24.0)
    assert confirmed_split(30) == (6, 16)  # round(22 * 12 / 46) = round(5.74)
    # Without a prior there is no allowance, and the defaults put half on masks.
    assert confirmed_split(54, use_prior=False) == (27, 27)
    assert confirmed_split(47, use_prior=False) == (24, 23)  # round(23.5): to even, 24
    assert confirmed_split(54, "before", use_prior=False) == (27, 27)
    with pytest.raises(ValueError, match="method="):
        confirmed_split(54, "atp")


def _up_front(orders, count):
    """The old defaults' candidates, written out: the orders take turns, each naming its
    likeliest head not picked yet, until ``count`` heads are picked."""
    picked, turn = [], 0
    while len(picked) < count:
        order = orders[turn % len(orders)]
        turn += 1
        picked.append(next(int(h) for h in order if int(h) not in picked))
    return picked


@pytest.mark.parametrize("use_prior", [True, False])
def test_before_is_the_old_up_front_alternation(use_prior):
    """method="before": the prior's one ranking and the plain fit's take turns up front
    (nothing measured steers the picks, nothing is held fixed in the fit), and the
    top-5 are the picked heads most harmful first by their measured change."""
    from headloc_bench.defaults import (
        confirming_run_top,
        measured_alone,
        simulated_prior,
    )
    from lm_eval_headloc.method.confirm import prior_penalty_weights, screen

    for seed in range(4):
        trial = seed_trial(40, 0.1, seed, 12, world_options={"noise": "documents"})
        _, changes = measured_alone(trial.world, noise_seed=0)
        prior = simulated_prior(trial.world, np.random.default_rng(seed)) if use_prior \
            else None
        weights = None if prior is None else prior_penalty_weights(np.clip(-prior[0], 0,
                                                                           None))
        fit = screen(trial.design, trial.scores, True, penalty_weights=weights)
        plain = fit.order
        orders = [plain] if prior is None else [np.argsort(prior[0], kind="stable"), plain]
        for confirm in (3, 8, 15):
            picked = _up_front(orders, confirm)
            # Measured to hurt, by change; then the fit's harmful estimates; then
            # measured harmless; then the rest of the fit's order.
            measured = sorted(picked, key=lambda h: (changes[h], h))
            rest = [h for h in plain if h not in picked]
            by_hand = ([h for h in measured if changes[h] < 0]
                       + [h for h in rest if fit.effects[h] < 0]
                       + [h for h in measured if changes[h] >= 0]
                       + [h for h in rest if fit.effects[h] >= 0])
            found = confirming_run_top(trial.world, trial.design, trial.scores, prior,
                                       confirm, changes, method="before")
            assert list(found) == by_hand[:5]


def test_defaults_pick_in_rounds_with_the_fit_redone():
    """method="defaults" is confirm.confirmation with the prior's rankings and the screen
    refitted on what each round measured: with the measured changes fed back, its
    top-5 differs from "before"'s on some seed (the rounds matter), and a prior that
    names the planted heads at both points finds them at once."""
    from headloc_bench.defaults import (
        confirming_run_top,
        measured_alone,
        simulated_prior,
    )

    differs = 0
    for seed in range(8):
        trial = seed_trial(120, 0.1, seed, 10, world_options={"noise": "documents"})
        _, changes = measured_alone(trial.world, noise_seed=0)
        prior = simulated_prior(trial.world, np.random.default_rng(seed), points=2)
        tops = [confirming_run_top(trial.world, trial.design, trial.scores, prior, 20,
                                   changes, method=m) for m in ("defaults", "before")]
        differs += list(tops[0]) != list(tops[1])
        # Near-exact measurements: the planted heads are the exhaustive top-5.
        exact = seed_trial(120, 0.1, seed, 10, world_options={"n_examples": 10**7})
        _, changes = measured_alone(exact.world, noise_seed=0)
        perfect = simulated_prior(exact.world, np.random.default_rng(seed), noise=0.0,
                                  miss=0.0, points=2)
        found = confirming_run_top(exact.world, exact.design, exact.scores, perfect, 10,
                                   changes)
        assert list(found) == list(exact.world.planted)
    assert differs >= 1


def test_prior_points_draw_independent_misses():
    """Every point draws its own noise and its own false negatives (unless told to share
    point 0's); point 0 is the one-point prior's draw."""
    from headloc_bench.defaults import simulated_prior

    world = planted_world(400, np.random.default_rng(0), k_true=60,
                          planted_drops=(0.2, 0.45), tail_mass=2.0)
    all_missed = simulated_prior(world, np.random.default_rng(1), noise=0.0, miss=1.0,
                                 points=2)
    assert all_missed.shape == (2, 400)
    for point in all_missed:  # every planted head shrunk at both points, the rest exact
        np.testing.assert_allclose(point[world.planted], 0.02 * world.effects[world.planted])
        np.testing.assert_array_equal(np.delete(point, world.planted),
                                      np.delete(world.effects, world.planted))
    half = simulated_prior(world, np.random.default_rng(2), noise=0.0, miss=0.5, points=2)
    missed = [set(world.planted[np.isclose(point[world.planted],
                                           0.02 * world.effects[world.planted])].tolist())
              for point in half]
    assert all(15 <= len(m) <= 45 for m in missed)  # ~30 of 60 each
    assert missed[0] != missed[1]
    # Independent: about a quarter of the planted heads missed at both (15 expected).
    assert 5 <= len(missed[0] & missed[1]) <= 25
    shared = simulated_prior(world, np.random.default_rng(2), noise=0.0, miss=0.5, points=2,
                             shared_misses=True)
    np.testing.assert_array_equal(shared[0], half[0])  # the same draws, point 0's misses
    np.testing.assert_array_equal(shared[1], half[0])
    noisy = simulated_prior(world, np.random.default_rng(3), points=2)
    assert not np.allclose(noisy[0], noisy[1])  # their own noise too
    one = simulated_prior(world, np.random.default_rng(3))
    np.testing.assert_array_equal(one[0], noisy[0])
    with pytest.raises(ValueError, match="points=0"):
        simulated_prior(world, np.random.default_rng(3), points=0)


def _documents_by_hand(world, design):
    """Every document, every mask, one at a time: the module docstring's rule written out
    (right when it guesses or its logit plus its own steps of the heads out is above 0)."""
    docs = world.documents
    scores = []
    for mask in np.asarray(design, dtype=bool):
        right = 0
        for d in range(world.n_examples):
            logit = docs.logits[d] + sum(docs.steps[d, j] for j in np.flatnonzero(mask))
            right += bool(docs.guessed[d]) or logit > 0
        scores.append(right / world.n_examples)
    return np.array(scores)


def test_fixed_documents_give_the_same_score_to_the_same_mask_and_match_a_hand_count():
    world = planted_world(30, np.random.default_rng(5), noise="documents", n_examples=40)
    design = design_matrix("stratified", 12, 30, 0.1, 0)
    first = simulate_scores(world, design, np.random.default_rng(1))
    again = simulate_scores(world, design, np.random.default_rng(2))  # rng: nothing drawn
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(first, _documents_by_hand(world, design))
    # The effects are the binomial world's (the documents are drawn after them).
    binomial = planted_world(30, np.random.default_rng(5), n_examples=40)
    np.testing.assert_array_equal(world.effects, binomial.effects)
    np.testing.assert_array_equal(world.planted, binomial.planted)
    assert binomial.documents is None and world.params["noise"] == "documents"


def test_fixed_documents_single_knockouts_are_the_hand_count_of_each_head_alone():
    from headloc_bench.defaults import measured_alone

    world = planted_world(25, np.random.default_rng(6), noise="documents", n_examples=30)
    base, changes = measured_alone(world, noise_seed=0)
    again = measured_alone(world, noise_seed=99)  # the same documents: nothing is drawn
    assert base == again[0]
    np.testing.assert_array_equal(changes, again[1])
    by_hand = _documents_by_hand(world, np.vstack([np.zeros(25), np.eye(25)]))
    assert base == pytest.approx(by_hand[0])
    np.testing.assert_allclose(changes, by_hand[1:] - by_hand[0])


def test_alike_documents_average_to_the_logistic_accuracy():
    # heterogeneity 0: every document has the same steps, so over many documents the
    # share right is floor + (1 - floor) * expit(logit), the logistic world's accuracy.
    n = 40_000
    world = planted_world(50, np.random.default_rng(7), noise="documents", n_examples=n,
                          heterogeneity=0.0)
    design = design_matrix("stratified", 6, 50, 0.1, 1)
    expected = world.accuracy(design)
    tolerance = 4 * np.sqrt(expected * (1 - expected) / n)  # 4 s.e. of n documents
    assert np.all(np.abs(simulate_scores(world, design, None) - expected) <= tolerance)


def test_fixed_documents_refuse_what_they_cannot_model():
    rng = np.random.default_rng(0)
    with raises_naming(ValueError, "noise='documents'", "saturation='logistic'", "'clip'"):
        planted_world(20, rng, noise="documents", saturation="clip")
    with pytest.raises(ValueError, match="noise='poisson'"):
        planted_world(20, rng, noise="poisson")
    with pytest.raises(ValueError, match="heterogeneity=-1"):
        planted_world(20, rng, noise="documents", heterogeneity=-1)


def test_cli_refuses_fixed_documents_with_another_saturation(capsys):
    from headloc_bench import simulate_recovery as module

    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--saturation", "clip"])
    assert exit_info.value.code == 2
    assert_names(capsys.readouterr().err, "--noise documents", "--saturation logistic",
                 "(got clip)")
    assert module.parse_args(["--saturation", "clip", "--noise", "binomial"]).noise == "binomial"


def test_confirming_with_fixed_documents_measures_exactly_the_ground_truth():
    """With fixed documents a head confirmed alone is the exhaustive search's own
    measurement: confirming every head returns the exhaustive top-5 whatever the masks."""
    from headloc_bench.defaults import confirming_run_top, exhaustive_top, measured_alone

    trial = seed_trial(40, 0.1, seed=3, max_masks=10,
                       world_options={"noise": "documents"})
    _, changes = measured_alone(trial.world, noise_seed=0)
    by_hand = _documents_by_hand(trial.world, np.vstack([np.zeros(40), np.eye(40)]))
    truth = np.argsort(by_hand[1:] - by_hand[0], kind="stable")[:5]
    assert list(exhaustive_top(changes)) == list(truth)
    for method in ("defaults", "before"):
        top = confirming_run_top(trial.world, trial.design, trial.scores, None, 40,
                                 changes, method=method)
        assert list(top) == list(truth)


def test_grouped_run_without_group_tests_is_the_confirming_run():
    from headloc_bench.defaults import (
        confirming_run_top,
        grouped_run_top,
        measured_alone,
        simulated_prior,
    )

    trial = seed_trial(120, 0.1, 3, 12, world_options={"noise": "documents"})
    changes = measured_alone(trial.world, 5)[1]
    prior = simulated_prior(trial.world, np.random.default_rng(1), points=2)
    plain = confirming_run_top(trial.world, trial.design, trial.scores, prior, 15, changes)
    grouped = grouped_run_top(trial.world, trial.design, trial.scores, prior, 15, 0, changes)
    assert list(grouped) == list(plain)


def test_the_simulated_defaults_are_the_packages_defaults():
    """The simulator's split and prior allowance must be the real defaults' (RunSpec's
    --masks and --confirm after the allowance of the prior --prior auto resolves to) and
    the recovery benchmark's, at every budget, or SIMULATION.md and RECOVERY.md describe
    another method than the package runs."""
    from headloc_bench import bench_recovery as bench
    from headloc_bench.defaults import METHOD_PRIOR, confirmed_split
    from lm_eval_headloc.method.budget import DEFAULT_BUDGET, PRIOR_ALLOWANCE, budget_split
    from lm_eval_headloc.runs.spec import RunSpec

    assert RunSpec().prior == "auto" and METHOD_PRIOR == {"defaults": "atp-path",
                                                          "before": "atp"}
    # The default budget is the prior's allowance, the masks and the heads alone: a run
    # with atp-path's prior, and one without a prior, as the simulator splits them.
    defaults = RunSpec().budgeted("atp-path")
    assert DEFAULT_BUDGET == PRIOR_ALLOWANCE["atp-path"] + defaults.masks + defaults.confirm
    assert confirmed_split(DEFAULT_BUDGET) == (defaults.masks, defaults.confirm)
    without = RunSpec().budgeted(None)
    assert DEFAULT_BUDGET == without.masks + without.confirm
    assert confirmed_split(DEFAULT_BUDGET, use_prior=False) == (without.masks, without.confirm)
    methods = {m.name: m for m in bench.METHODS}
    assert methods["default"].allowance == PRIOR_ALLOWANCE[METHOD_PRIOR["defaults"]] == 8
    assert methods["default-before"].allowance == PRIOR_ALLOWANCE[METHOD_PRIOR["before"]] == 4
    for budget in range(10, 400):
        assert (confirmed_split(budget) == budget_split(budget)
                == methods["default"].split(budget)[:2]), budget
        assert confirmed_split(budget, "before") == \
            methods["default-before"].split(budget)[:2]
        assert methods["default"].split(budget)[2] == 0  # the defaults: no group tests
        # The group-test variant: the defaults' masks, their heads-alone part shared.
        masks, alone, groups = methods["default-groups"].split(budget)
        assert (masks, alone + groups) == budget_split(budget), budget
        assert groups == round(budget_split(budget)[1] * 10 / 34), budget


def _run_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter started in benchmarks/ (headloc_bench importable)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)


def test_the_simulator_runs_without_torch():
    """The simulator (a confirming run with a two-point prior included) is numpy and the
    package's numpy modules: no torch, transformers or lm-eval."""
    done = _run_python(
        "import sys\n"
        "import numpy as np\n"
        "from headloc_bench.defaults import (confirming_run_top, measured_alone,\n"
        "    simulated_prior)\n"
        "from headloc_bench.simulation import seed_trial\n"
        "trial = seed_trial(40, 0.1, 0, 12)\n"
        "_, changes = measured_alone(trial.world, 0)\n"
        "prior = simulated_prior(trial.world, np.random.default_rng(0), points=2)\n"
        "for method in ('defaults', 'before'):\n"
        "    confirming_run_top(trial.world, trial.design, trial.scores, prior, 8, changes,\n"
        "                       method=method)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules))\n")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
