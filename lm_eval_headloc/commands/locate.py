"""``locate``: which heads a task depends on, by compressed sensing — the task measured
with many random sets of heads knocked out together (masks), a Lasso fitted to the scores
estimating each head's effect, and the likeliest heads then knocked out one at a time
(confirmation). ``refit``: the same fit again from the measurements on disk.

A run's state is one value, its ``LocateRun`` (``runs.record``), written to config.json
once per phase and read back by ``load_run`` alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lm_eval_headloc.common import timing
from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.files import write_atomically
from lm_eval_headloc.intervention.components import (
    Component,
    ComponentSpecError,
    Head,
    Neuron,
    parse_components,
    validate_heads,
)
from lm_eval_headloc.measurement.attribution import PRIOR_POINTS
from lm_eval_headloc.method.columns import (
    Columns,
    neuron_candidates,
)
from lm_eval_headloc.method.confirm import (
    ROUND,
    Changes,
    alternated,
    confirmation,
    prior_rankings,
    prior_weights,
    screen,
)
from lm_eval_headloc.method.designs import design_matrix
from lm_eval_headloc.method.fit import (
    _alone_changes,
    _has,
    _measured_alone,
    alone_key,
    fit_rankings,
    group_sets,
    mask_keys,
)
from lm_eval_headloc.method.group_tests import (
    MAX_GROUP,
    background_harm,
    entry_bar,
    group_key,
    group_order,
    group_size,
    group_testing,
)
from lm_eval_headloc.method.pilot import KEEP, UNFITTED, choose_sparsity, pilot_design
from lm_eval_headloc.method.ranking import Ranking
from lm_eval_headloc.method.recovery import harm
from lm_eval_headloc.report.locate_report import write_results
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.folder_checks import RunFolderError
from lm_eval_headloc.runs.plan import load_model, open_measurement, phase_bar, run_plan
from lm_eval_headloc.runs.record import (
    PRIOR_KEYS,
    LocateRun,
    column_prior,
    load_run,
    start_run,
    stored_prior,
    stored_priors,
)
from lm_eval_headloc.runs.setup import Setup, check_candidates, head_list, prepare
from lm_eval_headloc.runs.spec import (
    COMMAND_OPTIONS,
    DEFAULT_MAX_MASKS,
    RunSpec,
    command_spec,
    refuse_keywords,
)
from lm_eval_headloc.runs.types_file import ensure_types

log = logging.getLogger(__name__)

__all__ = ["locate", "mask_keys", "refit", "stored_prior"]


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
           ) -> dict[str, Ranking]:
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
         confirmed: bool = True) -> dict[str, Ranking]:
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
        except ComponentSpecError as err:
            raise UsageError(f"{flag}: {err}") from None
    return [str(c) for c in setup.never_ablate if isinstance(c, Neuron)]


def _excluded(spec: RunSpec, run: LocateRun) -> list[Component]:
    """--exclude's components in a stored run (MLP neurons where it locates them)."""
    assert isinstance(run.layers, int) and isinstance(run.heads_per_layer, int)
    return head_list(spec.exclude, run.layers, run.heads_per_layer, "--exclude",
                     neurons="neurons" in spec.components,
                     neurons_per_layer=run.neurons_per_layer, head_layers=run.head_layers)


def refit(out: str | Path, **settings: Any) -> dict[str, Ranking]:
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
                  excluded: Sequence[Component]) -> dict[str, Ranking]:
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
