"""How a head is ranked: the rule, and the one fit that applies it to a run's measurements.

A component knocked out alone has its change *measured*; every other component has its
change *estimated* by the Lasso over the masks (``lasso.HeadLasso``, refitted with the
measured changes held fixed: ``confirm.screen``). The ranking (``confirmed_order``):

1. the components measured alone that hurt, most harmful score change first
   (``rank_measured``: equal score changes by the larger drop of the logprob, then by
   index, which is no evidence: ``tied_with_above`` names such ties);
2. then the components not measured whose estimate hurts, in the screen's order;
3. then the components measured to do no harm; then the rest.

``fit_rankings`` applies it to a design and its measurements, one task at a time: the
screen, the order, the bootstrap's stability (each resample replays the confirmation,
``confirmation_replay``, so a head is as stable as the choice that measured it), the
evidence behind ties and the completeness certificate (``group_tests.certificate``). It
reads no run folder, so a notebook calls it on its own arrays; ``locate`` and ``refit``
call it on a run's. Measurement keys are named here (``mask_keys``, ``alone_key``; the
group tests' ``group_tests.group_key``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from lm_eval_headloc.common import timing
from lm_eval_headloc.intervention.components import Component
from lm_eval_headloc.measurement.noise import change_se, paired_se
from lm_eval_headloc.method.columns import UNITS, Column, Columns, components_of
from lm_eval_headloc.method.confirm import (
    Changes,
    ConfirmRecord,
    Screen,
    alternated,
    confirmation,
    prior_found_nothing,
    prior_rankings,
    prior_weights,
    screen,
)
from lm_eval_headloc.method.designs import same_masks
from lm_eval_headloc.method.group_tests import (
    CONFIDENCE,
    Harm,
    Z,
    background_harm,
    certificate,
    group_key,
    group_size,
)
from lm_eval_headloc.method.lasso import HeadLasso, bootstrap_stability, harm, held_out_r2
from lm_eval_headloc.method.ranking import (
    CertificateRecord,
    GroupTestRecord,
    Ranking,
    RankingFacts,
    all_measured_alone,
    largest_single_help,
)

__all__ = ["CERTIFICATE_RULE", "alone_changes", "alone_key", "confirmation_replay",
           "confirmed_order", "confirmed_top", "fit_rankings", "logprob_changes",
           "mask_keys", "measured_alone", "measured_changes", "measured_harm",
           "rank_measured", "tied_with_above"]


# --- the rule --------------------------------------------------------------------------

def measured_changes(reference: Mapping[str, Any], measured: Mapping[int, Mapping[str, Any]],
                     task: str) -> dict[int, tuple[float, float | None]]:
    """head -> (score change, logprob change) of ``task`` in each head's measurement
    record (a run folder's: ``scores`` and, where recorded, ``logprob`` by task) against
    the ``reference`` record's. Scored by the logprob signal, the logprob change is the
    score's; recorded nowhere (a task without gold answers), it is None (not 0: heads.json
    said every head left the log-likelihood as it was)."""
    def logprob(record: Mapping[str, Any]) -> float | None:
        if record.get("metrics", {}).get(task) == "logprob":
            return float(record["scores"][task])
        value = record.get("logprob", {}).get(task)
        return None if value is None else float(value)

    def change(record: Mapping[str, Any]) -> float | None:
        now, before = logprob(record), logprob(reference)
        return None if now is None or before is None else now - before

    return {int(head): (record["scores"][task] - reference["scores"][task], change(record))
            for head, record in measured.items()}


def logprob_changes(changes: Changes, size: int) -> np.ndarray:
    """The logprob changes of ``changes`` (column -> (score change, logprob change)) as
    one value per column of ``size``: NaN where none was measured."""
    values = np.full(size, np.nan)
    for column, (_, logprob) in changes.items():
        if logprob is not None:
            values[column] = logprob
    return values


def rank_measured(changes: Changes, higher_is_better: bool) -> list[int]:
    """The ranking rule of heads measured (``changes[head] = (score change, logprob
    change)``): the most harmful score change first; equal score changes (a metric over
    100 examples moves in steps of 0.01) by the larger drop of the logprob; equal both,
    by head index. That last order is no evidence: ``tied_with_above`` says which heads
    it ordered."""
    return sorted((int(h) for h in changes), key=lambda h: (
        -float(harm(changes[h][0], higher_is_better)),
        0.0 if changes[h][1] is None else float(changes[h][1]), h))


def confirmed_order(alone: Changes, screen_order: Sequence[int], higher_is_better: bool,
                    exclude: Iterable[int] = (), screen_effects: np.ndarray | None = None
                    ) -> list[int]:
    """The ranking: heads measured alone that hurt, by ``rank_measured``; then the heads
    not measured whose ``screen_effects`` estimate hurts, in ``screen_order``; then the
    heads measured to do no harm; then the rest of ``screen_order``. A measurement that
    shows no harm is stronger evidence than an estimate that shows some, so it does not
    outrank one (without ``screen_effects`` no estimate counts as harm). Heads in
    ``exclude`` are left out."""
    excluded = set(exclude)
    measured = rank_measured({h: c for h, c in alone.items() if h not in excluded},
                             higher_is_better)
    hurts = [h for h in measured if harm(alone[h][0], higher_is_better) > 0]
    harmless = measured[len(hurts):]  # rank_measured puts every harmful change first
    rest = [int(h) for h in screen_order if h not in alone and h not in excluded]
    implicated = [] if screen_effects is None else [
        h for h in rest if harm(screen_effects[h], higher_is_better) > 0]
    shown = set(implicated)
    return hurts + implicated + harmless + [h for h in rest if h not in shown]


def confirmed_top(alone: Changes, pool: Iterable[int], top_k: int,
                  higher_is_better: bool) -> list[int]:
    """The ``top_k`` heads of ``pool`` (all measured alone) with a harmful measured change,
    most harmful first: what a confirmation that had measured only ``pool`` would report."""
    order = confirmed_order({h: alone[h] for h in pool}, (), higher_is_better)
    return [h for h in order[:top_k] if harm(alone[h][0], higher_is_better) > 0]


def tied_with_above(order: Sequence[int], alone: Changes, fit: Screen | None = None
                    ) -> list[int]:
    """The heads of ``order`` whose evidence equals the head ranked just above them: the
    same measured changes (both measured alone), or the same fitted effect and marginal
    contrast (neither measured; without a ``fit``, a head not measured alone ties with
    none). Their order between them is the head index, which says nothing: a ranking
    must call them ties."""
    def evidence(head: int) -> tuple:
        if head in alone:
            return ("alone", *alone[head])
        if fit is None:
            return ("unmeasured", head)
        return ("fit", float(fit.effects[head]), float(fit.contrast[head]))

    return [int(below) for above, below in zip(order, order[1:], strict=False)
            if evidence(above) == evidence(below)]


# --- the fit ---------------------------------------------------------------------------


def _columns(columns: Columns | int, design: np.ndarray) -> Columns:
    # A heads_per_layer count stands for every head (callers from before neurons).
    if isinstance(columns, Columns):
        return columns
    return Columns.heads(np.shape(design)[1] // columns, columns)


def alone_key(head: Column | str) -> str:
    """The measurement of ``head`` knocked out alone (confirmation)."""
    return f"alone-{head}"


@timing.timed("fit and bootstrap")
def fit_rankings(design: np.ndarray, records: Mapping[str, Mapping[str, Any]],
                 tasks: Sequence[str], columns: Columns | int, alpha: float,
                 exclude: Sequence[Component] = (), *, top_k: int = 5,
                 bootstrap: int | None = 200, seed: int = 0,
                 priors: Mapping[str, Any] | None = None,
                 keys: Sequence[str] | None = None,
                 confirmed: ConfirmRecord | Mapping[str, Any] | None = None,
                 heads_per_layer: int | None = None,
                 never: Sequence[Component] = ()) -> dict[str, Ranking]:
    """One Lasso per task over the stored measurements (rows in design order), with each
    head's stability from ``bootstrap`` refits on resampled measurements (None: none).
    ``columns``: the component of each design column (``Columns``; a heads-per-layer
    count for every head; then ``heads_per_layer`` is the model's, for the ranking files).
    ``priors``: task -> attribution estimates of the logprob signal's change per head and
    path point (prior.json); the first point eases the penalty of likely heads
    (``prior_penalty_weights``). ``keys``: the measurement of each design row (default
    ``mask-0000``, ...). ``confirmed``: the run's ``ConfirmRecord`` (or config.json's
    ``confirm``, read as one): the heads measured alone to hurt rank first, by their
    measured change, then the heads the screen implicates, then those measured to do no
    harm (``confirmed_order``); the screen is refitted with those changes held fixed
    (``confirm.screen``); the bootstrap asks which of them a replay of the confirmation
    on a resample of the masks would have confirmed into the top-k. ``never``: the
    components no mask knocked out (--never-ablate): no measurement says anything of them,
    so they are left out of the ranking, their effect unknown (NaN), as ``exclude``'s are
    left out."""
    keys = mask_keys(len(design)) if keys is None else list(keys)
    confirmed = ConfirmRecord.of(confirmed)
    if isinstance(columns, int):
        heads_per_layer = columns
    columns = _columns(columns, design)
    if heads_per_layer is None:
        grid = columns.heads_grid
        heads_per_layer = grid[1] if grid is not None else 1
    baseline = records["baseline"]
    excluded = columns.holding(exclude)
    unmeasured = sorted({columns.index(h) for h in never if h in columns} - {*excluded})
    left_out = sorted({*excluded, *unmeasured})
    left_set = set(left_out)
    rankings = {}
    known: dict[str, _TaskFit] = {}

    def task_fit(task: str) -> _TaskFit:
        if task not in known:
            estimates = None if priors is None else priors[task]
            known[task] = _TaskFit(
                np.array([records[key]["scores"][task] for key in keys]),
                bool(baseline["higher_is_better"][task]), estimates,
                prior_weights(estimates), prior_rankings(estimates),
                {} if confirmed is None else measured_alone(confirmed, records, task,
                                                             columns))
        return known[task]

    # One replay per resample, shared by the tasks (keyed by the tasks it replays).
    replays: dict[tuple[tuple[str, ...], bytes], list[int]] = {}
    for task in tasks:
        # Fitted with an intercept, as the reference code does: the intercept absorbs the
        # small average cost of a mask's unimportant heads (pinning it to the baseline
        # recovers planted heads worse in simulation, see tests/test_designs_recovery.py).
        y, higher, estimates, weights, _, alone = task_fit(task)
        fixed = {h: change for h, (change, _) in alone.items()}
        fit = screen(design, y, higher, alpha=alpha, penalty_weights=weights, fixed=fixed,
                     exclude=left_out)
        order = confirmed_order(alone, fit.order, higher, left_out, fit.effects)
        # What the ranking says of the heads measured alone is of those it ranks: a head
        # --exclude'd after it was measured (refit, a resumed run) sets no entry bar and
        # ties with none (its measured change still holds its column in the fit).
        ranked_alone = {h: v for h, v in alone.items() if h not in left_set}
        select = None
        if confirmed is not None:
            select = confirmation_replay(confirmed, task, design, task_fit, alpha, top_k,
                                          left_out, columns, replays)
        # The refits are the screen's model (the measured changes held fixed), so each
        # interval is the spread of the estimate reported beside it.
        model = HeadLasso(alpha=alpha, penalty_weights=weights, fixed_effects=fixed)
        held_out = held_out_r2(model, design, y)
        stability = None if bootstrap is None else bootstrap_stability(
            model, design, y, top_k,
            higher_is_better=higher, exclude=left_out, resamples=bootstrap, seed=seed,
            select=select)
        if stability is not None and alone:
            # A head measured alone has one measurement, not a spread of Lasso refits.
            stability.low[list(alone)] = stability.high[list(alone)] = np.nan
        effects = fit.effects.copy()
        # What the ranking says of a column it does not rank is unknown (NaN), as its
        # ranking file, which lists only the ranked, reads back (read_rankings): never
        # knocked out, the fit's 0 is no estimate; --exclude'd, it is fitted, not ranked.
        effects[left_out] = np.nan
        if stability is not None:
            stability.low[left_out] = stability.high[left_out] = np.nan
        # What the ranking ordered equal effects by, kept for orders that need it (export).
        logprob_change = logprob_changes(alone, len(effects))
        contrast = fit.contrast.copy()
        contrast[[*alone, *unmeasured]] = np.nan
        evidence = {"logprob_change": logprob_change, "contrast": contrast}
        if estimates is not None:
            evidence["prior"] = np.atleast_2d(np.array(estimates, dtype=np.float64))
        for values in evidence.values():
            values[..., left_out] = np.nan
        rankings[task] = Ranking(
            task=task, metric=baseline["metrics"][task], higher_is_better=higher,
            baseline=float(baseline["scores"][task]), effects=effects,
            order=order, heads_per_layer=heads_per_layer, columns=columns,
            facts=RankingFacts(
                method="compressed sensing (Lasso)" + (
                    "" if confirmed is None else
                    f", the likeliest {UNITS[components_of(columns)]} measured alone"),
                r2=fit.r2, r2_held_out=held_out if np.isfinite(held_out) else None,
                alpha=alpha, measurements=int(len(design)),
                tied_with_above=columns.names(tied_with_above(order, alone, fit)),
                same_masks=_same_masks(
                    design, [h for h in order[:top_k] if harm(fit.effects[h], higher) > 0],
                    alone, columns),
                excluded=columns.names(excluded),
                never_knocked_out=columns.names(unmeasured) if unmeasured else None,
                **({} if confirmed is None else {
                    "confirmed": columns.names(ranked_alone),
                    "implicated": columns.names(h for h in fit.order
                                                if harm(fit.effects[h], higher) > 0),
                    # The confirmation's next round, less what the group tests have
                    # measured alone since it was chosen.
                    "next": [name for name in (confirmed.next or {}).get(task, [])
                             if name not in set(columns.names(ranked_alone))]}),
                prior_top_k=None if priors is None else columns.names(
                    alternated(prior_rankings(estimates), top_k)),
                prior_found_nothing=prior_found_nothing(estimates)),
            stability=stability, evidence=evidence)
        rankings[task].facts.certificate = _certificate(
            design, keys, records, task, ranked_alone, confirmed, columns,
            [h for h in order if h not in set(left_out)], top_k,
            [h for h in alone if h in left_set])
        recorded = largest_single_help(rankings[task])
        if recorded is not None:
            rankings[task].facts.largest_single_help = recorded
        if all_measured_alone(rankings[task]):
            # The fit held every change fixed and estimated nothing: its R² is no evidence.
            rankings[task].facts.r2 = rankings[task].facts.r2_held_out = None
    return rankings


#: The rule under which a measured set rules out its members (``group_tests``).
CERTIFICATE_RULE = ("a component's harm alone is at most the harm of any set it is "
                    "knocked out in (knocking out more never lessens the harm), with the "
                    "help of a member measured alone to help added back")


def measured_harm(record: Mapping[str, Any], baseline: Mapping[str, Any], task: str) -> Harm:
    """What the measurement ``record`` did to ``task``: its harm (the score's change
    against ``baseline``, positive = worse) and the paired standard error of that change
    (``measurement.noise.change_se``; 0 where the records hold no per-example scores)."""
    higher = bool(baseline["higher_is_better"][task])
    change = float(record["scores"][task]) - float(baseline["scores"][task])
    se = change_se(record, baseline, task)
    return Harm(float(harm(change, higher)), 0.0 if se is None else float(se))


def _certificate(design: np.ndarray, keys: Sequence[str],
                 records: Mapping[str, Mapping[str, Any]], task: str, alone: Changes,
                 confirmed: ConfirmRecord | None, columns: Columns,
                 candidates: Sequence[int], top_k: int,
                 left_out: Sequence[int] = ()) -> CertificateRecord:
    """heads.json's ``certificate`` (``group_tests.certificate``): what the run's
    measurements rule out for ``task`` and what they leave unchecked, in names
    (``candidates`` in the ranking's order, so the unchecked come likeliest first).
    ``left_out``: columns measured alone and left out of the ranking since, whose help
    the sets holding them still give back."""
    baseline = records["baseline"]
    higher = bool(baseline["higher_is_better"][task])
    alone_harm = {h: measured_harm(records[alone_key(columns[h])], baseline, task)
                  for h in alone}
    groups = [(tuple(columns.named(n) for n in members),
               measured_harm(records[group_key(members)], baseline, task))
              for members in ([] if confirmed is None else confirmed.group_sets)]
    mask_harms = [measured_harm(records[key], baseline, task) for key in keys]
    def se_between(a: int, b: int) -> float | None:  # two columns measured alone
        first, second = records[alone_key(columns[a])], records[alone_key(columns[b])]
        return paired_se(first.get("examples", {}).get(task),
                         second.get("examples", {}).get(task))

    cert = certificate(candidates, design, mask_harms, alone_harm, groups, top_k,
                       se_between=se_between,
                       left_out={h: measured_harm(records[alone_key(columns[h])], baseline,
                                                  task) for h in left_out})
    stage = None if confirmed is None else confirmed.groups
    margin = Z * float(np.median([h.se for h in [*mask_harms, *alone_harm.values()]])
                       ) if mask_harms or alone_harm else 0.0
    size = (stage and stage.size) or group_size(
        cert.bar, background_harm(design, [h.value for h in mask_harms], alone_harm), margin)
    sign = 1.0 if not higher else -1.0  # a harm back to a change of the score
    coverage = [cert.coverage[h] for h in cert.unchecked]
    tested = 0 if stage is None else stage.tested
    spent = (None if stage is None or stage.spent_before is None
             else int(stage.spent_before) + tested)
    to_cover = -(-len(cert.unchecked) // int(size))
    return CertificateRecord(
        certified=cert.complete, rule=CERTIFICATE_RULE,
        confidence=CONFIDENCE if cert.noise else None, entry_bar=cert.bar, top_k=top_k,
        measured_alone=len(cert.alone), ruled_out=len(cert.ruled_out), bound=cert.bound,
        unchecked=columns.names(cert.unchecked),
        unchecked_never_in_a_mask=sum(c == 0 for c in coverage),
        unchecked_in_one_mask=sum(c == 1 for c in coverage),
        unchecked_beside_measured=columns.names(cert.shadowed),
        tied_at_k=columns.names(cert.tied), helps=len(cert.helps),
        violations=len(cert.violations),
        group_size=int(size), group_tests_run=tested,
        group_tests=[GroupTestRecord(columns.names(m), sign * value.value,
                                     value.se if cert.noise else None)
                     for m, value in cert.groups],
        group_tests_to_cover=to_cover, measurements_spent=spent,
        max_measurements=None if stage is None else stage.cap,
        max_measurements_to_finish=(None if cert.complete or spent is None
                                    else spent + to_cover))


class _TaskFit(NamedTuple):
    """What one task's fit reads: its scores on the design's rows, its direction, its
    prior (estimates, penalty weights, rankings) and the changes measured alone."""

    y: np.ndarray
    higher: bool
    estimates: np.ndarray | None
    weights: np.ndarray | None
    sources: list[list[int]]
    alone: Changes


def confirmation_replay(confirmed: ConfirmRecord, task: str, design: np.ndarray,
                         task_fit: Callable[[str], _TaskFit], alpha: float, top_k: int,
                         excluded: Sequence[int], columns: Columns,
                         replays: dict[tuple[tuple[str, ...], bytes], list[int]]
                         ) -> Callable[[np.ndarray], np.ndarray]:
    """For ``bootstrap_stability(select=…)``: the top-k the confirmation would have led to
    on a resample of the masks (its rows). The whole confirmation is replayed, every
    task's picks with screens fitted on those rows (``confirm.confirmation``), as the run
    made it: a head another task's picks brought is in the pool only where its replay
    picks it too, as this task's own are. A pick the run did not measure cannot be
    ranked, so it is left out. Where fewer than k of the pool hurt, the ranking's rule
    fills the top-k with the heads the resample's screen (the pool's changes held fixed)
    implicates, so such a head is as stable as that screen says. ``replays`` keeps each
    resample's picks for the other tasks' rankings (the bootstrap draws the same rows for
    every task)."""
    picked_by = confirmed.picked_by or {task: confirmed.heads}
    replayed = list(picked_by)
    budget = sum(len(heads) for heads in picked_by.values())
    skip = sorted({*confirmed.never, *excluded})
    round_size = int(confirmed.round_size or budget or 1)
    y, higher, _, weights, _, alone = task_fit(task)
    found_by_groups = {columns.named(n) for n in
                       ([] if confirmed.groups is None else confirmed.groups.alone)
                       } & set(alone)

    def replay(rows: np.ndarray) -> list[int]:
        def screen_of(name: str) -> Callable[[Changes], list[int]]:
            fit = task_fit(name)
            return lambda changes: screen(
                design[rows], fit.y[rows], fit.higher, alpha=alpha,
                penalty_weights=fit.weights, fixed={h: c[0] for h, c in changes.items()},
                exclude=excluded).order

        def lookup(heads: list[int]) -> dict[str, Changes]:
            return {name: {h: task_fit(name).alone[h] for h in heads
                           if h in task_fit(name).alone} for name in replayed}

        return confirmation({name: task_fit(name).sources for name in replayed},
                            {name: screen_of(name) for name in replayed}, lookup, budget,
                            round_size=round_size, skip=skip).heads

    def select(rows: np.ndarray) -> np.ndarray:
        # Runs from before picked_by replay each task alone: not one replay for all.
        key = (tuple(replayed), np.asarray(rows, dtype=np.int64).tobytes())
        if key not in replays:
            replays[key] = replay(rows)
        # The group tests are not replayed: what they measured alone is in every pool.
        pool = {h for h in replays[key] if h in alone} | found_by_groups
        top = confirmed_top(alone, pool, top_k, higher)
        if len(top) < top_k:
            fit = screen(design[rows], y[rows], higher, alpha=alpha, penalty_weights=weights,
                         fixed={h: alone[h][0] for h in pool}, exclude=excluded)
            top += [h for h in fit.order if h not in pool and h not in skip
                    and harm(fit.effects[h], higher) > 0][:top_k - len(top)]
        return np.array(top, dtype=np.int64)

    return select


def _same_masks(design: np.ndarray, top: Sequence[int], alone: Changes, columns: Columns
                ) -> dict[str, list[str]]:
    """Of the ``top`` heads (those the fit implicates), the ones not measured alone that
    the masks knocked out only together with other heads not measured alone, with those
    heads (``designs.same_masks``): the masks cannot tell them apart."""
    unmeasured = [h for h in range(len(columns)) if h not in alone]
    found = same_masks(design, [h for h in top if h not in alone], unmeasured)
    return {str(columns[head]): columns.names(alike) for head, alike in found.items()}


def measured_alone(confirmed: ConfirmRecord, records: Mapping[str, Mapping[str, Any]],
                    task: str, columns: Columns) -> dict[int, tuple[float, float]]:
    """column -> (score change, logprob change) of every component the run measured
    alone."""
    heads = [columns.named(name) for name in confirmed.alone]
    return alone_changes(records, heads, task, columns)


def alone_changes(records: Mapping[str, Mapping[str, Any]], heads: Sequence[int], task: str,
                   columns: Columns) -> dict[int, tuple[float, float]]:
    """column -> (score change, logprob change) of each component knocked out alone."""
    return measured_changes(records["baseline"], {
        h: records[alone_key(columns[h])] for h in heads}, task)


def mask_keys(masks: int) -> list[str]:
    """The measurement keys of a design's rows, when the run recorded none (no pilot)."""
    return [f"mask-{i:04d}" for i in range(masks)]
