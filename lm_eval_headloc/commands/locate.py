"""``locate``: which heads a task depends on, by compressed sensing — the task measured
with many random sets of heads knocked out together (masks), a Lasso fitted to the scores
estimating each head's effect, and the likeliest heads then knocked out one at a time
(confirmation). ``refit``: the same fit again from the measurements on disk.

A run's state is one value, its ``LocateRun`` (``result.py``), written to config.json
once per phase and read back by ``load_run`` alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lm_eval_headloc.commands.types import ensure_types
from lm_eval_headloc.common import timing
from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.files import write_atomically
from lm_eval_headloc.intervention.components import (
    Component,
    Head,
    HeadSpecError,
    Neuron,
    parse_components,
    validate_heads,
)
from lm_eval_headloc.measurement.attribution import PRIOR_POINTS
from lm_eval_headloc.method.columns import Column, Columns, NeuronGroup, neuron_candidates
from lm_eval_headloc.method.confirm import (
    ROUND,
    Changes,
    alternated,
    confirmation,
    confirmed_order,
    confirmed_top,
    measured_changes,
    prior_found_nothing,
    prior_rankings,
    prior_weights,
    screen,
    tied_with_above,
)
from lm_eval_headloc.method.designs import design_matrix, same_masks
from lm_eval_headloc.method.group_tests import (
    MAX_GROUP,
    background_harm,
    certificate,
    entry_bar,
    group_key,
    group_order,
    group_size,
    group_testing,
)
from lm_eval_headloc.method.pilot import KEEP, UNFITTED, choose_sparsity, pilot_design
from lm_eval_headloc.method.recovery import HeadLasso, bootstrap_stability, harm, held_out_r2
from lm_eval_headloc.report.pages import (
    HeadRanking,
    equal_change_words,
    floor_words,
    harmless_words,
    largest_single_help,
    ranking_table,
    spread_words,
    tie_words,
    write_ranking,
)
from lm_eval_headloc.runs.folder import RunFolder, RunFolderError
from lm_eval_headloc.runs.record import (
    PRIOR_KEYS,
    LocateRun,
    column_prior,
    load_run,
    mask_keys,
    start_run,
    stored_prior,
    stored_priors,
)
from lm_eval_headloc.runs.setup import (
    Setup,
    check_candidates,
    head_list,
    load_model,
    open_measurement,
    phase_bar,
    prepare,
    run_plan,
)
from lm_eval_headloc.runs.spec import (
    COMMAND_OPTIONS,
    DEFAULT_MAX_MASKS,
    RunSpec,
    command_spec,
    refuse_keywords,
)

log = logging.getLogger(__name__)

__all__ = ["BELOW_ZERO", "CERTIFICATE_RULE", "certificate_line", "certificate_words",
           "fit_rankings", "fit_summary", "group_sets", "locate", "mask_keys", "refit",
           "stored_prior"]


def _columns(columns: Columns | int, design: np.ndarray) -> Columns:
    # A heads_per_layer count stands for every head (callers from before neurons).
    if isinstance(columns, Columns):
        return columns
    return Columns.heads(np.shape(design)[1] // columns, columns)


def alone_key(head: Column | str) -> str:
    """The measurement of ``head`` knocked out alone (confirmation)."""
    return f"alone-{head}"


def fit_rankings(design: np.ndarray, records: Mapping[str, Mapping[str, Any]],
                 tasks: Sequence[str], columns: Columns | int, alpha: float,
                 exclude: Sequence[Component] = (), *, top_k: int = 5,
                 bootstrap: int | None = 200, seed: int = 0,
                 priors: Mapping[str, Any] | None = None,
                 keys: Sequence[str] | None = None,
                 confirmed: Mapping[str, Any] | None = None,
                 heads_per_layer: int | None = None,
                 never: Sequence[Component] = ()) -> dict[str, HeadRanking]:
    """One Lasso per task over the stored measurements (rows in design order), with each
    head's stability from ``bootstrap`` refits on resampled measurements (None: none).
    ``columns``: the component of each design column (``Columns``; a heads-per-layer
    count for every head; then ``heads_per_layer`` is the model's, for the ranking files).
    ``priors``: task -> attribution estimates of the logprob signal's change per head and
    path point (prior.json); the first point eases the penalty of likely heads
    (``prior_penalty_weights``). ``keys``: the measurement of each design row (default
    ``mask-0000``, ...). ``confirmed``: config.json's ``confirm`` (``_confirm``): the heads
    measured alone to hurt rank first, by their measured change, then the heads the screen
    implicates, then those measured to do no harm (``confirm.confirmed_order``); the
    screen is refitted with those changes held fixed (``confirm.screen``); the
    bootstrap asks which of them a replay of the confirmation on a resample of the masks
    would have confirmed into the top-k. ``never``: the components no mask knocked out
    (--never-ablate): no measurement says anything of them, so they are left out of the
    ranking, their effect unknown (NaN), as ``exclude``'s are left out."""
    keys = mask_keys(len(design)) if keys is None else list(keys)
    if isinstance(columns, int):
        heads_per_layer = columns
    columns = _columns(columns, design)
    if heads_per_layer is None:
        grid = columns.heads_grid
        heads_per_layer = grid[1] if grid is not None else 1
    baseline = records["baseline"]
    excluded = sorted({columns.index(h) for h in exclude if _has(columns, h)})
    unmeasured = sorted({columns.index(h) for h in never if _has(columns, h)} - {*excluded})
    left_out = sorted({*excluded, *unmeasured})
    rankings = {}
    known: dict[str, _TaskFit] = {}

    def task_fit(task: str) -> _TaskFit:
        if task not in known:
            estimates = None if priors is None else priors[task]
            known[task] = _TaskFit(
                np.array([records[key]["scores"][task] for key in keys]),
                bool(baseline["higher_is_better"][task]), estimates,
                prior_weights(estimates), prior_rankings(estimates),
                {} if confirmed is None else _measured_alone(confirmed, records, task,
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
        select = None
        if confirmed is not None:
            select = _confirmation_replay(confirmed, task, design, task_fit, alpha, top_k,
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
        effects[unmeasured] = np.nan  # never knocked out: the fit's 0 is no estimate
        # What the ranking ordered equal effects by, kept for orders that need it (export).
        logprob_change = np.full(len(effects), np.nan)
        logprob_change[list(alone)] = [lp for _, lp in alone.values()]
        contrast = fit.contrast.copy()
        contrast[[*alone, *unmeasured]] = np.nan
        evidence = {"logprob_change": logprob_change, "contrast": contrast}
        if estimates is not None:
            evidence["prior"] = np.atleast_2d(np.asarray(estimates, dtype=np.float64))
        rankings[task] = HeadRanking(
            task=task, metric=baseline["metrics"][task], higher_is_better=higher,
            baseline=float(baseline["scores"][task]), effects=effects,
            order=order, heads_per_layer=heads_per_layer, columns=columns,
            extra={"method": "compressed sensing (Lasso)" + (
                       "" if confirmed is None else
                       f", the likeliest {_UNITS[_components_of(columns)]} measured alone"),
                   "r2": fit.r2,
                   "r2_held_out": held_out if np.isfinite(held_out) else None,
                   "alpha": alpha, "measurements": int(len(design)),
                   "tied_with_above": columns.names(tied_with_above(order, alone, fit)),
                   "same_masks": _same_masks(
                       design, [h for h in order[:top_k] if harm(fit.effects[h], higher) > 0],
                       alone, columns),
                   "excluded": columns.names(excluded),
                   **({"never_knocked_out": columns.names(unmeasured)} if unmeasured
                      else {}),
                   **({} if confirmed is None else {
                       "confirmed": columns.names(alone),
                       "implicated": columns.names(h for h in fit.order
                                                   if harm(fit.effects[h], higher) > 0),
                       "next": list(confirmed.get("next", {}).get(task, []))}),
                   **({} if priors is None else {"prior_top_k": columns.names(
                       alternated(prior_rankings(estimates), top_k))}),
                   **({"prior_found_nothing": True} if prior_found_nothing(estimates)
                      else {})},
            stability=stability, evidence=evidence)
        rankings[task].extra["certificate"] = _certificate(
            design, y, baseline, task, higher, alone, records, confirmed, columns,
            [h for h in order if h not in set(left_out)], top_k)
        recorded = largest_single_help(rankings[task])
        if recorded is not None:
            rankings[task].extra["largest_single_help"] = recorded
        if all_measured_alone(rankings[task]):
            # The fit held every change fixed and estimated nothing: its R² is no evidence.
            rankings[task].extra["r2"] = rankings[task].extra["r2_held_out"] = None
    return rankings


#: The rule under which a measured set rules out its members (``group_tests``).
CERTIFICATE_RULE = ("a component's harm alone is at most the harm of any set it is "
                    "knocked out in (knocking out more never lessens the harm)")


def _certificate(design: np.ndarray, y: np.ndarray, baseline: Mapping[str, Any], task: str,
                 higher: bool, alone: Changes, records: Mapping[str, Mapping[str, Any]],
                 confirmed: Mapping[str, Any] | None, columns: Columns,
                 candidates: Sequence[int], top_k: int) -> dict[str, Any]:
    """heads.json's ``certificate`` (``group_tests.certificate``): what the run's
    measurements rule out for ``task`` and what they leave unchecked, in names
    (``candidates`` in the ranking's order, so the unchecked come likeliest first)."""
    base = float(baseline["scores"][task])
    alone_harm = {h: float(harm(change, higher)) for h, (change, _) in alone.items()}
    groups = [(tuple(columns.named(n) for n in members),
               float(harm(records[group_key(members)]["scores"][task] - base, higher)))
              for members in group_sets(confirmed)]
    mask_harms = harm(np.asarray(y, dtype=np.float64) - base, higher)
    cert = certificate(candidates, design, mask_harms, alone_harm, groups, top_k)
    recorded = (confirmed or {}).get("groups") or {}
    size = recorded.get("size") or group_size(cert.bar, background_harm(design, mask_harms,
                                                                        alone_harm))
    sign = 1.0 if not higher else -1.0  # a harm back to a change of the score
    coverage = [cert.coverage[h] for h in cert.unchecked]
    return {"rule": CERTIFICATE_RULE, "entry_bar": cert.bar, "top_k": top_k,
            "measured_alone": len(cert.alone), "ruled_out": len(cert.ruled_out),
            "bound": cert.bound, "unchecked": columns.names(cert.unchecked),
            "unchecked_never_in_a_mask": sum(c == 0 for c in coverage),
            "unchecked_in_one_mask": sum(c == 1 for c in coverage),
            "unchecked_beside_measured": columns.names(cert.shadowed),
            "group_size": int(size), "group_tests_run": int(recorded.get("budget", 0)),
            "group_tests": [{"components": columns.names(m), "change": sign * value}
                            for m, value in cert.groups],
            "group_tests_to_cover": -(-len(cert.unchecked) // int(size))}


class _TaskFit(NamedTuple):
    """What one task's fit reads: its scores on the design's rows, its direction, its
    prior (estimates, penalty weights, rankings) and the changes measured alone."""

    y: np.ndarray
    higher: bool
    estimates: np.ndarray | None
    weights: np.ndarray | None
    sources: list[list[int]]
    alone: Changes


def _confirmation_replay(confirmed: Mapping[str, Any], task: str, design: np.ndarray,
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
    picked_by = confirmed.get("picked_by") or {task: confirmed["heads"]}
    replayed = list(picked_by)
    budget = sum(len(heads) for heads in picked_by.values())
    skip = sorted({*confirmed["never"], *excluded})
    round_size = int(confirmed.get("round_size", budget or 1))
    y, higher, _, weights, _, alone = task_fit(task)
    found_by_groups = {columns.named(n) for n in
                       (confirmed.get("groups") or {}).get("alone") or []} & set(alone)

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


def _measured_alone(confirmed: Mapping[str, Any], records: Mapping[str, Mapping[str, Any]],
                    task: str, columns: Columns) -> dict[int, tuple[float, float]]:
    """column -> (score change, logprob change) of every component the run measured
    alone."""
    names = [*confirmed["heads"], *((confirmed.get("groups") or {}).get("alone") or [])]
    heads = list(dict.fromkeys(columns.named(name) for name in names))
    return _alone_changes(records, heads, task, columns)


def _has(columns: Columns, component: Column) -> bool:
    try:
        columns.index(component)
    except KeyError:
        return False
    return True



_SIGNAL_WORDS = {"metric": "each task's metric, as lm-eval reports it",
                 "logprob": "the gold answers' mean log-likelihood (logprob)"}


def locate_report(run: LocateRun) -> str:
    """report.md of a fitted locate run (``run.rankings``), from its record alone."""
    spec, top_k = run.spec, run.spec.top_k
    units = _UNITS[spec.components]
    lines = [
        f"# {_TITLES[spec.components]} by compressed sensing", "",
        f"- model: `{spec.model_args}`",
        *([f"- components: {units}; the design's neuron columns are the attribution "
           f"prior's {len(run.candidates or ())} likeliest of the model's "
           f"{run.layers * run.neurons_per_layer:,} MLP neurons (--candidates)"
           + _group_words(run)]
          if "neurons" in spec.components and run.neurons_per_layer else []),
        f"- signal: {_SIGNAL_WORDS[spec.signal]}",
        *([f"- chat template: {_chat_words(run.chat_template)}"]
          if run.chat_template is not None else []),
        *([f"- few-shot examples per prompt: {spec.num_fewshot} (--num-fewshot; a task "
           "whose YAML fixes 0 keeps 0)"] if spec.num_fewshot is not None else []),
        *([f"- system instruction: {spec.system_instruction!r} (--system-instruction)"]
          if spec.system_instruction is not None else []),
        *([f"- generation arguments: `{spec.gen_kwargs}` (--gen-kwargs, over each "
           "generation task's own)"] if spec.gen_kwargs is not None else []),
        f"- design: {spec.design}, {_masks_words(run)}, sparsity "
        f"{_sparsity_words(run)}, seed {spec.seed}"
        + (f", masks drawn with seed {spec.design_seed}"
           if spec.design_seed is not None else ""),
        f"- examples per task: {spec.num_samples} asked, used "
        + ", ".join(f"{t} {n}" for t, n in (run.examples_used or {}).items())
        + " (the same subset in every measurement)",
        f"- attribution prior: {_prior_words(run)}"
        + (f" (--prior {spec.prior}" + (f": {run.prior_skipped})" if run.prior_skipped
                                        else ")") if spec.prior == "auto" else ""),
        f"- confirmation: {_confirm_words(run)}",
        f"- Lasso alpha: {spec.alpha}",
        f"- never knocked out: {spec.never_ablate or 'none'}"
        + (" (not ranked: no measurement knocked them out)" if spec.never_ablate else ""),
        f"- excluded from the ranking: {spec.exclude or 'none'}",
        *([f"- time: {timing.timings_line(run.timings)} (config.json's timings)"]
          if run.timings else []), "",
    ]
    for task, ranking in run.rankings.items():
        lines += [
            f"## {task} ({ranking.metric}, {'higher' if ranking.higher_is_better else 'lower'}"
            " is better)", "",
            f"Baseline (nothing knocked out): {ranking.baseline:.4f}. "
            + (f"Every {_UNIT[spec.components]} was measured alone, so each ranks by its "
               "measurement; the masks' fit, with those changes held fixed, has nothing "
               "left to estimate (no R²)." if all_measured_alone(ranking) else
               f"Fit R² = {ranking.extra['r2']:.3f} over {ranking.extra['measurements']} "
               f"measurements{held_out_words(ranking, _UNIT[spec.components])}."), "",
            *ranking_table(ranking, top_k, "change on knockout" if "confirmed" in ranking.extra
                           else "estimated change on knockout"), "",
            *floor_words(ranking),
            *tie_words(ranking, top_k, "the fit found no effect that tells them apart"),
            *harmless_words(ranking, top_k, _UNIT[spec.components]),
            *spread_words(ranking, top_k, _UNIT[spec.components]),
            *equal_change_words(ranking, top_k),
            *same_masks_words(ranking.extra, _UNIT[spec.components], run.uses_prior),
            *_unconfirmed_words(ranking.extra, _UNIT[spec.components]),
            *certificate_words(ranking, _UNIT[spec.components]),
            *_prior_top_words(ranking.extra, top_k, run.prior_kind, _UNIT[spec.components])]
    lines.append(f"Check the {units} with `headloc-harness verify` (knocks them out for "
                 "real).")
    return "\n".join(lines) + "\n"


def _prior_top_words(extra: Mapping[str, Any], top_k: int, prior_kind: str | None,
                     unit: str) -> list[str]:
    """The attribution prior's own top-k, or that it found nothing to order."""
    if "prior_top_k" not in extra:
        return []
    source = "prior.json" + (", its rankings in turn" if prior_kind == "atp-path" else "")
    if extra.get("prior_found_nothing"):
        return [f"The attribution prior ({source}) estimated the same change for every "
                f"{unit}: it found no effect, and its top-{top_k} "
                f"({', '.join(extra['prior_top_k'])}) is the {unit} index, not an order.", ""]
    return [f"The attribution prior's own top-{top_k} ({source}): "
            + ", ".join(extra["prior_top_k"]) + ".", ""]


def all_measured_alone(ranking: HeadRanking) -> bool:
    """Whether the confirmation measured every component the run ranks (a small model
    under the default budget): the fit then estimates nothing and its R² says nothing."""
    confirmed = ranking.extra.get("confirmed")
    if not confirmed:
        return False
    ranked = len(ranking.effects) - len(ranking.extra.get("excluded") or ())
    return len(set(confirmed)) >= ranked


#: What a held-out R² below 0 means (a newcomer reads a negative number as a failed run).
BELOW_ZERO = ("below 0: the fit predicts a measurement it did not see worse than the "
              "measurements' mean does")


def held_out_words(ranking: HeadRanking, unit: str = "head") -> str:
    """The fit's R² on measurements it did not see, beside the in-sample one (``r2``)."""
    extra = ranking.extra
    if "r2_held_out" not in extra:  # a ranking file from before it was computed
        return ""
    value, rows, columns = extra["r2_held_out"], extra["measurements"], len(ranking.effects)
    shown = "n/a (too few measurements, or none that vary)" if value is None else f"{value:.2f}"
    if value is not None and value < 0:
        shown += f" ({BELOW_ZERO})"
    crowded = (f" ({columns} {unit}s, {rows} measurements: a fit comes close whatever the "
               "truth)" if columns > rows else "")
    alone = (f"; the {unit}s measured alone rank by their measurement, not by this fit"
             if extra.get("confirmed") else "")
    return (f", in-sample{crowded}; each measurement predicted by a fit on the others: "
            f"R² = {shown}{alone}")


def fit_summary(ranking: HeadRanking, top_k: int) -> str:
    """The terminal's words on the masks' fit, after a task's baseline: where every top-k
    component was measured alone the fit ordered none of them, so its R² (which report.md
    gives) is left out rather than shown as a verdict on the run; otherwise its R² in-sample
    and held out, with what a held-out R² below 0 means. "" without a fit."""
    r2, held_out = ranking.extra.get("r2"), ranking.extra.get("r2_held_out")
    if r2 is None:
        return ""
    top = ranking.top(top_k)
    if top and all(ranking.measured_alone(c) for c in top):
        return (f"; the top {len(top)} measured alone: their order is measured, not "
                "fitted (the masks' fit: report.md)")
    words = f", fit R² {r2:.3f} in-sample"
    if held_out is not None:
        words += f", {held_out:.2f} held out" + (f" ({BELOW_ZERO})" if held_out < 0 else "")
    return words


def _group_words(run: LocateRun) -> str:
    groups = [c for c in run.columns if isinstance(c, NeuronGroup)]
    if not groups:
        return ""
    sizes = [len(g.neurons) for g in groups]
    return (f", and the other neurons in {len(groups)} groups (--neuron-groups "
            f"{run.spec.neuron_groups} per layer, {min(sizes):,}–{max(sizes):,} neurons "
            "each), one column per group: the attribution prior does not rank a group, "
            "so the masks alone implicate one")


def _components_of(columns: Columns) -> str:
    """The ``--components`` value whose columns these are."""
    heads = sum(isinstance(c, Head) for c in columns)
    return "heads" if heads == len(columns) else "neurons" if not heads else "heads+neurons"


def _prior_words(run: LocateRun) -> str:
    if run.prior_kind is None:
        return "none"
    one, all_ = _UNIT[run.spec.components], _UNITS[run.spec.components]
    return {"atp": "atp (prior.json): attribution patching at the clean run",
            "atp-path": "atp-path (prior.json): attribution patching at the clean run and "
                        f"with every {one} half ablated, each ranking the {all_}",
            "ig": "ig (prior.json): integrated gradients, the attribution averaged along "
                  "the path from the clean run to every component ablated"}[run.prior_kind]


#: What a run locates, in words (``--components``): all of them, one of them, the title.
_UNITS = {"heads": "heads", "neurons": "MLP neurons", "heads+neurons": "heads and MLP neurons"}
_UNIT = {"heads": "head", "neurons": "neuron", "heads+neurons": "component"}
_TITLES = {"heads": "Head localization", "neurons": "MLP neuron localization",
           "heads+neurons": "Head and MLP neuron localization"}


def _chat_words(chat_template: Mapping[str, bool]) -> str:
    """Which tasks were asked through the chat template, as the run recorded it."""
    through = [task for task, chat in chat_template.items() if chat]
    if not through:
        return "not used"
    if len(through) == len(chat_template):
        return "every task asked through it"
    return "asked through it: " + ", ".join(through) + "; the others plain"


def _confirm_words(run: LocateRun) -> str:
    confirmed = run.confirm
    if not confirmed:
        return f"none (every {_UNIT[run.spec.components]} ranked by the Lasso's estimate)"
    rounds = (f" in {len(confirmed['rounds'])} rounds of {confirmed['round_size']}"
              if "rounds" in confirmed else "")
    units = _UNITS[run.spec.components]
    return (f"{len(confirmed['heads'])} {units} knocked out one at a "
            f"time{rounds}, "
            + ("the attribution prior's rankings and the masks' fit's likeliest in turn"
               if run.uses_prior else "the masks' fit's likeliest")
            + " (the fit redone after each round with "
            f"the measured {units}' changes held fixed); those that hurt rank first, by "
            "their measured change (equal ones by the gold answers' log-likelihood change), "
            f"then the {units} the fit implicates, then those that did no harm "
            "(their stability: how often a replay of the confirmation on a bootstrap "
            "resample of the masks would have confirmed them into the top-k)")


def same_masks_words(extra: Mapping[str, Any], unit: str = "head",
                     uses_prior: bool = False) -> list[str]:
    """The top heads the masks cannot tell from others (``extra["same_masks"]``), said as
    such: the fit's credit among identical columns is not the masks' evidence."""
    found = extra.get("same_masks") or {}
    if not found:
        return []
    # Not "the lowest index": coordinate descent leaves some credit on the other copies
    # of a column (an audit's run split it -0.041 / -0.022 between two such heads).
    chooser = ("the attribution prior's penalty and the solver's order" if uses_prior
               else "the solver's order")

    def clause(head: str, alike: list[str]) -> str:
        shown = ", ".join(alike[:5]) + (f" and {len(alike) - 5} more" if len(alike) > 5
                                        else "")
        return f"{head} was knocked out in exactly the same masks as {shown}"

    return ["Not told apart by the masks: "
            + "; ".join(clause(head, alike) for head, alike in found.items())
            + f", none of them measured alone. The masks cannot say which {unit} of such a "
            f"set moved the score: how the fit shares the credit among them follows {chooser}, "
            "not the masks. Measuring it alone (a larger `--confirm`) settles it.", ""]


def _unconfirmed_words(extra: Mapping[str, Any], unit: str = "head") -> list[str]:
    """Where to look next: heads the masks' fit implicates that no one measured alone, and
    the round a larger --confirm would measure."""
    if "confirmed" not in extra:
        return []
    implicated = extra.get("implicated", [])
    lines = ["Not measured alone: " + (
        f"the masks' fit (with the measured {unit}s held fixed) implicates "
        + ", ".join(implicated[:10]) + (f" and {len(implicated) - 10} more"
                                        if len(implicated) > 10 else "")
        if implicated else f"the masks' fit implicates no other {unit}") + "."]
    if extra.get("next"):
        lines.append("A larger `--confirm` would measure next: "
                     + ", ".join(extra["next"]) + ".")
    return [" ".join(lines), ""]


def _listed(names: Sequence[str], most: int = 10) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more"
                                      if len(names) > most else "")


def certificate_words(ranking: HeadRanking, unit: str = "head") -> list[str]:
    """report.md's completeness certificate (``extra["certificate"]``): what the run
    measured alone, what a measured set ruled out and by how much at most, what the
    group tests measured, and what nothing checked, with the flag that would check it."""
    cert = ranking.extra.get("certificate")
    if not cert:
        return []
    k, bar = cert["top_k"], cert["entry_bar"]
    entry = (f"stays under the top-{k}'s entry bar, a harm of {bar:.4g} (the {k}th "
             "largest measured alone)," if bar > 0 else
             f"does not hurt the task at all (fewer than {k} {unit}s measured alone hurt "
             f"it, so any harm would enter the top-{k})")
    lines = [f"### What was checked ({cert['measured_alone'] + cert['ruled_out']} of "
             f"{cert['measured_alone'] + cert['ruled_out'] + len(cert['unchecked'])} "
             f"{unit}s)", "",
             f"Under the rule that {cert['rule']} — an assumption: a {unit} whose knockout "
             f"helps can hide one that hurts in the same set — a measured set whose harm "
             f"{entry} rules out each of its members.", "",
             f"- measured alone: {cert['measured_alone']} {unit}s (the table's measured "
             "changes)"]
    if cert["ruled_out"]:
        lines.append(f"- ruled out by a mask or group test: {cert['ruled_out']} {unit}s; "
                     + (f"none of them alone harms the task by more than {cert['bound']:.4g} "
                        "(the harm of the set that ruled it out)" if cert["bound"] > 0 else
                        "none of them alone hurts the task (each set that ruled one out "
                        "left the score as good or better)"))
    else:
        lines.append(f"- ruled out by a mask or group test: none (every measured set with "
                     f"an unmeasured {unit} in it reached the bar)")
    groups = cert["group_tests"]
    if groups:
        shown = "; ".join(f"{'+'.join(g['components'][:4])}"
                          + (f"+{len(g['components']) - 4} more" if len(g["components"]) > 4
                             else "") + f" {g['change']:+.4f}" for g in groups[:8])
        lines.append(f"- group tests ({len(groups)} sets of up to {cert['group_size']} "
                     f"{unit}s, halved where they reached the bar): {shown}"
                     + (f"; and {len(groups) - 8} more (heads.json)" if len(groups) > 8
                        else ""))
    unchecked = cert["unchecked"]
    if not unchecked:
        lines += ["", f"Every {unit} the run ranks was measured alone or ruled out: under "
                  f"the rule, no {unit} outside the table's measured ones would enter the "
                  f"top-{k}.", ""]
        return lines
    beside = cert["unchecked_beside_measured"]
    lines += [f"- **not checked: {len(unchecked)} {unit}s** "
              f"({cert['unchecked_never_in_a_mask']} never knocked out by a mask, "
              f"{cert['unchecked_in_one_mask']} in one mask only"
              + (f", {len(beside)} only in masks beside a {unit} measured to reach the bar"
                 if beside else "") + f"): {_listed(unchecked)}. Any of them could enter "
              f"the top-{k}; the masks' estimate is all the run has for them.", "",
              f"`--group-tests {cert['group_tests_run'] + cert['group_tests_to_cover']}` "
              f"would knock each of them out in at least one group of "
              f"{cert['group_size']} (more tests where a group reaches the bar and is "
              "halved); a larger `--confirm` measures the likeliest alone.", ""]
    return lines


def certificate_line(ranking: HeadRanking) -> str | None:
    """The terminal's one line on the certificate, or None without one."""
    cert = ranking.extra.get("certificate")
    if not cert:
        return None
    unit = _UNIT[_components_of(ranking.columns)]
    unchecked = len(cert["unchecked"])
    ruled = (f", {cert['ruled_out']} ruled out by sets under the top-{cert['top_k']}'s bar "
             + (f"(each ≤ {cert['bound']:.4g} alone)" if cert["bound"] > 0 else
                "(none of them hurts alone)") if cert["ruled_out"] else "")
    rest = (f", {unchecked} not checked (report.md: what would check them)" if unchecked
            else f"; every {unit} checked")
    return f"  checked: {cert['measured_alone']} measured alone{ruled}{rest}"


def _sparsity_words(run: LocateRun) -> str:
    if run.spec.sparsity != "auto" or run.pilot is None:
        return f"{run.spec.sparsity}"
    pilot = run.pilot
    return (f"auto: {pilot['sparsity']:g}, the largest whose pilot masks kept ≥ "
            f"{pilot['keep_at_least']:.0%} of the score's distance to a mask of half the "
            "heads (" + "; ".join(f"p={level}: " + ", ".join(
                f"{share:.0%}" for share in shares.values())
                for level, shares in pilot["kept"].items()) + ")")


def _masks_words(run: LocateRun) -> str:
    if run.spec.masks != "auto":
        return f"{run.spec.masks} masks"
    return (f"{run.masks_used} masks (--masks auto: measured until every top-k "
            f"head was stable, at most {run.spec.max_masks})")


def write_results(folder: RunFolder, run: LocateRun) -> None:
    """The run's ranking files and report (``write_ranking``), from ``run`` alone."""
    sparsity = run.spec.sparsity if run.pilot is None else run.pilot["sparsity"]
    write_ranking(folder, run.rankings, run.spec.top_k,
                  title=f"{run.spec.design} design, {_masks_words(run)}, p={sparsity}"
                        .replace(" (", "\n("),
                  report=lambda: locate_report(run))


def prior_method(spec: RunSpec, measure: Any) -> str | None:
    """The attribution prior the run computes (a ``PRIOR_POINTS`` key), or None: ``auto``
    is ``atp-path`` where the measurement can (``HarnessMeasurement.attributable``)."""
    if spec.prior == "auto":
        return "atp-path" if measure.attributable else None
    return None if spec.prior == "none" else spec.prior


@timing.timed("prior")
def attribution_prior(folder: RunFolder, measure: Any, method: str,
                      kinds: Sequence[str] = ("heads",)) -> dict[str, dict[str, np.ndarray]]:
    """The run's attribution prior, task -> kind -> ``(points, units)``: prior.json when
    a resumed run made it, else computed for each of ``kinds`` ("heads", "neurons";
    ``HarnessMeasurement.attribution`` at ``method``'s path points) and written there
    with its cost. A ranking is written for heads (a neuron's is its index order)."""
    if folder.file("prior.json").is_file():
        return stored_priors(folder)
    points = PRIOR_POINTS[method]
    start = time.perf_counter()
    effects = {kind: measure.attribution(points, kind=kind) for kind in kinds}
    seconds = time.perf_counter() - start
    knockout = measure.lm.knockout
    per_layer, with_heads = knockout.heads_per_layer, set(knockout.layers_with_heads)

    def ranking(values: np.ndarray) -> list[str]:
        # Flat order over every layer: a hybrid model's layers without heads hold zeros.
        heads = (Head.from_flat_index(int(i), per_layer)
                 for i in np.argsort(values, kind="stable"))
        return [str(head) for head in heads if head.layer in with_heads]

    tasks = next(iter(effects.values()))
    folder.write_json("prior.json", {
        "method": f"{method}: attribution patching (AtP) of the logprob signal, the "
                  "estimated change of each task's mean gold log-likelihood when a "
                  f"component ({', '.join(kinds)}) is knocked out, with the gradient taken "
                  "at each path point (0: the clean run; a: every component of the kind "
                  "moved a of the way to its ablated value; a list: the points' average); "
                  "neuron_effects in flat neuron order (layer x MLP width + neuron)",
        "prior": method, "seconds": round(seconds, 3), "kinds": list(kinds),
        "tasks": {task: {"points": [
            {"at": at, **{PRIOR_KEYS[kind]: [float(v) for v in effects[kind][task][i]]
                          for kind in kinds},
             **({"ranking": ranking(effects["heads"][task][i])} if "heads" in kinds else {})}
            for i, at in enumerate(points)]} for task in tasks}})
    return {task: {kind: np.atleast_2d(effects[kind][task]) for kind in kinds}
            for task in tasks}


#: --masks auto: masks in the first round, and each round's growth (a share of the masks
#: measured so far, at least ROUND_MIN), so a run checks its stability ~log(M) times.
FIRST_ROUND, ROUND_MIN, ROUND_GROWTH = 20, 10, 0.25


def auto_rounds(max_masks: int) -> list[int]:
    """The mask counts after which ``--masks auto`` checks whether to stop."""
    counts = [min(FIRST_ROUND, max_masks)]
    while counts[-1] < max_masks:
        step = max(ROUND_MIN, int(counts[-1] * ROUND_GROWTH))
        counts.append(min(max_masks, counts[-1] + step))
    return counts


def _pilot(folder: RunFolder, measure: Any, spec: RunSpec, setup: Setup, columns: Columns,
           never: Sequence[int]) -> tuple[float, list[str], np.ndarray, dict[str, Any] | None]:
    """(sparsity, pilot row keys, pilot rows, what config.json records of the pilot): with
    ``--sparsity auto`` the pilot is measured and chooses; its masks come first in the
    design and join the fit, its floor mask does not (``LocateRun.unfitted``)."""
    if spec.sparsity != "auto":
        return spec.sparsity, [], np.zeros((0, len(columns)), dtype=bool), None
    keys, levels, pilot = pilot_design(len(columns), spec.masks_seed, never)
    plan = [("baseline", [])] + [(key, columns.knocked_out(row))
                                 for key, row in zip(keys, pilot, strict=True)]
    records = run_plan(folder, measure, plan, desc="pilot", progress=spec.progress,
                       masks_per_pass=spec.masks_per_pass)
    sparsity, kept = choose_sparsity(levels, keys, records, setup.task_names)
    chosen = {"sparsity": sparsity, "kept": kept, "measurements": len(keys),
              "keep_at_least": KEEP}
    return sparsity, keys[:-UNFITTED], pilot[:-UNFITTED], chosen


@timing.on_clock
def locate(out: str | Path, spec: RunSpec | None = None, *, force: bool = False,
           setup: Setup | None = None, measure: Any = None, **options: Any
           ) -> dict[str, HeadRanking]:
    """Compressed-sensing localization; returns each task's ranking.

    ``spec`` or keyword options (``locate("runs/x", tasks=["gsm8k"], masks=200)``) give
    the run; ``setup``/``measure`` let ``sweep`` reuse a prepared run and loaded model.
    The run's record (``LocateRun``) writes config.json once per phase: started,
    measuring, designed, measured (see ``LocateRun``); the ranking files follow from it.
    """
    spec = command_spec("locate", spec, options)
    if setup is None:
        setup = prepare(spec)
        spec = setup.spec
    # else: the caller (sweep) passes a spec derived from setup.spec, already resolved.
    with RunFolder(out) as folder:
        stored = None if force else _stored_run(folder)
        if stored is not None:
            # --masks and --confirm left out: a resumed run keeps what it was made with
            # (one of them only, where it stopped before the budget was split).
            spec = spec.keeping_budget(stored.spec)
        if spec.group_tests is None:  # none, decided now: the first config write says so
            spec = spec.replace(group_tests=0)
        if spec.masks != "auto" and spec.max_masks != DEFAULT_MAX_MASKS:
            # Only --masks auto stops at --max-masks; a fixed count would silently ignore it.
            raise UsageError(f"--max-masks {spec.max_masks}: is for --masks auto; this run "
                             f"measures {spec.masks or 'the default budget of'} masks")
        done = None if force or measure is not None else _finished(stored, folder, spec)
        run = start_run(folder, "locate", spec, force=force,  # phase: started
                        fingerprint=setup.model_fingerprint)
        assert isinstance(run, LocateRun)
        if done is not None:
            log.info("%s: every measurement is on disk; fitting again without the model",
                     out)
            assert isinstance(done.layers, int) and isinstance(done.heads_per_layer, int)
            return _refit_stored(folder, done, spec, _excluded(spec, done))
        if measure is None:
            measure = open_measurement(setup, load_model(setup), folder, spec.num_samples,
                                       run=run)
        else:  # sweep's measurement, shared by its cells: recorded here too
            run.measured_with(setup, measure)
        kinds = spec.components.split("+")
        if "neurons" in kinds:
            run.neurons_per_layer = measure.lm.neurons_per_layer
            run.never_neurons = _never_neurons(setup, run.neurons_per_layer) or None
        run.save(folder, measure)  # phase: measuring
        # The prior comes first: a run with neurons gives columns to the neurons it names.
        method = prior_method(spec, measure)
        if "neurons" in kinds and method is None:
            raise UsageError(f"--components {spec.components}: the attribution prior, which "
                             "names the neurons the masks search, cannot run here ("
                             f"{measure.no_prior_reason()})")
        estimates = attribution_prior(folder, measure, method, kinds) if method else None
        # --masks and --confirm left out of a new run: the default budget's split for the
        # prior it has (confirm.default_split).
        spec = run.spec = spec.budgeted(method)
        run.settings = spec.settings("locate")
        if "heads" in kinds:  # what kind of head each is: the ranking files carry it
            ensure_types(folder, measure, spec.probe_rows)
        if "neurons" in kinds:
            run.candidates = [str(n) for n in _candidates(spec, setup, run, estimates)]
        columns = run.columns
        run.set_prior(None if estimates is None else column_prior(
                          estimates, columns, setup.heads_per_layer, run.neurons_per_layer),
                      method, measure.no_prior_reason() if spec.prior == "auto" and not method
                      else None)
        never = [columns.index(h) for h in setup.never_ablate if _has(columns, h)]
        sparsity, row_keys, rows, run.pilot = _pilot(folder, measure, spec, setup, columns,
                                                     never)
        spent = run.unfitted
        main = spec.design_rows - len(row_keys) - spent
        with timing.phase("design"):
            matrix = np.vstack([rows, design_matrix(spec.design, main, len(columns),
                                                    sparsity, spec.masks_seed, never)])
            run.design, run.row_keys = matrix, [*row_keys, *mask_keys(main)]
            # Through a file object: np.save would add ".npy" to the partial file's name.
            write_atomically(folder.file("design_matrix.npy"),
                             lambda partial: _save_array(partial, matrix))
        run.save(folder, measure)  # phase: designed
        plan = [("baseline", [])] + [(key, columns.knocked_out(row))
                                     for key, row in zip(run.keys(), matrix, strict=True)]
        checks = ([len(rows) + n for n in auto_rounds(main)] if spec.masks == "auto"
                  else [len(matrix)])
        rankings = None
        on_disk = {r["key"] for r in folder.measurements()}
        phase = plan[:checks[-1] + 1]  # one bar for --masks auto's rounds
        with phase_bar("locate", len(phase), sum(key in on_disk for key, _ in phase),
                       spec.progress) as bar:
            for used in checks:
                # Each round measures what is not on disk yet; --masks auto then fits the
                # first `used` rows and stops once every top-k head is stable in the
                # bootstrap: the decision depends only on the seed and the measurements,
                # so a killed run resumes to the same stop.
                run.records = run_plan(folder, measure, plan[:used + 1], desc="locate",
                                       masks_per_pass=spec.masks_per_pass, bar=bar)
                if spec.masks != "auto":
                    break
                rankings = _fit(run, setup.exclude, used, confirmed=False)
                if all(r.settled(spec.top_k) for r in rankings.values()):
                    break
        run.masks_used = used + spent
        if spec.confirm:
            run.confirm = _confirm(folder, measure, spec, setup, columns, matrix[:used],
                                   run.keys(used), run.priors, never)
            if spec.group_tests:
                run.confirm["groups"] = _group_test(folder, measure, spec, setup, columns,
                                                    matrix[:used], run.keys(used),
                                                    run.priors, never, run.confirm)
            run.records = {r["key"]: r for r in folder.measurements()}
            rankings = None  # the masks' fit alone was --masks auto's stopping rule
        run.save(folder, measure)  # phase: measured
        # Fitted once, with its bootstrap, on everything measured (--masks auto without
        # --confirm: its last round's fit is that fit).
        run.rankings = _fit(run, setup.exclude, used) if rankings is None else rankings
        run.save(folder, measure)  # phase: fitted (the timings the report says)
        write_results(folder, run)
    return run.rankings


@timing.timed("fit and bootstrap")
def _fit(run: LocateRun, exclude: Sequence[Component], rows: int, *,
         confirmed: bool = True) -> dict[str, HeadRanking]:
    """``fit_rankings`` of the run's first ``rows`` design rows with its settings, its
    prior and (``confirmed``) its confirmation."""
    spec = run.spec
    assert run.design is not None and isinstance(run.heads_per_layer, int)
    assert isinstance(run.layers, int)
    never = head_list(spec.never_ablate, run.layers, run.heads_per_layer, "--never-ablate",
                      neurons="neurons" in spec.components,
                      neurons_per_layer=run.neurons_per_layer, head_layers=run.head_layers)
    return fit_rankings(run.design[:rows], run.records, run.tasks, run.columns,
                        spec.alpha, exclude, top_k=spec.top_k, bootstrap=spec.bootstrap,
                        seed=spec.masks_seed, priors=run.priors, keys=run.keys(rows),
                        confirmed=run.confirm if confirmed else None,
                        heads_per_layer=run.heads_per_layer, never=never)


def _confirm(folder: RunFolder, measure: Any, spec: RunSpec, setup: Setup, columns: Columns,
             design: np.ndarray, keys: Sequence[str], priors: Mapping[str, np.ndarray] | None,
             never: Sequence[int]) -> dict[str, Any]:
    """Measure ``--confirm`` heads alone in rounds (``confirm.confirmation``): the prior's
    rankings and the screen, refitted after each round with what it measured; returns
    what the run's record keeps of it (``LocateRun.confirm``, ``fit_rankings``'
    ``confirmed``). Heads never knocked out or excluded from the ranking are no
    candidates. Every pick follows from the measurements on disk, so a resumed run makes
    the same picks and measures only what is missing."""
    tasks = setup.task_names
    excluded = [columns.index(h) for h in setup.exclude if _has(columns, h)]
    records = {r["key"]: r for r in folder.measurements()}
    higher = {t: bool(records["baseline"]["higher_is_better"][t]) for t in tasks}
    scores = {t: np.array([records[k]["scores"][t] for k in keys]) for t in tasks}

    def screen_of(task: str) -> Callable[[Changes], list[int]]:
        weights = prior_weights(None if priors is None else priors[task])
        return lambda changes: screen(
            design, scores[task], higher[task], alpha=spec.alpha, penalty_weights=weights,
            fixed={h: c[0] for h, c in changes.items()}, exclude=excluded).order

    def measured(heads: list[int]) -> dict[str, Changes]:
        done = run_plan(folder, measure, [("baseline", [])] + [
            (alone_key(columns[i]), columns.members(i)) for i in heads],
            desc="confirm", masks_per_pass=spec.masks_per_pass, bar=bar)
        return {t: _alone_changes(done, heads, t, columns) for t in tasks}

    def on_disk(heads: list[int]) -> dict[str, Changes]:
        records.update({r["key"]: r for r in folder.measurements()})
        known = [h for h in heads if alone_key(columns[h]) in records]
        return {t: _alone_changes(records, known, t, columns) for t in tasks}

    sources = {t: prior_rankings(None if priors is None else priors[t]) for t in tasks}
    screens = {t: screen_of(t) for t in tasks} if len(design) >= 2 else {}
    skip = sorted({*never, *excluded})
    # One bar for every round (a resumed run's picks are those on disk: the same picks).
    measured_before = sum(key.startswith(alone_key("")) for key in records)
    # The screens' refits between rounds are fits; the rounds' measurements, measurements.
    with phase_bar("confirm", spec.confirm, measured_before, spec.progress) as bar, \
            timing.phase("fit and bootstrap"):
        done = confirmation(sources, screens, measured, spec.confirm, skip=skip)
        # The round a larger --confirm would measure next: the same picks (they do not
        # depend on the budget), one round further, measuring nothing.
        ahead = confirmation(sources, screens, on_disk, spec.confirm + ROUND, skip=skip)

    names = columns.names

    confirmed = {"heads": names(done.heads), "round_size": ROUND,
                 "rounds": [names(r) for r in done.rounds],
                 "picked_by": {t: names(done.picked_by[t]) for t in tasks},
                 "next": {t: names(ahead.picked_by[t][len(done.picked_by[t]):])
                          for t in tasks},
                 "never": sorted(int(h) for h in never)}
    return confirmed


def _group_test(folder: RunFolder, measure: Any, spec: RunSpec, setup: Setup,
                columns: Columns, design: np.ndarray, keys: Sequence[str],
                priors: Mapping[str, np.ndarray] | None, never: Sequence[int],
                confirmed: Mapping[str, Any]) -> dict[str, Any]:
    """Spend ``--group-tests`` measurements on the components not measured alone, knocked
    out together in groups (``group_tests.group_testing``): each task's those its screen
    implicates first, then those the masks covered least, the tasks in turn; returns what
    the record keeps (``confirm["groups"]``). A group is keyed by its members, a
    component it narrows down to is measured as the confirmation's are (``alone_key``),
    so a resumed run looks every earlier set up and makes the same tests."""
    tasks = setup.task_names
    excluded = [columns.index(h) for h in setup.exclude if _has(columns, h)]
    records = {r["key"]: r for r in folder.measurements()}
    baseline = records["baseline"]
    higher = {t: bool(baseline["higher_is_better"][t]) for t in tasks}
    scores = {t: np.array([records[k]["scores"][t] for k in keys]) for t in tasks}
    alone = {t: _measured_alone(confirmed, records, t, columns) for t in tasks}
    skip = {*never, *excluded}

    def harms(record: Mapping[str, Any]) -> dict[str, float]:
        return {t: float(harm(record["scores"][t] - baseline["scores"][t], higher[t]))
                for t in tasks}

    known: dict[tuple[int, ...], dict[str, float]] = {
        tuple(int(h) for h in np.flatnonzero(row)): harms(records[key])
        for row, key in zip(design, keys, strict=True)}
    known.update({(h,): {t: float(harm(alone[t][h][0], higher[t])) for t in tasks}
                  for h in alone[tasks[0]]})
    orders, size = [], MAX_GROUP
    for task in tasks:
        fixed = {h: change for h, (change, _) in alone[task].items()}
        fit = screen(design, scores[task], higher[task], alpha=spec.alpha,
                     penalty_weights=prior_weights(None if priors is None else priors[task]),
                     fixed=fixed, exclude=sorted(skip))
        implicated = [h for h in fit.order if harm(fit.effects[h], higher[task]) > 0]
        orders.append(group_order(fit.order, implicated, design, skip={*skip, *fixed}))
        task_harms = {h: float(harm(c, higher[task])) for h, c in fixed.items()}
        size = min(size, group_size(entry_bar(task_harms, spec.top_k), background_harm(
            design, harm(scores[task] - baseline["scores"][task], higher[task]), task_harms)))
    order = alternated(orders, sum(len(o) for o in orders))

    def key_of(members: tuple[int, ...]) -> str:
        if len(members) == 1:
            return alone_key(columns[members[0]])
        return group_key(columns.names(members))

    def measured(sets: list[tuple[int, ...]]) -> dict[tuple[int, ...], dict[str, float]]:
        done = run_plan(folder, measure, [("baseline", [])] + [
            (key_of(s), [m for i in s for m in columns.members(i)]) for s in sets],
            desc="group tests", masks_per_pass=spec.masks_per_pass, bar=bar)
        return {s: harms(done[key_of(s)]) for s in sets}

    on_disk = sum(key.startswith("group-") for key in records)
    with phase_bar("group tests", spec.group_tests, on_disk, spec.progress) as bar:
        tested = group_testing(order, known, measured, spec.group_tests, size=size,
                               top_k=spec.top_k)
    names = columns.names
    return {"budget": spec.group_tests, "size": tested.size,
            "rounds": [[names(s) for s in batch] for batch in tested.rounds],
            "alone": names(s[0] for s in tested.sets if len(s) == 1)}


def group_sets(confirmed: Mapping[str, Any] | None) -> list[list[str]]:
    """The group tests' sets of two or more components, in the order measured (a run's
    ``confirm["groups"]``; none where it made none)."""
    groups = (confirmed or {}).get("groups") or {}
    return [members for batch in groups.get("rounds", []) for members in batch
            if len(members) > 1]


def _alone_changes(records: Mapping[str, Mapping[str, Any]], heads: Sequence[int], task: str,
                   columns: Columns) -> dict[int, tuple[float, float]]:
    """column -> (score change, logprob change) of each component knocked out alone."""
    return measured_changes(records["baseline"], {
        h: records[alone_key(columns[h])] for h in heads}, task)


def _candidates(spec: RunSpec, setup: Setup, run: LocateRun,
                estimates: Mapping[str, Mapping[str, np.ndarray]] | None) -> list[Neuron]:
    """The neurons a run gives design columns: the prior's likeliest (``--candidates``;
    auto: as many as the model has heads)."""
    assert estimates is not None and run.neurons_per_layer is not None
    count = setup.total_heads if spec.candidates == "auto" else int(spec.candidates)
    never = parse_components(run.never_neurons or [])
    # Checked again: prepare could not where the config does not give the MLP's width.
    check_candidates(count, setup.num_layers * run.neurons_per_layer, len(never))
    return neuron_candidates({t: by_kind["neurons"] for t, by_kind in estimates.items()},
                             run.neurons_per_layer, count, skip=never)


def _never_neurons(setup: Setup, neurons_per_layer: int) -> list[str]:
    """--never-ablate's MLP neurons, no candidate and in no group. Checked, with
    --exclude's, against the loaded MLP's width: ``prepare`` could not where the config
    does not say it."""
    for flag, listed in (("--exclude", setup.exclude), ("--never-ablate", setup.never_ablate)):
        try:
            validate_heads([c for c in listed if isinstance(c, Neuron)], setup.num_layers,
                           setup.heads_per_layer, neurons_per_layer)
        except HeadSpecError as err:
            raise UsageError(f"{flag}: {err}") from None
    return [str(c) for c in setup.never_ablate if isinstance(c, Neuron)]


def _excluded(spec: RunSpec, run: LocateRun) -> list[Component]:
    """--exclude's components in a stored run (MLP neurons where it locates them)."""
    assert isinstance(run.layers, int) and isinstance(run.heads_per_layer, int)
    return head_list(spec.exclude, run.layers, run.heads_per_layer, "--exclude",
                     neurons="neurons" in spec.components,
                     neurons_per_layer=run.neurons_per_layer, head_layers=run.head_layers)


def refit(out: str | Path, **settings: Any) -> dict[str, HeadRanking]:
    """Fit again from the stored measurements, without touching the model.

    ``settings``: the ranking settings to change (``COMMAND_OPTIONS["refit"]``: alpha,
    top_k, exclude, bootstrap, and masks — fewer than measured fits the first ones); one
    left out or None keeps the run's value; ``exclude=""`` excludes nothing.
    """
    refuse_keywords("refit", settings, COMMAND_OPTIONS["refit"])
    with RunFolder(out) as folder:
        run = load_run(folder)
        if not isinstance(run, LocateRun):
            raise RunFolderError(f"{out} holds a '{run.command}' run; refit needs a "
                                 "locate run")
        changes = {name: value for name, value in settings.items() if value is not None}
        if isinstance(changes.get("exclude"), str) and not changes["exclude"].strip():
            changes["exclude"] = None  # '' takes the run's --exclude back: none excluded
        spec = run.spec.replace(**changes).validate()
        layers, per_layer = run.layers, run.heads_per_layer
        if not (isinstance(layers, int) and isinstance(per_layer, int)):
            raise RunFolderError(f"{out} is incomplete (the model was never loaded); rerun "
                                 "the locate command to finish it")
        if spec.confirm and run.confirm is None:
            raise RunFolderError(f"{out} is incomplete (its confirmation never finished); "
                                 "rerun the locate command to finish it")
        columns = run.columns
        if spec.top_k > len(columns):
            raise UsageError(f"--top-k {spec.top_k}: the run ranks only {len(columns)} "
                             "components")
        excluded = _excluded(spec, run)
        if sum(_has(columns, h) for h in excluded) >= len(columns):
            raise UsageError(f"--exclude covers every component the run ranks "
                             f"({len(columns)}); nothing is left to rank")
        folder.lock()
        return _refit_stored(folder, run, spec, excluded)


def _refit_stored(folder: RunFolder, run: LocateRun, spec: RunSpec,
                  excluded: Sequence[Component]) -> dict[str, HeadRanking]:
    """The fit of a stored run's measurements with ``spec``'s ranking settings, its
    files rewritten (``refit``'s work, the folder locked)."""
    out = folder.path
    if run.design is None:  # _finished has read a finished run's data already
        run.read_data(folder)
    assert run.design is not None
    # --masks auto: the masks the run measured before it stopped. Counts are of
    # measurements: the pilot's floor mask (--sparsity auto) is one but not a row.
    spent = run.unfitted
    used = run.masks_measured if spec.masks == "auto" else spec.masks
    if used - spent > len(run.design):
        raise UsageError(f"--masks {used}: {out} has {len(run.design) + spent} masks; "
                         f"rerun locate with --masks {used} to measure the rest")
    if used - spent < 1:
        raise UsageError(f"--masks {used}: the pilot's floor mask is one of them; give at "
                         f"least {spent + 1}")
    rows = used - spent  # the run as if it had stopped after `used` masks
    if spec.masks == "auto" and run.spec.masks != "auto":
        # A fixed-budget run refitted on all it measured is that many masks, not a run
        # that measured until its top-k was stable (which the report would then say).
        spec = spec.replace(masks=used)
    missing = _missing(run, rows)
    if missing:
        raise RunFolderError(f"{out} is incomplete ({len(missing)} measurements missing, "
                             f"e.g. {missing[0]}); rerun the locate command to finish it")
    run.spec, run.settings = spec, spec.settings("locate")
    run.rankings = _fit(run, excluded, rows)
    run.save(folder)  # the one write: the settings the files were fitted with
    write_results(folder, run)
    return run.rankings


def _missing(run: LocateRun, rows: int) -> list[str]:
    """The measurements a fit of the run's first ``rows`` design rows needs that are not
    on disk (``run.read_data`` first)."""
    # --confirm: the heads the run measured alone stay what they were (refit measures
    # nothing); the screen's fit, and so each head's stability, follows the settings.
    alone = [alone_key(name) for name in [
        *run.confirm["heads"], *((run.confirm.get("groups") or {}).get("alone") or [])]
             ] if run.confirm else []
    groups = [group_key(members) for members in group_sets(run.confirm)]
    return [k for k in ["baseline", *run.keys(rows), *alone, *groups] if k not in run.records]


def _stored_run(folder: RunFolder) -> LocateRun | None:
    """The locate run ``folder`` holds, or None (no run, another command's, or one that
    cannot be read: ``start_run`` says what is wrong with it)."""
    if not folder.file("config.json").is_file():
        return None
    try:
        stored = load_run(folder)
    except (RunFolderError, KeyError, TypeError, ValueError):
        return None
    return stored if isinstance(stored, LocateRun) else None


def _finished(stored: LocateRun | None, folder: RunFolder, spec: RunSpec) -> LocateRun | None:
    """``stored``, the run ``folder`` holds, when it measured everything ``spec`` asks for
    (the same measuring settings, its masks and confirmations done, its head types
    written): resuming it then only fits again (``refit``'s settings may differ), so the
    model need not load. None otherwise, or when unsure."""
    if stored is None or stored.masks_used is None or not spec.budget_given:
        return None
    ranking = RunSpec.refittable("locate") - {"masks", "max_masks", "confirm", "group_tests"}
    measuring = {f: v for f, v in spec.as_config().items()
                 if f not in ranking and f not in RunSpec.runtime_fields()}
    if {f: stored.spec.as_config().get(f) for f in measuring} != measuring:
        return None
    if spec.confirm and stored.confirm is None:
        return None
    if (spec.group_tests or 0) != ((stored.confirm or {}).get("groups") or {}).get("budget",
                                                                                    0):
        return None  # its group tests were a different budget: measured (or looked up)
    if ("heads" in spec.components.split("+") and not folder.file("types.json").is_file()):
        return None  # a run made before head types: the model writes them
    if not (isinstance(stored.layers, int) and isinstance(stored.heads_per_layer, int)):
        return None
    try:
        stored.read_data(folder)
    except (OSError, ValueError, RunFolderError):
        return None
    if stored.design is None or _missing(stored, stored.masks_used - stored.unfitted):
        return None  # a measurement lost or cut short: measured again with the model
    return stored


def _save_array(path: Path, array: np.ndarray) -> None:
    with path.open("wb") as file:
        np.save(file, array)
