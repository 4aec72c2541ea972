"""Recover per-head effects from knockout measurements with a Lasso.

The model is ``y ≈ y0 + A·β``: ``A`` the design matrix (``True`` = head knocked out),
``y`` the task score of each measurement, ``y0`` the score with nothing knocked out and
``β_j`` the change of the score from knocking out head ``j``. Few heads matter for a
task, so ``β`` is sparse and an L1 penalty recovers it from far fewer measurements than
heads. For a higher-is-better score the task's heads are the most negative ``β_j``.

Reference settings (the released code of the compressed-sensing paper, Bair, Xu, Sun &
Kolter, arXiv 2603.03335): divide the scores by their standard deviation,
fit ``sklearn.linear_model.Lasso(alpha=0.01)`` *with* an intercept. Standardising makes
``alpha`` mean the same for a score in [0, 1] and one in the hundreds; the intercept
takes up ``y0`` together with the common cost of a mask's unimportant heads. ``coef_``
is reported back in the score's own units.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin, clone
from sklearn.linear_model import Lasso
from sklearn.metrics import r2_score
from sklearn.utils.validation import check_is_fitted, validate_data

from lm_eval_headloc.common.checks import UsageError, check_number
from lm_eval_headloc.common.equality import same_values
from lm_eval_headloc.intervention.components import Head
from lm_eval_headloc.method.designs import head_column_mask

__all__ = ["STABLE", "HeadLasso", "Stability", "bootstrap_stability", "harm", "held_out_r2",
           "less_fixed", "round_off"]

#: A head is *stable* in a top-k when at least this fraction of bootstrap refits put it there.
STABLE = 0.9


@contextmanager
def _one_line_errors(design_matrix: object, scores: object = None) -> Iterator[None]:
    """sklearn's input errors in one line, naming the shapes that were passed.

    Its messages go on with advice meant for tables of features (reshape, impute); their
    first line says what is wrong.
    """
    try:
        yield
    except ValueError as error:
        reason = str(error).splitlines()[0].rstrip(" :.")
        if "Reshape your data" in str(error):
            # Kept in these words: sklearn's own checks (check_fit2d_predict1d) look for them.
            reason += ". Reshape your data: one row per mask, one column per head"
        passed = [("X", "design matrix", design_matrix)]
        if scores is not None:
            passed.append(("y", "scores", scores))
        shapes = []
        for sklearn_name, name, value in passed:  # sklearn says X and y
            try:
                shapes.append(f"{sklearn_name}: {name} of shape {np.shape(value)}")
            except ValueError:  # ragged nested lists
                shapes.append(f"{sklearn_name}: {name} of no regular shape")
        raise ValueError(f"{reason} ({', '.join(shapes)})") from None


def less_fixed(design_matrix: np.ndarray, scores: np.ndarray,
               fixed: Mapping[int, float]) -> np.ndarray:
    """The scores less each mask's (row's) sum of the ``fixed`` heads' changes: what the
    other heads are left to explain."""
    held = sorted(fixed)
    if not held:
        return np.asarray(scores, dtype=np.float64)
    knocked_out = np.asarray(design_matrix, dtype=np.float64)
    return scores - knocked_out[:, held] @ np.array([fixed[h] for h in held], dtype=np.float64)


def _checked_bool(value: object, name: str) -> bool:
    # check_number is for numbers; a truthy string such as "False" must not pass.
    if not isinstance(value, (bool, np.bool_)):
        raise UsageError(f"{name}={value!r}: must be True or False")
    return bool(value)


def _short(value: object) -> str:
    # A repr that fits in a one-line message (an array's spans lines).
    return " ".join(reprlib.repr(value).split())


def _checked_weights(weights: object, total: int) -> np.ndarray:
    if weights is None:
        return np.ones(total)
    need = f"penalty_weights: need {total} finite positive numbers, one per head"
    try:
        checked = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise UsageError(f"{need} (got {_short(weights)})") from None
    if checked.shape != (total,) or not np.all(np.isfinite(checked)) or np.any(checked <= 0):
        raise UsageError(f"{need} (got shape {checked.shape})")
    return checked


def _checked_fixed(fixed: Mapping[int, float] | None, total: int) -> dict[int, float]:
    if fixed is None:
        return {}
    if not isinstance(fixed, Mapping):
        raise ValueError(f"fixed_effects={fixed!r}: must be a mapping of head column to "
                         "its known change")
    checked = {}
    for head, change in fixed.items():
        column = check_number(head, "fixed_effects column", whole=True, min_val=0,
                              max_val=total - 1)
        checked[int(column)] = float(check_number(change, f"fixed_effects[{head}]"))
    return checked


class HeadLasso(RegressorMixin, BaseEstimator):
    """Lasso recovery of head effects; the most harmful heads come first in ``ranking``.

    Parameters
    ----------
    alpha:
        L1 penalty of ``sklearn.linear_model.Lasso`` (on standardised scores when
        ``standardize``; then 0.01 is the paper's setting whatever the score's scale).
    standardize:
        Divide the scores by their standard deviation before fitting (reference
        behaviour). If the scores do not vary, nothing is divided (``scale_ = 1``).
    max_iter:
        Coordinate-descent iterations for the Lasso.
    penalty_weights:
        Optional ``(N,)`` positive factors on each head's L1 penalty (an adaptive Lasso:
        a head a prior says is likely gets a smaller one). None: the same for all.
    fixed_effects:
        Optional ``{column: change}`` of heads whose effect is known (measured alone):
        their ``coef_`` is that change, and the other heads are fitted on the scores less
        each mask's sum of the fixed changes (standardised, and ``r2_`` computed, on
        that remainder). A constructor parameter, so ``clone`` (the bootstrap) refits the
        same model. None: every head fitted.
    baseline:
        None (default, the reference): an intercept is fitted along with the head
        effects. ``y0`` (a measured unablated score): no intercept; ``(y − y0)/std`` is
        regressed on the design, pinning the empty mask to y0. A constructor parameter, so
        ``clone`` (the bootstrap, the held-out refits) refits the same model.

    The default is the intercept because it ranks better in simulation
    (tests/test_designs_recovery.py): real knockouts of unimportant heads still cost a
    little on average, and with ``k`` heads per mask those costs add up; the intercept
    absorbs that common shift, whereas a pinned baseline must explain it with head
    effects. At 270 heads the two rank alike (the pinned fit a little worse, its effect
    sizes a little closer); at 1,024 heads with 20–50 heads per mask the pinned fit
    loses the planted heads (0/20 seeds all five vs 11/20 at 100 masks, p = 0.05).

    Attributes (after ``fit``)
    ----------
    coef_: ``(N,)`` estimated change of the score from knocking out each head, in the
        score's units.
    intercept_: the fitted intercept (or the given baseline), in score units. It also
        absorbs the average small cost of the unimportant heads each mask knocks out (so
        it usually sits below the measured unablated score); it is not an estimate of y0.
    r2_: R² of the fit on the measurements (original units); for scores that do not
        vary, 1 if they are fitted exactly and 0 otherwise (sklearn's convention).
    n_measurements_: number of measurements (rows) fitted.
    scale_: the standard deviation the scores were divided by (1.0 if not standardised).
    n_features_in_: number of heads (columns).
    """

    def __init__(self, alpha: float = 0.01, standardize: bool = True, max_iter: int = 10000,
                 penalty_weights: object = None, fixed_effects: Mapping[int, float] | None = None,
                 baseline: float | None = None):
        self.alpha = alpha
        self.standardize = standardize
        self.max_iter = max_iter
        self.penalty_weights = penalty_weights
        self.fixed_effects = fixed_effects
        self.baseline = baseline

    def fit(self, X: object, y: object) -> HeadLasso:  # noqa: N803
        """Fit head effects: ``X`` the design matrix (masks x heads, 1 = knocked out;
        sklearn's name, as its estimator checks and tools expect), ``y`` each mask's
        measured score."""
        design_matrix, scores = X, y
        alpha = check_number(self.alpha, "alpha", min_val=0, include_boundaries="neither")
        max_iter = check_number(self.max_iter, "max_iter", whole=True, min_val=1)
        standardize = _checked_bool(self.standardize, "standardize")
        baseline = self.baseline
        if baseline is not None:
            baseline = check_number(baseline, "baseline")
        # validate_data records n_features_in_ (and feature names) on the estimator it is
        # given: a scratch copy's, so that a fit failing later leaves this one as it was.
        shapes = clone(self)
        with _one_line_errors(design_matrix, scores):
            # Scores as floats first: sklearn only converts object arrays of targets, and
            # its finiteness check must see "nan" given as text too. One measurement
            # cannot show an effect, so at least two.
            values = np.asarray(scores)
            if np.iscomplexobj(values):  # as float64 it would lose its imaginary part
                raise ValueError("Complex data not supported")
            knocked_out, y = validate_data(
                shapes, design_matrix, np.asarray(values, dtype=np.float64),
                dtype=np.float64, ensure_min_samples=2,
            )

        total = knocked_out.shape[1]
        fixed = _checked_fixed(self.fixed_effects, total)
        weights = _checked_weights(self.penalty_weights, total)
        held = np.array(sorted(fixed), dtype=np.int64)
        free = np.setdiff1d(np.arange(total), held)
        y = less_fixed(knocked_out, y, fixed)
        spread = float(np.std(y))
        noise = round_off(y)
        # A zero (or round-off) spread means no mask changed the score: nothing to
        # standardise, and dividing would blow round-off up into "effects".
        constant = spread <= noise
        scale = spread if standardize and not constant else 1.0

        offset = 0.0 if baseline is None else baseline
        coef = np.zeros(total)
        coef[held] = [fixed[h] for h in held]
        intercept, n_iter = float(np.mean(y - offset)) if baseline is None else 0.0, 0
        # A penalty w_j * |b_j| is the plain Lasso on the column divided by w_j.
        weighted, target = knocked_out[:, free] / weights[free], (y - offset) / scale
        if free.size and alpha < _alpha_max(weighted, target, baseline is None):
            lasso = Lasso(alpha=alpha, fit_intercept=baseline is None, max_iter=max_iter)
            lasso.fit(weighted, target)
            fitted_free = np.asarray(lasso.coef_, dtype=np.float64) / weights[free] * scale
            # An effect of round-off size is no effect: left as it is, it "hurts" the task by
            # 1e-19 and is ranked, bootstrapped and reported as a head that matters.
            fitted_free[(np.abs(fitted_free) <= noise) & (fitted_free != 0)] = 0.0
            coef[free] = fitted_free
            intercept, n_iter = float(lasso.intercept_) * scale, int(lasso.n_iter_)
        intercept = intercept if baseline is None else baseline
        # Fitted against the remainder the free heads explain (the fixed part is given).
        fitted = intercept + knocked_out[:, free] @ coef[free]
        # Constant scores: 1 if fitted exactly, else 0 (r2_score's convention), both up to
        # round-off; r2_score itself would give 0 for a round-off spread fitted to 1e-17.
        r2 = float(np.allclose(y - fitted, 0.0)) if constant else float(r2_score(y, fitted))

        # Everything is known: the fitted state is replaced all at once.
        self.coef_ = coef
        self.intercept_ = intercept
        self.scale_ = scale
        self.n_measurements_ = int(y.shape[0])
        self.n_iter_ = n_iter
        self.r2_ = r2
        self.n_features_in_ = shapes.n_features_in_
        if hasattr(shapes, "feature_names_in_"):
            self.feature_names_in_ = shapes.feature_names_in_
        elif hasattr(self, "feature_names_in_"):  # as validate_data's reset: names are X's
            del self.feature_names_in_
        return self

    def _predict(self, knocked_out: np.ndarray) -> np.ndarray:
        return self.intercept_ + knocked_out @ self.coef_

    def predict(self, X: object) -> np.ndarray:  # noqa: N803
        """Predicted scores ``intercept_ + A·coef_`` for each mask (row) of the design
        matrix ``X``."""
        design_matrix = X
        check_is_fitted(self, "coef_")
        with _one_line_errors(design_matrix):
            knocked_out = validate_data(self, design_matrix, dtype=np.float64, reset=False)
        return self._predict(knocked_out)

    def ranking(
        self, higher_is_better: bool = True, exclude: Iterable[int] = ()
    ) -> np.ndarray:
        """Head columns, most harmful to knock out first; ``exclude`` columns left out.

        Higher-is-better scores: most negative ``coef_`` first; lower-is-better (e.g.
        perplexity): most positive first. Equal effects keep index order (stable sort).
        Every non-excluded head is listed, harmless ones (``coef_`` 0) after harmful ones.
        """
        check_is_fitted(self, "coef_")
        higher_is_better = _checked_bool(higher_is_better, "higher_is_better")
        excluded = head_column_mask(exclude, self.coef_.shape[0], "exclude")
        order = np.argsort(-harm(self.coef_, higher_is_better), kind="stable")
        return order[~excluded[order]]

    def top_heads(
        self,
        k: int,
        heads_per_layer: int,
        higher_is_better: bool = True,
        exclude: Iterable[int] = (),
        head_layers: Sequence[int] | None = None,
    ) -> list[Head]:
        """The ``k`` most harmful heads as ``Head(layer, head)``, most harmful first.

        Always ``k`` heads: if fewer than ``k`` have a harmful effect the rest are the
        harmless ones in index order; check ``coef_`` when that matters. ``head_layers``:
        a hybrid model's layers with heads (config.json's ``head_layers``), whose heads
        alone the design has columns for, layer by layer.
        """
        check_is_fitted(self, "coef_")
        higher_is_better = _checked_bool(higher_is_better, "higher_is_better")
        total_heads = self.coef_.shape[0]
        heads_per_layer = check_number(heads_per_layer, "heads_per_layer", whole=True,
                                       min_val=1)
        layers = None if head_layers is None else _checked_layers(head_layers)
        if layers is not None and len(layers) * heads_per_layer != total_heads:
            raise ValueError(f"head_layers={head_layers!r} of {heads_per_layer} heads each "
                             f"are {len(layers) * heads_per_layer} heads, not the "
                             f"{total_heads} fitted")
        if total_heads % heads_per_layer:
            raise ValueError(
                f"heads_per_layer={heads_per_layer!r} does not divide the {total_heads} "
                "fitted heads into layers"
            )
        order = self.ranking(higher_is_better=higher_is_better, exclude=exclude)
        # At most the heads left after ``exclude``.
        k = check_number(k, "k", whole=True, min_val=1, max_val=order.size)
        heads = [Head.from_flat_index(int(j), heads_per_layer) for j in order[:k]]
        return heads if layers is None else [Head(layers[h.layer], h.head) for h in heads]


def _checked_layers(head_layers: object) -> list[int]:
    if isinstance(head_layers, (str, bytes)) or not isinstance(head_layers, Iterable):
        raise UsageError(f"head_layers={_short(head_layers)}: must be a list of layer "
                         "numbers (whole numbers >= 0), or None")
    return [int(check_number(layer, f"head_layers[{i}]", whole=True, min_val=0))
            for i, layer in enumerate(head_layers)]


def round_off(values: object) -> float:
    """How far apart values of this size may be by float round-off alone (the mean of 0.1s
    is not 0.1; coordinate descent leaves ~1e-19 on the second of two identical columns):
    differences no larger are no difference."""
    return 1e-12 * max(1.0, float(np.max(np.abs(np.asarray(values, dtype=np.float64)),
                                         initial=0.0)))


def harm(effects: object, higher_is_better: bool) -> np.ndarray:
    """How much knocking out each head hurts (positive = worse), whichever way the
    score points: ``-effects`` for higher-is-better scores, ``effects`` otherwise."""
    effects = np.asarray(effects, dtype=np.float64)
    return -effects if higher_is_better else effects


@dataclass(frozen=True)
class Stability:
    """How sure a fit is, per head, from refits on bootstrap resamples of the measurements.

    ``selected``: the fraction of refits that put the head in the top-k (the ranking's own
    top-k heads are stable when this is at least ``STABLE``); ``low``/``high``: the
    2.5th and 97.5th percentiles of its refitted effect (a 95 % percentile interval, in
    the score's units); ``resamples``: how many refits.

    The interval is the Lasso *estimate's*: it shows how far the estimate moves with the
    measurements. The L1 penalty shrinks every estimate towards 0, so it is no coverage
    guarantee for the true effect (a strong head's true effect is typically a little
    further from 0 than the whole interval).
    """

    selected: np.ndarray
    low: np.ndarray
    high: np.ndarray
    resamples: int

    def __post_init__(self) -> None:
        for name in ("low", "high"):  # + 0.0: a zero estimate is 0, never "-0.0000"
            object.__setattr__(self, name, np.asarray(getattr(self, name), float) + 0.0)

    def __eq__(self, other: object) -> bool:
        # The dataclass's own == raised on the arrays ("truth value ... is ambiguous").
        return same_values(self, other) if isinstance(other, Stability) else NotImplemented


def _alpha_max(design_matrix: np.ndarray, y: np.ndarray, intercept: bool) -> float:
    """The smallest penalty at which the Lasso's every coefficient is 0 (its optimality
    condition at 0: ``|X^T (y - mean)| / n <= alpha``). At or above it the fit is known
    without sklearn, whose solver overflows at an alpha near float's largest (a flood of
    ConvergenceWarnings with a duality gap of nan)."""
    if not design_matrix.size:
        return 0.0
    centred_x = design_matrix - design_matrix.mean(axis=0) if intercept else design_matrix
    centred_y = y - y.mean() if intercept else y
    return float(np.max(np.abs(centred_x.T @ centred_y)) / len(y))


def _paired(design_matrix: object, scores: object) -> tuple[np.ndarray, np.ndarray]:
    """The design and its scores as float arrays, one score per row (for the refitting
    helpers; ``fit`` checks its own inputs with sklearn's messages)."""
    knocked_out = np.asarray(design_matrix, dtype=np.float64)
    y = np.asarray(scores, dtype=np.float64)
    if knocked_out.ndim != 2 or y.shape != (knocked_out.shape[0],):
        raise ValueError(f"design matrix of shape {knocked_out.shape} and scores of shape "
                         f"{y.shape} do not pair up row by row")
    return knocked_out, y


def bootstrap_stability(estimator: HeadLasso, design_matrix: object, scores: object,
                        top_k: int, *, higher_is_better: bool = True,
                        exclude: Iterable[int] = (), resamples: int = 200,
                        seed: int = 0,
                        select: Callable[[np.ndarray], np.ndarray] | None = None
                        ) -> Stability:
    """Refit a clone of ``estimator`` on ``resamples`` resamples of the measurements (rows
    drawn with replacement, ``np.random.default_rng(seed)``) and count how often each head
    makes the top ``top_k`` with a harmful effect (a refit that finds fewer harmful heads
    selects fewer); the same seed gives the same answer.

    Each refit is the estimator's own model (``clone``): ``HeadLasso(baseline=y0)``
    refits pinned to that baseline, one without a baseline fits an intercept. Refitting a
    pinned fit with a free intercept would report the stability of another estimator, not
    of the one whose ranking is reported.

    ``select``: the heads a resample (its row indices into the measurements) leads to,
    when that is not the refit's own harmful top-k (``locate``'s confirmation replay)."""
    resamples = check_number(resamples, "resamples", whole=True, min_val=1)
    top_k = check_number(top_k, "top_k", whole=True, min_val=1)
    higher_is_better = _checked_bool(higher_is_better, "higher_is_better")
    knocked_out, y = _paired(design_matrix, scores)
    rows, total = knocked_out.shape
    excluded = list(exclude)
    rng = np.random.default_rng(seed)
    counts = np.zeros(total, dtype=np.int64)
    effects = np.empty((resamples, total))
    for r in range(resamples):
        picked = rng.integers(0, rows, size=rows)
        refit = clone(estimator).fit(knocked_out[picked], y[picked])
        effects[r] = refit.coef_
        ranking = refit.ranking(higher_is_better, excluded)
        if select is not None:
            counts[select(picked)] += 1
            continue
        top = ranking[:top_k]
        counts[top[harm(refit.coef_[top], higher_is_better) > 0]] += 1
    low, high = np.percentile(effects, [2.5, 97.5], axis=0)
    return Stability(counts / resamples, low, high, resamples)


def held_out_r2(estimator: HeadLasso, design_matrix: object, scores: object) -> float:
    """R² of each measurement predicted by a refit of ``estimator`` (a clone) on the other
    measurements (leave one out): how well the fit predicts a mask it did not see, where
    ``r2_`` says how closely it fits the masks it saw (with far more heads than
    measurements, closely whatever the truth). Like ``r2_``, on what the heads not in
    ``fixed_effects`` are left to explain. NaN with fewer than 3 measurements or when that
    does not vary. A head knocked out only in the left-out mask is unknown to its refit,
    so designs that knock most heads out once or twice score low here."""
    knocked_out, y = _paired(design_matrix, scores)
    rows, total = knocked_out.shape
    fixed = _checked_fixed(estimator.fixed_effects, total)
    rest = less_fixed(knocked_out, y, fixed)
    spread = float(np.sum((rest - rest.mean()) ** 2))
    if rows < 3 or spread <= 1e-24 * max(1.0, float(np.max(np.abs(rest)))) ** 2:
        return float("nan")
    free = np.setdiff1d(np.arange(total), sorted(fixed))
    predicted = np.empty(rows)
    for row in range(rows):
        others = np.arange(rows) != row
        refit = clone(estimator).fit(knocked_out[others], y[others])
        predicted[row] = refit.intercept_ + knocked_out[row, free] @ refit.coef_[free]
    return 1.0 - float(np.sum((rest - predicted) ** 2)) / spread
