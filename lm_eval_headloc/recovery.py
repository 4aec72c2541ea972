"""Recover per-head effects from knockout measurements with a Lasso (SPEC §2).

The model is ``y ≈ y0 + A·β``: ``A`` the design matrix (``True`` = head knocked out),
``y`` the task score of each measurement, ``y0`` the score with nothing knocked out and
``β_j`` the change of the score from knocking out head ``j``. Few heads matter for a
task, so ``β`` is sparse and an L1 penalty recovers it from far fewer measurements than
heads. For a higher-is-better score the task's heads are the most negative ``β_j``.

Reference settings (the paper's code): divide the scores by their standard deviation,
fit ``sklearn.linear_model.Lasso(alpha=0.01)`` *with* an intercept. Standardising makes
``alpha`` mean the same for a score in [0, 1] and one in the hundreds; the intercept
takes up ``y0`` together with the common cost of a mask's unimportant heads. ``coef_``
is reported back in the score's own units.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import Lasso
from sklearn.utils.validation import check_is_fitted

from .designs import head_column_mask
from .heads import Head

__all__ = ["HeadLasso"]


def _as_design(design_matrix: object) -> np.ndarray:
    matrix = np.asarray(design_matrix)
    if matrix.ndim != 2:
        raise ValueError(
            f"design matrix must be 2-D (measurements × heads), got shape {matrix.shape}"
        )
    if matrix.dtype == bool:
        return matrix.astype(np.float64)
    try:
        matrix = matrix.astype(np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            f"design matrix must hold 0/1 or True/False, got dtype {matrix.dtype}"
        ) from None
    if not np.all(np.isfinite(matrix)):
        raise ValueError("design matrix holds NaN or infinite entries; expected 0/1")
    return matrix


def _as_scores(scores: object) -> np.ndarray:
    values = np.asarray(scores)
    if values.ndim != 1:
        raise ValueError(f"scores must be 1-D (one per measurement), got shape {values.shape}")
    try:
        values = values.astype(np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"scores must be numbers, got dtype {values.dtype}") from None
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ValueError(
            f"score of measurement {bad[0]} is {values[bad[0]]}: every score must be finite"
        )
    return values


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

    Fit with ``baseline=None`` (default, the reference): an intercept is fitted along
    with the head effects. Fit with ``baseline=y0`` (a measured unablated score): no
    intercept; ``(y − y0)/std`` is regressed on the design, pinning the empty mask to y0.
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
    r2_: R² of the fit on the measurements (original units).
    n_measurements_: number of measurements (rows) fitted.
    scale_: the standard deviation the scores were divided by (1.0 if not standardised).
    baseline_: the baseline passed to ``fit`` (None if the intercept was fitted).
    n_features_in_: number of heads (columns).
    """

    def __init__(self, alpha: float = 0.01, standardize: bool = True, max_iter: int = 10000):
        self.alpha = alpha
        self.standardize = standardize
        self.max_iter = max_iter

    def fit(
        self, design_matrix: object, scores: object, baseline: float | None = None
    ) -> HeadLasso:
        """Fit head effects; ``baseline`` is the unablated score (None: fit an intercept)."""
        self._check_params()
        knocked_out = _as_design(design_matrix)
        y = _as_scores(scores)
        if knocked_out.shape[0] != y.shape[0]:
            raise ValueError(
                f"design matrix has {knocked_out.shape[0]} rows (measurements) but there are "
                f"{y.shape[0]} scores; they must match"
            )
        if y.shape[0] < 2:
            raise ValueError(f"need at least 2 measurements to fit, got {y.shape[0]}")
        if knocked_out.shape[1] < 1:
            raise ValueError("design matrix has no columns (heads)")
        if baseline is not None:
            if (
                isinstance(baseline, bool)
                or not isinstance(baseline, numbers.Real)
                or not np.isfinite(baseline)
            ):
                raise ValueError(f"baseline={baseline!r}: must be a finite number or None")
            baseline = float(baseline)

        scale = 1.0
        if self.standardize:
            spread = float(np.std(y))
            # A zero (or round-off) spread means no mask changed the score: nothing to
            # standardise, and dividing would blow round-off up into "effects".
            if spread > 1e-12 * max(1.0, float(np.max(np.abs(y)))):
                scale = spread

        offset = 0.0 if baseline is None else baseline
        lasso = Lasso(
            alpha=self.alpha, fit_intercept=baseline is None, max_iter=self.max_iter
        )
        lasso.fit(knocked_out, (y - offset) / scale)

        self.coef_ = np.asarray(lasso.coef_, dtype=np.float64) * scale
        self.intercept_ = (
            float(lasso.intercept_) * scale if baseline is None else baseline
        )
        self.baseline_ = baseline
        self.scale_ = scale
        self.n_measurements_ = int(y.shape[0])
        self.n_features_in_ = int(knocked_out.shape[1])
        self.n_iter_ = int(lasso.n_iter_)
        residual = y - self._predict(knocked_out)
        total = float(np.sum((y - y.mean()) ** 2))
        # Constant scores: R² is 1 if they are fitted exactly, else 0 (sklearn's convention).
        self.r2_ = (
            1.0 - float(np.sum(residual**2)) / total
            if total > 0
            else float(np.allclose(residual, 0.0))
        )
        return self

    def _check_params(self) -> None:
        alpha = self.alpha
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, numbers.Real)
            or not np.isfinite(alpha)
            or alpha <= 0
        ):
            raise ValueError(f"alpha={alpha!r}: must be a number > 0 (reference: 0.01)")
        if isinstance(self.max_iter, bool) or not isinstance(self.max_iter, numbers.Integral) \
                or self.max_iter < 1:
            raise ValueError(f"max_iter={self.max_iter!r}: must be a whole number >= 1")
        if not isinstance(self.standardize, (bool, np.bool_)):
            raise ValueError(f"standardize={self.standardize!r}: must be True or False")

    def _predict(self, knocked_out: np.ndarray) -> np.ndarray:
        return self.intercept_ + knocked_out @ self.coef_

    def predict(self, design_matrix: object) -> np.ndarray:
        """Predicted scores ``intercept_ + A·coef_`` for each mask (row)."""
        check_is_fitted(self, "coef_")
        knocked_out = _as_design(design_matrix)
        if knocked_out.shape[1] != self.n_features_in_:
            raise ValueError(
                f"design matrix has {knocked_out.shape[1]} columns but the model was fitted "
                f"on {self.n_features_in_} heads"
            )
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
        excluded = head_column_mask(exclude, self.coef_.shape[0], "exclude")
        harm = self.coef_ if higher_is_better else -self.coef_
        order = np.argsort(harm, kind="stable")
        return order[~excluded[order]]

    def top_heads(
        self,
        k: int,
        num_heads_per_layer: int,
        higher_is_better: bool = True,
        exclude: Iterable[int] = (),
    ) -> list[Head]:
        """The ``k`` most harmful heads as ``Head(layer, head)``, most harmful first.

        Always ``k`` heads: if fewer than ``k`` have a harmful effect the rest are the
        harmless ones in index order; check ``coef_`` when that matters.
        """
        check_is_fitted(self, "coef_")
        num_heads = self.coef_.shape[0]
        if (
            isinstance(num_heads_per_layer, bool)
            or not isinstance(num_heads_per_layer, numbers.Integral)
            or num_heads_per_layer < 1
            or num_heads % num_heads_per_layer
        ):
            raise ValueError(
                f"num_heads_per_layer={num_heads_per_layer!r}: must be a whole number >= 1 "
                f"that divides the {num_heads} fitted heads"
            )
        order = self.ranking(higher_is_better=higher_is_better, exclude=exclude)
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= order.size:
            raise ValueError(
                f"k={k!r}: must be a whole number in 1..{order.size} (heads left to rank)"
            )
        return [Head.from_index(int(j), int(num_heads_per_layer)) for j in order[:k]]
