"""``locate`` (compressed sensing, SPEC §2) and ``refit`` (the same fit from disk)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import UsageError
from ..confirm import candidates, confirm_selector, confirmed_order, task_candidates
from ..designs import design_matrix
from ..heads import Head, parse_heads
from ..pilot import KEEP, UNFITTED, choose_sparsity, pilot_design
from ..prior import prior_penalty_weights
from ..recovery import HeadLasso, bootstrap_stability, harm
from .engine import (
    Setup,
    head_list,
    load_model,
    open_measurement,
    prepare,
    record_examples,
    run_plan,
)
from .report import HeadRanking, ranking_table, write_ranking
from .runfolder import RunFolder, RunFolderError
from .spec import RunSpec

__all__ = ["fit_rankings", "locate", "refit"]


def _mask_heads(row: np.ndarray, heads_per_layer: int) -> list[Head]:
    return [Head.from_flat_index(i, heads_per_layer) for i in np.flatnonzero(row)]


def mask_keys(masks: int) -> list[str]:
    return [f"mask-{i:04d}" for i in range(masks)]


def alone_key(head: Head) -> str:
    """The measurement of ``head`` knocked out alone (confirmation)."""
    return f"alone-{head}"


def prior_order(priors: Mapping[str, np.ndarray] | None, task: str) -> np.ndarray | None:
    """The prior's ranking of ``task``'s heads, most harmful (most negative estimated
    change of the logprob) first; None without a prior."""
    return None if priors is None else np.argsort(priors[task], kind="stable")


def own_candidates(prior: Sequence[int] | None, screen_order: Sequence[int], count: int,
                   skip: Sequence[int]) -> list[int]:
    """A task's first ``count`` candidates for confirmation: the prior's (``prior_order``)
    and the screen's likeliest, alternately (``confirm.task_candidates``)."""
    orders = [screen_order] if prior is None else [prior, screen_order]
    return task_candidates(orders, count, skip)


def fit_rankings(design: np.ndarray, records: Mapping[str, Mapping[str, Any]],
                 tasks: Sequence[str], heads_per_layer: int, alpha: float,
                 exclude: Sequence[Head] = (), *, top_k: int = 5,
                 bootstrap: int | None = 200, seed: int = 0,
                 priors: Mapping[str, Any] | None = None,
                 keys: Sequence[str] | None = None,
                 confirmed: Mapping[str, Any] | None = None) -> dict[str, HeadRanking]:
    """One Lasso per task over the stored measurements (rows in design order), with each
    head's stability from ``bootstrap`` refits on resampled measurements (None: none).
    ``priors``: task -> attribution estimates of the logprob signal's change per head
    (prior.json), which ease the penalty of likely heads (``prior_penalty_weights``).
    ``keys``: the measurement of each design row (default ``mask-0000``, ...).
    ``confirmed``: config.json's ``confirm`` (heads measured alone, how many of each
    task's candidates they are, heads never knocked out): those heads rank first, by
    their measured change (``confirm.confirmed_order``), and the bootstrap asks which of
    them a refit of the screen would have confirmed into the top-k."""
    keys = mask_keys(len(design)) if keys is None else list(keys)
    baseline = records["baseline"]
    excluded = sorted({h.flat_index(heads_per_layer) for h in exclude})
    rankings = {}
    for task in tasks:
        y = np.array([records[key]["scores"][task] for key in keys])
        higher = bool(baseline["higher_is_better"][task])
        # Fitted with an intercept, as the reference code does: the intercept absorbs the
        # small average cost of a mask's unimportant heads (pinning it to the baseline
        # recovers planted heads worse in simulation, see tests/test_designs_recovery.py).
        weights = None if priors is None else prior_penalty_weights(
            harm(priors[task], higher_is_better=True))
        estimator = HeadLasso(alpha=alpha, penalty_weights=weights).fit(design, y)
        order = [int(i) for i in estimator.ranking(higher_is_better=higher, exclude=excluded)]
        effects, select, alone = np.array(estimator.coef_, dtype=np.float64), None, {}
        if confirmed is not None:
            alone = _measured_alone(confirmed, records, task, heads_per_layer)
            skip = sorted({*confirmed["never"], *excluded})
            count = confirmed["consumed"][task]
            own = own_candidates(prior_order(priors, task), order, count, skip)
            select = confirm_selector(alone, prior_order(priors, task), count,
                                      set(alone) - set(own), higher, top_k, skip)
            order = confirmed_order(alone, order, higher, excluded)
            for head, (change, _) in alone.items():
                effects[head] = change
        stability = None if bootstrap is None else bootstrap_stability(
            HeadLasso(alpha=alpha, penalty_weights=weights), design, y, top_k,
            higher_is_better=higher, exclude=excluded, resamples=bootstrap, seed=seed,
            select=select)
        if stability is not None and alone:
            # A head measured alone has one measurement, not a spread of Lasso refits.
            stability.low[list(alone)] = stability.high[list(alone)] = np.nan
        rankings[task] = HeadRanking(
            task=task, metric=baseline["metrics"][task], higher_is_better=higher,
            baseline=float(baseline["scores"][task]), effects=effects,
            order=order, heads_per_layer=heads_per_layer,
            extra={"method": "compressed sensing (Lasso)" + (
                       "" if confirmed is None else ", the likeliest heads measured alone"),
                   "r2": float(estimator.r2_),
                   "alpha": alpha, "measurements": int(len(design)),
                   "excluded": [str(Head.from_flat_index(i, heads_per_layer))
                                for i in excluded],
                   **({} if confirmed is None else {"confirmed": [
                       str(Head.from_flat_index(h, heads_per_layer)) for h in alone]}),
                   **({} if priors is None else {"prior_top_k": [
                       str(Head.from_flat_index(int(i), heads_per_layer))
                       for i in prior_order(priors, task)[:top_k]]})},
            stability=stability)
    return rankings


def _measured_alone(confirmed: Mapping[str, Any], records: Mapping[str, Mapping[str, Any]],
                    task: str, heads_per_layer: int) -> dict[int, tuple[float, float]]:
    """head -> (score change, logprob change; 0 where not recorded) knocked out alone."""
    base = records["baseline"]
    changes = {}
    for name in confirmed["heads"]:
        head = parse_heads(name)[0]
        record = records[alone_key(head)]
        changes[head.flat_index(heads_per_layer)] = (
            record["scores"][task] - base["scores"][task],
            record.get("logprob", {}).get(task, 0.0) - base.get("logprob", {}).get(task, 0.0))
    return changes


_SIGNAL_WORDS = {"metric": "each task's metric, as lm-eval reports it",
                 "logprob": "the gold answers' mean log-likelihood (logprob)"}


def locate_report(rankings: Mapping[str, HeadRanking], top_k: int,
                  config: Mapping[str, Any]) -> str:
    spec, settings = config["spec"], config["settings"]
    lines = [
        "# Head localization by compressed sensing", "",
        f"- model: `{spec['model_args']}`",
        f"- signal: {_SIGNAL_WORDS[spec.get('signal', 'metric')]}",
        f"- design: {spec['design']}, {_masks_words(spec, config)}, sparsity "
        f"{_sparsity_words(spec, config)}, seed {spec['seed']}"
        + (f", masks drawn with seed {spec['design_seed']}"
           if spec.get("design_seed") is not None else ""),
        f"- examples per task: {spec['num_samples']} asked, used "
        + ", ".join(f"{t} {n}" for t, n in config.get("examples_used", {}).items())
        + " (the same subset in every measurement)",
        f"- attribution prior: {'atp (prior.json)' if config.get('prior_used') else 'none'}"
        + (f" (--prior {spec.get('prior')})" if spec.get("prior") == "auto" else ""),
        f"- confirmation: {_confirm_words(config)}",
        f"- Lasso alpha: {settings['alpha']}",
        f"- never knocked out: {spec.get('never_ablate') or 'none'}",
        f"- excluded from the ranking: {settings.get('exclude') or 'none'}", "",
    ]
    for task, ranking in rankings.items():
        lines += [
            f"## {task} ({ranking.metric}, {'higher' if ranking.higher_is_better else 'lower'}"
            " is better)", "",
            f"Baseline (nothing knocked out): {ranking.baseline:.4f}. "
            f"Fit R² = {ranking.extra['r2']:.3f} over {ranking.extra['measurements']} "
            "measurements.", "",
            *ranking_table(ranking, top_k, "change on knockout" if "confirmed" in ranking.extra
                           else "estimated change on knockout"), "",
            *([f"The attribution prior's own top-{top_k} (prior.json): "
               + ", ".join(ranking.extra["prior_top_k"]) + ".", ""]
              if "prior_top_k" in ranking.extra else [])]
    lines.append("Check the heads with `headloc-harness verify` (knocks them out for real).")
    return "\n".join(lines) + "\n"


def _confirm_words(config: Mapping[str, Any]) -> str:
    confirmed = config.get("confirm")
    if not confirmed:
        return "none (every head ranked by the Lasso's estimate)"
    return (f"{len(confirmed['heads'])} heads knocked out one at a time, the "
            + ("attribution prior's and " if config.get("prior_used") else "")
            + "the masks' fit's likeliest in turn; they rank first, by their measured "
            "change (their stability: how often a bootstrap refit of the masks would have "
            "confirmed them into the top-k)")


def _sparsity_words(spec: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    if spec["sparsity"] != "auto":
        return f"{spec['sparsity']}"
    pilot = config["pilot"]
    return (f"auto: {pilot['sparsity']:g}, the largest whose pilot masks kept ≥ "
            f"{pilot['keep_at_least']:.0%} of the score's distance to a mask of half the "
            "heads (" + "; ".join(f"p={level}: " + ", ".join(
                f"{share:.0%}" for share in shares.values())
                for level, shares in pilot["kept"].items()) + ")")


def _masks_words(spec: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    if spec["masks"] != "auto":
        return f"{spec['masks']} masks"
    return (f"{config.get('masks_used')} masks (--masks auto: measured until every top-k "
            f"head was stable, at most {spec['max_masks']})")


def _write_results(folder: RunFolder, rankings: Mapping[str, HeadRanking],
                   top_k: int) -> None:
    config = folder.read_config()
    spec = config["spec"]
    write_ranking(folder, rankings, top_k,
                  title=f"{spec['design']} design, {_masks_words(spec, config)}, "
                        f"p={config.get('pilot', {}).get('sparsity', spec['sparsity'])}"
                        .replace(" (", "\n("),
                  report=locate_report(rankings, top_k, config))


def stored_prior(folder: RunFolder) -> dict[str, np.ndarray]:
    """prior.json's per-task attribution estimates (flat head order)."""
    data = json.loads(folder.file("prior.json").read_text())
    return {task: np.asarray(entry["effects"], dtype=np.float64)
            for task, entry in data["tasks"].items()}


def uses_prior(spec: RunSpec, measure: Any) -> bool:
    """Whether the run computes the attribution prior: ``--prior atp``, or ``auto`` where
    the measurement can (``HarnessMeasurement.attributable``)."""
    return spec.prior == "atp" or (spec.prior == "auto" and measure.attributable)


def attribution_prior(folder: RunFolder, measure: Any) -> dict[str, np.ndarray]:
    """The run's attribution prior: prior.json when a resumed run made it, else computed
    (``HarnessMeasurement.attribution``) and written there with its cost."""
    if folder.file("prior.json").is_file():
        return stored_prior(folder)
    start = time.perf_counter()
    effects = measure.attribution()
    seconds = time.perf_counter() - start
    per_layer = measure.lm.knockout.heads_per_layer
    folder.write_json("prior.json", {
        "method": "attribution patching (AtP) of the logprob signal: estimated change of "
                  "each task's mean gold log-likelihood when a head is knocked out",
        "seconds": round(seconds, 3),
        "tasks": {task: {"effects": [float(v) for v in values],
                         "ranking": [str(Head.from_flat_index(int(i), per_layer))
                                     for i in np.argsort(values, kind="stable")]}
                  for task, values in effects.items()}})
    return effects


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


def _pilot(folder: RunFolder, measure: Any, spec: RunSpec, setup: Setup,
           never: Sequence[int]) -> tuple[float, list[str], np.ndarray, int]:
    """(sparsity, pilot row keys, pilot rows, measurements spent outside the rows): with
    ``--sparsity auto`` the pilot is measured and chooses; its masks come first in the
    design and join the fit, its floor mask does not."""
    if spec.sparsity != "auto":
        return spec.sparsity, [], np.zeros((0, setup.total_heads), dtype=bool), 0
    keys, levels, pilot = pilot_design(setup.total_heads, spec.masks_seed, never)
    plan = [("baseline", [])] + [(key, _mask_heads(row, setup.heads_per_layer))
                                 for key, row in zip(keys, pilot, strict=True)]
    records = run_plan(folder, measure, plan, desc="pilot", progress=spec.progress,
                       masks_per_pass=spec.masks_per_pass)
    sparsity, kept = choose_sparsity(levels, keys, records, setup.task_names)
    folder.update_config(pilot={"sparsity": sparsity, "kept": kept,
                                "measurements": len(keys), "keep_at_least": KEEP})
    return sparsity, keys[:-UNFITTED], pilot[:-UNFITTED], UNFITTED


def locate(out: str | Path, spec: RunSpec | None = None, *, force: bool = False,
           setup: Setup | None = None, measure: Any = None, **options: Any
           ) -> dict[str, HeadRanking]:
    """Compressed-sensing localization (SPEC §2); returns each task's ranking.

    ``spec`` or keyword options (``locate("runs/x", tasks=["gsm8k"], masks=200)``) give
    the run; ``setup``/``measure`` let ``sweep`` reuse a prepared run and loaded model.
    """
    spec = (spec or RunSpec()).replace(**options)
    if setup is None:
        setup = prepare(spec)
        spec = setup.spec
    # else: the caller (sweep) passes a spec derived from setup.spec, already resolved.
    with RunFolder(out) as folder:
        folder.start("locate", spec.identity("locate"), spec.settings("locate"),
                     spec.as_config(), force=force, assumed=RunSpec.assumed_for_old_runs())
        per_layer = setup.heads_per_layer
        never = [h.flat_index(per_layer) for h in setup.never_ablate]
        if measure is None:
            measure = open_measurement(setup, load_model(setup), folder, spec.num_samples)
        else:  # sweep's measurement, shared by its cells: record it here too
            record_examples(folder, setup, measure, num_samples=None)
            folder.update_config(ablation=getattr(measure, "ablation_config", None))
        sparsity, row_keys, rows, spent = _pilot(folder, measure, spec, setup, never)
        main = spec.design_rows - len(row_keys) - spent
        matrix = np.vstack([rows, design_matrix(spec.design, main, setup.total_heads,
                                                sparsity, spec.masks_seed, never)])
        row_keys = [*row_keys, *mask_keys(main)]
        np.save(folder.file("design_matrix.npy"), matrix)
        folder.update_config(row_keys=row_keys)
        plan = [("baseline", [])] + [(key, _mask_heads(row, per_layer))
                                     for key, row in zip(row_keys, matrix, strict=True)]
        priors = attribution_prior(folder, measure) if uses_prior(spec, measure) else None
        folder.update_config(prior_used=priors is not None)
        checks = ([len(rows) + n for n in auto_rounds(main)] if spec.masks == "auto"
                  else [len(matrix)])
        for used in checks:
            # Each round measures what is not on disk yet, then fits the first `used`
            # rows: the decision to go on depends only on the seed and the measurements,
            # so a killed run resumes to the same stop.
            records = run_plan(folder, measure, plan[:used + 1], desc="locate",
                               progress=spec.progress, masks_per_pass=spec.masks_per_pass)
            rankings = fit_rankings(matrix[:used], records, setup.task_names, per_layer,
                                    spec.alpha, setup.exclude, top_k=spec.top_k,
                                    bootstrap=spec.bootstrap, seed=spec.masks_seed,
                                    priors=priors, keys=row_keys[:used])
            if not any(r.unstable(spec.top_k) for r in rankings.values()):
                break
        folder.update_config(masks_used=used + spent)
        if spec.confirm:
            confirmed = _confirm(folder, measure, spec, rankings, priors, never,
                                 [h.flat_index(per_layer) for h in setup.exclude])
            records = {r["key"]: r for r in folder.measurements()}
            rankings = fit_rankings(matrix[:used], records, setup.task_names, per_layer,
                                    spec.alpha, setup.exclude, top_k=spec.top_k,
                                    bootstrap=spec.bootstrap, seed=spec.masks_seed,
                                    priors=priors, keys=row_keys[:used], confirmed=confirmed)
        _write_results(folder, rankings, spec.top_k)
    return rankings


def _confirm(folder: RunFolder, measure: Any, spec: RunSpec,
             screen: Mapping[str, HeadRanking], priors: Mapping[str, np.ndarray] | None,
             never: Sequence[int], excluded: Sequence[int]) -> dict[str, Any]:
    """Measure the screen's and the prior's likeliest heads alone (``--confirm``); returns
    what config.json records of it (``fit_rankings``' ``confirmed``). Heads never knocked
    out or excluded from the ranking are no candidates."""
    skip = sorted({*never, *excluded})
    per_task = {task: own_candidates(prior_order(priors, task), ranking.order,
                                     spec.confirm, skip)
                for task, ranking in screen.items()}
    picked, consumed = candidates(per_task, spec.confirm)
    heads = [Head.from_flat_index(h, next(iter(screen.values())).heads_per_layer)
             for h in picked]
    confirmed = {"heads": [str(h) for h in heads], "consumed": consumed,
                 "never": sorted(int(h) for h in never)}
    # Written before measuring: a resumed run that derives other candidates (another
    # --alpha) records those; the measurements already on disk stay.
    folder.update_config(confirm=confirmed)
    run_plan(folder, measure, [("baseline", [])] + [(alone_key(h), [h]) for h in heads],
             desc="confirm", progress=spec.progress, masks_per_pass=spec.masks_per_pass)
    return confirmed


def refit(out: str | Path, **settings: Any) -> dict[str, HeadRanking]:
    """Fit again from the stored measurements, without touching the model.

    ``settings``: the ranking settings to change (``RunSpec.refittable("locate")``:
    alpha, top_k, exclude, bootstrap, and masks — fewer than measured fits the first
    ones); one left out or None keeps the run's value.
    """
    allowed = RunSpec.refittable("locate")
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise TypeError(f"refit() got {', '.join(unknown)}; it can change "
                        f"{', '.join(sorted(allowed))}")
    with RunFolder(out) as folder:
        config = folder.read_config()
        if config["command"] != "locate":
            raise RunFolderError(f"{out} holds a '{config['command']}' run; refit needs a "
                                 "locate run")
        stored = RunSpec.from_config(config)
        changes = {name: value for name, value in settings.items() if value is not None}
        spec = stored.replace(**changes).validate()
        layers, per_layer = config.get("layers"), config.get("heads_per_layer")
        if not (isinstance(layers, int) and isinstance(per_layer, int)):
            raise RunFolderError(f"{out} is incomplete (the model was never loaded); rerun "
                                 "the locate command to finish it")
        if spec.top_k > layers * per_layer:
            raise UsageError(f"--top-k {spec.top_k}: the model has only {layers * per_layer} "
                             "heads")
        excluded = head_list(spec.exclude, layers, per_layer, "--exclude")
        if len(excluded) >= layers * per_layer:
            raise UsageError(f"--exclude covers every head ({layers * per_layer}); nothing "
                             "is left to rank")
        folder.lock()
        matrix = np.load(folder.file("design_matrix.npy"))
        # --masks auto: the masks the run measured before it stopped. Counts are of
        # measurements: the pilot's floor mask (--sparsity auto) is one but not a row.
        spent = UNFITTED if "pilot" in config else 0
        used = config.get("masks_used", len(matrix)) if spec.masks == "auto" else spec.masks
        if used - spent > len(matrix):
            raise UsageError(f"--masks {used}: {out} has {len(matrix) + spent} masks; rerun "
                             f"locate with --masks {used} to measure the rest")
        if used - spent < 1:
            raise UsageError(f"--masks {used}: the pilot's floor mask is one of them; give at "
                             f"least {spent + 1}")
        matrix = matrix[:used - spent]  # the run as if it had stopped after `used` masks
        row_keys = config.get("row_keys", mask_keys(len(matrix)))[:len(matrix)]
        records = {r["key"]: r for r in folder.measurements()}
        # --confirm: the heads the run measured alone stay what they were (refit measures
        # nothing); the screen's fit, and so each head's stability, follows the settings.
        confirmed = config.get("confirm")
        alone = [alone_key(h) for h in parse_heads(confirmed["heads"])] if confirmed else []
        missing = [k for k in ["baseline", *row_keys, *alone] if k not in records]
        if missing:
            raise RunFolderError(f"{out} is incomplete ({len(missing)} measurements missing, "
                                 f"e.g. {missing[0]}); rerun the locate command to finish it")
        tasks = [t.split(":")[0] for t in spec.tasks]
        priors = stored_prior(folder) if config.get("prior_used", spec.prior == "atp") \
            else None
        rankings = fit_rankings(matrix, records, tasks, per_layer, spec.alpha, excluded,
                                top_k=spec.top_k, bootstrap=spec.bootstrap,
                                seed=spec.masks_seed, priors=priors, keys=row_keys,
                                confirmed=confirmed)
        folder.update_config(settings=spec.settings("locate"), spec=spec.as_config())
        _write_results(folder, rankings, spec.top_k)
    return rankings

