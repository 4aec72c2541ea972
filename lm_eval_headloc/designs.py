"""Design matrices for compressed-sensing head localization (SPEC §2).

A design matrix has one row per measurement (mask) and one column per head (flat index
``layer * H + head``); ``True`` means the head is knocked out in that measurement.
Everything here is a pure function of its arguments: the same seed gives the same
matrix, so a run folder that records the seed can rebuild (and check) its design.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["DESIGNS", "column_counts", "design_matrix", "head_column_mask",
           "knockouts_per_mask"]

#: The design kinds :func:`design_matrix` accepts.
DESIGNS: tuple[str, ...] = ("bernoulli", "stratified")


def _whole_number(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; True masks/heads is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be a whole number >= {minimum}")
    return int(value)


def head_column_mask(indices: Iterable[int], num_heads: int, name: str) -> np.ndarray:
    """Boolean mask over the ``num_heads`` head columns, True at ``indices``.

    Each index must be a whole number in ``0..num_heads-1``; ``name`` (the argument the
    indices came from) goes into the error.
    """
    mask = np.zeros(num_heads, dtype=bool)
    for index in indices:
        if (
            isinstance(index, bool)
            or not isinstance(index, numbers.Integral)
            or not 0 <= index < num_heads
        ):
            raise ValueError(
                f"{name} index {index!r} is not a head column: must be a whole "
                f"number in 0..{num_heads - 1} ({num_heads} heads)"
            )
        mask[int(index)] = True
    return mask


def _eligible_columns(num_heads: int, never_ablate: Sequence[int]) -> np.ndarray:
    eligible = np.flatnonzero(~head_column_mask(never_ablate, num_heads, "never_ablate"))
    if eligible.size == 0:
        raise ValueError(
            f"never_ablate lists all {num_heads} heads: at least one head must be eligible "
            "for knockout"
        )
    return eligible


def knockouts_per_mask(sparsity: float, num_eligible: int) -> int:
    """Heads a stratified mask knocks out: ``max(1, round(sparsity * num_eligible))``.

    At least one, so that a tiny model or sparsity still measures something. Python's
    ``round`` (halves to even) is used, as the SPEC writes ``round(p·N)``.
    """
    return max(1, int(round(sparsity * num_eligible)))


def design_matrix(
    kind: str,
    num_masks: int,
    num_heads: int,
    sparsity: float,
    seed: int,
    never_ablate: Sequence[int] = (),
) -> np.ndarray:
    """A ``(num_masks, num_heads)`` bool matrix; ``True`` = head knocked out in that mask.

    ``"bernoulli"``: every eligible entry is knocked out independently with probability
    ``sparsity`` (the textbook compressed-sensing design; columns' counts vary by chance).

    ``"stratified"``: every mask knocks out exactly ``k = max(1, round(sparsity *
    eligible))`` heads, taken as the heads knocked out least often so far with ties broken
    at random, so all eligible columns' counts differ by at most one (the paper's
    balanced design, which it finds more stable).

    ``never_ablate`` columns are never knocked out (all False) and do not count towards
    ``k``. Only ``np.random.default_rng(seed)`` supplies randomness.
    """
    if not isinstance(kind, str) or kind not in DESIGNS:
        raise ValueError(f"unknown design kind {kind!r}: allowed kinds are {', '.join(DESIGNS)}")
    num_masks = _whole_number("num_masks", num_masks, 1)
    num_heads = _whole_number("num_heads", num_heads, 1)
    seed = _whole_number("seed", seed, 0)
    if (
        isinstance(sparsity, bool)
        or not isinstance(sparsity, numbers.Real)
        or not math.isfinite(sparsity)
        or not 0 < sparsity < 1
    ):
        raise ValueError(
            f"sparsity={sparsity!r}: must be a number strictly between 0 and 1 "
            "(the fraction of heads knocked out per mask, e.g. 0.02)"
        )
    eligible = _eligible_columns(num_heads, never_ablate)
    rng = np.random.default_rng(seed)
    knocked_out = np.zeros((num_masks, num_heads), dtype=bool)

    if kind == "bernoulli":
        # Draw only the eligible columns so the rate over eligible heads is exactly p.
        knocked_out[:, eligible] = rng.random((num_masks, eligible.size)) < sparsity
        return knocked_out

    per_mask = knockouts_per_mask(sparsity, eligible.size)
    counts = np.zeros(eligible.size, dtype=np.int64)
    for row in range(num_masks):
        # Counts are integers, so a uniform [0, 1) jitter only breaks ties between
        # equally-often-knocked heads; it never reorders different counts.
        priority = counts + rng.random(eligible.size)
        chosen = np.argpartition(priority, per_mask - 1)[:per_mask]
        knocked_out[row, eligible[chosen]] = True
        counts[chosen] += 1
    return knocked_out


def column_counts(matrix: np.ndarray) -> np.ndarray:
    """How often each head (column) is knocked out: the design's coverage per head."""
    matrix = np.asarray(matrix)
    if matrix.ndim != 2:
        raise ValueError(
            f"design matrix must be 2-D (masks × heads), got shape {matrix.shape}"
        )
    return np.count_nonzero(matrix, axis=0)
