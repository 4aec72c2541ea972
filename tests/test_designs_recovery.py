"""Design matrices and Lasso recovery, checked on simulated measurements (no model).

The simulation stands in for "evaluate the model with these heads knocked out": an
accuracy-like score with baseline 0.6, five planted task heads costing 0.1–0.3 each,
every other head a small random effect that on average hurts a little, a few pairwise
interactions (two heads knocked out together cost extra, one pair among the planted
heads) and Gaussian measurement noise. Recovery counts are over fixed seeds, so the
assertions are deterministic. Their bars are not the rates observed: the Lasso must beat
two estimators computed here with numpy on the same measurements (difference of means,
least squares), the stratified design must beat the Bernoulli one (the paper's claim),
and absolute bars follow from the signal-to-noise argument written next to each.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
from helpers import raises_naming
from sklearn.utils.estimator_checks import parametrize_with_checks

from lm_eval_headloc.common.options import DESIGNS
from lm_eval_headloc.intervention.components import Head
from lm_eval_headloc.method.designs import column_counts, design_matrix, knockouts_per_mask
from lm_eval_headloc.method.lasso import HeadLasso, harm

LAYERS, HEADS_PER_LAYER = 30, 9  # the embedded SmolLM2: 270 heads
NUM_HEADS = LAYERS * HEADS_PER_LAYER
SEEDS = range(20)


class World(NamedTuple):
    effects: np.ndarray  # additive change of the score per knocked-out head
    planted: set[int]
    baseline: float
    pairs: list[tuple[int, int]]
    noise: float
    rng: np.random.Generator

    def measure(self, knocked_out: np.ndarray) -> np.ndarray:
        knocked = np.asarray(knocked_out, dtype=float)
        score = self.baseline + knocked @ self.effects
        for first, second in self.pairs:
            score -= 0.05 * knocked[:, first] * knocked[:, second]
        score += self.rng.normal(0.0, self.noise, knocked.shape[0])
        return np.clip(score, 0.0, 1.0)


def simulated_world(
    seed: int, total_heads: int = NUM_HEADS, noise: float = 0.02, small: float = 0.005,
    net_harm: float = 0.005,
) -> World:
    rng = np.random.default_rng(10_000 + seed)
    effects = rng.normal(0.0, small, total_heads) - net_harm * np.abs(rng.normal(size=total_heads))
    planted = rng.choice(total_heads, 5, replace=False)
    effects[planted] = -np.linspace(0.1, 0.3, 5)
    pairs = [tuple(int(j) for j in rng.choice(total_heads, 2, replace=False)) for _ in range(3)]
    pairs.append((int(planted[0]), int(planted[1])))
    return World(effects, set(planted.tolist()), 0.6, pairs, noise, rng)


def planted_in_top5(
    kind: str, masks: int, sparsity: float, seed: int, total_heads: int = NUM_HEADS,
    with_baseline: bool = False, **world_options: float,
) -> int:
    world = simulated_world(seed, total_heads, **world_options)
    knocked_out = design_matrix(kind, masks, total_heads, sparsity, seed)
    model = HeadLasso(baseline=world.baseline if with_baseline else None).fit(
        knocked_out, world.measure(knocked_out))
    return len(set(model.ranking()[:5].tolist()) & world.planted)


def planted_found_by_each_estimator(
    kind: str, masks: int, sparsity: float, seed: int
) -> dict[str, int]:
    """Planted heads in the top 5 of the Lasso and of two numpy estimators, same data.

    "difference of means": a head's effect is the mean score of the masks that knock it
    out minus that of the masks that do not (what one would do without a regression).
    "least squares": the minimum-norm solution of y = c + A·β (``np.linalg.lstsq``).
    Compressed sensing is worth its Lasso only if it beats both.
    """
    world = simulated_world(seed)
    knocked_out = design_matrix(kind, masks, NUM_HEADS, sparsity, seed)
    scores = world.measure(knocked_out)
    lasso = HeadLasso().fit(knocked_out, scores).ranking()
    ones = knocked_out.astype(float)
    times = ones.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        difference = ones.T @ scores / times - (1 - ones).T @ scores / (masks - times)
    difference = np.where(times > 0, difference, 0.0)  # never knocked out: no evidence
    with_intercept = np.column_stack([np.ones(masks), ones])
    least_squares = np.linalg.lstsq(with_intercept, scores, rcond=None)[0][1:]
    rankings = {"lasso": lasso, "difference of means": np.argsort(difference, kind="stable"),
                "least squares": np.argsort(least_squares, kind="stable")}
    return {name: len(set(order[:5].tolist()) & world.planted)
            for name, order in rankings.items()}


# ----------------------------------------------------------------------------- designs


@pytest.mark.parametrize("kind", DESIGNS)
def test_design_is_a_bool_matrix_fixed_by_the_seed(kind):
    first = design_matrix(kind, 50, 40, 0.1, seed=7)
    assert first.shape == (50, 40)
    assert first.dtype == bool
    assert np.array_equal(first, design_matrix(kind, 50, 40, 0.1, seed=7))
    assert not np.array_equal(first, design_matrix(kind, 50, 40, 0.1, seed=8))


@pytest.mark.parametrize("kind", DESIGNS)
def test_never_ablate_columns_stay_false(kind):
    never = [0, 5, 39]
    matrix = design_matrix(kind, 200, 40, 0.3, seed=1, never_ablate=never)
    assert not matrix[:, never].any()
    eligible = np.setdiff1d(np.arange(40), never)
    assert matrix[:, eligible].any(axis=0).all()


@pytest.mark.parametrize(
    "masks, heads, sparsity",
    [(100, 270, 0.02), (100, 1024, 0.02), (7, 10, 0.3), (13, 11, 0.5), (3, 270, 0.05)],
)
def test_stratified_masks_have_k_heads_and_balanced_columns(masks, heads, sparsity):
    matrix = design_matrix("stratified", masks, heads, sparsity, seed=3)
    k = max(1, round(sparsity * heads))
    assert (matrix.sum(axis=1) == k).all()
    counts = column_counts(matrix)
    assert counts.max() - counts.min() <= 1
    assert counts.sum() == masks * k


def test_stratified_k_is_over_eligible_heads_and_at_least_one():
    never = [1, 2, 3]
    matrix = design_matrix("stratified", 9, 10, 0.3, seed=0, never_ablate=never)
    assert (matrix.sum(axis=1) == 2).all()  # round(0.3 * 7), not round(0.3 * 10)
    counts = column_counts(matrix)[np.setdiff1d(np.arange(10), never)]
    assert counts.max() - counts.min() <= 1
    assert knockouts_per_mask(0.001, 50) == 1
    assert (design_matrix("stratified", 4, 50, 0.001, seed=0).sum(axis=1) == 1).all()


def test_bernoulli_rate_matches_sparsity():
    matrix = design_matrix("bernoulli", 2000, 500, 0.02, seed=11, never_ablate=range(100))
    assert not matrix[:, :100].any()
    # The rate over 800,000 eligible draws has a standard error of 1.6e-4.
    assert abs(matrix[:, 100:].mean() - 0.02) < 1e-3
    counts = column_counts(matrix[:, 100:])
    assert counts.max() - counts.min() > 1  # unlike stratified, columns vary by chance


@pytest.mark.parametrize(
    "kwargs, values",
    [  # the bad value and, where the message gives it, what is allowed
        (dict(kind="random"), ("'random'", "bernoulli, stratified")),
        (dict(num_masks=0), ("num_masks=0",)),
        (dict(num_masks=2.5), ("num_masks=2.5",)),
        (dict(total_heads=0), ("total_heads=0",)),
        (dict(sparsity=0.0), ("sparsity=0.0", "0 and 1")),
        (dict(sparsity=1.0), ("sparsity=1.0",)),
        (dict(sparsity=-0.1), ("sparsity=-0.1",)),
        (dict(sparsity=float("nan")), ("sparsity=nan",)),
        (dict(seed=-1), ("seed=-1",)),
        (dict(num_masks=True), ("num_masks=True",)),
        (dict(sparsity=np.float64(np.inf)), ("sparsity=", "inf")),
        (dict(never_ablate=[10]), ("never_ablate", "10", "0..9")),
        (dict(never_ablate=range(10)), ("never_ablate", "10 heads")),
        (dict(never_ablate=3), ("never_ablate=3", "0..9")),
        (dict(never_ablate="L0H1"), ("never_ablate='L0H1'", "0..9")),
    ],
)
def test_design_validation_errors_are_one_line_and_name_the_value(kwargs, values):
    arguments = dict(kind="stratified", num_masks=5, total_heads=10, sparsity=0.2, seed=0)
    arguments.update(kwargs)
    with raises_naming(ValueError, *values) as error:
        design_matrix(**arguments)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------- recovery


def test_fit_returns_self_and_coef_is_in_score_units():
    knocked_out = design_matrix("bernoulli", 200, 40, 0.1, seed=0)
    scores = 0.6 - 0.2 * knocked_out[:, 7]
    model = HeadLasso()
    assert model.fit(knocked_out, scores) is model
    assert model.coef_.shape == (40,)
    assert model.coef_[7] == pytest.approx(-0.2, abs=0.02)
    assert np.abs(np.delete(model.coef_, 7)).max() < 0.01
    assert model.intercept_ == pytest.approx(0.6, abs=0.02)
    assert (model.n_measurements_, model.n_features_in_) == (200, 40)
    # Scores are 0.6 or 0.4, the latter in a fraction q of the masks: the population
    # standard deviation is 0.2·sqrt(q(1 − q)) (a sample one, ddof=1, would differ).
    q = knocked_out[:, 7].mean()
    assert 0.05 < q < 0.15
    assert model.scale_ == pytest.approx(0.2 * np.sqrt(q * (1 - q)), rel=1e-12)
    # The same scores in percent give the same fit in percent: alpha means the same.
    percent = HeadLasso().fit(knocked_out, 100 * scores)
    assert np.allclose(percent.coef_, 100 * model.coef_)
    pinned = HeadLasso(baseline=0.6).fit(knocked_out, scores)
    assert pinned.intercept_ == 0.6
    assert pinned.coef_[7] == pytest.approx(-0.2, abs=0.02)


def _soft_threshold(value: float, alpha: float) -> float:
    return float(np.sign(value) * max(abs(value) - alpha, 0.0))


@pytest.mark.parametrize("baseline, alpha", [(None, 0.01), (0.6, 0.01), (None, 5.0)])
def test_one_head_fit_is_the_closed_form_lasso(baseline, alpha):
    # With one column, sklearn's Lasso objective (1/2n)·|z − c − w·x|² + alpha·|w| on the
    # standardised scores z = (y − offset)/s is minimised by a soft threshold:
    # w = S(mean(x̃·z̃), alpha) / mean(x̃²), with x̃, z̃ centred when the intercept is
    # fitted and left alone (c = 0, offset = y0) when the baseline is pinned. Worked out
    # by hand here, it checks standardising, units, intercept, predict and R² at once.
    rng = np.random.default_rng(0)
    x = np.arange(40) % 4 == 0  # head knocked out in 10 of the 40 measurements
    scores = 0.6 - 0.2 * x + rng.normal(0.0, 0.05, 40)
    s = np.sqrt(np.mean((scores - scores.mean()) ** 2))
    z = (scores - (0.0 if baseline is None else baseline)) / s
    if baseline is None:
        x_c, z_c = x - x.mean(), z - z.mean()
        effect = s * _soft_threshold(np.mean(x_c * z_c), alpha) / np.mean(x_c**2)
        intercept = scores.mean() - effect * x.mean()
    else:
        effect = s * _soft_threshold(np.mean(x * z), alpha) / np.mean(x**2)
        intercept = baseline
    predicted = intercept + effect * x
    r2 = 1 - np.sum((scores - predicted) ** 2) / np.sum((scores - scores.mean()) ** 2)

    model = HeadLasso(alpha=alpha, baseline=baseline).fit(x[:, None], scores)
    assert model.coef_[0] == pytest.approx(effect, rel=1e-9, abs=1e-12)
    assert model.intercept_ == pytest.approx(intercept, rel=1e-9)
    assert model.predict(x[:, None]) == pytest.approx(predicted, rel=1e-9)
    assert model.r2_ == pytest.approx(r2, rel=1e-9, abs=1e-12)
    assert model.score(x[:, None], scores) == pytest.approx(r2, rel=1e-9, abs=1e-12)
    if alpha == 5.0:  # the threshold exceeds the correlation: no effect, mean intercept
        assert (effect, model.r2_) == (0.0, pytest.approx(0.0, abs=1e-12))


def test_noiseless_additive_world_is_predicted_on_masks_never_fitted():
    world = simulated_world(0, noise=0.0, small=0.0, net_harm=0.0)._replace(pairs=[])
    knocked_out = design_matrix("stratified", 200, NUM_HEADS, 0.02, seed=0)
    model = HeadLasso().fit(knocked_out, world.measure(knocked_out))
    # No noise and no interactions: what the fit misses is the L1 penalty's shrinkage.
    assert model.r2_ > 0.95
    assert set(model.ranking()[:5].tolist()) == world.planted
    # Fresh masks (another seed) against the world's true scores. The penalty pulls each
    # effect towards 0 by about alpha·scale_/var(column), the one-column soft threshold
    # above; a prediction may be off by that much per planted head it knocks out, plus
    # the intercept's share (half of it, generously).
    fresh = design_matrix("stratified", 200, NUM_HEADS, 0.02, seed=99)
    truth = world.baseline + fresh @ world.effects
    shrinkage = 0.01 * model.scale_ / knocked_out.var(axis=0).min()
    planted_out = fresh[:, sorted(world.planted)].sum(axis=1)
    assert planted_out.max() >= 1  # the fresh masks do exercise the planted heads
    error = np.abs(model.predict(fresh) - truth)
    assert (error <= shrinkage * (planted_out + 0.5)).all(), error.max()
    assert model.predict(np.zeros((1, NUM_HEADS)))[0] == pytest.approx(0.6, abs=shrinkage / 2)


@pytest.mark.parametrize("value", [0.25, 0.1, 0.57, 12.3])
def test_constant_scores_fit_to_no_effects(value):
    # 0.25 is exact in binary; the mean of thirty 0.1s is not 0.1, a round-off spread
    # that must count as "no variation" for both the scale and R².
    knocked_out = design_matrix("bernoulli", 30, 12, 0.2, seed=0)
    model = HeadLasso().fit(knocked_out, np.full(30, value))
    assert model.scale_ == 1.0
    assert not model.coef_.any()
    assert model.intercept_ == pytest.approx(value)
    assert model.r2_ == 1.0  # fitted exactly (sklearn's convention for constant scores)
    assert model.ranking().tolist() == list(range(12))  # ties keep index order
    # Pinned to a baseline they do not reach, constant scores are not fitted: R² 0.
    assert HeadLasso(baseline=value + 1).fit(knocked_out, np.full(30, value)).r2_ == 0.0


RECOVERY_SETTINGS = [(100, 0.02), (200, 0.02), (100, 0.05)]


@pytest.mark.parametrize("masks, sparsity", RECOVERY_SETTINGS)
def test_stratified_recovers_the_planted_heads(masks, sparsity):
    found = [planted_found_by_each_estimator("stratified", masks, sparsity, seed)
             for seed in SEEDS]
    lasso = [f["lasso"] for f in found]
    for other in ("difference of means", "least squares"):
        assert sum(lasso) > sum(f[other] for f in found), (other, found)
    # Signal to noise: the weakest planted effect (0.1) is 3.5-4.5 sds of one measurement's
    # noise plus the small effects of the other heads in its mask, and stratified columns
    # differ by at most one knockout. With 3.7 or more knockouts per head (200 masks at
    # 0.02, 100 at 0.05) it is ~8 standard errors: a miss is a many-sigma event, so all
    # five must be found in at least 18 of 20 seeds. With 100 masks at 0.02 (1.85 per
    # head) ~15% of heads are knocked out only once, maybe together with another planted
    # head: 0.75 planted heads per seed, so "at least four" is the bar there.
    per_head = masks * knockouts_per_mask(sparsity, NUM_HEADS) / NUM_HEADS
    bar = 5 if per_head >= 3 else 4
    assert sum(h >= bar for h in lasso) >= 18, (per_head, lasso)


@pytest.mark.parametrize("masks, sparsity", RECOVERY_SETTINGS)
def test_bernoulli_recovers_most_planted_heads_but_fewer_than_stratified(masks, sparsity):
    found = [planted_found_by_each_estimator("bernoulli", masks, sparsity, seed)
             for seed in SEEDS]
    lasso = sum(f["lasso"] for f in found)
    for other in ("difference of means", "least squares"):
        assert lasso > sum(f[other] for f in found), (other, found)
    assert lasso > 50  # "most": more than half of the 100 planted heads over 20 seeds
    # The paper's reason for the stratified default, on the same worlds and budget.
    stratified = sum(planted_in_top5("stratified", masks, sparsity, seed) for seed in SEEDS)
    assert stratified >= lasso


def test_stratified_beats_bernoulli_on_a_1024_head_model():
    # Llama-3.1-8B size; 200 masks at p = 0.02 knock out 20 heads each.
    stratified = [planted_in_top5("stratified", 200, 0.02, s, total_heads=1024) for s in SEEDS]
    bernoulli = [planted_in_top5("bernoulli", 200, 0.02, s, total_heads=1024) for s in SEEDS]
    assert sum(stratified) > sum(bernoulli)
    # 3.9 knockouts per head: the well-sampled bar of the 270-head test above.
    assert sum(h == 5 for h in stratified) >= 18, stratified


def test_fitted_intercept_ranks_better_than_a_pinned_baseline():
    # Why baseline=None (fit the intercept) is the default: when unimportant heads hurt a
    # little on average, pinning y0 pushes their summed cost into the head effects and
    # the ranking suffers; the fitted intercept absorbs it. Worst with many heads per
    # mask (1,024 heads at p = 0.05: 51 per mask).
    settings = [
        ("bernoulli", 200, 0.02, NUM_HEADS), ("bernoulli", 100, 0.05, NUM_HEADS),
        ("stratified", 100, 0.05, NUM_HEADS), ("stratified", 100, 0.05, 1024),
    ]
    for kind, masks, sparsity, total_heads in settings:
        fitted = pinned = 0
        for seed in SEEDS:
            fitted += planted_in_top5(kind, masks, sparsity, seed, total_heads, net_harm=0.01)
            pinned += planted_in_top5(kind, masks, sparsity, seed, total_heads, net_harm=0.01,
                                      with_baseline=True)
        assert fitted >= pinned, (kind, masks, sparsity, total_heads)
        if total_heads == 1024:
            # The docstring's claim: the pinned fit loses the planted heads, the fitted
            # intercept keeps most of them (of 100 planted heads in all).
            assert fitted > 50 >= pinned, (fitted, pinned)


def test_lower_is_better_scores_rank_the_heads_that_raise_the_score():
    rng = np.random.default_rng(5)
    planted = [3, 40, 41, 100, 250]
    effects = rng.normal(0.0, 0.05, NUM_HEADS)
    effects[planted] = [2.0, 3.0, 4.0, 5.0, 6.0]  # perplexity points added by a knockout
    knocked_out = design_matrix("stratified", 200, NUM_HEADS, 0.02, seed=5)
    perplexity = 12.0 + knocked_out @ effects + rng.normal(0.0, 0.3, 200)
    model = HeadLasso().fit(knocked_out, perplexity)
    assert model.ranking(higher_is_better=False)[:5].tolist() == planted[::-1]
    assert set(model.ranking(higher_is_better=True)[-5:].tolist()) == set(planted)
    top = model.top_heads(3, HEADS_PER_LAYER, higher_is_better=False, exclude=[250])
    assert top == [Head(11, 1), Head(4, 5), Head(4, 4)]  # columns 100, 41, 40


def test_harm_is_positive_when_a_knockout_hurts():
    assert harm([-0.2, 0.0, 0.1], higher_is_better=True).tolist() == [0.2, 0.0, -0.1]
    assert harm([3.0, -1.0], higher_is_better=False).tolist() == [3.0, -1.0]  # perplexity


def test_ranking_orders_by_harm_stably_and_excludes():
    model = HeadLasso().fit(np.eye(5, dtype=bool), np.arange(5.0))
    model.coef_ = np.array([0.0, -1.0, 0.0, -1.0, 2.0])
    assert model.ranking().tolist() == [1, 3, 0, 2, 4]
    assert model.ranking(higher_is_better=False).tolist() == [4, 0, 2, 1, 3]
    assert model.ranking(exclude=[3, 0]).tolist() == [1, 2, 4]
    assert model.top_heads(2, 1) == [Head(1, 0), Head(3, 0)]
    # A hybrid's design: columns for layers 3 and 7's heads only (2 each), layer by layer.
    model.coef_ = np.array([0.0, -1.0, -2.0, 0.0])
    assert model.top_heads(2, 2, head_layers=(3, 7)) == [Head(7, 0), Head(3, 1)]
    with raises_naming(ValueError, "head_layers=(3,)", "2 heads", "4"):
        model.top_heads(2, 2, head_layers=(3,))


def _fitted() -> HeadLasso:
    return HeadLasso().fit(design_matrix("bernoulli", 20, 6, 0.3, seed=0), np.linspace(0, 1, 20))


@pytest.mark.parametrize(
    "call, values",
    [
        # sklearn's validation (validate_data), first line plus the shapes passed
        (lambda: HeadLasso().fit(np.zeros((5, 3)), np.zeros(4)), ("[5, 4]", "(5, 3)", "(4,)")),
        (lambda: HeadLasso().fit(np.zeros(5), np.zeros(5)), ("2D", "design matrix", "(5,)")),
        (lambda: HeadLasso().fit(np.zeros((3, 2)), [0.1, float("nan"), 0.2]),
         ("NaN", "scores")),
        (lambda: HeadLasso().fit(np.zeros((3, 2)), ["0.1", "nan", "0.2"]), ("NaN",)),
        (lambda: HeadLasso().fit(np.zeros((3, 2)), ["a", "b", "c"]), ("'a'",)),
        (lambda: HeadLasso().fit(np.full((3, 2), np.inf), np.zeros(3)),
         ("infinity", "design matrix")),
        (lambda: HeadLasso().fit(np.zeros((1, 2)), [0.1]), ("1 sample", "2")),
        (lambda: _fitted().predict(np.zeros((2, 5))), ("5 features", "6")),
        # parameters (check_number)
        (lambda: HeadLasso(alpha=0).fit(np.zeros((2, 2)), [0, 1]), ("alpha=0", "> 0")),
        (lambda: HeadLasso(alpha=float("nan")).fit(np.zeros((2, 2)), [0, 1]), ("alpha=nan",)),
        (lambda: HeadLasso(max_iter=0).fit(np.zeros((2, 2)), [0, 1]), ("max_iter=0",)),
        (lambda: HeadLasso(standardize="False").fit(np.zeros((2, 2)), [0, 1]),
         ("standardize='False'",)),
        (lambda: HeadLasso(baseline="high").fit(np.zeros((2, 2)), [0, 1]),
         ("baseline='high'",)),
        (lambda: _fitted().ranking(exclude=[6]), ("exclude index 6", "0..5")),
        (lambda: _fitted().top_heads(7, 3), ("k=7", "1 <= value <= 6")),
        (lambda: _fitted().top_heads(1, 6, exclude=range(6)), ("k=1", "<= 0")),
        (lambda: _fitted().top_heads(2, True), ("heads_per_layer=True",)),
        (lambda: _fitted().top_heads(2, 4), ("heads_per_layer=4", "6")),
        # named, not numpy's "could not convert string to float" / "invalid literal for int"
        (lambda: HeadLasso(penalty_weights="abc").fit(np.zeros((2, 2)), [0, 1]),
         ("penalty_weights", "2", "'abc'")),
        (lambda: _fitted().top_heads(2, 2, head_layers=["a", "b", "c"]),
         ("head_layers[0]='a'", ">= 0")),
        (lambda: _fitted().top_heads(2, 2, head_layers=[0, -1, 2]),
         ("head_layers[1]=-1", ">= 0")),
        (lambda: _fitted().top_heads(2, 2, head_layers=3), ("head_layers=3",)),
        # sklearn's own check_fit2d_predict1d looks for "Reshape your data".
        (lambda: _fitted().predict(np.zeros(6)), ("2D", "Reshape your data", "(6,)")),
    ],
)
def test_recovery_errors_are_one_line_and_name_the_value(call, values):
    with raises_naming(ValueError, *values) as error:
        call()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("value", ["False", None, 0, 1, "yes"])
def test_higher_is_better_must_be_a_bool(value):
    # "False" (truthy) used to rank as higher-is-better; None as lower-is-better.
    from lm_eval_headloc.method.lasso import bootstrap_stability

    model = _fitted()
    for call in (lambda: model.ranking(higher_is_better=value),
                 lambda: model.top_heads(2, 3, higher_is_better=value),
                 lambda: bootstrap_stability(HeadLasso(), np.eye(3), np.arange(3.0), 1,
                                             higher_is_better=value, resamples=1)):
        with raises_naming(ValueError, f"higher_is_better={value!r}", "True or False"):
            call()


def test_higher_is_better_takes_numpy_bools():
    model = _fitted()
    for flag in (True, False):
        assert model.ranking(np.bool_(flag)).tolist() == model.ranking(flag).tolist()
        assert model.top_heads(2, 3, np.bool_(flag)) == model.top_heads(2, 3, flag)


def _fitted_state(model: HeadLasso) -> dict[str, object]:
    return {k: v for k, v in vars(model).items() if k.endswith("_") and not k.startswith("_")}


# The refusal names the parameter, what it holds (12 weights, column 11) and what 8 heads
# allow.
@pytest.mark.parametrize("parameters, named", [
    (dict(penalty_weights=np.ones(12)), ("penalty_weights", "need 8", "shape (12,)")),
    (dict(fixed_effects={11: -0.1}), ("fixed_effects column=11", "<= 7")),
])
def test_a_failed_refit_leaves_the_fit_as_it_was(parameters, named):
    # The refit on 8 heads fails on a 12-head parameter; it used to leave n_features_in_ = 8
    # beside a 12-entry coef_, so predict failed in a matrix product.
    rng = np.random.default_rng(1)
    twelve, eight = rng.random((10, 12)) < 0.3, rng.random((10, 8)) < 0.3
    scores = rng.random(10)
    model = HeadLasso(**parameters).fit(twelve, scores)
    before = _fitted_state(model)
    predicted = model.predict(twelve)
    with raises_naming(ValueError, *named):
        model.fit(eight, scores)
    after = _fitted_state(model)
    assert after.keys() == before.keys() and model.n_features_in_ == 12
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value)
    np.testing.assert_array_equal(model.predict(twelve), predicted)
    # A first fit that fails leaves the estimator unfitted.
    from sklearn.exceptions import NotFittedError

    fresh = HeadLasso(**parameters)
    with pytest.raises(ValueError):
        fresh.fit(eight, scores)
    assert _fitted_state(fresh) == {}
    with pytest.raises(NotFittedError):
        fresh.predict(eight)


def test_a_refit_failing_sklearn_validation_keeps_the_feature_names():
    pandas = pytest.importorskip("pandas")
    knocked_out = pandas.DataFrame(np.eye(4, dtype=bool), columns=["a", "b", "c", "d"])
    model = HeadLasso().fit(knocked_out, np.arange(4.0))
    with pytest.raises(ValueError, match="y contains NaN"):
        model.fit(np.eye(4), [0.0, float("nan"), 1.0, 2.0])
    assert model.feature_names_in_.tolist() == ["a", "b", "c", "d"]
    # A successful refit on a plain array drops them, as sklearn's own estimators do.
    model.fit(np.eye(3), np.arange(3.0))
    assert not hasattr(model, "feature_names_in_") and model.n_features_in_ == 3


def test_sklearn_check_fit2d_predict1d_passes():
    from sklearn.utils.estimator_checks import check_fit2d_predict1d

    check_fit2d_predict1d("HeadLasso", HeadLasso())


# --------------------------------------------------------------------------- bootstrap

def _bootstrap_by_hand(knocked_out, scores, top_k, resamples, seed, alpha=0.01,
                       baseline=None):
    """A second implementation: sklearn's Lasso on standardised resampled scores,
    the top-k by most negative coefficient, counted with plain numpy. ``baseline``: the
    unablated score each refit is pinned to (no intercept), as ``HeadLasso.fit``'s."""
    from sklearn.linear_model import Lasso

    rng = np.random.default_rng(seed)
    rows, total = knocked_out.shape
    chosen = np.zeros(total)
    coefs = []
    for _ in range(resamples):
        pick = rng.integers(0, rows, size=rows)
        y = scores[pick]
        spread = y.std()
        scale = spread if spread > 1e-12 * max(1.0, np.abs(y).max()) else 1.0
        offset = 0.0 if baseline is None else baseline
        coef = Lasso(alpha=alpha, max_iter=10000, fit_intercept=baseline is None).fit(
            knocked_out[pick].astype(float), (y - offset) / scale).coef_ * scale
        coefs.append(coef)
        top = np.argsort(coef, kind="stable")[:top_k]
        chosen[top[coef[top] < 0]] += 1  # only heads whose knockout hurts
    return chosen / resamples, np.percentile(coefs, [2.5, 97.5], axis=0)


def test_bootstrap_stability_equals_a_hand_written_bootstrap():
    from lm_eval_headloc.method.lasso import bootstrap_stability

    world = simulated_world(3)
    knocked_out = design_matrix("stratified", 60, NUM_HEADS, 0.05, 3)
    scores = world.measure(knocked_out)
    stability = bootstrap_stability(HeadLasso(), knocked_out, scores, 5, resamples=40, seed=7)
    selected, (low, high) = _bootstrap_by_hand(knocked_out, scores, 5, 40, 7)
    assert stability.resamples == 40
    np.testing.assert_allclose(stability.selected, selected)
    np.testing.assert_allclose(stability.low, low, atol=1e-9)
    np.testing.assert_allclose(stability.high, high, atol=1e-9)
    # Each refit puts at most five heads in its top-5.
    assert 4 < stability.selected.sum() <= 5
    again = bootstrap_stability(HeadLasso(), knocked_out, scores, 5, resamples=40, seed=7)
    np.testing.assert_array_equal(again.selected, stability.selected)


def test_bootstrap_of_a_pinned_fit_refits_pinned_to_its_baseline():
    # Unimportant heads that cost a little on average (net_harm) are what the intercept
    # absorbs and a pinned baseline must explain with head effects: the two models select
    # differently here, so a bootstrap that dropped the baseline could not pass.
    from lm_eval_headloc.method.lasso import bootstrap_stability

    world = simulated_world(6, net_harm=0.02)
    knocked_out = design_matrix("stratified", 40, NUM_HEADS, 0.05, 6)
    scores = world.measure(knocked_out)
    pinned_by_hand = _bootstrap_by_hand(knocked_out, scores, 5, 30, 1, baseline=world.baseline)
    free_by_hand = _bootstrap_by_hand(knocked_out, scores, 5, 30, 1)
    assert not np.allclose(pinned_by_hand[0], free_by_hand[0])
    for baseline, (selected, (low, high)) in ((world.baseline, pinned_by_hand),
                                              (None, free_by_hand)):
        fitted = HeadLasso(baseline=baseline).fit(knocked_out, scores)
        stability = bootstrap_stability(fitted, knocked_out, scores, 5, resamples=30, seed=1)
        np.testing.assert_allclose(stability.selected, selected)
        np.testing.assert_allclose(stability.low, low, atol=1e-9)
        np.testing.assert_allclose(stability.high, high, atol=1e-9)


def test_bootstrap_is_sure_of_strong_heads_and_unsure_with_few_measurements():
    from lm_eval_headloc.method.lasso import bootstrap_stability

    world = simulated_world(5, noise=0.005, small=0.001, net_harm=0.0)
    strongest = sorted(world.planted, key=lambda j: world.effects[j])[:3]
    many = design_matrix("stratified", 300, NUM_HEADS, 0.05, 5)
    scores = world.measure(many)
    sure = bootstrap_stability(HeadLasso(), many, scores, 3, resamples=30)
    assert all(sure.selected[j] >= 0.9 for j in strongest)
    # The interval is the Lasso estimate's: around the full fit's (shrunk) effect.
    fitted = HeadLasso().fit(many, scores).coef_
    assert all(sure.low[j] < fitted[j] < sure.high[j] for j in strongest)
    few = design_matrix("stratified", 12, NUM_HEADS, 0.05, 5)
    unsure = bootstrap_stability(HeadLasso(), few, world.measure(few), 3, resamples=30)
    assert min(unsure.selected[j] for j in strongest) < 0.9


def test_bootstrap_ranks_lower_is_better_scores_by_their_rise_and_skips_excluded():
    from lm_eval_headloc.method.lasso import bootstrap_stability

    world = simulated_world(2, noise=0.005)
    knocked_out = design_matrix("stratified", 120, NUM_HEADS, 0.05, 2)
    scores = world.measure(knocked_out)
    top = max(world.planted, key=lambda j: -world.effects[j])
    flipped = bootstrap_stability(HeadLasso(), knocked_out, -scores, 5,
                                  higher_is_better=False, resamples=20)
    plain = bootstrap_stability(HeadLasso(), knocked_out, scores, 5, resamples=20)
    np.testing.assert_allclose(flipped.selected, plain.selected)
    skipped = bootstrap_stability(HeadLasso(), knocked_out, scores, 5, exclude=[top],
                                  resamples=20)
    assert plain.selected[top] > 0 and skipped.selected[top] == 0


def test_penalty_weights_solve_the_weighted_lasso():
    """The KKT conditions of min 1/(2n)|y/s - c - X b|^2 + alpha sum_j w_j |b_j|, checked
    on the fitted coefficients (an optimality check, not a second fit)."""
    world = simulated_world(4)
    knocked_out = design_matrix("stratified", 80, NUM_HEADS, 0.05, 4)
    scores = world.measure(knocked_out)
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.3, 3.0, NUM_HEADS)
    fit = HeadLasso(alpha=0.01, penalty_weights=weights, max_iter=100000).fit(
        knocked_out, scores)
    scale = scores.std()
    b = fit.coef_ / scale
    x = knocked_out.astype(float)
    residual = scores / scale - fit.intercept_ / scale - x @ b
    assert abs(residual.mean()) < 1e-8  # the intercept's condition
    correlation = x.T @ residual / len(scores)
    active = b != 0
    assert active.sum() >= 3
    np.testing.assert_allclose(correlation[active], 0.01 * weights[active] * np.sign(b[active]),
                               atol=1e-5)
    assert np.all(np.abs(correlation[~active]) <= 0.01 * weights[~active] + 1e-5)
    # Equal weights of 2 are the plain Lasso with twice the penalty.
    doubled = HeadLasso(alpha=0.01, penalty_weights=np.full(NUM_HEADS, 2.0)).fit(
        knocked_out, scores)
    np.testing.assert_allclose(doubled.coef_, HeadLasso(alpha=0.02).fit(
        knocked_out, scores).coef_, atol=1e-8)
    with raises_naming(ValueError, "penalty_weights", "270"):
        HeadLasso(penalty_weights=np.zeros(NUM_HEADS)).fit(knocked_out, scores)


@pytest.mark.parametrize("baseline", [None, 1.0])
def test_a_penalty_past_every_effect_fits_zeros_silently_as_sklearn_would(baseline):
    """``refit --alpha 1e308`` printed about 3,200 lines of sklearn's ConvergenceWarning
    (a duality gap of nan). At or above the penalty that zeroes every coefficient the fit
    is known without the solver: the same fit as sklearn's just above that penalty, and
    sklearn's own just below it."""
    import warnings

    from sklearn.linear_model import Lasso

    world = simulated_world(4)
    knocked_out = design_matrix("stratified", 60, NUM_HEADS, 0.05, 2)
    scores = world.measure(knocked_out)
    weights = np.random.default_rng(1).uniform(0.5, 2.0, NUM_HEADS)
    target = (scores - (0.0 if baseline is None else baseline)) / scores.std()
    x = knocked_out / weights
    centred = (x - x.mean(axis=0), target - target.mean()) if baseline is None else (x, target)
    # The zeroing penalty, derived here from the optimality condition at 0.
    zeroing = np.max(np.abs(centred[0].T @ centred[1])) / len(scores)
    for alpha in (zeroing * 1.000001, 10.0 * zeroing, 1e308):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning of any kind
            fit = HeadLasso(alpha=alpha, penalty_weights=weights, baseline=baseline).fit(
                knocked_out, scores)
        assert not fit.coef_.any() and fit.r2_ <= 1e-12
        assert fit.intercept_ == pytest.approx(scores.mean() if baseline is None else baseline)
    below = zeroing * 0.98
    fit = HeadLasso(alpha=below, penalty_weights=weights, baseline=baseline).fit(
        knocked_out, scores)
    plain = Lasso(alpha=below, fit_intercept=baseline is None, max_iter=10000).fit(x, target)
    assert 1 <= np.count_nonzero(fit.coef_)
    np.testing.assert_allclose(fit.coef_, plain.coef_ / weights * scores.std(), atol=1e-9)


# ------------------------------------------------------------------ fixed effects

def test_fixed_effects_fit_the_rest_on_what_the_fixed_heads_leave():
    """A head's known change (measured alone) is held: its coefficient is that change and
    the other heads are the plain Lasso (sklearn's, by hand) on the scores less each
    mask's fixed changes, standardised by that remainder's spread."""
    from sklearn.base import clone
    from sklearn.linear_model import Lasso

    world = simulated_world(8)
    knocked_out = design_matrix("stratified", 50, NUM_HEADS, 0.05, 8)
    scores = world.measure(knocked_out)
    fixed = {3: -0.2, 17: 0.0, 101: 0.05}
    fit = HeadLasso(fixed_effects=fixed).fit(knocked_out, scores)
    held = sorted(fixed)
    free = [h for h in range(NUM_HEADS) if h not in fixed]
    rest = scores - knocked_out[:, held].astype(float) @ np.array([fixed[h] for h in held])
    by_hand = Lasso(alpha=0.01, max_iter=10000).fit(knocked_out[:, free].astype(float),
                                                     rest / rest.std())
    np.testing.assert_allclose(fit.coef_[free], by_hand.coef_ * rest.std(), atol=1e-10)
    assert [fit.coef_[h] for h in held] == [fixed[h] for h in held]
    assert fit.intercept_ == pytest.approx(by_hand.intercept_ * rest.std())
    # A parameter, so a clone (each bootstrap refit) is the same model.
    assert clone(fit).get_params()["fixed_effects"] == fixed
    # The baseline too: a clone of a pinned fit refits pinned (sklearn's clone keeps the
    # constructor's parameters, not what fit was given), the same coefficients exactly.
    pinned = HeadLasso(baseline=world.baseline).fit(knocked_out, scores)
    assert clone(pinned).get_params()["baseline"] == world.baseline
    np.testing.assert_array_equal(clone(pinned).fit(knocked_out, scores).coef_, pinned.coef_)
    assert pinned.intercept_ == world.baseline
    assert not np.array_equal(HeadLasso().fit(knocked_out, scores).coef_, pinned.coef_)
    with raises_naming(ValueError, "fixed_effects column=270", "269"):
        HeadLasso(fixed_effects={270: 0.0}).fit(knocked_out, scores)
    with pytest.raises(ValueError, match=r"fixed_effects\[3\]=nan"):
        HeadLasso(fixed_effects={3: float("nan")}).fit(knocked_out, scores)


def test_same_masks_names_heads_with_identical_columns():
    from lm_eval_headloc.method.designs import same_masks

    matrix = np.array([[1, 1, 0, 1, 0, 0],
                       [0, 0, 1, 0, 0, 0],
                       [1, 1, 0, 1, 1, 0]], dtype=bool)
    # 0, 1 and 3 share both masks; 4 is in one of them only; 5 never knocked out.
    assert same_masks(matrix, [0, 2, 4, 5], among=range(6)) == {0: [1, 3]}
    assert same_masks(matrix, [0], among=[0, 3, 4]) == {0: [3]}
    assert same_masks(matrix, [1], among=[2, 4]) == {}


def test_held_out_r2_is_leave_one_out_by_hand():
    """Each measurement predicted by sklearn's Lasso fitted on the others (standardised as
    HeadLasso does), on what the fixed heads leave; R² of those predictions."""
    from sklearn.linear_model import Lasso

    from lm_eval_headloc.method.lasso import held_out_r2

    world = simulated_world(9)
    knocked_out = design_matrix("stratified", 40, NUM_HEADS, 0.05, 9)
    scores = world.measure(knocked_out)
    fixed = {5: -0.1, 60: 0.0}
    rest = scores - knocked_out[:, [5, 60]].astype(float) @ np.array([-0.1, 0.0])
    free = [h for h in range(NUM_HEADS) if h not in fixed]
    predicted = []
    for row in range(len(scores)):
        keep = np.arange(len(scores)) != row
        spread = rest[keep].std()
        fit = Lasso(alpha=0.01, max_iter=10000).fit(knocked_out[keep][:, free].astype(float),
                                                     rest[keep] / spread)
        predicted.append(spread * (fit.intercept_ + knocked_out[row, free] @ fit.coef_))
    by_hand = 1 - np.sum((rest - predicted) ** 2) / np.sum((rest - rest.mean()) ** 2)
    value = held_out_r2(HeadLasso(fixed_effects=fixed), knocked_out, scores)
    assert value == pytest.approx(by_hand, abs=1e-9)
    # In-sample it fits far closer than it predicts.
    assert HeadLasso(fixed_effects=fixed).fit(knocked_out, scores).r2_ > value + 0.1
    # Nothing to predict: too few measurements, or a remainder that does not vary.
    assert np.isnan(held_out_r2(HeadLasso(), knocked_out[:2], scores[:2]))
    flat = 0.5 - 0.1 * knocked_out[:, 5]
    assert np.isnan(held_out_r2(HeadLasso(fixed_effects={5: -0.1}), knocked_out, flat))


@parametrize_with_checks([HeadLasso()])
def test_head_lasso_passes_scikit_learns_estimator_checks(estimator, check):
    """fit(X, y) as sklearn names them (its tools and checks call them so), complex data
    refused rather than cast to its real part, clone/get_params, n_features_in_, ..."""
    check(estimator)


def test_an_effect_of_round_off_size_is_exactly_zero():
    # A real run (2x4-head model, 3 masks at sparsity 0.5, logprob): columns 1 and 6 are
    # knocked out in the same masks, and coordinate descent left -2.4e-19 on the second —
    # an effect that "hurt" the task, was ranked second and bootstrapped as selected.
    design = np.array([[0, 1, 1, 1, 0, 0, 1, 0],
                       [1, 0, 0, 0, 1, 1, 0, 1],
                       [0, 0, 1, 1, 1, 1, 0, 0]], dtype=float)
    scores = np.array([-5.47190477328318, -5.438645209300131, -5.438744916111615])
    baseline = -5.436263803382718
    model = HeadLasso(alpha=0.01, baseline=baseline).fit(design, scores)
    tiny = (model.coef_ != 0) & (np.abs(model.coef_) < 1e-9)
    assert not tiny.any(), model.coef_[tiny]
    # The pair's credit is what one copy of the column earns alone (fit independently).
    alone = HeadLasso(alpha=0.01, baseline=baseline).fit(np.delete(design, 6, axis=1), scores)
    assert model.coef_[1] + model.coef_[6] == pytest.approx(alone.coef_[1], rel=1e-9)
    assert min(abs(model.coef_[1]), abs(model.coef_[6])) == 0.0
