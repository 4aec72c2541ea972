"""Design matrices for compressed-sensing head localization.

A design matrix has one row per measurement (mask) and one column per head (flat index
``layer * H + head``); ``True`` means the head is knocked out in that measurement.
Everything here is a pure function of its arguments: the same seed gives the same
matrix, so a run folder that records the seed can rebuild (and check) its design.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import numpy as np

from lm_eval_headloc.common.checks import UsageError, check_number
from lm_eval_headloc.common.options import DESIGNS

__all__ = ["MAX_DESIGN_BYTES", "column_counts", "design_matrix", "head_column_mask",
           "knockouts_per_mask", "same_masks"]


def head_column_mask(indices: Iterable[int], total_heads: int, name: str) -> np.ndarray:
    """Boolean mask over the ``total_heads`` head columns, True at ``indices``.

    Each index must be a whole number in ``0..total_heads-1``; ``name`` (the argument the
    indices came from) goes into the error.
    """
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
        raise UsageError(f"{name}={indices!r}: must be a list of head column indices "
                         f"(whole numbers in 0..{total_heads - 1})")
    mask = np.zeros(total_heads, dtype=bool)
    for index in indices:
        if (
            isinstance(index, bool)
            or not isinstance(index, numbers.Integral)
            or not 0 <= index < total_heads
        ):
            raise UsageError(
                f"{name} index {index!r} is not a head column: must be a whole "
                f"number in 0..{total_heads - 1} ({total_heads} heads)"
            )
        mask[int(index)] = True
    return mask


def _eligible_columns(total_heads: int, never_ablate: Sequence[int]) -> np.ndarray:
    eligible = np.flatnonzero(~head_column_mask(never_ablate, total_heads, "never_ablate"))
    if eligible.size == 0:
        raise UsageError(
            f"never_ablate lists all {total_heads} heads: at least one head must be eligible "
            "for knockout"
        )
    return eligible


def knockouts_per_mask(sparsity: float, num_eligible: int) -> int:
    """Heads a stratified mask knocks out: ``max(1, round(sparsity * num_eligible))``.

    At least one, so that a tiny model or sparsity still measures something. Python's
    ``round`` (halves to even) is used: the method's ``round(p·N)``.
    """
    return max(1, int(round(sparsity * num_eligible)))


#: A design matrix is held in memory and saved as one bool array (a byte an entry): the
#: most entries one may have.
MAX_DESIGN_BYTES = 256 * 2**20


def design_matrix(
    kind: str,
    num_masks: int,
    total_heads: int,
    sparsity: float,
    seed: int,
    never_ablate: Sequence[int] = (),
) -> np.ndarray:
    """A ``(num_masks, total_heads)`` bool matrix; ``True`` = head knocked out in that mask.

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
        raise UsageError(f"unknown design kind {kind!r}: allowed kinds are {', '.join(DESIGNS)}")
    num_masks = check_number(num_masks, "num_masks", whole=True, min_val=1)
    total_heads = check_number(total_heads, "total_heads", whole=True, min_val=1)
    seed = check_number(seed, "seed", whole=True, min_val=0)
    if num_masks * total_heads > MAX_DESIGN_BYTES:  # before numpy asks for the memory
        raise UsageError(f"num_masks={num_masks} x total_heads={total_heads}: the design "
                         f"would take {num_masks * total_heads / 2**30:.1f} GiB; at most "
                         f"{max(1, MAX_DESIGN_BYTES // total_heads)} masks of "
                         f"{total_heads} heads fit its {MAX_DESIGN_BYTES // 2**20} MiB")
    # The fraction of heads knocked out per mask: 0 would measure nothing, 1 everything.
    sparsity = check_number(sparsity, "sparsity", min_val=0, max_val=1,
                            include_boundaries="neither")
    eligible = _eligible_columns(total_heads, never_ablate)
    rng = np.random.default_rng(seed)
    knocked_out = np.zeros((num_masks, total_heads), dtype=bool)

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


def same_masks(matrix: np.ndarray, heads: Iterable[int], among: Iterable[int]
               ) -> dict[int, list[int]]:
    """For each of ``heads``, the other columns of ``among`` that the masks knocked out in
    exactly the same measurements (identical columns; none for a head never knocked
    out, about which the masks say nothing anyway). The masks cannot tell such heads
    apart: a fit that credits one of them a mask's drop credits it for a reason other
    than the masks. Heads with none are left out."""
    knocked_out = np.asarray(matrix, dtype=bool)
    if knocked_out.ndim != 2:
        raise ValueError(
            f"design matrix must be 2-D (masks × heads), got shape {knocked_out.shape}"
        )
    pool = [int(h) for h in among]
    found = {}
    for head in map(int, heads):
        column = knocked_out[:, head]
        if not column.any():
            continue
        alike = [h for h in pool if h != head and np.array_equal(knocked_out[:, h], column)]
        if alike:
            found[head] = alike
    return found
