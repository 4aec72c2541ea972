"""The locate loop: a task's components ranked by compressed sensing, over a measurement
and a store of its measurements.

``locate_loop`` measures the task with random sets of components knocked out together
(the pilot's masks with ``--sparsity auto``, then the design's; ``--masks auto`` in rounds
until every top-k component is stable), measures the likeliest alone (``--confirm``) and
the rest in groups (``--group-tests``), and fits the Lasso (``rank.fit_rankings``). Every
measurement goes through ``measurement.store.run_plan``, so a store that already holds
some (a resumed run folder) is measured only where it lacks them, and every decision
follows from the seed and the measurements: a run resumed on the same store makes the
same decisions. It needs no run folder: a notebook passes a ``MemoryStore``
(``locate_components``); ``commands.locate`` passes the run folder and saves its record
at each ``checkpoint``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from lm_eval_headloc.common import timing
from lm_eval_headloc.intervention.components import Component
from lm_eval_headloc.measurement.store import (
    MeasurementStore,
    MemoryStore,
    phase_bar,
    run_plan,
)
from lm_eval_headloc.method.columns import Columns
from lm_eval_headloc.method.confirm import (
    ROUND,
    Changes,
    ConfirmRecord,
    GroupStage,
    alternated,
    confirmation,
    prior_rankings,
    prior_weights,
    screen,
)
from lm_eval_headloc.method.designs import design_matrix
from lm_eval_headloc.method.group_tests import (
    MAX_GROUP,
    GroupTesting,
    Harm,
    Z,
    background_harm,
    entry_bar,
    group_key,
    group_order,
    group_size,
    group_testing,
)
from lm_eval_headloc.method.lasso import harm
from lm_eval_headloc.method.pilot import (
    KEEP,
    UNFITTED,
    check_pilot_fits,
    choose_sparsity,
    pilot_design,
)
from lm_eval_headloc.method.rank import (
    alone_changes,
    alone_key,
    fit_rankings,
    mask_keys,
    measured_alone,
    measured_harm,
)
from lm_eval_headloc.method.ranking import Ranking

if TYPE_CHECKING:
    from lm_eval_headloc.measurement.measure import Measurement

__all__ = ["GroupPlan", "LocateState", "LoopSettings", "auto_rounds",
           "locate_components", "locate_loop", "plan_groups", "predicted_help"]

#: --masks auto: masks in the first round, and each round's growth (a share of the masks
#: measured so far, at least ROUND_MIN), so a run checks its stability ~log(M) times.
FIRST_ROUND, ROUND_MIN, ROUND_GROWTH = 20, 10, 0.25


class LoopSettings(Protocol):
    """The settings the loop reads (a ``runs.spec.RunSpec`` with its budget decided,
    e.g. ``RunSpec(masks=100, confirm=10)``)."""

    masks: int | str | None  # a count, or "auto": rounds up to design_rows
    design: str
    sparsity: float | str  # a share, or "auto": the pilot chooses
    confirm: int | None
    group_tests: int | None  # at most this many group tests (None: until certified)
    alpha: float
    top_k: int
    bootstrap: int | None
    progress: bool

    @property
    def design_rows(self) -> int: ...

    @property
    def masks_seed(self) -> int: ...

    @property
    def masks_per_pass(self) -> int | None: ...

    def measurement_cap(self, columns: int) -> int: ...


@dataclass
class LocateState:
    """What the loop decides and measures, in the order it does: the pilot's choice, the
    design and its measurement keys, the records, the masks used, the confirmation and
    the rankings. ``commands.locate`` passes its run record (``runs.record.LocateRun``,
    which has these attributes) so that each ``checkpoint`` saves them."""

    pilot: dict[str, Any] | None = None
    design: np.ndarray | None = field(default=None, repr=False)
    row_keys: list[str] | None = None
    records: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    masks_used: int | None = None
    confirm: ConfirmRecord | None = None
    rankings: dict[str, Ranking] = field(default_factory=dict)


def auto_rounds(max_masks: int) -> list[int]:
    """The mask counts after which ``--masks auto`` checks whether to stop."""
    counts = [min(FIRST_ROUND, max_masks)]
    while counts[-1] < max_masks:
        step = max(ROUND_MIN, int(counts[-1] * ROUND_GROWTH))
        counts.append(min(max_masks, counts[-1] + step))
    return counts


def locate_components(measure: Measurement, settings: LoopSettings, columns: Columns | None = None,
                      *, store: MeasurementStore | None = None,
                      priors: Mapping[str, np.ndarray] | None = None,
                      never: Sequence[Component] = (), exclude: Sequence[Component] = (),
                      allowance: int = 0) -> dict[str, Ranking]:
    """Each of ``measure``'s tasks' ranking of ``columns`` (default: every head of its
    model) by ``locate_loop``, in a ``MemoryStore`` unless ``store`` is given: a
    notebook's way to locate, given a measurement (``HarnessMeasurement``) and no run
    folder. Pass the same store again and nothing is measured twice. ``allowance``: the
    measurement-equivalents ``priors`` cost, counted against ``--max-measurements``."""
    knockout = measure.lm.knockout
    if columns is None:
        columns = Columns.heads(knockout.num_layers, knockout.heads_per_layer,
                                knockout.layers_with_heads)
    state = locate_loop(measure, MemoryStore() if store is None else store, columns,
                        [name for name, _ in measure.tasks], settings, priors=priors,
                        never=never, exclude=exclude, heads_per_layer=knockout.heads_per_layer,
                        allowance=allowance)
    return state.rankings


def locate_loop(measure: Measurement, store: MeasurementStore, columns: Columns,
                tasks: Sequence[str], settings: LoopSettings, *,
                priors: Mapping[str, np.ndarray] | None = None,
                never: Sequence[Component] = (), exclude: Sequence[Component] = (),
                heads_per_layer: int | None = None, state: Any = None,
                checkpoint: Callable[[str], None] | None = None, allowance: int = 0) -> Any:
    """Measure and fit ``tasks``' rankings of ``columns``; returns ``state`` (a new
    ``LocateState`` unless given) holding what was decided, measured and fitted.

    ``priors``: task -> each column's attribution estimates (they order the confirmation
    and ease the Lasso's penalty); ``never``: components no mask knocks out; ``exclude``:
    components left out of the ranking. ``checkpoint(phase)`` is called once the design is
    fixed ("designed") and once everything is measured ("measured"), with ``state`` up to
    date, so a caller can save what a resumed run must find. ``allowance``: the
    measurement-equivalents spent before the loop (the prior's), which count against
    ``settings.measurement_cap``: the group tests go on until every column is measured
    alone or ruled out (the run is certified) or the run has spent its cap.
    """
    state = LocateState() if state is None else state
    saved = checkpoint or (lambda phase: None)
    never_columns = [columns.index(h) for h in never if h in columns]
    excluded = columns.holding(exclude)
    per_pass = settings.masks_per_pass
    sparsity, row_keys, rows, state.pilot = _pilot(store, measure, settings, tasks, columns,
                                                   never_columns)
    spent = UNFITTED if state.pilot is not None else 0
    main = settings.design_rows - len(row_keys) - spent
    with timing.phase("design"):
        matrix = np.vstack([rows, design_matrix(settings.design, main, len(columns),
                                                sparsity, settings.masks_seed,
                                                never_columns)])
        state.design, state.row_keys = matrix, [*row_keys, *mask_keys(main)]
    saved("designed")
    keys = state.row_keys
    plan = [("baseline", [])] + [(key, columns.knocked_out(row))
                                 for key, row in zip(keys, matrix, strict=True)]
    checks = ([len(rows) + n for n in auto_rounds(main)] if settings.masks == "auto"
              else [len(matrix)])

    def fit(used: int, confirmed: ConfirmRecord | None) -> dict[str, Ranking]:
        return fit_rankings(matrix[:used], state.records, tasks, columns, settings.alpha,
                            exclude, top_k=settings.top_k, bootstrap=settings.bootstrap,
                            seed=settings.masks_seed, priors=priors, keys=keys[:used],
                            confirmed=confirmed, heads_per_layer=heads_per_layer, never=never)

    rankings = None
    stored = {r["key"] for r in store.measurements()}
    # One bar for --masks auto's rounds, counting the masks it measures: not the baseline
    # the plan carries ("locate 5/5" was drawn for --masks 4), nor the pilot's own bar's.
    phase = plan[1 + len(row_keys):checks[-1] + 1]
    with phase_bar("locate", len(phase), sum(key in stored for key, _ in phase),
                   settings.progress) as bar:
        for used in checks:
            # Each round measures what is not in the store yet; --masks auto then fits the
            # first `used` rows and stops once every top-k component is stable in the
            # bootstrap: the decision depends only on the seed and the measurements, so a
            # killed run resumes to the same stop.
            state.records = run_plan(store, measure, plan[:used + 1], desc="locate",
                                     masks_per_pass=per_pass, bar=bar)
            if settings.masks != "auto":
                break
            rankings = fit(used, None)
            if all(r.settled(settings.top_k) for r in rankings.values()):
                break
    state.masks_used = used + spent
    if settings.confirm:
        state.confirm = _confirm(store, measure, settings, tasks, columns, matrix[:used],
                                 keys[:used], priors, never_columns, excluded)
        spent_before = allowance + state.masks_used + len(state.confirm.heads)
        cap = settings.measurement_cap(len(columns))
        budget = max(0, cap - spent_before)
        if settings.group_tests is not None:
            budget = min(budget, int(settings.group_tests))
        state.confirm.groups = _group_test(store, measure, settings, tasks, columns,
                                           matrix[:used], keys[:used], priors, never_columns,
                                           excluded, state.confirm, budget)
        state.confirm.groups.cap, state.confirm.groups.spent_before = cap, spent_before
        state.records = {r["key"]: r for r in store.measurements()}
        rankings = None  # the masks' fit alone was --masks auto's stopping rule
    saved("measured")
    # Fitted once, with its bootstrap, on everything measured (--masks auto without
    # --confirm: its last round's fit is that fit).
    state.rankings = fit(used, state.confirm) if rankings is None else rankings
    return state


def _pilot(store: MeasurementStore, measure: Measurement, settings: LoopSettings,
           tasks: Sequence[str], columns: Columns, never: Sequence[int]
           ) -> tuple[float, list[str], np.ndarray, dict[str, Any] | None]:
    """(sparsity, pilot row keys, pilot rows, what the run records of the pilot): with
    ``--sparsity auto`` the pilot is measured and chooses; its masks come first in the
    design and join the fit, its floor mask does not (``UNFITTED``)."""
    if settings.sparsity != "auto":
        return float(settings.sparsity), [], np.zeros((0, len(columns)), dtype=bool), None
    keys, levels, pilot = pilot_design(len(columns), settings.masks_seed, never)
    if settings.masks is not None:  # checked by prepare too; locate_components is not
        check_pilot_fits(settings.design_rows, len(keys), settings.masks)
    plan = [("baseline", [])] + [(key, columns.knocked_out(row))
                                 for key, row in zip(keys, pilot, strict=True)]
    stored = {r["key"] for r in store.measurements()}
    with phase_bar("pilot", len(keys), sum(key in stored for key in keys),
                   settings.progress) as bar:  # the pilot's masks, as locate's bar counts
        records = run_plan(store, measure, plan, desc="pilot",
                           masks_per_pass=settings.masks_per_pass, bar=bar)
    sparsity, kept = choose_sparsity(levels, keys, records, tasks)
    chosen = {"sparsity": sparsity, "kept": kept, "measurements": len(keys),
              "keep_at_least": KEEP}
    return sparsity, keys[:-UNFITTED], pilot[:-UNFITTED], chosen


def _confirm(store: MeasurementStore, measure: Measurement, settings: LoopSettings,
             tasks: Sequence[str], columns: Columns, design: np.ndarray, keys: Sequence[str],
             priors: Mapping[str, np.ndarray] | None, never: Sequence[int],
             excluded: Sequence[int]) -> ConfirmRecord:
    """Measure ``--confirm`` components alone in rounds (``confirm.confirmation``): the
    prior's rankings and the screen, refitted after each round with what it measured;
    returns what the run's record keeps of it (``fit_rankings``' ``confirmed``).
    Components never knocked out or excluded from the ranking are no candidates. Every
    pick follows from the stored measurements, so a resumed run makes the same picks and
    measures only what is missing."""
    records = {r["key"]: r for r in store.measurements()}
    higher = {t: bool(records["baseline"]["higher_is_better"][t]) for t in tasks}
    scores = {t: np.array([records[k]["scores"][t] for k in keys]) for t in tasks}

    def screen_of(task: str) -> Callable[[Changes], list[int]]:
        weights = prior_weights(None if priors is None else priors[task])
        return lambda changes: screen(
            design, scores[task], higher[task], alpha=settings.alpha, penalty_weights=weights,
            fixed={h: c[0] for h, c in changes.items()}, exclude=excluded).order

    def measured(heads: list[int]) -> dict[str, Changes]:
        done = run_plan(store, measure, [("baseline", [])] + [
            (alone_key(columns[i]), columns.members(i)) for i in heads],
            desc="confirm", masks_per_pass=settings.masks_per_pass, bar=bar)
        return {t: alone_changes(done, heads, t, columns) for t in tasks}

    def stored(heads: list[int]) -> dict[str, Changes]:
        records.update({r["key"]: r for r in store.measurements()})
        known = [h for h in heads if alone_key(columns[h]) in records]
        return {t: alone_changes(records, known, t, columns) for t in tasks}

    sources = {t: prior_rankings(None if priors is None else priors[t]) for t in tasks}
    screens = {t: screen_of(t) for t in tasks} if len(design) >= 2 else {}
    skip = sorted({*never, *excluded})
    budget = int(settings.confirm or 0)
    # One bar for every round (a resumed run's picks are those stored: the same picks),
    # its total what the rounds measure: --confirm 34 on 8 heads drew "0/34".
    measured_before = sum(key.startswith(alone_key("")) for key in records)
    candidates = len(columns) - len(skip)
    # The screens' refits between rounds are fits; the rounds' measurements, measurements.
    with phase_bar("confirm", min(budget, candidates), measured_before,
                   settings.progress) as bar, \
            timing.phase("fit and bootstrap"):
        done = confirmation(sources, screens, measured, budget, skip=skip)
        # The round a larger --confirm would measure next: the same picks (they do not
        # depend on the budget), one round further, measuring nothing.
        ahead = confirmation(sources, screens, stored, budget + ROUND, skip=skip)

    names = columns.names
    return ConfirmRecord(
        heads=names(done.heads), round_size=ROUND, rounds=[names(r) for r in done.rounds],
        picked_by={t: names(done.picked_by[t]) for t in tasks},
        next={t: names(ahead.picked_by[t][len(done.picked_by[t]):]) for t in tasks},
        never=sorted(int(h) for h in never))


class GroupPlan(NamedTuple):
    """One task's group stage, set up (``plan_groups``)."""

    order: list[int]  # the columns to test in groups, in turn
    size: int  # the groups' size
    known: dict[tuple[int, ...], Harm]  # each set measured already (masks, alone): harm
    helpers: dict[int, float]  # column -> predicted help, the largest 1 (``predicted_help``)


def predicted_help(effects: np.ndarray, higher: bool) -> dict[int, float]:
    """The columns whose knockout ``effects`` (a prior's estimated changes, or a fit's)
    predict a help, each with its predicted help over the largest (so that tasks with
    other units compare): what a helping group's ``peeled`` takes out first."""
    helps = np.nan_to_num(-harm(np.asarray(effects, dtype=np.float64), higher))
    largest = float(helps.max()) if helps.size else 0.0
    if largest <= 0:
        return {}
    return {int(h): float(helps[h] / largest) for h in np.flatnonzero(helps > 0)}


def plan_groups(design: np.ndarray, scores: np.ndarray, baseline: float, higher: bool,
                alone: Mapping[int, float], *, alpha: float,
                penalty_weights: np.ndarray | None, top_k: int, skip: Iterable[int] = (),
                mask_se: Sequence[float] | None = None,
                alone_se: Mapping[int, float] | None = None,
                prior: np.ndarray | None = None) -> GroupPlan:
    """One task's group stage from its masks' ``scores`` and the columns measured
    ``alone`` (column -> measured change): the screen refitted with those changes held
    fixed orders the rest, those it implicates first (``group_tests.group_order``); the
    groups are sized to keep a group's typical harm under half of what the top-k's entry
    bar leaves above the noise (``group_size``, the margin ``Z`` times the median
    standard error of the sets measured); each set measured already, a mask or a column
    alone, is known by its harm and its standard error (``mask_se``, ``alone_se``; 0
    where not given). ``skip``: columns never knocked out or excluded. The columns
    predicted to help (``helpers``): by the ``prior``'s estimates of the logprob's change
    (``(points, heads)``: the clean run's point), else by the fit."""
    skip = sorted({int(h) for h in skip})
    alone_se = alone_se or {}
    alone_harms = {h: Harm(float(harm(change, higher)), float(alone_se.get(h, 0.0)))
                   for h, change in alone.items()}
    fit = screen(design, scores, higher, alpha=alpha, penalty_weights=penalty_weights,
                 fixed=dict(alone), exclude=skip)
    implicated = [h for h in fit.order if harm(fit.effects[h], higher) > 0]
    order = group_order(fit.order, implicated, design, skip={*skip, *alone})
    mask_harms = harm(np.asarray(scores, dtype=np.float64) - baseline, higher)
    ses = np.zeros(len(mask_harms)) if mask_se is None else np.asarray(mask_se, dtype=float)
    # A mask of one component is not that component measured alone, which ranks it and
    # settles it in the certificate: left to the group stage, which measures it alone
    # (run_plan copies the mask's record, measuring nothing).
    known = {tuple(int(h) for h in np.flatnonzero(row)): Harm(float(value), float(se))
             for row, value, se in zip(design, mask_harms, ses, strict=True)
             if np.count_nonzero(row) > 1}
    known.update({(h,): value for h, value in alone_harms.items()})
    margin = Z * float(np.median([h.se for h in known.values()])) if known else 0.0
    size = group_size(entry_bar(alone_harms, top_k),
                      background_harm(design, mask_harms, alone_harms), margin)
    helpers = (predicted_help(np.atleast_2d(prior)[0], True) if prior is not None
               else predicted_help(fit.effects, higher))
    left_out = {*skip, *alone}
    return GroupPlan(order, size, known,
                     {h: v for h, v in helpers.items() if h not in left_out})


def _group_test(store: MeasurementStore, measure: Measurement, settings: LoopSettings,
                tasks: Sequence[str], columns: Columns, design: np.ndarray,
                keys: Sequence[str], priors: Mapping[str, np.ndarray] | None,
                never: Sequence[int], excluded: Sequence[int],
                confirmed: ConfirmRecord, budget: int) -> GroupStage:
    """Spend up to ``budget`` measurements on the components not measured alone, knocked
    out together in groups (``group_tests.group_testing``): each task's those its screen
    implicates first, then those the masks covered least, the tasks in turn; it stops
    earlier once every component is measured alone or ruled out for every task. Returns
    what the record keeps (``ConfirmRecord.groups``). A group is keyed by its members, a
    component it narrows down to is measured as the confirmation's are (``alone_key``),
    so a resumed run looks every earlier set up and makes the same tests."""
    records = {r["key"]: r for r in store.measurements()}
    baseline = records["baseline"]
    higher = {t: bool(baseline["higher_is_better"][t]) for t in tasks}
    scores = {t: np.array([records[k]["scores"][t] for k in keys]) for t in tasks}
    skip = {*never, *excluded}
    # A head measured alone and --exclude'd since (a resumed run) sets no entry bar.
    alone = {t: {h: v for h, v in measured_alone(confirmed, records, t, columns).items()
                 if h not in skip} for t in tasks}
    alone_keys = {h: alone_key(columns[h]) for t in tasks for h in alone[t]}

    def harms(record: Mapping[str, Any]) -> dict[str, Harm]:
        return {t: measured_harm(record, baseline, t) for t in tasks}

    weights = {t: prior_weights(None if priors is None else priors[t]) for t in tasks}
    plans = {t: plan_groups(design, scores[t], baseline["scores"][t], higher[t],
                            {h: change for h, (change, _) in alone[t].items()},
                            alpha=settings.alpha, penalty_weights=weights[t],
                            top_k=settings.top_k, skip=skip,
                            mask_se=[measured_harm(records[k], baseline, t).se
                                     for k in keys],
                            alone_se={h: measured_harm(records[alone_keys[h]], baseline,
                                                       t).se for h in alone[t]},
                            prior=None if priors is None else priors[t])
             for t in tasks}
    known = {members: {t: plans[t].known[members] for t in tasks}
             for members in plans[tasks[0]].known}
    orders = [plans[t].order for t in tasks]
    size = min(MAX_GROUP, *(plans[t].size for t in tasks))
    order = alternated(orders, sum(len(o) for o in orders))
    helpers: dict[int, float] = {}  # a column's largest predicted help over the tasks
    for t in tasks:
        for h, value in plans[t].helpers.items():
            helpers[h] = max(value, helpers.get(h, 0.0))

    def key_of(members: tuple[int, ...]) -> str:
        if len(members) == 1:
            return alone_key(columns[members[0]])
        return group_key(columns.names(members))

    def measured(sets: list[tuple[int, ...]]) -> dict[tuple[int, ...], dict[str, Harm]]:
        done = run_plan(store, measure, [("baseline", [])] + [
            (key_of(s), [m for i in s for m in columns.members(i)]) for s in sets],
            desc="group tests", masks_per_pass=settings.masks_per_pass, bar=bar)
        return {s: harms(done[key_of(s)]) for s in sets}

    # What a resumed stage had measured: its groups and the components it measured alone
    # (alone keys past the confirmation's), as its bar counted them.
    confirmed_keys = {alone_key(name) for name in confirmed.heads}
    stored = sum(key.startswith("group-") or (key.startswith(alone_key(""))
                                              and key not in confirmed_keys)
                 for key in records)
    if budget == 0:  # the cap taken by the masks and the heads alone: no bar to draw
        tested = GroupTesting([], size)
    else:
        # The stage stops once the run is certified, how soon no one knows: its bar counts
        # the tests, its cap named ("12/118" was drawn for a stage that ended at 12).
        with phase_bar(f"group tests (at most {budget})", None, min(stored, budget),
                       settings.progress) as bar:
            tested = group_testing(order, known, measured, budget, size=size,
                                   top_k=settings.top_k, helpers=helpers)
    names = columns.names
    return GroupStage(budget=budget, size=tested.size,
                      rounds=[[names(s) for s in batch] for batch in tested.rounds],
                      alone=names(s[0] for s in tested.sets if len(s) == 1))
