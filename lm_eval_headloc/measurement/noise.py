"""The noise of a measured change: the standard error of one score's difference from another.

A measurement scores a mask on a sample of n examples per task, so its score is a sample
mean with noise of its own. Every measurement of a run uses the same examples, so the
noise of a *change* between two measurements is the paired one: it comes from how the
per-example differences scatter, not from the two scores' separate noises (an example one
mask gets right the other mostly gets right too, which the difference cancels). A record
of ``measurements.jsonl`` keeps the per-example values its scores are the means of
(``examples``, from ``TaskScore.examples``), as strata: the score is the mean over strata of
each stratum's mean (one stratum for a task, one per subtask where the score is the mean of
theirs), and the strata are sampled separately, so their variances add.

Plain Python: nothing here needs a model or lm-eval.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["change_se", "paired_se"]

Strata = Sequence[Sequence[float]]


def paired_se(a: Strata | None, b: Strata | None) -> float | None:
    """The standard error of ``score(a) - score(b)``, where a score is the mean over strata
    of each stratum's mean and ``a`` and ``b`` are two measurements' per-example values of
    one task on the same examples (a record's ``examples[task]``).

    From the per-example differences ``d = a_s - b_s`` of each stratum s of n_s examples:
    ``sqrt(sum_s var(d_s, ddof=1) / n_s) / S`` over the S strata; a stratum of one example
    adds nothing (no spread to read). None where either is None, their shapes differ (not
    the same examples), or a value is not a finite number.
    """
    if a is None or b is None or len(a) != len(b) or not a:
        return None
    total = 0.0
    for stratum_a, stratum_b in zip(a, b, strict=True):
        if len(stratum_a) != len(stratum_b) or not stratum_a:
            return None
        diffs = []
        for x, y in zip(stratum_a, stratum_b, strict=True):
            if not (_finite(x) and _finite(y)):
                return None
            diffs.append(float(x) - float(y))
        n = len(diffs)
        if n > 1:
            mean = math.fsum(diffs) / n
            variance = math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)
            total += variance / n
    return math.sqrt(total) / len(a)


def change_se(record: Mapping[str, Any], baseline: Mapping[str, Any], task: str
              ) -> float | None:
    """The standard error of ``task``'s change from ``baseline``'s score to ``record``'s
    (two records of ``measurements.jsonl``, or of a store), from their per-example values
    (``paired_se``); None where either record has none for the task."""
    return paired_se(record.get("examples", {}).get(task),
                     baseline.get("examples", {}).get(task))


def _finite(value: Any) -> bool:
    # A record read back writes a non-finite value as null (common.files); bool is no score.
    return isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and math.isfinite(value)
