"""Confirmation: the likeliest heads knocked out one at a time, in rounds, ranked by what
they measured.

A random design (the *screen*) and the attribution prior each name likely heads, and each
misses some: the Lasso on a few masks is noisy, and attribution patching misses heads
whose knockout saturates (a false negative it cannot see). Confirmation spends the rest
of a budget on knocking out their candidates alone. A head measured alone has its effect
measured, not estimated: the same quantity as an exhaustive one-head-at-a-time search, on
the same examples.

The candidates come in small rounds (``ROUND``). Each task's *sources* — every ranking
the prior gives (``prior.PRIOR_POINTS``) and the screen — take turns, one head each, and
the turns go on across rounds, so every source gets its share of the budget. Between
rounds the screen is refitted with the confirmed heads' measured changes held fixed
(``screen``): what the masks still cannot explain points at what is left to find, and
the screen's order is informative all the way down (its Lasso's zeros ordered by the
marginal contrast of the same residual, never by head index).

The procedure (``confirmation``) is a pure function of its sources and of what each
round measured, and a round's picks do not depend on the budget, so a run with a larger
``--confirm`` measures only what is new and a killed run resumes to the same picks.
Everything works on flat head indices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .recovery import HeadLasso, harm

__all__ = ["ROUND", "Confirmation", "confirmation", "confirmed_order", "confirmed_top",
           "marginal_contrast", "screen", "tied_with_above"]

#: Heads measured alone per round: small, so that each round's measurements steer the
#: next picks, and a whole number of masks-per-pass batches on a GPU.
ROUND = 5

#: What a head measured alone changed, per task: (score change, logprob change).
Changes = Mapping[int, tuple[float, float]]


def marginal_contrast(design_matrix: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Per head: the mean score of the masks that knock it out minus the mean of those
    that do not (0 for a head in every mask or in none: no evidence either way)."""
    knocked_out = np.asarray(design_matrix, dtype=bool)
    y = np.asarray(scores, dtype=np.float64)
    count = knocked_out.sum(axis=0)
    inside = knocked_out.T.astype(np.float64) @ y
    with np.errstate(invalid="ignore", divide="ignore"):
        contrast = inside / count - (y.sum() - inside) / (len(y) - count)
    contrast[(count == 0) | (count == len(y))] = 0.0
    return contrast


@dataclass(frozen=True)
class Screen:
    """The masks' fit with some heads' changes held fixed: ``order`` lists the other
    heads most harmful first (ties of the fit by marginal contrast, then by index),
    ``effects`` is every head's estimate (the fixed ones' given changes), ``contrast``
    every head's marginal contrast on the same residual."""

    order: list[int]
    effects: np.ndarray
    contrast: np.ndarray
    r2: float


def screen(design_matrix: np.ndarray, scores: np.ndarray, higher_is_better: bool, *,
           alpha: float = 0.01, penalty_weights: np.ndarray | None = None,
           fixed: Mapping[int, float] | None = None, exclude: Iterable[int] = ()) -> Screen:
    """Fit the masks (``HeadLasso``, intercept fitted) on the scores less each mask's sum
    of the ``fixed`` heads' measured changes, over the heads not fixed. With nothing
    fixed this is the plain compressed-sensing fit."""
    knocked_out = np.asarray(design_matrix, dtype=bool)
    y = np.asarray(scores, dtype=np.float64)
    total = knocked_out.shape[1]
    fixed = dict(fixed or {})
    held = np.array(sorted(fixed), dtype=np.int64)
    residual = y - (knocked_out[:, held] @ np.array([fixed[h] for h in held])
                    if held.size else 0.0)
    free = np.setdiff1d(np.arange(total), held)
    effects = np.zeros(total)
    effects[held] = [fixed[h] for h in held]
    r2 = 0.0
    if free.size and len(y) >= 2:
        weights = None if penalty_weights is None else np.asarray(penalty_weights)[free]
        fit = HeadLasso(alpha=alpha, penalty_weights=weights).fit(knocked_out[:, free],
                                                                  residual)
        effects[free], r2 = fit.coef_, fit.r2_
    contrast = marginal_contrast(knocked_out, residual) if len(y) >= 2 else np.zeros(total)
    excluded = {*map(int, exclude), *map(int, held)}
    fitted_harm = harm(effects, higher_is_better)
    contrast_harm = harm(contrast, higher_is_better)
    order = sorted((int(h) for h in free if int(h) not in excluded),
                   key=lambda h: (-fitted_harm[h], -contrast_harm[h], h))
    return Screen(order, effects, contrast, float(r2))


@dataclass(frozen=True)
class Confirmation:
    """What ``confirmation`` did: the heads picked in each round (in order), and per task
    the heads its sources picked."""

    rounds: list[list[int]]
    picked_by: dict[str, list[int]]

    @property
    def heads(self) -> list[int]:
        return [h for picks in self.rounds for h in picks]


def confirmation(sources: Mapping[str, Sequence[Sequence[int]]],
                 screens: Mapping[str, Callable[[Changes], Sequence[int]]],
                 measure: Callable[[list[int]], Mapping[str, Changes]], budget: int, *,
                 round_size: int = ROUND, skip: Iterable[int] = ()) -> Confirmation:
    """Pick and measure up to ``budget`` heads alone, ``round_size`` per round.

    ``sources``: per task, its fixed rankings (the prior's; likeliest first).
    ``screens``: per task, the screen's ranking given the changes measured so far (a task
    without one uses its fixed rankings alone). ``measure(heads)``: what those heads
    changed, per task, as ``{head: (score change, logprob change)}`` for every head
    measured so far (a head it cannot give, as in a bootstrap replay, stays unmeasured).
    A round's picks: the tasks in turn, each task's next source in turn (fixed rankings,
    then the screen) naming its likeliest head not yet picked, measured or in ``skip``.
    """
    tasks = list(sources)
    left_out = {int(h) for h in skip}
    turns = dict.fromkeys(tasks, 0)
    picked_by: dict[str, list[int]] = {t: [] for t in tasks}
    changes: dict[str, dict[int, tuple[float, float]]] = {t: {} for t in tasks}
    picked: list[int] = []
    rounds: list[list[int]] = []
    while len(picked) < budget:
        per_task = {t: [*sources[t], *([screens[t](changes[t])] if t in screens else [])]
                    for t in tasks}
        taken = set(picked) | left_out
        batch: list[int] = []
        size = min(round_size, budget - len(picked))
        live = [t for t in tasks if per_task[t]]
        while len(batch) < size and live:
            for task in list(live):
                head = _next_pick(per_task[task], turns, task, taken)
                if head is None:
                    live.remove(task)
                    continue
                batch.append(head)
                picked_by[task].append(head)
                taken.add(head)
                if len(batch) == size:
                    break
        if not batch:
            break  # every head measured or skipped
        picked += batch
        rounds.append(batch)
        measured = measure(list(picked))
        for task in tasks:
            changes[task] = dict(measured.get(task, {}))
    return Confirmation(rounds, picked_by)


def _next_pick(orders: Sequence[Sequence[int]], turns: dict[str, int], task: str,
               taken: set[int]) -> int | None:
    """The task's next source's likeliest head not taken (a source with none left passes
    its turn on); None when no source has one."""
    for _ in range(len(orders)):
        order = orders[turns[task] % len(orders)]
        turns[task] += 1
        head = next((int(h) for h in order if int(h) not in taken), None)
        if head is not None:
            return head
    return None


def confirmed_order(alone: Changes, screen_order: Sequence[int], higher_is_better: bool,
                    exclude: Iterable[int] = ()) -> list[int]:
    """The ranking: heads measured alone first, most harmful first by their measured
    change (``alone[head] = (score change, logprob change)``; equal score changes by the
    logprob's, then by index), then every other head in ``screen_order``."""
    excluded = set(exclude)
    confirmed = sorted((h for h in alone if h not in excluded), key=lambda h: (
        -float(harm(alone[h][0], higher_is_better)), -float(harm(alone[h][1], True)), h))
    return confirmed + [int(h) for h in screen_order if h not in alone and h not in excluded]


def confirmed_top(alone: Changes, pool: Iterable[int], top_k: int,
                  higher_is_better: bool) -> list[int]:
    """The ``top_k`` heads of ``pool`` (all measured alone) with a harmful measured change,
    most harmful first: what a confirmation that had measured only ``pool`` would report."""
    order = confirmed_order({h: alone[h] for h in pool}, (), higher_is_better)
    return [h for h in order[:top_k] if harm(alone[h][0], higher_is_better) > 0]


def tied_with_above(order: Sequence[int], alone: Changes, fit: Screen) -> list[int]:
    """The heads of ``order`` whose evidence equals the head ranked just above them: the
    same measured changes (both measured alone), or the same fitted effect and marginal
    contrast (neither measured). Their order between them is the head index, which says
    nothing: a ranking must call them ties."""
    def evidence(head: int) -> tuple:
        if head in alone:
            return ("alone", *alone[head])
        return ("fit", float(fit.effects[head]), float(fit.contrast[head]))

    return [int(below) for above, below in zip(order, order[1:], strict=False)
            if evidence(above) == evidence(below)]
