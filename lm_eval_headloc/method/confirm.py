"""Confirmation: which heads are knocked out alone, the likeliest first, in rounds (how
what they measured ranks them: ``rank``).

A random design (the *screen*) and the attribution prior each name likely heads, and each
misses some: the Lasso on a few masks is noisy, and attribution patching misses heads
whose knockout saturates (a false negative it cannot see). Confirmation spends the rest
of a budget on knocking out their candidates alone. A head measured alone has its effect
measured, not estimated: the same quantity as an exhaustive one-head-at-a-time search, on
the same examples.

The candidates come in small rounds (``ROUND``). Each task's *sources* — every ranking
the prior gives (``attribution.PRIOR_POINTS``) and the screen — take turns, one head each, and
the turns go on across rounds, so every source gets its share of the budget. Between
rounds the screen is refitted with the confirmed heads' measured changes held fixed
(``screen``): what the masks still cannot explain points at what is left to find, and
the screen's order is informative all the way down (its Lasso's zeros ordered by the
marginal contrast of the same residual, never by head index).

A budget in measurement-equivalents is spent as the prior's allowance, masks and heads
measured alone (``budget.budget_split``; the defaults' 54 as 8 + 12 + 34 with a prior,
27 + 27 without one: ``budget.default_split``). Heads measured alone
rank by one rule (``rank.rank_measured``), whether a confirmation picked them or one-shot
greedy measured every head.

The procedure (``confirmation``) is a pure function of its sources and of what each
round measured, and a round's picks do not depend on the budget, so a run with a larger
``--confirm`` measures only what is new and a killed run resumes to the same picks.
Everything works on flat head indices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from lm_eval_headloc.method.lasso import HeadLasso, harm, less_fixed, round_off

__all__ = ["PRIOR_EASE", "ROUND", "Changes", "ConfirmRecord", "Confirmation", "GroupStage",
           "Screen", "alternated",
           "confirmation", "marginal_contrast", "prior_penalty_weights", "prior_rankings",
           "prior_weights", "screen"]

#: Heads measured alone per round: small, so that each round's measurements steer the
#: next picks, and a whole number of masks-per-pass batches on a GPU.
ROUND = 5

#: What a head measured alone changed, per task: (score change, logprob change).
Changes = Mapping[int, tuple[float, float | None]]

# --- the prior's part: its rankings and the screen's penalty weights ---------------------

#: How much the prior eases the Lasso penalty of the head it finds most harmful: its
#: penalty is divided by 1 + PRIOR_EASE (others by less; harmless-looking heads keep 1).
PRIOR_EASE = 1.0


def prior_penalty_weights(harm_estimates: np.ndarray, ease: float = PRIOR_EASE) -> np.ndarray:
    """Per-head Lasso penalty factors from a prior's harm estimates (positive = the
    knockout hurts): ``1 / (1 + ease * share)``, ``share`` the head's harm over the
    largest. A mild adaptive Lasso: no head's penalty rises, so a head the prior misses
    (a false negative) is found as without a prior."""
    hurt = np.clip(np.asarray(harm_estimates, dtype=np.float64), 0.0, None)
    top = hurt.max() if hurt.size else 0.0
    share = hurt / top if top > 0 else np.zeros_like(hurt)
    return 1.0 / (1.0 + ease * share)


def prior_weights(estimates: np.ndarray | None) -> np.ndarray | None:
    """The screen's penalty weights from a prior's estimates of the logprob's change
    (``(points, heads)`` or one point; most negative = most harmful): the first point's,
    the clean run's, eases the penalty of likely heads (``prior_penalty_weights``); None
    without a prior."""
    if estimates is None:
        return None
    return prior_penalty_weights(harm(np.atleast_2d(estimates)[0], higher_is_better=True))


def prior_rankings(estimates: np.ndarray | None) -> list[list[int]]:
    """The prior's rankings, one per point of ``estimates`` (``(points, heads)`` or one
    point), most harmful (most negative estimated change of the logprob) first, equal
    estimates in head order; [] without a prior."""
    if estimates is None:
        return []
    return [[int(h) for h in np.argsort(point, kind="stable")]
            for point in np.atleast_2d(estimates)]


def prior_found_nothing(estimates: np.ndarray | None) -> bool:
    """Whether every point of the prior estimated the same change for every head (up to
    round-off: e.g. all 0 where no head's output reaches the answer): its rankings are
    then the head index, not an order. A column with no estimate (+inf: a neuron group)
    is no evidence either way. False without a prior."""
    if estimates is None:
        return False
    for point in np.atleast_2d(np.asarray(estimates, dtype=np.float64)):
        known = point[np.isfinite(point)]
        if known.size and np.ptp(known) > round_off(known):
            return False
    return True


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
    residual = less_fixed(knocked_out, y, fixed)
    free = np.setdiff1d(np.arange(total), held)
    effects = np.zeros(total)
    effects[held] = [fixed[h] for h in held]
    r2 = 0.0
    if free.size and len(y) >= 2:
        fit = HeadLasso(alpha=alpha, penalty_weights=penalty_weights,
                        fixed_effects=fixed).fit(knocked_out, y)
        effects, r2 = fit.coef_, fit.r2_
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


def alternated(orders: Sequence[Sequence[int]], count: int) -> list[int]:
    """The first ``count`` distinct heads of ``orders`` taken in turn, each naming its
    likeliest head not taken yet (one with none left passes its turn): what a
    confirmation with these sources picks when nothing it measures steers the picks."""
    return confirmation({"": orders}, {}, lambda _heads: {}, count, round_size=count).heads


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


# --- what a run records of it (config.json's "confirm") -------------------------------


@dataclass
class GroupStage:
    """What the group tests did (``confirm["groups"]``): the sets measured, round by
    round (each set by its members' names; a set of one is a component measured alone),
    the components they narrowed down to (``alone``), the groups' ``size``, the tests'
    ``budget``, and the cap on the run's measurements with what was spent before the
    group tests (``cap``, ``spent_before``; None in runs from before the cap)."""

    rounds: list[list[list[str]]] = field(default_factory=list)
    alone: list[str] = field(default_factory=list)
    size: int | None = None
    budget: int | None = None
    cap: int | None = None
    spent_before: int | None = None
    other: dict[str, Any] = field(default_factory=dict)  # keys a later version adds

    _ORDER: ClassVar[tuple[str, ...]] = ("cap", "spent_before", "budget", "size", "rounds",
                                         "alone")

    @property
    def sets(self) -> list[list[str]]:
        """The sets of two or more components, in the order measured."""
        return [members for batch in self.rounds for members in batch if len(members) > 1]

    @property
    def tested(self) -> int:
        """How many sets the group tests measured."""
        return sum(len(batch) for batch in self.rounds)

    def to_json(self) -> dict[str, Any]:
        return _json_of(self, self._ORDER)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupStage:
        return _from_json(cls, data, cls._ORDER)


@dataclass
class ConfirmRecord:
    """What a run records of its confirmation (config.json's ``confirm``): the components
    measured alone (``heads``, names, in the order picked), by round (``rounds``,
    ``round_size``) and by the task whose sources picked them (``picked_by``); the round
    a larger ``--confirm`` would measure next (``next``, per task); the columns no mask
    knocked out (``never``); and the group tests that followed (``groups``). Runs from
    before some of these leave them out (None)."""

    heads: list[str]
    never: list[int] = field(default_factory=list)
    round_size: int | None = None
    rounds: list[list[str]] | None = None
    picked_by: dict[str, list[str]] | None = None
    next: dict[str, list[str]] | None = None
    groups: GroupStage | None = None
    other: dict[str, Any] = field(default_factory=dict)  # keys a later version adds

    _ORDER: ClassVar[tuple[str, ...]] = ("heads", "round_size", "rounds", "picked_by",
                                         "next", "never", "groups")

    @property
    def alone(self) -> list[str]:
        """Every component measured alone: the confirmation's, then those the group tests
        narrowed down to."""
        found = [] if self.groups is None else self.groups.alone
        return list(dict.fromkeys([*self.heads, *found]))

    @property
    def group_sets(self) -> list[list[str]]:
        """The group tests' sets of two or more components (none without group tests)."""
        return [] if self.groups is None else self.groups.sets

    def to_json(self) -> dict[str, Any]:
        return _json_of(self, self._ORDER)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ConfirmRecord:
        return _from_json(cls, data, cls._ORDER)

    @classmethod
    def of(cls, value: ConfirmRecord | Mapping[str, Any] | None) -> ConfirmRecord | None:
        """``value`` as a record: a record as it is, config.json's dict read, None kept."""
        if value is None or isinstance(value, ConfirmRecord):
            return value
        return cls.from_json(value)


def _json_of(record: Any, order: Sequence[str]) -> dict[str, Any]:
    """A record's JSON: its keys in the order written since they existed, a field a run
    did not record left out, the keys a later version added kept."""
    data: dict[str, Any] = {}
    for key in order:
        value = getattr(record, key)
        if value is not None:
            data[key] = value.to_json() if hasattr(value, "to_json") else value
    return {**data, **record.other}


def _from_json(cls: Any, data: Mapping[str, Any], order: Sequence[str]) -> Any:
    values = {key: data[key] for key in order if key in data}
    if isinstance(values.get("groups"), Mapping):
        values["groups"] = GroupStage.from_json(values["groups"])
    return cls(**values, other={k: v for k, v in data.items() if k not in order})
