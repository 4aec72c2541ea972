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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lm_eval_headloc.common import timing
from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.files import read_json, write_atomically
from lm_eval_headloc.common.words import counted
from lm_eval_headloc.intervention.components import (
    Component,
    ComponentSpecError,
    Head,
    Neuron,
    parse_components,
    validate_heads,
)
from lm_eval_headloc.measurement.attribution import PRIOR_POINTS
from lm_eval_headloc.measurement.store import MeasurementStore, ReplayStore, SharingStore
from lm_eval_headloc.method.budget import ALL_ALONE_MASKS, PRIOR_ALLOWANCE
from lm_eval_headloc.method.columns import (
    Columns,
    neuron_candidates,
)
from lm_eval_headloc.method.group_tests import (
    group_key,
)
from lm_eval_headloc.method.locate_loop import locate_loop
from lm_eval_headloc.method.rank import (
    alone_key,
    fit_rankings,
    mask_keys,
)
from lm_eval_headloc.method.ranking import Ranking
from lm_eval_headloc.report.locate_report import write_results
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.folder_checks import RunFolderError
from lm_eval_headloc.runs.plan import load_model, open_measurement
from lm_eval_headloc.runs.record import (
    PRIOR_KEYS,
    LocateRun,
    column_prior,
    load_run,
    start_run,
    stored_prior,
    stored_priors,
)
from lm_eval_headloc.runs.setup import (
    Setup,
    check_candidates,
    head_list,
    prepare,
    recorded_components,
)
from lm_eval_headloc.runs.spec import (
    COMMAND_OPTIONS,
    DEFAULT_MAX_MASKS,
    RunSpec,
    command_spec,
    refuse_keywords,
)
from lm_eval_headloc.runs.types_file import ensure_types

if TYPE_CHECKING:
    from lm_eval_headloc.measurement.measure import Measurement

log = logging.getLogger(__name__)

__all__ = ["fits_from_disk", "locate", "mask_keys", "refit", "stored_prior"]


#: Why --prior auto computes none in a run that measures every head alone.
ALL_ALONE_NO_PRIOR = "every head is measured alone, so no ranking has to choose which"


def prior_method(spec: RunSpec, measure: Measurement, all_alone: bool = False
                 ) -> str | None:
    """The attribution prior the run computes (a ``PRIOR_POINTS`` key), or None: ``auto``
    is ``atp-path`` where the measurement can (``HarnessMeasurement.attributable``) and
    the run is not a default run measuring every head alone (``all_alone``: the prior
    would only order them)."""
    if spec.prior == "auto":
        return "atp-path" if measure.attributable and not all_alone else None
    return None if spec.prior == "none" else spec.prior


@timing.timed("prior")
def attribution_prior(folder: RunFolder, measure: Measurement, method: str,
                      kinds: Sequence[str] = ("heads",), shared: SharingStore | None = None
                      ) -> dict[str, dict[str, np.ndarray]]:
    """The run's attribution prior, task -> kind -> ``(points, units)``: prior.json when
    a resumed run made it, else computed for each of ``kinds`` ("heads", "neurons";
    ``HarnessMeasurement.attribution`` at ``method``'s path points) and written there
    with its cost. A ranking is written for heads (a neuron's is its index order).
    ``shared``: a sweep's cell's store, whose sweep has an earlier cell's prior of the
    same method and kinds (a function of the model and examples alone): prior.json is a
    copy of that one, ``same_as`` naming it, rather than computed again."""
    made = (method, tuple(kinds))
    if folder.file("prior.json").is_file():
        if shared is not None:  # a resumed cell's own, shared with the cells after it
            data = read_json(folder.file("prior.json"), RunFolderError)
            shared.wrote_file("prior.json", (data.get("prior"),
                                             tuple(data.get("kinds", ["heads"]))), data)
        return stored_priors(folder)
    if shared is not None and (copy := shared.made_file("prior.json", made)) is not None:
        folder.write_json("prior.json", copy)
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
    if shared is not None:
        shared.wrote_file("prior.json", made, read_json(folder.file("prior.json"),
                                                        RunFolderError))
    return {task: {kind: np.atleast_2d(effects[kind][task]) for kind in kinds}
            for task in tasks}


@timing.on_clock
def locate(out: str | Path, spec: RunSpec | None = None, *, force: bool = False,
           setup: Setup | None = None, measure: Measurement | None = None,
           shared: SharingStore | None = None, **options: Any) -> dict[str, Ranking]:
    """Compressed-sensing localization; returns each task's ranking.

    ``spec`` or keyword options (``locate("runs/x", tasks=["gsm8k"], masks=200)``) give
    the run; ``setup``/``measure`` let ``sweep`` reuse a prepared run and loaded model,
    and ``shared``, its folder's store, what the sweep and its earlier cells made with
    them: a knockout (the prior) one of them made is kept here as a copy (``same_as``
    naming it) rather than made again.
    The run's record (``LocateRun``) writes config.json once per phase: started,
    measuring, designed, measured (see ``LocateRun``); the ranking files follow from it.
    """
    spec = command_spec("locate", spec, options)
    if setup is None:
        setup = prepare(spec)
        spec = setup.spec
    # else: the caller (sweep) passes a spec derived from setup.spec, already resolved.
    with RunFolder(out) as folder:
        stored, spec, all_alone = _resumed(folder, spec, setup, force)
        if not all_alone:
            _check_cap_before_load(spec, setup)
        done = None if force or measure is not None else _finished(stored, folder, spec)
        if stored is not None and stored.candidates is not None:
            # Before config.json takes the new --exclude: a refused rerun left it there.
            _check_ranks_some(stored.columns, setup.exclude, setup.never_ablate, spec.top_k)
        run = start_run(folder, "locate", spec, force=force,  # phase: started
                        fingerprint=setup.model_fingerprint)
        assert isinstance(run, LocateRun)
        # A sweep's cell: what the sweep's other folders made with this measurement is
        # taken from them (copies), and what this one holds and makes is shared with them.
        sharing = None if shared is None else SharingStore(folder, shared)
        store: MeasurementStore = folder if sharing is None else sharing
        if done is not None:
            log.info("%s: every measurement is on disk; fitting again without the model",
                     out)
            return _refit_stored(folder, done, spec, _excluded(spec, done))
        replayed = None if force or measure is not None else _replayed(stored, folder, spec,
                                                                        setup)
        if replayed is not None:
            return replayed
        if measure is None:
            measure = open_measurement(setup, load_model(setup), folder, spec.num_samples,
                                       run=run)
        else:  # sweep's measurement, shared by its cells: recorded here too
            run.measured_with(setup, measure, folder.path)
        kinds = spec.components.split("+")
        if "neurons" in kinds:
            run.neurons_per_layer = measure.lm.neurons_per_layer
            run.never_neurons = _never_neurons(setup, run.neurons_per_layer) or None
        run.save(folder, measure)  # phase: measuring
        # The prior comes first: a run with neurons gives columns to the neurons it names.
        method = prior_method(spec, measure, all_alone)
        if "neurons" in kinds and method is None:
            raise UsageError(f"--components {spec.components}: the attribution prior, which "
                             "names the neurons the masks search, cannot run here ("
                             f"{measure.no_prior_reason()})")
        estimates = (attribution_prior(folder, measure, method, kinds, sharing) if method
                     else None)
        # --masks and --confirm left out of a new run: the default budget's split for the
        # prior it has (budget.default_split).
        spec = run.spec = spec.budgeted(method)
        allowance = PRIOR_ALLOWANCE[method] if method else 0
        spec.check_cap(allowance, alone_at_most=_alone_at_most(spec, setup))
        run.settings = spec.settings("locate")
        if "heads" in kinds:  # what kind of head each is: the ranking files carry it
            ensure_types(folder, measure, spec.probe_rows, sharing)
        if "neurons" in kinds:
            run.candidates = [str(n) for n in _candidates(spec, setup, run, estimates)]
        columns = run.columns
        _check_ranks_some(columns, setup.exclude, setup.never_ablate, spec.top_k)
        run.set_prior(None if estimates is None else column_prior(
                          estimates, columns, setup.heads_per_layer, run.neurons_per_layer),
                      method, (ALL_ALONE_NO_PRIOR if all_alone else measure.no_prior_reason())
                      if spec.prior == "auto" and not method else None)

        def checkpoint(phase: str) -> None:  # designed, then measured
            if phase == "designed":
                assert run.design is not None
                design = run.design
                with timing.phase("design"):
                    # Through a file object: np.save would add ".npy" to the partial name.
                    with folder.writing("design_matrix.npy") as path:
                        write_atomically(path, lambda partial: _save_array(partial, design))
            run.save(folder, measure)

        locate_loop(measure, store, columns, setup.task_names, spec, priors=run.priors,
                    never=setup.never_ablate, exclude=setup.exclude,
                    heads_per_layer=run.heads_per_layer, state=run, checkpoint=checkpoint,
                    allowance=allowance)
        run.save(folder, measure)  # phase: fitted
        # Saved again as report.md is written: its timings then hold the report's own.
        write_results(folder, run, before_report=lambda: run.save(folder))
    return run.rankings


def _resumed(folder: RunFolder, spec: RunSpec, setup: Setup, force: bool = False
             ) -> tuple[LocateRun | None, RunSpec, bool]:
    """The run ``folder`` holds (None: none, or ``force``), ``spec`` as a rerun there
    resumes it, and whether it measures every head alone (a default run on a model of few
    heads)."""
    stored = None if force else _stored_run(folder)
    given = (spec.masks, spec.confirm)
    if stored is not None:
        # --masks and --confirm left out: a resumed run keeps what it was made with
        # (one of them only, where it stopped before the budget was split).
        spec = spec.keeping_budget(stored.spec)
        spec.check_group_tests()  # a --confirm 0 kept from the run: refused as given
    if spec.masks != "auto" and spec.max_masks != DEFAULT_MAX_MASKS:
        # Only --masks auto stops at --max-masks; a fixed count would silently ignore it.
        raise UsageError(f"--max-masks {spec.max_masks}: is for --masks auto; this run "
                         f"measures {spec.masks or 'the default budget of'} masks")
    # A default run on a model of few heads measures every head alone, with no prior
    # under --prior auto (budget.measures_all_alone); a run resumed keeps that plan
    # (every head it now ranks: its --exclude may have changed), and one made with
    # another budget or a prior keeps its own.
    planned = spec.replace(masks=None, confirm=None).measuring_all_alone(
        setup.total_heads, setup.rankable_heads)
    all_alone = (planned.masks is not None
                 and not (stored is not None and stored.prior_used)
                 and ((spec.masks, spec.confirm) in ((None, None),
                                                     (planned.masks, planned.confirm))
                      or (given == (None, None) and stored is not None
                          and _planned_all_alone(stored.spec, setup))))
    return stored, planned if all_alone else spec, all_alone


def _check_cap_before_load(spec: RunSpec, setup: Setup) -> None:
    """A --max-measurements below the run's fixed part, refused before the model loads:
    --prior auto decides its prior once the model has loaded (``prior_method``), between
    the default budget's splits with a prior and without, so a cap below both fails
    either way; the refusal names the smaller."""
    methods = ["atp-path", None] if spec.prior == "auto" else [
        None if spec.prior == "none" else spec.prior]
    alone = _alone_at_most(spec, setup)
    choices = [(spec.budgeted(method), PRIOR_ALLOWANCE[method] if method else 0)
               for method in methods]
    budgeted, allowance = min(choices, key=lambda choice: choice[0].fixed_part(choice[1],
                                                                                alone))
    budgeted.check_cap(allowance, alone_at_most=alone,
                       prior_known=spec.prior != "auto" or allowance > 0)


def _alone_at_most(spec: RunSpec, setup: Setup) -> int | None:
    """The most components a run's confirmation can measure alone, where known before
    the model loads: a heads run's ranked heads (the default --confirm 34 on a model of 8
    heads measures 8). None for a run over neurons (its candidates come from its prior)."""
    return setup.rankable_heads if spec.components == "heads" else None


def fits_from_disk(out: str | Path, spec: RunSpec, setup: Setup) -> bool:
    """Whether ``locate(out, spec, setup=setup)`` would only fit again: the run ``out``
    holds measured everything ``spec`` asks for, so the model need not load (``sweep``
    asks it of each cell before it loads the model its cells share)."""
    folder = RunFolder(out)
    stored, spec, _ = _resumed(folder, spec, setup)
    return _finished(stored, folder, spec) is not None


def _fit(run: LocateRun, exclude: Sequence[Component], rows: int) -> dict[str, Ranking]:
    """``rank.fit_rankings`` of a stored run's first ``rows`` design rows with its
    settings, its prior and its confirmation."""
    spec = run.spec
    assert run.design is not None
    return fit_rankings(run.design[:rows], run.records, run.tasks, run.columns, spec.alpha,
                        exclude, top_k=spec.top_k, bootstrap=spec.bootstrap,
                        seed=spec.masks_seed, priors=run.priors, keys=run.keys(rows),
                        confirmed=run.confirm, never=_never(spec, run),
                        heads_per_layer=run.grid[1])


def _never(spec: RunSpec, run: LocateRun) -> list[Component]:
    """--never-ablate's components in a stored run (MLP neurons where it locates them)."""
    return head_list(spec.never_ablate, *run.grid, "--never-ablate",
                     neurons="neurons" in spec.components,
                     neurons_per_layer=run.neurons_per_layer, head_layers=run.head_layers)


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


def _planned_all_alone(stored: RunSpec, setup: Setup) -> bool:
    """Whether a stored run's plan measures every head it ranks alone after the fewest
    masks (``RunSpec.measuring_all_alone``'s), under the --exclude it was made with."""
    if stored.masks != ALL_ALONE_MASKS or stored.confirm is None:
        return False
    try:
        return stored.confirm == setup.heads_ranked_with(stored.exclude)
    except UsageError:  # its --exclude file is gone: its plan cannot be told
        return False


def _excluded(spec: RunSpec, run: LocateRun) -> list[Component]:
    """--exclude's components in a stored run (MLP neurons where it locates them), refused
    where they leave none of its columns ranked."""
    excluded = head_list(spec.exclude, *run.grid, "--exclude",
                         neurons="neurons" in spec.components,
                         neurons_per_layer=run.neurons_per_layer, head_layers=run.head_layers)
    _check_ranks_some(run.columns, excluded, _never(spec, run), spec.top_k)
    return excluded


def _check_ranks_some(columns: Columns, excluded: Sequence[Component],
                      never: Sequence[Component], top_k: int) -> None:
    """Refuse an --exclude that leaves no column ranked, or fewer than --top-k (a top-5
    of 2 neurons ran, its report speaking of a top-5), as ``prepare`` refuses it for a
    heads run: a neuron run's columns are known only once its prior has named them, and
    refit's --exclude and --top-k are new."""
    held = columns.holding(excluded)
    left_out = {*held, *(columns.index(c) for c in never if c in columns)}
    if len(held) >= len(columns):
        raise UsageError(f"--exclude covers every component the run ranks "
                         f"({len(columns)}); nothing is left to rank")
    if top_k > len(columns) - len(left_out):
        raise UsageError(f"--top-k {top_k}: the run ranks only "
                         f"{len(columns) - len(left_out)} of its {len(columns)} components "
                         "(the rest are in --exclude or --never-ablate)")


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
        spec = spec.replace(exclude=recorded_components(spec.exclude))
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
        # that measured until its top-k was stable (which the report would then say);
        # refit measures nothing, so it cannot do what auto asks: said, not silently read.
        log.warning("--masks auto: %s measured a fixed %d masks, not until its top-k was "
                    "stable, and refit measures nothing; fitted all %d (as without --masks)",
                    out, used, used)
        spec = spec.replace(masks=used)
    missing = _missing(run, rows)
    if missing:
        raise RunFolderError(f"{out} is incomplete ({counted(len(missing), 'measurement')} "
                             "missing, "
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
    confirmed = run.confirm
    alone = [] if confirmed is None else [alone_key(name) for name in confirmed.alone]
    groups = [] if confirmed is None else [group_key(m) for m in confirmed.group_sets]
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


def _measures_alike(stored: LocateRun | None, folder: RunFolder, spec: RunSpec,
                    free: frozenset[str]) -> bool:
    """Whether ``stored``, the finished run ``folder`` holds, was measured as ``spec``
    measures, but for the settings in ``free`` (and those that never change a measurement):
    then each measurement ``spec`` asks for that the folder holds is the one it would
    make. Its data is read (``read_data``); False where it cannot be, or when unsure."""
    if stored is None or stored.masks_used is None or not spec.budget_given:
        return False
    measuring = {f: v for f, v in spec.as_config().items()
                 if f not in free and f not in RunSpec.runtime_fields()}
    if {f: stored.spec.as_config().get(f) for f in measuring} != measuring:
        return False
    if ("heads" in spec.components.split("+") and not folder.file("types.json").is_file()):
        return False  # a run made before head types: the model writes them
    if not stored.has_geometry:
        return False
    try:
        if stored.design is None:
            stored.read_data(folder)
    except (OSError, ValueError, RunFolderError):
        return False
    return stored.design is not None


def _finished(stored: LocateRun | None, folder: RunFolder, spec: RunSpec) -> LocateRun | None:
    """``stored``, the run ``folder`` holds, when it measured everything ``spec`` asks for
    (the same measuring settings and budget, its masks and confirmations done, its head
    types written): resuming it then only fits again (``refit``'s settings may differ), so
    the model need not load. None otherwise, or when unsure."""
    # Another --masks, --max-masks, --confirm or --group-tests: measured, or replayed from
    # disk (_replayed).
    ranking = RunSpec.refittable("locate") - {"masks", "max_masks", "confirm", "group_tests"}
    if not _measures_alike(stored, folder, spec, ranking):
        return None
    assert stored is not None
    if spec.confirm and stored.confirm is None:
        return None
    if (spec.group_tests, spec.max_measurements) != (stored.spec.group_tests,
                                                     stored.spec.max_measurements):
        return None  # its group tests had a different budget: measured (or looked up)
    if spec.confirm and stored.confirm.groups is None and stored.spec.group_tests != 0:
        return None  # killed before its group tests finished
    assert stored.masks_used is not None
    if isinstance(spec.masks, int) and spec.masks > stored.masks_used:
        # config.json's spec is the last session's, written as it started: one stopped
        # before its masks (killed in the model load, or refused) measured fewer.
        return None
    if _missing(stored, stored.masks_used - stored.unfitted):
        return None  # a measurement lost or cut short: measured again with the model
    return stored


class _ModelNeeded(Exception):
    """A measurement a replay asks for is not on disk: the model must make it."""


class _NoModel:
    """A replay's measurement: there is no model, so anything left to measure ends it."""

    def auto_masks_per_pass(self) -> int:
        return 1

    def measure_chunks(self, chunks: Sequence[Sequence[Any]], masks_per_pass: int | None = None,
                       scale: float | None = None) -> Any:
        raise _ModelNeeded(f"{sum(len(chunk) for chunk in chunks)} measurements to make")


def _replayed(stored: LocateRun | None, folder: RunFolder, spec: RunSpec, setup: Setup
              ) -> dict[str, Ranking] | None:
    """The rankings of a rerun of the finished run ``folder`` holds with another budget
    (fewer masks, confirmations or group tests) whose measurements are all on disk, its
    files written: the loop run again on them (``ReplayStore``: each given as the loop
    asks for it, as if measured then), so it decides and fits what a run made with this
    budget from the start would, without the model. What a smaller budget decides is not
    always a part of what the stored run decided (fewer masks change the screen, and so
    the confirmation's picks; fewer confirmations, the group tests' sets; fewer group
    tests are their first ones), so only a replay tells whether anything is missing. None
    where something is (the model measures it), or when unsure."""
    if not _measures_alike(stored, folder, spec, RunSpec.refittable("locate")):
        return None
    assert stored is not None and stored.masks_used is not None
    if spec.masks == "auto":
        # The stored run stopped at its --max-masks: a larger one measures more.
        more = (stored.spec.masks == "auto" and spec.max_masks > stored.spec.max_masks
                and stored.masks_used >= stored.spec.max_masks)
    else:
        # More masks than the stored run used may still be on disk: measured by an earlier
        # run with more, before a rerun with fewer refitted it.
        more = int(spec.masks) > stored.masks_used and any(
            key not in stored.records for key in mask_keys(int(spec.masks)))
    if more:
        return None  # a replay would fit its first rounds for nothing
    method = stored.prior_kind
    allowance = PRIOR_ALLOWANCE[method] if method else 0
    spec.check_cap(allowance, alone_at_most=_alone_at_most(spec, setup))
    never, exclude = _never(spec, stored), _excluded(spec, stored)  # checked, as refit's
    store = ReplayStore(folder.path, stored.records)
    try:
        state = locate_loop(_NoModel(), store, stored.columns, setup.task_names,
                            spec.replace(progress=False), priors=stored.priors, never=never,
                            exclude=exclude, heads_per_layer=stored.grid[1],
                            allowance=allowance)
    except _ModelNeeded:
        return None
    log.info("%s: every measurement this budget needs is on disk; fitted without the model",
             folder.path)
    for record in store.new:  # a twin's copy, as a measured run writes it
        folder.append_measurement(record)
    design = state.design
    assert design is not None
    if stored.design is None or not np.array_equal(design, stored.design):
        with folder.writing("design_matrix.npy") as path:
            write_atomically(path, lambda partial: _save_array(partial, design))
    stored.design, stored.records = design, {r["key"]: r for r in store.measurements()}
    stored.pilot, stored.row_keys = state.pilot, state.row_keys
    stored.masks_used, stored.confirm = state.masks_used, state.confirm
    stored.spec, stored.settings = spec, spec.settings("locate")
    stored.rankings = state.rankings
    stored.save(folder)
    write_results(folder, stored)
    return stored.rankings


def _save_array(path: Path, array: np.ndarray) -> None:
    with path.open("wb") as file:
        np.save(file, array)
